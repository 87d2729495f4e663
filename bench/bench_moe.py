"""Mixture-of-experts training on CPU: the same samples packed vs one sample per row.

One tiny Qwen3-MoE-style model (8 experts, top-2, every layer MoE, aux_loss), trained with
``lr 0`` so both runs see the same weights at every step: forward + backward + optimizer step
over

- ``packed``: samples packed by the C++ best-fit packer into rows of ``seq_length`` (THD,
  cu_seqlens, routing segments per sample, pads unrouted);
- ``one per row``: one sample per row, rows of a micro-batch padded to its longest sample.

Prints real tokens/s and the expert load (tokens routed to each expert over the run, summed
over layers): its max/mean, and whether both runs routed exactly the same tokens to the same
experts (they must: pads reach no expert, and a token's experts do not depend on its pack-mates).

    python bench/bench_moe.py [--samples 128] [--seq-length 1024]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_train_throughput import heavy_tailed_lengths, make_samples, packed_rows, padded_rows, run  # noqa: E402
from mindspeed_pack.model import moe  # noqa: E402
from mindspeed_pack.model.gpt import build_gpt_model  # noqa: E402
from mindspeed_pack.packing.segments import build_packed_batch  # noqa: E402
from tests.model_utils import init_single_process, tiny_args  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4, help="rows per micro-batch of the one-sample-per-row run")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    init_single_process()
    model_args = tiny_args(seq_length=args.seq_length, hidden_size=args.hidden_size, ffn_hidden_size=4 * args.hidden_size,
                           num_attention_heads=4, num_query_groups=2, padded_vocab_size=2048, qk_layernorm=True,
                           add_qkv_bias=False, num_experts=args.experts, moe_router_topk=args.topk,
                           moe_ffn_hidden_size=args.hidden_size, moe_aux_loss_coeff=0.01)
    lengths = heavy_tailed_lengths(args.samples, args.seq_length)
    samples = make_samples(lengths, 2048)
    real = int(lengths.sum())
    configs = {"packed": packed_rows(samples, args.seq_length), "one per row": padded_rows(samples, args.batch, segments=True)}
    results = {}
    for name, rows in configs.items():
        torch.manual_seed(0)
        model = build_gpt_model(model_args).train()
        opt = torch.optim.AdamW(model.parameters(), lr=0.0)  # same weights at every step of both runs
        # as the trainer's forward_step: each micro-batch's routing segments reach the routers first
        segments = [build_packed_batch(ids, labels, seg).routing_segments for ids, labels, seg in rows]
        queue = list(segments[:2])
        model.register_forward_pre_hook(lambda m, a: moe.set_routing_segments(m, queue.pop(0)))
        run(model, opt, rows[:2], real)  # warm-up
        for router in moe.routers(model):
            router.reset_statistics()
        queue[:] = segments
        elapsed, tps, _ = run(model, opt, rows, real)
        load = sum(r.step_tokens_per_expert for r in moe.routers(model))
        results[name] = dict(rows=len(rows), computed=sum(r[0].numel() for r in rows), elapsed=elapsed, tps=tps,
                             load=load)

    print(f"\n{len(samples)} samples, {real} real tokens, seq_length={args.seq_length}, hidden={args.hidden_size}, "
          f"{args.experts} experts, top-{args.topk}, 2 MoE layers")
    print(f"{'config':>12} {'rows':>6} {'computed tok':>13} {'pad %':>7} {'seconds':>9} {'real tok/s':>11} "
          f"{'expert load max/mean':>21} {'routed tokens':>14}")
    for name, r in results.items():
        pad = 100 * (1 - real / r["computed"])
        imbalance = float(r["load"].max() / r["load"].mean())
        print(f"{name:>12} {r['rows']:6d} {r['computed']:13d} {pad:7.1f} {r['elapsed']:9.2f} {r['tps']:11.1f} "
              f"{imbalance:21.4f} {int(r['load'].sum()):14d}")
    packed, single = results["packed"], results["one per row"]
    same = torch.equal(packed["load"], single["load"])
    print(f"\nspeed-up packed vs one sample per row: {packed['tps'] / single['tps']:.2f}x; routed tokens = "
          f"{args.topk} x real tokens x layers: {int(packed['load'].sum()) == args.topk * real * 2}; "
          f"same expert load in both runs: {same}")


if __name__ == "__main__":
    main()

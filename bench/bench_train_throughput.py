"""Training throughput on CPU for the same samples: packed vs padded vs packed without isolation.

One run measures all three on one tiny Qwen2-style model (forward + backward + Adam step):

- ``packed``: samples packed by the C++ best-fit packer into rows of ``seq_length``,
  segment-isolated attention (THD, cu_seqlens), positions restarting per sample;
- ``padded``: micro-batches of samples padded to the longest one in the batch (the
  usual unpacked fine-tuning), one causal row per sample;
- ``packed-no-isolation``: the same packs with an all-ones mask (one causal row per pack).

Target (issue 3): packed real-token throughput >= 0.85 x (padded tokens / real tokens) x the
padded run's real-token throughput, i.e. packing recovers >= 85% of the ideal speed-up.
Also reports the packed attention's time against the sum of squared segment lengths and the
share of the step spent building the batch (``get_batch``).

``--against-transformers`` instead trains the same packs with ours (posttrain's model and loss path,
``--cross-entropy-chunk-size`` as posttrain takes it, SFT's masked loss sum from the model; ``--per-token-loss``:
the per-token losses summed outside, as DPO/KTO/GRPO take them) and with a transformers Qwen2 of the same shape in
the padding-free layout (each pack one row, ``position_ids`` restarting per sample, sdpa, the loss over
fp32 logits), alternating passes, best of ``--repeats``; prints real tokens/s and ours / transformers.

    python bench/bench_train_throughput.py [--samples 256] [--seq-length 1024]
    python bench/bench_train_throughput.py --against-transformers --layers 4 --hidden-size 256 \
        --seq-length 2048 --vocab-size 30522        # issue 42's shape
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mindspeed_pack.model.gpt import build_gpt_model  # noqa: E402
from mindspeed_pack.model.packed_attention import segment_causal_attention  # noqa: E402
from mindspeed_pack.packing.binpack import pack_lengths  # noqa: E402
from mindspeed_pack.packing.segments import IGNORE_INDEX, build_packed_batch  # noqa: E402
from mindspeed_pack.training.batches import packed_seq_params  # noqa: E402
from tests.model_utils import init_single_process, tiny_args  # noqa: E402


def heavy_tailed_lengths(n, seq_length, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(mean=np.log(seq_length / 8), sigma=0.8, size=n).astype(np.int64)
    return np.clip(lengths, 16, seq_length)


def make_samples(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, vocab, (int(n),), generator=g)
        labels = ids.clone()
        labels[: int(n) // 3] = IGNORE_INDEX
        out.append((ids, labels))
    return out


def packed_rows(samples, seq_length, isolate=True, plan=None):
    """One row per pack of ``plan`` (default: the packer's over the samples' lengths)."""
    plan = plan or pack_lengths([len(s[0]) for s in samples], seq_length)
    rows = []
    for items in plan.bins():
        ids = torch.zeros(seq_length, dtype=torch.long)
        labels = torch.full((seq_length,), IGNORE_INDEX)
        seg = torch.zeros(seq_length, dtype=torch.long)
        pos = 0
        for k, i in enumerate(items, start=1):
            x, y = samples[i]
            ids[pos:pos + len(x)], labels[pos:pos + len(x)], seg[pos:pos + len(x)] = x, y, k
            pos += len(x)
        rows.append((ids[None], labels[None], seg[None] if isolate else None))
    return rows


def padded_rows(samples, batch, segments=False):
    """Micro-batches of ``batch`` rows, one sample each, padded to the longest; ``segments``: with
    segment ids (1 = the sample, 0 = pad), else one causal row each (pads count as tokens)."""
    rows = []
    for start in range(0, len(samples), batch):
        chunk = samples[start:start + batch]
        width = max(len(x) for x, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        labels = torch.full((len(chunk), width), IGNORE_INDEX)
        seg = torch.zeros(len(chunk), width, dtype=torch.long)
        for r, (x, y) in enumerate(chunk):
            ids[r, :len(x)], labels[r, :len(x)], seg[r, :len(x)] = x, y, 1
        rows.append((ids, labels, seg if segments else None))
    return rows


PER_TOKEN_LOSS = {"value": False}  # --per-token-loss


def run(model, optimizer, rows, real_tokens):
    """Train once over ``rows``; returns (seconds, real tokens/s, batch-building seconds)."""
    batch_time = 0.0
    start = time.perf_counter()
    for ids, labels, seg in rows:
        t0 = time.perf_counter()
        b = build_packed_batch(ids, labels, seg)
        batch_time += time.perf_counter() - t0
        if PER_TOKEN_LOSS["value"]:
            out = model(b.tokens, b.position_ids, None, labels=b.target, packed_seq_params=packed_seq_params(b))
            loss = (out * b.loss_mask).sum() / b.loss_mask.sum().clamp(min=1)
        else:  # SFT's path: the model returns the masked sum (the fused loss forms its gradients in the forward)
            out = model(b.tokens, b.position_ids, None, labels=b.target, packed_seq_params=packed_seq_params(b),
                        loss_weights=b.loss_mask)
            loss = out / b.loss_mask.sum().clamp(min=1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    elapsed = time.perf_counter() - start
    return elapsed, real_tokens / elapsed, batch_time


def attention_scaling(seq_length, heads=8, groups=2, dim=64, repeats=3):
    """Packed attention time for one pack of L tokens split into k equal segments."""
    print(f"\npacked attention alone, L={seq_length}, heads={heads}, dim={dim} (forward+backward)")
    print(f"{'segments':>9} {'sum s_i^2 / L^2':>16} {'ms':>9} {'ms / full-causal ms':>20}")
    base = None
    for k in (1, 2, 4, 8, 16, 32):
        seg = seq_length // k
        cu = torch.arange(0, seq_length + 1, seg, dtype=torch.int32)
        q = torch.randn(seq_length, heads, dim, requires_grad=True)
        kv = torch.randn(seq_length, groups, dim, requires_grad=True)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            segment_causal_attention(q, kv, kv, cu).sum().backward()
            times.append(time.perf_counter() - t0)
        ms = 1000 * min(times)
        base = base or ms
        print(f"{k:9d} {k * seg * seg / seq_length ** 2:16.4f} {ms:9.2f} {ms / base:20.3f}")


def run_transformers(model, optimizer, rows, real_tokens):
    """The transformers padding-free loop over ``rows``: one flattened row per pack, positions per sample."""
    import torch.nn.functional as F

    start = time.perf_counter()
    for ids, labels, seg in rows:
        b = build_packed_batch(ids, labels, seg)
        logits = model(input_ids=b.tokens, position_ids=b.position_ids).logits
        target = torch.where(b.loss_mask > 0, b.target, torch.full_like(b.target, IGNORE_INDEX))
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), target.view(-1), ignore_index=IGNORE_INDEX,
                               reduction="sum") / b.loss_mask.sum().clamp(min=1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    elapsed = time.perf_counter() - start
    return elapsed, real_tokens / elapsed


def against_transformers(args, model_args, rows, real):
    """Ours vs the transformers padding-free loop on ``rows``, alternating passes; best tokens/s of each."""
    import transformers

    from mindspeed_pack.training.run_plan import loss_path

    torch.manual_seed(0)
    ours = build_gpt_model(model_args)
    config = transformers.Qwen2Config(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=model_args.ffn_hidden_size,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=2,
        tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=args.seq_length)
    theirs = transformers.Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa").train()
    sides = {"ours": (ours, run), "transformers": (theirs, run_transformers)}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, (m, _) in sides.items()}
    for name, (m, fn) in sides.items():
        fn(m, optimizers[name], rows[:2], real)  # warm-up
    best = {name: [0.0, 0.0] for name in sides}  # real tokens per wall second, per CPU second of this process
    for _ in range(args.repeats):
        for name, (m, fn) in sides.items():
            cpu = time.process_time()
            wall = fn(m, optimizers[name], rows, real)[0]
            cpu = time.process_time() - cpu
            best[name] = [max(best[name][0], real / wall), max(best[name][1], real / cpu)]
    chunk = loss_path(model_args)
    path = "megatron-core's unfused loss" if chunk == 0 else f"fused loss, chunks of {chunk} tokens"
    path += ", per-token losses summed outside" if args.per_token_loss else ", SFT's masked sum"
    print(f"\n{len(rows)} packs of {args.seq_length}, {real} real tokens; hidden {args.hidden_size}, {args.layers} "
          f"layers, vocabulary {args.vocab_size}; ours: {path}; best of {args.repeats}; {args.threads} thread(s)")
    for name in sides:
        print(f"{name:>14}: {best[name][0]:10.1f} real tokens/s, {best[name][1]:10.1f} per CPU second")
    print(f"ours / transformers padding-free: {best['ours'][0] / best['transformers'][0]:.2f}x (wall), "
          f"{best['ours'][1] / best['transformers'][1]:.2f}x (CPU time; steadier on a shared machine)")
    return best


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=192)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--padded-batch", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--heads", type=int, default=4, help="head dim = hidden / heads (CPU SDPA is slow below 32)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--against-transformers", action="store_true",
                   help="ours vs the transformers padding-free loop on the same packs (see above)")
    p.add_argument("--cross-entropy-chunk-size", type=int, default=None,
                   help="ours: posttrain's flag (default: the loss path chosen by the logits' size)")
    p.add_argument("--repeats", type=int, default=2, help="--against-transformers: alternating passes")
    p.add_argument("--per-token-loss", action="store_true",
                   help="ours: the model returns per-token losses, summed outside (the path of DPO, KTO, GRPO: the "
                        "fused loss recomputes its logits in the backward), instead of SFT's masked sum")
    args = p.parse_args(argv)
    PER_TOKEN_LOSS["value"] = args.per_token_loss
    torch.set_num_threads(args.threads)
    init_single_process()
    model_args = tiny_args(seq_length=args.seq_length, hidden_size=args.hidden_size, ffn_hidden_size=4 * args.hidden_size,
                           num_layers=args.layers, num_attention_heads=args.heads, num_query_groups=2,
                           padded_vocab_size=args.vocab_size, cross_entropy_chunk_size=args.cross_entropy_chunk_size,
                           micro_batch_size=1, context_parallel_size=1, tensor_model_parallel_size=1)
    lengths = heavy_tailed_lengths(args.samples, args.seq_length)
    samples = make_samples(lengths, args.vocab_size)
    real = int(lengths.sum())
    if args.against_transformers:
        return against_transformers(args, model_args, packed_rows(samples, args.seq_length, isolate=True), real)

    configs = {
        "packed": packed_rows(samples, args.seq_length, isolate=True),
        "padded": padded_rows(samples, args.padded_batch),
        "packed-no-isolation": packed_rows(samples, args.seq_length, isolate=False),
    }
    results = {}
    for name, rows in configs.items():
        torch.manual_seed(0)
        model = build_gpt_model(model_args)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        run(model, opt, rows[:2], real)  # warm-up
        computed = sum(r[0].numel() for r in rows)
        elapsed, tps, batch_s = run(model, opt, rows, real)
        results[name] = dict(rows=len(rows), computed=computed, elapsed=elapsed, tps=tps, batch_share=batch_s / elapsed)

    print(f"\n{len(samples)} samples, {real} real tokens, lengths p50={int(np.median(lengths))} "
          f"max={lengths.max()}, seq_length={args.seq_length}, hidden={args.hidden_size}, layers={args.layers}")
    print(f"{'config':>20} {'rows':>6} {'computed tok':>13} {'pad %':>7} {'seconds':>9} {'real tok/s':>11} {'get_batch %':>12}")
    for name, r in results.items():
        pad = 100 * (1 - real / r["computed"])
        print(f"{name:>20} {r['rows']:6d} {r['computed']:13d} {pad:7.1f} {r['elapsed']:9.2f} {r['tps']:11.1f} "
              f"{100 * r['batch_share']:12.2f}")
    padded, packed = results["padded"], results["packed"]
    ideal = padded["computed"] / real
    ratio = packed["tps"] / (ideal * padded["tps"])
    print(f"\nspeed-up packed vs padded: {packed['tps'] / padded['tps']:.2f}x (ideal {ideal:.2f}x from padding); "
          f"packed reaches {ratio:.2f} of ideal (target >= 0.85): {'PASS' if ratio >= 0.85 else 'FAIL'}")
    print(f"get_batch share of the packed step: {100 * packed['batch_share']:.2f}% (target < 2%): "
          f"{'PASS' if packed['batch_share'] < 0.02 else 'FAIL'}")
    attention_scaling(args.seq_length, heads=args.heads, dim=args.hidden_size // args.heads)


if __name__ == "__main__":
    main()

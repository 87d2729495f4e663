"""DPO on packed pairs vs padded pairs, on a heavy-tailed preference set, in one run.

- ``packed``: pairs placed by the preprocessing planner (``data/pairwise.pair_plan``: the
  pair is the unit of packing) into rows of ``seq_length``; chosen and rejected are segments
  of their pack (THD, segment-isolated attention).
- ``padded``: MindSpeed-LLM's layout: a micro-batch of pairs is ``2 x pairs`` rows (chosen,
  rejected), each padded to the micro-batch's longest sequence, one causal row each.

Both train the same pairs with the same model (forward + backward of the DPO loss + Adam)
in global batches of ``--global-pairs`` pairs; printed: padding ratio, rows per step, real
tokens/s and step time of each (best of ``--repeats`` alternating passes), and the speed-up.

Then the stages on the same packed pairs, each through its real ``loss_func`` (``posttrain.py
--stage``'s): ``dpo`` with its reference forward (a frozen copy of the policy, no gradient, before
each micro-batch, as the in-job reference runs), ``simpo`` and ``orpo`` with none; real tokens/s and
their ratio to DPO's.

    python bench/bench_dpo_packing.py [--pairs 128] [--seq-length 1024] [--hidden-size 512]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.bench_train_throughput import packed_rows, padded_rows  # noqa: E402
from mindspeed_pack.data.pairwise import pair_plan  # noqa: E402
from mindspeed_pack.model.gpt import build_gpt_model  # noqa: E402
from mindspeed_pack.packing.segments import IGNORE_INDEX, build_packed_batch, sequence_sums  # noqa: E402
from mindspeed_pack.training.batches import packed_seq_params  # noqa: E402
from mindspeed_pack.training.stages import get_stage, stage_args  # noqa: E402
from mindspeed_pack.training.stages.dpo import preference_losses  # noqa: E402
from mindspeed_pack.training.stages.sequences import pair_segments  # noqa: E402
from mindspeed_pack.training.stages.sequences import sequence_logps  # noqa: E402
from tests.model_utils import init_single_process, tiny_args  # noqa: E402


def heavy_tailed_pairs(n, seq_length, vocab, seed=0):
    """[(chosen ids, chosen labels, rejected ids, rejected labels)]: lognormal prompt and answer lengths."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        p, c, r = (int(x) for x in np.clip(rng.lognormal(np.log(seq_length / 16), 0.9, 3), 4, seq_length))
        if 2 * p + c + r > seq_length:
            continue  # preprocessing drops such a pair (never one-side truncated)
        prompt = rng.integers(3, vocab, p)
        pair = []
        for n_answer in (c, r):
            ids = np.concatenate([prompt, rng.integers(3, vocab, n_answer)])
            labels = ids.copy()
            labels[:p] = IGNORE_INDEX
            pair += [torch.from_numpy(ids), torch.from_numpy(labels)]
        out.append(tuple(pair))
    return out


def packed_step_rows(pairs, seq_length, packs_per_micro_batch=1):
    """Micro-batches of the pairs' packs (segments 2k-1 chosen, 2k rejected), as preprocessing plans them."""
    sequences = [x for pair in pairs for x in (pair[0:2], pair[2:4])]
    plan = pair_plan(np.array([len(i) for i, _ in sequences]), seq_length)
    rows = packed_rows(sequences, seq_length, plan=plan)
    return [tuple(torch.cat(x) for x in zip(*rows[i:i + packs_per_micro_batch]))
            for i in range(0, len(rows), packs_per_micro_batch)]


def padded_micro_batches(pairs, pairs_per_micro_batch):
    """[2b, longest] micro-batches: chosen and rejected rows padded to the batch's longest."""
    return padded_rows([x for pair in pairs for x in (pair[0:2], pair[2:4])], 2 * pairs_per_micro_batch)


def dpo_loss(model, rows, packed: bool):
    ids, labels, seg = rows
    batch = build_packed_batch(ids, labels, seg)
    out = model(batch.tokens, batch.position_ids, None, labels=batch.target, packed_seq_params=packed_seq_params(batch))
    logps = sequence_sums(-out.float().reshape(batch.loss_mask.shape) * batch.loss_mask, batch)
    if packed:
        chosen, rejected = pair_segments(batch)
    else:  # one row per sequence: chosen, rejected, chosen, ...
        chosen, rejected = torch.arange(0, len(logps), 2), torch.arange(1, len(logps), 2)
    pc, pr = logps[chosen], logps[rejected]
    losses = preference_losses(pc, pr, pc.detach() - 1, pr.detach() + 1, 0.1, "sigmoid")
    return losses.sum(), int(batch.loss_mask.numel())


def run(model, optimizer, steps, packed: bool):
    """steps: list of lists of micro-batch rows; returns (seconds, total tokens run)."""
    tokens = 0
    start = time.perf_counter()
    for step in steps:
        for rows in step:
            loss, n = dpo_loss(model, rows, packed)
            loss.backward()
            tokens += n
        optimizer.step()
        optimizer.zero_grad()
    return time.perf_counter() - start, tokens


def _forward(model, batch):
    return model(batch.tokens, batch.position_ids, None, labels=batch.target, packed_seq_params=packed_seq_params(batch))


def stage_step(model, stage, step_rows, reference=None):
    """One optimizer step's forward + backward of ``stage``'s loss over packed micro-batches; DPO's reference
    log-probs from ``reference`` (forward only), the others' step inputs from ``stage.prepare``."""
    batches = [build_packed_batch(*rows) for rows in step_rows]
    if reference is not None:
        with torch.no_grad():
            for batch in batches:
                seq = sequence_logps(batch, _forward(reference, batch))[0]
                chosen, rejected = pair_segments(batch)
                batch.ref_logps = torch.stack([seq[chosen], seq[rejected]], dim=1)
    else:
        stage.prepare(None, batches, None, "train", batches[0].num_tokens)
    pairs = sum(len(pair_segments(b)[0]) for b in batches)
    for batch in batches:
        loss, _, _ = stage.loss_func(batch, _forward(model, batch))
        (loss / pairs).backward()


def compare_stages(model_args, steps, real, repeats):
    """Real tokens/s of each stage on the same packed steps: the stages take turns step by step (a shared
    machine's load hits them alike), each step's best of ``repeats`` timed passes kept."""
    p = stage_args(argparse.ArgumentParser())
    p.add_argument("--stage")
    runs = {}
    for name in ("dpo", "simpo", "orpo"):
        torch.manual_seed(0)
        model = build_gpt_model(model_args)
        reference = None
        if name == "dpo":  # a frozen copy of the starting policy, as --stage dpo builds it
            reference = build_gpt_model(model_args)
            reference.load_state_dict(model.state_dict())
            reference.eval().requires_grad_(False)
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-5), get_stage(p.parse_args(["--stage", name])),
                      reference)
    best = {name: [float("inf")] * len(steps) for name in runs}
    for i in range(repeats + 1):  # the first pass warms up
        for k, step in enumerate(steps):
            for name, (model, optimizer, stage, reference) in runs.items():
                start = time.perf_counter()
                stage_step(model, stage, step, reference)
                optimizer.step()
                optimizer.zero_grad()
                if i:
                    best[name][k] = min(best[name][k], time.perf_counter() - start)
    total = {name: sum(times) for name, times in best.items()}
    print(f"{'stage':8s} {'reference':>9s} {'step (s)':>9s} {'tokens/s':>10s} {'vs dpo':>7s}")
    for name in runs:
        print(f"{name:8s} {'forward' if name == 'dpo' else 'none':>9s} {total[name] / len(steps):9.3f} "
              f"{real / total[name]:10.1f} {total['dpo'] / total[name]:6.2f}x")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=128)
    p.add_argument("--global-pairs", type=int, default=32, help="pairs per optimizer step")
    p.add_argument("--pairs-per-micro-batch", type=int, default=4, help="padded layout: pairs per micro-batch")
    p.add_argument("--packs-per-micro-batch", type=int, default=2, help="packed layout: packs per micro-batch")
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3, help="timed passes per layout and per stage (best kept)")
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    init_single_process()
    model_args = tiny_args(seq_length=args.seq_length, hidden_size=args.hidden_size, ffn_hidden_size=4 * args.hidden_size,
                           padded_vocab_size=1024)
    pairs = heavy_tailed_pairs(args.pairs, args.seq_length, 1000)
    real = sum(len(x[0]) + len(x[2]) for x in pairs)
    steps = range(0, len(pairs), args.global_pairs)
    layouts = {  # packed: one pack per micro-batch, each step's packs planned from its own pairs
        "packed": [packed_step_rows(pairs[s:s + args.global_pairs], args.seq_length, args.packs_per_micro_batch)
                   for s in steps],
        "padded": [padded_micro_batches(pairs[s:s + args.global_pairs], args.pairs_per_micro_batch) for s in steps],
    }
    print(f"{len(pairs)} pairs (heavy-tailed, real tokens {real}), {len(steps)} steps of "
          f"{args.global_pairs} pairs, seq_length {args.seq_length}, hidden {args.hidden_size}")
    print(f"{'layout':8s} {'rows/step':>9s} {'padding':>8s} {'step (s)':>9s} {'tokens/s':>10s}")
    models = {}
    for name in layouts:
        torch.manual_seed(0)
        model = build_gpt_model(model_args)
        models[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-5))
        run(*models[name], layouts[name][:1], name == "packed")  # warm-up
    # layouts alternate, best of --repeats: a shared machine's noise hits both alike
    best = {name: float("inf") for name in layouts}
    for _ in range(args.repeats):
        for name, layout in layouts.items():
            seconds, total = run(*models[name], layout, name == "packed")
            best[name] = min(best[name], seconds)
    results = {}
    for name, layout in layouts.items():
        total = sum(sum(r[0].numel() for r in step) for step in layout)
        rows = sum(sum(r[0].shape[0] for r in step) for step in layout) / len(layout)
        results[name] = real / best[name]
        print(f"{name:8s} {rows:9.1f} {(total - real) / total:8.3f} {best[name] / len(layout):9.3f} {results[name]:10.1f}")
    print(f"packed / padded tokens/s: {results['packed'] / results['padded']:.2f}x")
    print()
    compare_stages(model_args, layouts["packed"], real, args.repeats)


if __name__ == "__main__":
    main()

"""GRPO steps on heavy-tailed rollouts in three layouts, in one run: padded, next-fit packed, ours.

- ``padded``: Open-Reasoner-Zero's padded layout: a micro-batch of ``--rollouts-per-micro-batch``
  rollouts, each its own row of (longest prompt + longest response) of the micro-batch (prompts
  left-padded, responses right-padded: the same tokens run; here the padding sits at the row's end);
- ``next-fit``: Open-Reasoner-Zero's packing: rollouts in order, appended to the current row of
  ``--max-seqlen-per-dp-cp-rank`` tokens until the next one does not fit, then a new row;
- ``ours``: ``--stage grpo``'s plan (:func:`mindspeed_pack.packing.balance.plan_online_packing`:
  best-fit decreasing into rows of the same cap, DP balance by attention cost; one rank here).

Every layout trains the same rollouts with the same model through the stage's own row builder
and loss (``rollout_row``, ``GRPOStage``; forward + backward + Adam), one optimizer step per
``--global-batch-size`` rollouts. Printed: rows per step, padding ratio, step time and real
tokens/s of each (best of ``--repeats`` alternating passes), and ours / padded, ours / next-fit.

    python bench/bench_rollout_packing.py [--rollouts 128] [--max-seqlen-per-dp-cp-rank 2048] [--hidden-size 256]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import types

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mindspeed_pack.data.rollouts import parse_rollout, rollout_row  # noqa: E402
from mindspeed_pack.model.gpt import build_gpt_model  # noqa: E402
from mindspeed_pack.packing.balance import cost_model, plan_online_packing  # noqa: E402
from mindspeed_pack.packing.segments import build_packed_batch  # noqa: E402
from mindspeed_pack.training.stages.grpo import GRPOStage  # noqa: E402
from mindspeed_pack.training.trainer import packed_seq_params  # noqa: E402
from tests.model_utils import init_single_process, tiny_args  # noqa: E402

VOCAB = 1024


def heavy_tailed_rollouts(n: int, capacity: int, seed: int = 0) -> list:
    """Reasoning-RL-like rollouts: short prompts, lognormal responses with a long tail (some near the cap)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = int(np.clip(rng.lognormal(np.log(capacity / 32), 0.5), 8, capacity // 8))
        r = int(np.clip(rng.lognormal(np.log(capacity / 8), 1.0), 4, capacity - p))
        row = {"prompt_ids": rng.integers(3, VOCAB, p).tolist(), "response_ids": rng.integers(3, VOCAB, r).tolist(),
               "old_logprobs": (-rng.random(r) * 3).tolist(), "advantages": [float(rng.normal())] * r}
        out.append(parse_rollout(row, f"rollout {i}", VOCAB))
    return out


def padded_layout(rollouts, per_micro_batch: int) -> list:
    """Micro-batches [b, longest prompt + longest response]: one rollout a row."""
    out = []
    for s in range(0, len(rollouts), per_micro_batch):
        group = rollouts[s:s + per_micro_batch]
        width = max(len(r.prompt_ids) for r in group) + max(len(r.response_ids) for r in group)
        rows = [rollout_row([r], width) for r in group]
        mb = {k: torch.cat([row[k] for row in rows]) for k in ("input_ids", "labels", "segment_ids", "old_logprobs",
                                                                 "advantages")}
        out.append(mb)
    return out


def next_fit_layout(rollouts, capacity: int) -> list:
    rows, current, used = [], [], 0
    for r in rollouts:
        if current and used + len(r) > capacity:
            rows.append(current)
            current, used = [], 0
        current.append(r)
        used += len(r)
    rows.append(current)
    return [rollout_row(row, capacity) for row in rows]


def our_layout(rollouts, capacity: int, model_args) -> list:
    plan, = plan_online_packing(np.array([len(r) for r in rollouts]), 1, capacity, cost_model(model_args))
    return [rollout_row([rollouts[int(i)] for i in row], capacity) for row in plan.rows]


def run(model, optimizer, stage, steps) -> float:
    start = time.perf_counter()
    for step in steps:
        count = sum(int((mb["labels"] != -100).sum()) for mb in step)  # token-mean over the global step
        for mb in step:
            batch = build_packed_batch(mb["input_ids"], mb["labels"], mb["segment_ids"])
            batch, = stage.prepare(None, [batch], [{**mb, "ref_logprobs": None}], "train", 0)
            out = model(batch.tokens, batch.position_ids, None, labels=batch.target,
                        packed_seq_params=packed_seq_params(batch))
            loss, _, _ = stage.loss_func(batch, out)
            (loss / count).backward()
        optimizer.step()
        optimizer.zero_grad()
    return time.perf_counter() - start


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rollouts", type=int, default=128)
    p.add_argument("--global-batch-size", type=int, default=64, help="rollouts per optimizer step")
    p.add_argument("--rollouts-per-micro-batch", type=int, default=4, help="padded layout: rollouts per micro-batch")
    p.add_argument("--max-seqlen-per-dp-cp-rank", type=int, default=2048, help="packed row length (both packings)")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="timed passes per layout (best kept)")
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    init_single_process()
    capacity = args.max_seqlen_per_dp_cp_rank
    model_args = tiny_args(seq_length=capacity, hidden_size=args.hidden_size, ffn_hidden_size=4 * args.hidden_size,
                           padded_vocab_size=VOCAB)
    stage = GRPOStage(types.SimpleNamespace(loss_agg="token-mean", clip_ratio=[0.2, 0.28], kl_coef=0.0,
                                            kl_estimator="k3", seq_length=capacity, entropy_coef=0.0))
    rollouts = heavy_tailed_rollouts(args.rollouts, capacity)
    real = sum(len(r) for r in rollouts)
    starts = range(0, len(rollouts), args.global_batch_size)
    batches = [rollouts[s:s + args.global_batch_size] for s in starts]
    layouts = {
        "padded": [padded_layout(b, args.rollouts_per_micro_batch) for b in batches],
        "next-fit": [next_fit_layout(b, capacity) for b in batches],
        "ours": [our_layout(b, capacity, model_args) for b in batches],
    }
    lengths = np.array([len(r.response_ids) for r in rollouts])
    print(f"{len(rollouts)} rollouts, {real} real tokens; response length median {int(np.median(lengths))}, "
          f"p90 {int(np.percentile(lengths, 90))}, max {lengths.max()}; {len(batches)} steps of "
          f"{args.global_batch_size}; rows of {capacity} tokens; hidden {args.hidden_size}")
    models = {}
    for name in layouts:
        torch.manual_seed(0)
        model = build_gpt_model(model_args)
        models[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-6))
        run(*models[name], stage, layouts[name][:1])  # warm-up
    best = {name: float("inf") for name in layouts}
    for _ in range(args.repeats):  # layouts alternate: a shared machine's noise hits all alike
        for name, layout in layouts.items():
            best[name] = min(best[name], run(*models[name], stage, layout))
    speed = {}
    print(f"{'layout':9s} {'rows/step':>9s} {'padding':>8s} {'step (s)':>9s} {'tokens/s':>10s}")
    for name, layout in layouts.items():
        total = sum(mb["input_ids"].numel() for step in layout for mb in step)
        rows = sum(mb["input_ids"].shape[0] for step in layout for mb in step) / len(layout)
        speed[name] = real / best[name]
        print(f"{name:9s} {rows:9.1f} {(total - real) / total:8.3f} {best[name] / len(layout):9.3f} {speed[name]:10.1f}")
    print(f"ours / padded tokens/s: {speed['ours'] / speed['padded']:.2f}x; "
          f"ours / next-fit: {speed['ours'] / speed['next-fit']:.2f}x")


if __name__ == "__main__":
    main()

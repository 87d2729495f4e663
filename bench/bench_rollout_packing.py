"""RL rollouts in three layouts, on a heavy-tailed rollout set (long responses, as reasoning RL
produces), in one run; the same rollouts, tokens and model for all three:

- ``orz-padded``: Open-Reasoner-Zero's padded layout: a micro-batch of ``--micro-batch-size``
  rollouts, prompts left-padded to the micro-batch's longest prompt, responses right-padded to
  its longest response, one dense causal row per rollout (pads are computed);
- ``orz-nextfit``: ORZ's packing: rollouts in order, next-fit into rows of ``--max-seqlen``
  tokens (a row is closed when the next rollout does not fit), one row per micro-batch,
  samples isolated (THD);
- ``ours``: ``--stage grpo``'s plan: best-fit decreasing over the global batch + DP balance by
  attention cost (:func:`mindspeed_pack.packing.balance.plan_online_packing`), rows capped at
  ``--max-seqlen`` (``--max-seqlen-per-dp-cp-rank``), laid out by :func:`rollout_row`.

Each global batch of ``--global-batch-size`` rollouts is split over ``--dp`` data-parallel
ranks (ORZ: equal counts, in order; ours: the balanced plan). Every micro-batch runs a real
forward + backward of the PPO-clip loss of a small model on CPU; a step takes its slowest
rank's time (ranks run side by side; each micro-batch timed ``--repeats`` times, the fastest
kept), and tokens/s = real tokens / the steps' time. Printed per layout: rows and micro-batches
per step, padding ratio (pad tokens / tokens run), the largest micro-batch (tokens: what sizes
memory), rank imbalance (max / mean of the ranks' time, mean over steps), real tokens/s.

    python bench/bench_rollout_packing.py [--rollouts 128] [--max-seqlen 2048] [--hidden-size 128]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mindspeed_pack.datasets.rollouts import parse_rollout, rollout_row  # noqa: E402
from mindspeed_pack.model.gpt import build_gpt_model  # noqa: E402
from mindspeed_pack.packing.balance import cost_model, plan_online_packing  # noqa: E402
from mindspeed_pack.packing.segments import IGNORE_INDEX, build_packed_batch  # noqa: E402
from mindspeed_pack.training.batches import packed_seq_params  # noqa: E402
from mindspeed_pack.training.stages.grpo import policy_losses  # noqa: E402
from tests.model_utils import init_single_process, tiny_args  # noqa: E402

VOCAB = 1024


def heavy_tailed_rollouts(n, cap, seed=0):
    """Rollouts with prompts of 50-500 tokens and lognormal responses (median cap / 6), a few
    (2%) filling the cap: reasoning RL's long tail. Every rollout fits the cap."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(50, min(500, cap // 2) + 1, n)
    responses = np.clip(rng.lognormal(np.log(cap / 6), 0.8, n).astype(np.int64), 1, cap - prompts)
    near_cap = rng.choice(n, max(1, n // 50), replace=False)
    responses[near_cap] = cap - prompts[near_cap] - rng.integers(0, 8, len(near_cap))
    rows = []
    for p, r in zip(prompts, responses):
        rows.append({"prompt_ids": rng.integers(3, VOCAB, int(p)).tolist(),
                     "response_ids": rng.integers(3, VOCAB, int(r)).tolist(),
                     "advantages": np.full(int(r), rng.normal()).tolist()})
    return [parse_rollout(row, f"rollout {i}", VOCAB) for i, row in enumerate(rows)]


def orz_padded(rollouts, mbs):
    """[b, maxP + maxR] micro-batches: prompts left-padded, responses right-padded; one causal row each."""
    out = []
    for start in range(0, len(rollouts), mbs):
        chunk = rollouts[start:start + mbs]
        width_p = max(len(r.prompt_ids) for r in chunk)
        width = width_p + max(len(r.response_ids) for r in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        labels = torch.full((len(chunk), width), IGNORE_INDEX)
        adv = torch.zeros(len(chunk), width, dtype=torch.float64)
        for k, r in enumerate(chunk):
            p, n = len(r.prompt_ids), len(r.response_ids)
            ids[k, width_p - p:width_p] = torch.from_numpy(r.prompt_ids)
            ids[k, width_p:width_p + n] = torch.from_numpy(r.response_ids)
            labels[k, width_p:width_p + n] = torch.from_numpy(r.response_ids)
            adv[k, width_p - 1:width_p + n - 1] = torch.from_numpy(r.advantages)
        out.append((ids, labels, None, adv))
    return out


def packed(rollouts, groups, cap):
    """One row of ``cap`` tokens per group of rollouts (``rollout_row``: one sample per segment)."""
    out = []
    for group in groups:
        mb = rollout_row([rollouts[i] for i in group], cap)
        out.append((mb["input_ids"], mb["labels"], mb["segment_ids"], mb["advantages"]))
    return out


def next_fit(lengths, cap):
    """ORZ: rows filled in order; a row is closed when the next rollout does not fit."""
    rows, row, used = [], [], 0
    for i, n in enumerate(lengths):
        if row and used + n > cap:
            rows.append(row)
            row, used = [], 0
        row.append(i)
        used += n
    return rows + ([row] if row else [])


def layouts(rollouts, args, cost):
    """{layout: [step: [rank: [micro-batch]]]} over global batches of ``--global-batch-size``."""
    out = {"orz-padded": [], "orz-nextfit": [], "ours": []}
    for start in range(0, len(rollouts), args.global_batch_size):
        batch = rollouts[start:start + args.global_batch_size]
        shares = np.array_split(np.arange(len(batch)), args.dp)  # ORZ: equal counts, in order
        out["orz-padded"].append([orz_padded([batch[i] for i in s], args.micro_batch_size) for s in shares])
        out["orz-nextfit"].append([packed(batch, [s[row] for row in next_fit([len(batch[i]) for i in s],
                                                                               args.max_seqlen)], args.max_seqlen)
                                   for s in shares])
        plan = plan_online_packing(np.array([len(r) for r in batch]), args.dp, args.max_seqlen, cost)
        out["ours"].append([packed(batch, rank.rows, args.max_seqlen) for rank in plan])
    return out


def micro_batch_seconds(model, ids, labels, seg, adv):
    """Forward + backward of the PPO-clip loss (token-mean) of one micro-batch."""
    start = time.perf_counter()
    b = build_packed_batch(ids, labels, seg)
    out = model(b.tokens, b.position_ids, None, labels=b.target, packed_seq_params=packed_seq_params(b))
    logp = -out.float().reshape(b.loss_mask.shape)
    loss, *_ = policy_losses(logp, logp.detach(), adv.reshape(logp.shape).float(), None, 0.2, 0.2, 0.0, "k3")
    ((loss * b.loss_mask).sum() / b.loss_mask.sum().clamp(min=1)).backward()
    model.zero_grad()
    return time.perf_counter() - start


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rollouts", type=int, default=128)
    p.add_argument("--global-batch-size", type=int, default=32, help="rollouts per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=4, help="orz-padded: rollouts per micro-batch")
    p.add_argument("--max-seqlen", type=int, default=2048,
                   help="the cap: longest rollout and tokens of a packed row (--max-seqlen-per-dp-cp-rank)")
    p.add_argument("--dp", type=int, default=2, help="data-parallel ranks the steps are split over")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="timings per micro-batch (the fastest kept)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    init_single_process()
    model_args = tiny_args(seq_length=args.max_seqlen, hidden_size=args.hidden_size, num_attention_heads=4,
                           ffn_hidden_size=4 * args.hidden_size, padded_vocab_size=VOCAB)
    torch.manual_seed(0)
    model = build_gpt_model(model_args)
    rollouts = heavy_tailed_rollouts(args.rollouts, args.max_seqlen, args.seed)
    lengths = np.array([len(r) for r in rollouts])
    real = int(lengths.sum())
    plans = layouts(rollouts, args, cost_model(model_args))
    micro_batch_seconds(model, *plans["ours"][0][0][0])  # warm-up
    print(f"{len(rollouts)} rollouts: prompt + response tokens median {int(np.median(lengths))}, p90 "
          f"{int(np.percentile(lengths, 90))}, max {lengths.max()} (cap {args.max_seqlen}); {real} real tokens; "
          f"steps of {args.global_batch_size} over DP {args.dp}; hidden {args.hidden_size}")
    print(f"{'layout':12s} {'rows/step':>9s} {'mb/step':>7s} {'padding':>8s} {'max mb':>7s} {'imbalance':>9s} "
          f"{'tokens/s':>9s}")
    step_time = {name: 0.0 for name in plans}
    loads = {name: [] for name in plans}
    # layouts take turns step by step, so a shared machine's noise hits them alike
    for step in range(len(plans["ours"])):
        for name, steps in plans.items():
            ranks = [sum(min(micro_batch_seconds(model, *mb) for _ in range(args.repeats)) for mb in rank)
                     for rank in steps[step]]
            step_time[name] += max(ranks)
            loads[name].append(max(ranks) / max(np.mean(ranks), 1e-12))
    results = {}
    for name, steps in plans.items():
        mbs = [mb for step in steps for rank in step for mb in rank]
        total = sum(mb[0].numel() for mb in mbs)
        results[name] = real / step_time[name]
        rows = sum(mb[0].shape[0] for mb in mbs)
        print(f"{name:12s} {rows / len(steps):9.1f} {len(mbs) / len(steps):7.1f} {(total - real) / total:8.3f} "
              f"{max(mb[0].numel() for mb in mbs):7d} {np.mean(loads[name]):9.3f} {results[name]:9.0f}")
    print(f"ours / orz-padded tokens/s: {results['ours'] / results['orz-padded']:.2f}x; "
          f"ours / orz-nextfit: {results['ours'] / results['orz-nextfit']:.2f}x")


if __name__ == "__main__":
    main()

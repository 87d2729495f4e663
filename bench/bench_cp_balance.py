"""Context-parallel load balance of packed samples: zigzag split vs a contiguous split.

Heavy-tailed sample lengths (``heavy_tailed_lengths`` of ``bench_balance.py``: lognormal, median
C/16, sigma 1.2, clipped to C, fixed seed). For every CP size, each sample's length is rounded
up to ``2 x CP`` (what ``--pad-to-multiple-of`` / ``pad_segments`` do) and the rounded lengths are
packed into packs of ``--seq-length`` tokens with ``mindspeed_pack.packing.binpack``. Per-rank
attention work = causal query-key pairs (a query at position ``p`` of its sample sees ``p + 1``
keys), summed over the packs, for

* zigzag: every sample cut into ``2 x CP`` chunks, rank ``r`` keeps chunks ``r`` and
  ``2CP-1-r`` (``attention_pairs`` of ``mindspeed_pack/packing/context_parallel.py``);
* contiguous: rank ``r`` takes tokens ``[r T/CP, (r+1) T/CP)`` of the pack, ``T = --seq-length``
  (the pack's padding tail, which holds no sample, lands on the last ranks), work counted with
  the same per-sample causal rule.

Imbalance = max / mean over the CP ranks (1.0 = perfect): of each rank's work summed over all
packs ("all"); per pack weighted by the pack's work ("per pack" = sum over packs of the busiest
rank's work / sum of the mean rank's: the ranks wait for each other in every pack, so this is
the attention time relative to a perfect split); and the largest single-pack value ("worst").

The first table counts every position of the rounded samples (CP pad tokens too, as
``attention_pairs`` does): zigzag is then exactly balanced. The second counts real queries only
(a CP pad query does no work). A sample's pads are at its end, mostly in chunk ``2CP-1``, which
is always CP rank 0's: rank 0 is slightly light, by the pads' share of the work, which only
shows in packs of many short samples (little work in total).

    python bench/bench_cp_balance.py                      # CP 2/4/8, packs of 32768
    python bench/bench_cp_balance.py --seq-length 4096

``--dynamic`` instead simulates fixed CP (``dp_balanced`` at ``--context-parallel-size C``: every sample split
over C ranks) against dynamic CP (``default_dynamic_cp``: each sample on the smallest power-of-two group that holds
it) on a length mix, both plans as the schedulers make them: per rank linear and attention FLOPs and CP bytes, step
time with and without compute/communication overlap, and the ceilings (bench/cp_dynamic_sim.py). ``--real-cpu``
trains both on 2 CPU ranks and reports real tokens/s (bench/cp_dynamic_cpu.py).

    python bench/bench_cp_balance.py --dynamic             # the issue's long-tail mix: Qwen2.5-7B, C 8, N 8k and 16k
    python bench/bench_cp_balance.py --dynamic --mix verl  # the anchor's setting: Qwen3-30B-A3B, 1k-16k, C 4, N 4k
    python bench/bench_cp_balance.py --real-cpu            # 2 gloo ranks, tiny model, C 2, N 512
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_balance import heavy_tailed_lengths  # noqa: E402  (the same length mix as the DP balance bench)

from cp_dynamic_cpu import compare_real_cpu  # noqa: E402  (--real-cpu)
from cp_dynamic_sim import MIXES, compare_dynamic  # noqa: E402  (--dynamic)

from mindspeed_pack.packing.binpack import pack_lengths  # noqa: E402
from mindspeed_pack.packing.context_parallel import attention_pairs, round_up  # noqa: E402

TARGET = 1.01  # zigzag max/mean per pack


def causal_pairs(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Sum of (p + 1) for p in [lo, hi) (0 where hi <= lo)."""
    hi = np.maximum(hi, lo)
    return (hi * (hi + 1) - lo * (lo + 1)) // 2


def contiguous_pairs(padded: np.ndarray, real: np.ndarray, seq_length: int, cp: int, real_only: bool) -> np.ndarray:
    """Per-rank causal pairs of one pack ([cp], int64) when rank r holds tokens [r T/cp, (r+1) T/cp)."""
    starts = np.cumsum(padded) - padded
    bounds = np.arange(cp + 1, dtype=np.int64) * (seq_length // cp)
    # positions of each sample (rows) that fall in each rank's range (columns), in sample coordinates
    lo = np.clip(bounds[None, :-1] - starts[:, None], 0, padded[:, None])
    hi = np.clip(bounds[None, 1:] - starts[:, None], 0, padded[:, None])
    if real_only:
        lo, hi = np.minimum(lo, real[:, None]), np.minimum(hi, real[:, None])
    return causal_pairs(lo, hi).sum(axis=0)


def zigzag_pairs(padded: np.ndarray, real: np.ndarray, cp: int, real_only: bool) -> np.ndarray:
    """Per-rank causal pairs of one pack ([cp], int64) under the zigzag split, in closed form.

    Rank r holds positions [k c, (k+1) c) of every sample for k = r and 2cp-1-r (c = padded / 2cp).
    With ``real_only=False`` this equals ``attention_pairs`` (checked on every pack).
    """
    c = (padded // (2 * cp))[:, None]
    limit = (real if real_only else padded)[:, None]
    r = np.arange(cp, dtype=np.int64)[None, :]
    work = 0
    for k in (r, 2 * cp - 1 - r):
        work = work + causal_pairs(np.minimum(k * c, limit), np.minimum((k + 1) * c, limit))
    return work.sum(axis=0)


def imbalance(work: np.ndarray) -> np.ndarray:
    """max / mean over the last axis (ranks)."""
    work = np.asarray(work, dtype=np.float64)
    return work.max(axis=-1) / work.mean(axis=-1)


def stats(work: np.ndarray) -> tuple:
    """(all, per pack, worst) imbalance of per-pack, per-rank work [packs, cp]."""
    work = np.asarray(work, dtype=np.float64)
    return (imbalance(work.sum(0)), work.max(1).sum() / work.mean(1).sum(), imbalance(work).max())


def run(lengths: np.ndarray, seq_length: int, cp: int) -> dict:
    multiple = 2 * cp
    padded_all = round_up(lengths, multiple)
    plan = pack_lengths(padded_all, seq_length)
    zz, zz_real, cont, cont_real = [], [], [], []
    bins = plan.bins()
    for items in bins:
        padded, real = padded_all[items], lengths[items]
        cu = torch.from_numpy(np.concatenate([[0], np.cumsum(padded)]))  # the samples only, not the pack's tail
        zz.append(attention_pairs(cu, cp).numpy())
        if not (zz[-1] == zigzag_pairs(padded, real, cp, real_only=False)).all():
            raise AssertionError(f"closed form != attention_pairs: {zz[-1]}")
        zz_real.append(zigzag_pairs(padded, real, cp, real_only=True))
        cont.append(contiguous_pairs(padded, real, seq_length, cp, real_only=False))
        cont_real.append(contiguous_pairs(padded, real, seq_length, cp, real_only=True))
    zz, zz_real, cont, cont_real = (np.stack(x) for x in (zz, zz_real, cont, cont_real))
    # both splits hand out the same (query, key) pairs of every pack, only to different ranks
    assert (zz.sum(1) == cont.sum(1)).all() and (zz_real.sum(1) == cont_real.sum(1)).all()
    return dict(packs=plan.num_bins, pad=(padded_all.sum() - lengths.sum()) / lengths.sum(),
                counts=np.array([len(items) for items in bins]),
                zz=zz, zz_real=zz_real, cont=cont, cont_real=cont_real)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dynamic", action="store_true", help="fixed vs dynamic CP, simulated (bench/cp_dynamic_sim.py)")
    p.add_argument("--mix", choices=sorted(MIXES), default="long-tail",
                   help="--dynamic: length mix and its model, C, N, DP and samples a step (bench/cp_dynamic_sim.py)")
    p.add_argument("--max-cp", type=int, help="--dynamic: C, the (largest) CP group (default: the mix's)")
    p.add_argument("--per-rank", type=int, nargs="+", help="--dynamic: N values (default: the mix's)")
    p.add_argument("--dp", type=int, help="--dynamic: data-parallel size, ranks = DP x C (default: the mix's)")
    p.add_argument("--gbs", type=int, help="--dynamic: samples per step (default: the mix's)")
    p.add_argument("--steps", type=int, default=10, help="--dynamic: steps")
    p.add_argument("--long-share", type=float, default=0.1, help="--dynamic --mix long-tail: share of 16k-128k samples")
    p.add_argument("--cp-comm", choices=["p2p", "all_gather"], default="p2p",
                   help="--dynamic: CP communication (p2p: Megatron's default ring, 3 KV-sized passes per layer; "
                        "all_gather: 2)")
    p.add_argument("--hardware", nargs="+", default=["nvlink:400:150:20", "ib:400:25:30", "slow:400:5:30"],
                   help="--dynamic: name:TFLOP/s:GB/s per rank:us per ring step (effective figures)")
    p.add_argument("--real-cpu", action="store_true",
                   help="fixed vs dynamic CP trained on 2 CPU ranks, real tokens/s (bench/cp_dynamic_cpu.py)")
    p.add_argument("--cpu-per-rank", type=int, default=512, help="--real-cpu: N (C = 2)")
    p.add_argument("--cpu-gbs", type=int, default=128, help="--real-cpu: samples per step")
    p.add_argument("--cpu-steps", type=int, default=8,
                   help="--real-cpu: steps per run, each the same batch (the first a warm-up)")
    p.add_argument("--cpu-rounds", type=int, default=3, help="--real-cpu: fixed/dynamic run pairs (order alternates)")
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--seq-length", type=int, default=32768, help="pack capacity (try 4096 too)")
    p.add_argument("--samples", type=int, default=8000)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.dynamic:
        compare_dynamic(a)
        return
    if a.real_cpu:
        compare_real_cpu(a)
        return
    torch.set_num_threads(1)  # one small tensor op per pack: threads only add overhead
    C = a.seq_length
    for cp in a.cp:
        if C % (2 * cp):
            p.error(f"--seq-length {C} must be a multiple of 2 x CP ({2 * cp})")
    lengths = heavy_tailed_lengths(a.samples, C, a.seed)
    base = pack_lengths(lengths, C)
    print(f"{len(lengths)} samples, mean {lengths.mean():.0f}, median {np.median(lengths):.0f}, max {lengths.max()} "
          f"tokens; packs of {C}; without CP rounding: {base.num_bins} packs, fill {base.fill_rate(lengths):.4f}")
    print("imbalance = max / mean causal query-key pairs over the CP ranks; 'all' = each rank's work summed over "
          "every pack, 'per pack' = sum of per-pack max / sum of per-pack mean, 'worst' = the worst single pack")

    results = {}
    for cp in a.cp:
        t = time.perf_counter()
        results[cp] = run(lengths, C, cp)
        results[cp]["seconds"] = time.perf_counter() - t

    def table(title: str, zz_key: str, cont_key: str) -> None:
        print(f"\n{title}")
        print(f"{'':>26} | {'zigzag':^24} | {'contiguous':^24} | {'contiguous / zigzag':^26} |")
        print(f"{'CP':>3} {'packs':>6} {'+packs':>6} {'CP pad %':>8} | {'all':>7} {'per pack':>8} {'worst':>7} | "
              f"{'all':>7} {'per pack':>8} {'worst':>7} | {'all':>7} {'per pack':>8} {'worst':>8} | {'s':>5}")
        for cp, r in results.items():
            z = stats(r[zz_key])
            c = stats(r[cont_key])
            print(f"{cp:>3} {r['packs']:>6} {r['packs'] - base.num_bins:>+6} {100 * r['pad']:>8.3f} | "
                  f"{z[0]:>7.4f} {z[1]:>8.4f} {z[2]:>7.4f} | {c[0]:>7.4f} {c[1]:>8.4f} {c[2]:>7.4f} | "
                  f"{c[0] / z[0]:>6.2f}x {c[1] / z[1]:>7.2f}x {c[2] / z[2]:>7.2f}x | {r['seconds']:>5.1f}")

    table("all positions of the rounded samples (CP pads included; attention_pairs):", "zz", "cont")
    table("real queries only (a CP pad query does no work):", "zz_real", "cont_real")
    print("    (+packs: packs added by the 2 x CP rounding; CP pad %: rounding tokens / real tokens)")

    print(f"\ntarget: zigzag max/mean <= {TARGET} on every pack")
    for cp, r in results.items():
        worst = imbalance(r["zz"]).max()
        per_pack = imbalance(r["zz_real"])
        i = int(per_pack.argmax())
        work = r["zz_real"].sum(1)
        print(f"  CP {cp}: all positions: worst pack {worst:.4f} ({'met' if worst <= TARGET else 'MISSED'}); "
              f"real queries only: worst pack {per_pack[i]:.4f} ({'met' if per_pack[i] <= TARGET else 'MISSED'}; "
              f"that pack holds {r['counts'][i]} samples, {work[i] / work.mean():.3f}x the mean pack's work), "
              f"packs above {TARGET}: {(per_pack > TARGET).mean():.1%}")


if __name__ == "__main__":
    main()

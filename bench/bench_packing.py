"""Packing benchmark: C++ best-fit decreasing (plain and refined) vs the Python greedy-knapsack baseline.

Lengths are heavy-tailed (lognormal with a long right tail, clipped to [1, seq_length], fixed
seed), or with ``--dist uniform20-80`` uniform in [20, 80] (no short items: plain BFD leaves
unfillable gaps there, which the default refined packer closes). The baseline re-implements the greedy knapsack used by MindSpeed-LLM / LLaMA-Factory:
lengths sorted ascending; each pack (capacity seq_length - 1) is filled by repeatedly taking
the largest remaining length that still fits (bisect + list.pop) until nothing fits.
Samples of exactly seq_length tokens are cut to seq_length - 1 for the baseline.

    python bench/bench_packing.py                 # full run (baseline up to 1M lengths)
    python bench/bench_packing.py --quick         # a few seconds
    python bench/bench_packing.py --sizes 100000 1000000 --seq-lengths 4096
    python bench/bench_packing.py --dist uniform20-80 --seq-lengths 1024
"""
from __future__ import annotations

import argparse
import bisect
import time

import numpy as np

from mindspeed_pack.packing.binpack import ALGORITHMS, lower_bound, pack_lengths


def heavy_tailed_lengths(n: int, seq_length: int, seed: int = 0) -> np.ndarray:
    """Lognormal lengths (median seq_length/16, sigma 1.2: a long tail up to seq_length)."""
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(mean=np.log(seq_length / 16), sigma=1.2, size=n)
    return np.clip(np.rint(raw), 1, seq_length).astype(np.int64)


def uniform_lengths(n: int, seq_length: int, seed: int = 0) -> np.ndarray:
    """Lengths uniform in [20, 80] (capped at seq_length): many items per pack, none short."""
    rng = np.random.default_rng(seed)
    return np.minimum(rng.integers(20, 81, size=n), seq_length).astype(np.int64)


DISTRIBUTIONS = {"heavy-tailed": heavy_tailed_lengths, "uniform20-80": uniform_lengths}


def greedy_knapsack_baseline(lengths: list[int], capacity: int) -> list[list[int]]:
    """Packs of lengths, filled one at a time with the largest remaining length that fits."""
    remaining = sorted(lengths)
    packs = []
    while remaining:
        pack, room = [], capacity
        while True:
            fit = bisect.bisect_right(remaining, room)  # remaining[fit - 1] is the largest <= room
            if fit == 0:
                if not pack:
                    raise ValueError(f"length {remaining[0]} exceeds the pack capacity {capacity}")
                break
            length = remaining.pop(fit - 1)
            pack.append(length)
            room -= length
        packs.append(pack)
    return packs


def run(sizes, seq_lengths, baseline_max_n, repeats, dist="heavy-tailed"):
    header = f"{'n':>10} {'seq_len':>7} {'algorithm':<28} {'packs':>9} {'lower_bd':>9} {'packs/lb':>10} " \
             f"{'fill':>8} {'seconds':>8} {'speed-up':>8}"
    print(f"lengths: {dist}")
    print(header)
    print("-" * len(header))
    for seq_length in seq_lengths:
        for n in sizes:
            lengths = DISTRIBUTIONS[dist](n, seq_length)
            bound = lower_bound(lengths, seq_length)
            rows = []
            for algorithm in ALGORITHMS:
                seconds = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    plan = pack_lengths(lengths, seq_length, algorithm=algorithm)
                    seconds.append(time.perf_counter() - start)
                rows.append((algorithm, plan.num_bins, plan.fill_rate(lengths), min(seconds)))
            if n <= baseline_max_n:
                # Its capacity is seq_length - 1: a full-length sample is truncated by one token
                # (as --neat-pack truncates over-long samples) instead of looping forever.
                as_list = np.minimum(lengths, seq_length - 1).tolist()
                start = time.perf_counter()
                packs = greedy_knapsack_baseline(as_list, seq_length - 1)
                base_seconds = time.perf_counter() - start
                assert sum(len(p) for p in packs) == n
                rows.append(("greedy_knapsack (py)", len(packs), sum(as_list) / (len(packs) * seq_length), base_seconds))
            for name, packs, fill, secs in rows:
                has_baseline = rows[-1][0].startswith("greedy_knapsack")
                speedup = f"{rows[-1][3] / secs:8.1f}" if has_baseline else f"{'-':>8}"
                print(f"{n:>10} {seq_length:>7} {name:<28} {packs:>9} {bound:>9} {packs / bound:>10.6f} "
                      f"{fill:>8.5f} {secs:>8.3f} {speedup}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000, 10_000_000])
    parser.add_argument("--seq-lengths", type=int, nargs="+", default=[1024, 4096, 32768])
    parser.add_argument("--baseline-max-n", type=int, default=1_000_000,
                        help="run the Python baseline only up to this many lengths (it is slow)")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many C++ runs")
    parser.add_argument("--dist", choices=sorted(DISTRIBUTIONS), default="heavy-tailed", help="length distribution")
    parser.add_argument("--quick", action="store_true", help="small sizes, one seq_length: a few seconds")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.seq_lengths, args.baseline_max_n, args.repeats = [10_000, 100_000], [4096], 100_000, 1
    run(args.sizes, args.seq_lengths, args.baseline_max_n, args.repeats, args.dist)


if __name__ == "__main__":
    main()

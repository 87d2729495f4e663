"""Fixed vs dynamic context parallelism, simulated: ``bench_cp_balance.py --dynamic``.

Both plans are made by the schedulers themselves on the same samples: fixed CP is ``dp_balanced`` at CP C (every
sample padded to ``2C`` and split over C ranks, rows of ``C x N`` tokens per DP rank), dynamic CP is
``default_dynamic_cp`` (:func:`mindspeed_pack.packing.dynamic_cp.plan_dynamic_cp`: each sample on the smallest
power-of-two group ``g`` whose ``g x N`` tokens hold it). Per rank and micro-batch, as training runs it:

* linear FLOPs of all N tokens (pads and empty rows run through the layers too), x3 for forward + backward;
* attention FLOPs of the real samples / ``g`` (zigzag: every rank of a group gets the same share), x3;
* CP bytes: every micro-batch on a group of ``g`` ranks moves ``(g-1) x N`` tokens' keys and values per layer
  and pass, whatever the row holds (a row of short samples pays as much as one long sample). Passes:
  ``--cp-comm p2p`` (Megatron's default ``--cp-comm-type``, Transformer Engine's ring): 3 = the forward ring
  sends KV, the backward ring sends KV and dKV together (TE's backward p2p buffers hold both);
  ``all_gather`` (this project's local/flash attention): 2 = KV all-gather forward, dKV reduce-scatter backward;
* ring latency: ``2 (g-1)`` steps per layer.

Step time = the slowest rank's sum over its micro-batches at stated effective hardware numbers, without overlap,
and with overlap (``(overlap)`` columns): the ring exchanges the next step's KV while computing the current
step's attention, so a micro-batch's exposed communication is ``max(0, comm - attention)``; the linear layers do
not overlap it. Not modeled (the same for both, or unknown): DP gradient all-reduce, MoE all-to-all, kernel
efficiency of small chunks, memory.

Per N, what fixed CP spends on the short samples (<= N): its step (mean rank) / the same step with their CP
communication, ring latency and zigzag padding removed (their token share of each row's exchange); dynamic CP
also moves long samples to smaller groups (a 20k sample on 4 ranks, not 8), which this leaves out. "Ceiling: any
plan" = fixed CP's step / the lower bound of any scheduler at this N: every sample on its smallest group, no
padding, perfect balance, each sample moving only its own tokens' keys and values (row-based CP moves a group's
whole N share per rank whatever the row holds, so no real plan gets there). The term ratios (fixed / dynamic,
mean rank) bound the step ratio: a sum's ratio lies between its terms' ratios, so 1.6x needs a CP-bytes ratio of
at least 1.6 and a step that communication dominates.

Mixes (``--mix``):

* ``long-tail`` (the issue's): ``--long-share`` 10% of the samples log-uniform in 16k-128k tokens, the rest
  lognormal (median 400, sigma 0.9) under 2k; cut to C x N for both. Qwen2.5-7B, C 8, N 8k and 16k, DP 8,
  512 samples a step.
* ``verl`` (the anchor's setting: Qwen3-30B-A3B SFT, 1k-16k samples, against fixed CP4; verl's length mix is
  not published): log-uniform in 1k-16k tokens (as many samples per octave: half under 4k, 80% of the tokens
  above 4k). Qwen3-30B-A3B (configs/sft/qwen3_30b_a3b_4k_full_pack.yaml: 48 layers, hidden 2048, 32 query
  heads, 4 KV heads of 128, 128 experts of ffn 768, top-8, vocab 151936), C 4, N 4k (16k fits on 4 x 4k),
  DP 2 (8 ranks), 128 samples a step.
"""
from __future__ import annotations

import time
import types

import numpy as np

from mindspeed_pack.packing.balance import cost_model, imbalance, plan_online_packing
from mindspeed_pack.packing.context_parallel import round_up
from mindspeed_pack.packing.dynamic_cp import group_sizes, plan_dynamic_cp

ANCHOR = 1.6  # verl: 337k vs 210k tokens/s, dynamic vs fixed CP4

MODELS = {
    "qwen25-7b": dict(hidden_size=3584, num_layers=28, num_attention_heads=28, num_query_groups=4,
                      ffn_hidden_size=18944, swiglu=True, padded_vocab_size=152064, kv_channels=None),
    "qwen3-30b-a3b": dict(hidden_size=2048, num_layers=48, num_attention_heads=32, num_query_groups=4,
                          kv_channels=128, ffn_hidden_size=6144, swiglu=True, padded_vocab_size=151936,
                          num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768, moe_layer_freq=1),
}
MIXES = {
    "long-tail": dict(model="qwen25-7b", max_cp=8, per_rank=[8192, 16384], dp=8, gbs=512),
    "verl": dict(model="qwen3-30b-a3b", max_cp=4, per_rank=[4096], dp=2, gbs=128),
}
COMM_PASSES = {"p2p": 3, "all_gather": 2}  # KV-sized transfers per layer per micro-batch (see the docstring)


def long_tail_lengths(n: int, long_share: float, seed: int = 0) -> np.ndarray:
    """``long_share`` of the samples log-uniform in [16384, 131072], the rest lognormal (median 400) under 2048."""
    rng = np.random.default_rng(seed)
    short = np.clip(np.rint(rng.lognormal(np.log(400), 0.9, n)), 16, 2047)
    long = np.rint(np.exp(rng.uniform(np.log(16384), np.log(131072), n)))
    return np.where(rng.random(n) < long_share, long, short).astype(np.int64)


def verl_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Log-uniform in [1024, 16384]."""
    rng = np.random.default_rng(seed)
    return np.rint(np.exp(rng.uniform(np.log(1024), np.log(16384), n))).astype(np.int64)


def kv_bytes(args) -> int:
    """Bytes of one token's keys and values in one layer (bf16)."""
    head_dim = args.kv_channels or args.hidden_size // args.num_attention_heads
    return 2 * args.num_query_groups * head_dim * 2


def fixed_cp_rows(lengths, dp: int, cp: int, per_rank: int, model):
    """``dp_balanced`` at CP ``cp``: rows of ``cp x per_rank`` tokens (samples padded to 2 x cp) per DP rank."""
    ranks = plan_online_packing(round_up(lengths, 2 * cp), dp, cp * per_rank, model)
    return [(d * cp, cp, lengths[row]) for d, r in enumerate(ranks) for row in r.rows], len(ranks[0].rows)


def dynamic_cp_rows(lengths, dp: int, cp: int, per_rank: int, model):
    plan = plan_dynamic_cp(lengths, dp * cp, per_rank, cp, model)
    rows = [(j.first_rank, j.size, lengths[j.samples]) for j in plan.jobs]
    used = {(r, j.slot) for j in plan.jobs for r in range(j.first_rank, j.first_rank + j.size)}
    empty = [(r, 1, lengths[:0]) for r in range(dp * cp) for s in range(plan.slots) if (r, s) not in used]
    return rows + empty, plan.slots


def row_work(model, args, per_rank: int, rows, passes: int):
    """Per row, on each of its ranks: (first rank, group size, [linear FLOPs, attention FLOPs, CP bytes, ring
    steps])."""
    first = np.array([r[0] for r in rows], np.int64)
    g = np.array([r[1] for r in rows], np.int64)
    n = [np.asarray(r[2], np.float64) for r in rows]
    work = np.stack([
        np.full(len(rows), 3 * model.linear * per_rank),
        3 * model.attention * np.array([(x * x).sum() for x in n]) / g,
        passes * args.num_layers * (g - 1) * per_rank * kv_bytes(args),
        2.0 * args.num_layers * (g - 1),
    ], axis=1)
    return first, g, work


def per_rank(first, g, values, num_ranks: int) -> np.ndarray:
    """Sum ``values`` (one per row) over the ranks of each row's group."""
    out = np.zeros((num_ranks,) + values.shape[1:])
    for k in range(int(g.max())):
        sel = g > k
        np.add.at(out, first[sel] + k, values[sel])
    return out


def row_seconds(work: np.ndarray, flops: float, bw: float, lat: float, overlap: bool) -> np.ndarray:
    compute_attn, comm = work[:, 1] / flops, work[:, 2] / bw
    exposed = np.maximum(compute_attn, comm) if overlap else compute_attn + comm
    return work[:, 0] / flops + exposed + work[:, 3] * lat


def ideal_seconds(lengths, model, args, cp: int, n_per_rank: int, ranks: int, passes: int, hw, overlap: bool):
    """Any scheduler's lower bound for one step: every sample on its smallest group, no pads, perfect balance."""
    n = np.asarray(lengths, np.float64)
    g = group_sizes(lengths, n_per_rank, cp)
    _, flops, bw, _ = hw
    lin = 3 * model.linear * n.sum() / ranks / flops
    attn = 3 * model.attention * (n * n).sum() / ranks / flops
    comm = passes * args.num_layers * kv_bytes(args) * ((g - 1) * n).sum() / ranks / bw
    return lin + (max(attn, comm) if overlap else attn + comm)


def compare_dynamic(a) -> None:
    mix = MIXES[a.mix]
    cp, dp = a.max_cp or mix["max_cp"], a.dp or mix["dp"]
    gbs, per_ranks = a.gbs or mix["gbs"], a.per_rank or mix["per_rank"]
    args = types.SimpleNamespace(**MODELS[mix["model"]])
    model = cost_model(args)
    passes = COMM_PASSES[a.cp_comm]
    ranks = dp * cp
    if a.mix == "verl":
        lengths_all = verl_lengths(gbs * a.steps, a.seed)
    else:
        lengths_all = long_tail_lengths(gbs * a.steps, a.long_share, a.seed)
    hw = [(name, float(f) * 1e12, float(b) * 1e9, float(lat) * 1e-6) for name, f, b, lat in
          (x.split(":") for x in a.hardware)]
    print(f"mix {a.mix}: {len(lengths_all)} samples, median {np.median(lengths_all):.0f}, mean "
          f"{lengths_all.mean():.0f} tokens; {mix['model']}, CP up to {cp}, DP {dp} ({ranks} ranks), {gbs} samples "
          f"a step, {a.steps} steps; CP comm {a.cp_comm} ({passes} KV-sized passes per layer and micro-batch), "
          f"{kv_bytes(args)} bytes of KV per token and layer")
    print("hardware (effective): " + "; ".join(f"{n}: {f / 1e12:.0f} TFLOP/s, {b / 1e9:.0f} GB/s per rank, "
                                                f"{lat * 1e6:.0f} us per ring step" for n, f, b, lat in hw))
    cols = " | ".join(f"{n + ' s/step (overlap)':>24}" for n, *_ in hw)
    print(f"\n{'N':>6} {'sched':>8} {'mb/step':>8} | {'attn TFLOP/rank':>15} {'max/mean':>8} | {'CP GB/rank':>10} "
          f"{'max/mean':>8} | {cols}")
    for n_rank in per_ranks:
        lengths_n = np.minimum(lengths_all, cp * n_rank)
        short = lengths_n <= n_rank
        result = {}
        for name, rows_of in (("fixed", fixed_cp_rows), ("dynamic", dynamic_cp_rows)):
            t0 = time.perf_counter()
            work = np.zeros((ranks, 4))
            slots, times = 0, np.zeros((len(hw), 2))
            short_comm = np.zeros(len(hw))  # fixed CP: the short samples' share of each row's exchange
            for step in range(a.steps):
                lengths = lengths_n[step * gbs:(step + 1) * gbs]
                rows, m = rows_of(lengths, dp, cp, n_rank, model)
                first, g, w = row_work(model, args, n_rank, rows, passes)
                step_work = per_rank(first, g, w, ranks)
                work += step_work
                slots += m
                real = np.array([float(np.asarray(r[2]).sum()) for r in rows])
                short_real = np.array([float(np.asarray(r[2])[np.asarray(r[2]) <= n_rank].sum()) for r in rows])
                share = np.divide(short_real, real, out=np.zeros_like(real), where=real > 0)
                for i, (_, flops, bw, lat) in enumerate(hw):
                    for j, overlap in enumerate((False, True)):
                        times[i, j] += per_rank(first, g, row_seconds(w, flops, bw, lat, overlap), ranks).max()
                    cost = w[:, 2] / bw + w[:, 3] * lat
                    short_comm[i] += per_rank(first, g, share * cost, ranks).mean()
            result[name] = dict(times=times / a.steps, work=work / a.steps, short_comm=short_comm / a.steps)
            print(f"{n_rank:>6} {name:>8} {slots / a.steps:>8.1f} | {work[:, 1].mean() / a.steps / 1e12:>15.1f} "
                  f"{imbalance(work[:, 1]):>8.3f} | {work[:, 2].mean() / a.steps / 1e9:>10.2f} "
                  f"{imbalance(work[:, 2]) if work[:, 2].any() else 1.0:>8.3f} | "
                  + " | ".join(f"{t[0]:>14.2f} ({t[1]:>6.2f})" for t in times / a.steps)
                  + f"   ({time.perf_counter() - t0:.1f} s)")
        fixed, dyn = result["fixed"], result["dynamic"]
        ratio = fixed["times"] / dyn["times"]
        print(f"{n_rank:>6} {'fixed / dynamic step time':>38} | {'':>19} | "
              + " | ".join(f"{r[0]:>13.2f}x ({r[1]:>5.2f}x)" for r in ratio)
              + f"   (anchor {ANCHOR}x: " + ", ".join("met" if r.max() >= ANCHOR else "missed" for r in ratio) + ")")
        # ceilings: the short samples' share of fixed CP's step, and any scheduler's lower bound
        pad = (round_up(lengths_n[short], 2 * cp) - lengths_n[short]).sum() / a.steps
        ideal = np.array([[np.mean([ideal_seconds(lengths_n[s * gbs:(s + 1) * gbs], model, args, cp, n_rank, ranks,
                                                  passes, h, overlap) for s in range(a.steps)])
                           for overlap in (False, True)] for h in hw])
        free = []
        for i, (_, flops, bw, lat) in enumerate(hw):
            w = fixed["work"].mean(0)
            mean_t = (w[0] + w[1]) / flops + w[2] / bw + w[3] * lat
            free.append(mean_t / (mean_t - fixed["short_comm"][i] - 3 * model.linear * pad / ranks / flops))
        print(f"{n_rank:>6} {'fixed CP, short samples free of CP':>38} | {'':>19} | "
              + " | ".join(f"{f:>13.2f}x {'':>8}" for f in free))
        print(f"{n_rank:>6} {'ceiling: any plan at this N':>38} | {'':>19} | "
              + " | ".join(f"{r[0]:>13.2f}x ({r[1]:>5.2f}x)" for r in fixed["times"] / ideal))
        fw, dw = fixed["work"].mean(0), dyn["work"].mean(0)
        terms = np.array([(fw[0] + fw[1]) / (dw[0] + dw[1]), fw[2] / dw[2], fw[3] / dw[3]])
        short_tokens = lengths_n[short].sum() / lengths_n.sum()
        print(f"{'':>6} {short.mean():.1%} of the samples are <= N and hold {short_tokens:.1%} of the tokens; "
              f"fixed CP's CP bytes are "
              + ", ".join(f"{fw[2] / b / ((fw[0] + fw[1]) / f + fw[2] / b + fw[3] * lat):.0%} of its {n} step"
                          for n, f, b, lat in hw) + " (mean rank, no overlap)")
        print(f"{'':>6} fixed / dynamic per mean rank: compute {terms[0]:.2f}x, CP bytes {terms[1]:.2f}x, ring steps "
              f"{terms[2]:.2f}x: the step ratio is at most {terms.max():.2f}x at any bandwidth and latency"
              + (f" (< the anchor {ANCHOR}x)" if terms.max() < ANCHOR else ""))

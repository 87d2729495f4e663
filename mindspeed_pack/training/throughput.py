"""Honest throughput: real (non-pad) tokens and model FLOPs counted by actual segment lengths.

Model FLOPs of a step = 3 x (``a`` x real tokens + ``b`` x sum over samples of length^2), with
``a`` and ``b`` from :func:`mindspeed_pack.packing.balance.cost_model` (linear layers per token,
causal attention per squared sample length). Packed samples attend only within themselves, so
counting ``seq_length^2`` per row would overstate the work; padding is not counted at all.
MFU = model FLOP/s / (``--peak-tflops`` x devices).
"""
from __future__ import annotations

import numpy as np

from mindspeed_pack.packing.balance import cost_model, segment_lengths


def real_segment_lengths(mb: dict) -> np.ndarray:
    """Token counts of the samples (documents) of a micro-batch; padding excluded."""
    if mb.get("segment_lengths") is not None:
        return np.asarray(mb["segment_lengths"], np.int64)
    seg = mb.get("segment_ids")
    if seg is None:  # no isolation: every row is one causal sequence
        seg = np.ones(tuple(mb["input_ids"].shape), np.int64)
    seg = np.asarray(seg)
    return np.concatenate([segment_lengths(row) for row in seg]) if len(seg) else np.zeros(0, np.int64)


def add_micro_batch(stats: dict, mb: dict) -> None:
    """Accumulate a micro-batch's real tokens and squared sample lengths into the step's stats."""
    lengths = real_segment_lengths(mb)
    stats["real tokens"] = stats.get("real tokens", 0) + int(lengths.sum())
    stats["sum sq lengths"] = stats.get("sum sq lengths", 0) + int((lengths * lengths).sum())


def step_fields(args, stats: dict, elapsed: float, dp: int, world_size: int) -> dict:
    """Metrics fields of one training step (whole job: this rank's figures x ``dp``; the trainer passes
    figures already summed over the data-parallel ranks, so every scheduler counts the same real lengths)."""
    if "real tokens" not in stats:
        return {}
    tokens, sum_sq = stats["real tokens"] * dp, stats["sum sq lengths"] * dp
    flops = cost_model(args).flops(tokens, sum_sq)
    out = {"model TFLOPs": flops / 1e12,
           "model TFLOP/s per device": flops / elapsed / world_size / 1e12 if elapsed > 0 else 0.0}
    if args.peak_tflops:
        out["MFU"] = out["model TFLOP/s per device"] / args.peak_tflops
    if "rank imbalance" in stats:
        out["rank imbalance"] = stats["rank imbalance"]
    return out

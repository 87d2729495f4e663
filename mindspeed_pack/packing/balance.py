"""Cost model of a packed micro-batch, and the assignment of samples (or packs) to DP ranks.

Cost of one sample of ``n`` tokens (forward FLOPs; a training step is 3x)::

    cost(n) = a * n + b * n^2
    a = 2 * (linear weights a token passes through: per layer QKV, output projection, MLP;
             plus the output layer's hidden x vocab)
    b = 2 * layers * heads * head_dim      (causal attention: Q.K^T and P.V over n^2/2 pairs each)

A pack costs the sum over its samples: attention is isolated per sample, so a pack of forty
100-token samples costs far less attention than one 4096-token sample of the same size.
Padding is not work the model had to do and is left out (it is counted as padding instead).

All functions are pure numpy and deterministic (ties broken by index), so every rank derives
the same plan from the same lengths without communicating.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from mindspeed_pack.packing.binpack import pack_lengths


@dataclass(frozen=True)
class CostModel:
    """Forward FLOPs of a sample: ``linear * n + attention * n^2`` (see module docstring)."""

    linear: float
    attention: float

    def sample_costs(self, lengths) -> np.ndarray:
        n = np.asarray(lengths, dtype=np.float64)
        return self.linear * n + self.attention * n * n

    def flops(self, tokens: float, sum_sq_lengths: float, training: bool = True) -> float:
        """Model FLOPs of ``tokens`` real tokens in segments whose squared lengths sum to ``sum_sq_lengths``."""
        return (3.0 if training else 1.0) * (self.linear * tokens + self.attention * sum_sq_lengths)


@dataclass(frozen=True)
class ModelShape:
    """Weights of the GPT that Megatron-LM model flags describe, per piece (numbers of parameters)."""

    layers: int
    hidden: int
    heads: int
    head_dim: int
    qkv_rows: int  # output rows of the fused QKV projection (its bias, with --add-qkv-bias)
    attention: int  # one layer's QKV and output projection (no biases)
    mlp: int  # one dense layer's MLP
    expert_mlp: int  # one expert's MLP (0 without experts)
    experts: int
    moe_layers: int  # layers whose MLP is experts (per --moe-layer-freq)
    vocab: int  # padded vocabulary rows


def model_shape(args) -> ModelShape:
    """The shapes the cost model and the run plan count (``args``: Megatron-LM model flags)."""
    h, layers = args.hidden_size, args.num_layers
    heads = args.num_attention_heads
    head_dim = getattr(args, "kv_channels", None) or h // heads
    groups = getattr(args, "num_query_groups", None) or heads
    ffn = getattr(args, "ffn_hidden_size", None) or 4 * h
    gated = 2 if getattr(args, "swiglu", False) else 1
    experts = getattr(args, "num_experts", None) or 0
    moe_layers = 0
    if experts:
        freq = getattr(args, "moe_layer_freq", 1)
        moe_layers = sum(freq) if isinstance(freq, list) else len(range(0, layers, freq))
    return ModelShape(
        layers=layers, hidden=h, heads=heads, head_dim=head_dim, qkv_rows=(heads + 2 * groups) * head_dim,
        attention=h * (heads + 2 * groups) * head_dim + heads * head_dim * h, mlp=(gated + 1) * h * ffn,
        expert_mlp=(gated + 1) * h * (getattr(args, "moe_ffn_hidden_size", None) or ffn) if experts else 0,
        experts=experts, moe_layers=moe_layers,
        vocab=getattr(args, "padded_vocab_size", None) or getattr(args, "vocab_size", None) or 0)


def cost_model(args) -> CostModel:
    """The cost model of the GPT configured by ``args`` (Megatron-LM model flags)."""
    m = model_shape(args)
    # an MoE layer runs top-k experts per token, plus the router
    moe_mlp = args.moe_router_topk * m.expert_mlp + m.hidden * m.experts if m.experts else 0
    linear = m.layers * m.attention + (m.layers - m.moe_layers) * m.mlp + m.moe_layers * moe_mlp + m.hidden * m.vocab
    return CostModel(linear=2.0 * linear, attention=2.0 * m.layers * m.heads * m.head_dim)


def imbalance(loads) -> float:
    """max / mean of per-rank loads (1.0 = perfectly balanced)."""
    loads = np.asarray(loads, dtype=np.float64)
    mean = loads.mean() if loads.size else 0.0
    return float(loads.max() / mean) if mean > 0 else 1.0


def balance_partition(costs, num_parts: int, equal_counts: bool = False) -> List[np.ndarray]:
    """Split items over ``num_parts`` so that the summed costs are balanced (greedy LPT).

    Items go longest-processing-time first (cost descending, ties by index) to the part with the
    least load so far (ties: lowest part). ``equal_counts`` requires ``len(costs)`` to be a
    multiple of ``num_parts`` and gives every part exactly ``len(costs) / num_parts`` items (a
    full part takes no more). Returns each part's item indices in ascending order, so data order
    is kept within a rank.
    """
    costs = np.asarray(costs, dtype=np.float64)
    n = len(costs)
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    cap = n
    if equal_counts:
        if n % num_parts:
            raise ValueError(f"{n} items cannot be split into {num_parts} parts of equal count")
        cap = n // num_parts
    order = np.lexsort((np.arange(n), -costs))  # cost descending, then index ascending
    loads = np.zeros(num_parts)
    counts = np.zeros(num_parts, np.int64)
    owner = np.empty(n, np.int64)
    for i in order:
        open_parts = np.flatnonzero(counts < cap)
        p = int(open_parts[np.argmin(loads[open_parts])])  # argmin returns the first (lowest) minimum
        owner[i] = p
        loads[p] += costs[i]
        counts[p] += 1
    return [np.flatnonzero(owner == p) for p in range(num_parts)]


def segment_lengths(segment_ids: np.ndarray, pad_mask: Optional[np.ndarray] = None) -> np.ndarray:
    """Lengths of the runs of equal non-zero ids of one row (its samples; 0 = padding).

    ``pad_mask`` (same shape, True = a pad token): a run of pads that *ends* a segment is not
    counted, e.g. the padding ``preprocess_data.py --pad-to-multiple-of`` appends to a sample.
    """
    seg = np.asarray(segment_ids)
    if seg.size == 0:
        return np.zeros(0, np.int64)
    starts = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]])
    if pad_mask is None:
        lengths = np.diff(np.r_[starts, seg.size])
    else:  # up to the last non-pad token of each segment
        last = np.maximum.reduceat(np.where(np.asarray(pad_mask), -1, np.arange(seg.size)), starts)
        lengths = np.maximum(last - starts + 1, 0)
    return lengths[seg[starts] != 0]


def contiguous_partition(n: int, num_parts: int) -> List[np.ndarray]:
    """The naive assignment: consecutive equal-count slices (``n`` a multiple of ``num_parts``)."""
    per = n // num_parts
    return [np.arange(p * per, (p + 1) * per) for p in range(num_parts)]


@dataclass
class RankRows:
    """One rank's rows for a step: ``rows[r]`` lists the batch positions packed into row ``r``."""

    rows: List[np.ndarray]
    cost: float


def plan_online_packing(lengths, num_ranks: int, capacity: int, model: CostModel,
                        costs: Optional[np.ndarray] = None) -> List[RankRows]:
    """Balance one global batch's samples over ranks, then pack each rank's samples into rows.

    ``lengths`` are the samples' token counts (already clipped to ``capacity``); ``costs`` their
    costs where a sample is several sequences (a preference pair: its sequences' costs), else
    from ``lengths``. Samples are spread by :func:`balance_partition` on their cost, each rank's
    share is packed with the C++ best-fit-decreasing packer into rows of ``capacity`` tokens, and
    every rank then gets the same number of rows (pipelines and DDP need one micro-batch count per
    step): ranks short of rows split their fullest multi-sample row into two, or, when every row
    holds one sample, add an empty row (all padding, no trained tokens). Row order follows the
    first sample of each row, so data order is kept as far as packing allows.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    costs = model.sample_costs(lengths) if costs is None else np.asarray(costs, dtype=np.float64)
    parts = balance_partition(costs, num_ranks)
    ranks = []
    for part in parts:
        rows: List[np.ndarray] = []
        if len(part):
            plan = pack_lengths(lengths[part], capacity)
            rows = [part[b] for b in plan.bins()]
        ranks.append(RankRows(rows=rows, cost=float(costs[part].sum())))
    target = max(len(r.rows) for r in ranks)
    target = max(target, 1)
    for r in ranks:
        while len(r.rows) < target:
            multi = [i for i, row in enumerate(r.rows) if len(row) > 1]
            if not multi:
                r.rows.append(np.zeros(0, np.int64))
                continue
            i = max(multi, key=lambda k: (len(r.rows[k]), -k))  # most samples; first such row
            row = r.rows.pop(i)
            half = len(row) // 2
            r.rows[i:i] = [row[:half], row[half:]]
        r.rows.sort(key=lambda row: (len(row) == 0, int(row[0]) if len(row) else 0))
    return ranks


def row_stats(ranks: Sequence[RankRows], lengths, capacity: int) -> dict:
    """Padding ratio and rows per step of an online-packing plan (whole job)."""
    total_rows = sum(len(r.rows) for r in ranks)
    real = int(np.asarray(lengths, dtype=np.int64).sum())
    return {"rows": total_rows, "padding ratio": 1.0 - real / (total_rows * capacity) if total_rows else 0.0}

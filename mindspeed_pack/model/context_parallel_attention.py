"""Exact context-parallel (CP) packed attention for the local spec (CPU, or GPU without TE).

Each CP rank holds its zigzag share of every sample (chunks ``r`` and ``2N-1-r``, see
:mod:`mindspeed_pack.packing.context_parallel`). Attention needs all of a sample's earlier
keys, so keys and values are all-gathered over the CP group (megatron's sequence-parallel
gather: the backward is the matching reduce-scatter, which returns every rank's key/value
gradient to the rank that owns the token) and put back in global order. The local queries
then attend causally within their own sample, masked by *global* positions::

    sample of 8 tokens at CP2, rank 0 queries = positions 0,1 and 6,7
    keys (gathered, global order) 0 1 2 3 4 5 6 7
    query 1  -> keys 0..1        query 6 -> keys 0..6

This is the all-gather flavour of CP (Transformer Engine's ``--cp-comm-type all_gather``):
memory for one layer's full keys/values, exact by construction, one implementation for
every CP size. Samples of similar padded length share one batched SDPA call; the index
plan is built on the host once per micro-batch and reused by every layer (nothing waits on
the device, and the gathers' backward is a gather: :mod:`.row_gather`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from mindspeed_pack.model.row_gather import RowPlan, gather_rows, row_plan
from mindspeed_pack.model.segment_buckets import segments_by_width
from mindspeed_pack.model.thd import cached, host_cu_seqlens, to_device
from mindspeed_pack.packing.context_parallel import local_rows, segment_positions


@dataclass
class CPPlan:
    """Index work that depends only on the batch layout, built on the host once per micro-batch.

    ``queries``: local rows -> bucketed query rows; ``keys``: all-gathered (rank-major) rows -> bucketed
    key rows, in global order; ``scatter``: bucketed outputs -> local rows; per bucket its first query and
    key row, segments, query and key widths, and causal mask by global position.
    """

    queries: RowPlan
    keys: RowPlan
    scatter: RowPlan
    buckets: List[Tuple[int, int, int, int, int, torch.Tensor]]


def global_to_gathered(cu: np.ndarray, cp: int, t: int) -> np.ndarray:
    """For each global row of the padded layout ``cu``, its row in the all-gathered (rank-major) keys/values."""
    if int(cu[-1]) != t * cp:
        raise ValueError(f"CP attention: cu_seqlens_padded ends at {int(cu[-1])}, expected {t} local x {cp} ranks")
    gathered = np.concatenate([local_rows(cu, cp, r) for r in range(cp)])  # global row of each gathered row
    out = np.empty_like(gathered)
    out[gathered] = np.arange(len(gathered))
    return out


def cp_plan(cu: np.ndarray, cp: int, rank: int, t: int, device) -> CPPlan:
    to_gathered = global_to_gathered(cu, cp, t)
    q_pos = segment_positions(cu, cp, rank)  # each local query's position in its segment
    lengths = np.diff(cu)
    by_width = segments_by_width(lengths)
    q_rows, k_rows, slots, buckets = [], [], np.empty(t, dtype=np.int64), []
    q_first = k_first = 0
    for width in by_width:
        segs = np.asarray(by_width[width])
        q_width = -(-width // cp)
        q_off, k_off = np.arange(q_width), np.arange(width)
        q_valid = q_off[None] < (lengths[segs] // cp)[:, None]
        q_index = np.where(q_valid, (cu[segs] // cp)[:, None] + q_off[None], t)  # t: the zero row
        k_valid = k_off[None] < lengths[segs][:, None]
        k_index = np.where(k_valid, to_gathered[np.minimum(cu[segs][:, None] + k_off[None], t * cp - 1)],
                           t * cp)  # t * cp: the zero row
        pos = np.where(q_valid, q_pos[np.minimum(q_index, t - 1)], 0)
        # causal by global position; a padded query row sees key 0 (every row attends somewhere: no NaN)
        mask = (k_off[None, None, :] <= pos[:, :, None]) & k_valid[:, None, :]  # [n, q_width, width]
        q_rows.append(q_index.reshape(-1))
        k_rows.append(k_index.reshape(-1))
        slots[q_index[q_valid]] = (q_first + np.arange(q_index.size).reshape(q_index.shape))[q_valid]
        buckets.append((q_first, k_first, len(segs), q_width, width, to_device(mask[:, None], device)))
        q_first += q_index.size
        k_first += k_index.size
    return CPPlan(row_plan(np.concatenate(q_rows), t, device), row_plan(np.concatenate(k_rows), t * cp, device),
                  row_plan(slots, q_first, device), buckets)


def gather_keys_values(key: torch.Tensor, value: torch.Tensor, cp_group) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every CP rank's keys and values, rank-major ``[t * cp, g, d]`` (the backward reduce-scatters their
    gradients back to the ranks that own the tokens)."""
    groups = key.shape[1]
    kv = gather_from_sequence_parallel_region(torch.cat([key, value], dim=1), True, group=cp_group)
    return kv[:, :groups], kv[:, groups:]


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout,
    cp_group,
    *,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Local queries ``[t, h, d]`` against the CP group's keys/values ``[t, g, d]`` -> ``[t, h, d]``.

    ``layout``: the micro-batch's ``PackedSeqParams`` (plan cached there for every layer) or the
    ``cu_seqlens_padded`` tensor: *global* offsets of the padded segments (each a multiple of ``2 x CP``);
    ``t`` = global tokens / CP.
    """
    cp = cp_group.size()
    t, heads, dim = query.shape
    groups = key.shape[1]
    if isinstance(layout, torch.Tensor):
        layout = PackedSeqParams(qkv_format="thd", cu_seqlens_q_padded=layout, cu_seqlens_kv_padded=layout)
    plan = cached(layout, ("cp buckets", cp, cp_group.rank(), t, str(query.device)),
                  lambda: cp_plan(host_cu_seqlens(layout), cp, cp_group.rank(), t, query.device))
    k_all, v_all = gather_keys_values(key, value, cp_group)
    q_b = gather_rows(query, plan.queries)
    k_b, v_b = gather_rows(k_all, plan.keys), gather_rows(v_all, plan.keys)
    outputs = []
    for q_first, k_first, n, q_width, width, mask in plan.buckets:
        q = q_b[q_first:q_first + n * q_width].view(n, q_width, heads, dim).transpose(1, 2)
        k, v = (x[k_first:k_first + n * width].view(n, width, groups, dim).transpose(1, 2) for x in (k_b, v_b))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, dropout_p=dropout_p,
                                           enable_gqa=groups != heads)
        outputs.append(o.transpose(1, 2).reshape(n * q_width, heads, dim))
    return gather_rows(torch.cat(outputs) if len(outputs) > 1 else outputs[0], plan.scatter)

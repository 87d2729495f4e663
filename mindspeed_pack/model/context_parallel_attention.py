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
plan is built once per batch and reused by every layer.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from mindspeed_pack.model.segment_buckets import bucket_width
from mindspeed_pack.packing.context_parallel import zigzag_index


class _Plan:
    """Index work that depends only on the batch layout, shared by every layer of a forward.

    ``gathered_to_global`` reorders the all-gathered (rank-major) keys/values into global
    order; each bucket holds the rows, validity and causal mask of its batched SDPA call.
    """

    def __init__(self, cu: torch.Tensor, cp: int, rank: int, t: int, device):
        owner = torch.cat([zigzag_index(cu, cp, r) for r in range(cp)])  # global index of each gathered row
        self.gathered_to_global = torch.empty_like(owner)
        self.gathered_to_global[owner] = torch.arange(len(owner), device=device)
        q_global = zigzag_index(cu, cp, rank)
        starts, lengths = cu[:-1].tolist(), (cu[1:] - cu[:-1]).tolist()
        by_width: dict[int, list[int]] = {}
        for i, n in enumerate(lengths):
            if n:
                by_width.setdefault(bucket_width(n), []).append(i)
        self.buckets, rows = [], []
        for width, segs in by_width.items():
            seg_start = torch.tensor([starts[i] for i in segs], device=device)
            seg_len = torch.tensor([lengths[i] for i in segs], device=device)
            q_off = torch.arange(-(-width // cp), device=device)
            q_valid = q_off[None] < (seg_len // cp)[:, None]  # [n, width / cp]
            q_rows = torch.where(q_valid, seg_start[:, None] // cp + q_off[None], t)  # t: a zero row
            q_pos = torch.where(q_valid, q_global[q_rows.clamp(max=t - 1)] - seg_start[:, None], 0)
            k_off = torch.arange(width, device=device)
            k_valid = k_off[None] < seg_len[:, None]  # [n, width]
            k_rows = torch.where(k_valid, seg_start[:, None] + k_off[None], t * cp)  # t * cp: a zero row
            # causal by global position; a padded query row sees key 0 (every row attends somewhere: no NaN)
            mask = (k_off[None, None, :] <= q_pos[:, :, None]) & k_valid[:, None, :]  # [n, width / cp, width]
            self.buckets.append((q_rows, q_valid, k_rows, mask[:, None]))
            rows.append(q_rows[q_valid])
        order = torch.cat(rows)
        self.inverse = torch.empty_like(order)
        self.inverse[order] = torch.arange(len(order), device=device)


_last_plan: tuple = (None, None)  # (cu_seqlens_padded tensor, its plan): one batch at a time


def _plan_for(cu_seqlens_padded: torch.Tensor, cp: int, rank: int, t: int, device) -> _Plan:
    global _last_plan
    key = (cp, rank, t)
    held, plan = _last_plan
    # the tensor object itself is the key (held here, so its id cannot be reused): every layer of a
    # forward passes the same PackedSeqParams
    if held is not None and held[0] is cu_seqlens_padded and held[1] == key:
        return plan
    cu = cu_seqlens_padded.to(device=device, dtype=torch.long)
    if int(cu[-1]) != t * cp:
        raise ValueError(f"CP attention: cu_seqlens_padded ends at {int(cu[-1])}, expected {t} local x {cp} ranks")
    plan = _Plan(cu, cp, rank, t, device)
    _last_plan = ((cu_seqlens_padded, key), plan)
    return plan


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    cp_group,
    *,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Local queries ``[t, h, d]`` against the CP group's keys/values ``[t, g, d]`` -> ``[t, h, d]``.

    ``cu_seqlens_padded`` are the *global* offsets of the padded segments (each a multiple of
    ``2 x CP``); ``t`` = global tokens / CP.
    """
    cp = cp_group.size()
    t, heads, dim = query.shape
    groups = key.shape[1]
    plan = _plan_for(cu_seqlens_padded, cp, cp_group.rank(), t, query.device)
    # all ranks' keys/values, rank-major, then back in global token order (+ a zero row for bucket padding)
    kv = gather_from_sequence_parallel_region(torch.cat([key, value], dim=1), True, group=cp_group)
    kv = torch.cat([kv[plan.gathered_to_global], kv.new_zeros(1, 2 * groups, dim)])
    k_all, v_all = kv[:, :groups], kv[:, groups:]
    q_ext = torch.cat([query, query.new_zeros(1, heads, dim)])
    outputs = []
    for q_rows, q_valid, k_rows, mask in plan.buckets:
        o = F.scaled_dot_product_attention(
            q_ext[q_rows].transpose(1, 2), k_all[k_rows].transpose(1, 2), v_all[k_rows].transpose(1, 2),
            attn_mask=mask, scale=scale, dropout_p=dropout_p, enable_gqa=groups != heads,
        ).transpose(1, 2)
        outputs.append(o[q_valid])
    return torch.cat(outputs)[plan.inverse]

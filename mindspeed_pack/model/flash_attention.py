"""The ``flash`` backend: PyTorch's varlen FlashAttention on packed (THD) batches, no Transformer Engine.

``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.9, CUDA, fp16/bf16) takes the flat micro-batch
and ``cu_seqlens`` and runs causal attention inside each segment in one kernel: no padding to
buckets, no gathers. ``cu_seqlens`` is on the device already and ``max_seqlen`` is a host integer
(both built once per micro-batch), so nothing waits on the device. Causal is ``window_size=(-1, 0)``.
Grouped-query attention uses the kernel's ``enable_gqa`` where this torch has it, else the key/value
groups are expanded to the query heads (megatron's grouping: query head ``i`` reads group
``i // (heads / groups)``).

Under context parallelism each rank holds chunks ``r`` and ``2N-1-r`` of every (padded) segment
(:mod:`mindspeed_pack.packing.context_parallel`). After the all-gather of keys and values (as in
:mod:`.context_parallel_attention`), every local chunk is one query sequence whose keys are its
segment's prefix up to the chunk's end: FlashAttention aligns the causal mask to the bottom right when
a sequence has more keys than queries, which is exactly "query at global position ``p`` sees keys
``0..p``". A chunk's key prefix overlaps the other chunk's, so the first chunks and the second chunks
run as two calls, each with disjoint key prefixes (:func:`~.row_gather.gather_rows` both ways)::

    segment of 8 at CP2, rank 0 holds chunks 0 (positions 0,1) and 3 (6,7)
    call 1: queries 0,1  keys 0..1          call 2: queries 6,7  keys 0..7
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from mindspeed_pack.model.context_parallel_attention import gather_keys_values, global_to_gathered
from mindspeed_pack.model.packed_attention import PackedDotProductAttention
from mindspeed_pack.model.row_gather import RowPlan, gather_rows, row_plan
from mindspeed_pack.model.thd import cached, context_parallel_group, host_cu_seqlens, to_device

try:
    from torch.nn.attention.varlen import varlen_attn

    HAVE_VARLEN = True
    VARLEN_GQA = "enable_gqa" in inspect.signature(varlen_attn).parameters
except ImportError:  # torch < 2.9
    varlen_attn = None
    HAVE_VARLEN = False
    VARLEN_GQA = False

HALF = (torch.float16, torch.bfloat16)


def flash_unavailable_reason(dtype: torch.dtype, on_gpu: bool, attention_dropout: float) -> Optional[str]:
    """Why the flash backend cannot run this model (None: it can)."""
    if not HAVE_VARLEN:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (torch >= 2.9)"
    if not on_gpu:
        return "no CUDA device"
    if torch.cuda.get_device_capability()[0] < 8:
        return "FlashAttention needs compute capability 8.0 or newer"
    if dtype not in HALF:
        return "FlashAttention runs fp16/bf16 only (pass --bf16 or --fp16)"
    if attention_dropout:
        return "varlen FlashAttention has no attention dropout (--attention-dropout 0)"
    return None


def _kernel(query, key, value, cu_q, cu_k, max_q: int, max_k: int, scale: Optional[float]) -> torch.Tensor:
    heads, groups = query.shape[1], key.shape[1]
    extra = {}
    if groups != heads:
        if VARLEN_GQA:
            extra["enable_gqa"] = True
        else:
            key = key.repeat_interleave(heads // groups, dim=1)
            value = value.repeat_interleave(heads // groups, dim=1)
    return varlen_attn(query.contiguous(), key.contiguous(), value.contiguous(), cu_q, cu_k, max_q, max_k,
                       scale=scale, window_size=(-1, 0), **extra)


@dataclass
class CPFlashPlan:
    """Per pass (first chunks, second chunks): local query rows, gathered key rows, cu_seqlens, maxima;
    and the scatter of both passes' outputs back to local order."""

    passes: list  # [(queries RowPlan, keys RowPlan, cu_q, cu_k, max_q, max_k)]
    scatter: RowPlan


def cp_flash_plan(cu: np.ndarray, cp: int, rank: int, t: int, device) -> CPFlashPlan:
    to_gathered = global_to_gathered(cu, cp, t)
    chunk = np.diff(cu) // (2 * cp)
    local_start = cu[:-1] // cp
    passes, out_order = [], []
    for k, ends in ((0, (rank + 1) * chunk), (1, (2 * cp - rank) * chunk)):  # chunk r, then chunk 2N-1-r
        q_rows = np.concatenate([np.arange(s + k * c, s + (k + 1) * c) for s, c in zip(local_start, chunk)])
        k_rows = np.concatenate([to_gathered[np.arange(s, s + e)] for s, e in zip(cu[:-1], ends)])
        cu_q = np.concatenate([[0], np.cumsum(chunk)]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum(ends)]).astype(np.int32)
        passes.append((row_plan(q_rows, t, device), row_plan(k_rows, t * cp, device), to_device(cu_q, device),
                       to_device(cu_k, device), int(chunk.max()), int(ends.max())))
        out_order.append(q_rows)
    slots = np.empty(t, dtype=np.int64)
    slots[np.concatenate(out_order)] = np.arange(t)
    return CPFlashPlan(passes, row_plan(slots, t, device))


def cp_flash_attention(query, k_all, v_all, plan: CPFlashPlan, scale: Optional[float]) -> torch.Tensor:
    """Local queries ``[t, h, d]`` against the CP group's gathered (rank-major) keys/values ``[t * cp, g, d]``."""
    outputs = [_kernel(gather_rows(query, q_plan), gather_rows(k_all, k_plan), gather_rows(v_all, k_plan),
                       cu_q, cu_k, max_q, max_k, scale)
               for q_plan, k_plan, cu_q, cu_k, max_q, max_k in plan.passes]
    return gather_rows(torch.cat(outputs), plan.scatter)


class FlashPackedAttention(PackedDotProductAttention):
    """``core_attention`` of the ``flash`` backend: :class:`PackedDotProductAttention` with varlen FlashAttention."""

    backend = "flash"

    def thd_attention(self, query, key, value, params, dropout_p: float) -> torch.Tensor:
        if dropout_p:
            raise ValueError("the flash backend has no attention dropout: pass --attention-dropout 0")
        cp_group = context_parallel_group(params, self.cp_group)
        if cp_group is None:
            cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
            return _kernel(query, key, value, cu, cu, params.max_seqlen_q, params.max_seqlen_q, self.scale)
        cp, rank, t = cp_group.size(), cp_group.rank(), query.shape[0]
        plan = cached(params, ("cp flash", cp, rank, t, str(query.device)),
                      lambda: cp_flash_plan(host_cu_seqlens(params), cp, rank, t, query.device))
        k_all, v_all = gather_keys_values(key, value, cp_group)
        return cp_flash_attention(query, k_all, v_all, plan, self.scale)

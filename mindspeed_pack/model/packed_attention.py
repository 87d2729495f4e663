"""Exact packed (THD) core attention without Transformer Engine: the ``local`` backend (any device).

Fills the ``core_attention`` slot of megatron-core's local layer spec. Under
``PackedSeqParams(qkv_format="thd")`` megatron-core hands this module query ``[t, heads, dim]``
and key/value ``[t, groups, dim]`` for the whole flattened micro-batch. Attention is causal
*within each segment* and zero across segments. When the model left RoPE to attention
(:class:`~.packed_gpt.PackedGPTModel`), q and k are rotated here first, by position
(:mod:`.packed_rope`).

The local kernel batches segments of similar length into one SDPA call each (lengths rounded
up to :func:`~.segment_buckets.bucket_width`, at most 1/8 longer), so the cost follows the sum
of squared segment lengths, never the square of the pack::

    segments   a a a a a | b b | c c c            (t = 10)
    bucket 16  a a a a a 0 .. 0 | b b 0 .. 0 | c c c 0 .. 0    one SDPA call, [3, 16] rows

The padding is exact: under a causal mask a real query never sees keys after it, so only
padded queries (whose outputs are dropped) read padded keys. The bucket layout is an index
plan built on the host once per micro-batch (:func:`~.thd.cached`) and applied with
:func:`~.row_gather.gather_rows` in every layer: no device-to-host synchronisation, no
boolean indexing, and a backward that gathers instead of accumulating.

Without packed parameters (``[s, b, heads, dim]``) every row is one causal sequence.
Under context parallelism :mod:`.context_parallel_attention` takes over. The ``flash``
backend (:mod:`.flash_attention`) subclasses this module and swaps the kernel.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from mindspeed_pack.model.context_parallel_attention import context_parallel_attention
from mindspeed_pack.model.packed_rope import apply_packed_rope
from mindspeed_pack.model.row_gather import RowPlan, gather_rows, row_plan
from mindspeed_pack.model.segment_buckets import segments_by_width
from mindspeed_pack.model.thd import cached, context_parallel_group, host_cu_seqlens


@dataclass
class BucketPlan:
    """Rows of the flat micro-batch -> the bucketed layout (``gather``) and back (``scatter``)."""

    gather: Optional[RowPlan]
    scatter: Optional[RowPlan]
    buckets: List[Tuple[int, int, int]]  # (first row in the bucketed layout, segments, width)
    whole: bool  # one segment covering every token: plain causal attention


def bucket_plan(cu: np.ndarray, t: int, device) -> BucketPlan:
    lengths = np.diff(cu)
    if int(cu[-1]) != t:
        raise ValueError(f"packed attention: cu_seqlens end at {int(cu[-1])} but the micro-batch holds {t} tokens")
    if len(lengths) == 1:
        return BucketPlan(None, None, [], True)
    by_width = segments_by_width(lengths)
    rows, slots, buckets, offset = [], np.empty(t, dtype=np.int64), [], 0
    for width in by_width:
        segs = np.asarray(by_width[width])
        steps = np.arange(width)
        valid = steps[None, :] < lengths[segs][:, None]
        index = np.where(valid, cu[segs][:, None] + steps[None, :], t)  # t: the zero row
        rows.append(index.reshape(-1))
        slots[index[valid]] = (offset + np.arange(index.size).reshape(index.shape))[valid]
        buckets.append((offset, len(segs), width))
        offset += index.size
    return BucketPlan(row_plan(np.concatenate(rows), t, device), row_plan(slots, offset, device), buckets, False)


def segment_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout,
    *,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal attention restricted to segments. q ``[t, h, d]``, k/v ``[t, g, d]`` -> ``[t, h, d]``.

    ``layout``: the micro-batch's ``PackedSeqParams`` (its plan is cached there for every layer) or a
    ``cu_seqlens`` tensor. Query head ``i`` reads key/value group ``i // (h // g)`` (megatron's GQA grouping).
    """
    t, heads, dim = query.shape
    groups = key.shape[1]
    if isinstance(layout, torch.Tensor):
        layout = PackedSeqParams(qkv_format="thd", cu_seqlens_q=layout, cu_seqlens_kv=layout)
    plan = cached(layout, ("buckets", t, str(query.device)),
                  lambda: bucket_plan(host_cu_seqlens(layout), t, query.device))
    gqa = groups != heads
    if plan.whole:
        o = F.scaled_dot_product_attention(query.transpose(0, 1)[None], key.transpose(0, 1)[None],
                                           value.transpose(0, 1)[None], is_causal=True, scale=scale,
                                           dropout_p=dropout_p, enable_gqa=gqa)
        return o[0].transpose(0, 1)
    q_all, k_all, v_all = (gather_rows(x, plan.gather) for x in (query, key, value))
    outputs = []
    for first, n, width in plan.buckets:
        # [n * width, h, d] -> [n, h, width, d]
        q, k, v = (x[first:first + n * width].view(n, width, x.shape[1], dim).transpose(1, 2)
                   for x in (q_all, k_all, v_all))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=dropout_p, enable_gqa=gqa)
        outputs.append(o.transpose(1, 2).reshape(n * width, heads, dim))
    return gather_rows(torch.cat(outputs) if len(outputs) > 1 else outputs[0], plan.scatter)


class PackedDotProductAttention(MegatronModule):
    """Drop-in ``core_attention`` for the local spec that honours ``PackedSeqParams`` (the ``local`` backend)."""

    backend = "local"

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        tp = pg_collection.tp.size()
        self.cp_group = getattr(pg_collection, "cp", None) if config.context_parallel_size > 1 else None
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups or config.num_attention_heads, tp)
        head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError(f"attention_bias is not supported by the {self.backend} packed attention")
        dropout_p = self.dropout if self.training else 0.0
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"packed attention expects qkv_format='thd', got {packed_seq_params.qkv_format!r}")
            query, key = apply_packed_rope(query, key, packed_seq_params)
            return self.thd_attention(query, key, value, packed_seq_params, dropout_p)  # [t, h, d]
        if self.cp_group is not None:
            raise ValueError("context parallelism needs packed (THD) batches: PackedSeqParams with cu_seqlens_padded")
        out_dtype = query.dtype
        query, key, value = self._softmax_dtype(query, key, value)
        # [s, b, h, d] -> [b, h, s, d]
        s, b = query.shape[:2]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        o = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.scale, dropout_p=dropout_p, enable_gqa=self.groups != self.heads
        )
        return o.permute(2, 0, 1, 3).reshape(s, b, -1).to(out_dtype)

    def _softmax_dtype(self, *tensors):
        """--attention-softmax-in-fp32: scores, softmax and the weighted sum in fp32 (SDPA has no fp32-softmax
        option for half inputs), the result back in the model precision."""
        if self.config.attention_softmax_in_fp32 and tensors[0].dtype != torch.float32:
            return tuple(x.float() for x in tensors)
        return tensors

    def thd_attention(self, query, key, value, params: PackedSeqParams, dropout_p: float) -> torch.Tensor:
        """Segment-causal attention of a THD micro-batch (this backend's kernel)."""
        out_dtype = query.dtype
        query, key, value = self._softmax_dtype(query, key, value)
        cp_group = context_parallel_group(params, self.cp_group)
        if cp_group is not None:
            out = context_parallel_attention(query, key, value, params, cp_group, scale=self.scale,
                                             dropout_p=dropout_p)
        else:
            out = segment_causal_attention(query, key, value, params, scale=self.scale, dropout_p=dropout_p)
        return out.to(out_dtype)

"""Exact packed (THD) core attention without Transformer Engine.

Fills the ``core_attention`` slot of megatron-core's local layer spec. Under
``PackedSeqParams(qkv_format="thd")`` megatron-core hands this module query
``[t, heads, dim]`` and key/value ``[t, groups, dim]`` for the whole flattened micro-batch
(RoPE already applied per segment from ``cu_seqlens``). Attention is causal *within each
segment* and zero across segments; segments of similar length are batched into one SDPA
call, so the cost follows the sum of squared segment lengths (each at most 1/8 longer),
never the square of the pack length, and the Python loop runs once per length bucket.

Without packed parameters (``[s, b, heads, dim]``) every row is one causal sequence.
Under context parallelism the CP variant (:mod:`.context_parallel_attention`) takes over.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from mindspeed_pack.model.context_parallel_attention import context_parallel_attention
from mindspeed_pack.model.segment_buckets import bucket_width


def segment_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal attention restricted to segments. q ``[t, h, d]``, k/v ``[t, g, d]`` -> ``[t, h, d]``.

    Segments are grouped into buckets of similar length (:func:`bucket_width`) and each
    bucket is one batched causal SDPA call, its shorter segments padded at the end. The
    padding is exact: under a causal mask a real query never sees keys after it, so only
    the padded queries (whose outputs are dropped) read padded keys. Query head ``i``
    reads key/value group ``i // (h // g)`` (megatron's GQA grouping).
    """
    t, heads, dim = query.shape
    groups = key.shape[1]
    bounds = cu_seqlens.tolist()
    buckets: dict[int, list[tuple[int, int]]] = {}
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            buckets.setdefault(bucket_width(end - start), []).append((start, end - start))
    if len(buckets) == 1 and len(next(iter(buckets.values()))) == 1 and bounds[-1] - bounds[0] == t:
        # one segment covering everything: plain causal attention, no gathering
        o = F.scaled_dot_product_attention(query.transpose(0, 1)[None], key.transpose(0, 1)[None],
                                           value.transpose(0, 1)[None], is_causal=True, scale=scale,
                                           dropout_p=dropout_p, enable_gqa=groups != heads)
        return o[0].transpose(0, 1)
    device = query.device
    pad_row = t  # index of an all-zero row appended below
    q_ext = torch.cat([query, query.new_zeros(1, heads, dim)])
    k_ext = torch.cat([key, key.new_zeros(1, groups, dim)])
    v_ext = torch.cat([value, value.new_zeros(1, groups, dim)])
    outputs, positions = [], []
    for width, segs in buckets.items():
        starts = torch.tensor([s for s, _ in segs], device=device)
        lengths = torch.tensor([n for _, n in segs], device=device)
        offsets = torch.arange(width, device=device)
        valid = offsets[None, :] < lengths[:, None]  # [n, width]
        index = torch.where(valid, starts[:, None] + offsets[None, :], pad_row)
        # [n, width, h, d] -> [n, h, width, d]
        q = q_ext[index].transpose(1, 2)
        k = k_ext[index].transpose(1, 2)
        v = v_ext[index].transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, dropout_p=dropout_p, enable_gqa=groups != heads
        ).transpose(1, 2)
        outputs.append(o[valid])
        positions.append(index[valid])
    order = torch.cat(positions)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order), device=device)
    return torch.cat(outputs)[inverse]


class PackedDotProductAttention(MegatronModule):
    """Drop-in ``core_attention`` for the local spec that honours ``PackedSeqParams``."""

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
        if self.cp_group is not None:
            self._cp_attention = context_parallel_attention
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
            raise ValueError("attention_bias is not supported by PackedDotProductAttention")
        dropout_p = self.dropout if self.training else 0.0
        out_dtype = query.dtype
        if self.config.attention_softmax_in_fp32 and out_dtype != torch.float32:
            # --attention-softmax-in-fp32: scores, softmax and the weighted sum in fp32 (SDPA has no fp32-softmax
            # option for half inputs), the result back in the model precision
            query, key, value = query.float(), key.float(), value.float()
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"packed attention expects qkv_format='thd', got {packed_seq_params.qkv_format!r}")
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            if self.cp_group is not None:
                out = self._cp_attention(query, key, value, cu, self.cp_group, scale=self.scale, dropout_p=dropout_p)
            else:
                out = segment_causal_attention(query, key, value, cu, scale=self.scale, dropout_p=dropout_p)
            return out.to(out_dtype)  # [t, h, d]; megatron reshapes to [t, 1, h*d]
        if self.cp_group is not None:
            raise ValueError("context parallelism needs packed (THD) batches: PackedSeqParams with cu_seqlens_padded")
        # [s, b, h, d] -> [b, h, s, d]
        s, b = query.shape[:2]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        o = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.scale, dropout_p=dropout_p, enable_gqa=self.groups != self.heads
        )
        return o.permute(2, 0, 1, 3).reshape(s, b, -1).to(out_dtype)

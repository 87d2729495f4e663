"""Exact packed (THD) core attention without Transformer Engine.

Fills the ``core_attention`` slot of megatron-core's local layer spec. Under
``PackedSeqParams(qkv_format="thd")`` megatron-core hands this module query
``[t, heads, dim]`` and key/value ``[t, groups, dim]`` for the whole flattened micro-batch
(RoPE already applied per segment from ``cu_seqlens``). Attention is causal *within each
segment* and zero across segments; segments of equal length are batched into one SDPA
call, so the cost follows the sum of squared segment lengths, never the square of the
pack length, and the Python loop runs once per distinct length, not once per sample.

Without packed parameters (``[s, b, heads, dim]``) every row is one causal sequence.
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

    Query head ``i`` reads key/value group ``i // (h // g)`` (megatron's GQA grouping).
    """
    t, heads, dim = query.shape
    groups = key.shape[1]
    bounds = cu_seqlens.tolist()
    starts, lengths = bounds[:-1], [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    out = query.new_empty(t, heads, dim)
    by_length: dict[int, list[int]] = {}
    for start, length in zip(starts, lengths):
        if length > 0:
            by_length.setdefault(length, []).append(start)
    for length, seg_starts in by_length.items():
        index = (torch.tensor(seg_starts, device=query.device)[:, None]
                 + torch.arange(length, device=query.device)[None, :])  # [n, length]
        # [n, length, h, d] -> [n, h, length, d]
        q = query[index].transpose(1, 2)
        k = key[index].transpose(1, 2)
        v = value[index].transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, dropout_p=dropout_p, enable_gqa=groups != heads
        )
        out[index] = o.transpose(1, 2)
    return out


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
        if config.context_parallel_size != 1:
            raise ValueError("context parallelism needs Transformer Engine (TEDotProductAttention)")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
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
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"packed attention expects qkv_format='thd', got {packed_seq_params.qkv_format!r}")
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            out = segment_causal_attention(query, key, value, cu, scale=self.scale, dropout_p=dropout_p)
            return out  # [t, h, d]; megatron reshapes to [t, 1, h*d]
        # [s, b, h, d] -> [b, h, s, d]
        s, b = query.shape[:2]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        o = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.scale, dropout_p=dropout_p, enable_gqa=self.groups != self.heads
        )
        return o.permute(2, 0, 1, 3).reshape(s, b, -1)

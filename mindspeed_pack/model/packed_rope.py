"""RoPE for packed (THD) batches by each token's position in its segment: no per-segment split, no sync.

megatron-core's unfused THD RoPE splits q and k per segment from ``cu_seqlens.tolist()`` in every
layer. Here the model's rotary table (``[S, 1, 1, rot]``, megatron-core's own, llama3 scaling
included) is gathered once per micro-batch at :attr:`~.thd.ThdParams.rope_positions` and every
layer applies the same half-split rotation as megatron-core's ``_apply_rotary_pos_emb_bshd``,
so the result is that of megatron-core's path, bit for bit.
"""
from __future__ import annotations

import torch

from mindspeed_pack.model.compiled import fused
from mindspeed_pack.model.thd import ThdParams, cached

ROPE_TABLE = "_rope_table"  # where PackedGPTModel leaves the micro-batch's rotary table in its ThdParams


def rope_cos_sin(params: ThdParams, dtype: torch.dtype):
    """Per-token cos/sin ``[t, 1, rot]`` in ``dtype`` for this micro-batch (computed once, by the first layer;
    again only if another model, with another rotary table, runs the same params); None where the model left
    RoPE to megatron-core (no table in ``params``)."""
    if not isinstance(params, ThdParams) or ROPE_TABLE not in params.__dict__:
        return None
    table = params.__dict__[ROPE_TABLE]  # [S, 1, 1, rot] fp32, megatron-core's rotary embedding
    store = cached(params, ("rope", dtype), dict)
    if store.get("table") is not table:
        freqs = table.reshape(table.shape[0], -1).index_select(0, params.rope_positions)[:, None, :]
        store.update(table=table, cos=torch.cos(freqs).to(dtype), sin=torch.sin(freqs).to(dtype))
    return store["cos"], store["sin"]


@fused
def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    x, rest = x[..., :rot], x[..., rot:]
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((x * cos + torch.cat((-x2, x1), dim=-1) * sin, rest), dim=-1)


def apply_packed_rope(query: torch.Tensor, key: torch.Tensor, params) -> tuple:
    """q ``[t, h, d]`` and k ``[t, g, d]`` rotated by their tokens' positions, when the model left RoPE to
    attention (megatron-core's half-split rotation, as its unfused ``_apply_rotary_pos_emb_bshd``)."""
    rope = rope_cos_sin(params, query.dtype)
    if rope is None:
        return query, key
    cos, sin = rope
    return _rotate(query, cos, sin), _rotate(key, cos, sin)

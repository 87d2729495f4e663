"""Transformer Engine layer spec: the only module that touches Transformer Engine.

TE's ``TEDotProductAttention`` runs packed (THD) fused attention from ``PackedSeqParams``
(cu_seqlens with a leading 0). It is used when TE imports and CUDA is present.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

try:  # decided once, at import
    import transformer_engine  # noqa: F401
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    HAVE_TE = True
except Exception:  # ImportError, or a TE build that does not match torch/CUDA
    HAVE_TE = False


def kernel_fallbacks() -> str:
    """What megatron-core falls back to without Transformer Engine or Apex (empty with TE): said once per run
    instead of megatron's six import-time warnings (hidden in ``mindspeed_pack/__init__.py``)."""
    import importlib.util

    if HAVE_TE:
        return ""
    if importlib.util.find_spec("apex"):
        return "Transformer Engine not installed: megatron-core uses Apex's fused optimizer and norms"
    return ("Transformer Engine and Apex not installed: megatron-core uses torch's AdamW (fused here), torch's "
            "norms and its local multi-tensor kernels")


def te_layer_spec(qk_layernorm: bool = False):
    """megatron-core's TE spec (fused layernorm-linear, TE fused attention)."""
    if not HAVE_TE:
        raise RuntimeError("Transformer Engine is not importable; install the [gpu] extra on a CUDA machine")
    return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)


def te_block_spec(config, vp_stage=None):
    """megatron-core's TE block spec for an MoE config: dense and MoE layers per
    ``config.moe_layer_freq``, experts as TE grouped GEMM under ``config.moe_grouped_gemm``."""
    if not HAVE_TE:
        raise RuntimeError("Transformer Engine is not importable; install the [gpu] extra on a CUDA machine")
    return get_gpt_decoder_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage)


def te_unfused_norm_and_linear():
    """(TE's norm, TE's column-parallel linear): what replaces a fused layer-norm + linear whose input an
    adapter must see normalised (LoRA on linear_qkv / linear_fc1)."""
    if not HAVE_TE:
        raise RuntimeError("Transformer Engine is not importable; install the [gpu] extra on a CUDA machine")
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm

    return TENorm, TEColumnParallelLinear

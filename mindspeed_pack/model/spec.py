"""Choose the transformer layer spec once, at model build: TE, flash or local packed attention.

Every spec accepts ``PackedSeqParams(qkv_format="thd")``. ``te``: Transformer Engine's layer
spec (fused THD attention). ``flash`` and ``local``: megatron-core's local spec with the
project's exact segment-causal core attention in its ``core_attention`` slot, PyTorch's varlen
FlashAttention (:mod:`.flash_attention`, CUDA) or bucketed SDPA (:mod:`.packed_attention`, any
device), so CPU runs are packed exactly like GPU runs. ``auto`` takes the first that can run
(TE, then flash, then local) and logs why. With ``--num-experts`` the MLP slot of
the MoE layers (``config.moe_layer_freq``) is megatron-core's ``MoELayer`` (local experts,
or TE grouped GEMM with ``--moe-grouped-gemm``) whose router slot holds the packing-aware
:class:`~.moe.PackedTopKRouter`.
"""
from __future__ import annotations

import copy
import logging

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from mindspeed_pack.model.flash_attention import FlashPackedAttention, flash_unavailable_reason
from mindspeed_pack.model.moe import PackedTopKRouter
from mindspeed_pack.model.norm import SequenceParallelTorchNorm
from mindspeed_pack.model.packed_attention import PackedDotProductAttention
from mindspeed_pack.model.parallel_linear import own_linears
from mindspeed_pack.model.te_spec import HAVE_TE, te_block_spec, te_layer_spec
from mindspeed_pack.runtime.platform import cuda_usable

log = logging.getLogger(__name__)

BACKENDS = ("auto", "te", "flash", "local")
CORE_ATTENTION = {"local": PackedDotProductAttention, "flash": FlashPackedAttention}


def local_packed_layer_spec(normalization: str = "RMSNorm", qk_layernorm: bool = False, num_experts=None,
                            backend: str = "local"):
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm,
                                                  num_experts=num_experts))
    if num_experts:
        spec.submodules.mlp.submodules.router = PackedTopKRouter
    spec.submodules.self_attention.submodules.core_attention = CORE_ATTENTION[backend]
    own_linears(spec.submodules)  # the row-parallel one warned (a graph break) per call; in-graph accumulation
    spec.submodules.input_layernorm = SequenceParallelTorchNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
    if qk_layernorm:
        spec.submodules.self_attention.submodules.q_layernorm = SequenceParallelTorchNorm
        spec.submodules.self_attention.submodules.k_layernorm = SequenceParallelTorchNorm
    return spec


def local_packed_block_spec(config, qk_layernorm: bool = False, vp_stage=None,
                            backend: str = "local") -> TransformerBlockSubmodules:
    """This pipeline stage's layers plus the final norm, all with the sequence-parallel-capable norm."""
    dense = local_packed_layer_spec(config.normalization, qk_layernorm, backend=backend)
    moe = local_packed_layer_spec(config.normalization, qk_layernorm, config.num_moe_experts, backend) \
        if config.num_moe_experts else dense
    return TransformerBlockSubmodules(layer_specs=_stage_layers(config, dense, moe, vp_stage),
                                      layer_norm=SequenceParallelTorchNorm)


def _stage_layers(config, dense, moe, vp_stage=None) -> list:
    """This stage's layer specs: MoE where ``config.moe_layer_freq`` says 1, dense elsewhere."""
    offset = get_transformer_layer_offset(config, vp_stage)
    pattern = config.moe_layer_freq if config.num_moe_experts else None
    return [moe if pattern and pattern[offset + i] else dense
            for i in range(get_num_layers_to_build(config, vp_stage))]


def resolve_backend(requested: str = "auto", dtype=None, attention_dropout: float = 0.0,
                    no_te: str = "", quiet: bool = False) -> str:
    """The attention backend to build for a model of ``dtype``; logs the choice and the reason (unless ``quiet``:
    a check of the flags before the build). ``no_te``: why this run cannot use Transformer Engine (``auto`` then
    skips it)."""
    import torch

    if requested not in BACKENDS:
        raise ValueError(f"unknown attention backend {requested!r}; choose one of {BACKENDS}")
    on_gpu = cuda_usable()
    no_flash = flash_unavailable_reason(dtype or torch.float32, on_gpu, attention_dropout)
    if requested == "te" and no_te:
        raise RuntimeError(f"--attention-backend te: {no_te}")
    if requested == "te" and not (HAVE_TE and on_gpu):
        raise RuntimeError("--attention-backend te needs Transformer Engine and a CUDA device")
    if requested == "flash" and no_flash:
        raise RuntimeError(f"--attention-backend flash: {no_flash}")
    if requested != "auto":
        why = "requested with --attention-backend"
    elif HAVE_TE and on_gpu and not no_te:
        requested, why = "te", "auto: Transformer Engine imports and a CUDA device is present"
    else:
        te = f"Transformer Engine skipped ({no_te})" if HAVE_TE and no_te else None
        if not no_flash:
            requested = "flash"
            why = f"auto: {te or 'CUDA without Transformer Engine'}, varlen FlashAttention available"
        else:
            requested = "local"
            why = "auto: " + ("no CUDA device" if not on_gpu else
                              f"{te or 'Transformer Engine is not importable (pip install -e .[gpu])'} and "
                              f"flash cannot run: {no_flash}")
    desc = {"te": "Transformer Engine fused attention (THD)",
            "flash": "varlen FlashAttention (torch.nn.attention.varlen, THD), RoPE by position",
            "local": "local spec with exact segment-causal SDPA (THD), RoPE by position"}[requested]
    if not quiet:
        log.info("attention backend %s: %s (%s)", requested, desc, why)
    return requested


def layer_spec(backend: str, config, qk_layernorm: bool = False, vp_stage=None):
    """The decoder spec for ``backend``: TE's layer spec, or the local block spec."""
    if backend == "te":
        if not config.num_moe_experts:
            return te_layer_spec(qk_layernorm=qk_layernorm)
        block = te_block_spec(config, vp_stage)  # megatron-core's: layers per moe_layer_freq, final TE norm
        for spec in block.layer_specs:
            if hasattr(spec.submodules.mlp.submodules, "router"):
                spec.submodules.mlp.submodules.router = PackedTopKRouter
        return block
    return local_packed_block_spec(config, qk_layernorm, vp_stage, backend)

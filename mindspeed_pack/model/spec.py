"""Choose the transformer layer spec once, at model build: TE on CUDA, else local + packed.

Both specs accept ``PackedSeqParams(qkv_format="thd")``; the local one gets the project's
exact segment-causal core attention (:mod:`.packed_attention`) in its ``core_attention``
slot, so CPU runs are packed exactly like GPU runs.
"""
from __future__ import annotations

import copy
import logging

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

from mindspeed_pack.model.packed_attention import PackedDotProductAttention
from mindspeed_pack.model.te_spec import HAVE_TE, te_layer_spec
from mindspeed_pack.platform import cuda_usable

log = logging.getLogger(__name__)

BACKENDS = ("auto", "te", "local")


def local_packed_layer_spec(normalization: str = "RMSNorm", qk_layernorm: bool = False):
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm))
    spec.submodules.self_attention.submodules.core_attention = PackedDotProductAttention
    return spec


def resolve_backend(requested: str = "auto") -> str:
    if requested not in BACKENDS:
        raise ValueError(f"unknown attention backend {requested!r}; choose one of {BACKENDS}")
    if requested == "auto":
        return "te" if (HAVE_TE and cuda_usable()) else "local"
    if requested == "te" and not (HAVE_TE and cuda_usable()):
        raise RuntimeError("--attention-backend te needs Transformer Engine and a CUDA device")
    return requested


def layer_spec(backend: str, normalization: str = "RMSNorm", qk_layernorm: bool = False):
    if backend == "te":
        log.info("attention: Transformer Engine fused attention (THD)")
        return te_layer_spec(qk_layernorm=qk_layernorm)
    log.info("attention: local spec with exact segment-causal SDPA (THD)")
    return local_packed_layer_spec(normalization, qk_layernorm)

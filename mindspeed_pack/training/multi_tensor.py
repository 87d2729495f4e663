"""megatron-core's multi-tensor kernels on torch's ``_foreach`` ops when neither TE nor Apex brings them.

Without Transformer Engine or Apex, megatron-core falls back to ``local_multi_tensor_l2_norm``: a
``torch.norm`` per gradient tensor, then ``torch.tensor`` of those device scalars (one device-to-host read
per tensor: ~200 per step at 0.5B, each stalling the CPU until the GPU drains), and to
``local_multi_tensor_scale``: two kernels per tensor. The replacements compute the same values with one
foreach kernel per list and leave the norm on the device; megatron's ``get_grad_norm_fp32`` reads it
once per step, as with Apex (on a CPU summed in fp64: its fp32 norm kernel adds the squares in sequence).
Clipping multiplies by the same fp32 coefficient (bit for bit the same).
"""
from __future__ import annotations

import logging

import torch

from mindspeed_pack.runtime.platform import cuda_usable

log = logging.getLogger(__name__)


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``amp_C.multi_tensor_l2norm``'s contract: (the L2 norm of every tensor of every list as a [1] fp32
    device tensor, None)."""
    tensors = [t for tensors in tensor_lists for t in tensors]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device="cuda" if cuda_usable() else "cpu"), None
    # the CPU's fp32 norm adds the squares one after another: 9e-6 relative error on a 1M-element gradient, so the
    # same gradients logged other norms at TP1 and TP2; summed in fp64 there (a GPU's reduction is a tree already)
    dtype = torch.float64 if tensors[0].device.type == "cpu" else None
    norms = torch._foreach_norm(tensors, 2, dtype=dtype)
    return torch.linalg.vector_norm(torch.stack(norms)).float().reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``amp_C.multi_tensor_scale``'s contract: ``dst = src * scale`` per pair of the two lists (in place when
    they are the same tensors; dtype converted as ``copy_`` converts)."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if not src:
        return
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, src if scale == 1.0 else torch._foreach_mul(src, scale))


def use_foreach_kernels() -> bool:
    """Put the foreach kernels where megatron-core installed its local fallbacks; returns whether it did."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer

    replaced = False
    for module, name, local, ours in ((clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm, foreach_l2_norm),
                                      (clip_grads, "multi_tensor_scale_impl", utils.local_multi_tensor_scale,
                                       foreach_scale),
                                      (megatron_optimizer, "multi_tensor_scale_impl", utils.local_multi_tensor_scale,
                                       foreach_scale)):
        if getattr(module, name, None) is local:
            setattr(module, name, ours)
            replaced = True
    if replaced:
        log.info("gradient norm and scaling: torch's foreach kernels (no Transformer Engine or Apex multi-tensor "
                 "kernels; megatron-core's fallback reads every gradient's norm back separately)")
    return replaced

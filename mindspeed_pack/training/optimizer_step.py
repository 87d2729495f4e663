"""The optimizer step, stopped before the update when the gradient norm is not finite.

megatron-core's ``optimizer.step()`` prepares the gradients (the fp32 main gradients; under ``--fp16`` unscaled
and checked by the loss scaler), computes their norm, clips and updates, in that order, and updates even with
an inf/NaN gradient unless a loss scaler is there to skip it. A non-finite gradient has a non-finite norm, so
the norm megatron computes anyway (one read per step, the only one) decides: :func:`guarded_step` runs those
same pieces of megatron-core's optimizer (``prepare_grads``, ``get_grad_norm``, ``clip_grad_by_total_norm_fp32``,
``step_with_ready_grads``: its own ``step`` in that order) and stops before the update when the norm is not
finite. Which parameter's gradient was bad is looked up only then (:func:`non_finite_grad_name`); no pass over
the gradient buffers, no buffer-sized boolean tensor, in a healthy step.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

from mindspeed_pack.training.precision import scaler_owns_overflow


def _leaf_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


@torch.no_grad()
def guarded_step(optimizer) -> Tuple[bool, Optional[float], bool]:
    """(updated, gradient norm, non-finite gradient). Under --fp16 dynamic loss scaling an overflow is the
    scaler's (it skipped the update and lowered the scale, as in Megatron-LM): not reported as non-finite."""
    if optimizer.prepare_grads():  # a loss scaler found inf/NaN in the unscaled gradients
        return False, None, not scaler_owns_overflow(optimizer)
    grad_norm = optimizer.get_grad_norm()  # every rank of the gradient-statistics group gets the same value
    if not math.isfinite(grad_norm):
        return False, grad_norm, True
    for leaf in _leaf_optimizers(optimizer):
        params = leaf.get_parameters()
        if leaf.config.clip_grad > 0.0 and params and not getattr(leaf, "is_stub_optimizer", False):
            clip_grad_by_total_norm_fp32(params, max_norm=leaf.config.clip_grad, total_norm=grad_norm,
                                         use_decoupled_grad=leaf.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    return optimizer.step_with_ready_grads(), grad_norm, False


def non_finite_grad_name(model_chunks) -> str:
    """The first parameter (with its rank) whose gradient holds inf/NaN, agreed by every rank; called only
    after a step found a non-finite gradient norm."""
    name = None
    for chunk in model_chunks:
        for n, p in chunk.module.named_parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None and not bool(torch.isfinite(g).all()):
                name = f"{n} on rank {dist.get_rank()}"
                break
        if name:
            break
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, name)
    return next((n for n in names if n), "unknown parameter")

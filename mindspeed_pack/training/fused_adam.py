"""Fused AdamW when megatron-core falls back to torch's optimizer (no Transformer Engine, no Apex).

megatron-core then builds ``torch.optim.AdamW`` without ``fused``: on a GPU that is torch's
multi-tensor path, which keeps the step counters on the host and launches several kernels per
parameter group; on a CPU it reads every parameter's step counter back as a Python number.
torch's fused AdamW (CUDA and CPU) updates all parameters in one kernel per dtype with the
step counters on the device: the same update, fewer launches and no per-parameter reads.
Applied after a checkpoint load too (a loaded optimizer takes the saved groups' settings).
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)
_LOGGED = False


def _torch_optimizers(optimizer):
    """The torch optimizers inside megatron's (chained, mixed-precision, distributed) wrappers."""
    for chained in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(chained, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            yield inner


def use_fused_adam(optimizer) -> bool:
    """Switch every torch Adam/AdamW inside ``optimizer`` to ``fused=True`` where every parameter allows it.

    Existing step counters move to the parameters' devices as fused AdamW keeps them. Returns whether
    any optimizer was switched."""
    global _LOGGED
    switched = False
    for inner in _torch_optimizers(optimizer):
        if not isinstance(inner, torch.optim.Adam):  # AdamW subclasses Adam
            continue
        params = [p for g in inner.param_groups for p in g["params"]]
        if not params or any(not p.is_floating_point() for p in params) or \
                any(g.get("differentiable") or g.get("capturable") for g in inner.param_groups):
            continue
        for group in inner.param_groups:
            group["fused"], group["foreach"] = True, False
        for p in params:
            state = inner.state.get(p)
            if state and "step" in state:
                state["step"] = torch.as_tensor(state["step"], dtype=torch.float32).to(p.device)
        inner._step_supports_amp_scaling = True
        switched = True
    if switched and not _LOGGED:
        log.info("optimizer: torch's fused AdamW (one kernel per dtype, step counters on the device)")
        _LOGGED = True
    return switched

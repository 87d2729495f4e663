"""Small elementwise regions fused by ``torch.compile`` on a GPU, eager everywhere else.

Without Transformer Engine every elementwise step of RoPE and of the loss's softmax is its own
kernel launch (and its own pass over memory). ``torch.compile`` fuses each such region into one
kernel. It is used only where it cannot change what is computed (pure elementwise math, no
collectives inside) and only on CUDA; if compiling fails the region runs eagerly, with a warning,
so a missing compiler never stops a run. ``--torch-compile-kernels off`` keeps everything eager.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

log = logging.getLogger(__name__)
_ENABLED = {"value": True}


def set_enabled(enabled: bool) -> None:
    """``--torch-compile-kernels``: on (default, CUDA only) or off."""
    _ENABLED["value"] = bool(enabled)


def fused(fn: Callable) -> Callable:
    """``fn`` compiled on first use with CUDA tensors (else ``fn`` itself)."""
    state = {"compiled": None, "failed": False}

    def call(*args):
        if not (_ENABLED["value"] and not state["failed"] and args[0].is_cuda):
            return fn(*args)
        if state["compiled"] is None:
            state["compiled"] = torch.compile(fn, dynamic=True)
        try:
            return state["compiled"](*args)
        except Exception as e:  # a compiler problem (no Triton, an unsupported driver): run eagerly from now on
            state["failed"] = True
            log.warning("torch.compile of %s failed (%s: %s); running it eagerly", fn.__name__, type(e).__name__, e)
            return fn(*args)

    call.__name__ = fn.__name__
    call.__doc__ = fn.__doc__
    return call

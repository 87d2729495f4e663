"""Small elementwise regions fused by ``torch.compile`` on a GPU, eager everywhere else.

Without Transformer Engine every elementwise step of RoPE and of the loss's softmax is its own
kernel launch (and its own pass over memory). ``torch.compile`` fuses each such region into one
kernel. It is used only where it cannot change what is computed (pure elementwise math, no
collectives inside) and only on CUDA. ``--torch-compile-kernels off`` keeps everything eager.

A compile failure is never turned into a silently slower run. The first CUDA call of a region
compiles it and runs its forward and, when the call records a graph, its backward once on copies of
the inputs (``torch.compile`` compiles a backward lazily, at the first backward: a Triton failure there
would otherwise surface mid-step, far from its cause). A failure is retried once with a fresh
compilation, then stops the run with an error that names the region and ``--torch-compile-kernels
off``. What goes wrong *running* a compiled region (a CUDA out-of-memory, say) is the step's error,
raised as it is: the region stays compiled.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

log = logging.getLogger(__name__)
_ENABLED = {"value": True}
ATTEMPTS = 2


class CompileError(RuntimeError):
    """A region could not be compiled (twice)."""


def set_enabled(enabled: bool) -> None:
    """``--torch-compile-kernels``: auto (default: compiled on CUDA) or off."""
    _ENABLED["value"] = bool(enabled)


def _probe(compiled: Callable, args) -> None:
    """Run ``compiled`` forward (and backward, if this call records a graph) on detached copies of ``args``."""
    inputs = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]
    out = compiled(*inputs)
    outputs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
               if isinstance(o, torch.Tensor) and o.requires_grad]
    leaves = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]
    if torch.is_grad_enabled() and outputs and leaves:
        torch.autograd.grad(outputs, leaves, [torch.ones_like(o) for o in outputs], allow_unused=True)


def _compile_checked(fn: Callable, args) -> Callable:
    """``torch.compile(fn)``, compiled and run forward and backward once; retried once, then a :class:`CompileError`."""
    error = None
    for attempt in range(1, ATTEMPTS + 1):
        # static sizes first (torch's default): a region compiled with symbolic sizes from the start ran its
        # kernels several times slower on an H200 (megatron-core's compiled SwiGLU backward, once recompiled
        # with symbolic sizes: 0.63 ms per call at Qwen2.5-1.5B against < 0.19 ms static). A region called at a
        # second shape (the loss's last chunk) is recompiled once, with symbolic sizes, for the others
        compiled = torch.compile(fn)
        try:
            _probe(compiled, args)
            return compiled
        except torch.OutOfMemoryError:
            raise  # the device is full: not a compiler problem
        except Exception as e:  # a compiler problem (Triton, the driver, a missing toolchain)
            error = e
            log.warning("torch.compile of %s failed (attempt %d of %d): %s: %s", fn.__name__, attempt, ATTEMPTS,
                        type(e).__name__, e)
    raise CompileError(f"torch.compile of {fn.__name__} failed {ATTEMPTS} times ({type(error).__name__}: {error}); "
                       "pass --torch-compile-kernels off to run the elementwise regions eagerly") from error


def fused(fn: Callable) -> Callable:
    """``fn`` compiled (and checked) on first use with CUDA tensors, else ``fn`` itself."""
    state = {"compiled": None}

    def call(*args):
        # inside a layer compiled whole (--torch-compile-kernels layers) the region is traced with the layer
        if not (_ENABLED["value"] and args[0].is_cuda) or torch.compiler.is_compiling():
            return fn(*args)
        if state["compiled"] is None:
            state["compiled"] = _compile_checked(fn, args)
        return state["compiled"](*args)

    call.__name__ = fn.__name__
    call.__doc__ = fn.__doc__
    return call

"""Weight gradients accumulated into the fp32 ``main_grad`` inside the matmul, without Apex or Transformer Engine.

megatron-core's linear layers form a weight gradient in the weight's dtype (bf16) and its DDP hook then adds it
into the fp32 ``main_grad`` buffer: one more kernel and about 10 bytes per parameter per micro-batch. With
``gradient_accumulation_fusion`` they call Apex's ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32``
instead, which Apex alone provides (TE's layers do it themselves). On an H200 at Qwen2.5-1.5B the separate adds
were 1,584 launches and 47 ms of an 847 ms step (docs/gpu.md).

torch's ``addmm`` takes an output dtype on CUDA (bf16 products summed in fp32, written into the fp32 buffer, no
bf16 rounding of the gradient on its way): :func:`install` puts a module of that name in front of megatron-core,
after checking the operation on the device once (a torch without it, or a wrong result, leaves megatron-core as it
was and says why). The sum is then more exact than the unfused path's (the bf16 rounding of each micro-batch's
gradient is gone); in fp32 it is the same sum. Installed on CUDA only, where it pays; a test installs it on a CPU
(:func:`install` with ``probe=False``), where it computes the same sum with fp32 matmuls.

Inside a layer compiled whole (``--torch-compile-kernels layers``) megatron-core's fused backward cannot run:
it sets attributes of the weight, which dynamo cannot trace. The linear of :mod:`.traced_linear` calls
:func:`accumulate_traced` instead, and the ``grad_added_to_main_grad`` mark that tells the DDP hook not to add
the weight's (uninitialised) gradient is set before the layer runs (:func:`mark_accumulated`), outside the
traced code.
"""
from __future__ import annotations

import logging
import sys
import types
from typing import Optional

import torch

log = logging.getLogger(__name__)
MODULE = "fused_weight_gradient_mlp_cuda"
_STATE = {"installed": False, "why_not": None}


def accumulate(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ total_input`` (megatron-core passes [tokens, in] and [tokens, out])."""
    x = total_input.reshape(-1, total_input.shape[-1])
    g = grad_output.reshape(-1, grad_output.shape[-1])
    if g.dtype == main_grad.dtype:
        main_grad.addmm_(g.t(), x)
    elif main_grad.is_cuda:
        torch.addmm(main_grad, g.t(), x, out_dtype=main_grad.dtype, out=main_grad)
    else:  # the same sum where addmm has no output dtype (a CPU)
        main_grad.addmm_(g.t().to(main_grad.dtype), x.to(main_grad.dtype))


def _accumulate_op(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    accumulate(total_input, grad_output, main_grad)


# Defined through the dispatcher's own library API, not ``torch.library.custom_op``: a compiled backward calls it
# once per linear per micro-batch, and custom_op's Python autograd and in-place wrappers cost ~9 us of host time a
# call where this costs ~1 (the host time is what bounds a small model's step on a GPU). No gradient flows through
# it (it runs inside a backward); the dispatcher's autograd fallback bumps ``main_grad``'s version, as for any
# mutating op without a derivative.
_LIB = torch.library.Library("mindspeed_pack", "DEF")
_LIB.define("wgrad_accumulate(Tensor total_input, Tensor grad_output, Tensor(a!) main_grad) -> ()")
_LIB.impl("wgrad_accumulate", _accumulate_op, "CompositeExplicitAutograd")


@torch.library.register_fake("mindspeed_pack::wgrad_accumulate", lib=_LIB)
def _(total_input, grad_output, main_grad) -> None:
    return None


def accumulate_traced(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """:func:`accumulate` as an operation a compiled graph holds: opaque to inductor, which calls it in place
    (it declares the ``main_grad`` it mutates)."""
    torch.ops.mindspeed_pack.wgrad_accumulate(total_input, grad_output, main_grad)


def mark_accumulated(weights) -> None:
    """Tell megatron-core's DDP hook that these weights' gradients go into ``main_grad`` in the backward (what
    its fused backward sets itself; reset by every ``zero_grad_buffer``)."""
    for weight in weights:
        weight.grad_added_to_main_grad = True


def _probe(device: str, dtype: torch.dtype = torch.bfloat16) -> Optional[str]:
    """Why the fused accumulation of ``dtype`` gradients cannot run on ``device`` (None: it runs and sums right)."""
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(64, 48, device=device, generator=gen).to(dtype)
        g = torch.randn(64, 32, device=device, generator=gen).to(dtype)
        main = torch.randn(32, 48, device=device, generator=gen)
        want = main + g.t().float() @ x.float()
        accumulate(x, g, main)
    except Exception as e:  # a torch without addmm's output dtype on this device
        return f"{type(e).__name__}: {e}"
    error = float((main - want).abs().max() / want.abs().max())
    return None if error < 1e-4 else f"the accumulated gradient is off by {error:.2e}"


def install(probe: bool = True, device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> bool:
    """Provide ``fused_weight_gradient_mlp_cuda`` to megatron-core (unless Apex already does) for a model of
    ``dtype``; True if in place."""
    if _STATE["installed"]:
        return True
    if _STATE["why_not"] is not None:
        return False
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401  (Apex: megatron-core uses it as it is)
        _STATE["installed"] = True
        return True
    except ImportError:
        pass
    why = _probe(device, dtype) if probe else None
    if why:
        _STATE["why_not"] = why
        log.warning("gradient-accumulation fusion off (weight gradients added into main_grad by a separate "
                    "kernel): %s", why)
        return False
    shim = types.ModuleType(MODULE)
    shim.__doc__ = __doc__
    shim.wgrad_gemm_accum_fp32 = accumulate
    shim.wgrad_gemm_accum_fp16 = accumulate
    sys.modules[MODULE] = shim
    from megatron.core.tensor_parallel import layers

    layers.fused_weight_gradient_mlp_cuda = shim
    layers._grad_accum_fusion_available = True
    _STATE["installed"] = True
    return True


def installed() -> bool:
    return _STATE["installed"]


def uninstall() -> None:
    """Back to megatron-core's own state (tests)."""
    if getattr(sys.modules.get(MODULE), "wgrad_gemm_accum_fp32", None) is accumulate:
        del sys.modules[MODULE]
        from megatron.core.tensor_parallel import layers

        layers._grad_accum_fusion_available = False
    _STATE.update(installed=False, why_not=None)

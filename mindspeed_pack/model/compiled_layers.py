"""``--torch-compile-kernels layers`` (and ``auto``, the default, on CUDA wherever it can): every transformer layer's
forward compiled whole, and with it its backward.

Why: at one 4096-token pack per forward, Qwen2.5-0.5B's step on an H200 is bound by the host. Each layer
dispatches some 180 ATen ops per micro-batch through megatron-core's modules and autograd functions, each op
some microseconds of Python and dispatcher, while the GPU idles half of the step (docs/gpu.md). Compiled
whole (dynamo + inductor), a layer's forward is one graph and its backward one more: inductor fuses the
elementwise work (norms, RoPE, SwiGLU, bias and residual adds) into a few kernels and launches them from
generated code, and megatron-core's Python runs once, at tracing.

- **One graph or an error.** ``fullgraph=True``: a construct dynamo cannot trace stops the first call with an
  error naming this flag, never a layer silently split into pieces (Python branching on a device value is
  such a break); so does passing the recompile limit.
- **Shared code, one compilation.** All layers run one compiled code (their parameters are graph inputs). The
  token count stays static (the kernels inductor picks for it); a pack's segment count (the length of
  ``cu_seqlens``), its longest segment (the kernel's host integers, the rotary table's length) are symbolic
  from the first call: one compilation per run, one more for a no-grad forward (evaluation, DPO's reference)
  and one more under LoRA (the frozen embedding hands the first layer an input that needs no gradient).
- **What it covers.** Dense layers with the ``flash`` backend (PyTorch's varlen FlashAttention is a traceable
  custom op; the ``local`` backend plans its buckets on the host), without context parallelism (its
  key/value exchange plans on the host). The layer's linears (:mod:`.parallel_linear`) run megatron-core's
  linear in a form dynamo traces (:mod:`.traced_linear`): tensor parallelism, with or without sequence
  parallelism, communicates through functional collectives inside the graph, and the gradient-accumulation
  fusion (:mod:`.wgrad_fusion`) adds into ``main_grad`` there (megatron-core's own backward starts
  asynchronous collectives and sets attributes of the weight, which dynamo cannot trace). Pipeline and data
  parallelism, several packs per forward, LoRA and the preference stages sit outside the traced code or trace
  with it. Anything else is refused before the model is built, with the reason.
- The small regions of :mod:`.compiled` inside a layer are traced inline; the loss's stay compiled apart.
- Under a Python dispatch mode (the op and host-sync counters of the tests and benches) a layer runs eagerly:
  such a mode must see every op, and dynamo traces nothing under one.
"""
from __future__ import annotations

import logging

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from mindspeed_pack.model import packed_rope, parallel_linear, traced_mappings, wgrad_fusion

log = logging.getLogger(__name__)

FLAG = "--torch-compile-kernels layers"
# training, a no-grad forward and LoRA's first layer each compile once; headroom for differences no test has
# seen yet, never the silent eager fallback dynamo takes past its limit
RECOMPILE_LIMIT = 16
# a pack's longest segment (the flash kernel's host integers), different in nearly every micro-batch
MAX_SEQLEN_SOURCES = r".*packed_seq_params.*\.max_seqlen_(q|kv)$"


class LayerCompileError(RuntimeError):
    """A transformer layer could not be compiled whole."""


def unsupported_reason(args, backend: str) -> str:
    """Why this run cannot compile its layers whole ("" if it can); the layout's reasons before the backend's."""
    if getattr(args, "num_experts", None):
        return "MoE layers route tokens by data-dependent counts (host reads)"
    if getattr(args, "context_parallel_size", 1) > 1 or \
            getattr(args, "sequence_packing_scheduler", None) == "default_dynamic_cp":
        return "context parallelism runs collectives inside attention"
    if getattr(args, "recompute_granularity", None) == "selective":
        return ("selective recomputation checkpoints modules inside the layer (megatron-core's checkpoint function, "
                "which dynamo cannot trace); --recompute-granularity full can")
    if getattr(args, "overlap_param_gather", False):
        return ("--overlap-param-gather waits for each module's parameters in a forward pre-hook that a layer "
                "compiled whole would guard on its own parameters (one compilation per layer)")
    if backend != "flash":
        return (f"needs --attention-backend flash (this run's is {backend!r}: the local backend plans its "
                f"buckets on the host, Transformer Engine's modules are not traced)")
    return ""


def check_supported(args, backend: str) -> None:
    why = unsupported_reason(args, backend)
    if why:
        raise ValueError(f"{FLAG}: {why}; use --torch-compile-kernels auto")


COMPILE_WORDS = {
    "layers": "every transformer layer whole, forward and backward (compiled in the first steps)",
    "regions": "RoPE's and the loss's elementwise regions, on CUDA (eager on a CPU)",
    "off": "off (every op eager)",
}


def plan_line(args) -> str:
    """What ``--torch-compile-kernels`` compiles, for ``--dry-run`` (on a machine that may have no GPU: ``auto`` is
    said for CUDA and the flash backend, the layout's reason to keep the regions named)."""
    requested = getattr(args, "torch_compile_kernels", "auto")
    if requested != "auto":
        return f"torch.compile: {COMPILE_WORDS[requested]}"
    why = unsupported_reason(args, "flash")
    on_cuda = (f"RoPE's and the loss's elementwise regions (layers not compiled whole: {why})" if why else
               "every transformer layer whole, forward and backward, with the flash backend (RoPE's and the "
               "loss's elementwise regions with another)")
    return f"torch.compile (auto): on CUDA {on_cuda}; eager on a CPU"


def resolve_mode(args, backend: str, on_gpu: bool) -> tuple:
    """``--torch-compile-kernels`` as this run applies it, and why: ``layers`` (every layer compiled whole),
    ``regions`` (RoPE's and the loss's elementwise regions, compiled on CUDA, eager on a CPU) or ``off``.

    ``auto`` (the default) compiles the layers whole on CUDA wherever they can be: on an H200 at Qwen2.5-0.5B and
    1.5B shapes that ran 2.29x and 1.32x the regions' real tokens/s (docs/gpu.md). On a CPU it keeps the regions
    (eager there): compiling each layer costs a CPU run more than it saves in a short job or a test."""
    requested = getattr(args, "torch_compile_kernels", "auto")
    if requested != "auto":
        return requested, "requested with --torch-compile-kernels"
    if not on_gpu:
        return "regions", "auto: no CUDA device, the regions run eagerly"
    why = unsupported_reason(args, backend)
    return ("regions", f"auto: the layers cannot be compiled whole: {why}") if why else \
        ("layers", "auto: CUDA, flash backend, a layout a layer compiles whole in")


def compile_layers(model: torch.nn.Module) -> int:
    """Compile the forward of every ``TransformerLayer`` in ``model`` whole; returns how many."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    traced_mappings.install()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    _dynamic_from_the_start(MAX_SEQLEN_SOURCES)
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    accumulated = 0
    for layer in layers:
        linears = parallel_linear.traceable_linears(layer)
        for linear in linears:
            linear.traced = True
        fused = [linear.weight for linear in linears if linear.gradient_accumulation_fusion]
        accumulated += len(fused)
        layer.forward = _compiled_forward(layer, fused)
    log.info("%s: %d transformer layers compiled whole (at their first call)%s", FLAG, len(layers),
             f"; {accumulated} linears accumulate their weight gradients in the graph" if accumulated else "")
    return len(layers)


# The generated code checks every input's sizes and strides on every call (host time on each layer's call, ~4% of
# a compiled layer's on the CPU stand-in of bench/bench_host_time.py); dynamo's guards check the same before the
# code runs, so the checks are dropped.
INDUCTOR_OPTIONS = {"size_asserts": False}


def _dynamic_from_the_start(pattern: str) -> None:
    """Mark the sources matching ``pattern`` dynamic at the first compilation (dynamo's allowlist of dynamic
    sources), where dynamo would compile them static first and again, symbolic, once they change."""
    sources = [s for s in torch.compiler.config.dynamic_sources.split(",") if s]
    if pattern not in sources:
        torch.compiler.config.dynamic_sources = ",".join([*sources, pattern])


def _steady_inputs(kwargs: dict) -> None:
    """The inputs as every call will look, so one compilation serves them all: the first layer's input (the
    embedding's transposed view) takes the strides the other layers' inputs have; the micro-batch's RoPE
    cos/sin are built before any layer (every layer finds them cached, where dynamo would guard on the cache
    being empty for the first); a pack's segment count (the length of ``cu_seqlens``) and the rotary table's
    length (its longest segment) are symbolic from the start."""
    hidden = kwargs.get("hidden_states")
    if hidden is not None and hidden.stride() != _contiguous_strides(hidden.shape):
        kwargs["hidden_states"] = hidden.clone(memory_format=torch.contiguous_format)
    params = kwargs.get("packed_seq_params")
    if params is None:
        return
    if hidden is not None:
        packed_rope.rope_cos_sin(params, hidden.dtype)
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        cu = getattr(params, name, None)
        if isinstance(cu, torch.Tensor):
            torch._dynamo.maybe_mark_dynamic(cu, 0)
    table = params.__dict__.get(packed_rope.ROPE_TABLE)
    if isinstance(table, torch.Tensor):
        torch._dynamo.maybe_mark_dynamic(table, 0)


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _compiled_forward(layer, accumulated=()):
    """``accumulated``: the weights whose gradients the layer's backward adds into ``main_grad`` itself."""
    eager = layer.forward
    compiled = torch.compile(eager, fullgraph=True, options=INDUCTOR_OPTIONS)

    def forward(*args, **kwargs):
        if accumulated and torch.is_grad_enabled():
            wgrad_fusion.mark_accumulated(accumulated)
        if is_in_torch_dispatch_mode(include_infra_modes=False):
            # a Python dispatch mode (the host-sync and op counters of tools/host_syncs.py and the benches) sees
            # every op, which compiled code would hide: dynamo traces nothing under one. The layer runs eagerly
            return eager(*args, **kwargs)
        _steady_inputs(kwargs)
        try:
            return compiled(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as e:
            raise LayerCompileError(
                f"{FLAG}: transformer layer {layer.layer_number} could not be compiled whole "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); run with "
                f"--torch-compile-kernels regions") from e

    return forward

"""What precision and overlap a run actually uses, read from the built model and optimizer.

Flags say what was asked; this record says what was built (parameter, gradient and master
dtypes, the optimizer class, loss scaling, attention backend, fused kernels, overlap), so a
log or metrics file shows, e.g., that a run said ``--bf16`` and really kept fp32 masters.
"""
from __future__ import annotations

import torch
from megatron.core.utils import get_model_config



def _dtype_names(tensors) -> str:
    names = sorted({str(t.dtype).replace("torch.", "") for t in tensors if t is not None})
    return "/".join(names) if names else "none"


def _leaf_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def grad_scaler(optimizer):
    """The optimizer's loss scaler (megatron-core's Dynamic/ConstantGradScaler), None without one."""
    leaves = _leaf_optimizers(optimizer)
    return getattr(leaves[0], "grad_scaler", None) if leaves else None


def scaler_owns_overflow(optimizer) -> bool:
    """True under --fp16 dynamic loss scaling: an inf/NaN gradient is then the scaler's business
    (the optimizer skips the step and lowers the scale, as in Megatron-LM), not a failed step."""
    return hasattr(grad_scaler(optimizer), "hysteresis")


def loss_scale(optimizer) -> float:
    """The current loss scale (1.0 without scaling), as Megatron-LM's log prints it."""
    scaler = grad_scaler(optimizer)
    return float(scaler.scale.item()) if scaler is not None else 1.0


def _master_dtype(opt) -> str:
    groups = getattr(opt, "shard_fp32_from_float16_groups", None) or getattr(opt, "fp32_from_float16_groups", None)
    if groups:
        return _dtype_names(p for g in groups for p in g)
    return "none (the optimizer updates the parameters themselves)"


def _context_parallel(config, backend) -> str:
    cp = config.context_parallel_size
    if cp == 1:
        return "none"
    how = f"TE {config.cp_comm_type}" if backend == "te" else f"all-gather keys/values ({backend} attention)"
    return f"{cp} ranks, zigzag per sample, {how}"


def precision_record(args, model_chunks, optimizer) -> dict:
    """One JSON-able dict describing the run's numerics (for the log and the metrics file)."""
    chunk = model_chunks[0]
    config = get_model_config(chunk)
    params = [p for c in model_chunks for p in c.parameters()]
    leaves = _leaf_optimizers(optimizer)
    scaler = grad_scaler(optimizer)
    if scaler is None:
        loss_scaling = "none"
    elif scaler_owns_overflow(optimizer):
        loss_scaling = (f"dynamic (initial {loss_scale(optimizer):g}, hysteresis {scaler.hysteresis}, "
                        f"window {scaler.growth_interval}, min {float(scaler.min_scale.item()):g})")
    else:
        loss_scaling = f"constant {loss_scale(optimizer):g}"
    ddp_config = chunk.ddp_config
    return {
        "params": _dtype_names(params),
        "grads (main_grad buffers)": _dtype_names(getattr(p, "main_grad", None) for p in params),
        "master weights": _master_dtype(leaves[0]) if leaves else "none",
        "optimizer": "+".join(sorted({type(o).__name__ for o in leaves})),
        "loss scaling": loss_scaling,
        "attention backend": getattr(chunk.module, "attention_backend", None),
        "attention softmax in fp32": bool(config.attention_softmax_in_fp32),
        "fused kernels": {name: bool(getattr(config, name)) for name in (
            "masked_softmax_fusion", "bias_dropout_fusion", "bias_activation_fusion", "apply_rope_fusion",
            "gradient_accumulation_fusion", "persist_layer_norm")},
        "sequence parallel": bool(config.sequence_parallel),
        "context parallel": _context_parallel(config, getattr(chunk.module, "attention_backend", None)),
        "distributed optimizer": bool(ddp_config.use_distributed_optimizer),
        "overlap grad reduce": bool(ddp_config.overlap_grad_reduce),
        "overlap param gather": bool(ddp_config.overlap_param_gather),
        "grad reduce in fp32": bool(ddp_config.grad_reduce_in_fp32),
        "device": "cuda" if torch.cuda.is_available() and params and params[0].is_cuda else "cpu",
    }

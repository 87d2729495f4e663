"""The local spec's norm: torch's RMSNorm/LayerNorm, usable with sequence parallelism.

megatron-core's ``WrappedTorchNorm`` (its local-spec norm without Apex or TE) refuses
``sequence_parallel``. Under sequence parallelism a norm sees only this rank's slice of the
sequence, so its weight gradient is partial; megatron's ``finalize_model_grads`` sums such
gradients over the tensor-parallel group for every parameter marked ``sequence_parallel``,
exactly as it does for Apex's and TE's norms. This norm sets that mark, and is built in the
model's parameter dtype.
"""
from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


class SequenceParallelTorchNorm:
    """Build ``torch.nn.RMSNorm`` or ``torch.nn.LayerNorm`` (per ``config.normalization``)."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        if config.layernorm_zero_centered_gamma:
            raise ValueError("zero-centred gamma needs Transformer Engine's or Apex's norm (use --attention-backend te)")
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(f"normalization {config.normalization!r}: choose RMSNorm or LayerNorm")
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm

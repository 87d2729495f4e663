"""Llama-3.1/3.2 RoPE scaling ("llama3" rope_type), exactly as transformers computes it.

The inverse frequencies are divided by ``factor`` for wavelengths longer than
``original_max_position_embeddings / low_freq_factor``, kept for those shorter than
``original / high_freq_factor``, and interpolated between. megatron-core 0.16.1's
``RotaryEmbedding(rope_scaling=True)`` applies the same formula but with ``low=1``,
``high=4`` and ``original=8192`` fixed (what Llama-3.1/3.2 ship): it is used when a
config has exactly those, else this module scales the model's inverse frequencies itself
(a config with another original context, e.g. a tiny test model, stays exact).
"""
from __future__ import annotations

import math

import torch

# the constants megatron-core 0.16.1 hard-codes in RotaryEmbedding._apply_scaling
MCORE_LLAMA3_CONSTANTS = (1.0, 4.0, 8192)


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: int) -> torch.Tensor:
    """Scaled inverse frequencies (transformers' ``_compute_llama3_parameters``)."""
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _mcore_matches(args) -> bool:
    return (float(args.low_freq_factor), float(args.high_freq_factor),
            int(args.original_max_position_embeddings)) == MCORE_LLAMA3_CONSTANTS


def gpt_model_rope_kwargs(args) -> dict:
    """``GPTModel`` keywords: megatron-core's own llama3 scaling when its constants are the config's."""
    if getattr(args, "use_rope_scaling", False) and _mcore_matches(args):
        return {"rope_scaling": True, "rope_scaling_factor": float(args.rope_scaling_factor)}
    return {}


def scale_rotary_embedding(model, args) -> None:
    """Scale ``model``'s RoPE inverse frequencies here when megatron-core's constants differ."""
    if not getattr(args, "use_rope_scaling", False) or _mcore_matches(args):
        return
    rotary = model.rotary_pos_emb
    rotary.inv_freq = llama3_inv_freq(rotary.inv_freq, float(args.rope_scaling_factor), float(args.low_freq_factor),
                                      float(args.high_freq_factor), int(args.original_max_position_embeddings))

"""Weight initialisation that does not depend on the parallel layout.

megatron-core initialises each rank's shard from that rank's RNG stream, so a model built
at TP=2 or PP=2 starts from other weights than at TP=1/PP=1, and their losses cannot be
compared step by step. Here every parameter's *full* tensor is drawn from a generator
seeded by (seed, global parameter name; experts by their global index), then cut with the converter's own sharding rules
(:func:`mindspeed_pack.convert.sharding.shard_state_dict`): every layout starts from
the same model. Megatron's scheme is kept: normal(0, std) weights, output projections
scaled by 1/sqrt(2 * num_layers), zero biases, unit norms.
"""
from __future__ import annotations

import math
import re
import zlib

import torch
from megatron.core import parallel_state as ps

from mindspeed_pack.convert.sharding import COLUMN, GLU, ROW, VOCAB, layer_offset, shard_state_dict, split_kind
from mindspeed_pack.convert.weight_map import MG_EMBEDDING, MG_OUTPUT

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def _global_expert(name: str, first_expert: int) -> str:
    """Expert parallelism: a rank's local expert j is global expert ``first_expert + j``."""
    return _LOCAL_EXPERT.sub(lambda m: f".local_experts.{first_expert + int(m.group(1))}.", name)


def _global_name(local: str, offset: int, tied_output_copy: bool) -> str:
    if tied_output_copy and local == MG_OUTPUT:
        return MG_EMBEDDING  # the last stage's copy of tied embeddings
    m = _LAYER.match(local)
    return f"decoder.layers.{int(m.group(1)) + offset}.{m.group(2)}" if m else local


def _full_shape(shape, kind: str, tp: int):
    shape = list(shape)
    if kind in (VOCAB, COLUMN, GLU):
        shape[0] *= tp
    elif kind == ROW:
        shape[1] *= tp
    return shape


def _draw(name: str, shape, args, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    if ".lora_B." in name:  # LoRA: B zero (the adapted model starts as the base), A as PEFT draws it
        return torch.zeros(shape)
    if ".lora_A." in name:
        bound = 1.0 / math.sqrt(shape[1])
        return torch.empty(shape).uniform_(-bound, bound, generator=gen)
    if name.endswith("layernorm.weight") or name.endswith("layer_norm_weight"):
        return torch.ones(shape)
    if name.endswith("bias"):
        return torch.zeros(shape)
    std = args.init_method_std
    if name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight"):
        std = std / math.sqrt(2.0 * args.num_layers)
    return torch.empty(shape).normal_(0.0, std, generator=gen)


@torch.no_grad()
def parallel_invariant_init(model: torch.nn.Module, args, seed: int, only=None) -> None:
    """Overwrite ``model``'s parameters (this rank's shard) with the layout-free draw (those whose
    name ``only(name)`` accepts, when given: a LoRA run's adapters on a loaded base)."""
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    offset = layer_offset(args.num_layers, pp_rank, pp)
    tied_copy = pp > 1 and pp_rank == pp - 1 and not args.untie_embeddings_and_output_weights
    experts = args.num_experts or 0
    first_expert = ps.get_expert_model_parallel_rank() * (experts // ps.get_expert_model_parallel_world_size())
    for local, param in model.named_parameters():
        if only is not None and not only(local):
            continue
        name = _global_name(local, offset, tied_copy)
        kind = split_kind(name, args)
        full = _draw(_global_expert(name, first_expert), _full_shape(param.shape, kind, tp), args, seed)
        shard = shard_state_dict({name: full}, args, tp_rank, tp, pp_rank, pp)[local]
        if shard.shape != param.shape:
            raise RuntimeError(f"init of {local}: shard {tuple(shard.shape)} != parameter {tuple(param.shape)}")
        param.copy_(shard.to(param.dtype))

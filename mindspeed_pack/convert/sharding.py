"""Split full canonical Megatron weights into TP/PP shards, and merge shards back.

A "full" state dict is what a TP1/PP1 model loads (global layer ids, padded vocabulary);
a shard is what rank ``(tp_rank, pp_rank)`` loads with ``model.load_state_dict``: its
stage's layers renumbered from 0, and its slice of every tensor-parallel weight:

==============================================  ======================================
embedding / output layer                        rows (vocab-parallel), dim 0
linear_qkv weight/bias, fc1 (non-gated)         rows (column-parallel), dim 0; the QKV
                                                rows are grouped per query group, so a
                                                contiguous split hands out whole groups
linear_fc1 weight/bias (SwiGLU)                 gate and up halves split separately:
                                                rank r holds ``[gate_r; up_r]``
linear_proj / linear_fc2 weight                 columns (row-parallel), dim 1
MoE experts' fc1 / fc2                          as the dense MLP's (expert TP = TP)
MoE router                                      replicated
MoE experts over expert-parallel ranks          whole experts: EP rank e holds experts
                                                ``[e*n, (e+1)*n)``, ``n = num_experts/EP``,
                                                renumbered ``local_experts.0..n-1``
norms, row-parallel biases, learned_absolute     replicated
position embeddings (first stage only), a
reward model's score head (last stage only)
LoRA adapters (``lora_A.<p>``, ``lora_B.<p>``)   like their linear: B by rows (dim 0) on
                                                linear_qkv / fc1, A by columns (dim 1) on
                                                linear_proj / fc2; the other replicated
==============================================  ======================================

With tied embeddings and PP > 1, the last stage of a language model (not a reward model) holds its own copy of the word
embeddings as ``output_layer.weight`` (megatron-core keeps the two in sync), so
:func:`shard_state_dict` writes it there and :func:`merge_state_dicts` reads the first
stage's copy. :func:`expert_shard` / :func:`merge_expert_shards` do the same over
expert-parallel ranks (every other tensor is the same on all of them). All functions
accept partial dicts (any subset of layers), which is how
the converter streams one layer at a time.
"""
from __future__ import annotations

import logging
import re
from typing import Dict, Optional, Tuple

import torch

from mindspeed_pack.convert.model_specs import ConversionError
from mindspeed_pack.convert.weight_map import EMBEDDING, FINAL, MG_EMBEDDING, MG_OUTPUT, MG_SCORE, has_score_head, pad_vocab
from mindspeed_pack.model.lora import ADAPTED_LINEARS, COLUMN_PARALLEL

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(.*\.experts\.local_experts\.)(\d+)(\..+)$")
POSITION_EMBEDDING = "embedding.position_embeddings.weight"

VOCAB, COLUMN, ROW, GLU, REPLICATED = "vocab", "column", "row", "glu", "replicated"

# LoRA adapters, one A and B per projection (mindspeed_pack/model/lora.py): split like their base linear,
# B by output rows for a column-parallel one (each projection's rows in HF order: a contiguous range per
# rank), A by input columns for a row-parallel one; the other replicated
_ADAPTER_RULES = tuple(
    rule for linear, parts in ADAPTED_LINEARS.items() for p in parts
    for rule in ((f"lora_A.{p}", REPLICATED if linear in COLUMN_PARALLEL else ROW),
                 (f"lora_B.{p}", COLUMN if linear in COLUMN_PARALLEL else REPLICATED)))

# (name suffix, how it is split); first match wins
_RULES = (
    *_ADAPTER_RULES,
    (MG_EMBEDDING, VOCAB),
    (MG_OUTPUT, VOCAB),
    (MG_SCORE, REPLICATED),  # a reward model's 1-wide head: every TP rank holds it whole
    (POSITION_EMBEDDING, REPLICATED),  # learned_absolute: a plain nn.Embedding on every TP rank
    ("self_attention.linear_qkv.weight", COLUMN),
    ("self_attention.linear_qkv.bias", COLUMN),
    ("self_attention.linear_proj.weight", ROW),
    ("self_attention.linear_proj.bias", REPLICATED),
    ("mlp.linear_fc1.weight", GLU),
    ("mlp.linear_fc1.bias", GLU),
    ("mlp.linear_fc2.weight", ROW),
    ("mlp.linear_fc2.bias", REPLICATED),
    ("mlp.router.weight", REPLICATED),  # MoE: every rank routes its own tokens
    (".linear_fc1.weight", GLU),  # MoE experts (mlp.experts.local_experts.{j}.): split like the dense MLP
    (".linear_fc2.weight", ROW),
    ("layernorm.weight", REPLICATED),
    ("layernorm.bias", REPLICATED),
)


def split_kind(name: str, args) -> str:
    for suffix, kind in _RULES:
        if name.endswith(suffix):
            if kind == GLU and not getattr(args, "swiglu", False):
                return COLUMN
            return kind
    raise ConversionError(f"no tensor-parallel rule for parameter {name!r}; the converter does not know this module")


def layer_offset(num_layers: int, pp_rank: int, pp_size: int) -> int:
    """Global index of stage ``pp_rank``'s first layer under megatron's even split."""
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise ConversionError(f"pipeline rank {pp_rank} is not in [0, {pp_size})")
    if pp_size > num_layers:
        raise ConversionError(f"pipeline parallel size {pp_size} is larger than the layer count {num_layers}")
    if num_layers % pp_size:
        raise ConversionError(f"pipeline parallel size {pp_size} does not divide the layer count {num_layers}")
    return pp_rank * (num_layers // pp_size)


def stage_of_layer(layer: int, num_layers: int, pp_size: int) -> Tuple[int, int]:
    """(pp_rank, local index) of global layer ``layer``."""
    layer_offset(num_layers, 0, pp_size)  # validates
    per_stage = num_layers // pp_size
    return layer // per_stage, layer % per_stage


def _tied(args) -> bool:
    return not getattr(args, "untie_embeddings_and_output_weights", False)


def _output_copy(args) -> bool:
    """Whether the last stage keeps its own copy of tied embeddings as its output layer (a reward model has none)."""
    return _tied(args) and not has_score_head(args)


def _split(tensor: torch.Tensor, kind: str, tp_rank: int, tp_size: int, name: str) -> torch.Tensor:
    if kind == REPLICATED or tp_size == 1:
        return tensor
    dim = 1 if kind == ROW else 0
    if tensor.shape[dim] % (2 * tp_size if kind == GLU else tp_size):
        raise ConversionError(f"{name}: dimension {dim} of shape {tuple(tensor.shape)} does not split over TP={tp_size}")
    if kind == GLU:
        gate, up = torch.chunk(tensor, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp_size, 0)[tp_rank], torch.chunk(up, tp_size, 0)[tp_rank]], 0)
    return torch.chunk(tensor, tp_size, dim=dim)[tp_rank].clone()


def _merge(pieces, kind: str, name: str) -> torch.Tensor:
    if len(pieces) == 1:
        return pieces[0]
    if kind == REPLICATED:
        first = pieces[0]
        for rank, other in enumerate(pieces[1:], start=1):
            if not torch.equal(first, other):
                raise ConversionError(f"{name}: replicated parameter differs between tensor-parallel rank 0 and {rank}")
        return first
    if kind == GLU:
        halves = [torch.chunk(p, 2, dim=0) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    return torch.cat(pieces, dim=1 if kind == ROW else 0)


def shard_state_dict(
    full: Dict[str, torch.Tensor], args, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int
) -> Dict[str, torch.Tensor]:
    """The part of ``full`` that rank ``(tp_rank, pp_rank)`` loads (layers renumbered).

    Vocabulary tensors with fewer rows than ``args.padded_vocab_size`` (e.g. straight from
    a HF model) are zero-padded first.
    """
    if not 0 <= tp_rank < tp_size:
        raise ConversionError(f"tensor rank {tp_rank} is not in [0, {tp_size})")
    offset = layer_offset(args.num_layers, pp_rank, pp_size)
    per_stage = args.num_layers // pp_size
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    out: Dict[str, torch.Tensor] = {}
    for name, tensor in full.items():
        m = _LAYER.match(name)
        if m:
            layer = int(m.group(1))
            if not offset <= layer < offset + per_stage:
                continue
            target = f"decoder.layers.{layer - offset}.{m.group(2)}"
        elif name == MG_EMBEDDING:
            tensor = pad_vocab(tensor, args.padded_vocab_size, name)
            if first:
                out[name] = _split(tensor, VOCAB, tp_rank, tp_size, name)
            if last and pp_size > 1 and _output_copy(args):
                out[MG_OUTPUT] = _split(tensor, VOCAB, tp_rank, tp_size, name)
            continue
        elif name == MG_OUTPUT:
            if _tied(args) or not last:
                continue  # tied: megatron derives it from the embedding
            tensor = pad_vocab(tensor, args.padded_vocab_size, name)
            target = name
        elif name.startswith("decoder.final_layernorm.") or name == MG_SCORE:
            if not last:
                continue
            target = name
        elif name == POSITION_EMBEDDING:
            if not first:
                continue
            target = name
        else:
            raise ConversionError(f"unknown parameter {name!r} in the full state dict")
        out[target] = _split(tensor, split_kind(name, args), tp_rank, tp_size, name)
    return out


def merge_state_dicts(
    shards: Dict[Tuple[int, int], Dict[str, torch.Tensor]], args, tp_size: int, pp_size: int
) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`shard_state_dict` for the stages present in ``shards``.

    ``shards`` maps ``(tp_rank, pp_rank)`` to that rank's state dict; every stage present
    must have all ``tp_size`` ranks. Vocabulary tensors keep their padded rows.
    """
    stages = sorted({pp for _, pp in shards})
    full: Dict[str, torch.Tensor] = {}
    tied_copy: Optional[torch.Tensor] = None
    for pp_rank in stages:
        missing = [tp for tp in range(tp_size) if (tp, pp_rank) not in shards]
        if missing:
            raise ConversionError(f"pipeline stage {pp_rank}: shards of tensor ranks {missing} are missing")
        offset = layer_offset(args.num_layers, pp_rank, pp_size)
        ranks = [shards[(tp, pp_rank)] for tp in range(tp_size)]
        for name in ranks[0]:
            if name.endswith("_extra_state"):
                continue
            pieces = []
            for tp, sd in enumerate(ranks):
                if name not in sd:
                    raise ConversionError(f"{name!r} is in the shard of rank (0, {pp_rank}) but not of ({tp}, {pp_rank})")
                pieces.append(sd[name])
            merged = _merge(pieces, split_kind(name, args), name)
            m = _LAYER.match(name)
            if m:
                name = f"decoder.layers.{int(m.group(1)) + offset}.{m.group(2)}"
            elif name == MG_OUTPUT and _tied(args):
                tied_copy = merged  # the last stage's copy of the embedding
                continue
            full[name] = merged
    if tied_copy is not None and MG_EMBEDDING in full and not torch.equal(tied_copy, full[MG_EMBEDDING]):
        log.warning("tied embeddings: the last stage's output_layer copy differs from the first stage's "
                    "word embeddings; using the first stage's")
    return full


def experts_of_rank(num_experts: int, ep_rank: int, ep_size: int) -> range:
    """Global indices of the experts expert-parallel rank ``ep_rank`` holds (Megatron's contiguous split)."""
    if not num_experts or num_experts % ep_size:
        raise ConversionError(f"expert parallel size {ep_size} does not divide the number of experts {num_experts}")
    per_rank = num_experts // ep_size
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def expert_shard(state: Dict[str, torch.Tensor], num_experts: int, ep_rank: int, ep_size: int
                 ) -> Dict[str, torch.Tensor]:
    """The part of ``state`` (global expert indices) expert-parallel rank ``ep_rank`` holds: every
    non-expert tensor, and its experts renumbered from 0."""
    if ep_size == 1:
        return state
    mine = experts_of_rank(num_experts, ep_rank, ep_size)
    out = {}
    for name, tensor in state.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = tensor
        elif int(m.group(2)) in mine:
            out[f"{m.group(1)}{int(m.group(2)) - mine.start}{m.group(3)}"] = tensor
    return out


def merge_expert_shards(shards: Dict[int, Dict[str, torch.Tensor]], num_experts: int, ep_size: int
                        ) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`expert_shard` for the expert-parallel ranks in ``shards`` (``ep_rank -> state``):
    experts back to their global indices, every other tensor from the lowest rank given."""
    if ep_size == 1:
        return shards[0]
    out = {}
    for ep_rank in sorted(shards, reverse=True):  # the lowest rank's non-expert tensors last, so they win
        first = experts_of_rank(num_experts, ep_rank, ep_size).start
        for name, tensor in shards[ep_rank].items():
            m = _EXPERT.match(name)
            out[f"{m.group(1)}{first + int(m.group(2))}{m.group(3)}" if m else name] = tensor
    return out


def stage_units(args, pp_rank: int, pp_size: int) -> list:
    """Conversion units stage ``pp_rank`` holds: its layers, plus the embedding on the first
    stage (and on the last one when tied, for its output-layer copy), plus the final norm
    and output layer on the last stage."""
    offset = layer_offset(args.num_layers, pp_rank, pp_size)
    per_stage = args.num_layers // pp_size
    last = pp_rank == pp_size - 1
    out = [EMBEDDING] if pp_rank == 0 or (last and _output_copy(args)) else []
    out += list(range(offset, offset + per_stage))
    if last:
        out.append(FINAL)
    return out

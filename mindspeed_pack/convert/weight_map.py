"""Hugging Face tensors <-> canonical Megatron tensors (full, unsharded, global layer ids).

Canonical names are megatron-core's local-spec parameter names of a TP1/PP1 model::

    embedding.word_embeddings.weight            <- model.embed_tokens.weight (vocab padded)
    decoder.layers.{i}.input_layernorm.weight   <- model.layers.{i}.input_layernorm.weight
    decoder.layers.{i}.self_attention.linear_qkv.{weight,bias}
                                                <- q_proj, k_proj, v_proj, fused per group
    decoder.layers.{i}.self_attention.linear_proj.weight   <- o_proj
    decoder.layers.{i}.self_attention.{q,k}_layernorm.weight <- self_attn.{q,k}_norm (qk_layernorm rows: Qwen3)
    decoder.layers.{i}.pre_mlp_layernorm.weight <- post_attention_layernorm
    decoder.layers.{i}.mlp.linear_fc1.weight    <- [gate_proj; up_proj]
    decoder.layers.{i}.mlp.linear_fc2.weight    <- down_proj
    decoder.layers.{i}.mlp.router.weight        <- mlp.gate.weight (MoE layers: Qwen3-MoE;
                                                   Mixtral: block_sparse_moe.gate.weight)
    decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc1.weight <- [experts.{j}.gate_proj; up_proj]
                                                   (Mixtral: block_sparse_moe.experts.{j}.[w1; w3])
    decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc2.weight <- experts.{j}.down_proj (Mixtral: w2)
    decoder.final_layernorm.weight              <- model.norm.weight
    output_layer.weight                         <- lm_head.weight (untied only; vocab padded)
    score.weight                                <- score.weight (a reward model's [1, hidden] head,
                                                   in place of the output layer: *ForSequenceClassification)

Fused QKV rows are grouped per query group, ``[q heads of group 0, k0, v0, q heads of
group 1, k1, v1, ...]``, so that a contiguous split of the rows hands every tensor-parallel
rank whole groups. The model is converted in *units* (the embedding, one layer, the final
norm + output layer) so that only one unit's tensors are in memory at a time.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple, Union

import torch

from mindspeed_pack.convert.model_specs import ConversionError, ModelSpec, moe_layers

Unit = Union[str, int]  # "embedding", a global layer index, or "final"
EMBEDDING, FINAL = "embedding", "final"

MG_EMBEDDING = "embedding.word_embeddings.weight"
MG_OUTPUT = "output_layer.weight"
MG_FINAL_NORM = "decoder.final_layernorm.weight"
HF_EMBEDDING = "model.embed_tokens.weight"
HF_OUTPUT = "lm_head.weight"
HF_FINAL_NORM = "model.norm.weight"
MG_SCORE = HF_SCORE = "score.weight"  # an outcome reward model's scalar head (args.reward_head)

# per-head q/k RMSNorm weights ([head_dim], the same on every tensor-parallel rank)
QK_NORMS = (("q_norm.weight", "q_layernorm.weight"), ("k_norm.weight", "k_layernorm.weight"))

# HF tensors that carry nothing the Megatron model needs
IGNORABLE_HF_SUFFIXES = ("rotary_emb.inv_freq",)

# the HF module holding the projections of a megatron layer's module (LoRA adapters are per projection)
HF_MODULE = {"self_attention": "self_attn", "mlp": "mlp"}


def units(args) -> List[Unit]:
    return [EMBEDDING, *range(args.num_layers), FINAL]


def has_score_head(args) -> bool:
    """An outcome reward model: its final unit holds the score head instead of the output layer."""
    return bool(getattr(args, "reward_head", False))


def _hf_layer(i: int) -> str:
    return f"model.layers.{i}."


def _mg_layer(i: int) -> str:
    return f"decoder.layers.{i}."


DENSE_MLP = ("gate_proj", "up_proj", "down_proj")  # a dense layer's gate, up and down projections


def _mlps(unit: int, args, spec: ModelSpec, experts: Optional[range] = None) -> List[Tuple[str, str, Tuple[str, ...]]]:
    """``(HF prefix, megatron prefix, (gate, up, down) names)`` of a layer's MLPs: the dense MLP, or each of
    ``experts`` (global indices; default all) of an MoE layer, named as the family's :class:`ExpertLayout` says."""
    hp, mp = _hf_layer(unit), _mg_layer(unit)
    if unit not in moe_layers(args):
        return [(hp + "mlp.", mp + "mlp.", DENSE_MLP)]
    layout = spec.moe
    if layout is None:
        raise ConversionError(f"the {spec.name} family has no mixture-of-experts layers (layer {unit} is one here)")
    return [(f"{hp}{layout.block}.experts.{j}.", f"{mp}mlp.experts.local_experts.{j}.", layout.projections)
            for j in (experts if experts is not None else range(args.num_experts))]


def _hf_router(unit: int, spec: ModelSpec) -> str:
    return f"{_hf_layer(unit)}{spec.moe.block}.gate.weight"


def hf_projection(layer: int, mg_linear: str, projection: str) -> str:
    """HF module of one projection fused in a megatron linear: (3, 'self_attention.linear_qkv', 'q_proj')
    -> 'model.layers.3.self_attn.q_proj' (its weight is that name + '.weight')."""
    owner = mg_linear.split(".")[0]
    return f"{_hf_layer(layer)}{HF_MODULE[owner]}.{projection}"


def hf_unit_shapes(unit: Unit, args, spec: ModelSpec) -> Dict[str, Tuple[int, ...]]:
    """HF tensor names of a unit and the shapes the config implies."""
    h, d = args.hidden_size, args.kv_channels
    if unit == EMBEDDING:
        return {HF_EMBEDDING: (args.vocab_size, h)}
    if unit == FINAL:
        shapes = {HF_FINAL_NORM: (h,)}
        if has_score_head(args):
            shapes[HF_SCORE] = (1, h)
        elif args.untie_embeddings_and_output_weights:
            shapes[HF_OUTPUT] = (args.vocab_size, h)
        return shapes
    p = _hf_layer(unit)
    q_rows, kv_rows = args.num_attention_heads * d, args.num_query_groups * d
    shapes = {
        p + "input_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (q_rows, h),
        p + "self_attn.k_proj.weight": (kv_rows, h),
        p + "self_attn.v_proj.weight": (kv_rows, h),
        p + "self_attn.o_proj.weight": (h, q_rows),
        p + "post_attention_layernorm.weight": (h,),
    }
    f = args.ffn_hidden_size
    if unit in moe_layers(args):
        f = args.moe_ffn_hidden_size or args.ffn_hidden_size
        shapes[_hf_router(unit, spec)] = (args.num_experts, h)
    for hf_mlp, _, (gate, up, down) in _mlps(unit, args, spec):
        shapes.update({f"{hf_mlp}{gate}.weight": (f, h), f"{hf_mlp}{up}.weight": (f, h),
                       f"{hf_mlp}{down}.weight": (h, f)})
    if spec.qk_layernorm:
        shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    if spec.qkv_bias:
        shapes.update({
            p + "self_attn.q_proj.bias": (q_rows,),
            p + "self_attn.k_proj.bias": (kv_rows,),
            p + "self_attn.v_proj.bias": (kv_rows,),
        })
    return shapes


def expected_hf_shapes(args, spec: ModelSpec) -> Dict[str, Tuple[int, ...]]:
    shapes: Dict[str, Tuple[int, ...]] = {}
    for unit in units(args):
        shapes.update(hf_unit_shapes(unit, args, spec))
    return shapes


def is_ignorable_hf_tensor(name: str, args) -> bool:
    if name.endswith(IGNORABLE_HF_SUFFIXES):
        return True
    # tied models sometimes still store lm_head; the embedding is the weight in use (check_tied_output: when equal)
    return name == HF_OUTPUT and not args.untie_embeddings_and_output_weights


def assumed_defaults(config: Dict, args, spec: ModelSpec) -> str:
    """The config-class defaults that stood in for fields config.json lacks, said where a shape disagrees."""
    if spec.head_dim is not None and config.get("head_dim") is None and args.kv_channels == spec.head_dim:
        return (f"config.json has no head_dim, so {spec.head_dim} was assumed, the default of transformers' "
                f"{spec.hf_model_type} config; add the weights' head_dim to config.json")
    return ""


# transformers 5.x's in-memory MoE experts, one tensor per layer ([experts, 2 x width, hidden] and
# [experts, hidden, width]); save_pretrained writes them back as one tensor per expert and projection
FUSED_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")


def check_hf_tensors(reader, args, spec: ModelSpec) -> None:
    """Every tensor of the HF files named and shaped as config.json implies, and a tied output layer really tied."""
    fused = [n for n in reader.keys() if n.endswith(FUSED_EXPERTS)]
    if fused and spec.moe:
        layer = next(u for u in range(args.num_layers) if u in moe_layers(args))
        per_expert = f"{_mlps(layer, args, spec, range(1))[0][0]}{spec.moe.projections[0]}.weight"
        raise ConversionError(
            f"{reader.file_of(fused[0])}: {fused[0]!r} holds every expert of a layer in one tensor (transformers' "
            f"in-memory layout, as model.state_dict() has it); the converter reads one tensor per expert, as "
            f"save_pretrained writes them ({per_expert!r}, ...): re-save the model with "
            "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR) and convert NEW_DIR")
    reader.check_shapes(expected_hf_shapes(args, spec), lambda n: is_ignorable_hf_tensor(n, args),
                        assumed_defaults(reader.config, args, spec))
    check_tied_output(reader, args)


def check_tied_output(reader, args) -> None:
    """A tied model's files may still store ``lm_head.weight``: ignored when it equals the embedding, refused when
    it differs (transformers does not tie them then: the model it loads has its own output layer, which the tied
    Megatron model would drop)."""
    if args.untie_embeddings_and_output_weights or HF_OUTPUT not in reader.keys():
        return
    if not torch.equal(reader.get(HF_OUTPUT), reader.get(HF_EMBEDDING)):
        raise ConversionError(
            f"{reader.file_of(HF_OUTPUT)}: config.json ties the output layer to the embedding (tie_word_embeddings), "
            f"but the stored {HF_OUTPUT!r} differs from {HF_EMBEDDING!r}: transformers does not tie them then (the "
            "model has its own output layer), and the tied model built from config.json would drop it; set "
            "tie_word_embeddings to false in config.json to train them untied")


# --------------------------------------------------------------------------- fused layouts
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args) -> torch.Tensor:
    """q ``[heads*d, ...]``, k/v ``[groups*d, ...]`` -> megatron's grouped ``[(heads+2g)*d, ...]``."""
    g, d = args.num_query_groups, args.kv_channels
    per_group = args.num_attention_heads // g
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(g, per_group * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)
    return fused.reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, args) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = args.num_query_groups, args.kv_channels
    per_group = args.num_attention_heads // g
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, (per_group + 2) * d, *rest)
    q, k, v = torch.split(grouped, [per_group * d, d, d], dim=1)
    return q.reshape(-1, *rest).clone(), k.reshape(-1, *rest).clone(), v.reshape(-1, *rest).clone()


def pad_vocab(weight: torch.Tensor, padded_vocab_size: int, name: str = "") -> torch.Tensor:
    """Append zero rows up to ``padded_vocab_size`` (zero: they are never a target or an input)."""
    rows = weight.shape[0]
    if rows > padded_vocab_size:
        raise ConversionError(f"{name}: {rows} vocabulary rows do not fit padded_vocab_size={padded_vocab_size}")
    if rows == padded_vocab_size:
        return weight
    return torch.cat([weight, weight.new_zeros(padded_vocab_size - rows, *weight.shape[1:])], dim=0)


def unpad_vocab(weight: torch.Tensor, vocab_size: int, name: str = "") -> torch.Tensor:
    if weight.shape[0] < vocab_size:
        raise ConversionError(f"{name}: {weight.shape[0]} rows, fewer than the true vocabulary size {vocab_size}")
    return weight[:vocab_size].clone()


# --------------------------------------------------------------------------- HF -> megatron
def hf_to_mg_unit(unit: Unit, get: Callable[[str], torch.Tensor], args, spec: ModelSpec,
                  experts: Optional[range] = None) -> Dict[str, torch.Tensor]:
    """Canonical megatron tensors of ``unit``, reading HF tensors with ``get(name)``; of an MoE
    layer's experts only ``experts`` (global indices; default all) are read."""
    if unit == EMBEDDING:
        return {MG_EMBEDDING: pad_vocab(get(HF_EMBEDDING), args.padded_vocab_size, HF_EMBEDDING)}
    if unit == FINAL:
        out = {MG_FINAL_NORM: get(HF_FINAL_NORM)}
        if has_score_head(args):
            out[MG_SCORE] = get(HF_SCORE)
        elif args.untie_embeddings_and_output_weights:
            out[MG_OUTPUT] = pad_vocab(get(HF_OUTPUT), args.padded_vocab_size, HF_OUTPUT)
        return out
    hp, mp = _hf_layer(unit), _mg_layer(unit)
    attn = hp + "self_attn."
    out = {
        mp + "input_layernorm.weight": get(hp + "input_layernorm.weight"),
        mp + "self_attention.linear_qkv.weight": fuse_qkv(
            get(attn + "q_proj.weight"), get(attn + "k_proj.weight"), get(attn + "v_proj.weight"), args),
        mp + "self_attention.linear_proj.weight": get(attn + "o_proj.weight"),
        mp + "pre_mlp_layernorm.weight": get(hp + "post_attention_layernorm.weight"),
    }
    if unit in moe_layers(args):
        out[mp + "mlp.router.weight"] = get(_hf_router(unit, spec))
    for hf_mlp, mg_mlp, (gate, up, down) in _mlps(unit, args, spec, experts):
        out[mg_mlp + "linear_fc1.weight"] = torch.cat([get(f"{hf_mlp}{gate}.weight"), get(f"{hf_mlp}{up}.weight")], 0)
        out[mg_mlp + "linear_fc2.weight"] = get(f"{hf_mlp}{down}.weight")
    if spec.qk_layernorm:
        for hf_norm, mg_norm in QK_NORMS:
            out[mp + "self_attention." + mg_norm] = get(attn + hf_norm)
    if spec.qkv_bias:
        out[mp + "self_attention.linear_qkv.bias"] = fuse_qkv(
            get(attn + "q_proj.bias"), get(attn + "k_proj.bias"), get(attn + "v_proj.bias"), args)
    return out


# --------------------------------------------------------------------------- megatron -> HF
def mg_to_hf_unit(unit: Unit, full: Dict[str, torch.Tensor], args, spec: ModelSpec) -> Dict[str, torch.Tensor]:
    """HF tensors of ``unit`` from its canonical megatron tensors (vocab un-padded)."""

    def take(name):
        if name not in full:
            raise ConversionError(f"megatron checkpoint lacks {name!r} (unit {unit!r}); found {sorted(full)[:8]}")
        return full[name]

    if unit == EMBEDDING:
        return {HF_EMBEDDING: unpad_vocab(take(MG_EMBEDDING), args.vocab_size, MG_EMBEDDING)}
    if unit == FINAL:
        out = {HF_FINAL_NORM: take(MG_FINAL_NORM)}
        if has_score_head(args):
            out[HF_SCORE] = take(MG_SCORE)
        elif args.untie_embeddings_and_output_weights:
            out[HF_OUTPUT] = unpad_vocab(take(MG_OUTPUT), args.vocab_size, MG_OUTPUT)
        return out
    hp, mp = _hf_layer(unit), _mg_layer(unit)
    attn = hp + "self_attn."
    q, k, v = split_qkv(take(mp + "self_attention.linear_qkv.weight"), args)
    out = {
        hp + "input_layernorm.weight": take(mp + "input_layernorm.weight"),
        attn + "q_proj.weight": q,
        attn + "k_proj.weight": k,
        attn + "v_proj.weight": v,
        attn + "o_proj.weight": take(mp + "self_attention.linear_proj.weight"),
        hp + "post_attention_layernorm.weight": take(mp + "pre_mlp_layernorm.weight"),
    }
    if unit in moe_layers(args):
        out[_hf_router(unit, spec)] = take(mp + "mlp.router.weight")
    for hf_mlp, mg_mlp, (gate, up, down) in _mlps(unit, args, spec):
        gate_w, up_w = torch.chunk(take(mg_mlp + "linear_fc1.weight"), 2, dim=0)
        out.update({f"{hf_mlp}{gate}.weight": gate_w.clone(), f"{hf_mlp}{up}.weight": up_w.clone(),
                    f"{hf_mlp}{down}.weight": take(mg_mlp + "linear_fc2.weight")})
    if spec.qk_layernorm:
        for hf_norm, mg_norm in QK_NORMS:
            out[attn + hf_norm] = take(mp + "self_attention." + mg_norm)
    if spec.qkv_bias:
        qb, kb, vb = split_qkv(take(mp + "self_attention.linear_qkv.bias"), args)
        out.update({attn + "q_proj.bias": qb, attn + "k_proj.bias": kb, attn + "v_proj.bias": vb})
    return out


def mg_unit_names(unit: Unit, args) -> List[str]:
    """Canonical megatron names belonging to ``unit`` (for picking them out of a shard)."""
    if unit == EMBEDDING:
        return [MG_EMBEDDING]
    if unit == FINAL:
        names = [MG_FINAL_NORM]
        if args.normalization == "LayerNorm":
            names.append("decoder.final_layernorm.bias")
        if has_score_head(args):
            names.append(MG_SCORE)
        elif args.untie_embeddings_and_output_weights:
            names.append(MG_OUTPUT)
        return names
    raise ValueError("layer units are selected by prefix, see mg_layer_prefix")


def mg_layer_prefix(layer: int) -> str:
    return _mg_layer(layer)

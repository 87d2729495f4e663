"""The model families the converter, the direct loader and the model builder know: one row each.

Qwen2/2.5, Qwen3, Qwen3-MoE, Llama 2/3/3.1/3.2, Mistral and Mixtral share one layout (pre-norm RMSNorm decoder,
RoPE, GQA, SwiGLU MLP, optional tied embeddings). What differs is data in a :class:`ModelSpec`
row: the Megatron arguments the family fixes (``--add-qkv-bias``, ``--qk-layernorm``), the
RoPE types it may use, and the config.json fields it understands beyond the common mapping,
each with its check, and for a mixture-of-experts family where its config and files keep the
experts (an :class:`ExpertLayout`). :func:`args_from_hf_config` maps a config through its row; every field
no row explains is refused by name (MoE fields with their own message), so a model is
never built that silently differs from the one in config.json. Tensor names and fused
layouts live in :mod:`.weight_map`, which reads the same row.

An outcome reward model of a family (a scalar ``score`` head instead of the LM head,
``--stage orm``) is the row's ``hf_reward_architecture`` (transformers' ``*ForSequenceClassification``
with ``num_labels: 1``): config.json naming it maps to ``reward_head`` and the pad token transformers
pools by (``reward_pad_token_id``); a family without that class has no reward model to write.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from mindspeed_pack.model.gpt import padded_vocab_size as megatron_padded_vocab_size
from mindspeed_pack.model.moe import moe_layer_pattern


class ConversionError(ValueError):
    """Bad converter input: the message says which file/field/tensor and what to do."""


# A field check: (field, value, config, context) -> None, raising ConversionError when the
# value asks for something the Megatron model does not do. ``context`` has "where" and "seq_length".
FieldCheck = Callable[[str, object, dict, dict], None]


def _refuse(ctx: dict, field: str, value, why: str):
    raise ConversionError(f"{ctx['where']}: {field}={value!r} is not supported: {why}")


def harmless(field, value, config, ctx) -> None:
    """Metadata or a training-time setting: the weights and the forward do not depend on it."""


def equals(*allowed) -> FieldCheck:
    """The field must hold one of ``allowed`` (null counts as the default, allowed)."""

    def check(field, value, config, ctx):
        if value is not None and value not in allowed:
            _refuse(ctx, field, value, f"the Megatron model is built for {' or '.join(map(repr, allowed))}")

    return check


def one_label(field, value, config, ctx) -> None:
    """A sequence classifier's labels: a reward model has one (``num_labels: 1``, a scalar score)."""
    if not _is_reward_config(config) or value is None:
        return
    if len(value) != 1:
        _refuse(ctx, field, value, f"a sequence classifier with {len(value)} labels; the reward model (a scalar score) "
                                   "has num_labels 1")


def _is_reward_config(config: dict) -> bool:
    return any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or [])


def full_attention_layers(field, value, config, ctx) -> None:
    kinds = sorted(set(value or []) - {"full_attention"})
    if kinds:
        _refuse(ctx, field, kinds, "every layer attends to the whole (packed) sample; only full_attention layers")


def window_covers_sequence(field, value, config, ctx) -> None:
    """A sliding window is exact only when no sample is longer than it."""
    if value is not None and int(value) < ctx["seq_length"]:
        _refuse(ctx, field, value, f"it is below the sequence length {ctx['seq_length']}: the Megatron model attends "
                                   "to the whole sample, so tokens further back than the window would be seen; train "
                                   f"with --seq-length <= {value} (convert with --seq-length {value})")


# config.json fields of mixture-of-experts models: refused by name unless the family's row reads them
MOE_FIELDS = (
    "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "n_routed_experts",
    "n_shared_experts", "shared_expert_intermediate_size", "router_aux_loss_coef", "output_router_logits",
    "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob", "moe_layer_freq", "first_k_dense_replace",
    "router_jitter_noise", "topk_group", "n_group",
)

# mixture-of-experts families with shared experts: their mapping is not written (refused by name)
SHARED_EXPERT_FAMILIES = {"qwen2_moe": "Qwen2MoeForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                          "deepseek_v3": "DeepseekV3ForCausalLM"}

# fields every family maps into Megatron arguments (args_from_hf_config)
MAPPED_FIELDS = (
    "hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "intermediate_size",
    "vocab_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "head_dim", "rope_theta",
    "rope_parameters", "rope_scaling",
)

COMMON_FIELDS: Dict[str, FieldCheck] = {
    **{name: harmless for name in (
        "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
        "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache",
        "attention_dropout",  # training dropout is --attention-dropout
    )},
    "id2label": one_label,  # written by *ForSequenceClassification (a reward model: one label)
    "label2id": one_label,
    "hidden_act": equals("silu"),
}

_QWEN_FIELDS = {"use_sliding_window": equals(False), "layer_types": full_attention_layers,
                "max_window_layers": harmless,  # read only under use_sliding_window
                "sliding_window": harmless}  # likewise

# the keys of rope_parameters / rope_scaling each RoPE type reads
# read by args_from_hf_config for MoE rows (router_aux_loss_coef is a training setting:
# --moe-aux-loss-coeff; output_router_logits only adds the aux loss to transformers' outputs)
_QWEN3_MOE_FIELDS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "norm_topk_prob", "mlp_only_layers", "decoder_sparse_step", "router_aux_loss_coef",
                     "output_router_logits")
_MIXTRAL_FIELDS = {**{k: harmless for k in ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef",
                                            "output_router_logits")},
                   # multiplicative noise on the router's input, in training only: Megatron's is not applied here
                   "router_jitter_noise": equals(0.0),
                   "sliding_window": window_covers_sequence}

ROPE_KEYS = {
    "default": ("rope_type", "type", "rope_theta"),
    "llama3": ("rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
}


@dataclass(frozen=True)
class ExpertLayout:
    """Where a mixture-of-experts family keeps its routed experts: the layer's MoE module in the weight files
    (``model.layers.{i}.<block>.gate.weight`` the router, ``<block>.experts.{j}.<gate|up|down>.weight``), and
    the config.json fields of their count, width, top-k normalisation and dense layers."""
    block: str = "mlp"
    projections: Tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # an expert's gate, up, down
    count_field: str = "num_experts"
    width_field: str = "moe_intermediate_size"  # one expert's FFN width
    renormalised: Optional[bool] = None  # top-k weights renormalised over the chosen k; None: norm_topk_prob says
    dense_layers: bool = True  # mlp_only_layers / decoder_sparse_step name dense layers (else every layer is MoE)


# Qwen3-MoE: mlp.experts.{j}.gate_proj, moe_intermediate_size, norm_topk_prob, mlp_only_layers
QWEN3_MOE_EXPERTS = ExpertLayout()
# Mixtral (the published checkpoints and transformers 5.x's save_pretrained, which un-fuses its in-memory
# mlp.experts.gate_up_proj): block_sparse_moe.experts.{j}.w1 (gate), w3 (up), w2 (down); every layer sparse,
# experts intermediate_size wide, top-k weights always renormalised (softmax over the chosen k)
MIXTRAL_EXPERTS = ExpertLayout(block="block_sparse_moe", projections=("w1", "w3", "w2"),
                               count_field="num_local_experts", width_field="intermediate_size", renormalised=True,
                               dense_layers=False)


@dataclass(frozen=True)
class ModelSpec:
    name: str  # --model-type-hf value
    hf_model_type: str  # config.json "model_type"
    hf_architecture: str  # config.json "architectures"[0]
    qkv_bias: bool  # --add-qkv-bias
    qk_layernorm: bool = False  # --qk-layernorm: per-head RMSNorm of q and k (self_attn.q_norm/k_norm)
    rope_types: Tuple[str, ...] = ("default",)
    fields: Dict[str, FieldCheck] = field(default_factory=dict)  # understood beyond COMMON/MAPPED_FIELDS
    hf_defaults: Dict[str, object] = field(default_factory=dict)  # written into a converted config.json
    moe: Optional[ExpertLayout] = None  # routed experts (no shared expert) in the layers --moe-layer-freq marks
    hf_reward_architecture: Optional[str] = None  # *ForSequenceClassification: the outcome reward model's class
    head_dim: Optional[int] = None  # the config class's head_dim where config.json has none (else hidden / heads)


MODEL_SPECS = {
    "qwen2": ModelSpec("qwen2", "qwen2", "Qwen2ForCausalLM", qkv_bias=True, fields=_QWEN_FIELDS,
                       hf_reward_architecture="Qwen2ForSequenceClassification"),
    "qwen3": ModelSpec("qwen3", "qwen3", "Qwen3ForCausalLM", qkv_bias=False, qk_layernorm=True,
                       fields={**_QWEN_FIELDS, "attention_bias": equals(False)},
                       hf_defaults={"attention_bias": False}, hf_reward_architecture="Qwen3ForSequenceClassification",
                       head_dim=128),  # transformers' Qwen3Config default
    "qwen3_moe": ModelSpec("qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM", qkv_bias=False, qk_layernorm=True,
                           moe=QWEN3_MOE_EXPERTS, fields={**_QWEN_FIELDS, "attention_bias": equals(False),
                                             **{k: harmless for k in _QWEN3_MOE_FIELDS}},
                           hf_defaults={"attention_bias": False},
                           hf_reward_architecture="Qwen3MoeForSequenceClassification"),
    "llama": ModelSpec("llama", "llama", "LlamaForCausalLM", qkv_bias=False, rope_types=("default", "llama3"),
                       fields={"attention_bias": equals(False), "mlp_bias": equals(False), "pretraining_tp": harmless},
                       hf_defaults={"attention_bias": False, "mlp_bias": False},
                       hf_reward_architecture="LlamaForSequenceClassification"),
    "mistral": ModelSpec("mistral", "mistral", "MistralForCausalLM", qkv_bias=False,
                         fields={"sliding_window": window_covers_sequence},
                         hf_reward_architecture="MistralForSequenceClassification"),
    "mixtral": ModelSpec("mixtral", "mixtral", "MixtralForCausalLM", qkv_bias=False, moe=MIXTRAL_EXPERTS,
                         fields=_MIXTRAL_FIELDS, hf_reward_architecture="MixtralForSequenceClassification"),
}
# the families of MODEL_SPECS as users name them (messages)
FAMILY_NAMES = ("Qwen2/Qwen2.5", "Qwen3", "Qwen3-MoE", "Llama 2/3/3.1/3.2", "Mistral", "Mixtral")

# args stored in every converted checkpoint: the model shape the trainer must match
MODEL_ARG_NAMES = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
    "num_query_groups", "kv_channels", "add_qkv_bias", "disable_bias_linear", "swiglu", "normalization",
    "norm_epsilon", "position_embedding_type", "rotary_base", "untie_embeddings_and_output_weights",
    "padded_vocab_size", "vocab_size", "max_position_embeddings", "seq_length",
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "make_vocab_size_divisible_by",
    "model_type_hf",
)
# added with the Qwen3/Llama-3.1 families; checkpoints written before them hold the defaults
OPTIONAL_MODEL_ARGS = {
    "qk_layernorm": False, "use_rope_scaling": False, "rope_scaling_factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192, "sliding_window": None, "rotary_percent": 1.0,
    # mixture of experts (qwen3_moe, mixtral); a dense model has num_experts None
    "num_experts": None, "moe_router_topk": 2, "moe_ffn_hidden_size": None, "moe_router_pre_softmax": False,
    "moe_layer_freq": 1, "expert_model_parallel_size": 1,
    # an outcome reward model (--stage orm): a scalar score head, read at the last token that is not this pad
    # token (transformers' pooling; None: the last token)
    "reward_head": False, "reward_pad_token_id": None,
}


# conversion arguments that are inputs of the run (its layout), not properties of the model
RUN_LAYOUT_ARGS = ("seq_length", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                   "expert_model_parallel_size", "make_vocab_size_divisible_by")


# recorded arguments that change the function the weights compute, not only their shapes: a checkpoint
# used under flags that differ in one of them trains or scores another model (model_differences)
FUNCTION_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "add_qkv_bias", "disable_bias_linear", "swiglu", "normalization", "norm_epsilon", "qk_layernorm",
    "untie_embeddings_and_output_weights", "padded_vocab_size", "position_embedding_type", "rotary_base",
    "rotary_percent", "use_rope_scaling", "rope_scaling_factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings", "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
    "moe_router_pre_softmax",
)
# arguments the model reads only when another one is on (in the recorded model): argument -> (that one, value)
_READ_ONLY_WITH = {
    # RoPE computes any position: the table size matters to learned positions only (MindSpeed-LLM's scripts pass
    # --max-position-embeddings ${SEQ_LENGTH}, below the config's 32768 or 40960)
    "max_position_embeddings": ("position_embedding_type", "learned_absolute"),
    **{k: ("position_embedding_type", "rope") for k in ("rotary_base", "rotary_percent", "use_rope_scaling")},
    **{k: ("use_rope_scaling", True) for k in ("rope_scaling_factor", "low_freq_factor", "high_freq_factor",
                                               "original_max_position_embeddings")},
    **{k: ("num_experts", "any") for k in ("moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
                                           "moe_router_pre_softmax")},
}


def _setting(values, key: str, num_layers=None):
    """The value ``key`` takes in the model built from ``values`` (a dict or a namespace; None: not recorded),
    with the defaults the builder fills in (head size, query groups, expert width, MoE layer pattern)."""
    get = values.get if isinstance(values, dict) else lambda k: getattr(values, k, None)
    value = get(key)
    if key == "kv_channels" and value is None and get("hidden_size") and get("num_attention_heads"):
        return get("hidden_size") // get("num_attention_heads")
    if key == "num_query_groups" and (value is None or get("group_query_attention") is False):
        return get("num_attention_heads")  # Megatron-LM keeps --num-query-groups' default 1 without GQA
    if key == "moe_ffn_hidden_size" and value is None and get("num_experts"):
        return get("ffn_hidden_size")
    if key == "moe_layer_freq" and value is not None and (get("num_layers") or num_layers):
        return moe_layer_pattern(argparse.Namespace(moe_layer_freq=value, num_layers=get("num_layers") or num_layers))
    return value


def same_setting(a, b) -> bool:
    """Equal as the model reads them: booleans as booleans, numbers by value (1e6 == 1000000)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return bool(a) == bool(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def model_differences(recorded: dict, args, keys=FUNCTION_ARGS) -> list:
    """``[(argument, recorded value, value in args)]`` for each of ``keys`` where the model ``recorded``
    describes (a checkpoint's ``args``, a converted config.json) differs from the one ``args`` builds.

    A key the record lacks is not compared (checkpoints of other tools record other things; the tensor
    shapes are checked apart); nor is one the recorded model does not read (RoPE scaling factors without
    RoPE scaling, expert settings of a dense model)."""
    out = []
    for key in keys:
        if key not in recorded:
            continue
        gate = _READ_ONLY_WITH.get(key)
        if gate:
            on = _setting(recorded, gate[0])
            if (not on) if gate[1] == "any" else (on is not None and not same_setting(on, gate[1])):
                continue
        layers = recorded.get("num_layers")
        theirs, mine = _setting(recorded, key), _setting(args, key, layers)
        if key != "num_experts" and (theirs is None or mine is None):
            continue
        if not same_setting(theirs, mine):
            out.append((key, theirs, mine))
    return out


def flag_of(key: str) -> str:
    return "--" + key.replace("_", "-")


def show_setting(value) -> str:
    """A flag's value as the user types it: booleans as set / not set."""
    if isinstance(value, bool) or value is None:
        return "set" if value else "not set"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))  # --rotary-base 1000000, not 1000000.0
    return str(value)


# MindSpeed-LLM's --model-type-hf names of the families converted here
MINDSPEED_MODEL_TYPES = {"qwen25": "qwen2", "qwen3-moe": "qwen3_moe", "llama2": "llama"}


def recorded_family(name: Optional[str]) -> Optional[str]:
    """A checkpoint's recorded ``model_type_hf`` as MODEL_SPECS names it: MindSpeed-LLM's converter records its own
    --model-type-hf (qwen25, llama2, qwen3-moe), which a run that loads it records in turn."""
    return MINDSPEED_MODEL_TYPES.get(name, name)


def get_spec(model_type_hf: str) -> ModelSpec:
    try:
        return MODEL_SPECS[model_type_hf]
    except KeyError:
        raise ConversionError(
            f"unknown --model-type-hf {model_type_hf!r}; supported: {', '.join(sorted(MODEL_SPECS))}"
        ) from None


def reward_architecture(spec: ModelSpec) -> str:
    """The transformers class an outcome reward model of ``spec``'s family is written as."""
    if not spec.hf_reward_architecture:
        raise ConversionError(f"the {spec.name} family has no sequence-classification class in transformers "
                              "(hf_reward_architecture of its row in MODEL_SPECS): its outcome reward model cannot be "
                              "written as a Hugging Face model; keep the Megatron checkpoint (--save), or train a "
                              "family that has one")
    return spec.hf_reward_architecture


def spec_for_args(args) -> ModelSpec:
    """The family whose fixed Megatron arguments ``args`` has (for checkpoints trained from flags)."""
    moe = bool(getattr(args, "num_experts", None))
    for spec in MODEL_SPECS.values():
        if (spec.qkv_bias, spec.qk_layernorm, bool(spec.moe)) == (bool(getattr(args, "add_qkv_bias", False)),
                                                            bool(getattr(args, "qk_layernorm", False)), moe):
            return spec
    raise ConversionError(f"no model family has --add-qkv-bias={getattr(args, 'add_qkv_bias', False)}, "
                          f"--qk-layernorm={getattr(args, 'qk_layernorm', False)} and --num-experts={moe}")


def detect_model_type(hf_config: dict, config_path: str = "config.json") -> str:
    """The spec name for a config.json, from ``model_type`` or ``architectures``."""
    model_type = hf_config.get("model_type")
    archs = hf_config.get("architectures") or []
    for name, arch in SHARED_EXPERT_FAMILIES.items():
        if model_type == name or arch in archs:
            raise ConversionError(f"{config_path}: {arch} ({name}) has shared experts, which are not supported; "
                                  "mixture-of-experts families supported: qwen3_moe (Qwen3-MoE), mixtral (Mixtral)")
    for spec in MODEL_SPECS.values():
        if model_type == spec.hf_model_type:
            return spec.name
    for arch in hf_config.get("architectures") or []:
        for spec in MODEL_SPECS.values():
            if arch in (spec.hf_architecture, spec.hf_reward_architecture):
                return spec.name
    raise ConversionError(
        f"{config_path}: unknown architecture (model_type={model_type!r}, "
        f"architectures={hf_config.get('architectures')!r}); supported model types: "
        f"{', '.join(sorted(MODEL_SPECS))} ({', '.join(FAMILY_NAMES)}). --model-type-hf reads a config of "
        "another name as one of these, whose fields it must then have"
    )


def rope_settings(hf_config: dict, spec: ModelSpec, where: str) -> dict:
    """RoPE base and scaling from a transformers 5.x (``rope_parameters``) or 4.x (``rope_theta``,
    ``rope_scaling``) config, as Megatron arguments; every key of the RoPE dict must be understood."""
    params = dict(hf_config.get("rope_scaling") or {})
    params.update(hf_config.get("rope_parameters") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    name = "rope_parameters" if hf_config.get("rope_parameters") else "rope_scaling"
    if rope_type not in spec.rope_types:
        raise ConversionError(f"{where}: {name}.rope_type={rope_type!r} is not supported for {spec.name}: "
                              f"supported: {', '.join(spec.rope_types)}")
    unknown = sorted(set(params) - set(ROPE_KEYS[rope_type]))
    if unknown:
        raise ConversionError(f"{where}: {name} field(s) {', '.join(unknown)} are not supported "
                              f"({rope_type} RoPE reads {', '.join(ROPE_KEYS[rope_type][2:])})")
    theta = float(params.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
    out = {"rotary_base": int(theta) if theta.is_integer() else theta, "use_rope_scaling": rope_type == "llama3"}
    if rope_type == "llama3":
        for key in ROPE_KEYS["llama3"][3:]:
            if params.get(key) is None:
                raise ConversionError(f"{where}: {name}.{key} is missing (llama3 RoPE needs it)")
        out.update(rope_scaling_factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
                   high_freq_factor=float(params["high_freq_factor"]),
                   original_max_position_embeddings=int(params["original_max_position_embeddings"]))
    return out


def check_config_fields(hf_config: dict, spec: ModelSpec, where: str, seq_length: int) -> None:
    """Every field is mapped, checked by the family's row, or refused by name (all at once)."""
    moe = [k for k in MOE_FIELDS if k in hf_config and hf_config[k] not in (None, 0, [], False)
           and k not in spec.fields]
    if moe:
        raise ConversionError(f"{where}: mixture-of-experts field(s) {', '.join(moe)} are not supported: "
                              + (f"the {spec.name} mapping reads {spec.hf_architecture}'s expert fields only (routed "
                                 "experts, no shared experts)" if spec.moe else f"{spec.name} is converted as a dense model"))
    ctx = {"where": where, "seq_length": seq_length}
    checks = {**COMMON_FIELDS, **spec.fields}
    unknown = sorted(k for k in hf_config if k not in checks and k not in MAPPED_FIELDS and k not in MOE_FIELDS)
    if unknown:
        raise ConversionError(
            f"{where}: field(s) {', '.join(unknown)} are not understood by the {spec.name} mapping; the converted "
            "model could differ from this config, so it is refused (known fields: see MODEL_SPECS in "
            "mindspeed_pack/convert/model_specs.py)")
    for name, check in checks.items():
        if name in hf_config:
            check(name, hf_config[name], hf_config, ctx)


def _require(hf_config: dict, field: str, where: str):
    if field not in hf_config or hf_config[field] is None:
        raise ConversionError(f"{where}: required field {field!r} is missing")
    return hf_config[field]


def resolve_padded_vocab(
    vocab_size: int, tp: int, make_vocab_size_divisible_by: int = 128, padded_vocab_size: Optional[int] = None,
    where: str = "",
) -> int:
    """Megatron's padded vocabulary: the explicit size if given (checked), else its rounding rule."""
    if padded_vocab_size is None:
        if make_vocab_size_divisible_by < 1:
            raise ConversionError(f"--make-vocab-size-divisible-by must be >= 1, got {make_vocab_size_divisible_by}")
        return megatron_padded_vocab_size(vocab_size, make_vocab_size_divisible_by, tp)
    if padded_vocab_size < vocab_size:
        raise ConversionError(
            f"{where}--padded-vocab-size {padded_vocab_size} is smaller than the model's vocabulary "
            f"({vocab_size} rows); it must be >= {vocab_size}"
        )
    if padded_vocab_size % tp:
        raise ConversionError(
            f"{where}--padded-vocab-size {padded_vocab_size} is not divisible by the tensor parallel size {tp}"
        )
    return padded_vocab_size


def check_parallel_sizes(args, tp: int, pp: int, where: str = "", ep: int = 1) -> None:
    """TP must divide heads and query groups (and the padded vocab); PP must split layers evenly;
    EP must split the experts evenly."""
    if tp < 1 or pp < 1 or ep < 1:
        raise ConversionError(f"{where}parallel sizes must be >= 1, got TP={tp}, PP={pp}, EP={ep}")
    if ep > 1 and not getattr(args, "num_experts", None):
        raise ConversionError(f"{where}expert parallel size {ep} needs a mixture-of-experts model; this one is dense")
    if ep > 1 and args.num_experts % ep:
        raise ConversionError(f"{where}expert parallel size {ep} does not divide num_experts={args.num_experts}")
    if args.num_attention_heads % tp:
        raise ConversionError(
            f"{where}tensor parallel size {tp} does not divide num_attention_heads={args.num_attention_heads}"
        )
    if args.num_query_groups % tp:
        raise ConversionError(
            f"{where}tensor parallel size {tp} does not divide the number of query groups "
            f"(num_key_value_heads) = {args.num_query_groups}"
        )
    if args.ffn_hidden_size % tp:
        raise ConversionError(f"{where}tensor parallel size {tp} does not divide ffn_hidden_size={args.ffn_hidden_size}")
    if args.padded_vocab_size % tp:
        raise ConversionError(f"{where}tensor parallel size {tp} does not divide padded_vocab_size={args.padded_vocab_size}")
    if pp > args.num_layers:
        raise ConversionError(f"{where}pipeline parallel size {pp} is larger than the layer count {args.num_layers}")
    if args.num_layers % pp:
        raise ConversionError(
            f"{where}pipeline parallel size {pp} does not divide the layer count {args.num_layers} "
            "(stages must hold equal numbers of layers)"
        )


def args_from_hf_config(
    hf_config: dict,
    model_type_hf: Optional[str] = None,
    tp: int = 1,
    pp: int = 1,
    make_vocab_size_divisible_by: int = 128,
    padded_vocab_size: Optional[int] = None,
    where: str = "config.json",
    seq_length: Optional[int] = None,
    ep: int = 1,
) -> argparse.Namespace:
    """Megatron-LM arguments (names as ``build_gpt_model`` reads them) for a HF config.

    ``seq_length`` (default ``max_position_embeddings``) is the longest sequence the model
    will see: a sliding window shorter than it is refused.
    """
    name = model_type_hf or detect_model_type(hf_config, where)
    if model_type_hf:
        try:
            found = detect_model_type(hf_config, where)
        except ConversionError:
            found = model_type_hf  # config.json names no family this converter knows: the flag's is taken
        if found != model_type_hf:  # the mapping's errors (fields not understood, tensors missing) named no cause
            raise ConversionError(f"{where}: holds a {found} model (model_type {hf_config.get('model_type')!r}), not "
                                  f"{model_type_hf} (--model-type-hf): pass --model-type-hf {found}, or leave it out "
                                  "(detected from config.json)")
    spec = get_spec(name)
    max_pos = int(hf_config.get("max_position_embeddings") or 4096)
    seq_length = int(seq_length or max_pos)
    check_config_fields(hf_config, spec, where, seq_length)
    hidden = int(_require(hf_config, "hidden_size", where))
    heads = int(_require(hf_config, "num_attention_heads", where))
    groups = int(hf_config.get("num_key_value_heads") or heads)
    if heads % groups:
        raise ConversionError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}")
    head_dim = hf_config.get("head_dim") or spec.head_dim or hidden // heads
    vocab = int(_require(hf_config, "vocab_size", where))
    args = argparse.Namespace(
        num_layers=int(_require(hf_config, "num_hidden_layers", where)),
        hidden_size=hidden,
        ffn_hidden_size=int(_require(hf_config, "intermediate_size", where)),
        num_attention_heads=heads,
        group_query_attention=groups != heads,
        num_query_groups=groups,
        kv_channels=int(head_dim),
        add_qkv_bias=spec.qkv_bias,
        disable_bias_linear=True,
        swiglu=True,
        normalization="RMSNorm",
        norm_epsilon=float(hf_config.get("rms_norm_eps", 1e-6)),
        position_embedding_type="rope",
        **{**OPTIONAL_MODEL_ARGS, **rope_settings(hf_config, spec, where), "qk_layernorm": spec.qk_layernorm,
           "sliding_window": _sliding_window(hf_config, spec)},
        untie_embeddings_and_output_weights=not bool(hf_config.get("tie_word_embeddings", False)),
        vocab_size=vocab,
        padded_vocab_size=resolve_padded_vocab(vocab, tp, make_vocab_size_divisible_by, padded_vocab_size),
        max_position_embeddings=max_pos,
        seq_length=seq_length,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        model_type_hf=spec.name,
    )
    if spec.moe:
        vars(args).update(moe_args_from_hf_config(hf_config, args.num_layers, where, spec.moe))
    if _is_reward_config(hf_config):
        archs = hf_config.get("architectures")
        if reward_architecture(spec) not in archs:
            raise ConversionError(f"{where}: architectures {archs!r}: the {spec.name} reward model is "
                                  f"{spec.hf_reward_architecture}")
        pad = hf_config.get("pad_token_id")
        args.reward_head, args.reward_pad_token_id = True, None if pad is None else int(pad)
    args.expert_model_parallel_size = ep
    check_parallel_sizes(args, tp, pp, where=f"{where}: ", ep=ep)
    return args


def moe_args_from_hf_config(hf_config: dict, num_layers: int, where: str,
                            layout: ExpertLayout = QWEN3_MOE_EXPERTS) -> dict:
    """A MoE family's expert fields as Megatron-LM arguments. Qwen3-MoE: a layer is sparse unless listed in
    ``mlp_only_layers``, and only every ``decoder_sparse_step``-th one (transformers' rule); Mixtral: every layer."""
    experts = hf_config.get("num_experts") or hf_config.get("num_local_experts")
    if not experts:
        raise ConversionError(f"{where}: required field {layout.count_field!r} is missing")
    topk = int(_require(hf_config, "num_experts_per_tok", where))
    if not 1 <= topk <= int(experts):
        raise ConversionError(f"{where}: num_experts_per_tok={topk} must be in [1, {layout.count_field}={experts}]")
    step = int(hf_config.get("decoder_sparse_step") or 1) if layout.dense_layers else 1
    dense = set(hf_config.get("mlp_only_layers") or []) if layout.dense_layers else set()
    outside = sorted(i for i in dense if not 0 <= i < num_layers)
    if outside:
        raise ConversionError(f"{where}: mlp_only_layers {outside} are not layers of a {num_layers}-layer model")
    renormalised = layout.renormalised if layout.renormalised is not None else bool(hf_config.get("norm_topk_prob"))
    return dict(num_experts=int(experts), moe_router_topk=topk,
                moe_ffn_hidden_size=int(_require(hf_config, layout.width_field, where)),
                # normalised top-k weights = softmax over the chosen experts' logits (megatron's default)
                moe_router_pre_softmax=not renormalised,
                moe_layer_freq=[int(i not in dense and (i + 1) % step == 0) for i in range(num_layers)])


def hf_moe_fields(args, layout: ExpertLayout) -> dict:
    """The config.json fields of the experts of ``args`` in ``layout``'s family (inverse of moe_args_from_hf_config;
    what a family cannot say, e.g. Mixtral's dense layers, comes back different and settings_lost names it)."""
    fields = {layout.count_field: args.num_experts, "num_experts_per_tok": args.moe_router_topk,
              layout.width_field: args.moe_ffn_hidden_size or args.ffn_hidden_size}
    if layout.renormalised is None:
        fields["norm_topk_prob"] = not args.moe_router_pre_softmax
    if layout.dense_layers:
        sparse = set(moe_layers(args))
        fields.update(decoder_sparse_step=1, mlp_only_layers=[i for i in range(args.num_layers) if i not in sparse])
    return fields


def moe_layers(args) -> list:
    """Global indices of the MoE layers of ``args`` (none for a dense model)."""
    if not getattr(args, "num_experts", None):
        return []
    return [i for i, sparse in enumerate(moe_layer_pattern(args)) if sparse]


def _sliding_window(hf_config: dict, spec: ModelSpec) -> Optional[int]:
    """The window a family applies (kept in the checkpoint args: training refuses longer sequences)."""
    if spec.fields.get("sliding_window") is window_covers_sequence and hf_config.get("sliding_window") is not None:
        return int(hf_config["sliding_window"])
    return None


def args_to_dict(args) -> dict:
    return {**{k: getattr(args, k) for k in MODEL_ARG_NAMES},
            **{k: getattr(args, k, default) for k, default in OPTIONAL_MODEL_ARGS.items()}}


def training_model_args(args) -> dict:
    """The model-shape arguments a training run's checkpoint records (those of :func:`args_to_dict`), with
    the loaded model's sliding window and family, or the family the flags describe."""
    out = {k: getattr(args, k, None) for k in MODEL_ARG_NAMES}
    out.update({k: getattr(args, k, default) for k, default in OPTIONAL_MODEL_ARGS.items()})
    out["sliding_window"] = getattr(args, "loaded_sliding_window", None)
    if out.get("model_type_hf") is None:
        # kept from a converted checkpoint when there was one; else the family the flags describe, if any
        # (a model no family describes still saves and resumes; only its conversion to HF is refused)
        out["model_type_hf"] = getattr(args, "loaded_model_type_hf", None)
        if out["model_type_hf"] is None:
            try:
                out["model_type_hf"] = spec_for_args(args).name
            except ConversionError:
                pass
    return out


def args_from_dict(stored: dict, where: str) -> argparse.Namespace:
    missing = [k for k in MODEL_ARG_NAMES if k not in stored]
    if missing:
        raise ConversionError(f"{where}: checkpoint 'args' lacks {missing}; it was not written by this converter "
                              "or a trainer that stores the model-shape arguments")
    args = argparse.Namespace(**{k: stored[k] for k in MODEL_ARG_NAMES},
                              **{k: stored.get(k, default) for k, default in OPTIONAL_MODEL_ARGS.items()})
    args.model_type_hf = recorded_family(args.model_type_hf)
    if args.kv_channels is None:  # a training run without --kv-channels (before it was filled in)
        args.kv_channels = args.hidden_size // args.num_attention_heads
    return args


def hf_rope_parameters(args) -> dict:
    """transformers' ``rope_parameters`` for the Megatron RoPE arguments."""
    params = {"rope_type": "default", "rope_theta": float(args.rotary_base)}
    if getattr(args, "use_rope_scaling", False):
        params.update(rope_type="llama3", factor=float(args.rope_scaling_factor),
                      low_freq_factor=float(args.low_freq_factor), high_freq_factor=float(args.high_freq_factor),
                      original_max_position_embeddings=int(args.original_max_position_embeddings))
    return params


def hf_config_from_args(args, spec: ModelSpec, dtype: str, extra: Optional[dict] = None):
    """A transformers config object for the converted model (defaults from transformers itself).

    ``extra`` carries fields megatron does not know (token ids, ...) from a source config.
    """
    from transformers import AutoConfig

    fields = dict(
        architectures=[spec.hf_architecture],
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.ffn_hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_query_groups,
        hidden_act="silu",
        max_position_embeddings=args.max_position_embeddings,
        rms_norm_eps=args.norm_epsilon,
        tie_word_embeddings=not args.untie_embeddings_and_output_weights,
        rope_parameters=hf_rope_parameters(args),
        head_dim=args.kv_channels,
        dtype=dtype,
        **spec.hf_defaults,
    )
    if spec.moe:
        fields.update(hf_moe_fields(args, spec.moe))
        if extra and extra.get("router_aux_loss_coef") is not None:  # a training setting: the source model's
            fields["router_aux_loss_coef"] = extra["router_aux_loss_coef"]
    if spec.fields.get("sliding_window") is window_covers_sequence:
        fields["sliding_window"] = getattr(args, "sliding_window", None)  # transformers' own default is a window
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if extra and extra.get(key) is not None:
            fields[key] = extra[key]
    if getattr(args, "reward_head", False):  # an outcome reward model: pooled at the token training read
        fields.update(architectures=[reward_architecture(spec)], num_labels=1,
                      pad_token_id=getattr(args, "reward_pad_token_id", None))
    return AutoConfig.for_model(spec.hf_model_type, **fields)


def settings_lost(mine: dict, spec: ModelSpec, where: str) -> List[str]:
    """The model's settings (``mine``: the arguments a checkpoint records) that a Hugging Face ``spec`` model
    would not keep: they go through the converter both ways (to a transformers config and back), and every
    one that does not come back is named (``--add-qkv-bias True (a LlamaForCausalLM has False)``)."""
    # what save_pretrained writes into config.json (to_diff_dict), as the converter reads it back; a reward
    # model of a family without a sequence-classification class is refused here
    config = hf_config_from_args(argparse.Namespace(**mine), spec, "float32").to_diff_dict()
    back = vars(args_from_hf_config(config, spec.name, mine["tensor_model_parallel_size"],
                                    mine["pipeline_model_parallel_size"], mine["make_vocab_size_divisible_by"],
                                    mine["padded_vocab_size"], where=where))
    # compared as the model reads them: --moe-layer-freq 1 is [1, 1, ...], no --moe-ffn-hidden-size is the FFN's;
    # the dense FFN's width, where no layer has one (every layer MoE, as in Mixtral), shapes nothing
    unused = {"ffn_hidden_size"} if moe_layers(argparse.Namespace(**mine)) == list(range(mine["num_layers"])) else set()
    return [f"--{k.replace('_', '-')} {mine[k]} (a {spec.hf_architecture} has {v})" for k, v in back.items()
            if k in mine and k not in (*RUN_LAYOUT_ARGS, "model_type_hf", *unused)
            and not same_setting(_setting(mine, k), _setting(back, k))]

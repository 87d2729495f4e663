"""What differs between the Hugging Face architectures the converter knows.

Qwen2/Qwen2.5 and Llama 2/3 share one layout (pre-norm RMSNorm decoder, RoPE, GQA,
SwiGLU MLP, optional tied embeddings); they differ only in the attention biases. Each
architecture is one :class:`ModelSpec` row; everything else (tensor names, fused layouts)
lives in :mod:`.weight_map`. Configs whose features ``build_gpt_model`` cannot reproduce
(RoPE scaling, sliding windows, other activations, extra biases) are refused here, before
any weight is read, instead of producing a model that silently differs.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from mindspeed_pack.model.gpt import padded_vocab_size as megatron_padded_vocab_size


class ConversionError(ValueError):
    """Bad converter input: the message says which file/field/tensor and what to do."""


@dataclass(frozen=True)
class ModelSpec:
    name: str  # --model-type-hf value
    hf_model_type: str  # config.json "model_type"
    hf_architecture: str  # config.json "architectures"[0]
    qkv_bias: bool


MODEL_SPECS = {
    "qwen2": ModelSpec("qwen2", "qwen2", "Qwen2ForCausalLM", qkv_bias=True),
    "llama": ModelSpec("llama", "llama", "LlamaForCausalLM", qkv_bias=False),
}

# args stored in every converted checkpoint: the model shape the trainer must match
MODEL_ARG_NAMES = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
    "num_query_groups", "kv_channels", "add_qkv_bias", "disable_bias_linear", "swiglu", "normalization",
    "norm_epsilon", "position_embedding_type", "rotary_base", "untie_embeddings_and_output_weights",
    "padded_vocab_size", "vocab_size", "max_position_embeddings", "seq_length",
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "make_vocab_size_divisible_by",
    "model_type_hf",
)


def get_spec(model_type_hf: str) -> ModelSpec:
    try:
        return MODEL_SPECS[model_type_hf]
    except KeyError:
        raise ConversionError(
            f"unknown --model-type-hf {model_type_hf!r}; supported: {', '.join(sorted(MODEL_SPECS))}"
        ) from None


def detect_model_type(hf_config: dict, config_path: str = "config.json") -> str:
    """The spec name for a config.json, from ``model_type`` or ``architectures``."""
    model_type = hf_config.get("model_type")
    for spec in MODEL_SPECS.values():
        if model_type == spec.hf_model_type:
            return spec.name
    for arch in hf_config.get("architectures") or []:
        for spec in MODEL_SPECS.values():
            if arch == spec.hf_architecture:
                return spec.name
    raise ConversionError(
        f"{config_path}: unknown architecture (model_type={model_type!r}, "
        f"architectures={hf_config.get('architectures')!r}); supported model types: "
        f"{', '.join(sorted(MODEL_SPECS))} (Qwen2/Qwen2.5, Llama 2/3). Pass --model-type-hf to override."
    )


def rope_theta(hf_config: dict) -> float:
    """RoPE base from a transformers 4.x (``rope_theta``) or 5.x (``rope_parameters``) config."""
    params = hf_config.get("rope_parameters") or {}
    if "rope_theta" in params:
        return float(params["rope_theta"])
    return float(hf_config.get("rope_theta", 10000.0))


def _int_if_integral(value: float):
    """Megatron-LM's --rotary-base is an int; keep fractional bases as they are."""
    return int(value) if float(value).is_integer() else value


def _refuse_unsupported(hf_config: dict, spec: ModelSpec, where: str) -> None:
    def bad(field, value, why):
        raise ConversionError(f"{where}: {field}={value!r} is not supported: {why}")

    act = hf_config.get("hidden_act", "silu")
    if act != "silu":
        bad("hidden_act", act, "the Megatron model uses SwiGLU (silu)")
    scaling = hf_config.get("rope_scaling")
    params = hf_config.get("rope_parameters") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if scaling or rope_type != "default":
        bad("rope_scaling/rope_parameters", scaling or params, "build_gpt_model applies plain RoPE only")
    if hf_config.get("use_sliding_window"):
        bad("use_sliding_window", True, "the Megatron model attends to the full (packed) sequence")
    if hf_config.get("mlp_bias"):
        bad("mlp_bias", True, f"{spec.name} is converted without MLP biases")
    attention_bias = hf_config.get("attention_bias")
    if attention_bias is not None and bool(attention_bias) != spec.qkv_bias:
        bad("attention_bias", attention_bias, f"{spec.name} expects attention_bias={spec.qkv_bias}")


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


def check_parallel_sizes(args, tp: int, pp: int, where: str = "") -> None:
    """TP must divide heads and query groups (and the padded vocab); PP must split layers evenly."""
    if tp < 1 or pp < 1:
        raise ConversionError(f"{where}parallel sizes must be >= 1, got TP={tp}, PP={pp}")
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
) -> argparse.Namespace:
    """Megatron-LM arguments (names as ``build_gpt_model`` reads them) for a HF config."""
    name = model_type_hf or detect_model_type(hf_config, where)
    spec = get_spec(name)
    _refuse_unsupported(hf_config, spec, where)
    hidden = int(_require(hf_config, "hidden_size", where))
    heads = int(_require(hf_config, "num_attention_heads", where))
    groups = int(hf_config.get("num_key_value_heads") or heads)
    if heads % groups:
        raise ConversionError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}")
    head_dim = hf_config.get("head_dim") or hidden // heads
    vocab = int(_require(hf_config, "vocab_size", where))
    max_pos = int(hf_config.get("max_position_embeddings") or 4096)
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
        rotary_base=_int_if_integral(rope_theta(hf_config)),
        untie_embeddings_and_output_weights=not bool(hf_config.get("tie_word_embeddings", False)),
        vocab_size=vocab,
        padded_vocab_size=resolve_padded_vocab(vocab, tp, make_vocab_size_divisible_by, padded_vocab_size),
        max_position_embeddings=max_pos,
        seq_length=max_pos,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        model_type_hf=spec.name,
    )
    check_parallel_sizes(args, tp, pp, where=f"{where}: ")
    return args


def args_to_dict(args) -> dict:
    return {k: getattr(args, k) for k in MODEL_ARG_NAMES}


def args_from_dict(stored: dict, where: str) -> argparse.Namespace:
    missing = [k for k in MODEL_ARG_NAMES if k not in stored]
    if missing:
        raise ConversionError(f"{where}: checkpoint 'args' lacks {missing}; it was not written by this converter "
                              "or a trainer that stores the model-shape arguments")
    return argparse.Namespace(**{k: stored[k] for k in MODEL_ARG_NAMES})


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
        rope_parameters={"rope_type": "default", "rope_theta": float(args.rotary_base)},
        dtype=dtype,
    )
    if spec.name == "llama":
        fields.update(attention_bias=False, mlp_bias=False)
    if spec.name == "llama" or args.kv_channels * args.num_attention_heads != args.hidden_size:
        fields["head_dim"] = args.kv_channels
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if extra and extra.get(key) is not None:
            fields[key] = extra[key]
    return AutoConfig.for_model(spec.hf_model_type, **fields)

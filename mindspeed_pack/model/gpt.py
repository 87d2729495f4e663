"""Build megatron-core ``GPTModel`` (the Qwen2/Qwen3/Llama/Mistral/Mixtral layout) from Megatron-LM style arguments.

``args`` is any object with Megatron-LM's argument names (``num_layers``, ``hidden_size``,
``group_query_attention``, ``swiglu``, ...): the training parser's namespace, or a
converter's. The same function builds every pipeline stage; the layer spec decides the
attention backend (see :mod:`mindspeed_pack.model.spec`); ``reward_head`` (an outcome reward model) puts
a scalar score head where the output layer was (:mod:`mindspeed_pack.model.score_head`).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from mindspeed_pack.model import compiled, compiled_layers, lora, wgrad_fusion
from mindspeed_pack.model.moe import moe_config_kwargs
from mindspeed_pack.model.packed_gpt import PackedGPTModel
from mindspeed_pack.model.rope import gpt_model_rope_kwargs, scale_rotary_embedding
from mindspeed_pack.model.spec import layer_spec, resolve_backend
from mindspeed_pack.model.te_spec import HAVE_TE
from mindspeed_pack.runtime.platform import cuda_usable

log = logging.getLogger(__name__)
_SKIPPED_LOGGED = False


def params_dtype(args) -> torch.dtype:
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return torch.float32


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tp: int = 1) -> int:
    """Megatron's rule: pad the vocabulary to a multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def fusion_settings(args, on_gpu: bool, backend: str) -> dict:
    """Megatron-LM's fused-kernel switches: on unless ``--no-*-fusion``, where the kernel exists.

    Gradient-accumulation fusion: TE's linear layers do it themselves, megatron-core's local ones through
    :mod:`~mindspeed_pack.model.wgrad_fusion` (addmm into the fp32 buffer; Apex where installed). Fused RoPE
    (THD) is TE's kernel. On a CPU none of these kernels exists: the unfused path computes the same thing, and
    :func:`_log_cpu_skips` names each skipped kernel once (a test may install the accumulation there).
    """
    swiglu = getattr(args, "swiglu", False)
    accumulate = not getattr(args, "no_gradient_accumulation_fusion", False)
    wanted = {
        "masked_softmax_fusion": not getattr(args, "no_masked_softmax_fusion", False),
        "bias_dropout_fusion": not getattr(args, "no_bias_dropout_fusion", False),
        "bias_activation_fusion": swiglu and not getattr(args, "no_bias_swiglu_fusion", False),
        "apply_rope_fusion": HAVE_TE and not getattr(args, "no_rope_fusion", False),
        "gradient_accumulation_fusion": accumulate and (
            backend == "te" or (on_gpu and wgrad_fusion.install(dtype=params_dtype(args)))),
    }
    if on_gpu:
        return wanted
    _log_cpu_skips([k for k, v in wanted.items() if v])
    return {k: False for k in wanted} | {"gradient_accumulation_fusion": accumulate and backend != "te"
                                         and wgrad_fusion.installed()}


def _log_cpu_skips(names) -> None:
    global _SKIPPED_LOGGED
    if names and not _SKIPPED_LOGGED:
        log.info("no CUDA device: fused GPU kernels skipped (unfused equivalents run): %s", ", ".join(names))
        _SKIPPED_LOGGED = True


def transformer_config(args, backend: str = "local") -> TransformerConfig:
    on_gpu = cuda_usable()
    heads = args.num_attention_heads
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    swiglu = getattr(args, "swiglu", False)
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=getattr(args, "kv_channels", None) or args.hidden_size // heads,
        add_qkv_bias=getattr(args, "add_qkv_bias", False),
        # also read by finalize_model_grads: it sums the q/k-norm gradients over TP ranks (each holds some heads)
        qk_layernorm=getattr(args, "qk_layernorm", False),
        add_bias_linear=not getattr(args, "disable_bias_linear", False),
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        normalization=getattr(args, "normalization", "RMSNorm"),
        layernorm_epsilon=getattr(args, "norm_epsilon", 1e-5),
        hidden_dropout=getattr(args, "hidden_dropout", 0.0),
        attention_dropout=getattr(args, "attention_dropout", 0.0),
        init_method_std=getattr(args, "init_method_std", 0.02),
        params_dtype=params_dtype(args),
        bf16=getattr(args, "bf16", False),
        fp16=getattr(args, "fp16", False),
        tensor_model_parallel_size=getattr(args, "tensor_model_parallel_size", 1),
        pipeline_model_parallel_size=getattr(args, "pipeline_model_parallel_size", 1),
        sequence_parallel=getattr(args, "sequence_parallel", False),
        context_parallel_size=getattr(args, "context_parallel_size", 1),
        cp_comm_type=getattr(args, "cp_comm_type", None) if getattr(args, "context_parallel_size", 1) > 1 else None,
        pipeline_dtype=params_dtype(args),
        # the same seed gives the same full weights at every TP size
        use_cpu_initialization=getattr(args, "use_cpu_initialization", True),
        perform_initialization=True,
        **fusion_settings(args, on_gpu, backend),
        persist_layer_norm=on_gpu and backend == "te",
        attention_softmax_in_fp32=getattr(args, "attention_softmax_in_fp32", False),
        deterministic_mode=getattr(args, "deterministic_mode", False),
        recompute_granularity=getattr(args, "recompute_granularity", None),
        recompute_method=getattr(args, "recompute_method", None),
        recompute_num_layers=getattr(args, "recompute_num_layers", None),
        recompute_modules=getattr(args, "recompute_modules", None),
        # per-token loss summed here, averaged over the global batch's tokens by the trainer
        calculate_per_token_loss=True,
        **moe_config_kwargs(args),
    )


def _no_te(args) -> str:
    """Why this run cannot use Transformer Engine's attention ("" if it can)."""
    if getattr(args, "sequence_packing_scheduler", None) == "default_dynamic_cp":
        return ("--sequence-packing-scheduler default_dynamic_cp: megatron-core 0.16 applies THD RoPE over its fixed "
                "CP group, not a micro-batch's own (use --attention-backend flash or local)")
    return ""


def attention_backend(args, quiet: bool = False) -> str:
    """The attention backend this run builds (``--attention-backend``, ``auto`` resolved on this machine)."""
    return resolve_backend(getattr(args, "attention_backend", "auto"), params_dtype(args),
                           getattr(args, "attention_dropout", 0.0), _no_te(args), quiet=quiet)


def build_gpt_model(args, pre_process: bool = True, post_process: bool = True, vp_stage=None) -> PackedGPTModel:
    backend = attention_backend(args)
    if getattr(args, "torch_compile_kernels", "auto") == "layers":
        compiled_layers.check_supported(args, backend)
    compile_mode, why = compiled_layers.resolve_mode(args, backend, cuda_usable())
    log.info("torch.compile: %s (%s)", compiled_layers.COMPILE_WORDS[compile_mode], why)
    compiled.set_enabled(compile_mode != "off")
    config = transformer_config(args, backend)
    spec = layer_spec(backend, config, qk_layernorm=config.qk_layernorm, vp_stage=vp_stage)
    adapters = lora.settings_from_args(args)
    if adapters:  # LoRA: the targeted linears of the spec carry adapters, the rest is frozen
        spec = lora.adapt_layer_spec(spec, adapters)
    model = PackedGPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=getattr(args, "max_position_embeddings", None) or args.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not getattr(args, "untie_embeddings_and_output_weights", False),
        position_embedding_type=getattr(args, "position_embedding_type", "rope"),
        rotary_base=int(getattr(args, "rotary_base", 10000)),
        rotary_percent=getattr(args, "rotary_percent", 1.0),
        vp_stage=vp_stage,
        **gpt_model_rope_kwargs(args),
        rope_in_attention=backend in ("local", "flash"),
        real_vocab_size=getattr(args, "vocab_size", None),
        loss_chunk=getattr(args, "cross_entropy_chunk_size", None),
        reward_head=bool(getattr(args, "reward_head", False)),  # an outcome reward model: a scalar score head
    )
    if model.position_embedding_type == "rope":
        scale_rotary_embedding(model, args)
    if adapters:
        lora.freeze_base(model)
    if compile_mode == "layers":
        compiled_layers.compile_layers(model)
    model.attention_backend = backend
    return model

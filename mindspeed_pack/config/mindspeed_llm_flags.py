"""MindSpeed-LLM's own training flags, as its example scripts pass them, so such a script runs here.

MindSpeed-LLM's tune and pretrain scripts (Qwen2.5, Qwen3, Qwen3-MoE, Llama 3) pass flags Megatron-LM lacks.
Each has one of four fates here, never a silent drop:

* **the same meaning under another name**: ``--enable-hf2mg-convert --model-type-hf qwen3`` is ``--load HF_DIR``
  (checked: ``--load`` is a Hugging Face directory of that family); ``--norm-topk-prob`` is the default top-k
  renormalisation (refused with ``--moe-router-pre-softmax``); ``--first-k-dense-replace K`` makes the
  first K layers dense (``--moe-layer-freq`` as a list); ``--moe-token-dispatcher-type alltoall_seq`` is
  ``alltoall``; ``--moe-intermediate-size`` is ``--moe-ffn-hidden-size``; ``--npu-deterministic`` is
  ``--deterministic-mode``; ``--spec ...qwen3_spec layer_spec`` is Qwen3's layer (checked:
  ``--qk-layernorm``); ``--expert-tensor-parallel-size`` equal to TP is what runs;
* **the same behaviour**: ``--no-shared-storage``, raw data preprocessed by each node's first rank
  (:mod:`mindspeed_pack.training.raw_data`);
* **a check of what always holds**: ``--is-pairwise-dataset`` (a pairwise ``--stage``), ``--lora-ckpt-filter``
  (a LoRA run's checkpoints hold only its adapters), ``--lora-register-forward-hook`` (a LoRA run: its adapters'
  gradients cross pipeline stages without MindSpeed-LLM's hook), ``--attention-mask-type`` (packed attention follows the
  samples' boundaries, ``cu_seqlens``, whichever mask type MindSpeed would build);
* **Megatron-LM's deprecated flags** MindSpeed-LLM's Mixtral scripts still pass: ``--no-position-embedding``
  (no learned position embedding: nothing to drop under RoPE; otherwise ``--position-embedding-type none``, where
  Megatron-LM refuses it) and ``--no-check-for-nan-in-loss-and-grad`` (``--nan-policy skip``);
* **Ascend optimisations** (:data:`NPU_OPTIMISATIONS`): overlap, swapping and fused NPU kernels, which change
  speed or memory but not what is computed: accepted with one warning naming them (a job that fitted only with
  a memory option may need activation recomputation here: ``--recompute-granularity``);
* **layouts not built here** (:data:`REFUSED`): refused by name, with the reason.
"""
from __future__ import annotations

import argparse
import logging

from mindspeed_pack.config.errors import ArgumentError
from mindspeed_pack.convert.model_specs import MINDSPEED_MODEL_TYPES, MODEL_SPECS

log = logging.getLogger(__name__)

# flag -> (its argparse keywords, what it does on an Ascend NPU)
NPU_OPTIMISATIONS = {
    "--use-ascend-coc": ({}, "computation-communication overlap of TP linears"),
    "--coc-fused-kernel": ({}, "fused NPU kernels for that overlap"),
    "--use-ascend-mc2": ({}, "fused matmul + collective NPU kernels"),
    "--use-cp-send-recv-overlap": ({}, "overlapped ring-attention send/receive"),
    "--moe-alltoall-overlap-comm": ({}, "overlapped MoE all-to-all"),
    "--moe-permutation-async-comm": ({}, "asynchronous MoE token permutation"),
    "--moe-fb-overlap": ({}, "forward/backward overlap of MoE layers"),
    "--moe-zero-memory": ({"default": None, "metavar": "LEVEL"}, "recomputed MoE activations"),
    "--swap-attention": ({}, "attention activations swapped to the host"),
    "--swap-optimizer": ({}, "optimizer states swapped to the host"),
    "--reuse-fp32-param": ({}, "bf16 parameters sharing the fp32 master copy's memory"),
    "--o2-optimizer": ({}, "bf16 optimizer states"),
    "--o2-gradient": ({}, "bf16 gradients"),
    "--recompute-activation-function": ({}, "the MLP's activation recomputed"),
    "--lora-fusion": ({}, "fused LoRA kernels (CCLoRA)"),
    "--gemm-gradient-accumulation-fusion": ({}, "weight gradients accumulated inside the GEMM (here: "
                                                "megatron-core's gradient-accumulation fusion, on by default)"),
    "--moe-permute-fusion": ({}, "fused token permutation kernels"),
    "--disable-gloo-group": ({}, "no gloo groups beside HCCL"),
}

# flag -> (its argparse keywords, why it is refused)
REFUSED = {
    "--num-layers-per-virtual-pipeline-stage": (
        {"type": int, "default": None},
        "the interleaved (virtual) pipeline schedule is not built here: drop it (the 1F1B schedule runs)"),
    "--noop-layers": (
        {"default": None},
        "no-op padding layers are not built here: --num-layers must divide over --pipeline-model-parallel-size"),
    "--num-layer-list": (
        {"default": None},
        "uneven pipeline stages are not built here: --num-layers must divide over --pipeline-model-parallel-size "
        "(a list of --pipeline-model-parallel-size equal stages, the even split, is accepted)"),
    "--no-pad-to-seq-lengths": (
        {"action": "store_true"},
        "unpacked samples are padded to --seq-length here; pack them instead (--neat-pack: several samples per "
        "row, each trained exactly as alone), which removes the padding, or drop the flag"),
    "--lora-modules-to-save": (
        {"nargs": "+", "default": None, "metavar": "MODULE"},
        "modules trained in full beside the adapters (MindSpeed-LLM's word_embeddings / output_layer, for an "
        "extended vocabulary) are not trained here: drop it (a LoRA run trains its adapters only; a full "
        "fine-tune, without --lora-r, trains every weight)"),
    "--qlora": (
        {"action": "store_true"},
        "a 4-bit quantised base (QLoRA) is not built here: LoRA trains on the base in --bf16 (the adapters and the "
        "export are the same kind), or drop it"),
    "--qlora-save-dequantize": (
        {"action": "store_true"},
        "goes with --qlora, which is not built here: drop both (LoRA trains on the --bf16 base)"),
}

QWEN3_SPEC = "mindspeed_llm.tasks.models.spec.qwen3_spec"
PAIRWISE_STAGES = ("dpo", "simpo", "orpo", "orm", "dpo_reference")


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("MindSpeed-LLM's own flags (mindspeed_pack/config/mindspeed_llm_flags.py)")
    g.add_argument("--enable-hf2mg-convert", action="store_true",
                   help="--load is a Hugging Face directory, converted as it is loaded (always so here)")
    g.add_argument("--model-type-hf", dest="hf2mg_model_type", default=None,
                   help="with --enable-hf2mg-convert: the family --load must hold (MindSpeed-LLM's names: "
                        f"{', '.join(sorted(MINDSPEED_MODEL_TYPES))}; or ours: {', '.join(sorted(MODEL_SPECS))})")
    g.add_argument("--spec", nargs="+", default=None, metavar="MODULE FUNCTION",
                   help=f"MindSpeed-LLM's layer spec: only {QWEN3_SPEC} layer_spec (Qwen3's layer: needs "
                        "--qk-layernorm); the layer follows from the model flags")
    g.add_argument("--norm-topk-prob", action="store_true",
                   help="top-k routing weights renormalised to sum to 1 (the default; not with "
                        "--moe-router-pre-softmax)")
    g.add_argument("--first-k-dense-replace", type=int, default=None, metavar="K",
                   help="the first K layers dense: layer i (from 0) is MoE when i >= K and i %% --moe-layer-freq "
                        "is 0 (MindSpeed-LLM's rule; K <= 0: none dense)")
    g.add_argument("--moe-intermediate-size", type=int, default=None,
                   help="MindSpeed-LLM's older name of --moe-ffn-hidden-size")
    g.add_argument("--npu-deterministic", action="store_true",
                   help="MindSpeed-LLM's deterministic computing: here --deterministic-mode")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="experts are split over the tensor-parallel group: only --tensor-model-parallel-size's value")
    g.add_argument("--is-pairwise-dataset", action="store_true",
                   help="the data are preference pairs: checked against --stage (dpo, simpo, orpo, orm)")
    g.add_argument("--lora-ckpt-filter", action="store_true",
                   help="save only the LoRA adapters (what a LoRA run always saves here)")
    g.add_argument("--lora-register-forward-hook", nargs="+", default=None, metavar="MODULE",
                   help="MindSpeed-LLM's repair of the gradient chain that a frozen first layer breaks under PP: not "
                        "needed here (the adapters' gradients reach every pipeline stage), accepted with LoRA")
    g.add_argument("--no-shared-storage", action="store_true",
                   help="the nodes share no file system: raw --data-path files are preprocessed by each node's first "
                        "rank onto its own disk (checkpoints still need a --save every node sees: a resume whose "
                        "ranks find different iterations stops)")
    g.add_argument("--attention-mask-type", default="causal", choices=["causal", "general"],
                   help="accepted no-op: packed attention is causal within each sample's boundaries (cu_seqlens) "
                        "whichever mask MindSpeed-LLM would build")
    g.add_argument("--no-position-embedding", dest="add_position_embedding", action="store_false",
                   help="Megatron-LM's deprecated flag: no learned position embedding. Under --position-embedding-type "
                        "rope it changes nothing; otherwise it is --position-embedding-type none (refused with an "
                        "explicit learned_absolute)")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false",
                   help="Megatron-LM: do not stop on a NaN loss or gradient. Here --nan-policy skip: the run goes on, "
                        "and a step with a non-finite loss or gradient is skipped with a warning (weights unchanged; "
                        "Megatron-LM would apply it); refused with --nan-policy stop")
    for flag, (kwargs, what) in NPU_OPTIMISATIONS.items():
        g.add_argument(flag, **({"action": "store_true"} if not kwargs else kwargs),
                       help=f"Ascend optimisation ({what}): accepted, no effect here")
    for flag, (kwargs, why) in REFUSED.items():
        g.add_argument(flag, **kwargs, help=f"refused: {why}")


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _even_layer_list(args, value) -> bool:
    """Whether ``--num-layer-list`` names the even split the pipeline builds anyway (``2,2`` for 4 layers on PP 2)."""
    try:
        counts = [int(n) for n in str(value).split(",")]
    except ValueError:
        return False
    return (len(counts) == args.pipeline_model_parallel_size and sum(counts) == args.num_layers
            and len(set(counts)) == 1)


def check_refused(args) -> None:
    """Refuse the layouts this project does not build (before anything else reads the flags)."""
    for flag, (_, why) in REFUSED.items():
        value = getattr(args, _dest(flag))
        if flag == "--num-layer-list" and value is not None and _even_layer_list(args, value):
            continue  # the stages --pipeline-model-parallel-size gives
        if value not in (None, False):
            shown = " ".join(map(str, value)) if isinstance(value, list) else value
            raise ArgumentError(f"{flag}{'' if value is True else f' {shown}'}: {why}")


def apply(args, given: set, loads_hf: bool) -> None:
    """Translate and check MindSpeed-LLM's flags; ``loads_hf``: ``--load`` is a Hugging Face directory. Runs
    after the Hugging Face ``--load``'s model flags are filled in, before validation."""
    check_refused(args)
    _hf_convert(args, loads_hf)
    if args.moe_intermediate_size is not None:
        if "moe_ffn_hidden_size" in given and args.moe_ffn_hidden_size != args.moe_intermediate_size:
            raise ArgumentError(f"--moe-intermediate-size {args.moe_intermediate_size} and --moe-ffn-hidden-size "
                                f"{args.moe_ffn_hidden_size} name the same size: pass one")
        args.moe_ffn_hidden_size = args.moe_intermediate_size
    if args.npu_deterministic:
        args.deterministic_mode = True
    _megatron_deprecated(args, given)
    if args.spec is not None:
        if args.spec[0] != QWEN3_SPEC:
            raise ArgumentError(f"--spec {' '.join(args.spec)}: only {QWEN3_SPEC} layer_spec is known here (the layer "
                                "follows from the model flags: drop --spec)")
        if not args.qk_layernorm:
            raise ArgumentError(f"--spec {QWEN3_SPEC} is Qwen3's layer, which normalises queries and keys: pass "
                                "--qk-layernorm")
    if args.norm_topk_prob and args.moe_router_pre_softmax:
        raise ArgumentError("--norm-topk-prob renormalises the top-k weights, --moe-router-pre-softmax does not"
                            + (" (as the Hugging Face --load's config.json says: norm_topk_prob false)"
                               if "moe_router_pre_softmax" not in given else "") + ": pass one of them")
    if args.first_k_dense_replace is not None:
        _first_k_dense(args, loads_hf)
    if args.moe_token_dispatcher_type == "alltoall_seq":  # megatron-core's older all-to-all: the same routing
        args.moe_token_dispatcher_type = "alltoall"
    etp = args.expert_tensor_parallel_size
    if etp is not None and etp != args.tensor_model_parallel_size:
        raise ArgumentError(f"--expert-tensor-parallel-size {etp}: experts are split over the tensor-parallel group "
                            f"here, so it must equal --tensor-model-parallel-size {args.tensor_model_parallel_size} "
                            "(or be dropped)")
    if args.is_pairwise_dataset and args.stage not in PAIRWISE_STAGES:
        raise ArgumentError(f"--is-pairwise-dataset: --stage {args.stage} does not train on preference pairs; pass "
                            f"--stage {' or '.join(PAIRWISE_STAGES[:4])}")
    if args.lora_ckpt_filter and args.lora_r is None:
        raise ArgumentError("--lora-ckpt-filter saves a LoRA run's adapters only: pass --lora-r and "
                            "--lora-target-modules (a full fine-tune saves every weight)")
    if args.lora_register_forward_hook and args.lora_r is None:
        raise ArgumentError(f"--lora-register-forward-hook {' '.join(args.lora_register_forward_hook)} goes with "
                            "LoRA (--lora-r, --lora-target-modules); a full fine-tune drops it")
    used = [flag for flag in NPU_OPTIMISATIONS if getattr(args, _dest(flag)) not in (None, False)]
    if used:
        log.warning("MindSpeed-LLM's Ascend optimisations have no effect here (what is computed is the same; speed "
                    "and memory differ: activation recomputation is --recompute-granularity): %s", ", ".join(used))


def _hf_convert(args, loads_hf: bool) -> None:
    """``--enable-hf2mg-convert`` / ``--model-type-hf``: a Hugging Face ``--load`` of that family."""
    name = args.hf2mg_model_type
    if name is not None and not args.enable_hf2mg_convert:
        raise ArgumentError(f"--model-type-hf {name} goes with --enable-hf2mg-convert (a Hugging Face "
                            "--load); a Megatron --load records its family")
    if not args.enable_hf2mg_convert:
        return
    if not loads_hf:
        raise ArgumentError(f"--enable-hf2mg-convert: --load {args.load} is not a Hugging Face model directory "
                            "(config.json and *.safetensors)")
    if name is None:
        return
    ours = MINDSPEED_MODEL_TYPES.get(name, name)
    if ours not in MODEL_SPECS:
        known = sorted({*MINDSPEED_MODEL_TYPES, *MODEL_SPECS})
        raise ArgumentError(f"--model-type-hf {name}: not a family converted here ({', '.join(known)})")
    found = getattr(args, "model_type_hf", None)  # what config.json holds (config/hf_flags.py)
    if found != ours:
        raise ArgumentError(f"--model-type-hf {name}{f' (= {ours})' if ours != name else ''}, but --load "
                            f"{args.load} holds a {found} model (its config.json)")


def _first_k_dense(args, loads_hf: bool) -> None:
    """MindSpeed-LLM's rule: layer ``i`` (from 0) is MoE when ``i >= K`` and ``--moe-layer-freq`` makes it MoE
    (``i % N == 0``, or the list's entry: a Hugging Face ``--load``'s config.json gives a list)."""
    k, layers, freq = args.first_k_dense_replace, args.num_layers, args.moe_layer_freq
    if not args.num_experts:
        raise ArgumentError(f"--first-k-dense-replace {k} needs --num-experts (a MoE model)")
    if layers is None or k >= layers:
        raise ArgumentError(f"--first-k-dense-replace {k} must be below --num-layers {layers}")
    moe = list(freq) if isinstance(freq, list) else [1 if i % freq == 0 else 0 for i in range(layers)]
    pattern = [v if i >= k else 0 for i, v in enumerate(moe)]
    if loads_hf and isinstance(freq, list) and pattern != freq:
        raise ArgumentError(f"--first-k-dense-replace {k} makes layers {', '.join(str(i) for i in range(k))} dense, "
                            f"but --load {args.load}'s config.json has MoE layers there: drop the flag")
    args.moe_layer_freq = pattern


def _megatron_deprecated(args, given: set) -> None:
    """Megatron-LM's ``--no-position-embedding`` and ``--no-check-for-nan-in-loss-and-grad`` (Mixtral's scripts)."""
    if not args.add_position_embedding:
        kind = "rope" if args.use_rotary_position_embeddings else args.position_embedding_type
        if kind == "learned_absolute":
            if "position_embedding_type" in given:
                raise ArgumentError("--no-position-embedding turns off the learned position embedding that "
                                    "--position-embedding-type learned_absolute asks for: pass one of them "
                                    "(--position-embedding-type none or rope)")
            log.info("--no-position-embedding: --position-embedding-type none (no position embedding)")
            args.position_embedding_type = "none"
        # rope / none: the model has no learned position embedding to turn off
    if not args.check_for_nan_in_loss_and_grad:
        if "nan_policy" in given and args.nan_policy == "stop":
            raise ArgumentError("--no-check-for-nan-in-loss-and-grad (here --nan-policy skip: the run goes on past a "
                                "non-finite loss or gradient) contradicts --nan-policy stop: pass one of them")
        args.nan_policy = "skip"

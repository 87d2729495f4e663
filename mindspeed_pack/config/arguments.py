"""Command-line arguments with Megatron-LM / MindSpeed-LLM names, and their validation.

Omitting a flag means what it means in Megatron-LM (its defaults: LayerNorm, learned absolute
positions, dropout 0.1, linear decay, ``--eval-iters 100``, ``--log-interval 100``); the few
defaults that differ are listed in the README ("Training flags with Megatron-LM's meaning").

Every flag of MindSpeed-LLM's Qwen2.5-7B pack example parses. Flags that only select a
fused CUDA kernel are accepted everywhere (the kernels are chosen by the layer spec) and
ignored with one warning on a CPU; flags that cannot work together fail with a clear error.
"""
from __future__ import annotations

import argparse
import ast
import logging
import os
import warnings

from megatron.core.tensor_parallel import random as megatron_random

from mindspeed_pack.config import (
    checkpoint_flags,
    finetune_defaults,
    hf_flags,
    mindspeed_llm_flags,
    model_head,
    peft_flags,
    resolved_config,
    yaml_file,
)
from mindspeed_pack.config.errors import ArgumentError, flag_scope
from mindspeed_pack.data.tokenizer import fold_megatron_hf_tokenizer
from mindspeed_pack.model import compiled_layers, lora
from mindspeed_pack.model.gpt import attention_backend, padded_vocab_size
from mindspeed_pack.model.moe import DISPATCHERS, LOAD_BALANCING_TYPES
from mindspeed_pack.runtime import error_scope
from mindspeed_pack.runtime.platform import cuda_usable

log = logging.getLogger(__name__)

# megatron-core 0.16.1's names (TransformerConfig checks them only when the model is built)
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
CHECKPOINT_WITHOUT_OUTPUT_MODULES = {"layernorm", "moe_act"}

# flags that only pick fused GPU kernels (the TE spec uses its fused kernels anyway): no-ops on a CPU.
# Precision (--bf16/--fp16), --sequence-parallel, --use-distributed-optimizer and the overlap flags
# run on the CPU too (see mindspeed_pack.model.gpt and the trainer).
GPU_KERNEL_FLAGS = ("use_flash_attn", "use_fused_rmsnorm", "use_fused_swiglu", "use_fused_rotary_pos_emb")


# other frameworks' names of a stage: LLaMA-Factory's reward model stage is "rm"
STAGE_ALIASES = {"rm": "orm"}


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=False)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--ffn-hidden-size", type=int)
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--add-qkv-bias", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--normalization", default="LayerNorm", choices=["RMSNorm", "LayerNorm"])
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=["rope", "learned_absolute", "none"])
    g.add_argument("--use-rotary-position-embeddings", action="store_true", help="alias of --position-embedding-type rope")
    g.add_argument("--rotary-base", type=float, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="per-head RMSNorm of queries and keys before RoPE (Qwen3); their gradients are summed over TP")
    g.add_argument("--use-rope-scaling", action="store_true", help="Llama-3.1/3.2 (llama3) RoPE scaling")
    g.add_argument("--rope-scaling-type", default=None, choices=["llama3"],
                   help="MindSpeed-LLM name: llama3 = --use-rope-scaling")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0)
    g.add_argument("--low-freq-factor", type=float, default=1.0, help="llama3 RoPE scaling (MindSpeed-LLM)")
    g.add_argument("--high-freq-factor", type=float, default=4.0, help="llama3 RoPE scaling (MindSpeed-LLM)")
    g.add_argument("--original-max-position-embeddings", type=int, default=8192,
                   help="llama3 RoPE scaling: the context the model was pretrained with (MindSpeed-LLM)")
    g.add_argument("--padded-vocab-size", "--pad-vocab-size-to", type=int, default=None,
                   help="vocabulary size of the embedding (else derived from the tokenizer); --pad-vocab-size-to is "
                        "MindSpeed-LLM's (ModelLink's) name")
    g.add_argument("--vocab-size", type=int, default=None, help="true vocabulary size (else from the tokenizer)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--no-parallel-invariant-init", action="store_true",
                   help="use megatron's per-rank initialisation (faster for huge from-scratch models) instead "
                        "of drawing the same full weights at every TP/PP layout")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "te", "flash", "local"],
                   help="te = Transformer Engine fused THD attention (CUDA); flash = PyTorch's varlen "
                        "FlashAttention (CUDA, bf16/fp16, no TE needed); local = exact segment-causal SDPA (any "
                        "device); auto picks the first of te, flash, local that can run and logs why")
    g.add_argument("--cross-entropy-chunk-size", type=int, default=None,
                   help="tokens per chunk of the fused output-layer cross-entropy, which never holds the whole "
                        "micro-batch's fp32 logits; 0 = megatron-core's unfused loss; default: the unfused loss "
                        "while a micro-batch's fp32 logits fit 4 GiB per rank (no second output-layer matmul), "
                        "else chunks of 512 MiB of logits (--dry-run shows the choice)")
    g.add_argument("--torch-compile-kernels", default="auto", choices=["auto", "layers", "regions", "off"],
                   help="auto: on CUDA every transformer layer compiled whole where it can be (layers), else the "
                        "regions; eager on a CPU. layers: every transformer layer compiled whole, forward and "
                        "backward (flash backend, dense, TP and sequence parallelism inside the graph, no CP, "
                        "selective recomputation or --overlap-param-gather; cuts the host time per layer; a layer "
                        "that cannot be traced whole stops the run). regions: RoPE's and the loss's elementwise "
                        "steps fused with torch.compile on CUDA (a region that fails to compile twice stops the "
                        "run). off: always eager")
    g.add_argument("--use-mcore-models", action="store_true",
                   help="accepted no-op: megatron-core models are the only models (always on)")
    g.add_argument("--transformer-impl", default=None, choices=["local", "transformer_engine"],
                   help="Megatron-LM alias of --attention-backend")
    for name in ("--use-flash-attn", "--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb"):
        g.add_argument(name, action="store_true", help="fused kernel (GPU); the TE spec uses it anyway")
    for name in ("--no-masked-softmax-fusion", "--no-gradient-accumulation-fusion", "--no-bias-dropout-fusion",
                 "--no-bias-swiglu-fusion", "--no-rope-fusion"):
        g.add_argument(name, action="store_true", help="turn this fused GPU kernel off (Megatron-LM)")
    g.add_argument("--attention-softmax-in-fp32", action="store_true",
                   help="attention scores and softmax in fp32 under --bf16/--fp16")
    g.add_argument("--use-cpu-initialization", action="store_true", help="accepted for compatibility")


def _moe_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mixture of experts (Megatron-LM's flags; see mindspeed_pack/model/moe.py)")
    g.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer (dense model without it)")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="each expert's FFN size (default "
                   "--ffn-hidden-size)")
    g.add_argument("--moe-layer-freq", type=_layer_freq, default=1,
                   help="N: every N-th layer is MoE; or a list like [0,1,1] (0 = dense layer)")
    g.add_argument("--moe-router-load-balancing-type", default="aux_loss", choices=list(LOAD_BALANCING_TYPES),
                   help="aux_loss over the micro-batch's real tokens, seq_aux_loss per sample of the pack")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="softmax over all experts before top-k (top-k weights not renormalised: "
                        "norm_topk_prob=false); without it the top-k weights sum to 1")
    g.add_argument("--moe-token-dispatcher-type", default="allgather", choices=[*DISPATCHERS, "alltoall_seq"],
                   help="alltoall_seq: megatron-core's former sequence-parallel all-to-all, run as alltoall")
    g.add_argument("--moe-grouped-gemm", action="store_true", help="TE grouped GEMM for the experts (GPU)")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="drop tokens over capacity (default dropless; with packing, routing then depends on pack-mates)")
    g.add_argument("--expert-model-parallel-size", type=int, default=1)


def _layer_freq(text: str):
    """Megatron-LM's --moe-layer-freq: an int, or a Python list of 0/1 per layer."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(f"{text!r} is neither an integer nor a list like [0,1,1]") from None
    if isinstance(value, int) and value != 0:
        return abs(value)  # Megatron-LM's layer i is MoE when i % N == 0: -1 (MindSpeed-LLM's scripts) is every layer
    if isinstance(value, list) and value and all(v in (0, 1) for v in value):
        return value
    raise argparse.ArgumentTypeError(f"{text!r}: give a non-zero integer or a list of 0/1 per layer")


def _check_moe_flags(args) -> None:
    """MoE flag combinations this project runs exactly; the rest refused by name."""
    if not args.num_experts:
        return
    ep = args.expert_model_parallel_size
    if args.num_experts % ep:
        raise ArgumentError(f"--expert-model-parallel-size {ep} must divide --num-experts {args.num_experts}")
    if not 1 <= args.moe_router_topk <= args.num_experts:
        raise ArgumentError(f"--moe-router-topk {args.moe_router_topk} must be in [1, --num-experts]")
    if isinstance(args.moe_layer_freq, list) and len(args.moe_layer_freq) != args.num_layers:
        raise ArgumentError(f"--moe-layer-freq lists {len(args.moe_layer_freq)} layers, the model has "
                            f"--num-layers {args.num_layers}")
    if args.data_parallel_size % ep:
        tp, pp, cp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                      args.context_parallel_size)
        world = args.data_parallel_size * tp * pp * cp
        raise ArgumentError(f"--expert-model-parallel-size {ep} must divide the data-parallel size "
                            f"{args.data_parallel_size} (world size {world} / TP {tp} x PP {pp} x CP {cp}): launch "
                            f"a multiple of {ep * tp * pp * cp} processes, or lower the TP, PP or CP size")
    if args.tensor_model_parallel_size > 1 and not args.sequence_parallel:
        raise ArgumentError("--num-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel "
                            "(megatron-core's MoE layer)")
    if args.moe_grouped_gemm and not cuda_usable():
        warnings.warn("no CUDA device: --moe-grouped-gemm is a TE GPU kernel; the local experts run", stacklevel=3)
        args.moe_grouped_gemm = False
    packed = args.neat_pack or args.reset_attention_mask or args.stage in ("dpo", "grpo", "score") or \
        args.sequence_packing_scheduler != "none"
    if args.moe_router_load_balancing_type == "aux_loss" and args.moe_aux_loss_coeff > 0 and packed:
        log.warning("--moe-router-load-balancing-type aux_loss balances over each micro-batch's tokens, so its "
                    "gradient changes with how many samples share a row (under GRPO with the rollouts per row); "
                    "--moe-router-load-balancing-type seq_aux_loss balances each sample and does not depend on the "
                    "packing")
    if args.moe_expert_capacity_factor is not None:
        log.warning("--moe-expert-capacity-factor %s: tokens over an expert's capacity are dropped, so a token's "
                    "routing depends on its pack-mates (packing changes routing); drop the flag for dropless "
                    "routing", args.moe_expert_capacity_factor)


def _lora_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA (MindSpeed-LLM's flags; see mindspeed_pack/model/lora.py)")
    g.add_argument("--lora-r", type=int, default=None,
                   help="train LoRA adapters of this rank on the frozen --load model (default 16 when only "
                        "--lora-target-modules is given)")
    g.add_argument("--lora-alpha", type=float, default=32.0, help="adapter scale alpha / r (alpha / sqrt(r) with "
                   "--lora-use-rslora)")
    g.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the adapters' input")
    g.add_argument("--lora-target-modules", nargs="+", default=None,
                   help="linears that get adapters: linear_qkv linear_proj linear_fc1 linear_fc2, or the Hugging "
                        "Face projections q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or all-linear "
                        "(the default; also 'all'); a comma list (q_proj,v_proj) reads as the names it lists")
    g.add_argument("--lora-use-rslora", action="store_true", help="rank-stabilised scale alpha / sqrt(r)")
    g.add_argument("--lora-load", default=None, metavar="DIR",
                   help="a LoRA run's checkpoint (its --save: adapters, optimizer, the base's fingerprint) to resume "
                        "from (or, with --finetune, to start from); or a PEFT adapter directory to start from at any "
                        "layout (iteration 0); the LoRA flags default to the checkpoint's record or the "
                        "directory's adapter_config.json; --load is the base they were trained on")
    g.add_argument("--lora-merge", action="store_true",
                   help="--save-hf writes the model with the adapters merged (transformers) instead of a PEFT "
                        "adapter directory")


LORA_DEFAULT_RANK = 16  # --lora-target-modules without --lora-r


def _check_lora_flags(args) -> None:
    """LoRA flags: on with --lora-r or --lora-target-modules; the adapted model needs its base (--load)."""
    if args.lora_r is None and args.lora_target_modules is None:
        if args.lora_load:
            raise ArgumentError("--lora-load needs the LoRA flags the adapters were trained with: --lora-r, "
                                "--lora-alpha, --lora-target-modules")
        given = [f for f, on in (("--lora-merge", args.lora_merge), ("--lora-use-rslora", args.lora_use_rslora)) if on]
        if given:
            raise ArgumentError(f"{given[0]} applies to LoRA adapters, and this run trains none: pass --lora-r (and "
                                f"--lora-target-modules) to train them, or drop {given[0]}")
        return
    if args.lora_r <= 0:
        raise ArgumentError(f"--lora-r {args.lora_r}: the adapters' rank must be a positive integer")
    if args.lora_alpha <= 0:
        raise ArgumentError(f"--lora-alpha {args.lora_alpha} must be positive")
    if not 0.0 <= args.lora_dropout < 1.0:
        raise ArgumentError(f"--lora-dropout {args.lora_dropout} must be in [0, 1)")
    if args.lora_target_modules is not None:  # one spelling for the LoRA line, the record and run_config.yaml
        args.lora_target_modules = lora.target_names(args.lora_target_modules)
    try:
        lora.resolve_targets(args.lora_target_modules or [lora.ALL_LINEAR])
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    problem = lora.target_problem(args)  # what building the model would refuse, refused by --dry-run too
    if problem:
        raise ArgumentError(problem)
    idle = lora.idle_targets(args)
    if idle:
        rest = [n for n in args.lora_target_modules if n not in idle]
        log.warning("--lora-target-modules %s: every layer of this model is MoE, and experts get no adapter: %s "
                    "nothing; the adapters train on %s only",
                    " ".join(idle), "they adapt" if len(idle) > 1 else "it adapts", " ".join(rest))
    if not args.load:
        raise ArgumentError("--lora-r: LoRA adapts a model: pass it (the base, a Hugging Face directory or a Megatron "
                            "checkpoint) with --load")
    if args.save and os.path.abspath(args.save) == os.path.abspath(args.load):
        raise ArgumentError(f"--save {args.save} is the --load base: a LoRA run saves its adapters elsewhere (resume "
                            "with --load BASE --lora-load SAVE_DIR)")
    if args.lora_merge and not args.save_hf:
        raise ArgumentError("--lora-merge chooses what --save-hf writes: pass --save-hf DIR")


def _parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="split every sequence over N ranks (zigzag per sample: rank r holds chunks r and 2N-1-r); "
                        "samples are padded to a multiple of 2N (x TP under --sequence-parallel) at batch build, "
                        "or at preprocessing with --pad-to-multiple-of")
    g.add_argument("--cp-comm-type", default="p2p", choices=["p2p", "all_gather", "a2a", "a2a+p2p"],
                   help="Transformer Engine's CP attention communication (GPU); the CPU attention all-gathers "
                        "keys/values whatever this says. a2a+p2p is refused: it needs megatron-core's hierarchical "
                        "CP groups, which are not made here")
    g.add_argument("--context-parallel-algo", default="megatron_cp_algo", choices=[*CP_ALGOS, *CP_ALGOS_REFUSED],
                   help="MindSpeed-LLM name: megatron_cp_algo = --cp-comm-type as given (ring, p2p by default); "
                        "ulysses_cp_algo = --cp-comm-type a2a; hybrid_cp_algo, adaptive_cp_algo and "
                        "hybrid_adaptive_cp_algo are refused by name")
    g.add_argument("--ulysses-degree-in-cp", type=int, default=None,
                   help="MindSpeed-LLM's hybrid_cp_algo (Ulysses inside ring): refused, as that algorithm is")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo"],
                   help="torch.distributed backend (default: nccl with CUDA, gloo without)")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10,
                   help="how long the rendezvous and any collective wait for a peer before the rank exits "
                        "with one line naming what it waited for (fractions allowed)")


def _training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None,
                   help="Megatron-LM's sample-based training: train --train-samples // --global-batch-size "
                        "iterations, the schedule sized in samples (--lr-decay-samples, --lr-warmup-samples, "
                        "--lr-wsd-decay-samples); not with --train-iters")
    g.add_argument("--seq-length", type=int, required=False)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--initial-loss-scale", type=float, default=2**32, help="--fp16: dynamic loss scaling's start")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="--fp16: a constant loss scale instead of dynamic loss scaling")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="--fp16: dynamic loss scaling's floor")
    g.add_argument("--loss-scale-window", type=float, default=1000,
                   help="--fp16: iterations without overflow before the dynamic loss scale doubles")
    g.add_argument("--hysteresis", type=int, default=2,
                   help="--fp16: overflowing iterations in a row before the dynamic loss scale halves")
    g.add_argument("--lr", type=float, default=1e-4)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
                   help="WSD (warmup-stable-decay): --lr until the last --lr-wsd-decay-iters of --lr-decay-iters, "
                        "then --lr-wsd-decay-style down to --min-lr")
    g.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=["exponential", "linear", "cosine", "minus_sqrt"],
                   help="--lr-decay-style WSD: the shape of its final decay (Megatron-LM's default exponential)")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None,
                   help="--lr-decay-style WSD: iterations of the final decay, at the end of --lr-decay-iters")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warmup as a fraction of --lr-decay-iters, kept fractional (the schedule counts samples, "
                        "as in Megatron-LM); not together with --lr-warmup-iters")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0,
                   help="the learning rate the warmup starts from (Megatron-LM's; at most --lr)")
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="--train-samples: samples the lr decays over (default --train-samples)")
    g.add_argument("--lr-warmup-samples", type=int, default=0, help="--train-samples: warmup samples")
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None,
                   help="--train-samples with --lr-decay-style WSD: samples of the final decay")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--weight-decay-incr-style", default="constant", choices=["constant", "linear", "cosine"],
                   help="Megatron-LM's weight decay schedule: constant --weight-decay, or from --start-weight-decay "
                        "to --end-weight-decay over the training samples")
    g.add_argument("--start-weight-decay", type=float, default=None,
                   help="--weight-decay-incr-style linear/cosine: the weight decay at the start")
    g.add_argument("--end-weight-decay", type=float, default=None,
                   help="--weight-decay-incr-style linear/cosine: the weight decay at the end of training")
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    g.add_argument("--per-sample-loss", action="store_true",
                   help="average each sample's token losses first, then over samples (default: per-token mean "
                        "over the global batch, the only packing-invariant choice)")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="Megatron-LM's per-token loss: always so here (not with --per-sample-loss)")
    g.add_argument("--nan-policy", default="stop", choices=["stop", "skip"],
                   help="on a NaN/inf loss or gradient: stop with the iteration, or skip the update (under --fp16 "
                        "dynamic loss scaling an inf/NaN gradient always skips the step and lowers the scale)")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="deterministic algorithms (bitwise-reproducible CPU runs); the data order is always fixed by "
                        "--seed, or sequential with --no-shuffle")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"],
                   help="activation recomputation (Megatron-LM): full recomputes whole transformer layers in the "
                        "backward (--recompute-method, --recompute-num-layers), selective only the modules of "
                        "--recompute-modules")
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"],
                   help="full: uniform splits each pipeline stage's layers into chunks of --recompute-num-layers "
                        "and keeps only each chunk's input; block recomputes the first --recompute-num-layers "
                        "layers of each stage and keeps the others' activations")
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--recompute-modules", nargs="+", default=None, choices=RECOMPUTE_MODULES,
                   help="selective: the submodules recomputed (megatron-core's names: core_attn, layernorm, mlp, "
                        "moe, moe_act, shared_experts; default core_attn)")
    g.add_argument("--recompute-activations", action="store_true",
                   help="Megatron-LM's alias of --recompute-granularity selective")
    g.add_argument("--override-opt_param-scheduler", action="store_true",
                   help="on resume, follow the schedule of these flags (lr, min-lr, warmup, decay) from the "
                        "checkpoint's iteration instead of refusing a schedule that differs from the checkpoint's")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   help="on resume, keep the checkpoint's schedule and ignore the schedule flags")
    g.add_argument("--skip-train", action="store_true", help="evaluation only")
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="stop once the run has taken this many minutes, after the iteration under way (saved "
                        "first with --save; Megatron-LM's flag): the same command resumes")
    g.add_argument("--exit-signal-handler", action="store_true")
    g.add_argument("--manual-gc", action="store_true",
                   help="Python's garbage collector off, run by hand (Megatron-LM): every --manual-gc-interval "
                        "iterations and around evaluations, at the same step on every rank, so no rank pauses "
                        "at random while the others wait for it")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="--manual-gc: iterations between collections (0: only around evaluations)")
    g.add_argument("--no-manual-gc-eval", action="store_false", dest="manual_gc_eval",
                   help="--manual-gc: no collection around evaluations")


def per_split_data_args(p: argparse.ArgumentParser, pretrain: bool = False) -> argparse.ArgumentParser:
    """Megatron-LM's separately preprocessed splits: each prefix is used whole (posttrain.py: one packed prefix;
    ``pretrain``: pretrain_gpt.py's, each split its own blend, as Megatron-LM's ``blend_per_split``)."""
    g = p.add_argument_group("per-split data (instead of --data-path and --split)")
    for name in ("train", "valid", "test"):
        g.add_argument(f"--{name}-data-path", nargs="*", default=None,
                       help=f"the {name} split's P_text_document prefixes or raw files, or a weighted blend "
                            "'0.3 A 0.7 B' of either, used whole" if pretrain else
                       f"prefix P of the {name} split's P_packed_*_document, used whole")
    return p


def _data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="prefix P of P_packed_*_document (posttrain.py: one), or raw data files / a directory, "
                        "tokenised and packed first with the preprocessing flags (cached); pretrain_gpt.py: "
                        "P_text_document prefixes or raw files, or a weighted blend '0.3 A 0.7 B' of either")
    g.add_argument("--split", default="100,0,0")
    g.add_argument("--num-workers", type=int, default=0,
                   help="only 0: packs are memory-mapped and read in the training process")
    g.add_argument("--data-cache-path", default=None,
                   help="where sample indices (and the packs of raw --data-path files) are cached (default: next "
                        "to the data; raw files: mindspeed_pack_cache/ beside the first)")
    g.add_argument("--is-instruction-dataset", action="store_true",
                   help="accepted no-op: posttrain.py always reads instruction (packed) data")
    g.add_argument("--neat-pack", action="store_true",
                   help="attention_mask holds segment ids: attention, labels and positions are isolated per "
                        "sample (positions restart per sample unless --no-reset-position-ids)")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="restart position ids at every sample/document (default on with --neat-pack); on plain "
                        "--pack data, samples end at the EOS recorded in the sidecar (as in MindSpeed-LLM) and are "
                        "isolated like --reset-attention-mask, since megatron-core's THD RoPE takes positions "
                        "from cu_seqlens")
    g.add_argument("--no-reset-position-ids", action="store_true",
                   help="keep positions 0..s-1 across a pack (not recommended; MindSpeed's example did this)")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="isolate attention per sample/document (cu_seqlens; never a dense s x s mask); on plain "
                        "--pack data, samples end at the EOS recorded in the sidecar")
    g.add_argument("--eod-mask-loss", action="store_true", help="pretraining: do not train EOD targets")
    g.add_argument("--padded-samples", action="store_true",
                   help="repeat the first packs of each epoch to complete its last global batch")
    g.add_argument("--no-shuffle", action="store_true", help="sequential data order (for loss comparison runs)")
    g.add_argument("--dataloader-type", default=None, choices=["single", "cyclic"],
                   help="accepted no-op (Megatron-LM's sampler): the order is the sample index's, a seeded shuffle "
                        "of every epoch (--no-shuffle: sequential)")
    g.add_argument("--sequence-packing-scheduler", default="none",
                   choices=["none", "dp_balanced", "default_dynamic_cp"],
                   help="dp_balanced: pack unpacked data at load time into rows of --max-seqlen-per-dp-cp-rank "
                        "tokens and balance data-parallel ranks by estimated cost (offline packs: balance the packs); "
                        "default_dynamic_cp: as dp_balanced, but every sample runs on the smallest power-of-two CP "
                        "group (up to --context-parallel-size) whose ranks hold it at --max-seqlen-per-dp-cp-rank "
                        "tokens each: short samples on one rank, long ones split")
    g.add_argument("--max-seqlen-per-dp-cp-rank", type=int, default=None,
                   help="tokens per packed row (per CP rank) under --sequence-packing-scheduler dp_balanced or "
                        "default_dynamic_cp (default --seq-length)")
    g.add_argument("--min-dynamic-context-parallel-size", type=int, default=1,
                   help="default_dynamic_cp: the smallest CP group a sample runs on (a power of two)")
    g.add_argument("--overlong-samples", default="refuse", choices=["refuse", "drop"],
                   help="default_dynamic_cp: a sample longer than --context-parallel-size x "
                        "--max-seqlen-per-dp-cp-rank stops the run naming it (refuse), or is dropped and counted "
                        "(drop); never truncated")
    g.add_argument("--prompt-type", default=None,
                   help="chat template used at preprocessing: checked against the data's sidecar")
    g.add_argument("--stage", default="sft", type=lambda name: STAGE_ALIASES.get(name, name),
                   choices=["sft", "dpo", "simpo", "orpo", "dpo_reference", "score", "grpo", "kto", "orm", "prm"],
                   help="post-training stage (mindspeed_pack/training/stages): sft, dpo (preference pairs), "
                        "simpo and orpo (preference pairs, no reference model), "
                        "dpo_reference (score a reference model's log-probs beside the data, once), "
                        "score (per-token log-probs of rollouts, or their rewards under a reward model), grpo "
                        "(PPO-clip on rollouts), kto (unpaired desirable/undesirable samples), orm (outcome reward "
                        "model on pairs; LLaMA-Factory's rm), prm (process reward model)")
    g.add_argument("--variable-seq-lengths", action="store_true",
                   help="accepted no-op: packs have a fixed length and unpacked rows are padded to --seq-length")
    g.add_argument("--tokenizer-type", default=None,
                   help="PretrainedFromHF (with --tokenizer-name-or-path DIR), or Megatron-LM's HuggingFaceTokenizer "
                        "(with --tokenizer-model DIR): the same")
    g.add_argument("--tokenizer-name-or-path", default=None)
    g.add_argument("--tokenizer-model", default=None,
                   help="with --tokenizer-type HuggingFaceTokenizer: its directory; refused otherwise "
                        "(sentencepiece model files are not read; pass --tokenizer-name-or-path)")
    for flag in ("--vocab-file", "--merge-file"):  # Megatron-LM's GPT2BPETokenizer/BERT files: refused by name
        g.add_argument(flag, default=None, help="refused: Megatron-LM's GPT-2 BPE/WordPiece files are not read "
                                                "(the data's sidecar records the EOD id and vocabulary)")
    g.add_argument("--tokenizer-not-use-fast", action="store_true",
                   help="load the slow (Python) HF tokenizer instead of the fast one")


def _checkpoint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None,
                   help="a checkpoint directory, or a Hugging Face model directory (config.json + *.safetensors): "
                        "then the model flags come from config.json and each rank reads only its own slice")
    g.add_argument("--load-format", default="auto", choices=["auto", "mg", "hf"],
                   help="what --load holds: auto = a Hugging Face model when it has config.json or *.safetensors "
                        "and no latest_checkpointed_iteration.txt, else a Megatron checkpoint")
    g.add_argument("--save-hf", default=None, metavar="DIR",
                   help="at the end of training, write a transformers-loadable model (config.json, safetensors, "
                        "tokenizer files) to DIR (must not exist or be empty)")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--finetune", action="store_true", help="load weights only and reset the iteration")
    g.add_argument("--ckpt-step", type=int, default=None, metavar="N",
                   help="Megatron-LM's: load iteration N of the Megatron --load instead of the one "
                        "latest_checkpointed_iteration.txt names")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="Megatron-LM's: the model flags come from --load (the arguments a Megatron checkpoint "
                        "records, a Hugging Face directory's config.json) with or without it; with it, a model flag "
                        "given with another value takes the checkpoint's (warned) instead of being refused")
    g.add_argument("--overwrite-output-dir", action="store_true",
                   help="start over in --save, removing the checkpoints it holds (and its fine-tuning default "
                        "--save-hf SAVE/hf). Without it a run that starts from --load's weights (a Hugging Face "
                        "directory, --finetune, a release checkpoint) resumes from --save when it holds this run's "
                        "checkpoint and refuses another run's. On torchrun's restarts the job resumes what it saved")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--ckpt-format", default="torch", choices=["torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"],
                   help="torch: Megatron-LM's per-rank files (model_optim_rng.pt under mp_rank_*), the only format "
                        "saved and loaded here; its distributed formats (torch_dist, its default) are refused by name")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="--load D --save D with no checkpoint in D yet stops instead of starting from scratch "
                        "(any other --load without a checkpoint always does)")
    g.add_argument("--allow-unsafe-checkpoint-load", action="store_true",
                   help="load a --load checkpoint that needs full pickle (it can run code): only for a legacy file "
                        "you trust; refused by default")


def _logging_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000,
                   help="validate every N iterations (with --eval-iters); also at the end of training, and the "
                        "test split at the end, as Megatron-LM does")
    g.add_argument("--eval-iters", type=int, default=100,
                   help="global batches per validation (and test) evaluation; 0 = no evaluation")
    g.add_argument("--tensorboard-dir", default=None)
    # Megatron-LM's TensorBoard flags, as its example scripts pass them
    g.add_argument("--tensorboard-log-interval", type=int, default=1,
                   help="write the training scalars to TensorBoard every N iterations (Megatron-LM's)")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000,
                   help="TensorBoard events kept in memory before a write to disk (Megatron-LM's)")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="also write the validation (and test) perplexity, SFT and pretraining only (Megatron-LM's)")
    for name, what in (("--log-timers-to-tensorboard", "step time (ms)"),
                       ("--log-batch-size-to-tensorboard", "global batch size"),
                       ("--log-learning-rate-to-tensorboard", "lr"), ("--log-loss-scale-to-tensorboard", "loss scale")):
        g.add_argument(name, action="store_true", help=f"accepted no-op: TensorBoard always gets train/{what}")
    g.add_argument("--metrics-file", default=None, help="every step's metrics as JSON lines")
    g.add_argument("--log-throughput", action="store_true",
                   help="also log the model TFLOP/s per GPU (tokens/s is always logged)")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="peak dense TFLOP/s of one device (e.g. 989 for H100 bf16): logs MFU next to model TFLOP/s")
    g.add_argument("--dry-run", action="store_true",
                   help="print the resolved configuration and the plan (data, packs, iterations, layout, memory "
                        "estimate), then exit without training; raw --data-path files are preprocessed (cached)")


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line: the usage of some 300 flags buried the message. Every rank
    parses the same flags: the line is printed once per job, or once per node when a file gave flags
    (``refusal_scope``, :func:`~mindspeed_pack.config.errors.flag_scope`); every rank exits 2."""

    refusal_scope = "job"  # the command line alone; yaml_file.parse and parse_args widen it once files give flags

    def error(self, message):
        if not error_scope.prints_here(self.refusal_scope):
            self.exit(2)
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def build_parser(description: str = "mindspeed-pack training") -> argparse.ArgumentParser:
    p = _Parser(description=description, allow_abbrev=False)
    for add in (_model_args, _moe_args, _lora_args, _parallel_args, _training_args, _data_args, _checkpoint_args,
                _logging_args, mindspeed_llm_flags.add_flags):
        add(p)
    yaml_file.add_config_flag(p)
    return p


def _warn_unavailable(args) -> None:
    if cuda_usable():
        return
    used = [f"--{n.replace('_', '-')}" for n in GPU_KERNEL_FLAGS if getattr(args, n, False)]
    if used:
        warnings.warn(f"no CUDA device: {', '.join(used)} select fused GPU kernels; skipped on the CPU", stacklevel=3)


def _check_precision_and_parallel(args) -> None:
    """Megatron-LM's rules for the precision, sequence-parallel and distributed-optimizer flags."""
    if args.bf16 and args.fp16:
        raise ArgumentError("--bf16 and --fp16 cannot be used together")
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        log.warning("--sequence-parallel with --tensor-model-parallel-size 1 has nothing to shard: disabled")
        args.sequence_parallel = False
    if args.sequence_parallel and args.seq_length % args.tensor_model_parallel_size:
        raise ArgumentError(f"--sequence-parallel splits the sequence over TP: --seq-length {args.seq_length} must be "
                            f"a multiple of --tensor-model-parallel-size {args.tensor_model_parallel_size}")
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise ArgumentError("--overlap-param-gather needs --use-distributed-optimizer")


def _check_checkpoint_format(args) -> None:
    """Megatron-LM's default --ckpt-format torch_dist, passed by its scripts, was argparse's bare 'invalid choice'."""
    fmt = getattr(args, "ckpt_format", "torch")
    if fmt != "torch":
        raise ArgumentError(f"--ckpt-format {fmt}: checkpoints are saved and loaded here in Megatron-LM's per-rank "
                            "format only (--ckpt-format torch, as MindSpeed-LLM's scripts pass): pass torch or drop "
                            f"the flag; a {fmt} checkpoint to --load is re-saved in it by Megatron-LM's training "
                            "script with --ckpt-convert-format torch --ckpt-convert-save NEW_DIR")


def _check_ranges(args) -> None:
    """Values no run can use, refused by name before anything divides by them or hands them to torch."""
    for dest, low in (("micro_batch_size", 1), ("global_batch_size", 1), ("train_iters", 0), ("seq_length", 2),
                      ("lr", 0.0), ("min_lr", 0.0), ("weight_decay", 0.0), ("clip_grad", 0.0), ("adam_eps", 0.0),
                      ("exit_duration_in_mins", 0.0)):
        value = getattr(args, dest, None)
        if value is not None and value < low:
            raise ArgumentError(f"--{dest.replace('_', '-')} {value} must be >= {low}")
    for dest in ("adam_beta1", "adam_beta2"):
        value = getattr(args, dest)
        if not 0.0 <= value < 1.0:
            raise ArgumentError(f"--{dest.replace('_', '-')} {value} must be in [0, 1)")


REFERENCE_STAGES = ("dpo", "kto", "grpo")


def _warn_dropout_against_a_reference(args) -> None:
    """Stages that compare the policy's log-probs with a reference's, under dropout (Megatron-LM's 0.1 defaults,
    which a Megatron --load keeps): the two differ by the dropout draws, from step 1 (TRL turns dropout off)."""
    if getattr(args, "stage", None) in REFERENCE_STAGES and (args.attention_dropout or args.hidden_dropout):
        log.warning("--stage %s with dropout on (--attention-dropout %s, --hidden-dropout %s): the policy's log-probs "
                    "are drawn with dropout and the reference's without, so they differ from step 1 (DPO's first "
                    "loss is not log 2); pass --attention-dropout 0 --hidden-dropout 0 to compare like for like",
                    args.stage, args.attention_dropout, args.hidden_dropout)


def _check_loss_and_gc_flags(args) -> None:
    """Megatron-LM's ``--calculate-per-token-loss`` (always so here) and manual garbage collection."""
    if args.calculate_per_token_loss and args.per_sample_loss:
        raise ArgumentError("--calculate-per-token-loss and --per-sample-loss both given: the loss is a per-token "
                            "mean (the default) or a mean of per-sample means; pass one")
    if args.manual_gc_interval < 0:
        raise ArgumentError(f"--manual-gc-interval {args.manual_gc_interval} must be >= 0")
    if args.manual_gc_interval and not args.manual_gc:
        raise ArgumentError(f"--manual-gc-interval {args.manual_gc_interval} schedules manual collections: pass "
                            "--manual-gc")


def _check_schedule_flags(args) -> None:
    """Megatron-LM's rules for the warmup and the resume schedule flags."""
    if args.lr_warmup_fraction is not None:
        for flag, value in (("--lr-warmup-iters", args.lr_warmup_iters), ("--lr-warmup-samples", args.lr_warmup_samples)):
            if value:
                raise ArgumentError(f"--lr-warmup-fraction and {flag} both given: pass only one of them")
        if not 0.0 <= args.lr_warmup_fraction < 1.0:
            raise ArgumentError(f"--lr-warmup-fraction {args.lr_warmup_fraction} must be in [0, 1)")
    if args.min_lr > args.lr:  # megatron-core's scheduler asserts it, a bare AssertionError after the model is built
        raise ArgumentError(f"--min-lr {args.min_lr} is above --lr {args.lr}: the lr decays from --lr down to --min-lr")
    if args.lr_warmup_init < 0 or args.lr_warmup_init > args.lr:
        raise ArgumentError(f"--lr-warmup-init {args.lr_warmup_init} must be in [0, --lr {args.lr}]")
    unit = "samples" if args.train_samples else "iters"
    wsd, decay = getattr(args, f"lr_wsd_decay_{unit}"), getattr(args, f"lr_decay_{unit}")
    if args.lr_decay_style == "WSD" and wsd is None:
        raise ArgumentError(f"--lr-decay-style WSD decays over its last --lr-wsd-decay-{unit} {unit}: give it")
    decay = decay or args.train_samples  # None until --train-epochs is resolved
    if wsd is not None and (wsd < 1 or (decay and wsd > decay)):
        raise ArgumentError(f"--lr-wsd-decay-{unit} {wsd} must be in [1, --lr-decay-{unit} (default --train-{unit}) "
                            f"{decay}]")
    _check_weight_decay_schedule(args)
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ArgumentError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler both given: "
                            "pass only one of them")


def _resolve_train_samples(args) -> None:
    """Megatron-LM's sample-based training: ``--train-iters`` = ``--train-samples`` // GBS, the schedule's lengths
    in samples; the iteration-based lengths are refused with it, and the sample-based ones without it."""
    counted = {"--train-iters": args.train_iters, "--train-epochs": getattr(args, "train_epochs", None),
               "--lr-decay-iters": args.lr_decay_iters, "--lr-warmup-iters": args.lr_warmup_iters,
               "--lr-wsd-decay-iters": args.lr_wsd_decay_iters}
    sampled = {"--lr-decay-samples": args.lr_decay_samples, "--lr-warmup-samples": args.lr_warmup_samples,
               "--lr-wsd-decay-samples": args.lr_wsd_decay_samples}
    if not args.train_samples:
        given = [flag for flag, value in sampled.items() if value]
        if given:
            raise ArgumentError(f"{', '.join(given)} size the schedule of --train-samples runs: give --train-samples, "
                                "or the iteration flags (--lr-decay-iters, --lr-warmup-iters, --lr-wsd-decay-iters)")
        return
    given = [flag for flag, value in counted.items() if value]
    if given:
        raise ArgumentError(f"--train-samples {args.train_samples} counts samples: {', '.join(given)} count "
                            "iterations; give their sample flags (--lr-decay-samples, --lr-warmup-samples, "
                            "--lr-wsd-decay-samples) or --train-iters instead")
    args.train_iters = args.train_samples // args.global_batch_size
    if args.train_iters < 1:
        raise ArgumentError(f"--train-samples {args.train_samples} is less than one global batch "
                            f"(--global-batch-size {args.global_batch_size})")


def _check_weight_decay_schedule(args) -> None:
    """Megatron-LM's rule: a constant weight decay is --weight-decay; an increasing one names both ends."""
    ends = (args.start_weight_decay, args.end_weight_decay)
    if args.weight_decay_incr_style == "constant":
        if any(end is not None for end in ends):
            raise ArgumentError("--start-weight-decay/--end-weight-decay need --weight-decay-incr-style linear or "
                                "cosine (constant: --weight-decay)")
        args.start_weight_decay = args.end_weight_decay = args.weight_decay
        return
    if any(end is None for end in ends):
        raise ArgumentError(f"--weight-decay-incr-style {args.weight_decay_incr_style} goes from "
                            "--start-weight-decay to --end-weight-decay: give both")
    if not 0.0 <= args.start_weight_decay <= args.end_weight_decay:
        raise ArgumentError(f"--start-weight-decay {args.start_weight_decay} and --end-weight-decay "
                            f"{args.end_weight_decay}: need 0 <= start <= end (the weight decay only increases)")


def _check_data_flags(args) -> None:
    """Refuse data and tokenizer flags this project cannot honour (none is silently ignored)."""
    if args.num_workers:
        raise ArgumentError(f"--num-workers {args.num_workers}: packs are memory-mapped and read in the training "
                            "process; only 0 is supported (drop the flag)")
    # training reads a tokenizer for the EOD id and the vocabulary size only, which preprocessing records
    need_not = ("the training scripts need no tokenizer for data preprocess_data.py wrote (its _meta.json sidecar "
                "records the EOD id and vocabulary: drop the tokenizer flags); for documents preprocessed elsewhere "
                "pretrain_gpt.py takes --eod-id and --vocab-size (GPT-2's: --eod-id 50256 --vocab-size 50257)")
    if args.tokenizer_type not in (None, "PretrainedFromHF"):
        raise ArgumentError(f"--tokenizer-type {args.tokenizer_type}: only PretrainedFromHF (with "
                            "--tokenizer-name-or-path DIR) or Megatron-LM's HuggingFaceTokenizer (with "
                            f"--tokenizer-model DIR) is read; {need_not}")
    files = [f"--{d.replace('_', '-')} {v}" for d in ("vocab_file", "merge_file") if (v := getattr(args, d))]
    if files:
        raise ArgumentError(f"{', '.join(files)}: Megatron-LM's GPT-2 BPE/WordPiece files are not read; {need_not}")
    if args.tokenizer_model:
        raise ArgumentError("--tokenizer-model: sentencepiece model files are not read; pass "
                            f"--tokenizer-name-or-path with a Hugging Face tokenizer directory; {need_not}")
    if args.distributed_backend == "nccl" and not cuda_usable():
        raise ArgumentError("--distributed-backend nccl needs CUDA: drop the flag (gloo is used without CUDA)")
    if args.eval_interval is not None and args.eval_interval < 1:
        raise ArgumentError(f"--eval-interval {args.eval_interval} must be >= 1")


# posttrain.py's --data-path: one packed prefix, or raw files it packs together (datasets/packed_dataset.py,
# training/raw_data.py say the same)
ONE_PREFIX = ("posttrain.py trains on one packed prefix, or on raw files it packs together; weighted blends are "
              "pretrain_gpt.py's: preprocess the datasets into one prefix (preprocess_data.py --input A B) and pass "
              "it, or pass the raw files as --data-path A B")

# posttrain.py's flags that pretrain_gpt.py's GPTDataset rows (documents cut at --seq-length) would ignore
NOT_FOR_PRETRAINING = {
    "padded_samples": "it completes an epoch's last global batch with repeated packs of posttrain.py's sample "
                      "index; GPTDataset cuts the documents into rows over as many epochs as the iterations need, so "
                      "it would change nothing: drop it",
    "sequence_packing_scheduler": "it packs and balances posttrain.py's instruction samples at load time; every row "
                                  "of pretrain_gpt.py is --seq-length tokens of documents, so it would change nothing: "
                                  "drop it",
    "neat_pack": "it reads the segment ids preprocess_data.py --neat-pack writes into instruction packs; pretraining "
                 "documents have none: --reset-attention-mask --reset-position-ids isolate them at each EOD",
}


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _check_data_path_for_the_script(args) -> None:
    """What one training script reads: a weighted blend is pretrain_gpt.py's, the instruction-packing flags are
    posttrain.py's (:data:`NOT_FOR_PRETRAINING`); refused by name, before any data is read."""
    if getattr(args, "pretraining", False):
        for dest, why in NOT_FOR_PRETRAINING.items():
            value = getattr(args, dest)
            if value not in (False, None, "none"):
                flag = f"--{dest.replace('_', '-')}" + ("" if value is True else f" {value}")
                raise ArgumentError(f"{flag} is posttrain.py's, not pretrain_gpt.py's: {why}")
        return
    if any(_is_number(p) for p in args.data_path or []):
        raise ArgumentError(f"--data-path {' '.join(args.data_path)}: {ONE_PREFIX}")
    for name in ("train", "valid", "test"):  # each split's own prefix (its check at data setup came after the build)
        paths = getattr(args, f"{name}_data_path", None) or []
        if len(paths) > 1:
            raise ArgumentError(f"--{name}-data-path {' '.join(paths)}: takes one packed prefix; "
                                + (ONE_PREFIX if any(_is_number(p) for p in paths) else
                                   "preprocess the datasets into one (preprocess_data.py --input A B) and pass it"))


# stages whose per-token inputs are laid out for megatron's fixed CP split, or that run their own loop
DYNAMIC_CP_REFUSED_STAGES = {
    "prm": "its step labels are laid out for megatron's fixed CP split",
    "dpo_reference": "it scores every document once in its own fixed layout; score with --sequence-packing-scheduler "
                     "none: its table serves a dynamic CP run of the same data (--ref-logps)",
}


# MindSpeed-LLM's --context-parallel-algo values: those built here (as Transformer Engine's --cp-comm-type), and
# those refused, with why
CP_ALGOS = {"megatron_cp_algo": None, "ulysses_cp_algo": "a2a"}
CP_ALGOS_REFUSED = {
    "hybrid_cp_algo": "MindSpeed's Ulysses-inside-ring CP is not built here (Transformer Engine's equivalent, "
                      "--cp-comm-type a2a+p2p, needs megatron-core's hierarchical CP groups, which are not made here)",
    "adaptive_cp_algo": "MindSpeed's adaptive CP (ring communication planned for a general attention mask) is not "
                        "built here: packed samples are causal within their boundaries, which the ring runs",
    "hybrid_adaptive_cp_algo": "MindSpeed's adaptive CP (ring communication planned for a general attention mask) "
                               "is not built here: packed samples are causal within their boundaries, which the "
                               "ring runs",
}
_CP_ALGO_HINT = ("use megatron_cp_algo (ring, --cp-comm-type p2p) or ulysses_cp_algo (all-to-all over the CP group, "
                 "--cp-comm-type a2a)")


def _check_cp_algorithm(args) -> None:
    """MindSpeed-LLM's ``--context-parallel-algo`` as Transformer Engine's ``--cp-comm-type``; what neither builds
    is refused by name. ``a2a+p2p``: megatron-core gives Transformer Engine the hierarchical CP groups for it
    (``get_hierarchical_context_parallel_groups``), made only from Megatron-LM's
    ``--hierarchical-context-parallel-sizes``; without them TE's attention gets no CP group and runs unsplit on
    each rank's share, so it is refused rather than trained wrong."""
    algo = args.context_parallel_algo
    if algo in CP_ALGOS_REFUSED:
        raise ArgumentError(f"--context-parallel-algo {algo}: {CP_ALGOS_REFUSED[algo]}; {_CP_ALGO_HINT}")
    if args.ulysses_degree_in_cp is not None:
        raise ArgumentError(f"--ulysses-degree-in-cp {args.ulysses_degree_in_cp} goes with MindSpeed's "
                            f"--context-parallel-algo hybrid_cp_algo, which is not built here: drop it and "
                            f"{_CP_ALGO_HINT}")
    if CP_ALGOS[algo]:
        args.cp_comm_type = CP_ALGOS[algo]
    if args.context_parallel_size > 1 and args.cp_comm_type == "a2a+p2p":
        raise ArgumentError("--cp-comm-type a2a+p2p: Transformer Engine's hierarchical CP (all-to-all inside, ring "
                            "across) needs megatron-core's hierarchical CP groups (Megatron-LM's "
                            "--hierarchical-context-parallel-sizes), which are not made here; without them its "
                            "attention would run unsplit on each rank's share. Use --cp-comm-type p2p (ring), a2a "
                            "(all-to-all over the CP group) or all_gather")


def _check_dynamic_cp_flags(args) -> None:
    """``--sequence-packing-scheduler default_dynamic_cp``: group sizes that the sub-groups and the zigzag
    padding rule can serve, and the combinations it trains exactly (packing/dynamic_cp.py)."""
    scheduler = args.sequence_packing_scheduler
    if scheduler != "default_dynamic_cp":
        if args.overlong_samples != "refuse":
            raise ArgumentError(f"--overlong-samples {args.overlong_samples} applies to --sequence-packing-scheduler "
                                f"default_dynamic_cp, not {scheduler}")
        return
    if args.overlong_samples != "refuse" and args.stage in ("grpo", "score"):
        raise ArgumentError(f"--overlong-samples {args.overlong_samples}: --stage {args.stage} reads rollouts, whose "
                            "over-long ones --rollout-overlong refuses or drops; use it instead")
    cp, low = args.context_parallel_size, args.min_dynamic_context_parallel_size
    if cp < 2 or cp & (cp - 1):
        raise ArgumentError(f"--sequence-packing-scheduler default_dynamic_cp: --context-parallel-size {cp} is the "
                            "largest CP group a sample runs on; give a power of two >= 2")
    if low < 1 or low & (low - 1) or low > cp:
        raise ArgumentError(f"--min-dynamic-context-parallel-size {low} must be a power of two between 1 and "
                            f"--context-parallel-size {cp}")
    tp = args.tensor_model_parallel_size
    rule = 2 * (tp if args.sequence_parallel else 1)
    if args.max_seqlen_per_dp_cp_rank % rule:
        raise ArgumentError(f"--max-seqlen-per-dp-cp-rank {args.max_seqlen_per_dp_cp_rank} must be a multiple of "
                            f"{rule} under default_dynamic_cp: a sample on a CP group of g ranks is padded to a "
                            f"multiple of 2 x g" + (f" x TP {tp} (--sequence-parallel)" if rule > 2 else "")
                            + " and its row holds g x --max-seqlen-per-dp-cp-rank tokens")
    refused = [(args.micro_batch_size != 1, f"--micro-batch-size {args.micro_batch_size} (a micro-batch is one "
                "row of --max-seqlen-per-dp-cp-rank tokens per rank: use 1)"),
               (args.stage in DYNAMIC_CP_REFUSED_STAGES,
                f"--stage {args.stage} ({DYNAMIC_CP_REFUSED_STAGES.get(args.stage)}; dynamic CP trains --stage "
                "sft, dpo, simpo, orpo, kto, orm and grpo, and scores with --stage score)"),
               (args.attention_backend == "te", "--attention-backend te (megatron-core 0.16 applies THD RoPE over "
                "its fixed CP group, not a micro-batch's own; use local or flash)")]
    for bad, what in refused:
        if bad:
            raise ArgumentError(f"--sequence-packing-scheduler default_dynamic_cp does not support {what}")


def _check_recompute(args) -> None:
    """Megatron-LM's activation-recomputation flags, checked before megatron-core would refuse them."""
    if args.recompute_activations:
        if args.recompute_granularity not in (None, "selective"):
            raise ArgumentError("--recompute-activations is --recompute-granularity selective; it cannot go with "
                                f"--recompute-granularity {args.recompute_granularity}")
        args.recompute_granularity = "selective"
    granularity = args.recompute_granularity
    if granularity != "full":
        given = [f for f, v in (("--recompute-method", args.recompute_method),
                                ("--recompute-num-layers", args.recompute_num_layers)) if v is not None]
        if given:
            raise ArgumentError(f"{' and '.join(given)} {'go' if len(given) > 1 else 'goes'} with "
                                f"--recompute-granularity full (this run's: {granularity})")
    if args.recompute_modules is not None and granularity != "selective":
        raise ArgumentError(f"--recompute-modules goes with --recompute-granularity selective (this run's: "
                            f"{granularity})")
    without_te = sorted(set(args.recompute_modules or ()) & CHECKPOINT_WITHOUT_OUTPUT_MODULES)
    if granularity == "selective" and without_te and not megatron_random.HAVE_TE:
        # megatron-core 0.16.1's CheckpointWithoutOutput takes every instance as FP8 and reads TE's FP8 state:
        # without TE the first forward stopped with a NameError
        raise ArgumentError(f"--recompute-modules {' '.join(without_te)} needs Transformer Engine, not importable "
                            "here (megatron-core 0.16.1 checkpoints these modules through TE's FP8 state): recompute "
                            "core_attn or mlp instead, or use --recompute-granularity full")
    if granularity == "full":
        if args.recompute_method is None:
            raise ArgumentError("--recompute-granularity full needs --recompute-method uniform or block")
        stage = args.num_layers // max(1, args.pipeline_model_parallel_size)
        if args.recompute_num_layers is None or not 1 <= args.recompute_num_layers <= stage:
            raise ArgumentError(f"--recompute-granularity full needs --recompute-num-layers between 1 and {stage} "
                                f"(the layers of a pipeline stage); got {args.recompute_num_layers}")


def validate_args(args, world_size: int = 1) -> argparse.Namespace:
    """Check combinations and fill derived values (Megatron-LM semantics)."""
    _check_checkpoint_format(args)
    need = ["num_layers", "hidden_size", "num_attention_heads", "seq_length"]
    missing = [f"--{n.replace('_', '-')}" for n in need if getattr(args, n) is None]
    if missing:
        raise ArgumentError(f"missing required arguments: {', '.join(missing)}")
    _check_ranges(args)
    _warn_unavailable(args)
    _check_precision_and_parallel(args)
    _check_recompute(args)
    if args.transformer_impl:
        args.attention_backend = "te" if args.transformer_impl == "transformer_engine" else "local"
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if args.rope_scaling_type == "llama3":
        args.use_rope_scaling = True
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.kv_channels is None:  # Megatron-LM's default; checkpoints then record the head size
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.group_query_attention:
        if not args.num_query_groups:
            raise ArgumentError("--group-query-attention needs --num-query-groups")
        if args.num_attention_heads % args.num_query_groups:
            raise ArgumentError(f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                                f"--num-query-groups {args.num_query_groups}")
    else:
        args.num_query_groups = args.num_attention_heads
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if args.num_query_groups % tp:
        raise ArgumentError(f"--tensor-model-parallel-size {tp} must divide the query groups ({args.num_query_groups})")
    if args.num_layers % pp:
        raise ArgumentError(f"--pipeline-model-parallel-size {pp} must divide --num-layers {args.num_layers}")
    cp = args.context_parallel_size
    if cp < 1:
        raise ArgumentError(f"--context-parallel-size {cp} must be >= 1")
    _check_cp_algorithm(args)
    if cp > 1 and args.cp_comm_type in ("a2a", "a2a+p2p") and args.num_attention_heads // tp % cp:
        raise ArgumentError(f"--cp-comm-type {args.cp_comm_type} splits heads over CP: heads per TP rank "
                            f"({args.num_attention_heads // tp}) must be a multiple of --context-parallel-size {cp}")
    if world_size % (tp * pp * cp):
        raise ArgumentError(f"world size {world_size} is not divisible by TP {tp} x PP {pp} x CP {cp}")
    args.data_parallel_size = world_size // (tp * pp * cp)
    if args.torch_compile_kernels == "layers":  # refused before anything is built, with the backend it would get
        try:
            backend = attention_backend(args, quiet=True)
        except RuntimeError:  # a backend this machine cannot run: the build says so
            backend = args.attention_backend
        why = compiled_layers.unsupported_reason(args, backend)
        if why:
            raise ArgumentError(f"{compiled_layers.FLAG}: {why}")
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step:
        raise ArgumentError(f"--global-batch-size {args.global_batch_size} is not a multiple of micro-batch size "
                            f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size}")
    args.num_micro_batches = args.global_batch_size // per_step
    if args.seq_length < 2:
        raise ArgumentError("--seq-length must be at least 2")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type == "learned_absolute" and args.max_position_embeddings < args.seq_length:
        # the embedding table has a row per position: the first step failed with torch's bare IndexError
        raise ArgumentError(f"--max-position-embeddings {args.max_position_embeddings} is below --seq-length "
                            f"{args.seq_length}: learned absolute position embeddings have no row for positions "
                            f"{args.max_position_embeddings}..{args.seq_length - 1}; raise it to at least "
                            "--seq-length (Megatron-LM refuses it too)")
    if args.neat_pack and args.no_reset_position_ids:
        warnings.warn("--no-reset-position-ids with --neat-pack: positions run across samples; megatron-core's "
                      "THD RoPE restarts them per segment anyway", stacklevel=2)
    args.reset_position_ids = (args.reset_position_ids or args.neat_pack) and not args.no_reset_position_ids
    args.isolate_segments = args.neat_pack or args.reset_attention_mask
    if args.max_seqlen_per_dp_cp_rank is None:
        args.max_seqlen_per_dp_cp_rank = args.seq_length
    if args.max_seqlen_per_dp_cp_rank < 2:
        raise ArgumentError("--max-seqlen-per-dp-cp-rank must be at least 2")
    if args.padded_vocab_size is None and args.vocab_size is not None:
        args.padded_vocab_size = padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by, tp)
    _resolve_train_samples(args)
    if args.lr_decay_iters is None and not args.train_samples:
        args.lr_decay_iters = args.train_iters
    _check_schedule_flags(args)
    _check_loss_and_gc_flags(args)
    _warn_dropout_against_a_reference(args)
    _check_data_flags(args)
    _check_data_path_for_the_script(args)
    _check_dynamic_cp_flags(args)
    _check_moe_flags(args)
    _check_lora_flags(args)
    epochs = getattr(args, "train_epochs", None)  # posttrain.py: iterations computed from the packs (run_plan.py)
    if epochs is not None and args.train_iters:
        raise ArgumentError(f"--train-epochs {epochs} and --train-iters {args.train_iters} both given: pass only one")
    if epochs is not None and epochs < 1:
        raise ArgumentError(f"--train-epochs {epochs} must be >= 1")
    if not args.skip_train and not args.train_iters and not epochs and args.stage not in ("dpo_reference", "score"):
        raise ArgumentError("--train-iters is required (or --train-epochs, --train-samples, or --skip-train for "
                            "evaluation only)")
    if args.skip_train and not args.eval_iters:
        raise ArgumentError("--skip-train needs --eval-iters > 0")
    if args.finetune and not args.load:
        raise ArgumentError("--finetune needs --load")
    if args.overwrite_output_dir and not args.save:
        raise ArgumentError("--overwrite-output-dir starts over in --save: give --save")
    per_split = [getattr(args, f"{name}_data_path", None) for name in ("train", "valid", "test")]
    if args.data_path and any(per_split):
        raise ArgumentError("give --data-path (divided by --split) or --train-data-path/--valid-data-path/"
                            "--test-data-path, not both")
    rollouts = args.stage in ("score", "grpo")
    # an in-process RL session (training/rl_session.py) is handed its rollouts, not a file
    handed = getattr(args, "rollouts_in_process", False)
    if rollouts and (args.data_path or any(per_split) or not (getattr(args, "rollout_path", None) or handed)):
        raise ArgumentError(f"--stage {args.stage} reads rollouts: give --rollout-path (and no --data-path)")
    if handed and getattr(args, "rollout_path", None):
        raise ArgumentError("an in-process RL session is handed its rollouts: drop --rollout-path")
    if not rollouts and getattr(args, "rollout_path", None):
        raise ArgumentError("--rollout-path is read by --stage score and --stage grpo only")
    if not args.data_path and not any(per_split) and not rollouts:
        raise ArgumentError("--data-path is required" + (" (or --train-data-path)" if hasattr(args, "train_data_path") else ""))
    return args


# flags a stage would ignore if given: refused by name rather than silently dropped
_IGNORED_BY_STAGE = {
    "grpo": (("eval_interval", "--eval-interval"), ("eval_iters", "--eval-iters"), ("split", "--split")),
}


def _refuse_ignored_flags(args, given: set) -> None:
    ignored = [flag for dest, flag in _IGNORED_BY_STAGE.get(args.stage, ())
               if dest in given and not (dest == "eval_iters" and args.eval_iters == 0)]  # 0: no evaluation, as meant
    if ignored:
        raise ArgumentError(f"--stage {args.stage} trains on the rollouts of --rollout-path and evaluates nothing (no "
                            f"validation split): {', '.join(ignored)} would be ignored; drop "
                            + ("it" if len(ignored) == 1 else "them"))


def _changed(before: dict, args) -> set:
    return {k for k, v in vars(args).items() if k in before and before[k] != v}


def parse_args(argv=None, world_size: int | None = None, extra_args_provider=None, description=None) -> argparse.Namespace:
    """The flags of the command line and its ``--config`` file, checked, with the Hugging Face ``--load``'s
    model flags and the fine-tuning defaults filled in; ``args.flag_sources`` says where each value came
    from (``resolved_config``). ``--dry-run`` is the script's to act on (it needs the data)."""
    parser = build_parser(description or "mindspeed-pack training")
    if extra_args_provider is not None:
        extra_args_provider(parser)
    args, argv = yaml_file.parse(parser, argv)  # one parser for the file and the command line
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    given = hf_flags.explicit_dests(parser, argv)  # flags the user chose (command line or file)
    try:
        from_peft = peft_flags.fill_lora_flags(args, given)  # a PEFT --lora-load states its LoRA settings
        if args.lora_r is None and args.lora_target_modules is not None:
            args.lora_r = LORA_DEFAULT_RANK  # LoRA is on (lora.trains_adapters) from here on
        fold_megatron_hf_tokenizer(args, ArgumentError)  # Megatron-LM's HuggingFaceTokenizer --tokenizer-model DIR
        if args.use_checkpoint_args and not args.load:
            raise ArgumentError("--use-checkpoint-args takes the model flags from --load's checkpoint: pass --load")
        if args.ckpt_step is not None and not args.load:
            raise ArgumentError(f"--ckpt-step {args.ckpt_step} picks an iteration of --load's checkpoint: pass --load")
        before = dict(vars(args))
        hf_flags.apply_hf_flags(args, parser, argv)  # a HF --load: model flags from its config.json
        from_hf, before = _changed(before, args), dict(vars(args))
        if args.load_format == "mg":  # resolved from --load, which is no Hugging Face directory: derived, not config.json's
            from_hf.discard("load_format")
        if args.load_format == "mg":  # a Megatron --load: model flags from the arguments it records
            checkpoint_flags.fill_model_args(args, given)
        elif args.ckpt_step is not None:
            raise ArgumentError(f"--ckpt-step {args.ckpt_step} picks an iteration of a Megatron checkpoint; --load "
                                f"{args.load} is a Hugging Face directory")
        from_checkpoint = _changed(before, args) | from_peft
        mindspeed_llm_flags.apply(args, given, loads_hf=args.load_format == "hf")
        model_head.apply(args)  # a reward model's score head (--stage orm, or --stage score of one)
        defaults = finetune_defaults.apply(args, given)
        validate_args(args, world_size)
        _refuse_ignored_flags(args, given)
    except ArgumentError as e:
        parser.refusal_scope = error_scope.scope_of(e) if hasattr(e, "scope") else flag_scope(args)
        parser.error(str(e))
    resolved_config.record_sources(parser, args, given, from_hf, defaults, from_checkpoint)
    return args

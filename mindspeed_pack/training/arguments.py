"""Command-line arguments with Megatron-LM / MindSpeed-LLM names, and their validation.

Every flag of MindSpeed-LLM's Qwen2.5-7B pack example parses. Flags that only select a
fused CUDA kernel are accepted everywhere (the kernels are chosen by the layer spec) and
ignored with one warning on a CPU; flags that cannot work together fail with a clear error.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import warnings

from mindspeed_pack.model.gpt import padded_vocab_size
from mindspeed_pack.platform import cuda_usable

log = logging.getLogger(__name__)

# flags that pick fused GPU kernels; on CUDA the TE spec uses its fused kernels anyway
GPU_KERNEL_FLAGS = (
    "use_flash_attn", "use_fused_rmsnorm", "use_fused_swiglu", "use_fused_rotary_pos_emb",
    "overlap_grad_reduce", "overlap_param_gather", "use_distributed_optimizer", "sequence_parallel",
)


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
    g.add_argument("--normalization", default="RMSNorm", choices=["RMSNorm", "LayerNorm"])
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--position-embedding-type", default="rope", choices=["rope", "learned_absolute", "none"])
    g.add_argument("--use-rotary-position-embeddings", action="store_true", help="alias of --position-embedding-type rope")
    g.add_argument("--rotary-base", type=float, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--padded-vocab-size", type=int, default=None,
                   help="vocabulary size of the embedding (else derived from the tokenizer)")
    g.add_argument("--vocab-size", type=int, default=None, help="true vocabulary size (else from the tokenizer)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--no-parallel-invariant-init", action="store_true",
                   help="use megatron's per-rank initialisation (faster for huge from-scratch models) instead "
                        "of drawing the same full weights at every TP/PP layout")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "te", "local"],
                   help="te = Transformer Engine fused THD attention (CUDA); local = exact segment-causal "
                        "SDPA (any device); auto picks te when available")
    g.add_argument("--use-mcore-models", action="store_true", help="accepted for compatibility (always on)")
    g.add_argument("--transformer-impl", default=None, choices=["local", "transformer_engine"],
                   help="Megatron-LM alias of --attention-backend")
    for name in ("--use-flash-attn", "--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb"):
        g.add_argument(name, action="store_true", help="fused kernel (GPU); the TE spec uses it anyway")
    for name in ("--no-masked-softmax-fusion", "--no-gradient-accumulation-fusion", "--no-bias-dropout-fusion",
                 "--no-bias-swiglu-fusion", "--no-rope-fusion", "--attention-softmax-in-fp32", "--use-cpu-initialization"):
        g.add_argument(name, action="store_true", help="accepted for compatibility")


def _parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo"])
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)


def _training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--seq-length", type=int, required=False)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--initial-loss-scale", type=float, default=2**32)
    g.add_argument("--loss-scale", type=float, default=None)
    g.add_argument("--lr", type=float, default=1e-4)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="cosine", choices=["constant", "linear", "cosine", "inverse-square-root"])
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    g.add_argument("--per-sample-loss", action="store_true",
                   help="average each sample's token losses first, then over samples (default: per-token mean "
                        "over the global batch, the only packing-invariant choice)")
    g.add_argument("--nan-policy", default="stop", choices=["stop", "skip"],
                   help="on a NaN/inf loss or grad norm: stop with the iteration, or skip the update")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="deterministic algorithms (bitwise-reproducible CPU runs); the data order is always fixed by "
                        "--seed, or sequential with --no-shuffle")
    g.add_argument("--skip-train", action="store_true", help="evaluation only")
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-signal-handler", action="store_true")


def _data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None, help="prefix P of P_packed_*_document (or a blend)")
    g.add_argument("--split", default="100,0,0")
    g.add_argument("--num-workers", type=int, default=0)
    g.add_argument("--data-cache-path", default=None, help="where sample indices are cached (default: next to data)")
    g.add_argument("--is-instruction-dataset", action="store_true")
    g.add_argument("--neat-pack", action="store_true",
                   help="attention_mask holds segment ids: attention, labels and positions are isolated per "
                        "sample (positions restart per sample unless --no-reset-position-ids)")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="restart position ids at every sample/document (default on with --neat-pack)")
    g.add_argument("--no-reset-position-ids", action="store_true",
                   help="keep positions 0..s-1 across a pack (not recommended; MindSpeed's example did this)")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="isolate attention per sample/document (cu_seqlens; never a dense s x s mask)")
    g.add_argument("--eod-mask-loss", action="store_true", help="pretraining: do not train EOD targets")
    g.add_argument("--padded-samples", action="store_true",
                   help="repeat the first packs of each epoch to complete its last global batch")
    g.add_argument("--no-shuffle", action="store_true", help="sequential data order (for loss comparison runs)")
    g.add_argument("--sequence-packing-scheduler", default="none", choices=["none", "dp_balanced"],
                   help="dp_balanced: pack unpacked data at load time into rows of --max-seqlen-per-dp-cp-rank "
                        "tokens and balance data-parallel ranks by estimated cost (offline packs: balance the packs)")
    g.add_argument("--max-seqlen-per-dp-cp-rank", type=int, default=None,
                   help="tokens per packed row under --sequence-packing-scheduler dp_balanced (default --seq-length)")
    g.add_argument("--prompt-type", default=None, help="chat template used at preprocessing (recorded, checked)")
    g.add_argument("--stage", default="sft", choices=["sft"], help="post-training stage")
    g.add_argument("--variable-seq-lengths", action="store_true", help="accepted for compatibility")
    g.add_argument("--tokenizer-type", default=None)
    g.add_argument("--tokenizer-name-or-path", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--tokenizer-not-use-fast", action="store_true")


def _checkpoint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--finetune", action="store_true", help="load weights only and reset the iteration")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--ckpt-format", default="torch", choices=["torch"])


def _logging_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--eval-interval", type=int, default=None)
    g.add_argument("--eval-iters", type=int, default=0)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--metrics-file", default=None, help="every step's metrics as JSON lines")
    g.add_argument("--log-throughput", action="store_true", help="accepted; tokens/s is always logged")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="peak dense TFLOP/s of one device (e.g. 989 for H100 bf16): logs MFU next to model TFLOP/s")
    g.add_argument("--dry-run", action="store_true", help="parse and validate the arguments, print them, exit")


def build_parser(description: str = "mindspeed-pack training") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, allow_abbrev=False)
    for add in (_model_args, _parallel_args, _training_args, _data_args, _checkpoint_args, _logging_args):
        add(p)
    return p


class ArgumentError(ValueError):
    """An invalid flag or combination of flags."""


def _warn_unavailable(args) -> None:
    if cuda_usable():
        return
    used = [f"--{n.replace('_', '-')}" for n in GPU_KERNEL_FLAGS if getattr(args, n, False)]
    if args.bf16 or args.fp16:
        used.append("--bf16" if args.bf16 else "--fp16")
        args.bf16 = args.fp16 = False
    for name in ("sequence_parallel", "use_distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather"):
        setattr(args, name, False)
    if used:
        warnings.warn(f"no CUDA device: ignoring {', '.join(used)} (fp32 and local kernels on CPU)", stacklevel=3)


def validate_args(args, world_size: int = 1) -> argparse.Namespace:
    """Check combinations and fill derived values (Megatron-LM semantics)."""
    need = ["num_layers", "hidden_size", "num_attention_heads", "seq_length"]
    missing = [f"--{n.replace('_', '-')}" for n in need if getattr(args, n) is None]
    if missing:
        raise ArgumentError(f"missing required arguments: {', '.join(missing)}")
    _warn_unavailable(args)
    if args.transformer_impl:
        args.attention_backend = "te" if args.transformer_impl == "transformer_engine" else "local"
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
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
    if args.context_parallel_size != 1:
        raise ArgumentError("--context-parallel-size > 1 is not supported yet")
    if world_size % (tp * pp):
        raise ArgumentError(f"world size {world_size} is not divisible by TP {tp} x PP {pp}")
    args.data_parallel_size = world_size // (tp * pp)
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
    if args.neat_pack and args.no_reset_position_ids:
        warnings.warn("--no-reset-position-ids with --neat-pack: positions run across samples; megatron-core's "
                      "THD RoPE restarts them per segment anyway", stacklevel=2)
    args.reset_position_ids = (args.reset_position_ids or args.neat_pack) and not args.no_reset_position_ids
    args.isolate_segments = args.neat_pack or args.reset_attention_mask
    if args.max_seqlen_per_dp_cp_rank is None:
        args.max_seqlen_per_dp_cp_rank = args.seq_length
    if args.max_seqlen_per_dp_cp_rank < 2:
        raise ArgumentError("--max-seqlen-per-dp-cp-rank must be at least 2")
    if args.sequence_packing_scheduler == "dp_balanced" and not args.no_reset_position_ids:
        args.reset_position_ids = True  # online packing isolates samples: positions restart per sample
    if args.padded_vocab_size is None and args.vocab_size is not None:
        args.padded_vocab_size = padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by, tp)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None and args.train_iters:
        args.lr_warmup_iters = int(args.lr_warmup_fraction * (args.lr_decay_iters or args.train_iters))
    if not args.skip_train and not args.train_iters:
        raise ArgumentError("--train-iters is required (or --skip-train for evaluation only)")
    if args.skip_train and not args.eval_iters:
        raise ArgumentError("--skip-train needs --eval-iters > 0")
    if args.finetune and not args.load:
        raise ArgumentError("--finetune needs --load")
    if not args.data_path:
        raise ArgumentError("--data-path is required")
    return args


def parse_args(argv=None, world_size: int | None = None, extra_args_provider=None, description=None) -> argparse.Namespace:
    parser = build_parser(description or "mindspeed-pack training")
    if extra_args_provider is not None:
        extra_args_provider(parser)
    args = parser.parse_args(argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        validate_args(args, world_size)
    except ArgumentError as e:
        parser.error(str(e))
    if args.dry_run:
        print(json.dumps({k: v for k, v in sorted(vars(args).items())}, indent=1, default=str))
        raise SystemExit(0)
    return args

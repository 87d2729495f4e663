"""What a run will do before it does it: ``--train-epochs`` as iterations, and ``--dry-run``'s plan.

``--train-epochs N`` counts the training split's documents (packs, or samples of unpacked data),
``D``; an epoch is ``D`` samples of the sample index (rounded up to a multiple of the global batch
under ``--padded-samples``, whose repeats complete it), and the run takes
``ceil(N x epoch / global batch)`` iterations, so every document is seen exactly ``N`` times when
the epochs fill whole global batches (else the last batch also reads the next epoch's first
documents, said in the log). The global batch already holds the data-parallel size
(micro-batch x DP x micro-batches).

``--dry-run`` prints the resolved configuration (as ``resolved_config`` writes it) and the plan:
the data found, its packs, the iterations, the parallel layout, a memory estimate per GPU and the largest
micro-batch that estimate fits: several packs per forward are one THD sequence (the same losses), so the
host's per-layer launches are paid once for more tokens (issue 42: a 24-layer model is host-bound at one pack).
"""
from __future__ import annotations

import copy
import logging
import math
import os

from mindspeed_pack.config import resolved_config
from mindspeed_pack.config.errors import ArgumentError
from mindspeed_pack.datasets.packed_documents import DataError, is_blend_weight
from mindspeed_pack.model import compiled_layers, lora
from mindspeed_pack.model.vocab_cross_entropy import UNFUSED_ELEMENTS, loss_chunk
from mindspeed_pack.packing.balance import model_shape
from mindspeed_pack.runtime.error_scope import scoped
from mindspeed_pack.runtime.platform import cuda_usable
from mindspeed_pack.training.layout import ROLLOUT_STAGES, layout_line, packs_at_load_time, world_size

log = logging.getLogger(__name__)

GiB = 1024 ** 3  # every memory figure is in GiB (what torch and nvidia-smi report), labelled so


def training_documents(args) -> int:
    """Documents (packs, or unpacked samples) of the training split."""
    from mindspeed_pack.datasets.packed_dataset import split_ranges
    from mindspeed_pack.datasets.packed_documents import PackedDocuments

    per_split = getattr(args, "train_data_path", None)
    if per_split:
        return len(PackedDocuments(per_split[0]))
    docs = PackedDocuments(args.data_path[0])
    start, end = split_ranges(len(docs), args.split)[0]
    return end - start


def resolve_epochs(args) -> None:
    """``--train-iters`` (and ``--lr-decay-iters`` unless given) from ``--train-epochs``; logged."""
    epochs = getattr(args, "train_epochs", None)
    if not epochs:
        return
    if not args.data_path and not getattr(args, "train_data_path", None):
        raise DataError(f"--train-epochs {epochs} counts the packs of --data-path; --stage {args.stage} reads "
                        "rollouts: give --train-iters")
    try:
        docs = training_documents(args)
    except DataError:
        if getattr(args, "dry_run", False):  # a dry run checks a job's flags before its data exists: the plan
            return  # says the iterations come from --train-epochs once the data is found
        raise
    if docs == 0:
        raise DataError(f"--train-epochs {epochs}: the training split is empty (--split {args.split})")
    gbs = args.global_batch_size
    epoch = -(-docs // gbs) * gbs if args.padded_samples else docs
    args.train_iters = -(-epochs * epoch // gbs)
    resolved_config.mark(args, "train_iters", "epochs")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
        resolved_config.mark(args, "lr_decay_iters", "epochs")
    extra = args.train_iters * gbs - epochs * epoch
    batch = (f"{gbs} samples on data-parallel {args.data_parallel_size}, packed at load time into as many "
             "micro-batches as they fill" if packs_at_load_time(args) else
             f"micro-batch {args.micro_batch_size} x data-parallel {args.data_parallel_size} x "
             f"{args.num_micro_batches} micro-batch{'' if args.num_micro_batches == 1 else 'es'}")
    note = (f"--train-epochs {epochs}: {docs} training documents"
            + (f" (+{epoch - docs} repeats, --padded-samples)" if epoch != docs else "")
            + f" x {epochs} = {epochs * epoch} samples / global batch {gbs} ({batch}) = {args.train_iters} iterations")
    if extra:
        beyond = (f"epoch {epochs + 1}" if extra <= epoch else
                  f"epochs {epochs + 1}-{epochs + -(-extra // epoch)} (a global batch larger than an epoch)")
        note += (f"; the last global batch also reads {extra} documents of {beyond} (a global batch that "
                 f"divides {epoch}, or --padded-samples, makes the epochs exact)")
    args.epochs_note = note
    log.info(note)
    wsd = getattr(args, "lr_wsd_decay_iters", None)
    if wsd is not None and wsd > args.lr_decay_iters:  # the parser could not check it before the epochs' iterations
        raise DataError(f"--lr-wsd-decay-iters {wsd} is longer than the decay ({args.lr_decay_iters} iterations, "
                        f"--lr-decay-iters or {note.split(':')[0]}'s): give at most {args.lr_decay_iters}")


# ---------------------------------------------------------------------------- memory
def parameters_per_rank(args) -> tuple:
    """(total parameters, dense parameters on the busiest rank, expert parameters on it) from the model flags.

    Experts are split over the expert-parallel group (and TP: ``--expert-tensor-parallel-size`` is TP here);
    the router is replicated on every rank, as megatron-core keeps it."""
    m = model_shape(args)
    attention = m.attention + (m.qkv_rows if args.add_qkv_bias else 0)
    experts, router = m.experts * m.expert_mlp, m.hidden * m.experts  # of one MoE layer
    embedding = m.vocab * m.hidden + (args.max_position_embeddings * m.hidden
                                      if args.position_embedding_type == "learned_absolute" else 0)
    # a reward model's output layer is its score head (hidden -> 1), untied from the embedding
    output = m.hidden if getattr(args, "reward_head", False) else (
        0 if not args.untie_embeddings_and_output_weights else m.vocab * m.hidden)
    dense = m.layers - m.moe_layers
    total = m.layers * attention + dense * m.mlp + m.moe_layers * (experts + router) + embedding + output
    tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    stage = m.layers / pp  # layers of a pipeline stage; MoE and dense layers counted at their share
    per_layer = (attention + m.mlp * dense / m.layers) / tp + router * m.moe_layers / m.layers
    ends = (embedding + output) / tp if pp == 1 else max(embedding, output) / tp
    return total, stage * per_layer + ends, stage * experts * m.moe_layers / m.layers / (tp * ep)


def optimizer_shards(args) -> tuple:
    """(ranks the distributed optimizer shards a dense parameter's state over, ranks it shards an expert's over):
    megatron-core's data-parallel group with CP (DP x CP), and its expert-data-parallel group of world / (ETP x EP
    x PP) = DP x CP / EP ranks (ETP = TP here); (1, 1) without ``--use-distributed-optimizer``."""
    if not args.use_distributed_optimizer:
        return 1, 1
    dense = args.data_parallel_size * args.context_parallel_size
    return dense, max(1, dense // args.expert_model_parallel_size)


def memory_estimate(args) -> dict:
    """GiB per GPU of weights, gradients, optimizer state and activations (one rank of the first stage).

    The optimizer state of dense parameters is sharded over DP x CP, that of expert parameters over the smaller
    expert-data-parallel group (:func:`optimizer_shards`). Under LoRA only the adapters have gradients and
    optimizer state (the frozen base has neither). A DPO or KTO run's in-job reference model is a second copy of
    the base weights (:func:`reference_model_parameters`)."""
    total, dense, experts = parameters_per_rank(args)
    reference = reference_model_parameters(args, dense + experts)
    params = dense + experts
    adapters = lora.settings_from_args(args)
    trained_dense, trained_experts = dense, experts
    if adapters:
        # replicated factors are on every tensor-parallel rank (lora.adapter_parameters)
        per_rank = lora.adapter_parameters(adapters, args, args.tensor_model_parallel_size)
        total = total + lora.adapter_parameters(adapters, args)
        trained_dense, trained_experts = per_rank / args.pipeline_model_parallel_size, 0
        params = params + trained_dense
    trained = trained_dense + trained_experts
    half = args.bf16 or args.fp16
    dense_shards, expert_shards = optimizer_shards(args)
    states = (4 if half else 0) + (8 if args.optimizer == "adam" else 4)  # fp32 master copy, Adam moments
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    local = tokens_per_rank(args)
    sbh = local * args.hidden_size
    per_layer = local * layer_activation_bytes(args) * (1 if half else 2)
    in_flight = min(pp, args.num_micro_batches)  # 1F1B: micro-batches the first stage holds
    layers = recomputed_activation_layers(args, per_layer, sbh * (1 / tp if args.sequence_parallel else 1)
                                          * (2 if half else 4))
    # the fused loss holds one chunk of fp32 logits (model/vocab_cross_entropy.py), megatron's unfused one all
    rows = local
    vocab = (args.padded_vocab_size or 0) / tp
    chunk = loss_path(args)
    if chunk:
        rows = min(rows, chunk)
    logits = rows * vocab * 4 * 2
    if chunk != 0 and not adapters:  # it sums a trained output layer's gradient in an fp32 buffer, in fp32 runs too
        logits += vocab * args.hidden_size * 4
    if getattr(args, "reward_head", False):
        logits = 0  # one score per token of the score head, no vocabulary logits
    out = {"parameters": total, "parameters per GPU": params, "trained per GPU": trained,
           "weights": params * (2 if half else 4) / GiB, "reference model": reference * (2 if half else 4) / GiB,
           "gradients": trained * 4 / GiB,
           "optimizer": (trained_dense / dense_shards + trained_experts / expert_shards) * states / GiB,
           "activations": (layers * in_flight + (logits if pp == 1 else 0)) / GiB}
    out["total"] = out["weights"] + out["reference model"] + out["gradients"] + out["optimizer"] + out["activations"]
    return out


def reference_model_parameters(args, base: float) -> float:
    """Parameters per GPU of the frozen reference model that ``--stage dpo``/``kto`` build beside the policy (a copy of
    the starting weights or ``--ref-load``, in the policy's precision): ``base``, the policy's without adapters; none
    with ``--ref-logps`` or under LoRA without ``--ref-load`` (the adapters switched off), and for other stages."""
    from mindspeed_pack.training.stages.reference import has_reference_model

    if getattr(args, "stage", None) not in ("dpo", "kto") or not has_reference_model(args):
        return 0.0
    return base


def layer_activation_bytes(args) -> float:
    """Bytes of 16-bit activations one token keeps for the backward in a layer of the stage (the stage's dense and
    MoE layers averaged), without recomputation and with fused attention (no s x s scores): Korthikanti et al.
    2022's count (34h per token, TP-split as 10h + 24h/TP, all of it under sequence parallelism) with its MLP,
    which assumes a 4h GELU, taken from the model's shape: the fc1 input and dropout mask (3h), the fc1 output and
    the activation's output (2F + 2F, gated: 4F + 2F); an MoE layer's routed experts keep that for each of a
    token's top-k copies, with the permuted input and the expert output the combine weights (4h each copy)."""
    m = model_shape(args)
    h, tp = m.hidden, args.tensor_model_parallel_size
    gated = 2 if getattr(args, "swiglu", False) else 1
    ffn = getattr(args, "ffn_hidden_size", None) or 4 * h
    dense_mlp = (2 * gated + 2) * ffn
    split = 8 * h + dense_mlp  # attention's q, k, v and output (8h), the MLP's intermediate
    if m.moe_layers:
        expert_ffn = getattr(args, "moe_ffn_hidden_size", None) or ffn
        moe_mlp = args.moe_router_topk * (4 * h + (2 * gated + 2) * expert_ffn)
        split += (moe_mlp - dense_mlp) * m.moe_layers / m.layers
    replicated = 10 * h  # norms, the attention's and the MLP's inputs, dropout masks
    return (replicated + split) / tp if args.sequence_parallel else replicated + split / tp


def recomputed_activation_layers(args, per_layer: float, layer_input: float) -> float:
    """Bytes of one micro-batch's activations over a pipeline stage's layers under ``--recompute-granularity full``
    (Korthikanti et al. 2022): a recomputed layer keeps only its input, and one recomputed chunk holds its whole
    activations again while its backward runs. Selective recomputation of the core attention changes nothing
    here: the estimate already assumes fused attention (no s x s scores kept)."""
    stage = args.num_layers / args.pipeline_model_parallel_size
    if getattr(args, "recompute_granularity", None) != "full":
        return per_layer * stage
    n = args.recompute_num_layers
    if args.recompute_method == "uniform":
        return math.ceil(stage / n) * layer_input + n * per_layer
    return n * layer_input + (stage - n) * per_layer + per_layer  # block: the first n, one at a time


def _recompute_words(args) -> str:
    granularity = getattr(args, "recompute_granularity", None)
    if granularity == "full":
        return (f"with full recomputation ({args.recompute_method}, {args.recompute_num_layers} layer"
                f"{'s' if args.recompute_num_layers > 1 else ''})")
    return "with selective recomputation (unchanged: fused attention keeps no scores)" if granularity \
        else "without recomputation"


def tokens_per_rank(args) -> int:
    """Tokens one rank holds of a micro-batch: ``--max-seqlen-per-dp-cp-rank`` of a row packed at load time (dynamic
    CP, rollouts, ``dp_balanced`` on unpacked data: a row of CP x that many tokens), else its share of
    ``--micro-batch-size`` packs of ``--seq-length``."""
    scheduler = getattr(args, "sequence_packing_scheduler", None)
    if scheduler == "default_dynamic_cp" or getattr(args, "stage", None) in ROLLOUT_STAGES or (
            scheduler == "dp_balanced" and _unpacked_data(args)):
        return int(args.max_seqlen_per_dp_cp_rank)
    return args.seq_length * args.micro_batch_size // args.context_parallel_size


def _unpacked_data(args) -> bool:
    """Whether the training data holds one sample per document (dp_balanced then packs rows at load time), as
    :class:`~mindspeed_pack.datasets.online_packing.BalancedBatchSource` decides; False when it cannot be read."""
    from mindspeed_pack.datasets.online_packing import data_kind
    from mindspeed_pack.datasets.packed_documents import PackedDocuments

    prefixes = getattr(args, "train_data_path", None) or [p for p in args.data_path or [] if not is_blend_weight(p)]
    if not prefixes:
        return False
    try:
        return data_kind(PackedDocuments(prefixes[0])) == "unpacked"
    except (DataError, OSError, ValueError):
        return False


def loss_path(args) -> int:
    """Tokens per chunk of the fused output-layer loss at this run's micro-batch (0: megatron-core's unfused loss),
    as the model chooses it (:func:`~mindspeed_pack.model.vocab_cross_entropy.loss_chunk`)."""
    tokens = tokens_per_rank(args)
    vocab = (args.padded_vocab_size or 0) // args.tensor_model_parallel_size
    # model-shape namespaces (bench, tests) lack the flag
    return loss_chunk(tokens, vocab, getattr(args, "cross_entropy_chunk_size", None))


def _loss_line(args) -> str:
    if getattr(args, "reward_head", False):
        return "loss: the score head's (one score per sample, no vocabulary logits)"
    if not args.padded_vocab_size:
        return "loss: chosen at the first step (vocabulary unknown)"
    tokens = tokens_per_rank(args)
    vocab = args.padded_vocab_size // args.tensor_model_parallel_size
    size = f"the micro-batch's fp32 logits: {tokens * vocab * 4 / GiB:.2f} GiB per rank"
    requested = getattr(args, "cross_entropy_chunk_size", None)
    why = "--cross-entropy-chunk-size" if requested is not None else \
        f"{'within' if loss_path(args) == 0 else 'over'} the unfused loss's {UNFUSED_ELEMENTS * 4 / GiB:.0f} GiB budget"
    chunk = loss_path(args)
    what = "megatron-core's unfused output layer + cross-entropy" if chunk == 0 else \
        f"output layer + cross-entropy fused, {chunk} tokens per chunk"
    return f"loss: {what} ({size}, {why})"


# ---------------------------------------------------------------------------- the plan
def _data_lines(args) -> list:
    if getattr(args, "rollout_path", None):
        return [f"data: rollouts {args.rollout_path} (packed at load time into rows of "
                f"{args.max_seqlen_per_dp_cp_rank} tokens per CP rank)"]
    if getattr(args, "data_summary", None):
        return [f"data: {args.data_summary}"]
    from mindspeed_pack.datasets.packed_documents import data_prefixes, read_meta

    lines = []
    read_by = {}  # per-split data: which flags read each prefix
    for name in ("train", "valid", "test"):
        for path in getattr(args, f"{name}_data_path", None) or []:
            read_by.setdefault(path, []).append(f"--{name}-data-path")
    for prefix in data_prefixes(args):
        found = [f for f in (f"{prefix}_packed_input_ids_document.bin", f"{prefix}_text_document.bin",
                             f"{prefix}.bin") if os.path.isfile(f)]
        label = f" [{', '.join(read_by[prefix])}]" if prefix in read_by else ""
        if not found:
            lines.append(f"data: {prefix}{label}: NOT FOUND (neither packs {prefix}_packed_*_document.bin nor documents "
                         f"{prefix}.bin nor a file or directory of that name)")
            continue
        stats = (read_meta(prefix) or {}).get("statistics") or {}
        detail = ", ".join(f"{stats[k]} {k.replace('_', ' ')}" for k in ("packs", "documents", "samples_written",
                                                                         "fill_rate") if k in stats)
        lines.append(f"data: {found[0][:-4]}{label}" + (f" ({detail})" if detail else ""))
    return lines


def plan_lines(args) -> list:
    lines = _data_lines(args)
    try:
        if args.data_path and not any(is_blend_weight(p) for p in args.data_path):
            docs = training_documents(args)
            lines.append(f"training split: {docs} documents (--split {args.split})")
    except DataError:
        pass
    if getattr(args, "epochs_note", None):
        lines.append(f"iterations: {args.train_iters} ({args.epochs_note})")
    elif getattr(args, "train_epochs", None):
        lines.append(f"iterations: from --train-epochs {args.train_epochs} once the data is found")
    else:
        lines.append(f"iterations: {args.train_iters} (--train-iters)")
    world = world_size(args)
    load_time = packs_at_load_time(args)
    lines.append(layout_line(args))
    if getattr(args, "sequence_packing_scheduler", None) == "default_dynamic_cp":
        lines += _dynamic_cp_lines(args)
    m = memory_estimate(args)
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    lines.append(f"model: {_count(m['parameters'])} parameters, {_count(m['parameters per GPU'])} per GPU "
                 f"({precision}" + (", vocabulary unknown" if not args.padded_vocab_size else "")
                 + (f"; LoRA: {_count(m['trained per GPU'])} trained per GPU" if lora.settings_from_args(args) else "")
                 + ")")
    if args.padded_vocab_size and not load_time:
        lines.append(_compute_line(args, world))
    lines.append(_loss_line(args))
    lines.append(compiled_layers.plan_line(args))
    reference = f"reference model {m['reference model']:.2f} GiB + " if m["reference model"] else ""
    lines.append(f"memory per GPU (estimate): weights {m['weights']:.2f} GiB + {reference}"
                 f"gradients {m['gradients']:.2f} GiB + "
                 f"optimizer {m['optimizer']:.2f} GiB + activations {m['activations']:.2f} GiB = {m['total']:.2f} GiB "
                 f"(fp32 gradients and Adam state as megatron keeps them; activations {_recompute_words(args)}, "
                 "Korthikanti et al.; allocator and communication buffers come on top)")
    if not load_time:  # load-time packing and rollouts: one row per forward
        lines.append(_micro_batch_line(args))
    lines += _gpu_precision_lines(args)
    return lines


def _gpu_precision_lines(args) -> list:
    """Where no GPU is visible the fine-tuning defaults leave a run in fp32 (finetune_defaults.py), while the plan
    sizes it for a GPU, where the same command trains in bf16: say so, with that run's estimate."""
    if not getattr(args, "bf16_on_a_gpu", False) or args.bf16 or args.fp16:
        return []
    bf16 = copy.copy(args)
    bf16.bf16 = True
    return [f"precision: fp32 here (no GPU visible); on a GPU with bf16 the fine-tuning defaults turn on --bf16: "
            f"memory per GPU (estimate) {memory_estimate(bf16)['total']:.2f} GiB; pass --bf16 to plan that run"]


ASSUMED_DEVICE_GIB = 80.0  # an H100's memory, when --dry-run runs where no GPU is visible
HEADROOM = 0.85  # the share of a GPU's memory the estimate may fill: allocator and communication buffers on top


def device_memory_gib() -> tuple:
    """(GiB of GPU 0, how it was found): the visible GPU's, else an H100's assumed."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory / GiB, props.name
    return ASSUMED_DEVICE_GIB, "no GPU visible: an 80 GiB H100 assumed"


def largest_micro_batch(args, device_gib: float) -> tuple:
    """(the largest micro-batch size up to 8, a power of two, whose estimate fits ``HEADROOM`` of ``device_gib``,
    its estimated GiB); (0, GiB at 1) when even one pack does not fit."""
    best, best_gib = 0, memory_estimate(_with_micro_batch(args, 1))["total"]
    for mbs in (1, 2, 4, 8):
        total = memory_estimate(_with_micro_batch(args, mbs))["total"]
        if total > HEADROOM * device_gib:
            break
        best, best_gib = mbs, total
    return best, best_gib


def _with_micro_batch(args, mbs: int):
    trial = copy.copy(args)
    trial.micro_batch_size = mbs
    trial.num_micro_batches = max(1, args.global_batch_size // (mbs * args.data_parallel_size))
    return trial


def _micro_batch_line(args) -> str:
    """The largest micro-batch the estimate fits: packs per forward flattened into one THD sequence."""
    gib, where = device_memory_gib()
    best, total = largest_micro_batch(args, gib)
    budget = f"{HEADROOM:.0%} of {gib:.0f} GiB ({where})"
    if best == 0:
        return f"micro-batch: even 1 pack per forward is estimated at {total:.1f} GiB, over {budget}"
    line = f"micro-batch: up to {best} pack{'s' if best > 1 else ''} per forward fit{'s' if best == 1 else ''} " \
           f"{budget} (estimate {total:.1f} GiB)"
    dp, pp, gbs = args.data_parallel_size, args.pipeline_model_parallel_size, args.global_batch_size
    # 1F1B needs at least PP micro-batches per step, or a pipeline stage idles (one micro-batch: PP - 1 of PP stages);
    # without a pipeline a larger global batch makes room for any micro-batch
    fill = [m for m in (1, 2, 4, 8) if m <= best and (pp == 1 or gbs // (m * dp) >= pp)]
    suggested = max(fill, default=1)
    rule = (f"; {suggested}, not {best}: the largest that keeps at least PP {pp} micro-batches per step at "
            f"--global-batch-size {gbs}, since fewer idle a pipeline stage under 1F1B")
    if suggested <= args.micro_batch_size:
        if best <= args.micro_batch_size:
            return line
        return (f"{line}; keep --micro-batch-size {args.micro_batch_size}: a larger one leaves fewer than PP {pp} "
                f"micro-batches per step at --global-batch-size {gbs} (fewer idle a pipeline stage under 1F1B); "
                f"--global-batch-size {best * dp * pp} would take --micro-batch-size {best}")
    why = "trains the same losses with fewer launches per token (its packs are one THD sequence per forward)"
    per_step = suggested * dp
    batch = f", with --global-batch-size a multiple of {per_step}" if gbs % per_step else ""
    return f"{line}; --micro-batch-size {suggested} {why}{batch}" + (rule if suggested < best else "")


def _dynamic_cp_lines(args) -> list:
    """The first steps' dynamic CP plans (the data's sizes), or why they cannot be shown."""
    from mindspeed_pack.datasets import online_packing, rollouts

    if getattr(args, "rollouts_in_process", False):
        return ["dynamic CP plan: made per step from the lengths of the rollouts each round hands over"]
    rollout_path = getattr(args, "rollout_path", None)
    if not args.data_path and not getattr(args, "train_data_path", None) and not rollout_path:
        return ["dynamic CP plan: needs --data-path"]
    try:
        return (rollouts if rollout_path else online_packing).dynamic_cp_preview(args)
    except (DataError, OSError, FileNotFoundError) as exc:
        return [f"dynamic CP plan: {exc}"]


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


ASSUMED_MFU = 0.4  # what the project measured on an H200 at 1.5B with the layers compiled (docs/gpu.md): 42-45%


def step_flops(args) -> tuple:
    """(fewest, most) model FLOPs of one step, as the training log counts them: ``--global-batch-size`` full rows,
    their attention from none (many short samples) up to one sample per row (segments' squared lengths)."""
    from mindspeed_pack.packing.balance import cost_model

    tokens = args.global_batch_size * args.seq_length
    model = cost_model(args)
    return model.flops(tokens, 0), model.flops(tokens, args.global_batch_size * args.seq_length ** 2)


def _compute_line(args, world: int) -> str:
    """What a step costs in FLOPs and, given ``--peak-tflops``, about how long the run takes: for sizing a job."""
    low, high = step_flops(args)
    line = (f"compute: {low / 1e15:.3g}-{high / 1e15:.3g} PFLOP per step ({args.global_batch_size} x {args.seq_length} "
            "tokens; attention from none up to one sample per row; the log's model TFLOPs count the samples packed)")
    peak = getattr(args, "peak_tflops", None)
    if not peak:
        return line + "; --peak-tflops P (a device's dense peak, e.g. 989 for an H100 in bf16) adds the run's time"
    rate = world * peak * 1e12 * ASSUMED_MFU
    iterations = getattr(args, "train_iters", None)
    hours = [iterations * f / rate / 3600 for f in (low, high)] if iterations else None
    return line + (f"; at {ASSUMED_MFU:.0%} MFU of {world} x {peak:g} TFLOP/s: {low / rate:.3g}-"
                   f"{high / rate:.3g} s per step" + (f", {hours[0]:.3g}-{hours[1]:.3g} h for {iterations} "
                                                       "iterations" if hours else ""))


def host_memory_gib():
    """GiB of memory this host can still give (``MemAvailable``, within a cgroup v2 limit), or None where unknown."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 / GiB for line in f if line.startswith("MemAvailable:")]
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.current") as g:
            limit = f.read().strip()
            if limit != "max":
                found.append((int(limit) - int(g.read().strip())) / GiB)
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check_host_memory(args) -> None:
    """Without a CUDA device the run's tensors live in host memory: when ``--dry-run``'s estimate for this host's
    processes exceeds what it has free, stop before anything is built (the Qwen2.5-7B example on a CPU machine
    had its 8 processes killed by the kernel one by one, a SIGKILL summary and no word of why)."""
    if cuda_usable():
        return
    free = host_memory_gib()
    if free is None:
        return
    m = memory_estimate(args)
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if m["total"] * processes <= free:
        return
    parts = " + ".join(f"{name} {m[name]:.2f}" for name in ("weights", "reference model", "gradients", "optimizer",
                                                            "activations") if m[name])
    raise scoped(ArgumentError(  # the host's memory: each node's local rank 0 says it (runtime.error_scope)
        f"no CUDA device: this run would hold about {m['total']:.2f} GiB per process in host memory ({parts} GiB, "
        f"--dry-run's estimate for a {_count(m['parameters'])}-parameter model) x {processes} process(es) on this "
        f"host = {m['total'] * processes:.1f} GiB, and the host has {free:.1f} GiB free: run it on GPUs "
        "(--dry-run, the example scripts' DRY_RUN=1, checks its flags and prints its plan without one), or make the "
        "model or --seq-length smaller"), "node")


def dry_run(args, script: str) -> bool:
    """Under ``--dry-run``: print the resolved configuration and the plan, and say so (True)."""
    if not args.dry_run:
        return False
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every rank resolves the same: one prints it
        print(resolved_config.text(args, script))
        print("# --- plan\n" + "\n".join(f"# {line}" for line in plan_lines(args)))
    return True


def train_epochs_arg(parser):
    """posttrain.py's ``--train-epochs`` (instead of ``--train-iters``)."""
    parser.add_argument_group("epochs").add_argument(
        "--train-epochs", type=int, default=None, metavar="N",
        help="train N passes over the training split's documents (packs): --train-iters = ceil(N x documents / "
             "--global-batch-size), logged and in the resolved configuration; instead of --train-iters")
    return parser

"""Reference log-probs: scored by a frozen model, in the job or once beforehand.

``posttrain.py --stage dpo_reference --load REF --data-path P ...`` runs the reference over
every pack of ``P`` (forward only, any TP/PP/CP/DP layout) and writes ``P_dpo_reference.pt``
beside the data: per pack, its segment pairs' log-prob sums (a preference pair's chosen and rejected
answer; a KTO sample and its KL partner), and the data's identity (content fingerprint of the packs,
tokenizer, template) from its sidecar. ``--stage dpo --ref-logps`` (or ``kto``) then trains with no
reference model in memory; a file scored on other data, another tokenizer or template is refused,
naming both identities. :class:`Reference` is the one place a stage gets its reference log-probs.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from mindspeed_pack.datasets.packed_dataset import DataError, micro_batch
from mindspeed_pack.model import lora, moe
from mindspeed_pack.packing import context_parallel as cp_view
from mindspeed_pack.runtime import stale_files
from mindspeed_pack.runtime.platform import cuda_usable
from mindspeed_pack.training.stages.sequences import document_units, pair_segments, sequence_logps

log = logging.getLogger(__name__)

SUFFIX = "_dpo_reference.pt"
FORMAT = "mindspeed-pack dpo reference log-probs"

# where a preference stage's reference log-probs come from (reference_source)
TABLE, ADAPTERS_OFF, REF_LOAD, STARTING_POLICY = "precomputed table", "adapters off", "--ref-load", "starting policy"


def reference_source(args) -> str:
    """Where this run's reference log-probs come from: a precomputed table (``--ref-logps``), the policy itself
    with its LoRA adapters switched off (a LoRA run without ``--ref-load``), a model loaded from ``--ref-load``,
    or a frozen copy of the starting policy. Every stage with a reference asks this, not the flags."""
    if args.ref_logps:
        return TABLE
    if lora.trains_adapters(args) and not args.ref_load:
        return ADAPTERS_OFF
    return REF_LOAD if args.ref_load else STARTING_POLICY


def has_reference_model(args) -> bool:
    """True when the reference is a second, frozen model in this job's memory."""
    return reference_source(args) in (REF_LOAD, STARTING_POLICY)


class Reference:
    """The reference log-probs of every micro-batch's segment pairs ``(2k-1, 2k)`` (a preference pair's chosen
    and rejected answer, a KTO sample and its KL partner), from where :func:`reference_source` says: a frozen
    model run in the job (``--ref-load``, or a copy of the starting policy), the policy itself with its LoRA
    adapters off, or a table precomputed by ``--stage dpo_reference`` (``--ref-logps``)."""

    def __init__(self, chunks=None, adapters_off: bool = False, tables=None):
        self.chunks, self.adapters_off, self.tables = chunks, adapters_off, tables

    @classmethod
    def of_run(cls, trainer, args, stage: str) -> "Reference":
        """This run's reference, logged by ``stage``."""
        source = reference_source(args)
        if source == TABLE:
            tables = {docs.prefix: ReferenceTable.load_for(docs) for docs in trainer.source.docs}
            log.info("%s: precomputed reference log-probs (%s)", stage, ", ".join(t.path for t in tables.values()))
            return cls(tables=tables)
        if source == ADAPTERS_OFF:
            log.info("%s: reference model = the frozen base --load %s: the policy's own module with its LoRA adapters "
                     "switched off (no second model in memory)", stage, args.load)
            return cls(trainer.model, adapters_off=True)
        return cls([frozen_model(trainer, args, stage)])

    def pair_logps(self, batches, micro_batches, prefix: str, tokens_per_micro_batch: int) -> list:
        """[pairs, 2] per micro-batch (segments 2k-1, 2k); None where this pipeline stage holds no scores."""
        if self.tables is not None:
            return [self.tables[prefix].lookup(mb).to(b.loss_mask.device) for b, mb in zip(batches, micro_batches)]
        with lora.base_model_only(self.chunks) if self.adapters_off else contextlib.nullcontext():
            scores = score_sequences(self.chunks, batches, tokens_per_micro_batch)
        out = []
        for batch, seq in zip(batches, scores):
            first, second = pair_segments(batch) if seq is not None else (None, None)
            out.append(None if seq is None else torch.stack([seq[first], seq[second]], dim=1))
        return out


def frozen_model(trainer, args, stage: str):
    """The reference model of this job: ``--ref-load`` (a Megatron checkpoint or HF directory, read as ``--load``
    reads it) or a copy of the starting policy, frozen, in eval mode."""
    from megatron.core.transformer.module import Float16Module
    from megatron.core.utils import get_model_config

    from mindspeed_pack.checkpoint import resume, save_load
    from mindspeed_pack.model.gpt import build_gpt_model

    model = build_gpt_model(lora.without_lora(args), pre_process=ps.is_pipeline_first_stage(),
                            post_process=ps.is_pipeline_last_stage())
    step = getattr(args, "refer_model_iter", None)
    if step is not None:  # MindSpeed-LLM's: an iteration of the reference's checkpoint, --ref-load's else --load's
        root, flag = (args.ref_load, "--ref-load") if args.ref_load else (args.load, "--load")
        save_load.load_model_weights(args, root, model, flag, step=step)
        log.info("%s: reference model = iteration %d of %s %s (--refer-model-iter; frozen)", stage, step, flag, root)
    elif args.ref_load:
        save_load.load_model_weights(args, args.ref_load, model, "--ref-load")
        log.info("%s: reference model loaded from %s (frozen)", stage, args.ref_load)
    elif trainer.iteration > 0 and resume.resumed_own_save(args):  # --load still holds the starting policy
        save_load.load_model_weights(args, args.load, model, "--load")
        log.info("%s: reference model = the starting policy, read again from --load %s (the run resumed from "
                 "its --save)", stage, args.load)
    elif trainer.iteration > 0:
        raise DataError(f"--stage {stage} resumes at iteration {trainer.iteration}: the reference is the *starting* "
                        "policy, which the checkpoint no longer holds; pass --ref-load (the model the run "
                        "started from: its Megatron checkpoint or Hugging Face directory) or --ref-logps")
    else:
        policy = trainer.model[0]
        while hasattr(policy, "module"):
            policy = policy.module
        model.load_state_dict(policy.state_dict(), strict=True)
        log.info("%s: reference model = a frozen copy of the starting policy", stage)
    if cuda_usable():
        model.cuda(torch.cuda.current_device())
    if args.bf16 or args.fp16:
        model = Float16Module(get_model_config(model), model)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def score_sequences(model_chunks, batches, tokens_per_micro_batch: int) -> list:
    """Per-segment log-prob sums of every micro-batch under ``model_chunks`` (forward only, the
    same pipeline schedule as training); tensors on the last pipeline stage, None elsewhere."""
    return score_batches(model_chunks, batches, tokens_per_micro_batch, lambda b, out: sequence_logps(b, out)[0])


def token_logps(batch, output_tensor: torch.Tensor) -> torch.Tensor:
    """Log-prob of every position's target [1, T] (the model's per-token loss is ``-log p``)."""
    return -output_tensor.float().reshape(batch.loss_mask.shape)


def score_batches(model_chunks, batches, tokens_per_micro_batch: int, score, needs_logits: bool = False) -> list:
    """``score(batch, per-token loss)`` of every micro-batch under ``model_chunks`` (forward only, the
    same pipeline schedule as training); tensors on the last pipeline stage, None elsewhere.
    ``needs_logits``: ``score`` gets the vocab-parallel logits instead of the per-token loss."""
    from mindspeed_pack.training.batches import packed_seq_params

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        # a mixture of experts routes by this micro-batch's samples (the policy's routers hold the last step's)
        moe.set_routing_segments(model, batch.routing_segments, batch.routing_groups, batch.local_cp_size)
        output = model(batch.tokens, batch.position_ids, None, labels=None if needs_logits else batch.target,
                       packed_seq_params=packed_seq_params(batch))

        def collect(output_tensor):
            scores = score(batch, output_tensor)
            return scores.sum() * 0, torch.tensor(0, dtype=torch.int), {"scores": scores.detach()}

        return output, collect

    with torch.no_grad():
        results = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=model_chunks,
            num_microbatches=len(batches), seq_length=tokens_per_micro_batch, micro_batch_size=1, forward_only=True)
    if not ps.is_pipeline_last_stage():
        return [None] * len(batches)
    return [r["scores"].double() for r in results]


def data_identity(docs) -> dict:
    """What reference log-probs are valid for: the packs' content, tokenizer and template."""
    meta = docs.meta or {}
    key = meta.get("cache_key") or {}
    fingerprint = (meta.get("statistics") or {}).get("data_fingerprint")
    if not fingerprint:
        raise DataError(f"{docs.prefix}_packed_meta.json records no data_fingerprint: re-run preprocess_data.py "
                        "with a pairwise handler")
    tokenizer = hashlib.sha256(json.dumps(key.get("tokenizer"), sort_keys=True).encode()).hexdigest()[:16]
    template = (key.get("template") or {}).get("name")
    return {"data": fingerprint, "tokenizer": tokenizer, "template": template}


def _describe(identity: dict) -> str:
    return f"data fingerprint {identity['data']} (tokenizer {identity['tokenizer']}, template {identity['template']})"


class ReferenceTable:
    """Pairs' reference log-probs of one data prefix, keyed by (pack, pair in the pack)."""

    def __init__(self, path: str, pair_offsets: torch.Tensor, logps: torch.Tensor):
        self.path, self.pair_offsets, self.logps = path, pair_offsets.long(), logps.double()

    @classmethod
    def load_for(cls, docs) -> "ReferenceTable":
        path = docs.prefix + SUFFIX
        if not os.path.isfile(path):
            raise DataError(f"--ref-logps: {path} not found; score the reference first: posttrain.py --stage "
                            f"dpo_reference --load REF_CHECKPOINT --data-path {docs.prefix} ...")
        saved = torch.load(path, weights_only=True)
        if not isinstance(saved, dict) or saved.get("format") != FORMAT:
            raise DataError(f"{path}: not a reference log-prob file of --stage dpo_reference")
        mine = data_identity(docs)
        if saved["identity"] != mine:
            raise DataError(f"{path} was scored on {_describe(saved['identity'])}, but {docs.prefix!r} holds "
                            f"{_describe(mine)}: re-run --stage dpo_reference on this data")
        return cls(path, saved["pair_offsets"], saved["logps"])

    def lookup(self, micro_batch: dict) -> torch.Tensor:
        """[pairs, 2] (chosen, rejected) of a micro-batch's documents, in segment order."""
        out = [self.logps[:0]]  # (a dynamic context parallel row may hold none)
        for doc, segments in document_units(micro_batch):
            first, last = int(self.pair_offsets[doc]), int(self.pair_offsets[doc + 1])
            if last - first != segments // 2:
                raise DataError(f"{self.path}: pack {doc} has {segments // 2} pairs but the file "
                                f"{last - first}: it belongs to other data")
            out.append(self.logps[first:last])
        return torch.cat(out)


class ReferenceScoringStage:
    """``--stage dpo_reference``: one forward pass of ``--load`` over every pack, written beside the data."""

    name = "dpo_reference"
    metric_names: tuple = ()
    normaliser = "none (forward only)"

    def __init__(self, args):
        self.args = args

    def batch_source(self, args):
        from mindspeed_pack.datasets.packed_dataset import PackedBatchSource

        return PackedBatchSource()

    def setup(self, trainer) -> None:
        pass

    def run(self, args):
        """The trainer's setup (model, ``--load``, data), then :meth:`score` in eval mode (forward only)."""
        from mindspeed_pack.training.trainer import Trainer

        self.check(args)
        if not args.finetune:  # a forward-only pass reads the weights alone: no optimizer state, no schedule check
            log.info("--stage %s reads the weights of --load%s only (as --finetune)", self.name,
                     " and --lora-load" if args.lora_load else "")
            args.finetune = True
        trainer = Trainer(args, self.batch_source(args), self, saves=False)  # (a --save out of habit: left alone)
        trainer.setup()
        try:
            for chunk in trainer.model:
                chunk.eval()
            self.score(trainer)
        finally:
            trainer.cleanup()
        return trainer

    def check(self, args) -> None:
        if not args.load:
            raise DataError(f"--stage {self.name} scores a model: pass it with --load")

    def score(self, trainer) -> None:
        for docs in trainer.source.docs:
            self.score_prefix(trainer, docs)

    def score_prefix(self, trainer, docs) -> str:
        from mindspeed_pack.training.batches import to_packed_batch

        args = self.args
        identity = data_identity(docs)
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        mbs, n = args.micro_batch_size, len(docs)
        per_step = mbs * dp * args.num_micro_batches
        mine = {}  # pack -> [pairs, 2]
        for start in range(0, n, per_step):
            order = [(start + i) % n for i in range(per_step)]  # the last step wraps round (duplicates dropped)
            batches, raw = [], []
            for m in range(args.num_micro_batches):
                first = (m * dp + dp_rank) * mbs
                chosen_docs = order[first:first + mbs]
                mb = micro_batch([docs.get(d) for d in chosen_docs], args, isolate=True)
                mb["documents"] = chosen_docs
                raw.append(mb)
                batches.append(to_packed_batch(mb, args))
            tokens = args.seq_length * mbs
            if args.context_parallel_size > 1:
                multiple = cp_view.padding_multiple(args.context_parallel_size, args.tensor_model_parallel_size,
                                                    args.sequence_parallel)
                batches, tokens = cp_view.step_views(batches, args.context_parallel_size,
                                                     ps.get_context_parallel_rank(), multiple,
                                                     same_length=ps.get_pipeline_model_parallel_world_size() > 1)

            for batch, mb, seq in zip(batches, raw, score_sequences(trainer.model, batches, tokens)):
                if seq is None:
                    continue
                chosen, rejected = pair_segments(batch)
                pairs = torch.stack([seq[chosen], seq[rejected]], dim=1).cpu()
                for doc, seg in zip(mb["documents"], mb["segment_ids"]):
                    k = int(seg.max()) // 2
                    mine[doc], pairs = pairs[:k], pairs[k:]
        path = docs.prefix + SUFFIX
        writer = (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
                  and ps.get_context_parallel_rank() == 0)
        if writer:
            gathered = [None] * dp
            dist.all_gather_object(gathered, mine, group=ps.get_data_parallel_group())
            if dp_rank == 0:
                table = {}
                for part in gathered:
                    table.update(part)
                counts = np.array([len(table[d]) for d in range(n)], dtype=np.int64)
                offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(counts)]))
                logps = torch.cat([table[d] for d in range(n)]).double()
                tmp = stale_files.temporary_for(path, "dpo_reference")
                torch.save({"format": FORMAT, "identity": identity, "reference": str(args.load),
                            "pair_offsets": offsets, "logps": logps}, tmp)
                os.replace(tmp, path)
                # a pack's segments 2k-1, 2k: a preference pair, or a KTO sample and its KL partner
                units = "KTO couples" if ((docs.meta or {}).get("layout") or {}).get("kto_labels") else "pairs"
                log.info("dpo_reference: %d %s of %d packs scored by %s -> %s (%s)", len(logps), units, n, args.load,
                         path, _describe(identity))
                print(f" reference log-probs of {len(logps)} {units} written to {path} ({_describe(identity)})",
                      flush=True)
        dist.barrier()
        return path

"""Kahneman-Tversky optimisation on packed KTO couples (``posttrain.py --stage kto``), as TRL's ``KTOTrainer``.

A pack holds whole couples (``mindspeed_pack/data/kto.py``): segment ``2k-1`` is a sample (prompt and its
completion, desirable or not: ``P_packed_kto_labels``), ``2k`` its KL partner (the same prompt with another
sample's completion). Written without ``--pack``, each couple is its own document: one a row under scheduler
``none``, packed whole into rows under ``dp_balanced``, whole on one CP group each under ``default_dynamic_cp``.
From the per-sequence log-prob sums of the policy (:func:`~mindspeed_pack.training.stages.sequences.sequence_logps`)
and of the reference::

    r_i  = logp(sample i) - ref(sample i)                        the implied reward, / beta
    KL   = max(0, mean over the global batch's partners j of (logp(partner j) - ref(partner j)))    detached
    loss = w_D (1 - sigmoid(beta (r_i - KL)))    desirable i      (w_D = --kto-desirable-weight)
           w_U (1 - sigmoid(beta (KL - r_i)))    undesirable i    (w_U = --kto-undesirable-weight)

The step's loss is the mean over the global batch's samples: each micro-batch returns (sum, samples) and
megatron divides by the total, whatever the packing or the DP/PP/CP layout (under CP the sums are
all-reduced over the micro-batch's CP group first and the samples counted once, on its first rank). The KL
reference point is the *whole global batch's*: it is known before any micro-batch's loss, from a forward-only
pass of the policy over the step's micro-batches at :meth:`KTOStage.prepare` (the partners' log-probs, summed
over the micro-batches and the data x context parallel ranks, each micro-batch counted on its CP group's first
rank), so
a KTO step runs the policy forward twice and the reference once (TRL runs the KL batch through the policy
with gradients and detaches it; the values are the same). The reference is DPO's
(:class:`~mindspeed_pack.training.stages.reference.Reference`: ``--ref-load``, the starting policy, the
adapters switched off under LoRA, or ``--ref-logps`` scored by ``--stage dpo_reference``, which scores the
couples of KTO packs as it scores pairs).

Logged as TRL logs them: ``kl``, ``rewards/chosen``/``rewards/rejected`` = beta x (policy - reference)
log-prob sums of the desirable/undesirable samples, ``logps/chosen``/``logps/rejected`` the policy's sums
(each a mean over the samples of its kind; NaN in a step without one).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from mindspeed_pack.datasets.packed_dataset import DataError
from mindspeed_pack.packing.segments import PackedBatch
from mindspeed_pack.training.stages import data_layouts, reference
from mindspeed_pack.training.stages.sequences import counts_here, document_units, pair_segments, sequence_logps

KTO_METRICS = ("kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")
DESIRABLE, UNDESIRABLE, PARTNER = 1, 0, -1  # a segment's label in P_packed_kto_labels


def kto_losses(logratios: torch.Tensor, kl: torch.Tensor, desirable: torch.Tensor, beta: float,
               desirable_weight: float, undesirable_weight: float) -> torch.Tensor:
    """Per-sample KTO loss from ``logratios`` (policy - reference log-prob sums) and the KL reference point."""
    return torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (logratios - kl))),
                       undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratios))))


class KTOLabels:
    """The KTO labels of one data prefix's packs (``P_packed_kto_labels``: one label per segment)."""

    def __init__(self, docs):
        self.path = ((docs.meta or {}).get("layout") or {}).get("kto_labels")
        self.labels = docs.recorded("kto_labels", "the packs' KTO labels")
        if self.labels is None:
            raise DataError(f"--stage kto: {docs.prefix!r} holds no KTO couples (its sidecar names no KTO labels): "
                            "preprocess with --handler-name AlpacaStyleKTOHandler or SharegptStyleKTOHandler "
                            "(--pack --neat-pack: packs of whole couples; without --pack: each couple its own "
                            "document)")
        if len(self.labels) != len(docs):
            raise DataError(f"{self.path}: {len(self.labels)} documents for {len(docs)} packs of {docs.prefix!r}: it "
                            "belongs to other data; re-run preprocess_data.py")

    def lookup(self, micro_batch: dict) -> torch.Tensor:
        """[samples] bool (desirable) of a micro-batch's documents, in segment order (as :func:`pair_segments`)."""
        out = [torch.zeros(0, dtype=torch.bool)]  # (a dynamic context parallel row may hold none)
        for doc, segments in document_units(micro_batch):
            labels = np.asarray(self.labels[doc])
            if len(labels) != segments or (labels[1::2] != PARTNER).any() or \
                    not np.isin(labels[0::2], (DESIRABLE, UNDESIRABLE)).all():
                raise DataError(f"{self.path}: pack {doc} has {segments} segments but labels {labels.tolist()} "
                                "(one per segment: 1 or 0 for a sample, -1 for its KL partner): it belongs to other "
                                "data; re-run preprocess_data.py")
            out.append(torch.from_numpy(labels[0::2] == DESIRABLE))
        return torch.cat(out)


class KTOStage:
    name = "kto"
    metric_names = KTO_METRICS
    normaliser = "KTO samples in the global batch"

    def __init__(self, args):
        if args.ref_load and args.ref_logps:
            raise DataError("--ref-load and --ref-logps both given: the reference is either a model run in this job "
                            "or log-probs precomputed by --stage dpo_reference, not both")
        if not args.kto_beta > 0:
            raise DataError(f"--kto-beta {args.kto_beta}: the reward's temperature must be positive")
        for flag, weight in (("--kto-desirable-weight", args.kto_desirable_weight),
                             ("--kto-undesirable-weight", args.kto_undesirable_weight)):
            if not weight >= 0:
                raise DataError(f"{flag} {weight}: a loss weight must be >= 0")
        self.args = args
        self.reference = None  # reference.Reference
        self.labels = None  # {prefix: KTOLabels}

    def batch_source(self, args):
        from mindspeed_pack.datasets.online_packing import batch_source

        return batch_source(args)  # whole units: one a document (packed at load time) or packs of them

    # ---------------------------------------------------------------- setup
    def setup(self, trainer) -> None:
        for docs in trainer.source.docs:
            data_layouts.check(self.name, docs.prefix, docs.meta)
        self.labels = {docs.prefix: KTOLabels(docs) for docs in trainer.source.docs}
        self.reference = reference.Reference.of_run(trainer, self.args, self.name)

    # ---------------------------------------------------------------- per step
    def prepare(self, trainer, batches, micro_batches, split, tokens_per_micro_batch):
        """Labels and reference log-probs of every micro-batch, and the global batch's KL reference point."""
        prefix = trainer.source.splits[split].docs.prefix
        for batch, mb in zip(batches, micro_batches):
            batch.desirable = self.labels[prefix].lookup(mb).to(batch.loss_mask.device)
        for batch, ref in zip(batches, self.reference.pair_logps(batches, micro_batches, prefix,
                                                                  tokens_per_micro_batch)):
            if ref is not None:
                batch.ref_logps = ref
        policy = reference.score_sequences(trainer.model, batches, tokens_per_micro_batch)  # this step's weights
        if not ps.is_pipeline_last_stage():
            return batches
        total = torch.zeros(2, dtype=torch.float64, device=batches[0].loss_mask.device)  # [sum, partners]
        for batch, seq in zip(batches, policy):
            _, partner = pair_segments(batch)
            difference = (seq[partner] - batch.ref_logps[:, 1].to(seq.dtype)).sum()
            # every rank of the micro-batch's CP group holds its whole-sequence sums: counted on the first
            once = float(counts_here(batch))
            total += torch.stack([difference, difference.new_tensor(float(len(partner)))]) * once
        dist.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
        kl = (total[0] / total[1].clamp(min=1)).clamp(min=0)
        for batch in batches:
            batch.kl = kl
        return batches

    def count(self, batch: PackedBatch) -> torch.Tensor:
        """The samples of ``batch``, counted once, on its CP group's first rank (every rank of the group holds the
        same samples' loss)."""
        once = counts_here(batch)
        return torch.full((), len(pair_segments(batch)[0]) if once else 0, dtype=torch.int,
                          device=batch.loss_mask.device)

    def loss_func(self, batch: PackedBatch, output_tensor: torch.Tensor):
        args = self.args
        logps, _ = sequence_logps(batch, output_tensor)
        sample, _ = pair_segments(batch)
        policy = logps[sample]
        logratios = policy - batch.ref_logps[:, 0].to(policy.dtype)
        kl = batch.kl.to(policy.dtype)
        desirable = batch.desirable
        losses = kto_losses(logratios, kl, desirable, args.kto_beta, args.kto_desirable_weight,
                            args.kto_undesirable_weight)
        n = self.count(batch)
        once = float(counts_here(batch))  # reported once, on the CP group's first rank
        with torch.no_grad():
            rewards = args.kto_beta * logratios
            chosen, rejected = desirable.to(policy.dtype) * once, (~desirable).to(policy.dtype) * once
            reports = {
                "lm loss": torch.stack([losses.sum() * once, n.to(policy.dtype)]),
                "kl": torch.stack([kl * n, n.to(policy.dtype)]),
                "rewards/chosen": torch.stack([(rewards * chosen).sum(), chosen.sum()]),
                "rewards/rejected": torch.stack([(rewards * rejected).sum(), rejected.sum()]),
                "logps/chosen": torch.stack([(policy * chosen).sum(), chosen.sum()]),
                "logps/rejected": torch.stack([(policy * rejected).sum(), rejected.sum()]),
            }
        return losses.sum(), n, reports

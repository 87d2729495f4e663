"""Direct preference optimisation on packed pairs (``posttrain.py --stage dpo``).

Per pair (:mod:`.pairs`: the pair layout, the margin losses, the normalisation by the global
batch's pairs), from the per-sequence log-prob sums of the policy and of the reference::

    z = (logp_c - logp_r) - (ref_c - ref_r)        (ipo: per-token means, as TRL's IPO)
    loss = margin loss of z (--dpo-loss-type, --dpo-label-smoothing) + --pref-ftx SFT term

Logged as TRL logs them: ``rewards/*`` = beta x (policy - reference) log-prob *sums*, ``logps/*``
the policy's sums; under ipo both of the per-token means (TRL divides the log-probs by the trained tokens
for ipo before its loss and its reports, so its accuracies and margins are those of the means).

The reference: a frozen copy run in the same job (``--ref-load DIR``: a Megatron checkpoint or a
Hugging Face directory, loaded and checked as ``--load``; default the starting policy, read again
from ``--load`` when the run resumed from its own ``--save``), through
the same pipeline, or log-probs precomputed once (``--ref-logps``, :mod:`.reference`) and looked
up by (pack, pair). With LoRA the default reference is the frozen base itself: the policy's own
module run with its adapters switched off (no second model).
"""
from __future__ import annotations

import logging

import torch

from mindspeed_pack.datasets.packed_dataset import DataError
from mindspeed_pack.training.stages import reference
from mindspeed_pack.training.stages.pairs import PairStage, PairTerms, check_label_smoothing, margin_losses

log = logging.getLogger(__name__)


def preference_losses(chosen, rejected, ref_chosen, ref_rejected, beta: float, loss_type: str,
                      label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-pair loss of DPO (sigmoid), IPO or the hinge loss from the four log-probs."""
    check_label_smoothing(label_smoothing, loss_type)
    return margin_losses((chosen - rejected) - (ref_chosen - ref_rejected), beta, loss_type, label_smoothing)


class DPOStage(PairStage):
    name = "dpo"

    def __init__(self, args):
        super().__init__(args)
        if args.ref_load and args.ref_logps:
            raise DataError("--ref-load and --ref-logps both given: the reference is either a model run in this job "
                            "or log-probs precomputed by --stage dpo_reference, not both")
        check_label_smoothing(args.dpo_label_smoothing, args.dpo_loss_type)
        self.reference = None  # reference.Reference: where the reference log-probs come from

    # ---------------------------------------------------------------- setup
    def setup(self, trainer) -> None:
        super().setup(trainer)
        self.reference = reference.Reference.of_run(trainer, self.args, self.name)

    # ---------------------------------------------------------------- per step
    def prepare(self, trainer, batches, micro_batches, split, tokens_per_micro_batch):
        prefix = trainer.source.splits[split].docs.prefix
        for batch, ref in zip(batches, self.reference.pair_logps(batches, micro_batches, prefix,
                                                                  tokens_per_micro_batch)):
            if ref is not None:
                batch.ref_logps = ref
        return batches

    def pair_terms(self, batch, logps, counts, chosen, rejected) -> PairTerms:
        args = self.args
        pc, pr = logps[chosen], logps[rejected]
        ref = batch.ref_logps.to(pc.dtype)
        rc, rr = ref[:, 0], ref[:, 1]
        sft = self.sft_term(logps, counts, chosen)  # per-token mean NLL whatever the loss
        # IPO compares per-token means, and TRL (as LLaMA-Factory) divides the log-probs by the trained tokens
        # before anything else: its loss, rewards and logps/* are all of the means
        if args.dpo_loss_type == "ipo":
            nc, nr = counts[chosen].clamp(min=1), counts[rejected].clamp(min=1)
            pc, pr, rc, rr = pc / nc, pr / nr, rc / nc, rr / nr
        losses = preference_losses(pc, pr, rc, rr, args.dpo_beta, args.dpo_loss_type, args.dpo_label_smoothing)
        # TRL's rewards: beta x (policy - reference) log-probs (sums; ipo: per-token means)
        return PairTerms(losses + sft, (args.dpo_beta * (pc - rc)).detach(), (args.dpo_beta * (pr - rr)).detach(),
                         pc.detach(), pr.detach())

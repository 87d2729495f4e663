"""Direct preference optimisation on packed pairs (``posttrain.py --stage dpo``).

A pack holds whole pairs (``mindspeed_pack/data/pairwise.py``): segments ``2k-1`` (chosen)
and ``2k`` (rejected). Per pair, from the per-sequence log-prob sums of the policy
(:func:`~mindspeed_pack.training.stages.sequences.sequence_logps`) and of the reference::

    z = (logp_c - logp_r) - (ref_c - ref_r)
    sigmoid  -(1 - s) log sigmoid(beta z) - s log sigmoid(-beta z)      (s = --dpo-label-smoothing)
    hinge    relu(1 - beta z)                                            (no smoothed form: s refused)
    ipo      (z - 1 / (2 beta))^2          (log-probs as per-token means, as TRL's IPO; s refused)
    + ftx x (chosen answer's per-token mean NLL)                          (--dpo-ftx)

Logged as TRL logs them, whatever the loss: ``rewards/*`` = beta x (policy - reference)
log-prob *sums*, ``logps/*`` the policy's sums.

The step's loss is the sum over the global batch's pairs divided by their number: each
micro-batch returns (sum, pairs) and megatron divides by the total, whatever the packing or
the DP/PP/CP layout (under CP the sums are all-reduced first and the pairs counted once).

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
import torch.nn.functional as F
from megatron.core import parallel_state as ps

from mindspeed_pack.datasets.packed_dataset import DataError
from mindspeed_pack.packing.segments import PackedBatch
from mindspeed_pack.training.stages import reference
from mindspeed_pack.training.stages.sequences import pair_segments, sequence_logps

log = logging.getLogger(__name__)

DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
               "logps/chosen", "logps/rejected")


def check_label_smoothing(label_smoothing: float, loss_type: str) -> None:
    """``--dpo-label-smoothing`` is conservative DPO's flip probability: defined for the sigmoid loss only
    (as in TRL, whose hinge and IPO losses have no smoothed form), below 1/2."""
    if not label_smoothing:
        return
    if loss_type != "sigmoid":
        raise DataError(f"--dpo-label-smoothing {label_smoothing} with --dpo-loss-type {loss_type}: label smoothing "
                        "(conservative DPO) is defined for the sigmoid loss only; drop it, or use --dpo-loss-type "
                        "sigmoid")
    if not 0 < label_smoothing < 0.5:
        raise DataError(f"--dpo-label-smoothing {label_smoothing}: the probability that a pair's preference is "
                        "flipped must be in [0, 0.5)")


def preference_losses(chosen, rejected, ref_chosen, ref_rejected, beta: float, loss_type: str,
                      label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-pair loss of DPO (sigmoid), IPO or the hinge loss from the four log-probs."""
    check_label_smoothing(label_smoothing, loss_type)
    z = (chosen - rejected) - (ref_chosen - ref_rejected)
    if loss_type == "sigmoid":
        return -(1 - label_smoothing) * F.logsigmoid(beta * z) - label_smoothing * F.logsigmoid(-beta * z)
    if loss_type == "hinge":
        return torch.relu(1 - beta * z)
    if loss_type == "ipo":
        return (z - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown --dpo-loss-type {loss_type!r}")


class DPOStage:
    name = "dpo"
    metric_names = DPO_METRICS
    normaliser = "preference pairs in the global batch"

    def __init__(self, args):
        if args.ref_load and args.ref_logps:
            raise DataError("--ref-load and --ref-logps both given: the reference is either a model run in this job "
                            "or log-probs precomputed by --stage dpo_reference, not both")
        check_label_smoothing(args.dpo_label_smoothing, args.dpo_loss_type)
        self.args = args
        self.reference = None  # reference.Reference: where the reference log-probs come from

    def batch_source(self, args):
        if args.sequence_packing_scheduler != "none":
            raise DataError("--stage dpo reads offline packs of whole pairs: drop --sequence-packing-scheduler")
        from mindspeed_pack.datasets.packed_dataset import PackedBatchSource

        return PackedBatchSource()

    # ---------------------------------------------------------------- setup
    def setup(self, trainer) -> None:
        args = self.args
        for docs in trainer.source.docs:
            if not ((docs.meta or {}).get("layout") or {}).get("pairs"):
                raise DataError(f"--stage dpo: {docs.prefix!r} holds no preference pairs (its sidecar records no "
                                "pairing): preprocess with --handler-name AlpacaStylePairwiseHandler or "
                                "SharegptStylePairwiseHandler --pack --neat-pack")
        self.reference = reference.Reference.of_run(trainer, args, self.name)

    # ---------------------------------------------------------------- per step
    def prepare(self, trainer, batches, micro_batches, split, tokens_per_micro_batch):
        prefix = trainer.source.splits[split].docs.prefix
        for batch, ref in zip(batches, self.reference.pair_logps(batches, micro_batches, prefix,
                                                                  tokens_per_micro_batch)):
            if ref is not None:
                batch.ref_logps = ref
        return batches

    def count(self, batch: PackedBatch) -> torch.Tensor:
        """The pairs of ``batch``: every CP rank holds the same pairs' loss (its backward carries
        that rank's share of the gradient); they are counted once, on CP rank 0."""
        once = ps.get_context_parallel_rank() == 0
        return torch.full((), len(pair_segments(batch)[0]) if once else 0, dtype=torch.int,
                          device=batch.loss_mask.device)  # a fill on the device: no copy from the host

    def loss_func(self, batch: PackedBatch, output_tensor: torch.Tensor):
        args = self.args
        logps, counts = sequence_logps(batch, output_tensor)
        chosen, rejected = pair_segments(batch)
        pc, pr = logps[chosen], logps[rejected]
        ref = batch.ref_logps.to(pc.dtype)
        rc, rr = ref[:, 0], ref[:, 1]
        # IPO compares per-token means (in its loss only: the logged rewards stay sums)
        ipo = args.dpo_loss_type == "ipo"
        nc, nr = (counts[chosen].clamp(min=1), counts[rejected].clamp(min=1)) if ipo else (1.0, 1.0)
        losses = preference_losses(pc / nc, pr / nr, rc / nc, rr / nr, args.dpo_beta, args.dpo_loss_type,
                                   args.dpo_label_smoothing)
        if args.dpo_ftx:
            losses = losses + args.dpo_ftx * (-logps[chosen] / counts[chosen].clamp(min=1))
        loss = losses.sum()
        n = self.count(batch)
        once = float(ps.get_context_parallel_rank() == 0)  # reported once, on CP rank 0
        nf = n.to(torch.float32)
        with torch.no_grad():
            # TRL's rewards whatever the loss: beta x (policy - reference) log-prob sums
            reward_c, reward_r = args.dpo_beta * (pc - rc), args.dpo_beta * (pr - rr)
            reports = {name: torch.stack([value.sum() * once, nf]) for name, value in (
                ("lm loss", losses), ("rewards/chosen", reward_c), ("rewards/rejected", reward_r),
                ("rewards/accuracies", (reward_c > reward_r).float()), ("rewards/margins", reward_c - reward_r),
                ("logps/chosen", logps[chosen]), ("logps/rejected", logps[rejected]))}
        return loss, n, reports

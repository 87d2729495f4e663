"""What every stage on packed preference pairs shares: ``--stage dpo``, ``simpo``, ``orpo``.

A pack holds whole pairs (``mindspeed_pack/data/pairwise.py``): segments ``2k-1`` (chosen) and
``2k`` (rejected), never split across packs, micro-batches or ranks; so does a row of pairs written one
a document (``preprocess_data.py`` without ``--pack``), one pair a row under scheduler ``none``, whole pairs
packed into rows under ``dp_balanced`` or on one CP group each under ``default_dynamic_cp``. A pair stage reads the
per-sequence log-prob sums and trained-token counts of the policy
(:func:`~mindspeed_pack.training.stages.sequences.sequence_logps`, summed over the micro-batch's CP group) and
returns one loss per pair (:meth:`PairStage.pair_terms`); the step's loss is the sum over the
global batch's pairs divided by their number: each micro-batch returns (sum, pairs) and megatron
divides by the total, whatever the packing or the DP/PP/CP layout (under CP the sums are
all-reduced first and the pairs counted once, on the group's first rank).

The losses of a pair's margin ``z`` that DPO and SimPO share (``s`` the label smoothing)::

    sigmoid  -(1 - s) log sigmoid(beta z) - s log sigmoid(-beta z)
    hinge    relu(1 - beta z)                        (no smoothed form: s refused)
    ipo      (z - 1 / (2 beta))^2                     (s refused)

``--pref-ftx`` (MindSpeed-LLM's name; ``--dpo-ftx`` is the same flag) adds, for DPO and SimPO,
``ftx x`` the chosen answer's per-token mean NLL to each pair's loss (LLaMA-Factory's and
MindSpeed-LLM's SFT term). ORPO has its own NLL term and refuses it.
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from mindspeed_pack.datasets.packed_dataset import DataError
from mindspeed_pack.packing.segments import PackedBatch
from mindspeed_pack.training.stages import data_layouts
from mindspeed_pack.training.stages.sequences import counts_here, pair_segments, sequence_logps

PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected")
LOSS_TYPES = ("sigmoid", "hinge", "ipo")


def check_label_smoothing(label_smoothing: float, loss_type: str, prefix: str = "dpo") -> None:
    """``--{prefix}-label-smoothing`` is conservative DPO's flip probability: defined for the sigmoid loss only
    (as in TRL, whose hinge and IPO losses have no smoothed form), below 1/2."""
    if not label_smoothing:
        return
    flag = f"--{prefix}-label-smoothing {label_smoothing}"
    if loss_type != "sigmoid":
        raise DataError(f"{flag} with --{prefix}-loss-type {loss_type}: label smoothing (conservative DPO) is defined "
                        f"for the sigmoid loss only; drop it, or use --{prefix}-loss-type sigmoid")
    if not 0 < label_smoothing < 0.5:
        raise DataError(f"{flag}: the probability that a pair's preference is flipped must be in [0, 0.5)")


def margin_losses(z: torch.Tensor, beta: float, loss_type: str, label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-pair loss of the margin ``z`` (DPO: policy minus reference log-ratio; SimPO: mean log-prob
    difference minus gamma / beta)."""
    if loss_type == "sigmoid":
        return -(1 - label_smoothing) * F.logsigmoid(beta * z) - label_smoothing * F.logsigmoid(-beta * z)
    if loss_type == "hinge":
        return torch.relu(1 - beta * z)
    if loss_type == "ipo":
        return (z - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown loss type {loss_type!r} (one of {', '.join(LOSS_TYPES)})")


def refuse_reference(args, stage: str) -> None:
    """A reference-free stage given a reference: stop rather than ignore it."""
    for flag, given in (("--ref-load", args.ref_load), ("--ref-logps", args.ref_logps)):
        if given:
            raise DataError(f"--stage {stage} is reference-free (no reference model is built, loaded or read): "
                            f"drop {flag}, or train with --stage dpo")


class PairTerms(NamedTuple):
    """One value per pair: its loss and what is logged (TRL's names); a stage's other reports as means
    over the pairs (``pair_means``: per-pair values) or over something else (``other_means``: [sum, count])."""

    losses: torch.Tensor
    reward_chosen: torch.Tensor
    reward_rejected: torch.Tensor
    logps_chosen: torch.Tensor
    logps_rejected: torch.Tensor
    pair_means: Optional[Dict[str, torch.Tensor]] = None
    other_means: Optional[Dict[str, Tuple[torch.Tensor, torch.Tensor]]] = None


class PairStage:
    """A stage of packed preference pairs. A subclass names itself (``name``) and supplies
    ``pair_terms(batch, logps, counts, chosen, rejected) -> PairTerms`` from the per-sequence log-prob sums
    and trained-token counts (whole over CP) and the pairs' segment indices."""

    name = "pairs"
    metric_names = PAIR_METRICS
    normaliser = "preference pairs in the global batch"

    def __init__(self, args):
        self.args = args

    def batch_source(self, args):
        from mindspeed_pack.datasets.online_packing import batch_source

        return batch_source(args)  # whole units: one a document (packed at load time) or packs of them

    def setup(self, trainer) -> None:
        for docs in trainer.source.docs:
            data_layouts.check(self.name, docs.prefix, docs.meta)

    def prepare(self, trainer, batches, micro_batches, split, tokens_per_micro_batch):
        return batches

    def count(self, batch: PackedBatch) -> torch.Tensor:
        """The pairs of ``batch``: every rank of its CP group holds the same pairs' loss (its backward carries
        that rank's share of the gradient); they are counted once, on the group's first rank."""
        once = counts_here(batch)
        return torch.full((), len(pair_segments(batch)[0]) if once else 0, dtype=torch.int,
                          device=batch.loss_mask.device)  # a fill on the device: no copy from the host

    def sft_term(self, logps: torch.Tensor, counts: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """``--pref-ftx`` x the chosen answer's per-token mean NLL, per pair (0 when not asked for)."""
        ftx = self.args.pref_ftx
        return ftx * (-logps[chosen] / counts[chosen].clamp(min=1)) if ftx else torch.zeros_like(logps[chosen])

    def loss_func(self, batch: PackedBatch, output_tensor: torch.Tensor):
        logps, counts = sequence_logps(batch, output_tensor)
        chosen, rejected = pair_segments(batch)
        terms = self.pair_terms(batch, logps, counts, chosen, rejected)
        n = self.count(batch)
        once = float(counts_here(batch))  # reported once, on the CP group's first rank
        nf = n.to(torch.float32)
        with torch.no_grad():
            rc, rr = terms.reward_chosen, terms.reward_rejected
            per_pair = {"lm loss": terms.losses, "rewards/chosen": rc, "rewards/rejected": rr,
                        "rewards/accuracies": (rc > rr).float(), "rewards/margins": rc - rr,
                        "logps/chosen": terms.logps_chosen, "logps/rejected": terms.logps_rejected,
                        **(terms.pair_means or {})}
            reports = {name: torch.stack([value.sum() * once, nf]) for name, value in per_pair.items()}
            for name, (total, count) in (terms.other_means or {}).items():
                reports[name] = torch.stack([total.float() * once, count.float() * once])
        return terms.losses.sum(), n, reports

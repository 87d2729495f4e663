"""Odds-ratio preference optimisation on packed pairs (``posttrain.py --stage orpo``): no reference model.

ORPO adds to the NLL of the chosen answers a term that raises the odds of the chosen answer against the
rejected one, the odds taken from each answer's mean log-prob over its trained tokens (``l_c``, ``l_r``),
as TRL's ORPOTrainer defines it::

    log_odds = (l_c - l_r) - (log(1 - exp(l_c)) - log(1 - exp(l_r)))
    loss     = NLL(chosen answers) - beta x mean over pairs of log sigmoid(log_odds)      (beta = --orpo-beta)

The NLL is TRL's: a per-token mean over all chosen answers of the global step (not a mean of per-answer
means). The step divides by its pairs (:mod:`.pairs`), so each pair's NLL sum enters with the weight
pairs / chosen tokens of the whole step, both counted in :meth:`ORPOStage.prepare` over DP x CP: the
loss is the same whatever the packing, micro-batches or layout. ``log(1 - exp(l))`` is computed as
``log(-expm1(l))`` (the same value, accurate near 0) with ``l`` kept below -1e-6: an answer whose every
token is certain in fp32 would otherwise give an infinite log-odds and a NaN gradient.

Logged as TRL logs them: ``rewards/*`` = beta x the mean log-probs, ``logps/*`` the mean log-probs,
``nll_loss``, ``log_odds_ratio`` (the mean log sigmoid(log_odds)) and ``log_odds_chosen`` (the mean log_odds).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from mindspeed_pack.datasets.packed_dataset import DataError
from mindspeed_pack.packing.segments import sequence_sums
from mindspeed_pack.training.reductions import step_totals
from mindspeed_pack.training.stages.pairs import PAIR_METRICS, PairStage, PairTerms, refuse_reference
from mindspeed_pack.training.stages.sequences import counts_here

log = logging.getLogger(__name__)

ORPO_METRICS = (*PAIR_METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen")


def log_odds_ratio(mean_chosen: torch.Tensor, mean_rejected: torch.Tensor) -> torch.Tensor:
    """log(odds(chosen) / odds(rejected)), odds(y) = p / (1 - p) with p = exp(the answer's mean log-prob)."""
    def log1m_exp(x):
        return torch.log(-torch.expm1(x.clamp(max=-1e-6)))

    return (mean_chosen - mean_rejected) - (log1m_exp(mean_chosen) - log1m_exp(mean_rejected))


class ORPOStage(PairStage):
    name = "orpo"
    metric_names = ORPO_METRICS

    def __init__(self, args):
        super().__init__(args)
        refuse_reference(args, self.name)
        if args.pref_ftx:
            raise DataError(f"--pref-ftx {args.pref_ftx} with --stage orpo: ORPO's loss holds its own NLL term on the "
                            "chosen answers (weight 1, as TRL's); drop --pref-ftx and weigh the odds-ratio term with "
                            "--orpo-beta")
        self.nll_weight = None  # pairs / chosen tokens of the current step (prepare)

    def setup(self, trainer) -> None:
        super().setup(trainer)
        log.info("orpo: reference-free (no reference model built or loaded): NLL of the chosen answers + %g x "
                 "odds-ratio term", self.args.orpo_beta)

    def prepare(self, trainer, batches, micro_batches, split, tokens_per_micro_batch):
        """The step's pairs and chosen-answer tokens over DP x CP (a collective on the device): the NLL
        term's weight. Pairs count on their CP group's first rank; tokens are each CP rank's share."""
        local = torch.zeros(2, dtype=torch.float32, device=batches[0].loss_mask.device)
        for batch in batches:
            once = float(counts_here(batch))
            labels = batch.segment_labels
            chosen = ((labels > 0) & (labels % 2 == 1)).float()  # segments 2k-1 (no index: no host sync)
            local += torch.stack([chosen.sum() * once, (sequence_sums(batch.loss_mask, batch) * chosen).sum()])
        pairs, tokens = step_totals(local)
        self.nll_weight = pairs / tokens.clamp(min=1)
        return batches

    def pair_terms(self, batch, logps, counts, chosen, rejected) -> PairTerms:
        beta = self.args.orpo_beta
        mean_c = logps[chosen] / counts[chosen].clamp(min=1)
        mean_r = logps[rejected] / counts[rejected].clamp(min=1)
        log_odds = log_odds_ratio(mean_c, mean_r)
        ratio = F.logsigmoid(log_odds)
        nll = -logps[chosen]  # each chosen answer's NLL sum
        losses = self.nll_weight.to(nll.dtype) * nll - beta * ratio
        return PairTerms(losses, (beta * mean_c).detach(), (beta * mean_r).detach(), mean_c.detach(), mean_r.detach(),
                         pair_means={"log_odds_ratio": ratio.detach(), "log_odds_chosen": log_odds.detach()},
                         other_means={"nll_loss": (nll.detach().sum(), counts[chosen].sum())})

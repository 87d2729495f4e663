"""Simple preference optimisation on packed pairs (``posttrain.py --stage simpo``): no reference model.

SimPO's reward is length-normalised and reference-free: beta x the answer's mean log-prob over its
trained tokens. Per pair, with ``a_c``, ``a_r`` the chosen and rejected answers' mean log-probs
(:mod:`.pairs`: the pair layout, the margin losses, the normalisation by the global batch's pairs)::

    z = (a_c - a_r) - gamma / beta              gamma = --gamma-beta-ratio x --simpo-beta
    sigmoid  -log sigmoid(beta (a_c - a_r) - gamma)   (smoothed by --simpo-label-smoothing)
    hinge    relu(1 - beta z),   ipo  (z - 1 / (2 beta))^2           (MindSpeed-LLM's forms)
    + --pref-ftx x (chosen answer's per-token mean NLL)

Logged as TRL's CPOTrainer logs ``loss_type="simpo"``: ``rewards/*`` = beta x the mean log-probs,
``logps/*`` the mean log-probs (per token, unlike DPO's sums).
"""
from __future__ import annotations

import logging

from mindspeed_pack.training.stages.pairs import (PairStage, PairTerms, check_label_smoothing, margin_losses,
                                                  refuse_reference)

log = logging.getLogger(__name__)


class SimPOStage(PairStage):
    name = "simpo"

    def __init__(self, args):
        super().__init__(args)
        refuse_reference(args, self.name)
        check_label_smoothing(args.simpo_label_smoothing, args.simpo_loss_type, "simpo")

    def setup(self, trainer) -> None:
        super().setup(trainer)
        args = self.args
        log.info("simpo: reference-free (no reference model built or loaded): beta %g, gamma %g (= %g x beta), "
                 "%s loss", args.simpo_beta, args.gamma_beta_ratio * args.simpo_beta, args.gamma_beta_ratio,
                 args.simpo_loss_type)

    def pair_terms(self, batch, logps, counts, chosen, rejected) -> PairTerms:
        args = self.args
        mean_c = logps[chosen] / counts[chosen].clamp(min=1)
        mean_r = logps[rejected] / counts[rejected].clamp(min=1)
        losses = margin_losses(mean_c - mean_r - args.gamma_beta_ratio, args.simpo_beta, args.simpo_loss_type,
                               args.simpo_label_smoothing)
        beta = args.simpo_beta
        return PairTerms(losses + self.sft_term(logps, counts, chosen), (beta * mean_c).detach(),
                         (beta * mean_r).detach(), mean_c.detach(), mean_r.detach())

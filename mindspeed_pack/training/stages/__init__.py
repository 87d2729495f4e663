"""Training stages: what differs between supervised fine-tuning, preference training, scoring.

The :class:`~mindspeed_pack.training.trainer.Trainer` is one loop for every stage. A stage
supplies only what differs (as Megatron-LM's ``pretrain(..., forward_step_func)``):

* ``batch_source(args)``: how rows and their per-token / per-sequence fields reach a rank;
* ``setup(trainer)``: what it needs besides the policy (a frozen reference model, a table);
* ``prepare(trainer, batches, micro_batches, split, tokens_per_micro_batch)``: per-step inputs
  attached to this rank's micro-batches (after the context-parallel split);
* ``loss_func(batch, output) -> (sum, count, reports)``: what ``forward_step`` returns. The
  trainer divides by the *global step's* total ``count`` (megatron-core's
  ``calculate_per_token_loss``), so ``normaliser`` (tokens, samples, pairs) never depends on
  packing or on the DP/PP/CP layout; every report is a ``[sum, count]`` pair reduced the same way;
* ``metric_names``: the reports logged besides ``lm loss`` (console, TensorBoard, JSONL).

Per-sequence quantities come from the packed batch's segment ids in one place:
:func:`mindspeed_pack.training.stages.sequences.sequence_logps`.
"""
from __future__ import annotations

import argparse

STAGES = ("sft", "dpo", "dpo_reference")


def stage_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Flags of the post-training stages (LLaMA-Factory / MindSpeed-LLM names)."""
    g = p.add_argument_group("preference training (--stage dpo)")
    g.add_argument("--dpo-beta", type=float, default=0.1, help="strength of the KL term (temperature of the reward)")
    g.add_argument("--dpo-loss-type", default="sigmoid", choices=["sigmoid", "ipo", "hinge"])
    g.add_argument("--dpo-label-smoothing", type=float, default=0.0,
                   help="conservative DPO: the probability that a pair's preference is flipped (sigmoid loss)")
    g.add_argument("--dpo-ftx", type=float, default=0.0,
                   help="weight of an SFT term on the chosen answer (its per-token mean NLL; LLaMA-Factory pref_ftx)")
    g.add_argument("--ref-load", default=None,
                   help="checkpoint of the frozen reference model, run in this job (default: a copy of the "
                        "starting policy)")
    g.add_argument("--ref-logps", action="store_true",
                   help="read the reference log-probs precomputed by --stage dpo_reference beside each data prefix "
                        "(P_dpo_reference.pt): no reference model in memory")
    return p


def get_stage(args):
    """The stage object ``--stage`` selects."""
    if args.stage == "dpo":
        from mindspeed_pack.training.stages.dpo import DPOStage

        return DPOStage(args)
    if args.stage == "dpo_reference":
        from mindspeed_pack.training.stages.reference import ReferenceScoringStage

        return ReferenceScoringStage(args)
    from mindspeed_pack.training.stages.sft import SFTStage

    return SFTStage(args)

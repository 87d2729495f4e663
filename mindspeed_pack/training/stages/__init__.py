"""Training stages: what differs between supervised fine-tuning, preference training, scoring.

The :class:`~mindspeed_pack.training.trainer.Trainer` is one loop for every stage. A stage
supplies only what differs (as Megatron-LM's ``pretrain(..., forward_step_func)``):

* ``batch_source(args)``: how rows and their per-token / per-sequence fields reach a rank;
* ``setup(trainer)``: what it needs besides the policy (a frozen reference model, a table);
* ``prepare(trainer, batches, micro_batches, split, tokens_per_micro_batch)``: per-step inputs
  attached to this rank's micro-batches (after the context-parallel split), on every rank (so it may
  sum a step's counts over DP x CP: ORPO's NLL is a per-token mean over the whole step);
* ``loss_func(batch, output) -> (sum, count, reports)``: what ``forward_step`` returns. The
  trainer divides by the *global step's* total ``count`` (megatron-core's
  ``calculate_per_token_loss``), so ``normaliser`` (tokens, samples, pairs) never depends on
  packing or on the DP/PP/CP layout; every report is a ``[sum, count]`` pair reduced the same way;
* ``count(batch)``: that ``count``, from the micro-batch alone (before the forward, on every
  pipeline stage): a mixture-of-experts step scales its load-balancing gradient to the step's
  total (:func:`mindspeed_pack.model.moe.scale_aux_loss`), so the balancing strength is the
  same whatever the stage divides by;
* ``metric_names``: the reports logged besides ``lm loss`` (console, TensorBoard, JSONL);
  optional ``max_metrics``: those reported as ``[max, 1]`` and reduced by MAX instead;
* optional ``loss_weights(batch)``: the stage's loss is ``sum_i w_i * loss_i`` with these fixed [b, s]
  token weights (SFT); ``loss_func`` then gets that sum, a scalar, from the model, which forms the fused
  loss's gradients in its forward (no recomputed logits). Stages whose per-token gradients depend on the
  forward's values (DPO, KTO, GRPO, ...) leave it out and get the per-token losses;
* optional ``needs_logits``: ``loss_func`` gets the vocab-parallel logits instead of the per-token
  loss (an entropy term needs the whole distribution).

Per-sequence quantities come from the packed batch's segment ids in one place:
:func:`mindspeed_pack.training.stages.sequences.sequence_logps`. The stages on preference pairs
(``dpo``, and ``simpo`` and ``orpo`` without a reference) share :mod:`.pairs`: the pair layout, the
margin losses, the count by pairs and TRL's reports.
"""
from __future__ import annotations

import argparse

STAGES = ("sft", "dpo", "simpo", "orpo", "dpo_reference", "score", "grpo", "kto", "orm", "prm")


def stage_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Flags of the post-training stages (LLaMA-Factory / MindSpeed-LLM names)."""
    g = p.add_argument_group("preference training (--stage dpo)")
    g.add_argument("--dpo-beta", type=float, default=0.1, help="strength of the KL term (temperature of the reward)")
    g.add_argument("--dpo-loss-type", default="sigmoid", choices=["sigmoid", "ipo", "hinge"])
    g.add_argument("--dpo-label-smoothing", type=float, default=0.0,
                   help="conservative DPO: the probability that a pair's preference is flipped, in [0, 0.5) "
                        "(sigmoid loss only: refused with ipo and hinge, which have no smoothed form)")
    g.add_argument("--pref-ftx", "--dpo-ftx", dest="pref_ftx", type=float, default=0.0,
                   help="--stage dpo and simpo: weight of an SFT term on the chosen answer (its per-token mean NLL, "
                        "per pair; MindSpeed-LLM's and LLaMA-Factory's pref_ftx; --dpo-ftx is the same flag). "
                        "Refused with --stage orpo, whose NLL term is its own")
    g.add_argument("--ref-load", "--ref-model", dest="ref_load", default=None,
                   help="the frozen reference model, run in this job: a Megatron checkpoint or a Hugging Face "
                        "directory (read as --load reads it; its model and tokenizer must be the run's). Default: a "
                        "copy of the starting policy. --ref-model (MindSpeed-LLM's name) is the same flag")
    g.add_argument("--refer-model-iter", type=int, default=None, metavar="N",
                   help="MindSpeed-LLM's: the reference is iteration N of its Megatron checkpoint (--ref-load, else "
                        "--load) instead of the iteration its tracker names, e.g. the starting weights when a run "
                        "resumes from the directory it started from")
    g.add_argument("--ref-logps", action="store_true",
                   help="read the reference log-probs precomputed by --stage dpo_reference beside each data prefix "
                        "(P_dpo_reference.pt): no reference model in memory")
    g = p.add_argument_group("reference-free preference training (--stage simpo, --stage orpo)")
    g.add_argument("--simpo-beta", type=float, default=2.5,
                   help="SimPO: scale of the reward, beta x the answer's mean log-prob")
    g.add_argument("--gamma-beta-ratio", type=float, default=1.4,
                   help="SimPO: the target reward margin gamma, as gamma / --simpo-beta")
    g.add_argument("--simpo-loss-type", default="sigmoid", choices=["sigmoid", "hinge", "ipo"])
    g.add_argument("--simpo-label-smoothing", type=float, default=0.0,
                   help="SimPO: the probability that a pair's preference is flipped, in [0, 0.5) (sigmoid loss only)")
    g.add_argument("--orpo-beta", type=float, default=0.1,
                   help="ORPO: weight of the odds-ratio term beside the chosen answers' NLL (TRL's beta, the paper's "
                        "lambda)")
    g = p.add_argument_group("KTO (--stage kto; its reference as dpo's: --ref-load, --ref-logps)")
    g.add_argument("--kto-beta", type=float, default=0.1, help="KTO's beta: the temperature of the implied reward")
    g.add_argument("--kto-desirable-weight", type=float, default=1.0, help="weight of a desirable sample's loss")
    g.add_argument("--kto-undesirable-weight", type=float, default=1.0,
                   help="weight of an undesirable sample's loss")
    g = p.add_argument_group("reward models (--stage orm, --stage prm)")
    g.add_argument("--center-rewards-coefficient", type=float, default=0.0,
                   help="--stage orm: weight of c x mean((r_chosen + r_rejected)^2), which keeps rewards centred at "
                        "0 (TRL's center_rewards_coefficient; 0: off)")
    g = p.add_argument_group("RL rollouts (--stage score, --stage grpo)")
    g.add_argument("--rollout-path", default=None,
                   help="rollout file or directory (.jsonl/.json/.parquet, one sample a row; see README)")
    g.add_argument("--rollout-overlong", default="refuse", choices=["refuse", "drop"],
                   help="a rollout longer than --max-seqlen-per-dp-cp-rank stops the run, or is dropped and counted "
                        "(never truncated)")
    g.add_argument("--advantage-estimator", default="grpo", choices=["grpo", "rloo"],
                   help="advantages of rows with a scalar reward and a group: group-normalised (grpo) or "
                        "leave-one-out (rloo)")
    g.add_argument("--score-output", default=None, help="--stage score: where the scored rollouts go (.jsonl/.parquet)")
    g.add_argument("--score-field", default="old_logprobs", choices=["old_logprobs", "ref_logprobs"],
                   help="--stage score: the field the per-token log-probs are written to")
    g.add_argument("--score-entropy", action="store_true",
                   help="--stage score: also write 'entropy', the policy's entropy at the position that predicts each "
                        "response token (needs the full logits)")
    g.add_argument("--clip-ratio", type=float, nargs="+", default=[0.2],
                   help="PPO clip range: eps (both sides) or eps_low eps_high")
    g.add_argument("--kl-coef", type=float, default=0.0, help="weight of the KL penalty against ref_logprobs")
    g.add_argument("--kl-estimator", default="k3", choices=["k1", "k3"],
                   help="per-token KL estimator: k1 = logp - ref, k3 = exp(ref - logp) - (ref - logp) - 1")
    g.add_argument("--entropy-coef", type=float, default=0.0,
                   help="weight of an entropy bonus (the policy's entropy at every trained position; needs the "
                        "full logits)")
    g.add_argument("--log-entropy", action="store_true",
                   help="--stage grpo: log the policy's entropy over the trained tokens without an entropy bonus "
                        "(needs the full logits; --entropy-coef logs it too)")
    g.add_argument("--loss-agg", default="token-mean", type=_loss_agg,
                   choices=["token-mean", "seq-mean-token-mean", "dr-grpo"],
                   help="how per-token losses become the step's loss, normalised over the whole global step: by "
                        "trained tokens, by samples of each one's token mean, or dr-grpo (TRL's dr_grpo: by samples "
                        "of each one's token sum / --seq-length)")
    return p


def _loss_agg(value: str) -> str:
    if value == "seq-mean-token-sum-norm":  # verl's name, another normalisation: refused, never reinterpreted
        raise argparse.ArgumentTypeError(
            "seq-mean-token-sum-norm is verl's name for the token sums of all samples divided by a constant (not by "
            "the number of samples); this project's constant-length mode is dr-grpo (TRL's dr_grpo: each sample's "
            "token sum / --seq-length, averaged over the samples)")
    return value


# flag -> the stages that read it (a flag given to another stage is said, not dropped without a word)
_STAGE_FLAGS = {
    ("dpo",): ("dpo_beta", "dpo_loss_type", "dpo_label_smoothing"),
    ("dpo", "kto"): ("refer_model_iter",),
    ("dpo", "simpo", "orpo"): ("pref_ftx",),  # orpo refuses it (its NLL term is its own)
    ("simpo",): ("simpo_beta", "gamma_beta_ratio", "simpo_loss_type", "simpo_label_smoothing"),
    ("orpo",): ("orpo_beta",),
    ("kto",): ("kto_beta", "kto_desirable_weight", "kto_undesirable_weight"),
    ("orm",): ("center_rewards_coefficient",),
    ("score", "grpo"): ("rollout_path", "rollout_overlong"),
    ("score",): ("score_output", "score_field", "score_entropy"),
    ("grpo",): ("advantage_estimator", "clip_ratio", "kl_coef", "kl_estimator", "entropy_coef", "log_entropy",
                "loss_agg"),
}
# value ranges: dest -> (lowest, whether the lowest itself is allowed); every value finite
_RANGES = {"dpo_beta": (0.0, False), "simpo_beta": (0.0, False), "orpo_beta": (0.0, False), "kto_beta": (0.0, False),
           "kto_desirable_weight": (0.0, False), "kto_undesirable_weight": (0.0, False), "pref_ftx": (0.0, True),
           "gamma_beta_ratio": (0.0, True), "center_rewards_coefficient": (0.0, True), "kl_coef": (0.0, True),
           "entropy_coef": (0.0, True)}
_REFERENCE_STAGES = ("dpo", "kto")


def check_stage_flags(args) -> None:
    """Values no stage can train with (a beta of 0 trains nothing, a negative one inverts the preference; a
    negative --pref-ftx maximises the NLL) refused by name; a reference given to a stage that has none refused;
    another stage's flags given (a DPO script moved to SimPO kept its --dpo-beta) said once. A refusal is printed
    once per job (:func:`~mindspeed_pack.config.errors.flag_scope`), not by every rank."""
    from mindspeed_pack.config.errors import ArgumentError, flag_scope
    from mindspeed_pack.runtime.error_scope import scoped

    try:
        _check_stage_flags(args)
    except ArgumentError as e:
        scoped(e, flag_scope(args))
        raise


def _check_stage_flags(args) -> None:
    import logging
    import math

    from mindspeed_pack.config.errors import ArgumentError

    for dest, (low, inclusive) in _RANGES.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if not math.isfinite(value) or value < low or (value == low and not inclusive):
            raise ArgumentError(f"--{dest.replace('_', '-')} {value} must be a finite number "
                                f"{'>=' if inclusive else '>'} {low:g}")
    stage = args.stage
    step = getattr(args, "refer_model_iter", None)
    if step is not None and stage in _REFERENCE_STAGES:
        from mindspeed_pack.model import lora

        if args.ref_logps:
            raise ArgumentError(f"--refer-model-iter {step} with --ref-logps: the reference log-probs are read from "
                                "the table --stage dpo_reference wrote, no reference model is loaded; score that "
                                "iteration with --stage dpo_reference --load CKPT --ckpt-step N, or drop one flag")
        if lora.trains_adapters(args) and not args.ref_load:
            raise ArgumentError(f"--refer-model-iter {step} with LoRA: the reference is the frozen base (the policy "
                                "with its adapters switched off), the same at every iteration; drop "
                                "--refer-model-iter, or name another reference with --ref-load")
    if stage not in (*_REFERENCE_STAGES, "simpo", "orpo"):  # simpo and orpo name themselves reference-free
        for flag, given in (("--ref-load", args.ref_load), ("--ref-logps", args.ref_logps)):
            if given:
                what = ("it scores --load: pass the reference model as --load" if stage == "dpo_reference" else
                        f"no reference model is used by this stage (--stage {' or '.join(_REFERENCE_STAGES)} "
                        "compares with one)")
                raise ArgumentError(f"{flag} with --stage {stage}: {what}; drop {flag}")
    sources = getattr(args, "flag_sources", {}) or {}
    ignored = [f"--{dest.replace('_', '-')} (--stage {'/'.join(stages)})" for stages, dests in _STAGE_FLAGS.items()
               if stage not in stages for dest in dests if (sources.get(dest) or [None, None])[1] == "given"]
    if ignored:
        logging.getLogger(__name__).warning("--stage %s does not read %s: given, but without effect", stage,
                                            ", ".join(ignored))


def get_stage(args):
    """The stage object ``--stage`` selects (the common checks of its flags: :func:`check_stage_flags`, which
    posttrain.py runs first). A stage's constructor checks its flags and reads no file: its refusal is printed
    once per job (:func:`~mindspeed_pack.config.errors.flag_scope`), not by every rank."""
    from mindspeed_pack.config.errors import ArgumentError, flag_scope
    from mindspeed_pack.datasets.packed_dataset import DataError
    from mindspeed_pack.runtime.error_scope import scoped

    try:
        return _make_stage(args)
    except (ArgumentError, DataError) as e:
        scoped(e, flag_scope(args))
        raise


def _make_stage(args):
    if args.stage == "dpo":
        from mindspeed_pack.training.stages.dpo import DPOStage

        return DPOStage(args)
    if args.stage == "simpo":
        from mindspeed_pack.training.stages.simpo import SimPOStage

        return SimPOStage(args)
    if args.stage == "orpo":
        from mindspeed_pack.training.stages.orpo import ORPOStage

        return ORPOStage(args)
    if args.stage == "dpo_reference":
        from mindspeed_pack.training.stages.reference import ReferenceScoringStage

        return ReferenceScoringStage(args)
    if args.stage == "grpo":
        from mindspeed_pack.training.stages.grpo import GRPOStage

        return GRPOStage(args)
    if args.stage == "kto":
        from mindspeed_pack.training.stages.kto import KTOStage

        return KTOStage(args)
    if args.stage == "score":
        from mindspeed_pack.training.stages.score import ScoreStage

        return ScoreStage(args)
    if args.stage in ("orm", "prm"):
        from mindspeed_pack.training.stages.reward_models import OutcomeRewardStage, ProcessRewardStage

        return OutcomeRewardStage(args) if args.stage == "orm" else ProcessRewardStage(args)
    from mindspeed_pack.training.stages.sft import SFTStage

    return SFTStage(args)

"""What a checkpoint records about itself, checked against the run that loads it.

A mismatch stops the run with a message naming the flag, the file and what to do, instead of
silently training something else:

* the model a checkpoint holds (``--load`` and ``--ref-load``, Megatron or Hugging Face alike): every
  setting that changes its function (:data:`~mindspeed_pack.convert.model_specs.FUNCTION_ARGS`: shape,
  RoPE base and scaling, norm epsilon, biases, tying, vocabulary, MoE) must be the flags', and its
  tokenizer (:mod:`~mindspeed_pack.convert.tokenizer_record`) this run's;
* the head: a reward model's checkpoint (a scalar score head, no LM head) is refused by a run that
  needs a language model; a language model's weights start a reward model (``--stage orm``) with a
  fresh head, from a weights-only load (``--finetune``, a release or Hugging Face checkpoint);
* the checkpoint's learning-rate schedule, counted in samples (Megatron-LM's rule: a resume
  whose ``--lr``, ``--min-lr``, warmup, decay samples or decay style differ from the checkpoint's is
  refused unless ``--override-opt_param-scheduler`` (follow the flags from the checkpoint's
  iteration) or ``--use-checkpoint-opt_param-scheduler`` (keep the checkpoint's schedule)).
  Checkpoints written before the schedule counted samples hold iteration counts: :func:`in_samples`
  converts them at load.
"""
from __future__ import annotations

import logging

import numpy as np

from mindspeed_pack.checkpoint.errors import CheckpointError
from mindspeed_pack.convert import tokenizer_record
from mindspeed_pack.convert.model_specs import flag_of, model_differences, show_setting

log = logging.getLogger(__name__)

# the scheduler state's marker: its step counts are samples (absent: iterations, older checkpoints)
UNIT_KEY, UNIT = "num_steps_unit", "samples"
_STEP_KEYS = ("num_steps", "lr_warmup_steps", "lr_decay_steps", "wd_incr_steps")

# scheduler state key -> (what it is, the flags that set it)
SCHEDULE_FIELDS = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "lr_warmup_steps": "--lr-warmup-iters/--lr-warmup-samples/--lr-warmup-fraction (in samples)",
    "lr_decay_steps": "--lr-decay-iters (default --train-iters) x --global-batch-size, or --lr-decay-samples (default "
                      "--train-samples) (in samples)",
    "lr_decay_style": "--lr-decay-style",
    "start_wd": "--weight-decay (--start-weight-decay)",
    "end_wd": "--weight-decay (--end-weight-decay)",
    "wd_incr_style": "--weight-decay-incr-style",
    "wd_incr_steps": "--train-iters x --global-batch-size or --train-samples (the weight decay's increase, in samples)",
}


# ---------------------------------------------------------------------------- checkpoint
def check_model_settings(recorded: dict, args, source: str, where: str) -> None:
    """Refuse a checkpoint whose model (``recorded``: its args, or a HF config mapped by the converter) is not
    the one these flags build. ``source`` is the flag and the path given (``--ref-load DIR``), ``where`` the
    file read."""
    differing = model_differences(recorded, args)
    if not differing:
        return
    what = "; ".join(f"{flag_of(key)} {show_setting(mine)} here, {show_setting(theirs)} in the checkpoint"
                     for key, theirs, mine in differing)
    hint = ("the reference model is built with the policy's flags, so it must be the same model: pass a reference "
            "of this model" if source.startswith("--ref-load") else "pass the flags the checkpoint was trained with")
    raise CheckpointError(f"{source}: the model flags differ from the checkpoint's ({where}): {what}; {hint}")


def check_model_head(recorded_reward_head: bool, args, source: str) -> bool:
    """Refuse a reward model's checkpoint where a language model is needed; True when the run's score head
    starts fresh (a language model's weights into a reward model: its output layer is not loaded)."""
    mine = bool(getattr(args, "reward_head", False))
    if recorded_reward_head and not mine:
        stage = getattr(args, "stage", None)
        raise CheckpointError(f"{source} holds an outcome reward model (a scalar score head, no LM head)"
                              + (f": --stage {stage} needs a language model" if stage else "")
                              + "; train it on with --stage orm, score rollouts with it with --stage score, or load "
                                "a language model")
    return mine and not recorded_reward_head


def check_tokenizer(record, run_record, source: str) -> None:
    """Refuse a checkpoint trained with another tokenizer than ``run_record`` (this run's: its ids must mean the
    same tokens to it); a checkpoint that records none is warned about, not refused."""
    if record is None:
        if run_record is not None:
            log.warning("%s records no tokenizer (written before checkpoints recorded one, or converted from a "
                        "directory without tokenizer files): it cannot be checked against this run's (%s)", source,
                        tokenizer_record.describe(run_record))
        return
    if run_record is None:
        return
    why = tokenizer_record.disagreement(record, run_record)
    if why:
        raise CheckpointError(f"{source} was trained with another tokenizer than this run's ({why}): the "
                              f"checkpoint's is {tokenizer_record.describe(record)}; this run's is "
                              f"{tokenizer_record.describe(run_record)}; use a checkpoint of this tokenizer, or data "
                              "preprocessed with the checkpoint's")


def schedule_mismatches(saved: dict, scheduler) -> list:
    """``[(flag, checkpoint value, value of these flags)]`` where the schedules differ."""
    out = []
    constant = saved.get("wd_incr_style", "constant") == "constant" and scheduler.wd_incr_style == "constant"
    for key, flag in SCHEDULE_FIELDS.items():
        if key not in saved or (key == "wd_incr_steps" and constant):  # a constant decay's length means nothing
            continue
        mine = getattr(scheduler, key)
        if saved[key] != mine and not (isinstance(mine, float) and np.isclose(saved[key], mine, rtol=1e-12, atol=0)):
            out.append((flag, saved[key], mine))
    return out


def check_resume_schedule(args, scheduler, saved: dict) -> None:
    """Refuse a resume whose schedule flags differ from the checkpoint's (Megatron-LM's rule)."""
    if args.override_opt_param_scheduler or args.use_checkpoint_opt_param_scheduler or args.skip_train:
        return  # --skip-train: no update, so no schedule
    differing = schedule_mismatches(saved, scheduler)
    if differing:
        what = _listed(differing)
        own, adapters = getattr(args, "resumed_from", None), getattr(args, "lora_load", None)
        source = f"--save {own}" if own else f"--lora-load {adapters}" if adapters else f"--load {args.load}"
        raise CheckpointError(
            f"{source}: the learning-rate schedule differs from the checkpoint's ({what}). Pass "
            "--override-opt_param-scheduler to follow these flags from the checkpoint's iteration, or "
            "--use-checkpoint-opt_param-scheduler to keep the checkpoint's schedule")


def _listed(differing: list) -> str:
    return "; ".join(f"{flag}: checkpoint {a}, flags {b}" for flag, a, b in differing)


def guard_scheduler_resume(args, scheduler) -> None:
    """Check the checkpoint's schedule when (and only when) the checkpoint loader restores it.

    megatron-core's ``OptimizerParamScheduler.load_state_dict`` then keeps the flags' values
    (``--override-opt_param-scheduler``) or the checkpoint's (``--use-checkpoint-...``).
    """
    scheduler.override_opt_param_scheduler = bool(args.override_opt_param_scheduler)
    scheduler.use_checkpoint_opt_param_scheduler = bool(args.use_checkpoint_opt_param_scheduler)
    restore = scheduler.load_state_dict

    def load_state_dict(state_dict: dict) -> None:
        state_dict = in_samples(state_dict, args.global_batch_size)  # older checkpoints: iterations
        check_resume_schedule(args, scheduler, state_dict)
        differing = schedule_mismatches(state_dict, scheduler)
        if args.use_checkpoint_opt_param_scheduler and differing and not args.skip_train:
            log.warning("--use-checkpoint-opt_param-scheduler: keeping the checkpoint's schedule, not these flags' "
                        "(%s); --override-opt_param-scheduler follows the flags instead", _listed(differing))
        if args.skip_train:
            scheduler.use_checkpoint_opt_param_scheduler = True
        if scheduler.wd_incr_style == "constant" and state_dict.get("wd_incr_style", "constant") == "constant":
            # weight decay is constant here, so its increment length (tied to --train-iters) means
            # nothing: take the checkpoint's so megatron's equality check does not refuse a longer run
            scheduler.wd_incr_steps = state_dict.get("wd_incr_steps", scheduler.wd_incr_steps)
        restore(state_dict)
        # the optimizer's param groups carry their own max/min lr, restored from the checkpoint
        # just before: make them follow the schedule chosen above, then recompute the lr
        for group in scheduler.optimizer.param_groups:
            group["max_lr"], group["min_lr"] = scheduler.max_lr, scheduler.min_lr
        scheduler.step(increment=0)
        if args.override_opt_param_scheduler:
            log.info("--override-opt_param-scheduler: following the flags' schedule from sample %d%s",
                     scheduler.num_steps, f" ({_listed(differing)})" if differing else "")

    scheduler.load_state_dict = load_state_dict


def in_samples(state: dict, global_batch_size: int) -> dict:
    """A saved scheduler state with its step counts in samples.

    States without the marker counted iterations (one step per update): each count times the
    global batch size gives the same learning rate at the same iteration as before."""
    if state.get(UNIT_KEY) == UNIT:
        return state
    out = dict(state)
    for key in _STEP_KEYS:
        if key in out:
            out[key] = out[key] * global_batch_size
    out[UNIT_KEY] = UNIT
    return out

"""The learning-rate schedule, counted in samples as Megatron-LM counts it.

Megatron-LM's ``get_optimizer_param_scheduler`` sizes the schedule in samples and steps it by
the global batch size after every update::

    decay steps   = --lr-decay-iters (default --train-iters) x GBS   (--train-samples: --lr-decay-samples, default
                                                                     --train-samples; likewise the other lengths)
    warmup steps  = --lr-warmup-fraction x decay steps   (fractional: 0.01 x 50 iterations x GBS 2 = 1 sample)
                  or --lr-warmup-iters x GBS
    WSD's decay   = --lr-wsd-decay-iters x GBS, the last ones of the decay steps
    weight decay  = --start-weight-decay -> --end-weight-decay over --train-iters x GBS (--weight-decay-incr-style;
                    constant: --weight-decay)

so a warmup shorter than an iteration still warms up (the first step runs at --lr-warmup-init, 0 by
default), and a resume with another global batch size keeps its place in the schedule (with
``--use-checkpoint-opt_param-scheduler``). Checkpoints written before the schedule counted
samples hold iteration counts: :func:`mindspeed_pack.checkpoint.identity.in_samples` converts them at load.
"""
from __future__ import annotations

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from mindspeed_pack.checkpoint.identity import UNIT, UNIT_KEY


class SampleScheduler(OptimizerParamScheduler):
    """megatron-core's scheduler whose saved state says that it counts samples."""

    def state_dict(self) -> dict:
        return {**super().state_dict(), UNIT_KEY: UNIT}


def schedule_lengths(args) -> tuple:
    """(decay, warmup, WSD decay, weight decay increase) in samples, as Megatron-LM sizes them for
    iteration-based (``--train-iters``) and sample-based (``--train-samples``) runs."""
    gbs = args.global_batch_size
    if args.train_samples:
        decay = args.lr_decay_samples or args.train_samples
        warmup = args.lr_warmup_samples
        wsd, incr = args.lr_wsd_decay_samples, args.train_samples
    else:
        decay = (args.lr_decay_iters or args.train_iters or 1) * gbs
        warmup = args.lr_warmup_iters * gbs
        wsd = args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters is not None else None
        incr = (args.train_iters or 1) * gbs
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    return decay, warmup, wsd, incr


def build_scheduler(args, optimizer) -> SampleScheduler:
    """Megatron-LM's ``get_optimizer_param_scheduler``."""
    gbs = args.global_batch_size
    decay_steps, warmup_steps, wsd_steps, incr_steps = schedule_lengths(args)
    # megatron-core needs warmup < decay: a warmup as long as the run decays over one more iteration
    decay_steps = max(decay_steps, warmup_steps + gbs)
    return SampleScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=warmup_steps, lr_decay_steps=decay_steps, lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay, end_wd=args.end_weight_decay,
        wd_incr_steps=incr_steps, wd_incr_style=args.weight_decay_incr_style,
        wsd_decay_steps=wsd_steps, lr_wsd_decay_style=args.lr_wsd_decay_style,
    )

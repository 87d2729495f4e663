"""Defaults a fine-tuner expects when ``--load`` is a Hugging Face model and ``--stage sft``.

Megatron-LM's defaults suit pretraining from scratch (linear decay to 0, no warmup, fp32, no
export); a fine-tuning run from a released model wants a short warmup, cosine decay to a tenth
of the peak, bf16 where the GPU has it, and the trained model written back as a Hugging Face
directory. Each applies only where neither the command line nor the config file gave the
flag, and each one applied is listed in the resolved configuration (section "fine-tuning
defaults") and logged, so nothing changes silently. A resume of such a run from its Megatron
checkpoint (``--load SAVE``) takes the same values from ``SAVE/run_config.yaml``, the export going to its own
``--save``'s ``hf/`` (whether an export there is written again: training/trainer.py).
"""
from __future__ import annotations

import logging
import os

from mindspeed_pack.config.errors import ArgumentError
from mindspeed_pack.convert import hf_io
from mindspeed_pack.convert import megatron_layout as layout
from mindspeed_pack.convert.tokenizer_record import has_tokenizer
from mindspeed_pack.runtime.platform import cuda_usable

log = logging.getLogger(__name__)

WARMUP_FRACTION = 0.03  # of the decay samples
MIN_LR_RATIO = 0.1  # cosine decay to a tenth of --lr
SAVE_HF_SUBDIR = "hf"  # --save-hf default: SAVE/hf


def bf16_supported() -> bool:
    import torch

    return cuda_usable() and torch.cuda.is_bf16_supported()


def tokenizer_default(args, given: set) -> set:
    """``--tokenizer-name-or-path`` defaults to a Hugging Face ``--load`` directory holding tokenizer files."""
    if "tokenizer_name_or_path" in given or args.load_format != "hf" or args.tokenizer_name_or_path:
        return set()
    if not any(os.path.isfile(os.path.join(args.load, name)) for name in hf_io.TOKENIZER_FILES):
        return set()
    args.tokenizer_name_or_path = args.load
    return {"tokenizer_name_or_path"}


def _fresh_defaults(args, given: set) -> dict:
    """{dest: value} of the defaults a fine-tuning run from a HF model starts with."""
    out = {}
    if not {"lr_warmup_fraction", "lr_warmup_iters", "lr_warmup_samples"} & given:
        out["lr_warmup_fraction"] = WARMUP_FRACTION
    out["lr_decay_style"] = "cosine"
    out["min_lr"] = float(f"{MIN_LR_RATIO * args.lr:.12g}")  # 2e-6, not 2.0000000000000003e-06
    if not {"bf16", "fp16"} & given:
        if bf16_supported():
            out["bf16"] = True
        else:  # fp32 here; --dry-run, which plans for a GPU where none is visible, says what a GPU run would take
            args.bf16_on_a_gpu = True
    if args.save:
        out["save_hf"] = os.path.join(args.save, SAVE_HF_SUBDIR)
    return out


def _holds_checkpoint(save) -> bool:
    """Whether ``--save`` holds a checkpoint (a resume of its run, or another run's: the checkpoint loader tells)."""
    return bool(save) and os.path.isfile(os.path.join(save, layout.TRACKER))


def exported(path: str) -> bool:
    """Whether a model was exported to ``path`` (it exists, and is not an empty directory)."""
    return os.path.exists(path) and (not os.path.isdir(path) or bool(os.listdir(path)))


def apply(args, given: set) -> set:
    """Fill the fine-tuning defaults ``args`` lacks; returns the destinations set.

    A run from a HF ``--load`` gets them fresh; a resume from a Megatron checkpoint whose run got them
    (its ``run_config.yaml``, resolved_config.py) gets the same values, so its schedule matches the
    checkpoint's as the uninterrupted run's would."""
    from mindspeed_pack.config import resolved_config

    applied = tokenizer_default(args, given)
    if args.stage in ("dpo", "simpo", "orpo", "kto", "orm", "prm") and args.load_format == "hf" \
            and not args.save_hf and not getattr(args, "skip_train", False):  # no export default (SFT's below)
        log.warning("--stage %s from the Hugging Face model --load %s without --save-hf: the trained model is written "
                    "%s; pass --save-hf DIR for a transformers-loadable one", args.stage, args.load,
                    "as Megatron checkpoints only (--save)" if args.save else "nowhere (no --save either)")
    if args.stage != "sft" or not args.load or getattr(args, "pretraining", False):  # pretrain_gpt.py: Megatron-LM's
        return applied
    if args.load_format == "hf":
        defaults, why = _fresh_defaults(args, given), "--load is a Hugging Face model, --stage sft"
        # with a checkpoint beside it, the export is its run's: a resume of that run writes none over it, another
        # run is refused (checkpoint/resume.py), and --overwrite-output-dir removes both
        if "save_hf" not in given and exported(defaults.get("save_hf", "")) and not args.overwrite_output_dir \
                and not _holds_checkpoint(args.save):
            raise ArgumentError(f"--save {args.save}: the fine-tuning default --save-hf {defaults['save_hf']} exists "
                                "and is not empty; pass --save-hf NEW_DIR, another --save, or --overwrite-output-dir "
                                "to start over in it")
    elif args.finetune and resolved_config.recorded(args.load, "finetune"):
        # weights alone of a fine-tuning run's checkpoint: a new run, with defaults of its own (the recorded
        # --min-lr of another --lr broke megatron's schedule; its export went into that run's directory)
        defaults, why = _fresh_defaults(args, given), f"--finetune from the fine-tuning run of --load {args.load}"
    else:
        defaults = resolved_config.recorded(args.load, "finetune")
        # the tokenizer its run took from its HF directory, while that holds one (raw --data-path files need it;
        # else the export copies the one the checkpoint records)
        tokenizer = defaults.pop("tokenizer_name_or_path", None)
        if tokenizer and not args.tokenizer_name_or_path and "tokenizer_name_or_path" not in given \
                and has_tokenizer(tokenizer):
            defaults["tokenizer_name_or_path"] = tokenizer
        why = f"resuming the run of --load {args.load}: its {resolved_config.FILE_NAME}"
        if "save_hf" in defaults:  # SAVE/hf of this run's --save, not of the recorded run's (a copy, a move)
            if args.save:
                defaults["save_hf"] = os.path.join(args.save, SAVE_HF_SUBDIR)
            else:
                del defaults["save_hf"]
    if args.load_format == "hf" and not {"save_hf"} & (given | set(defaults)) and not getattr(args, "skip_train", False):
        log.warning("--load %s is a Hugging Face model but neither --save nor --save-hf is given: the trained "
                    "model will not be written", args.load)
    if not defaults:
        return applied
    for dest, value in defaults.items():
        if dest not in given and hasattr(args, dest):
            setattr(args, dest, value)
            applied.add(dest)
    log.info("fine-tuning defaults (%s): %s", why,
             ", ".join(f"--{d.replace('_', '-')} {getattr(args, d)}" for d in sorted(applied)))
    return applied

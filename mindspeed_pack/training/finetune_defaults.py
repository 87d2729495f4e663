"""Defaults a fine-tuner expects when ``--load`` is a Hugging Face model and ``--stage sft``.

Megatron-LM's defaults suit pretraining from scratch (linear decay to 0, no warmup, fp32, no
export); a fine-tuning run from a released model wants a short warmup, cosine decay to a tenth
of the peak, bf16 where the GPU has it, and the trained model written back as a Hugging Face
directory. Each applies only where neither the command line nor the config file gave the
flag, and each one applied is listed in the resolved configuration (section "fine-tuning
defaults") and logged, so nothing changes silently.
"""
from __future__ import annotations

import logging
import os

from mindspeed_pack.platform import cuda_usable
from mindspeed_pack.training.errors import ArgumentError

log = logging.getLogger(__name__)

WARMUP_FRACTION = 0.03  # of the decay samples
MIN_LR_RATIO = 0.1  # cosine decay to a tenth of --lr
SAVE_HF_SUBDIR = "hf"  # --save-hf default: SAVE/hf


def bf16_supported() -> bool:
    import torch

    return cuda_usable() and torch.cuda.is_bf16_supported()


def tokenizer_default(args, given: set) -> set:
    """``--tokenizer-name-or-path`` defaults to a Hugging Face ``--load`` directory holding tokenizer files."""
    if "tokenizer_name_or_path" in given or getattr(args, "load_format", None) != "hf" or args.tokenizer_name_or_path:
        return set()
    if not any(os.path.isfile(os.path.join(args.load, name)) for name in ("tokenizer.json", "tokenizer_config.json")):
        return set()
    args.tokenizer_name_or_path = args.load
    return {"tokenizer_name_or_path"}


def apply(args, given: set) -> set:
    """Fill the fine-tuning defaults ``args`` lacks; returns the destinations set."""
    applied = tokenizer_default(args, given)
    if getattr(args, "load_format", None) != "hf" or args.stage != "sft":
        return applied
    if not {"lr_warmup_fraction", "lr_warmup_iters"} & given:
        args.lr_warmup_fraction = WARMUP_FRACTION
        applied.add("lr_warmup_fraction")
    if "lr_decay_style" not in given:
        args.lr_decay_style = "cosine"
        applied.add("lr_decay_style")
    if "min_lr" not in given:
        args.min_lr = float(f"{MIN_LR_RATIO * args.lr:.12g}")  # 2e-6, not 2.0000000000000003e-06
        applied.add("min_lr")
    if not {"bf16", "fp16"} & given and bf16_supported():
        args.bf16 = True
        applied.add("bf16")
    if "save_hf" not in given and args.save:
        path = os.path.join(args.save, SAVE_HF_SUBDIR)
        if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
            raise ArgumentError(f"--save {args.save}: the fine-tuning default --save-hf {path} exists and is not "
                                "empty; pass --save-hf NEW_DIR, or another --save")
        args.save_hf = path
        applied.add("save_hf")
    elif "save_hf" not in given:
        log.warning("--load %s is a Hugging Face model but neither --save nor --save-hf is given: the trained "
                    "model will not be written", args.load)
    if applied:
        log.info("fine-tuning defaults (--load is a Hugging Face model, --stage sft): %s",
                 ", ".join(f"--{d.replace('_', '-')} {getattr(args, d)}" for d in sorted(applied)))
    return applied

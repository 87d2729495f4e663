"""The model flags of a Hugging Face ``--load``, taken from its config.json before validation.

A flag the user also passed must agree with config.json (the error names both values); the rest are
filled in with the converter's own :func:`~mindspeed_pack.convert.model_specs.args_from_hf_config`, so
``--load HF_DIR`` needs no ``--num-layers`` and friends. Reading the weights is
:mod:`mindspeed_pack.checkpoint.hf_checkpoint`'s.
"""
from __future__ import annotations

import argparse
import logging
import os

from mindspeed_pack.config.errors import ArgumentError
from mindspeed_pack.convert import hf_io
from mindspeed_pack.convert.model_specs import (
    RUN_LAYOUT_ARGS,
    ConversionError,
    args_from_hf_config,
    flag_of,
    model_differences,
    show_setting,
)
from mindspeed_pack.model import lora

log = logging.getLogger(__name__)


def explicit_dests(parser: argparse.ArgumentParser, argv) -> set:
    """Destinations of the flags present on the command line (a default is not a choice)."""
    saved = [(action, action.default) for action in parser._actions]
    for action, _ in saved:
        action.default = argparse.SUPPRESS
    try:
        given, _ = parser.parse_known_args(argv)
    finally:
        for action, default in saved:
            action.default = default
    return set(vars(given))


def fill_model_args(args, explicit: set) -> argparse.Namespace:
    """Set the model-shape arguments of ``args`` from ``args.load``'s config.json.

    Returns the converter's arguments for the model (the same ones ``convert_ckpt.py`` writes
    into a converted checkpoint). Model fields a family adds to ``args_from_hf_config`` are
    filled in the same way, with no change here.
    """
    config_path = os.path.join(args.load, hf_io.CONFIG)
    try:
        config = hf_io.read_config(args.load)
        model = args_from_hf_config(
            config, tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
            padded_vocab_size=args.padded_vocab_size, where=config_path,
            seq_length=args.seq_length,  # a sliding window shorter than the run's sequences is refused
            ep=args.expert_model_parallel_size)
    except ConversionError as e:
        raise ArgumentError(f"--load {args.load}: {e}") from None
    given = [k for k in vars(model) if k in explicit and k not in RUN_LAYOUT_ARGS]
    disagree = [f"{flag_of(key)} {show_setting(mine)} but {config_path} gives {flag_of(key)} {show_setting(theirs)}"
                for key, theirs, mine in model_differences(vars(model), args, given)]
    for key, value in vars(model).items():
        if key not in RUN_LAYOUT_ARGS:
            setattr(args, key, value)
    if disagree and not getattr(args, "use_checkpoint_args", False):
        raise ArgumentError("model flags disagree with the Hugging Face config (drop them, or pass the config's "
                            "values): " + "; ".join(disagree))
    if disagree:  # Megatron-LM's --use-checkpoint-args: config.json's values (set above) override the flags
        log.warning("--use-checkpoint-args: the Hugging Face config's values replace the flags given: %s",
                    "; ".join(disagree))
    # dropout is the HF model's own (its config's attention_dropout; transformers' decoders have no hidden
    # dropout), not Megatron-LM's 0.1 defaults, unless the flags are given
    if "attention_dropout" not in explicit:
        args.attention_dropout = float(config.get("attention_dropout", 0.0) or 0.0)
    if "hidden_dropout" not in explicit:
        args.hidden_dropout = 0.0
    coef = config.get("router_aux_loss_coef")
    if getattr(args, "num_experts", None) and coef and "moe_aux_loss_coeff" not in explicit:
        # a training setting, not the model's (convert/model_specs.py): Megatron-LM's default holds
        log.info("--load %s: config.json's router_aux_loss_coef %s is not applied (--moe-aux-loss-coeff %s: the "
                 "load-balancing loss is logged as 'moe aux loss' but adds no gradient); pass --moe-aux-loss-coeff %s "
                 "to train with it", args.load, coef, args.moe_aux_loss_coeff, coef)
    args.hf_config = config
    args.loaded_sliding_window = getattr(model, "sliding_window", None)  # kept in the checkpoints this run saves
    log.info("--load %s: Hugging Face %s, model flags from config.json", args.load, model.model_type_hf)
    return model


def _may_resume(args) -> bool:
    """Whether the run may resume a training checkpoint (its --save's, --lora-load's or --load's)."""
    from mindspeed_pack.convert.megatron_layout import RELEASE, read_tracker

    def tracked(path):
        try:
            return bool(path) and os.path.isdir(path) and read_tracker(path) not in (None, RELEASE)
        except ValueError:
            return False

    return tracked(args.save) or (not args.finetune and (tracked(args.lora_load) or tracked(args.load)))


def _check_save_hf_dir(args) -> None:
    path = args.save_hf
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        if os.path.isdir(path) and _may_resume(args):
            return  # decided once the checkpoint is loaded (trainer.run): done, replaced, or refused
        raise ArgumentError(f"--save-hf {path} exists and is not an empty directory; choose a new directory")
    if args.load and os.path.abspath(path) == os.path.abspath(args.load):
        raise ArgumentError(f"--save-hf {path} is the --load directory; choose a new directory")


def apply_hf_flags(args, parser: argparse.ArgumentParser, argv) -> None:
    """Resolve ``--load-format``, fill the model flags of a HF ``--load``, check ``--save-hf``.

    Runs before the flags are validated (``--num-layers`` and friends may come from config.json).
    """
    fmt = args.load_format
    if args.load and (fmt == "hf" or (fmt == "auto" and hf_io.looks_like_hf(args.load))):
        hf_io.check_hf_dir(args.load, "--load", ArgumentError)
        if args.save and os.path.abspath(args.save) == os.path.abspath(args.load):
            raise ArgumentError(f"--save {args.save} is the Hugging Face --load directory: checkpoints would be "
                                "written into the model's files; choose another --save directory")
        args.load_format = "hf"
        fill_model_args(args, explicit_dests(parser, argv))
        # weights only: iteration 0, a fresh optimizer (a LoRA base always is; there --finetune is --lora-load's)
        if not lora.trains_adapters(args):
            args.finetune = True
    elif args.load:
        args.load_format = "mg"
    if args.save_hf:
        _check_save_hf_dir(args)

"""The model flags of a Megatron ``--load``, taken from the arguments its files record, before validation.

Every converted or saved checkpoint records the model it holds (``convert_ckpt.py`` writes the converter's
arguments, a training run's ``--save`` the run's: :data:`~mindspeed_pack.convert.model_specs.MODEL_ARG_NAMES`
and the optional ones). As :mod:`.hf_flags` takes them from a HF directory's config.json, a flag the user also
passed must agree (the error names both values) and the rest are filled in, so ``--load ckpt --finetune``
needs no ``--num-layers`` and friends. The vocabulary is among them: ``vocab_size`` is the model's own rows
(for a converted model config.json's ``vocab_size``, the embedding's rows, which may be more than its
tokenizer's entries: Qwen2.5 has 152,064 rows for 151,665 tokens) and ``padded_vocab_size`` those rows with
Megatron's padding; so every row of the model stays in the softmax and only Megatron's padding is masked.
Dropout is not a model argument: Megatron-LM's defaults hold unless given, or unless the checkpoint's run started
from a Hugging Face directory (its ``run_config.yaml`` records that model's dropout, taken again). Loading the
weights, and checking them against the flags, is :mod:`mindspeed_pack.checkpoint.save_load`'s.
"""
from __future__ import annotations

import logging
import os

from mindspeed_pack.config import resolved_config
from mindspeed_pack.config.errors import ArgumentError
from mindspeed_pack.convert import megatron_layout as layout
from mindspeed_pack.convert.model_specs import (
    MODEL_ARG_NAMES,
    OPTIONAL_MODEL_ARGS,
    RUN_LAYOUT_ARGS,
    flag_of,
    model_differences,
    show_setting,
)
from mindspeed_pack.model import lora

log = logging.getLogger(__name__)

# the recorded model arguments that are flags (the run's layout is the run's; the family and sliding window
# are no flags: the load takes them from the record; a reward model's head is the stage's: config/model_head.py)
FILLED_ARGS = tuple(k for k in (*MODEL_ARG_NAMES, *OPTIONAL_MODEL_ARGS)
                    if k not in (*RUN_LAYOUT_ARGS, "model_type_hf", "sliding_window", "reward_head",
                                 "reward_pad_token_id"))
# what a run cannot be described without (parse_args' required model flags)
_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads")


def read_record(args):
    """(file, its record) of ``args.load``'s tracked iteration, or None when it holds none yet."""
    root = args.load
    step = getattr(args, "ckpt_step", None)
    if step is not None and not os.path.isdir(layout.iteration_dir(root, step)):
        found = sorted(n for n in os.listdir(root) if n.startswith("iter_")) if os.path.isdir(root) else []
        raise ArgumentError(f"--ckpt-step {step}: {layout.iteration_dir(root, step)} does not exist; {root} holds "
                            f"{', '.join(found) or 'no iteration'}")
    try:
        path = layout.first_rank_file(root, step)
    except ValueError as e:  # a tracker naming no iteration
        raise ArgumentError(f"--load {root}: {e}") from None
    if path is None:
        return None
    try:
        record = layout.load_file(path, allow_unsafe=args.allow_unsafe_checkpoint_load, mmap=True)
    except layout.UnsafeCheckpointError as e:
        raise ArgumentError(str(e)) from None
    except Exception as e:  # truncated or corrupt
        raise ArgumentError(f"--load {root}: {path} cannot be read ({type(e).__name__}: {e}); the file is truncated "
                            f"or corrupt: load an earlier iteration (edit the number in "
                            f"{os.path.join(root, layout.TRACKER)})") from None
    return path, record if isinstance(record, dict) else {}


def _tracked_file_missing(args) -> str:
    """Why the iteration ``args.load``'s tracker (or ``--ckpt-step``) names has no first rank file to read."""
    step = getattr(args, "ckpt_step", None)
    iteration = layout.read_tracker(args.load) if step is None else step
    it_dir = layout.iteration_dir(args.load, iteration)
    if not os.path.isdir(it_dir) and not os.path.isdir(it_dir + ".old"):
        return layout.missing_iteration(args.load, iteration)
    return f"{it_dir} holds no mp_rank_00*/model_optim_rng.pt (an incomplete copy?); {layout.other_iterations(args.load)}"


def fill_model_args(args, explicit: set) -> None:
    """Set the recorded model arguments of ``args.load`` that the user did not pass; refuse those passed with
    another value. A checkpoint that records none (another tool's), or none yet, leaves the flags as given; a --load
    that does not exist, or holds no model, is refused by name when the model flags are not all given."""
    missing = [k for k in _REQUIRED if getattr(args, k) is None]
    if not os.path.isdir(args.load):
        if missing:
            raise ArgumentError(_no_model(args, missing, "does not exist"))
        return  # the model flags are given: the load refuses the missing directory (a dry run plans without it)
    try:
        found = read_record(args)
    except ArgumentError:
        if all(getattr(args, k) is not None for k in _REQUIRED):
            return  # the model flags are given: the load refuses the unreadable or unsafe file, in the same words
        raise  # the run cannot be described without the record: its reason, not "missing --num-layers"
    if found is None:
        if missing and not os.path.isfile(os.path.join(args.load, layout.TRACKER)):
            raise ArgumentError(_no_model(args, missing, "holds neither a Hugging Face model (config.json, "
                                          f"*.safetensors) nor a Megatron checkpoint ({layout.TRACKER})"
                                          + layout.inside_checkpoint(args.load)))
        if missing:  # the tracked iteration is gone: its reason, not "missing required arguments: --num-layers"
            raise ArgumentError(f"--load {args.load}: {_tracked_file_missing(args)}")
        return
    path, record = found
    if record.get("lora") is not None and not lora.trains_adapters(args):
        base = (record["lora"].get("base") or {}).get("path")
        raise ArgumentError(f"--load {args.load} holds LoRA adapters (a LoRA run's --save), not a model: pass their base"
                            f"{f' ({base})' if base else ''} as --load, {args.load} as --lora-load, and the LoRA flags "
                            "they were trained with (--lora-r, --lora-alpha, --lora-target-modules)")
    recorded = layout.args_of(record)
    keys = [k for k in FILLED_ARGS if recorded.get(k) is not None]  # None: not recorded (another tool's file)
    unknown = [k for k in missing if k not in keys]
    if unknown:  # MindSpeed-LLM's converter records its own arguments, not the model's: 'missing required arguments'
        raise ArgumentError(f"--load {args.load}: {path} records no {', '.join(flag_of(k) for k in unknown)} (a checkpoint "
                            "of another tool, such as MindSpeed-LLM's converter, which records its own arguments): "
                            "pass the model flags of the model it holds, as MindSpeed-LLM's tune scripts do")
    given = [k for k in keys if k in explicit]
    disagree = [f"{flag_of(key)} {show_setting(mine)} but {path} records {flag_of(key)} {show_setting(theirs)}"
                for key, theirs, mine in model_differences(recorded, args, given)]
    if disagree and not getattr(args, "use_checkpoint_args", False):
        raise ArgumentError("model flags disagree with the --load checkpoint (drop them, or pass its values): "
                            + "; ".join(disagree))
    if disagree:  # Megatron-LM's --use-checkpoint-args: the checkpoint's arguments override the flags
        log.warning("--use-checkpoint-args: the --load checkpoint's values replace the flags given: %s",
                    "; ".join(disagree))
        given = []
    filled = [k for k in keys if k not in given]
    if getattr(args, "use_checkpoint_args", False) and args.seq_length is None and recorded.get("seq_length"):
        filled.append("seq_length")  # Megatron-LM's load_args_from_checkpoint takes it too, when not given
    for key in filled:
        setattr(args, key, recorded[key])
    if filled:
        log.info("--load %s: model flags from the arguments %s records: %s", args.load, path,
                 " ".join(f"{flag_of(k)} {show_setting(recorded[k])}" for k in filled))
    _dropout_of_its_run(args, explicit)


def _no_model(args, missing: list, what: str) -> str:
    """Why the run has no model shape: ``--load`` ``what``, and the model flags come from what it holds."""
    flags = ", ".join(flag_of(k) for k in missing)
    text = (f"--load {args.load} {what}; the model flags ({flags}) come from what it holds (a Hugging Face model's "
            "config.json, or the arguments a Megatron checkpoint records): download or convert the model into it, or "
            "correct the path")
    if args.save and os.path.abspath(args.save) == os.path.abspath(args.load):
        text += f" (it is also --save: a first launch, with nothing saved yet, passes {flags})"
    if getattr(args, "dry_run", False):
        text += (f"; --dry-run plans from the model's shape: to plan before the model is there, pass {flags} and the "
                 "other model flags")
    return text


def _dropout_of_its_run(args, explicit: set) -> None:
    """A run started from a Hugging Face directory took that model's dropout (0 for Qwen), not Megatron-LM's 0.1,
    and its ``run_config.yaml`` says so: a ``--load`` of its checkpoint takes the same, so the resume trains as the
    uninterrupted run would (a converted checkpoint records no run: Megatron-LM's defaults hold)."""
    # the "hf" section of a run from the HF directory; the "checkpoint" section of a run that took it in turn from
    # its --load (a resume with --load SAVE, a --finetune of it, a reshard: any hop keeps it)
    from_hf = {**resolved_config.recorded(args.load, "checkpoint"), **resolved_config.recorded(args.load, "hf")}
    taken = {k: from_hf[k] for k in ("attention_dropout", "hidden_dropout") if k in from_hf and k not in explicit}
    for key, value in taken.items():
        setattr(args, key, float(value))
    if taken:
        log.info("--load %s: dropout of the run that saved it (its %s, from its Hugging Face --load): %s", args.load,
                 resolved_config.FILE_NAME, " ".join(f"{flag_of(k)} {v}" for k, v in taken.items()))

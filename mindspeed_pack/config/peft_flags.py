"""The LoRA flags of a PEFT ``--lora-load`` directory, before validation.

``--lora-load`` takes a LoRA run's checkpoint (its ``--save``, whose settings the flags must repeat) or a
PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``: the ``--save-hf`` /
``convert_ckpt.py`` export, or PEFT's own). A PEFT directory states what its adapters are, so, as
:mod:`.hf_flags` takes the model flags from config.json, the LoRA flags not given are taken from it (rank,
alpha, rsLoRA, the adapted projections, dropout) and those given must agree; dropout excepted: it is how the
adapters go on training, not what they are. Loading the adapters is
:mod:`mindspeed_pack.checkpoint.lora_checkpoint`'s.
"""
from __future__ import annotations

import logging
import os

from mindspeed_pack.config.errors import ArgumentError
from mindspeed_pack.convert import adapters
from mindspeed_pack.convert.model_specs import ConversionError
from mindspeed_pack.model import lora

log = logging.getLogger(__name__)


def _recorded_settings(root: str):
    """The LoRA settings a LoRA run's checkpoint records (its ``lora`` entry), as flag values; None when ``root``
    is no such checkpoint (the load names what is wrong with it)."""
    from mindspeed_pack.convert import megatron_layout as layout
    from mindspeed_pack.convert.convert import MegatronCheckpoint

    try:
        if layout.read_tracker(root) is None:
            return None
        record = MegatronCheckpoint(root).lora
    except (ConversionError, OSError, ValueError):
        return None
    if not record or not record.get("targets"):
        return None
    targets = sorted({t.split(".")[-1] for t in record["targets"]})
    if lora.resolve_targets(targets) == lora.resolve_targets([lora.ALL_LINEAR]):
        targets = None  # the default, as the run was given it (its resolved config records it so)
    return {"lora_r": record["r"], "lora_alpha": record["alpha"], "lora_use_rslora": bool(record.get("rslora")),
            "lora_target_modules": targets, "lora_dropout": record.get("dropout", 0.0)}


def fill_lora_flags(args, given: set) -> set:
    """Fill the LoRA flags not given from ``--lora-load``'s adapter_config.json (a PEFT directory; given ones that
    differ are refused) or a LoRA run's checkpoint's record (it asked for all of them, though it records them;
    given ones are checked against the record at load); returns the destinations filled."""
    root = args.lora_load
    named = adapters.named_peft_adapters(root) if root else []
    if named:
        raise ArgumentError(f"--lora-load {root}: no adapter_config.json there, but the PEFT adapters {', '.join(named)} "
                            "below it (PEFT saves an adapter not named 'default' in a subdirectory of its name): pass "
                            f"--lora-load {os.path.join(root, named[0])}")
    if root and not adapters.is_peft_dir(root):  # those given are checked against the record at load
        values = _recorded_settings(root)
        if values is None:
            return set()
        filled = {dest for dest in values if dest not in given}
        for dest in filled:
            setattr(args, dest, values[dest])
        log.info("--lora-load %s: LoRA flags from its checkpoint's record: %s", root,
                 " ".join(f"--{d.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                          for d, v in sorted(values.items()) if d in filled and v is not None))
        return filled
    if not root or not adapters.is_peft_dir(root):
        return set()
    try:
        peft = adapters.read_peft_settings(root)
    except ConversionError as e:
        raise ArgumentError(f"--lora-load {root}: {e}") from None
    values = {"lora_r": peft["r"], "lora_alpha": peft["alpha"], "lora_use_rslora": peft["rslora"],
              "lora_target_modules": peft["projections"], "lora_dropout": peft["dropout"]}
    differ = []
    for dest, theirs in values.items():
        if dest not in given:
            continue
        mine = getattr(args, dest)
        if dest == "lora_target_modules":
            try:
                same = lora.resolve_targets(mine) == lora.resolve_targets(theirs)
            except ValueError as e:
                raise ArgumentError(str(e)) from None
        else:
            same = dest == "lora_dropout" or mine == theirs
        if not same:
            show = lambda v: " ".join(v) if isinstance(v, list) else v  # noqa: E731
            differ.append(f"--{dest.replace('_', '-')}: adapter_config.json {show(theirs)}, flags {show(mine)}")
    if differ:
        raise ArgumentError(f"--lora-load {root}: the LoRA flags differ from the adapters' ({'; '.join(differ)}): drop "
                            "them (they are read from adapter_config.json) or pass its values")
    filled = {dest for dest in values if dest not in given}
    for dest in filled:
        setattr(args, dest, values[dest])
    if filled:
        shown = {d: " ".join(v) if isinstance(v, list) else v for d, v in values.items()}
        log.info("--lora-load %s: LoRA flags from its adapter_config.json: %s", root,
                 " ".join(f"--{d.replace('_', '-')} {shown[d]}" for d in sorted(filled)))
    return filled

"""The checkpoint a run starts from: ``--load`` as it is, or under LoRA the frozen base and then
``--lora-load``'s adapters. The trainer calls :func:`load_run_checkpoint` and never asks which."""
from __future__ import annotations

from mindspeed_pack.checkpoint import lora_checkpoint, save_load
from mindspeed_pack.model import lora


def load_run_checkpoint(args, model, optimizer, scheduler) -> tuple:
    """(iteration, consumed samples) the run resumes at, after loading what it starts from."""
    load = lora_checkpoint.load_checkpoint if lora.trains_adapters(args) else save_load.load_checkpoint
    return load(args, model, optimizer, scheduler)


def loaded_from(args) -> str:
    """The checkpoint the iteration and data position came from (LoRA: the adapters' checkpoint)."""
    return args.lora_load or args.load

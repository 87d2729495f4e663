"""The error a bad flag or flag combination raises (the parser turns it into one usage line)."""
from __future__ import annotations


class ArgumentError(ValueError):
    """An invalid flag or combination of flags."""


# the flags whose files give a run flags as parse_args reads them: a YAML file, a checkpoint's or HF model's
# recorded settings, a PEFT adapter's config
_FILE_FLAGS = ("config", "load", "lora_load")


def flag_scope(args) -> str:
    """Which ranks print a refusal of the run's flags (:mod:`mindspeed_pack.runtime.error_scope`): ``"job"``
    (global rank 0) when the flags came from the command line alone, which every rank parsed alike; ``"node"``
    (each node's local rank 0) when a file gave some (``--config``, ``--load``'s config.json or recorded
    arguments, ``--lora-load``'s adapter_config.json): another node may read another copy, or none."""
    return "node" if any(getattr(args, name, None) for name in _FILE_FLAGS) else "job"

"""The errors training raises for a bad flag or checkpoint, and how ranks agree that none failed.

Below the argument parser, the checkpoint code and the Hugging Face reader/writer, which all
raise them, so none of those has to import another for its error type.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mindspeed_pack.platform import cuda_usable


class ArgumentError(ValueError):
    """An invalid flag or combination of flags."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read, written or used by this run; the message says where and what to do."""


def all_ranks_ok(error) -> bool:
    """True when no rank failed (every rank must agree, or the others would hang in a barrier)."""
    failed = torch.tensor([int(error is not None)], device=torch.cuda.current_device() if cuda_usable() else "cpu")
    dist.all_reduce(failed)
    return not failed.item()

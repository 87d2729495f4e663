"""The error every checkpoint reader and writer raises: the scripts print it as one ``error:`` line."""
from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read, written or used by this run; the message says where and what to do."""

"""A full disk, said in one line: what was being written, where, about how much it needs and how much is free.

Writers (the ``--save-hf`` export, preprocessing, the metrics file) catch the writer's own error (an
``OSError`` with ``ENOSPC``, or safetensors' error carrying "os error 28"), remove what they had started,
and raise their own error type with :func:`disk_full_message`, so the run ends with one ``error:`` line
instead of a traceback, and nothing partial is left.
"""
from __future__ import annotations

import errno
import os
import shutil


class DiskFullError(RuntimeError):
    """A write that found the disk full; the message says where, how much is needed and how much is free."""


def is_disk_full(error: BaseException) -> bool:
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(error)
    return "No space left on device" in text or "os error 28" in text or "Disk quota exceeded" in text


def gib(n: float) -> str:
    return f"{n / 2 ** 30:.2f} GiB"


def free_bytes(path: str) -> int:
    """Free bytes on the file system that holds ``path`` (or its nearest existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def tree_bytes(path: str) -> int:
    """Bytes of the files under ``path`` (a file's own size; 0 if it is gone)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def disk_full_message(what: str, path: str, needed: int | None) -> str:
    """``what`` (e.g. "--save-hf") writing ``path`` needs about ``needed`` bytes (None: a small write)."""
    need = f"this needs about {gib(needed)} and " if needed else ""
    return (f"{what} {path}: the disk is full: {need}{gib(free_bytes(path))} are free there; free space or choose "
            "another directory, then re-run")

"""``--save``, claimed by one job before it builds anything: writable, and no other job saving into it.

Two jobs given the same ``--save`` by mistake (a copied script, a resubmitted job while the first still
runs) both pass the start-up checks while the directory holds no checkpoint yet, then save over each other's
iterations (a re-save of ``iter_N`` replaces it) and their ``run_config.yaml``: what a resume loads is then
whichever wrote last, without a word. So rank 0 holds a POSIX lock on ``SAVE/.save.lock`` for the whole run
(the kernel releases it when the process dies, so torchrun's restart of the same job finds it free; a run that
ends removes the file), and a second job stops at once naming the first. A ``--save`` that cannot be written (a read-only mount, no
permission) stops here too, as one line, not as a traceback after the model was loaded.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from typing import Optional

import torch.distributed as dist

from mindspeed_pack.checkpoint.errors import CheckpointError
from mindspeed_pack.runtime.error_scope import scoped
from mindspeed_pack.runtime.stale_files import HOST

log = logging.getLogger(__name__)

LOCK_NAME = ".save.lock"
_held = {}  # lock path -> descriptor, for this process's runs (closing any descriptor of it would release it)


def claim(args) -> None:
    """Every rank: rank 0 creates ``--save`` and locks it for this job; a failure there is raised on every
    rank (a rank that stopped alone would leave the others to report a lost peer)."""
    if not args.save or args.skip_train:  # an evaluation saves nothing
        return
    message = [_claim(args.save) if dist.get_rank() == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(message, src=0)
    if message[0] is not None:  # rank 0's finding, on every rank: rank 0 prints it for the job
        raise scoped(CheckpointError(message[0]), "job")


def release(save: Optional[str]) -> None:
    """Give ``--save`` back (the run ended, or failed, inside a longer-lived process)."""
    path = _lock_path(save) if save else None
    fd = _held.pop(path, None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.unlink(path)  # before the unlock: a job that locked this file next sees it gone and retries
        os.close(fd)


def _lock_path(save: str) -> str:
    return os.path.join(os.path.abspath(save), LOCK_NAME)


def _claim(save: str) -> Optional[str]:
    """None once ``save`` is this job's, else the error line."""
    path = _lock_path(save)
    if path in _held:
        return None
    while True:
        try:
            os.makedirs(save, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            if os.path.exists(save) and not os.path.isdir(save):  # makedirs said only "File exists"
                return (f"--save {save} is a file, not a directory: pass a directory for the checkpoints (made if "
                        "missing)")
            return (f"--save {save} cannot be written ({e.strerror or e}"
                    f"{f': {e.filename}' if e.filename else ''}): pass a --save this job can write, on a file system "
                    "every node sees")
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EAGAIN):  # another process holds it
                holder = os.pread(fd, 200, 0).decode(errors="replace").split()
                os.close(fd)
                who = f"PID {holder[0]} on {holder[1]}" if len(holder) == 2 else "another process"
                return (f"--save {save} is in use by another job ({who} holds {path}): two runs saving into one "
                        "directory overwrite each other's checkpoints; pass another --save, or wait until that job "
                        "ends")
            log.warning("--save %s: %s cannot be locked on this file system (%s): a second job given the same "
                        "--save would not be stopped", save, path, e.strerror)
        if _same_file(fd, path):
            break
        os.close(fd)  # its holder removed it as we locked it: lock the file now at the path
    with contextlib.suppress(OSError):  # who holds it, for the message of a job that finds it taken
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {HOST}\n".encode(), 0)
    _held[path] = fd
    return None


def _same_file(fd: int, path: str) -> bool:
    try:
        mine, now = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino)

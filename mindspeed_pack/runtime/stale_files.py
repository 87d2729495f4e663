"""Temporaries named after their owner, removed once it is gone; one builder of an output at a time.

A writer stages its output beside the target and renames it when complete (preprocessing's
``.P.tmp-HOST-PID`` and ``.P.tokens-HOST-PID``, the export's ``.DIR.tmp-HOST-PID``). A SIGKILL (the OOM
killer, a preempted job, a power cut) leaves the temporary behind, gigabytes at 7B. So its name says
who owns it (:func:`owned_name`), and the next writer of the same target removes the siblings whose
owner is gone (:func:`remove_stale`), in one log line with the bytes freed. A temporary of a live
process is never touched, nor one made on another host (a shared file system: that host's processes
cannot be seen from here). Only the rank that writes an output cleans beside it.

:func:`exclusive` is the lock two jobs building the same output take: the first builds, the others
wait, then find the output built. It is a POSIX record lock (``fcntl.lockf``), which the kernel
releases when its process dies, so a killed builder never blocks the next; unlike ``flock`` it is not
shared with forked children (preprocessing's ``--workers``), which could outlive a killed parent.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import socket
import time
from typing import Iterator, Optional, Sequence, Tuple

from mindspeed_pack.runtime.disk import tree_bytes

log = logging.getLogger(__name__)

HOST = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "localhost"


def owned_name(prefix: str) -> str:
    """``prefix`` + ``HOST-PID`` of this process: a temporary whose owner a later run can check."""
    return f"{prefix}{HOST}-{os.getpid()}"


def temporary_for(path: str, what: str) -> str:
    """This process's temporary for ``path``: ``.NAME.tmp-HOST-PID`` beside it (a file or a directory, renamed
    onto ``path`` when complete), once the ones of killed writers are removed (:func:`remove_stale_temporaries`)."""
    remove_stale_temporaries(path, what)
    directory, prefix = _beside(path)
    return os.path.join(directory, owned_name(prefix))


def remove_stale_temporaries(path: str, what: str) -> int:
    """Remove the ``.NAME.tmp-HOST-PID`` beside ``path`` whose owner is gone (:func:`remove_stale`)."""
    directory, prefix = _beside(path)
    return remove_stale(directory, [prefix], what)


def _beside(path: str) -> Tuple[str, str]:
    directory, name = os.path.split(os.path.abspath(path))
    return directory, f".{name}.tmp-"


def owner(name: str, prefix: str) -> Optional[Tuple[str, int]]:
    """(host, pid) of a name :func:`owned_name` made from ``prefix``, else None."""
    if not name.startswith(prefix):
        return None
    host, _, pid = name[len(prefix):].rpartition("-")
    return (host, int(pid)) if host and pid.isdigit() else None


PF_EXITING = 0x4  # Linux's flag of a process inside exit(): killed, its files (and locks) being released


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (a process of another user counts: it is not ours to judge).
    One that is exiting or a zombie does not: killed, it releases its locks before its parent reaps it, and
    a job waiting on such a lock must see its temporaries as stale."""
    if pid <= 0:
        return True  # never made by owned_name; os.kill(0, ...) would mean this process group
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            fields = f.read().rpartition(")")[2].split()  # after "pid (comm)": state, ppid, ..., flags (the 7th)
        return fields[0] not in ("Z", "X") and not int(fields[6]) & PF_EXITING
    except (OSError, IndexError, ValueError):  # no /proc (not Linux), or it ended just now
        return os.path.exists(f"/proc/{pid}") or not os.path.isdir("/proc")


def size_text(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def remove_stale(directory: str, prefixes: Sequence[str], what: str) -> int:
    """Remove ``directory``'s entries named ``PREFIX HOST-PID`` (``PREFIX`` one of ``prefixes``) whose owner
    process is gone; returns the bytes freed. ``what`` (the output) starts the log lines."""
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return 0
    removed, elsewhere, freed = [], [], 0
    for name in names:
        found = next((o for o in (owner(name, p) for p in prefixes) if o is not None), None)
        if found is None:
            continue
        host, pid = found
        if host != HOST:
            elsewhere.append(name)
            continue
        if pid == os.getpid() or process_alive(pid):
            continue
        path = os.path.join(directory, name)
        size = tree_bytes(path)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        if not os.path.lexists(path):
            removed.append(name)
            freed += size
    if removed:
        log.warning("%s: removed %d leftover%s of killed runs from %s (%s freed): %s", what, len(removed),
                    "s" if len(removed) > 1 else "", directory, size_text(freed), ", ".join(removed))
    if elsewhere:
        log.warning("%s: left %s in %s: made on another host, whose processes cannot be checked from %s; remove "
                    "them by hand once no job there writes them", what, ", ".join(elsewhere), directory, HOST)
    return freed


@contextlib.contextmanager
def exclusive(lock_path: str, what: str) -> Iterator[bool]:
    """Hold an exclusive lock on ``lock_path`` while the block builds ``what``; a job holding it is waited for
    (logged with its PID), and the block gets whether it waited. The file is removed on release; a holder
    killed leaves it, unlocked, to the next.
    A POSIX lock belongs to the process: it does not exclude the process's own threads, and closing any
    descriptor of the file in the holder releases it (only :func:`exclusive` opens it)."""
    waited = False
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            waited = _lock(fd, lock_path, what) or waited
            mine = os.fstat(fd)
            now = os.stat(lock_path)
        except FileNotFoundError:  # the holder we waited for removed the file: lock the one at the path now
            os.close(fd)
            continue
        except BaseException:
            os.close(fd)
            raise
        if (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino):
            break
        os.close(fd)
    try:
        with contextlib.suppress(OSError):  # who holds it, for the log of a job that waits (a full disk: unsaid)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {HOST}\n".encode(), 0)
        yield waited
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock_path)  # before the unlock: a job that locks this file next sees it gone and retries
        os.close(fd)


def _lock(fd: int, lock_path: str, what: str) -> bool:
    """Lock ``fd``; whether another process held it first."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            log.warning("%s: %s cannot be locked on this file system (%s): two jobs building it at once would "
                        "both build it", what, lock_path, e.strerror)
            return False
        if e.errno not in (errno.EACCES, errno.EAGAIN):  # these two: another process holds it
            raise
    holder = os.pread(fd, 200, 0).decode(errors="replace").split()
    who = f"PID {holder[0]} on {holder[1]}" if len(holder) == 2 else "another job"
    log.warning("waiting for %s, which is building %s (lock %s)", who, what, lock_path)
    start = time.monotonic()
    fcntl.lockf(fd, fcntl.LOCK_EX)
    log.warning("%s: the lock is free after %.1f s", what, time.monotonic() - start)
    return True

"""Fault injection for crash-safety tests: die or fail at a named point of a run.

``MINDSPEED_PACK_FAULT="POINT@ITER[:ACTION][:rankR][:attemptA][,...]"`` arms one or more
faults; each fires when the run reaches ``POINT`` at iteration ``ITER``:

=============  ==============================================================
``step``       after iteration ITER's optimizer step, before it is logged or saved
``write``      half-way through writing a rank file of the save of ITER
``written``    every rank file of the save written, before ``iter_N.tmp`` is renamed
``renamed``    ``iter_N`` in place, the tracker not yet moved to it
``tracker``    the tracker moved, the previous copy of a re-save not yet removed
``tokenized``  preprocessing: every row in its temporary token store, no output written
               yet (ITER 0: it runs once)
``exported``   an export (``--save-hf``, ``convert_ckpt.py``) complete in its temporary
               directory, not yet renamed onto the target (ITER 0)
=============  ==============================================================

``ACTION`` is ``kill`` (SIGKILL this process: a power cut as seen by the files; the
default), ``enospc`` (raise ``OSError(ENOSPC)``, as a full disk does) or ``stop`` (SIGSTOP
this process: a job stalled there until the test sends SIGCONT, or kills it).
``rankR`` limits a fault to global rank R (default: every rank); ``attemptA`` to torchrun's
restart attempt A (``TORCHELASTIC_RESTART_COUNT``; default 0, the first attempt), so a
restarted job that resumes before the armed iteration does not die there again.
``MINDSPEED_PACK_KILL_DURING_SAVE=N`` is the older spelling of ``write@N:kill``.
Unarmed (the normal case) every check is one dictionary lookup.

``MINDSPEED_PACK_START_DELAY="R:SECONDS[,...]"`` delays rank R's rendezvous on restart
attempts (not the first), as a slow node or a slow import does (:func:`delay_start`).
"""
from __future__ import annotations

import errno
import logging
import os
import signal
import time
from typing import Dict, Optional, Tuple

log = logging.getLogger(__name__)

FAULT_ENV = "MINDSPEED_PACK_FAULT"
START_DELAY_ENV = "MINDSPEED_PACK_START_DELAY"
LEGACY_KILL_ENV = "MINDSPEED_PACK_KILL_DURING_SAVE"
POINTS = ("step", "write", "written", "renamed", "tracker", "tokenized", "exported")
ACTIONS = ("kill", "enospc", "stop")


def parse(spec: str, rank: int = 0, attempt: int = 0) -> Dict[Tuple[str, int], str]:
    """The faults armed for this ``rank`` and restart ``attempt``:
    ``"write@7:kill,step@3:rank1:attempt2"`` -> {("write", 7): "kill"} on rank 0, attempt 0."""
    armed = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        where, *qualifiers = item.split(":")
        point, _, iteration = where.partition("@")
        action, only_rank, only_attempt = "kill", None, 0
        ok = point in POINTS and iteration.isdigit()
        for q in qualifiers:
            if q in ACTIONS:
                action = q
            elif q.startswith("rank") and q[4:].isdigit():
                only_rank = int(q[4:])
            elif q.startswith("attempt") and q[7:].isdigit():
                only_attempt = int(q[7:])
            else:
                ok = False
        if not ok:
            raise ValueError(f"{FAULT_ENV}={spec!r}: {item!r} is not POINT@ITER[:ACTION][:rankR][:attemptA] with "
                             f"POINT in {POINTS} and ACTION in {ACTIONS}")
        if only_rank in (None, rank) and only_attempt == attempt:
            armed[(point, int(iteration))] = action
    return armed


def restart_attempt() -> int:
    """torchrun's restart count of this worker group (0 on the first attempt and outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _armed() -> Dict[Tuple[str, int], str]:
    spec = os.environ.get(FAULT_ENV, "")
    legacy = os.environ.get(LEGACY_KILL_ENV)
    if legacy:
        spec = f"{spec},write@{legacy}:kill"
    return parse(spec, int(os.environ.get("RANK", "0")), restart_attempt()) if spec else {}


def action_at(point: str, iteration: Optional[int]) -> Optional[str]:
    """The action armed for ``point`` at ``iteration``, or None."""
    if iteration is None or not (os.environ.get(FAULT_ENV) or os.environ.get(LEGACY_KILL_ENV)):
        return None
    return _armed().get((point, int(iteration)))


def trigger(action: str, point: str, iteration: int, path: str = "") -> None:
    where = f" ({path})" if path else ""
    if action == "kill":
        log.warning("%s: killing this process at %s@%d%s", FAULT_ENV, point, iteration, where)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "stop":
        log.warning("%s: stopping this process at %s@%d%s (SIGCONT resumes it)", FAULT_ENV, point, iteration, where)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected by {FAULT_ENV} at {point}@{iteration})",
                  path or None)


def fire(point: str, iteration: Optional[int], path: str = "") -> None:
    """Kill or fail here if a fault is armed for ``point`` at ``iteration``."""
    action = action_at(point, iteration)
    if action:
        trigger(action, point, iteration, path)


def delay_start() -> None:
    """Sleep before the rendezvous when ``MINDSPEED_PACK_START_DELAY`` names this rank and this is a
    restart attempt: restarted workers then reach the store seconds apart."""
    spec = os.environ.get(START_DELAY_ENV)
    if not spec or restart_attempt() == 0:
        return
    rank = os.environ.get("RANK", "0")
    for item in filter(None, (s.strip() for s in spec.split(","))):
        who, _, seconds = item.partition(":")
        try:
            delay = float(seconds)
        except ValueError:
            raise ValueError(f"{START_DELAY_ENV}={spec!r}: {item!r} is not RANK:SECONDS") from None
        if who == rank:
            log.warning("%s: rank %s waits %.1f s before the rendezvous (restart attempt %d)", START_DELAY_ENV,
                        rank, delay, restart_attempt())
            time.sleep(delay)

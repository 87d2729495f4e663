"""Fault injection for crash-safety tests: die or fail at a named point of a run.

``MINDSPEED_PACK_FAULT="POINT@ITER[:ACTION][,...]"`` arms one or more faults; each fires
when the run reaches ``POINT`` at iteration ``ITER``:

=========  ==================================================================
``step``    after iteration ITER's optimizer step, before it is logged or saved
``write``   half-way through writing a rank file of the save of ITER
``written`` every rank file of the save written, before ``iter_N.tmp`` is renamed
``renamed`` ``iter_N`` in place, the tracker not yet moved to it
``tracker`` the tracker moved, the previous copy of a re-save not yet removed
=========  ==================================================================

``ACTION`` is ``kill`` (SIGKILL this process: a power cut as seen by the files; the
default) or ``enospc`` (raise ``OSError(ENOSPC)``, as a full disk does).
``MINDSPEED_PACK_KILL_DURING_SAVE=N`` is the older spelling of ``write@N:kill``.
Unarmed (the normal case) every check is one dictionary lookup.
"""
from __future__ import annotations

import errno
import logging
import os
import signal
from typing import Dict, Optional, Tuple

log = logging.getLogger(__name__)

FAULT_ENV = "MINDSPEED_PACK_FAULT"
LEGACY_KILL_ENV = "MINDSPEED_PACK_KILL_DURING_SAVE"
POINTS = ("step", "write", "written", "renamed", "tracker")
ACTIONS = ("kill", "enospc")


def parse(spec: str) -> Dict[Tuple[str, int], str]:
    """``"write@7:kill,step@3"`` -> {("write", 7): "kill", ("step", 3): "kill"}."""
    armed = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        where, _, action = item.partition(":")
        point, _, iteration = where.partition("@")
        action = action or "kill"
        if point not in POINTS or not iteration.isdigit() or action not in ACTIONS:
            raise ValueError(f"{FAULT_ENV}={spec!r}: {item!r} is not POINT@ITER[:ACTION] with POINT in {POINTS} "
                             f"and ACTION in {ACTIONS}")
        armed[(point, int(iteration))] = action
    return armed


def _armed() -> Dict[Tuple[str, int], str]:
    spec = os.environ.get(FAULT_ENV, "")
    legacy = os.environ.get(LEGACY_KILL_ENV)
    if legacy:
        spec = f"{spec},write@{legacy}:kill"
    return parse(spec) if spec else {}


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
    raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected by {FAULT_ENV} at {point}@{iteration})",
                  path or None)


def fire(point: str, iteration: Optional[int], path: str = "") -> None:
    """Kill or fail here if a fault is armed for ``point`` at ``iteration``."""
    action = action_at(point, iteration)
    if action:
        trigger(action, point, iteration, path)

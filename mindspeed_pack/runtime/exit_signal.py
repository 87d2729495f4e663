"""``--exit-signal-handler``: SIGTERM/SIGINT save a checkpoint and stop, unless a peer cannot take part.

The signal only sets a flag: after the current iteration every rank agrees (an all-reduce) and
then all save and exit together, as in Megatron-LM. When torchrun stops the survivors of a dead
rank, or a peer hangs, that agreement never comes, and the Python handler cannot even run while
the main thread sits in a collective. So a watcher thread, woken through
:func:`signal.set_wakeup_fd` whatever the main thread is doing, gives the rank ``grace``
seconds to reach the agreement; past it the rank exits at once (status 128 + signal) with one
line, without saving: the last complete checkpoint stays the one a restart resumes from. The time this rank
spends writing its checkpoint files (:meth:`ExitSignal.writing`) does not count against the grace, which
starts again when they are written: a checkpoint that takes longer to write than a few steps was cut off,
with the exit's own save, where the ranks were about to agree. The save's collectives do count: a hung peer
there still ends the rank within the grace.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Callable

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class ExitSignal:
    def __init__(self, grace_s: Callable[[], float], describe: Callable[[], str]):
        """``grace_s()``: seconds to reach the agreement, read when a signal arrives;
        ``describe()``: what the rank is doing (for the exit line)."""
        self.requested = False
        self._grace_s = grace_s
        self._describe = describe
        self._agreed = threading.Event()
        self._idle = threading.Event()  # set when this rank is not writing checkpoint files
        self._idle.set()
        read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._previous = {signum: signal.getsignal(signum) for signum in SIGNALS}
        self._previous_fd = signal.set_wakeup_fd(self._write_fd)
        for signum in SIGNALS:
            signal.signal(signum, self._on_signal)
        threading.Thread(target=self._watch, args=(read_fd,), name="exit-signal-watch", daemon=True).start()

    def close(self) -> None:
        """Give the signals back (a run inside a longer-lived process); the watcher stops (a signal that came after
        the last iteration leaves the run to end as it does)."""
        self._agreed.set()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._write_fd)  # the watcher reads end-of-file and returns

    def _on_signal(self, signum, frame) -> None:
        if not self.requested:
            log.warning("signal %d received: saving a checkpoint after this iteration (if every rank agrees) and "
                        "exiting", signum)
        self.requested = True

    def agreed(self) -> None:
        """Every rank agreed to stop: they are all alive, so the save may take its time."""
        self._agreed.set()

    @contextlib.contextmanager
    def writing(self):
        """This rank's checkpoint files being written: the grace waits for them, then starts again."""
        self._idle.clear()
        try:
            yield
        finally:
            self._idle.set()

    def _watch(self, read_fd: int) -> None:
        with os.fdopen(read_fd, "rb", buffering=0) as wakeups:
            while True:
                byte = wakeups.read(1)
                if not byte:
                    return  # closed: the run ended
                if byte[0] in SIGNALS:
                    signum = byte[0]
                    break
        while True:
            grace = self._grace_s()
            if self._agreed.wait(grace):
                return
            if self._idle.is_set():
                break
            self._idle.wait()  # its files being written: their end, then a new grace to reach the agreement
        print(f"rank {os.environ.get('RANK', '0')}: signal {signum} received during {self._describe()} and the "
              f"ranks did not agree to stop within {grace:.0f} s (a peer is dead or hung): exiting without saving",
              file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(128 + signum)

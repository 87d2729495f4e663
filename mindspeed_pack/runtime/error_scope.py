"""Which ranks print an error that many ranks hit alike: one line per job, not one per rank.

Every rank of a torchrun job parses the same command line and runs the same checks, so a bad flag was printed
by all of them (8 interleaved copies per node). An error says how far it is shared, its ``scope``:

- ``"job"``: it follows from what every rank has alike (the command line; after the ranks met, what they
  exchanged, e.g. ``check_same_flags``). Global rank 0 prints it (``RANK``: before the process group exists
  the environment is all there is, and after it is the group's rank).
- ``"node"``: it follows from files or the host (a ``--config`` file, ``--load``'s config.json, host memory):
  another node may see other files, so each node's local rank 0 prints it (``LOCAL_RANK``).
- ``"rank"`` (an error without a scope): only some ranks may hit it (a rank's own checkpoint shard, a lost
  peer): every rank that hits it prints it.

Every rank still exits with the same code; the launcher reports the failed ranks.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

SCOPES = ("job", "node", "rank")


def scope_of(error: BaseException) -> str:
    """The ``scope`` an error was raised with; ``"rank"`` when it has none."""
    scope = getattr(error, "scope", None)
    return scope if scope in SCOPES else "rank"


def _env_rank(name: str) -> int:
    try:
        return int(os.environ.get(name, "0"))
    except ValueError:  # not a launcher's value: print rather than hide the error
        return 0


def prints_here(scope: str) -> bool:
    """Whether this process prints an error of ``scope`` (:data:`SCOPES`). One that does not waits
    :data:`QUIET_EXIT_DELAY_S` first (:func:`leave_it_to_the_printer`)."""
    if scope == "job":  # torchrun's RANK is the process group's rank once it exists (a world of one: unset)
        printer = _env_rank("RANK") == 0
    elif scope == "node":
        printer = _env_rank("LOCAL_RANK") == 0
    else:
        printer = True
    if not printer:
        leave_it_to_the_printer()
    return printer


# torchrun stops a job's other processes (SIGTERM) as soon as one of them exits: a rank that leaves the line to
# rank 0 and exits at once could have rank 0 killed before it prints it (it runs the same checks at about the
# same moment, but on a busy host a second or two later)
QUIET_EXIT_DELAY_S = 3.0


def leave_it_to_the_printer() -> None:
    """Wait :data:`QUIET_EXIT_DELAY_S` before this rank exits without printing the error."""
    import time

    time.sleep(QUIET_EXIT_DELAY_S)


def scoped(error: BaseException, scope: str) -> BaseException:
    """``error`` with its ``scope`` set (``raise scoped(DataError(...), "job")``)."""
    assert scope in SCOPES, scope
    error.scope = scope
    return error


@contextmanager
def files_read_alike(*types, scope: str = "node"):
    """Errors of ``types`` raised inside, without a scope of their own, get ``scope``: checks that every rank runs
    on the same files (a data prefix, ``--save``'s record) fail alike on every rank of a node, and each node's local
    rank 0 says so for its node (another node may see other files). ``scope="job"``: what the ranks exchanged."""
    assert scope in SCOPES, scope
    try:
        yield
    except types as error:
        if getattr(error, "scope", None) not in SCOPES:
            error.scope = scope
        raise

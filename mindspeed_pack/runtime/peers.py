"""What a rank was waiting for when a peer died or hung: one line instead of a hang or a C++ trace.

A collective whose peer is dead fails at once (gloo: "Connection closed by peer"); one whose
peer is hung (stopped, deadlocked, unreachable) fails after ``--distributed-timeout-minutes``.
Both surface as a bare ``RuntimeError`` from the backend. :func:`waiting_for` names the phase
(``iteration 7``, ``the save of iteration 6``) so such an error becomes a :class:`PeerFailure`
whose message says what this rank was waiting for; the scripts print it as one line and
exit 1, and torchrun restarts the job (``--max-restarts``).
"""
from __future__ import annotations

import contextlib
import os
import re
import socket

import torch
import torch.distributed as dist

from mindspeed_pack.runtime.platform import cuda_usable, node_and_host
from mindspeed_pack.runtime.rendezvous import RendezvousTimeout, first_line

# what gloo, NCCL and the store say when a peer is gone or late
_BACKEND_FAILURE = re.compile(r"gloo|nccl|Connection (closed|reset|refused)|Timed out|timed out|timeout|"
                              r"Socket|pair closure|Broken pipe", re.IGNORECASE)
_TIMEOUT = re.compile(r"Timed out|timeout", re.IGNORECASE)


# where every rank runs ({address: [(rank, node, host), ...]}), recorded when the ranks meet (check_same_flags)
_PLACES: dict = {}
_ADDRESS = re.compile(r"\[([0-9a-fA-F.:]+)\]:\d+")
_LOOPBACK = ("127.0.0.1", "::1")


def this_place() -> tuple:
    """(node, host, addresses) of this process: :func:`node_and_host` and the host's IP addresses."""
    node, host = node_and_host()
    try:
        addresses = socket.gethostbyname_ex(host)[2]
    except OSError:
        addresses = []
    return node, host, sorted(set(addresses) | set(_LOOPBACK))


def record_places(places: list) -> None:
    """Remember ``places[rank]`` (:func:`this_place` of every rank) for the failure message."""
    _PLACES.clear()
    for rank, (node, host, addresses) in enumerate(places):
        for address in addresses:
            _PLACES.setdefault(address, []).append((rank, node, host))


def _ranks_at(message: str) -> str:
    """' (ranks 8-15 run there: node 1, host h2)' for the peer address in a backend's message; '' if unknown. A
    loopback address is a peer on this rank's host."""
    found = _ADDRESS.search(message)
    if not found or not _PLACES:
        return ""
    address = found.group(1)
    me = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    here = [p for p in _PLACES.get(address, []) if p[0] != me]
    if address in _LOOPBACK:
        host = next((h for r, _, h in _PLACES[address] if r == me), None)
        here = [p for p in here if p[2] == host]
    if not here:
        return ""
    ranks = [r for r, _, _ in here]
    spans = _spans(ranks)  # "8-15", "3, 5"
    nodes = sorted({n for _, n, _ in here})
    hosts = sorted({h for _, _, h in here})
    return (f" (the peer at {address} is {f'one of ranks {spans}' if len(ranks) > 1 else f'rank {spans}'}: node "
            f"{', '.join(map(str, nodes))}, host {', '.join(hosts)})")


def _spans(ranks: list) -> str:
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)


class PeerFailure(RuntimeError):
    """A collective could not complete: a peer is dead, hung or unreachable."""


def is_backend_failure(e: BaseException) -> bool:
    if isinstance(e, (dist.DistError, RendezvousTimeout)):
        return True
    return type(e) is RuntimeError and bool(_BACKEND_FAILURE.search(str(e)))


@contextlib.contextmanager
def waiting_for(what, timeout_minutes: float):
    """Turn a backend failure inside the block into a :class:`PeerFailure` naming ``what`` (a string,
    or a function returning one when the failure happens)."""
    try:
        yield
    except (PeerFailure, RendezvousTimeout):
        raise
    except Exception as e:
        if not is_backend_failure(e):
            raise
        what = what() if callable(what) else what
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        first = first_line(e)
        if _TIMEOUT.search(first):
            cause = (f"timed out after {timeout_minutes:g} min (--distributed-timeout-minutes) waiting for a peer "
                     f"(hung or unreachable)")
        else:
            cause = "lost a peer (it died or closed its connection)"
        raise PeerFailure(f"rank {rank}: {cause} during {what}: {first}{_ranks_at(first)}") from None


def all_ranks_ok(error) -> bool:
    """True when no rank failed (every rank must agree, or the others would hang in a barrier)."""
    failed = torch.tensor([int(error is not None)], device=torch.cuda.current_device() if cuda_usable() else "cpu")
    dist.all_reduce(failed)
    return not failed.item()

"""A process-group store that a torchrun restart can never confuse with the previous attempt's.

torchrun (static or c10d rendezvous) hands its workers one key-value store for the whole job
(``MASTER_ADDR:MASTER_PORT``, ``TORCHELASTIC_USE_AGENT_STORE``). ``init_process_group`` writes
the same keys under it on every attempt, so a restarted worker that arrives before its peer
reads the peer's address from the dead attempt and fails or waits. ``TORCHELASTIC_RESTART_COUNT``
cannot scope the keys: each node's agent counts its own restarts, and under c10d a node whose
workers did not fail restarts without counting.

Instead the workers of an attempt agree on a fresh *generation* through the store itself:

- rank 0 draws the next generation ``g`` (an atomic add), publishes it as the leader key and
  waits for ``join/g/R`` of every other rank R; then it acknowledges each joiner's nonce;
- rank R draws a random nonce, writes ``join/g/R`` for the generation it reads and waits for
  the acknowledgement of *its own* nonce, re-reading the leader key meanwhile (a value left
  by a dead attempt is never acknowledged; the new rank 0 soon replaces it).

Keys of generation ``g`` are new by construction, so nothing stale is read. The process
group and every later group (megatron's ``new_group`` calls use the default store) live
under ``mindspeed_pack/generation<g>/``. The same holds for gloo and NCCL, one node or many,
and without torchrun (rank 0 then hosts the store, as ``env://`` does).
"""
from __future__ import annotations

import datetime
import logging
import os
import re
import time
import uuid

import torch.distributed as dist

log = logging.getLogger(__name__)

PREFIX = "mindspeed_pack"
GENERATION_KEY = f"{PREFIX}/generation"
LEADER_KEY = f"{PREFIX}/leader"
POLL_S = 0.5  # how often a joiner re-reads the leader key while it waits


class RendezvousTimeout(RuntimeError):
    """The workers of this attempt did not all meet within ``--distributed-timeout-minutes``."""


class StorePortTaken(RendezvousTimeout):
    """Rank 0 could not host the key-value store: ``MASTER_PORT`` is in use (the workers cannot meet at all)."""


def attempt_store(rank: int, world_size: int, timeout: datetime.timedelta) -> tuple:
    """(store scoped to this attempt, generation) for ``init_process_group(store=...)``."""
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    try:
        base, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    except (RuntimeError, ValueError) as e:  # a store that never answered (DistNetworkError, DistStoreError)
        cause = first_line(e)
        if "EADDRINUSE" in cause or "address already in use" in cause.lower():
            raise StorePortTaken(f"rank {rank}: cannot host the key-value store at {where}: the port is in use "
                                 f"(another job, or a process of an earlier run still alive); set another "
                                 f"MASTER_PORT ({cause})") from None
        raise RendezvousTimeout(f"rank {rank}: no key-value store at {where} within {_minutes(timeout)} "
                                f"(--distributed-timeout-minutes): {cause}") from None
    base.set_timeout(timeout)
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        generation = _lead(base, world_size, deadline, where, timeout)
    else:
        generation = _join(base, rank, deadline, where, timeout)
    return dist.PrefixStore(f"{PREFIX}/generation{generation}", base), generation


def _lead(store, world_size: int, deadline: float, where: str, timeout) -> int:
    generation = store.add(GENERATION_KEY, 1)
    store.set(LEADER_KEY, str(generation))
    keys = [f"{PREFIX}/join/{generation}/{r}" for r in range(1, world_size)]
    if keys:
        try:
            store.wait(keys, _remaining(deadline))
        except RuntimeError:
            missing = [r for r, key in zip(range(1, world_size), keys) if not store.check([key])]
            raise RendezvousTimeout(
                f"rank 0: timed out after {_minutes(timeout)} (--distributed-timeout-minutes) waiting for rank(s) "
                f"{_ranks(missing)} to join attempt {generation} at {where}") from None
        for nonce in store.multi_get(keys):
            store.set(f"{PREFIX}/ack/{nonce.decode()}", str(generation))
    return generation


def _join(store, rank: int, deadline: float, where: str, timeout) -> int:
    nonce = f"{rank}.{uuid.uuid4().hex}"
    ack = f"{PREFIX}/ack/{nonce}"
    joined = None
    while True:
        if store.check([LEADER_KEY]):
            leader = int(store.get(LEADER_KEY))
            if leader != joined:  # a new rank 0 (or the first one read): offer ourselves to it
                store.set(f"{PREFIX}/join/{leader}/{rank}", nonce)
                joined = leader
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousTimeout(
                f"rank {rank}: timed out after {_minutes(timeout)} (--distributed-timeout-minutes) waiting for rank 0 "
                f"to open this attempt at {where}" + (f" (last seen: attempt {joined}, which never answered)"
                                                      if joined is not None else ""))
        try:
            store.wait([ack], datetime.timedelta(seconds=min(POLL_S, left)))
        except RuntimeError:
            continue
        return int(store.get(ack))


def _remaining(deadline: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(0.001, deadline - time.monotonic()))


def _minutes(timeout: datetime.timedelta) -> str:
    return f"{timeout.total_seconds() / 60:g} min"


def _ranks(ranks: list) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def first_line(e: BaseException) -> str:
    """The first line of a backend error, without the C++ source position gloo puts in front."""
    line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", line)

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

Keys of generation ``g`` are new by construction, so nothing stale is read.

A rank that stops before the ranks meet (bad input on one node: another ``--seq-length`` than the packs', a
missing file) calls :func:`announce_stop`: it leaves its error line under ``STOPPED_KEY``, and the ranks waiting
in :func:`_lead` / :func:`_join` stop within ``POLL_S`` with that line, naming its rank, node and host, instead of
waiting out ``--distributed-timeout-minutes`` in silence and then blaming a rank that "did not join". Only on a
job's first attempt: the key is not scoped to an attempt (nothing is, before the ranks meet), and a restart must not
stop on the error of the attempt before it. The process
group and every later group (megatron's ``new_group`` calls use the default store) live
under ``mindspeed_pack/generation<g>/``. The same holds for gloo and NCCL, one node or many,
and without torchrun (rank 0 then hosts the store, as ``env://`` does).
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import re
import time
import uuid

import torch.distributed as dist

from mindspeed_pack.runtime.platform import node_and_host

log = logging.getLogger(__name__)

PREFIX = "mindspeed_pack"
GENERATION_KEY = f"{PREFIX}/generation"
LEADER_KEY = f"{PREFIX}/leader"
STOPPED_KEY = f"{PREFIX}/stopped"  # the error line of a rank that stopped before the ranks met (announce_stop)
POLL_S = 0.5  # how often a waiting rank re-reads the leader key and STOPPED_KEY
ANNOUNCE_TIMEOUT_S = 5.0  # how long a stopping rank tries to reach the store to say why


class RendezvousTimeout(RuntimeError):
    """The workers of this attempt did not all meet within ``--distributed-timeout-minutes``."""


class StorePortTaken(RendezvousTimeout):
    """Rank 0 could not host the key-value store: ``MASTER_PORT`` is in use (the workers cannot meet at all)."""


class PeerStoppedEarly(RendezvousTimeout):
    """Another rank stopped before the ranks met (its error line is in the message): this rank stops too."""


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
        while True:
            try:
                store.wait(keys, datetime.timedelta(seconds=min(POLL_S, max(0.001, deadline - time.monotonic()))))
                break
            except RuntimeError:
                pass
            _raise_if_stopped(store, 0)
            if time.monotonic() >= deadline:
                missing = [r for r, key in zip(range(1, world_size), keys) if not store.check([key])]
                raise RendezvousTimeout(
                    f"rank 0: timed out after {_minutes(timeout)} (--distributed-timeout-minutes) waiting for "
                    f"rank(s) {_ranks(missing)} to join attempt {generation} at {where}")
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
            _raise_if_stopped(store, rank)
            continue
        return int(store.get(ack))


def announce_stop(error: str) -> None:
    """Leave ``error`` (this rank's one-line reason to stop) where the ranks waiting to meet it look (best effort,
    :data:`ANNOUNCE_TIMEOUT_S` at most): only before the ranks met, under a launcher, on the job's first attempt."""
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1") or 1) < 2 or "RANK" not in os.environ:
        return
    rank = int(os.environ["RANK"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if not _first_attempt() or (rank == 0 and not agent_store):  # rank 0 without torchrun: nobody hosts a store
        return
    node, host = node_and_host()
    record = json.dumps({"rank": rank, "node": node, "host": host, "error": error})
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=ANNOUNCE_TIMEOUT_S))
        store.set(STOPPED_KEY, record)
    except (RuntimeError, ValueError, KeyError) as e:  # no store to reach: the peers time out as before
        log.debug("could not tell the other ranks why rank %d stopped: %s", rank, first_line(e))


def _raise_if_stopped(store, rank: int) -> None:
    if not _first_attempt() or not store.check([STOPPED_KEY]):
        return
    stopped = json.loads(store.get(STOPPED_KEY))
    raise PeerStoppedEarly(f"rank {rank}: rank {stopped['rank']} (node {stopped['node']}, host {stopped['host']}) "
                           f"stopped before the ranks met, so this rank stops too; its error: {stopped['error']}")


def _first_attempt() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) == 0


def _minutes(timeout: datetime.timedelta) -> str:
    return f"{timeout.total_seconds() / 60:g} min"


def _ranks(ranks: list) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def first_line(e: BaseException) -> str:
    """The first line of a backend error, without the C++ source position gloo puts in front."""
    line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", line)

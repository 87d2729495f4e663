"""Process-group and seed initialisation for torchrun jobs, on CUDA (nccl) or CPU (gloo).

The process group meets through a store scoped to this restart attempt
(:mod:`mindspeed_pack.runtime.rendezvous`), and it and megatron's groups wait at most
``--distributed-timeout-minutes`` for a peer.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import random
import socket
import sys

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from mindspeed_pack.runtime import faults, peers, platform
from mindspeed_pack.runtime.error_scope import scoped
from mindspeed_pack.runtime.rendezvous import attempt_store

_LAYOUT = None  # (TP, PP, CP, EP, dynamic CP) of the megatron groups this module made


class LaunchError(RuntimeError):
    """The process was started in a way no rendezvous can complete (the message says how to start it)."""


def initialize_distributed(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    seed: int = 1234,
    timeout_minutes: float = 10,
    backend: str | None = None,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    dynamic_context_parallel: bool = False,
    flags: dict | None = None,
) -> None:
    """Initialise torch.distributed from torchrun's environment and megatron's groups.

    A plain ``python script.py`` (no torchrun) runs as a world of one process. ``backend``
    (``--distributed-backend``) defaults to nccl with CUDA, gloo without. ``timeout_minutes``
    (``--distributed-timeout-minutes``, fractions allowed) bounds the rendezvous and every collective.
    ``dynamic_context_parallel`` (``--sequence-packing-scheduler default_dynamic_cp``): megatron's sub-groups
    of every power-of-two size of the data x context parallel ranks are made too (:func:`dynamic_cp_group`).
    Called again with the same layout, a no-op; with another (a later run in the same processes), megatron's
    groups are made anew. ``flags`` ({flag: value}, the run's): checked to be the same on every rank once the
    process group exists, before megatron's groups are made from them (:func:`check_same_flags`).
    """
    if not platform.cuda_usable():
        platform.enable()
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        if "RANK" not in os.environ and world_size > 1:
            raise LaunchError(f"WORLD_SIZE={world_size} but RANK is not set: this process was not started by a "
                              f"launcher. Start the job with torchrun (torchrun --nproc-per-node {world_size} "
                              f"{os.path.basename(sys.argv[0]) or 'posttrain.py'} ...), or unset WORLD_SIZE to run "
                              "one process")
        if "RANK" not in os.environ:
            # a plain `python script.py`: a world of one on a port nobody else holds
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ["MASTER_PORT"] = str(_free_port())
        if platform.cuda_usable():
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
        faults.delay_start()
        timeout = datetime.timedelta(minutes=timeout_minutes)
        store, generation = attempt_store(rank, world_size, timeout)
        dist.init_process_group(backend=backend or platform.default_backend(), store=store, rank=rank,
                                world_size=world_size, timeout=timeout)
        if rank == 0 and faults.restart_attempt() > 0:
            logging.getLogger(__name__).info("restart %d of this job: its processes met as attempt %d",
                                             faults.restart_attempt(), generation)
        if flags is not None:
            check_same_flags(flags)
    model_parallel = tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size
    if world_size % model_parallel != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor ({tensor_model_parallel_size}) x "
            f"pipeline ({pipeline_model_parallel_size}) x context ({context_parallel_size}) parallel size"
        )
    global _LAYOUT
    layout = (tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size,
              expert_model_parallel_size, dynamic_context_parallel)
    if parallel_state.model_parallel_is_initialized() and _LAYOUT not in (None, layout):
        # an earlier run in this process (runs one after the other in one job) made another layout's groups
        release_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size,
                                                 context_parallel_size=context_parallel_size,
                                                 expert_model_parallel_size=expert_model_parallel_size,
                                                 distributed_timeout_minutes=timeout_minutes,
                                                 hybrid_context_parallel=dynamic_context_parallel)
        _LAYOUT = layout
    set_seed(seed)


def check_same_flags(flags: dict) -> None:
    """Every rank was started with the same ``flags`` ({flag: value}); else :class:`LaunchError` on every rank,
    naming the ranks, nodes and values that differ. Nodes started with different commands (another --lr, --seq-length,
    --train-iters or --data-path on one node) otherwise train apart silently (their data-parallel replicas'
    weights drift) or meet in different collectives and wait there until the timeout, blaming a hung peer."""
    mine = json.dumps(flags, sort_keys=True, default=str)
    gathered = [None] * dist.get_world_size()
    # one gather: the digest, and where the rank runs (a lost peer's address then names its ranks: peers.py)
    dist.all_gather_object(gathered, (hashlib.sha256(mine.encode()).hexdigest(), peers.this_place()))
    digests = [digest for digest, _ in gathered]
    peers.record_places([place for _, place in gathered])
    if len(set(digests)) == 1:
        return
    ranks = [None] * dist.get_world_size()  # only now the whole set: one rank's, and where each rank runs
    dist.all_gather_object(ranks, (flags, *platform.node_and_host()))
    reference, *_ = ranks[0]
    lines = []
    for rank, (theirs, node, host) in enumerate(ranks):
        differing = [f"--{k} {theirs.get(k)!r} there, {reference.get(k)!r} on rank 0"
                     for k in sorted(set(theirs) | set(reference)) if theirs.get(k) != reference.get(k)]
        if differing:
            lines.append(f"rank {rank} (node {node}, host {host}): {'; '.join(differing[:5])}")
    paths = sorted({k for theirs, _, _ in ranks for k in set(theirs) | set(reference)
                    if theirs.get(k) != reference.get(k) and k in _PATH_HINTS})
    hints = "".join(f"; {_PATH_HINTS[k]}" for k in paths)
    # every rank gathered the same: rank 0 says it for the job (runtime.error_scope)
    raise scoped(LaunchError(f"the ranks were started with different flags: {' | '.join(lines[:4])}"
                             f"{f' (and {len(lines) - 4} more ranks)' if len(lines) > 4 else ''}; start every node "
                             f"with the same command (only --node-rank differs){hints}"), "job")


# what to do when a path differs between nodes (node-local copies mounted at different places)
_PATH_HINTS = {
    "data-path": "per-node copies of the data must sit at the same path on every node (a symlink will do), or on a "
                 "filesystem every node shares",
    "save": "--save must be one directory every node sees (a shared filesystem): each node's own directory leaves "
            "the checkpoint on node 0 only, and a resume is refused",
    "load": "--load must be the same path on every node (a shared filesystem, or a copy at the same path)",
}


def initialize_from_args(args, flags: dict | None = None) -> None:
    """:func:`initialize_distributed` with the run's flags, the deterministic environment set before
    the process group exists; called again (e.g. after raw data was prepared with the groups), a no-op.
    ``flags``: the values every rank must share (``resolved_config.flag_values``), checked once the ranks meet."""
    if args.deterministic_mode:
        # cuBLAS needs a fixed workspace for deterministic GEMMs; NCCL must not pick algorithms per run
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        os.environ.setdefault("NCCL_ALGO", "Ring")
        os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")  # TE fused attention backward
    initialize_distributed(args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.seed,
                           args.distributed_timeout_minutes, backend=args.distributed_backend,
                           context_parallel_size=args.context_parallel_size,
                           expert_model_parallel_size=args.expert_model_parallel_size,
                           dynamic_context_parallel=getattr(args, "sequence_packing_scheduler", None)
                           == "default_dynamic_cp", flags=flags)


def dynamic_cp_group(size: int):
    """The CP group of ``size`` ranks this rank belongs to under dynamic context parallelism: the aligned
    block ``[k size, (k+1) size)`` of its data x context parallel ranks (None: one rank, no CP)."""
    if size == 1:
        return None
    if size == parallel_state.get_data_parallel_world_size(with_context_parallel=True):
        return parallel_state.get_data_parallel_group(with_context_parallel=True)
    return parallel_state.get_hybrid_data_context_parallel_groups(group_size=size)


def check_dynamic_cp_groups(max_cp: int) -> None:
    """Every sub-group up to ``max_cp`` ranks is the aligned block of the pool the planner assumes, with
    group ranks in pool order (the planner places a row's zigzag shares by them)."""
    pool = dist.get_process_group_ranks(parallel_state.get_data_parallel_group(with_context_parallel=True))
    me = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    size = 2
    while size <= max_cp:
        block = pool[me - me % size:me - me % size + size]
        group = dynamic_cp_group(size)
        if dist.get_process_group_ranks(group) != block or group.rank() != me % size:
            raise RuntimeError(f"dynamic CP: the sub-group of {size} ranks of rank {dist.get_rank()} holds ranks "
                               f"{dist.get_process_group_ranks(group)} (its rank {group.rank()}), not the aligned "
                               f"block {block} of the data x context parallel ranks {pool}")
        size *= 2


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def set_seed(seed: int) -> None:
    """Seed python, numpy, torch and megatron's model-parallel RNG tracker.

    Pipeline stages get different seeds (as in Megatron-LM) so their dropout masks differ.
    """
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    from megatron.core.tensor_parallel import random as mp_random

    mp_random.get_cuda_rng_tracker().reset()
    model_parallel_cuda_manual_seed(seed)


def release_model_parallel() -> None:
    """megatron's groups of the last layout dropped, and released: ``destroy_model_parallel`` only forgets them,
    while c10d keeps every group it made (a gloo group's threads too) until it is destroyed. A process that runs
    layout after layout (the tests' jobs) gathered thousands of idle gloo threads, and its steps slowed tenfold.
    Every group but the default one is destroyed (none of them is used across layouts)."""
    from torch.distributed import distributed_c10d as c10d

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        for group in list(c10d._world.pg_map):
            if group is not c10d.GroupMember.WORLD:
                dist.destroy_process_group(group)


def destroy() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()

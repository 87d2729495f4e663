"""Run a function in N local processes as a torch.distributed (gloo) job, for tests.

Two ways, both with torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``) so code under test initialises exactly as it would under
``torchrun`` (e.g. ``initialize_distributed(tp, pp)``):

- :func:`run_distributed` runs ``fn(*args)`` in fresh processes (forked from a server that has
  only imported torch and megatron, :mod:`tests.preloaded`; never ``fork`` of this process:
  forking a process whose OpenMP pool is live can hang) and returns every rank's return value;
  an exception in any rank is re-raised here with that rank's traceback, and the other ranks
  are stopped instead of waiting forever in a collective.
- :func:`run_torchrun` runs a script/module under ``python -m torch.distributed.run``, for
  end-to-end tests of command-line entry points.

``fn`` must be importable by name (a module-level function), as it is pickled to the ranks.
Return values travel through files (``torch.save``), so tensors of any size are fine.
"""
from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from tests.preloaded import adopt, preloaded_context


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(rank: int, world_size: int, port: int) -> Dict[str, str]:
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def _child(rank: int, world_size: int, port: int, threads: int, parent_env: Dict[str, str], env: Dict[str, str],
           cwd: str, out_dir: str, fn, args, kwargs):
    adopt({**parent_env, **torchrun_env(rank, world_size, port), **env}, cwd, threads)
    try:
        result = fn(*args, **kwargs)
        torch.save({"ok": True, "result": result}, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:  # report everything, including SystemExit from argparse
        torch.save({"ok": False, "error": traceback.format_exc()}, os.path.join(out_dir, f"rank{rank}.pt"))
        raise SystemExit(1)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


class DistributedError(RuntimeError):
    """A rank failed (or timed out); the message carries every failed rank's traceback."""


def run_distributed(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    threads_per_process: Optional[int] = None,
    env: Optional[Dict[str, str]] = None,
    start_method: Optional[str] = None,
    **kwargs: Any,
) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` on ranks ``0..world_size-1``; return their results by rank.

    ``start_method``: ``"spawn"`` for ranks that must start from nothing (the CUDA tests), else the
    preloaded server's processes.

    ``threads_per_process`` defaults to ``OMP_NUM_THREADS`` (the tests set 1: tiny models gain
    nothing from more threads, and ranks sharing a core must not oversubscribe it). ``env`` adds
    environment variables (set before ``fn`` runs, after torchrun's).
    """
    threads = threads_per_process or max(1, int(os.environ.get("OMP_NUM_THREADS") or 1))
    ctx = multiprocessing.get_context(start_method) if start_method else preloaded_context()
    with tempfile.TemporaryDirectory(prefix="dist_harness_") as out_dir:
        port = free_port()
        procs = []
        for rank in range(world_size):
            p = ctx.Process(
                target=_child,
                args=(rank, world_size, port, threads, dict(os.environ), dict(env or {}), os.getcwd(), out_dir, fn, args,
                      kwargs),
                daemon=False,
            )
            p.start()
            procs.append(p)
        _wait_all(procs, timeout)
        results, errors = [], []
        for rank, p in enumerate(procs):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            if not os.path.exists(path):
                errors.append(f"--- rank {rank}: exited with code {p.exitcode} and no result "
                              f"(killed, timed out after {timeout:.0f}s, or crashed)")
                results.append(None)
                continue
            record = torch.load(path, weights_only=False)
            if record["ok"]:
                results.append(record["result"])
            else:
                errors.append(f"--- rank {rank} raised:\n{record['error']}")
                results.append(None)
        if errors:
            name = getattr(fn, "__qualname__", repr(fn))
            raise DistributedError(f"{name} failed on {len(errors)} of {world_size} ranks:\n" + "\n".join(errors))
        return results


def _wait_all(procs, timeout: float) -> None:
    """Join every process; once one fails or time runs out, stop the rest (they would hang)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in procs if p.is_alive()]
        failed = any(p.exitcode not in (None, 0) for p in procs)
        if not alive:
            return
        if failed or time.monotonic() > deadline:
            grace = time.monotonic() + (5.0 if failed else 0.0)  # let peers write their own error first
            while time.monotonic() < grace and any(p.is_alive() for p in procs):
                time.sleep(0.05)
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
                    p.join()
            return
        time.sleep(0.05)


def run_torchrun(
    argv: Sequence[str],
    nproc: int,
    *,
    module: bool = False,
    timeout: float = 600.0,
    env: Optional[Dict[str, str]] = None,
    cwd: Optional[str] = None,
    launcher_args: Sequence[str] = ("--standalone",),
) -> subprocess.CompletedProcess:
    """Run ``python -m torch.distributed.run --nproc-per-node N [launcher_args] [-m] argv...``.

    Returns the completed process (stdout/stderr captured as text); raises
    :class:`DistributedError` with the output tail when it fails or times out.
    """
    # --standalone (the default) picks its own rendezvous port; a fixed one would collide across tests
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher_args, f"--nproc-per-node={nproc}"]
    cmd += (["-m"] if module else []) + list(argv)
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    full_env.update(env or {})
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"")[-4000:] if isinstance(e.stdout, bytes) else (e.stdout or "")[-4000:]
        raise DistributedError(f"{' '.join(cmd)} timed out after {timeout:.0f}s; output tail:\n{out}") from None
    if proc.returncode != 0:
        raise DistributedError(
            f"{' '.join(cmd)} exited with {proc.returncode}; stderr tail:\n{proc.stderr[-6000:]}\n"
            f"stdout tail:\n{proc.stdout[-2000:]}"
        )
    return proc

"""Processes that start without paying for ``import torch, megatron`` (seconds each), for tests.

Every run of a script (``python posttrain.py ...``, a torchrun job of it) and every rank of
:func:`tests.dist_harness.run_distributed` is a fresh process forked from one server per test
session that has only *imported* torch, megatron-core, transformers and the scripts: it never ran
a tensor op, so no OpenMP pool is live when it forks (the reason the harness never uses plain
``fork``), and no training state exists in it. The child then takes the caller's environment,
working directory, argv and thread count, so a run is what the command line would do, minus
the interpreter start:

* :func:`preloaded_context`: the ``multiprocessing`` context whose processes start this way.
* :func:`run_script`: ``python SCRIPT ARGV`` (or ``torchrun --nproc-per-node N SCRIPT ARGV``)
  as a :class:`subprocess.CompletedProcess` with the exit code and the captured text.

Launchers themselves (torchrun's restarts and rendezvous, the example shell scripts) are tested
with real processes in ``test_elastic.py``, ``test_multinode.py`` and ``test_example_*.py``.
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import time
from typing import Dict, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRELOAD = ["torch", "megatron.core", "transformers", "mindspeed_pack.training.trainer", "posttrain", "pretrain_gpt",
           "tests.dist_harness"]


def preloaded_context():
    """The ``forkserver`` context, its server preloaded with :data:`PRELOAD` (started on first use)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def adopt(env: Dict[str, str], cwd: str, threads: int) -> None:
    """In a forked child: take the caller's environment, directory and thread count, as a new process would."""
    import torch

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    torch.set_num_threads(threads)


def _threads(env: Dict[str, str]) -> int:
    try:
        return max(1, int(env.get("OMP_NUM_THREADS", "")))
    except ValueError:
        return max(1, os.cpu_count() or 1)


def _script_child(script: str, argv: Sequence[str], env: Dict[str, str], cwd: str, out: str, err: str) -> None:
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    adopt(env, cwd, _threads(env))
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # what the interpreter runs at exit; multiprocessing's children skip it


def _torchrun_env(rank: int, nproc: int, port: int) -> Dict[str, str]:
    from tests.dist_harness import torchrun_env

    return {**torchrun_env(rank, nproc, port), "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(nproc), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}


def run_script(script: str, argv: Sequence[str], *, nproc: int = 1, env: Optional[Dict[str, str]] = None,
               cwd: str = ROOT, timeout: float = 600.0) -> subprocess.CompletedProcess:
    """Run ``script`` with ``argv`` in ``nproc`` preloaded processes (ranks with torchrun's variables when
    ``nproc > 1``); ``env`` is the whole environment (default: this one). Like torchrun, once a rank fails
    the others are stopped (SIGTERM) and the job's exit code is 1; one process returns its own code
    (negative: killed by that signal). Output is each rank's, in rank order; a run past ``timeout``
    is killed and raises :class:`subprocess.TimeoutExpired`."""
    from tests.dist_harness import free_port

    env = dict(os.environ if env is None else env)
    script = os.path.join(ROOT, script) if not os.path.isabs(script) else script
    ctx = preloaded_context()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="preloaded_run_") as tmp:
        procs, files = [], []
        for rank in range(nproc):
            rank_env = env if nproc == 1 else {**env, **_torchrun_env(rank, nproc, port)}
            out, err = os.path.join(tmp, f"{rank}.out"), os.path.join(tmp, f"{rank}.err")
            p = ctx.Process(target=_script_child, args=(script, list(argv), rank_env, cwd, out, err))
            p.start()
            procs.append(p)
            files.append((out, err))
        timed_out = not _wait(procs, timeout)

        def read(i):
            return "".join(open(f[i], errors="replace").read() if os.path.exists(f[i]) else "" for f in files)

        stdout, stderr = read(0), read(1)
    cmd = [sys.executable, script, *argv] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", script, *argv]
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
    codes = [p.exitcode for p in procs]
    code = codes[0] if nproc == 1 else int(any(c != 0 for c in codes))
    return subprocess.CompletedProcess(cmd, code, stdout, stderr)


def _wait(procs, timeout: float) -> bool:
    """Join every process; once one fails, SIGTERM the rest (as torchrun does). False when time ran out."""
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs):
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
                p.join()
            return False
        if any(p.exitcode not in (None, 0) for p in procs):
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
                    p.join()
            return True
        time.sleep(0.02)
    return True

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
  as a :class:`subprocess.CompletedProcess` with the exit code and the captured text; ``then``:
  more runs of the script in the same processes, one after the other (one job: its start and its
  process groups paid once, e.g. one parallel layout's runs of several stages).
* :class:`ScriptProcess`: one such process started in the background, Popen-like (poll, wait, signals).

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
    """The ``forkserver`` context, its server preloaded with :data:`PRELOAD` (started on first use).

    Where CUDA is present, ``spawn`` instead: a process that may have initialised CUDA while importing
    must not be forked (a forked child cannot use CUDA, and megatron's imports may touch it)."""
    import torch

    if torch.cuda.is_available():
        return multiprocessing.get_context("spawn")
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


def _script_child(script: str, argvs: Sequence[Sequence[str]], env: Dict[str, str], cwd: str, out: str,
                  err: str) -> None:
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(f, fd)
        os.close(f)
    adopt(env, cwd, _threads(env))
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        for argv in argvs:  # a run that fails ends the process: the ones after it do not start
            sys.argv = [script, *argv]
            runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # what the interpreter runs at exit; multiprocessing's children skip it


class ScriptProcess:
    """``python SCRIPT ARGV`` started in a preloaded process, its stdout and stderr appended to files
    (the same file for both, as ``stderr=STDOUT`` does), with the part of :class:`subprocess.Popen`'s
    interface the tests use (``pid``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``)."""

    def __init__(self, script: str, argv: Sequence[str], *, env: Optional[Dict[str, str]] = None, cwd: str = ROOT,
                 stdout: str = os.devnull, stderr: Optional[str] = None, then: Sequence[Sequence[str]] = ()):
        script = script if os.path.isabs(script) else os.path.join(ROOT, script)
        self.args = [sys.executable, script, *argv]
        argvs = [list(argv), *(list(a) for a in then)]
        self._process = preloaded_context().Process(
            target=_script_child, args=(script, argvs, dict(os.environ if env is None else env), cwd, stdout,
                                        stderr or stdout))
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> Optional[int]:
        return self._process.exitcode

    def poll(self) -> Optional[int]:
        return self._process.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self._process.terminate()

    def kill(self) -> None:
        self._process.kill()


def _torchrun_env(rank: int, nproc: int, port: int) -> Dict[str, str]:
    from tests.dist_harness import torchrun_env

    return {**torchrun_env(rank, nproc, port), "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(nproc), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}


def run_script(script: str, argv: Sequence[str], *, nproc: int = 1, env: Optional[Dict[str, str]] = None,
               cwd: str = ROOT, timeout: float = 600.0,
               then: Sequence[Sequence[str]] = ()) -> subprocess.CompletedProcess:
    """Run ``script`` with ``argv`` in ``nproc`` preloaded processes (ranks with torchrun's variables when
    ``nproc > 1``), then with each argv of ``then`` in the same processes; ``env`` is the whole environment
    (default: this one). Like torchrun, once a rank fails
    the others are stopped (SIGTERM) and the job's exit code is 1; one process returns its own code
    (negative: killed by that signal). Output is each rank's, in rank order; a run past ``timeout``
    is killed and raises :class:`subprocess.TimeoutExpired`."""
    from tests.dist_harness import free_port

    env = dict(os.environ if env is None else env)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="preloaded_run_") as tmp:
        files = [(os.path.join(tmp, f"{rank}.out"), os.path.join(tmp, f"{rank}.err")) for rank in range(nproc)]
        procs = [ScriptProcess(script, argv, env=env if nproc == 1 else {**env, **_torchrun_env(rank, nproc, port)},
                               cwd=cwd, stdout=out, stderr=err, then=then) for rank, (out, err) in enumerate(files)]
        timed_out = not _wait(procs, timeout)

        def read(i):
            return "".join(open(f[i], errors="replace").read() if os.path.exists(f[i]) else "" for f in files)

        stdout, stderr = read(0), read(1)
    cmd = procs[0].args if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", *procs[0].args[1:]]
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
    codes = [p.returncode for p in procs]
    code = codes[0] if nproc == 1 else int(any(c != 0 for c in codes))
    return subprocess.CompletedProcess(cmd, code, stdout, stderr)


def _wait(procs, timeout: float) -> bool:
    """Wait for every process; once one fails, SIGTERM the rest (as torchrun does). False when time ran out."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
                p.wait()
            return False
        if any(p.poll() not in (None, 0) for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            return True
        time.sleep(0.02)
    return True

"""A killed preprocessing run leaves nothing behind for long, and two jobs on one cache build it once.

Preprocessing runs here as ``python preprocess_data.py`` processes (:class:`tests.preloaded.ScriptProcess`) that
``MINDSPEED_PACK_FAULT`` kills (SIGKILL) or stops (SIGSTOP) once every row is in the temporary token store
(``tokenized@0``, :mod:`mindspeed_pack.runtime.faults`). The export's counterpart (``--save-hf``) is in
``test_hf_direct_load.py``.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mindspeed_pack.data import toy
from tests.preloaded import ScriptProcess

TIMEOUT = 120


@pytest.fixture(scope="module")
def raw(tmp_path_factory, toy_alpaca_rows):
    return toy.write_dataset(tmp_path_factory.mktemp("raw") / "a.jsonl", toy_alpaca_rows[:80])


def _argv(raw, prefix, tokenizer, *extra):
    return ["--input", str(raw), "--output-prefix", str(prefix), "--tokenizer-name-or-path", str(tokenizer),
            "--prompt-type", "qwen", "--seq-length", "128", "--pack", *extra]


def _start(argv, log, fault=None) -> ScriptProcess:
    env = {k: v for k, v in os.environ.items() if k != "MINDSPEED_PACK_FAULT"}
    if fault:
        env["MINDSPEED_PACK_FAULT"] = fault
    return ScriptProcess("preprocess_data.py", argv, env=env, stdout=str(log))


def _until(what, condition, proc=None, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process ended ({proc.poll()}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _reader(path):
    """What the process logging to ``path`` has written so far ("" before it starts)."""
    return lambda: path.read_text() if path.exists() else ""


def _state(pid: int) -> str:
    """The process's state letter in /proc (R, S, T stopped, Z zombie, ...)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _finished_outputs(out_dir, name="a") -> list:
    """The files a complete build leaves in ``out_dir``: the outputs its sidecar lists, and the sidecar."""
    with open(out_dir / f"{name}_packed_meta.json") as f:
        return sorted([*json.load(f)["outputs"], f"{name}_packed_meta.json"])


def test_a_killed_preprocessing_leaves_temporaries_that_the_next_run_removes(tmp_path, raw, toy_tokenizer_dir):
    out = tmp_path / "out"
    argv = _argv(raw, out / "a", toy_tokenizer_dir)
    killed = _start(argv, tmp_path / "killed.log", fault="tokenized@0:kill")
    assert killed.wait(TIMEOUT) == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-3000:]
    leftovers = sorted(os.listdir(out))
    assert any(".a.tmp-" in n for n in leftovers) and any(".a.tokens-" in n for n in leftovers), leftovers

    rerun = _start(argv, tmp_path / "rerun.log")
    assert rerun.wait(TIMEOUT) == 0, (tmp_path / "rerun.log").read_text()[-3000:]
    log = (tmp_path / "rerun.log").read_text()
    assert sorted(os.listdir(out)) == _finished_outputs(out), log
    assert f"removed 2 leftovers of killed runs from {out}" in log and "freed" in log, log
    assert f"-{killed.pid}" in log, log  # the line names what it removed


def test_two_jobs_building_one_cache_build_it_once(tmp_path, raw, toy_tokenizer_dir):
    """The second job waits for the first (which keeps its temporaries: it is alive), then reuses its output."""
    out = tmp_path / "out"
    argv = _argv(raw, out / "a", toy_tokenizer_dir)
    first = _start(argv, tmp_path / "first.log", fault="tokenized@0:stop")
    try:
        _until("the first job to stop inside its build", lambda: _state(first.pid) == "T", first)
        building = sorted(os.listdir(out))
        second = _start(argv, tmp_path / "second.log")
        second_log = _reader(tmp_path / "second.log")
        _until("the second job to wait for the first",
               lambda: f"waiting for PID {first.pid}" in second_log() or second.poll() is not None)
        assert f"waiting for PID {first.pid}" in second_log() and f"building {out / 'a'}" in second_log(), \
            second_log()[-3000:]
        assert set(building) <= set(os.listdir(out)), "the waiting job removed a live job's temporaries"
        os.kill(first.pid, signal.SIGCONT)
        assert first.wait(TIMEOUT) == 0, (tmp_path / "first.log").read_text()[-3000:]
        assert second.wait(TIMEOUT) == 0, second_log()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
    first_log = (tmp_path / "first.log").read_text()
    assert "rows read 80" in first_log and "reusing" not in first_log, first_log[-3000:]
    assert "reusing cached output" in second_log() and "rows read" not in second_log(), second_log()[-3000:]
    assert sorted(os.listdir(out)) == _finished_outputs(out)


def test_a_killed_cache_builder_does_not_block_the_job_waiting_for_it(tmp_path, raw, toy_tokenizer_dir):
    """The kernel releases the dead builder's lock: the waiting job builds, and removes the dead one's temporaries."""
    out = tmp_path / "out"
    argv = _argv(raw, out / "a", toy_tokenizer_dir)
    first = _start(argv, tmp_path / "first.log", fault="tokenized@0:stop")
    try:
        _until("the first job to stop inside its build", lambda: _state(first.pid) == "T", first)
        second = _start(argv, tmp_path / "second.log")
        second_log = _reader(tmp_path / "second.log")
        _until("the second job to wait for the first",
               lambda: f"waiting for PID {first.pid}" in second_log() or second.poll() is not None)
        assert f"waiting for PID {first.pid}" in second_log(), second_log()[-3000:]
        time.sleep(2)
    finally:
        first.kill()
    assert first.wait(TIMEOUT) == -signal.SIGKILL
    assert second.wait(TIMEOUT) == 0, second_log()[-3000:]
    assert "rows read 80" in second_log() and "removed 2 leftovers of killed runs" in second_log()
    assert sorted(os.listdir(out)) == _finished_outputs(out)
    # the wait is its own figure, not "setup: tokenizer, input checks, megatron-core import"
    stats = json.loads((out / "a_packed_meta.json").read_text())["statistics"]
    assert stats["lock_wait_seconds"] >= 2 and "for another job's build)" in second_log(), stats
    assert stats["setup_seconds"] <= stats["elapsed_seconds"] - stats["lock_wait_seconds"], stats


# --------------------------------------------------------------------------- the helper itself
def test_only_temporaries_of_dead_processes_on_this_host_are_removed(tmp_path, caplog):
    from mindspeed_pack.runtime.stale_files import HOST, owned_name, remove_stale

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # ended, not yet reaped: its locks are free
    _until("a zombie", lambda: _state(zombie.pid) == "Z")
    try:
        names = {"dead": f".a.tmp-{HOST}-{gone.pid}", "zombie": f".a.tmp-{HOST}-{zombie.pid}",
                 "live": f".a.tmp-{HOST}-{sleeper.pid}",
                 "parent": f".a.tmp-{HOST}-{os.getppid()}", "mine": owned_name(".a.tmp-"),
                 "other host": f".a.tmp-elsewhere-{gone.pid}", "other output": f".b.tmp-{HOST}-{gone.pid}",
                 "not a pid": f".a.tmp-{HOST}-x1"}
        for name in names.values():
            (tmp_path / name).mkdir()
            (tmp_path / name / "tokens.bin").write_bytes(b"\0" * 1000)
        (tmp_path / f".a.tokens-{HOST}-{gone.pid}").write_bytes(b"\0" * 500)  # a file, not a directory
        with caplog.at_level("INFO"):
            freed = remove_stale(str(tmp_path), [".a.tmp-", ".a.tokens-"], "preprocessing a")
        assert freed == 2500
        assert sorted(os.listdir(tmp_path)) == sorted(v for k, v in names.items() if k not in ("dead", "zombie"))
        assert f"removed 3 leftovers of killed runs from {tmp_path} (2.5 KB freed)" in caplog.text
        assert f".a.tmp-elsewhere-{gone.pid}" in caplog.text and "another host" in caplog.text
    finally:
        sleeper.kill()
        sleeper.wait()
        zombie.wait()


def test_the_lock_excludes_other_processes_and_its_file_is_gone_after_the_build(tmp_path):
    from mindspeed_pack.runtime.stale_files import HOST, exclusive

    lock = tmp_path / ".a.lock"
    # another process: this one must not open the file while it holds the lock (a close would release it)
    try_lock = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); print(os.read(fd, 200).decode())\n"
                "try:\n    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept OSError:\n    sys.exit(3)")
    with exclusive(str(lock), "a") as waited:
        assert waited is False
        other = subprocess.run([sys.executable, "-c", try_lock, str(lock)], capture_output=True, text=True)
        assert other.returncode == 3 and other.stdout.split() == [str(os.getpid()), HOST], other
    assert not lock.exists()

"""A rank that dies is restarted by torchrun and the job resumes by itself; a hung peer never hangs the job.

Two-process gloo jobs of a tiny model with ``--load D --save D``, launched as a user does
(``torchrun --max-restarts N``, static or c10d rendezvous). Ranks are killed by the armed
faults of :mod:`mindspeed_pack.runtime.faults` (each fires on one restart attempt only), restarted
workers are made to reach the rendezvous seconds apart (``MINDSPEED_PACK_START_DELAY``), and
every recovered run must end with an uninterrupted run's loss at every iteration and a
metrics file holding iterations 1..N once each.


The first tests check the pieces in one process (the store handshake against a dead attempt's
keys, the metrics rewrite, the one-line failures); the slow ones run whole torchrun jobs, except
the uninterrupted reference and the hung-peer jobs, whose ranks start without a launcher in
preloaded processes (:mod:`tests.preloaded`).
"""
import contextlib
import datetime
import json
import os
import random
import signal
import threading
import time

import pytest
import torch.distributed as dist

from mindspeed_pack.runtime import faults as fault_hooks
from mindspeed_pack.runtime import rendezvous
from mindspeed_pack.runtime.peers import PeerFailure, waiting_for
from mindspeed_pack.training import metrics_history
from tests.data_utils import read_metrics, rel_err, write_packed_instruction_dataset
from tests.dist_harness import free_port, run_torchrun, torchrun_env
from tests.model_utils import TINY_FLAGS
from tests.preloaded import ScriptProcess, run_script
from tests.train_utils import ROOT

ITERS = 10
SEQ = 64
SAVE_INTERVAL = 2
POSTTRAIN = os.path.join(ROOT, "posttrain.py")


def argv(data, ckpt, metrics, *extra):
    return [POSTTRAIN, *TINY_FLAGS, "--seq-length", str(SEQ), "--micro-batch-size", "1", "--global-batch-size", "2",
            "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "2", "--neat-pack", "--train-iters", str(ITERS),
            "--hidden-dropout", "0.1", "--data-path", data, "--load", ckpt, "--save", ckpt,
            "--save-interval", str(SAVE_INTERVAL), "--metrics-file", metrics, "--distributed-timeout-minutes", "1",
            *extra]


def torchrun(args, restarts=0, rendezvous="static", env=None):
    port = free_port()
    launcher = ["--master-addr", "127.0.0.1", "--master-port", str(port)] if rendezvous == "static" else \
        ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test"]
    start = time.perf_counter()
    proc = run_torchrun(args, 2, launcher_args=[*launcher, "--max-restarts", str(restarts)], timeout=420,
                        env={"OMP_NUM_THREADS": "1", **(env or {})}, cwd=ROOT)
    return proc, time.perf_counter() - start


def train_iterations(path):
    """Every train record's iteration, in file order (duplicates kept)."""
    with open(path) as f:
        return [r["iteration"] for r in map(json.loads, f) if r.get("split") == "train"]


def assert_equals_reference(metrics, reference):
    assert train_iterations(metrics) == list(range(1, ITERS + 1))  # each iteration once, re-run ones replaced
    got = read_metrics(metrics)
    for it in range(1, ITERS + 1):
        assert rel_err(got[it]["lm loss"], reference[it]["lm loss"]) <= 1e-6, (it, got[it], reference[it])
        assert rel_err(got[it]["grad norm"], reference[it]["grad norm"]) <= 1e-5, (it, got[it], reference[it])


# ------------------------------------------------------------------ pieces, in one process
def _store_pair():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, is_master=False)
    return server, client


def test_a_late_rank_0_is_found_past_a_dead_attempts_keys():
    """Rank 1 reaches the store first and reads the leader key a dead attempt left; it joins the new
    attempt once rank 0 arrives, and both scope the process group to that attempt."""
    server, client = _store_pair()
    server.add(rendezvous.GENERATION_KEY, 3)  # three earlier attempts ...
    server.set(rendezvous.LEADER_KEY, "3")  # ... the last one's leader key, never to be acknowledged
    deadline = time.monotonic() + 30
    joined = {}
    thread = threading.Thread(target=lambda: joined.update(g=rendezvous._join(client, 1, deadline, "here", None)))
    thread.start()
    time.sleep(1.5)  # rank 1 is waiting on attempt 3 by now
    assert rendezvous._lead(server, 2, deadline, "here", None) == 4
    thread.join(10)
    assert joined == {"g": 4}


def test_rendezvous_timeout_names_the_missing_rank():
    server, _ = _store_pair()
    timeout = datetime.timedelta(seconds=0.5)
    with pytest.raises(rendezvous.RendezvousTimeout, match=r"rank 0: timed out after 0.00833\d* min "
                       r"\(--distributed-timeout-minutes\) waiting for rank\(s\) 1 to join attempt 1 at here"):
        rendezvous._lead(server, 2, time.monotonic() + 0.5, "here", timeout)


@pytest.mark.parametrize("stopping_rank", [1, 0])
def test_a_rank_stopping_before_the_ranks_meet_stops_the_others_at_once(monkeypatch, stopping_rank):
    """Node 1 started with another --seq-length than the packs' stops at its data check, before the rendezvous; node 0
    waited the whole --distributed-timeout-minutes (10 min) in silence, then said rank 1 'did not join'. Now the
    stopping rank leaves its error line in torchrun's store and the waiting rank stops within a second with it."""
    server, client = _store_pair()
    port = server.port
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", str(stopping_rank))
    monkeypatch.setenv("GROUP_RANK", str(stopping_rank))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # torchrun's agent hosts the store
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    rendezvous.announce_stop("--seq-length 128 differs from the packs' length 256 in data/sft_packed_meta.json")
    waiting = 1 - stopping_rank
    start = time.monotonic()
    with pytest.raises(rendezvous.PeerStoppedEarly, match=rf"rank {waiting}: rank {stopping_rank} \(node "
                       rf"{stopping_rank}, host .*\) stopped before the ranks met, so this rank stops too; its error: "
                       r"--seq-length 128 differs from the packs' length 256"):
        if waiting == 0:
            rendezvous._lead(server, 2, time.monotonic() + 60, "here", datetime.timedelta(minutes=1))
        else:
            rendezvous._join(client, 1, time.monotonic() + 60, "here", datetime.timedelta(minutes=1))
    assert time.monotonic() - start < 10
    # a restart attempt does not stop on the error of the attempt before it (the key is not scoped to an attempt)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(rendezvous.RendezvousTimeout, match="timed out"):
        if waiting == 0:
            rendezvous._lead(server, 2, time.monotonic() + 1, "here", datetime.timedelta(seconds=1))
        else:
            rendezvous._join(client, 1, time.monotonic() + 1, "here", datetime.timedelta(seconds=1))


def test_a_taken_master_port_is_named_not_waited_for(monkeypatch):
    """A port another process listens on fails at once with its own message, not as a 10-minute timeout."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        start = time.monotonic()
        with pytest.raises(rendezvous.StorePortTaken, match=rf"rank 0: cannot host the key-value store at "
                           rf"127.0.0.1:{port}: the port is in use .*set another MASTER_PORT"):
            rendezvous.attempt_store(0, 2, datetime.timedelta(minutes=10))
        assert time.monotonic() - start < 60


def test_backend_failures_become_one_line_naming_the_phase():
    with pytest.raises(PeerFailure) as e:
        with waiting_for(lambda: "iteration 8", 0.25):
            raise RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                               "[127.0.0.1]:50375. This is typically caused by a remote worker crashing.\nmore")
    assert str(e.value).startswith("rank 0: lost a peer (it died or closed its connection) during iteration 8: "
                                   "Connection closed by peer [127.0.0.1]:50375.") and "\n" not in str(e.value)
    with pytest.raises(PeerFailure, match=r"^rank 0: timed out after 0.25 min \(--distributed-timeout-minutes\) "
                                          r"waiting for a peer \(hung or unreachable\) during the save of iteration 6: "
                                          r"Timed out waiting 15000ms for recv operation to complete$"):
        with waiting_for("the save of iteration 6", 0.25):
            raise RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 15000ms for recv "
                               "operation to complete")
    with pytest.raises(ValueError):  # not a peer's failure: untouched
        with waiting_for("iteration 1", 1):
            raise ValueError("bad flag")


def test_faults_fire_on_their_rank_and_attempt_only():
    spec = "step@3,write@4:enospc:rank1,written@6:kill:rank0:attempt2"
    assert fault_hooks.parse(spec, rank=0, attempt=0) == {("step", 3): "kill"}
    assert fault_hooks.parse(spec, rank=1, attempt=0) == {("step", 3): "kill", ("write", 4): "enospc"}
    assert fault_hooks.parse(spec, rank=0, attempt=2) == {("written", 6): "kill"}
    assert fault_hooks.parse(spec, rank=1, attempt=1) == {}
    with pytest.raises(ValueError, match="rankR"):
        fault_hooks.parse("step@3:rankX")


_SIGNAL_DURING_A_SAVE = """
import os, signal, time
from mindspeed_pack.runtime.exit_signal import ExitSignal
exit_signal = ExitSignal(grace_s=lambda: 0.5, describe=lambda: "the save of iteration 5")
with exit_signal.writing():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(2.0)  # a checkpoint that takes longer to write than the grace
time.sleep(0.2)  # the next iteration, then the agreement to stop
exit_signal.agreed()
print("agreed after the save", flush=True)
"""


def test_a_signal_during_a_long_checkpoint_write_waits_for_it_then_for_the_agreement():
    """--exit-signal-handler: SIGTERM while a checkpoint was being written (a 7B save takes longer than the grace of
    10 s + two steps) cut that save off and left without the exit's save, as if a peer were dead; the grace now
    waits for the rank's writes and starts again after them (the save's collectives still count: a hung peer there
    ends the rank within the grace, test_hung_peer_makes_the_others_exit_instead_of_hanging)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _SIGNAL_DURING_A_SAVE], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "agreed after the save" and "exiting without saving" not in proc.stderr


def test_resumed_metrics_file_replaces_the_re_run_steps(tmp_path):
    """Records after the resume iteration go (train, validation, setup); earlier ones, lines that are
    not ours and nothing else; a last line cut by the kill goes too. The file is replaced whole."""
    path = tmp_path / "m.jsonl"
    records = [{"iteration": 0, "split": "setup"}] + [{"iteration": i, "split": "train", "lm loss": i}
                                                      for i in range(1, 8)]
    records.insert(5, {"iteration": 4, "split": "valid", "lm loss": 1.0})
    lines = [json.dumps(r) for r in records]
    lines.insert(3, "not json, kept")
    path.write_text("\n".join(lines) + "\n" + '{"iteration": 8, "split": "tr')
    assert metrics_history.drop_records_after(str(path), 5) == [6, 7]
    kept = path.read_text().splitlines()
    assert kept == lines[:lines.index(json.dumps(records[-2]))]  # through iteration 5, in order
    assert sorted(os.listdir(tmp_path)) == ["m.jsonl"]  # no temporary file left
    assert metrics_history.drop_records_after(str(path), 5) == [] and path.read_text().splitlines() == kept


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_packed_instruction_dataset(str(tmp_path_factory.mktemp("elastic") / "toy"), num_packs=64,
                                            seq_length=SEQ, seed=5)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data):
    """The uninterrupted job's steps (its two ranks started as torchrun starts them, without the launcher)."""
    d = tmp_path_factory.mktemp("reference")
    proc = run_script(POSTTRAIN, argv(data, str(d / "ckpt"), str(d / "m.jsonl"))[1:], nproc=2, timeout=420)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return read_metrics(str(d / "m.jsonl"))


@pytest.mark.slow
def test_killed_rank_restarts_and_resumes_exactly(tmp_path, data, reference):
    """rank 1 SIGKILLed after step 7 (checkpoint 6, steps 7 logged): torchrun restarts both workers,
    rank 0 reaching the rendezvous 5 s after rank 1, and the job ends as the uninterrupted one."""
    metrics, tb = str(tmp_path / "m.jsonl"), str(tmp_path / "tb")
    proc, _ = torchrun(argv(data, str(tmp_path / "ckpt"), metrics, "--tensorboard-dir", tb), restarts=1,
                       env={"MINDSPEED_PACK_FAULT": "step@8:kill:rank1", "MINDSPEED_PACK_START_DELAY": "0:5"})
    out = proc.stdout + proc.stderr
    assert "killing this process at step@8" in out and "rank 0 waits 5.0 s before the rendezvous" in out, out[-4000:]
    resumed = [line for line in out.splitlines() if "resumed from" in line]
    assert len(resumed) == 1, resumed  # once, by one rank
    assert "at iteration 6 (torchrun restart 1); iteration 7 (1 step), logged before, is run again and " \
        f"replaced in {metrics}" in resumed[0], resumed
    assert_equals_reference(metrics, reference)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(tb)
    events.Reload()
    assert [e.step for e in events.Scalars("train/lm loss")] == list(range(1, ITERS + 1))  # step 7 purged once


def _soak_plan(rng, kills):
    """(fault spec, delayed rank) per attempt: kills at random steps or save phases of random ranks,
    each after the checkpoint its attempt resumes from (so it fires), with the resume point it leaves."""
    saves = [i for i in range(1, ITERS + 1) if i % SAVE_INTERVAL == 0 or i == ITERS]
    done, faults = 0, []
    for attempt in range(kills):
        kind = rng.choice(["step", "step", "write", "written", "renamed", "tracker"])
        # the files are written by rank 0 (data-parallel rank 0) and published by rank 0
        rank = rng.randrange(2) if kind in ("step", "written") else 0
        if kind == "step":
            it = rng.randint(done + 1, min(ITERS, done + 4))
            done = max([s for s in saves if s < it] + [done])
        else:  # the next save or the one after (a tracker kill publishes it: keep one save ahead of the end)
            if kind == "tracker" and done + SAVE_INTERVAL >= ITERS:
                kind = "written"
            it = rng.choice([s for s in saves if s > done and (kind != "tracker" or s < ITERS)][:2])
            done = it if kind == "tracker" else max([s for s in saves if s < it] + [done])
        faults.append(f"{kind}@{it}:kill:rank{rank}:attempt{attempt}")
    return faults


@pytest.mark.slow
def test_soak_random_kills_under_c10d_rendezvous(tmp_path, data, reference):
    """5 SIGKILLs of random ranks at random steps and inside saves, --max-restarts 5, c10d rendezvous,
    restarted workers arriving up to 3 s apart: the run ends equal to the uninterrupted one."""
    rng = random.Random(6)
    faults = _soak_plan(rng, 5)
    delays = f"{rng.randrange(2)}:3"
    metrics = str(tmp_path / "m.jsonl")
    proc, seconds = torchrun(argv(data, str(tmp_path / "ckpt"), metrics), restarts=5, rendezvous="c10d",
                             env={"MINDSPEED_PACK_FAULT": ",".join(faults), "MINDSPEED_PACK_START_DELAY": delays})
    out = proc.stdout + proc.stderr
    assert out.count("killing this process at") == 5, (faults, out[-4000:])
    assert_equals_reference(metrics, reference)
    print(f"\nsoak: 5 kills ({', '.join(faults)}) recovered; the job took {seconds:.1f} s")


def _launch_rank(rank, port, args, log):
    env = {**os.environ, **torchrun_env(rank, 2, port), "OMP_NUM_THREADS": "1"}
    return ScriptProcess(args[0], args[1:], env=env, cwd=ROOT, stdout=log)


def _first_step_logged(metrics, procs, timeout=240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        if os.path.exists(metrics) and train_iterations(metrics):
            return
        time.sleep(0.1)
    raise AssertionError("no step was logged")


@pytest.mark.slow
def test_hung_peer_makes_the_others_exit_instead_of_hanging(tmp_path, data):
    """rank 1 stopped with SIGSTOP mid-run. Job A: rank 0 exits 1 once --distributed-timeout-minutes
    (0.25 = 15 s) expire, with one line naming what it waited for. Job B (--exit-signal-handler):
    rank 0 also gets SIGTERM, as torchrun sends survivors; it leaves without trying to save through
    the hung peer, well before its 1-minute timeout."""
    jobs = {}
    for name, extra in (("A", ["--distributed-timeout-minutes", "0.25"]), ("B", ["--exit-signal-handler"])):
        d = tmp_path / name
        d.mkdir()
        args = argv(data, str(d / "ckpt"), str(d / "m.jsonl"), "--train-iters", "100000", *extra)
        port = free_port()
        logs = [str(d / f"rank{r}.log") for r in (0, 1)]
        jobs[name] = (d, [_launch_rank(r, port, args, logs[r]) for r in (0, 1)])
    try:
        for d, procs in jobs.values():
            _first_step_logged(str(d / "m.jsonl"), procs)
        stopped = time.monotonic()
        for _, procs in jobs.values():
            procs[1].send_signal(signal.SIGSTOP)
        time.sleep(1.0)
        jobs["B"][1][0].send_signal(signal.SIGTERM)
        codes = {name: procs[0].wait(timeout=120) for name, (_, procs) in jobs.items()}
        waited = time.monotonic() - stopped
    finally:
        for _, procs in jobs.values():
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    out_a = (jobs["A"][0] / "rank0.log").read_text()
    out_b = (jobs["B"][0] / "rank0.log").read_text()
    assert codes["A"] == 1, out_a[-3000:]
    errors = [line for line in out_a.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in out_a, out_a[-3000:]
    assert "rank 0: timed out after 0.25 min (--distributed-timeout-minutes) waiting for a peer" in errors[0], errors
    assert " during iteration " in errors[0] or " during the save of iteration " in errors[0], errors
    assert codes["B"] == 128 + signal.SIGTERM, out_b[-3000:]
    assert "did not agree to stop" in out_b and "exiting without saving" in out_b, out_b[-3000:]
    assert waited < 15 + 45, waited  # A's timeout plus a margin (B's grace is shorter)


@pytest.mark.parametrize("outcome,torn_down", [
    (None, True), (SystemExit(0), True), ("data", True), ("peer", False), (SystemExit(2), False),
    (RuntimeError("gloo timeout"), False)])
def test_a_scripts_process_groups_are_destroyed_before_exit_unless_a_peer_may_wait(monkeypatch, outcome, torn_down):
    """Left to the interpreter's teardown, gloo's worker threads could abort it ("terminate called without an
    active exception": exit 134 instead of the run's code). A script destroys its groups first; not after a
    lost peer or an unexplained failure, where a collective may still wait and the destroy could block."""
    from mindspeed_pack.datasets.packed_documents import DataError
    from mindspeed_pack.runtime import process_groups
    from mindspeed_pack.training.cli import run_cli

    calls = []
    monkeypatch.setattr(process_groups, "destroy", lambda: calls.append(1))
    raised = {"data": DataError("bad row"), "peer": PeerFailure("rank 1 is gone")}.get(outcome, outcome)

    def main():
        if raised is not None:
            raise raised

    with contextlib.suppress(SystemExit, RuntimeError):
        run_cli("posttrain.py", main, own_process=True)
    assert calls == ([1] if torn_down else [])
    with contextlib.suppress(SystemExit, RuntimeError):
        run_cli("posttrain.py", main)  # in process (tests, a notebook): the caller's groups stay
    assert calls == ([1] if torn_down else [])


def test_a_lost_peers_address_names_the_ranks_that_run_there():
    """"lost a peer ... Connection closed by peer [10.0.0.2]:50375" named an address only: on a many-node job, which
    node died? The ranks' places, gathered when they meet, name its ranks, node and host."""
    from mindspeed_pack.runtime import peers

    loop = ["127.0.0.1", "::1"]
    peers.record_places([("0", "h1", ["10.0.0.1", *loop]), ("0", "h1", ["10.0.0.1", *loop]),
                         ("1", "h2", ["10.0.0.2", *loop]), ("1", "h2", ["10.0.0.2", *loop])])
    try:
        for address, named in (("10.0.0.2", "one of ranks 2-3: node 1, host h2"), ("127.0.0.1", "rank 1: node 0, host h1")):
            with pytest.raises(PeerFailure) as e:
                with waiting_for("iteration 8", 1):
                    raise RuntimeError(f"[pair.cc:553] Connection closed by peer [{address}]:50375")
            assert str(e.value).endswith(f"Connection closed by peer [{address}]:50375 (the peer at {address} is {named})")
        with pytest.raises(PeerFailure) as e:  # an address no rank reported: as before
            with waiting_for("iteration 8", 1):
                raise RuntimeError("Connection closed by peer [10.9.9.9]:1")
        assert str(e.value).endswith("[10.9.9.9]:1")
    finally:
        peers.record_places([])

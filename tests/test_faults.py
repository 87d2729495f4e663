"""Faults lose nothing: SIGKILL at random moments (in steps and inside saves) and a full disk.

The soak test runs a tiny packed fine-tune with a save every 2 iterations, kills it (seeded)
again and again, some kills armed at a phase of a save through ``MINDSPEED_PACK_FAULT``, some
by a timer from outside, resumes each time with ``--load D --save D``, and ends with the
weights and every step's loss of an uninterrupted run. Timer kills strike a random moment
(0-0.3 s) after a run's first logged step. Runs are forked from a server that
has already imported torch and megatron (:mod:`tests.preloaded`), so a run starts in about a second.
"""
import json
import os
import random
import resource
import signal
import time

import pytest
import torch

import posttrain
from mindspeed_pack.checkpoint.save_load import CheckpointError
from mindspeed_pack.convert import megatron_layout as layout
from tests.data_utils import read_metrics, rel_err, write_packed_instruction_dataset
from tests.dist_harness import free_port
from tests.model_utils import TINY_FLAGS
from tests.preloaded import preloaded_context

ITERS = 32
SEQ = 64
SEED = 17
SAVE_PHASES = ("write", "written", "renamed", "tracker")


def argv(data, ckpt, metrics, *extra):
    return [*TINY_FLAGS, "--seq-length", str(SEQ), "--micro-batch-size", "1", "--global-batch-size", "2",
            "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "2", "--neat-pack",
            "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--train-iters", str(ITERS),
            "--data-path", data, "--load", ckpt, "--save", ckpt, "--save-interval", "2",
            "--metrics-file", metrics, *extra]


def _child(args, fault, log_path, fsize_limit=None):
    """One training run in a forked process: its own port, one thread, output to ``log_path``."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ["MASTER_PORT"] = str(free_port())
    os.environ.pop("MINDSPEED_PACK_FAULT", None)
    if fault:
        os.environ["MINDSPEED_PACK_FAULT"] = fault
    if fsize_limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, fsize_limit))
    torch.set_num_threads(1)
    from mindspeed_pack.training.cli import run_cli, setup_logging

    setup_logging()
    run_cli("posttrain.py", lambda: posttrain.main(args))


@pytest.fixture(scope="module")
def launcher():
    ctx = preloaded_context()

    def launch(args, fault=None, log_path=os.devnull, kill_after_step=None, fsize_limit=None, timeout=300):
        """Run; returns the exit code (-9 when killed). ``kill_after_step``: SIGKILL it that many seconds
        after its first step is logged (a moment in the middle of training, whatever the machine's speed)."""
        p = ctx.Process(target=_child, args=(args, fault, log_path, fsize_limit))
        p.start()
        deadline = time.monotonic() + timeout
        if kill_after_step is not None:
            metrics = args[args.index("--metrics-file") + 1]
            while p.is_alive() and time.monotonic() < deadline:
                if os.path.exists(metrics) and os.path.getsize(metrics) > 0:
                    time.sleep(kill_after_step)
                    p.kill()
                    break
                time.sleep(0.01)
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
            raise AssertionError(f"run timed out after {timeout}s: {open(log_path).read()[-3000:]}")
        return p.exitcode

    return launch


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_packed_instruction_dataset(str(tmp_path_factory.mktemp("faults") / "toy"), num_packs=64,
                                            seq_length=SEQ, seed=3)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data, launcher):
    d = tmp_path_factory.mktemp("reference")
    code = launcher(argv(data, str(d / "ckpt"), str(d / "m.jsonl")), log_path=str(d / "log"))
    assert code == 0, open(d / "log").read()[-3000:]
    return read_metrics(str(d / "m.jsonl")), str(d / "ckpt")


def merged_losses(paths):
    """{iteration: loss}, the last run that logged an iteration winning (a killed run may end mid-line)."""
    out = {}
    for path in paths:
        if not os.path.exists(path):
            continue
        for line in open(path):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("split") == "train":
                out[rec["iteration"]] = rec["lm loss"]
    return out


def final_weights(ckpt):
    return layout.load_file(layout.checkpoint_file(ckpt, ITERS, 0, 0, 1))["model"]


def fault_plan(rng):
    """Kinds of kill, shuffled: every save phase twice, a step kill twice, three timer kills."""
    kinds = [*SAVE_PHASES, *SAVE_PHASES, "step", "step", "timer", "timer", "timer"]
    rng.shuffle(kinds)
    return kinds


@pytest.mark.slow
def test_random_sigkills_resume_to_the_uninterrupted_run(tmp_path, data, reference, launcher):
    ref_losses, ref_ckpt = reference
    rng = random.Random(SEED)
    ckpt = str(tmp_path / "ckpt")
    metrics, kills, history = [], 0, []
    for run, kind in enumerate([*fault_plan(rng), None]):
        done = (layout.read_tracker(ckpt) if os.path.exists(ckpt) else None) or 0
        fault, kill_after_step = None, None
        if kind in SAVE_PHASES:  # a save iteration (even) ahead of the last checkpoint
            fault = f"{kind}@{min(ITERS, done + 2 * rng.randint(1, 2))}:kill"
        elif kind == "step":
            fault = f"step@{min(ITERS, done + rng.randint(1, 3))}:kill"
        elif kind == "timer":
            kill_after_step = rng.uniform(0.0, 0.3)
            # near the end the run can finish before the timer fires: the last step's kill is its backstop
            fault = f"step@{ITERS}:kill"
        metrics.append(str(tmp_path / f"m{run}.jsonl"))
        log = str(tmp_path / f"log{run}")
        start = time.perf_counter()
        code = launcher(argv(data, ckpt, metrics[-1]), fault=fault, log_path=log, kill_after_step=kill_after_step)
        history.append((kind, fault or (kill_after_step and round(kill_after_step, 2)), done, code,
                        round(time.perf_counter() - start, 1)))
        expected = 0 if kind is None else -signal.SIGKILL
        assert code == expected, (history, open(log).read()[-3000:])
        kills += code == -signal.SIGKILL
    print(f"\nsoak: {kills} SIGKILLs over {len(history)} runs: {history}")
    assert kills >= 10, history
    assert sum(1 for kind, _, _, code, _ in history if kind in SAVE_PHASES and code == -9) >= 5

    losses = merged_losses(metrics)
    assert sorted(losses) == list(range(1, ITERS + 1)), history
    for it in range(1, ITERS + 1):
        assert rel_err(losses[it], ref_losses[it]["lm loss"]) <= 1e-6, (it, losses[it], ref_losses[it], history)
    got, want = final_weights(ckpt), final_weights(ref_ckpt)
    assert got.keys() == want.keys()
    for name in want:
        scale = want[name].abs().max().clamp_min(1e-30)
        assert float((got[name] - want[name]).abs().max() / scale) <= 1e-6, name
    assert sorted(os.listdir(ckpt)) == sorted(os.listdir(ref_ckpt))  # no leftovers of crashed saves


def _run_in_process(monkeypatch, data, ckpt, metrics, fault, iters):
    monkeypatch.setenv("MINDSPEED_PACK_FAULT", fault) if fault else monkeypatch.delenv("MINDSPEED_PACK_FAULT",
                                                                                         raising=False)
    posttrain.main(argv(data, ckpt, metrics, "--train-iters", str(iters), "--save-interval", "1"))


def test_disk_full_during_a_save_keeps_the_previous_checkpoint(tmp_path, data, monkeypatch):
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(CheckpointError) as e:
        _run_in_process(monkeypatch, data, ckpt, str(tmp_path / "a.jsonl"), "write@2:enospc", 3)
    msg = str(e.value)
    assert f"saving iteration 2 to {ckpt} failed: No space left on device" in msg, msg
    assert "model_optim_rng.pt.tmp" in msg and f"still holds iteration 1, which --load {ckpt} resumes from" in msg
    assert "free disk space" in msg
    assert sorted(os.listdir(ckpt)) == ["iter_0000001", layout.TRACKER, "run_config.yaml"]  # the partial save is gone
    _run_in_process(monkeypatch, data, ckpt, str(tmp_path / "b.jsonl"), None, 3)  # the previous one resumes
    assert sorted(read_metrics(str(tmp_path / "b.jsonl"))) == [2, 3]
    assert layout.read_tracker(ckpt) == 3


def test_file_size_limit_during_a_save_is_reported(tmp_path, data, launcher, monkeypatch):
    """A real failing write (RLIMIT_FSIZE): the run exits 2 with one line; iteration 1 stays loadable."""
    ckpt = str(tmp_path / "ckpt")
    _run_in_process(monkeypatch, data, ckpt, str(tmp_path / "a.jsonl"), None, 1)
    size = os.path.getsize(layout.checkpoint_file(ckpt, 1, 0, 0, 1))
    log = str(tmp_path / "log")
    code = launcher(argv(data, ckpt, str(tmp_path / "b.jsonl"), "--train-iters", "2"), log_path=log,
                    fsize_limit=size // 2)
    out = open(log).read()
    assert code == 2, out[-3000:]
    assert f"posttrain.py: error: saving iteration 2 to {ckpt} failed: File too large" in out, out[-3000:]
    assert "Traceback" not in out
    assert layout.read_tracker(ckpt) == 1 and sorted(os.listdir(ckpt)) == ["iter_0000001", layout.TRACKER,
                                                                           "run_config.yaml"]


def test_first_save_killed_before_its_tracker_starts_over(tmp_path, data, launcher):
    """A kill between the first save's rename and its tracker leaves an uncommitted iter_N: the restart
    (--load D = --save D) starts from scratch and saves over it, instead of refusing to start."""
    ckpt, log = str(tmp_path / "ckpt"), str(tmp_path / "log")
    first = launcher(argv(data, ckpt, str(tmp_path / "a.jsonl"), "--train-iters", "3"), fault="renamed@2:kill",
                     log_path=log)
    # (the killed job's claim on --save stays as a file; the kernel released its lock, so the restart takes it)
    assert first == -signal.SIGKILL and sorted(os.listdir(ckpt)) == [".save.lock", "iter_0000002",
                                                                     "run_config.yaml"], open(log).read()[-3000:]
    code = launcher(argv(data, ckpt, str(tmp_path / "b.jsonl"), "--train-iters", "3"), log_path=log)
    out = open(log).read()
    assert code == 0, out[-3000:]
    assert f"(iter_0000002 without {layout.TRACKER}: an interrupted first save): starting from scratch" in out
    assert sorted(read_metrics(str(tmp_path / "b.jsonl"))) == [1, 2, 3] and layout.read_tracker(ckpt) == 3
    assert ".save.lock" not in os.listdir(ckpt)  # a run that ends gives --save back


def test_complete_iterations_without_their_tracker_are_refused_not_overwritten(tmp_path, data, monkeypatch):
    """The tracker of a directory holding complete iterations 2, 4, 6 is deleted: --load D --save D refuses to
    start over (which would overwrite them), naming the latest and how to resume from it; done so, it resumes."""
    from tests.data_utils import fingerprint

    ckpt = str(tmp_path / "ckpt")
    posttrain.main(argv(data, ckpt, str(tmp_path / "a.jsonl"), "--train-iters", "8", "--exit-interval", "6"))
    os.remove(os.path.join(ckpt, layout.TRACKER))
    before = fingerprint(ckpt)
    with pytest.raises(CheckpointError) as e:
        posttrain.main(argv(data, ckpt, str(tmp_path / "b.jsonl"), "--train-iters", "8"))
    msg = str(e.value)
    assert f"--load (= --save) {ckpt} holds complete iterations 2, 4, 6 but no {layout.TRACKER}" in msg, msg
    assert f"echo 6 > {os.path.join(ckpt, layout.TRACKER)}" in msg and "--overwrite-output-dir" in msg, msg
    assert fingerprint(ckpt) == before  # nothing overwritten
    with open(os.path.join(ckpt, layout.TRACKER), "w") as f:
        f.write("6")
    posttrain.main(argv(data, ckpt, str(tmp_path / "c.jsonl"), "--train-iters", "8"))
    assert sorted(read_metrics(str(tmp_path / "c.jsonl"))) == [7, 8] and layout.read_tracker(ckpt) == 8


def test_rerun_by_hand_after_a_kill_before_the_first_save_logs_each_step_once(tmp_path, data, launcher):
    """Killed after step 4, before the first checkpoint (steps 1-3 logged), then the same command by hand: it
    starts from scratch and its steps replace the logged ones, as a torchrun restart's do."""
    ckpt, metrics, log = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl"), str(tmp_path / "log")
    args = argv(data, ckpt, metrics, "--train-iters", "5", "--save-interval", "5")
    assert launcher(args, fault="step@4:kill", log_path=log) == -signal.SIGKILL, open(log).read()[-3000:]
    with open(metrics) as f:
        assert [r["iteration"] for r in map(json.loads, f) if r["split"] == "train"] == [1, 2, 3]
    assert launcher(args, log_path=log) == 0, open(log).read()[-3000:]
    with open(metrics) as f:
        assert [r["iteration"] for r in map(json.loads, f) if r["split"] == "train"] == [1, 2, 3, 4, 5]
    assert f"iterations 1-3 (3 steps), logged before, are run again and replaced in {metrics}" in open(log).read()

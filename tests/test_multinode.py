"""A real two-node launch of the Qwen2.5 tune script, on one CPU machine.

Two copies of ``examples/qwen25/tune_qwen25_7b_4k_full_pack.sh`` run side by side as
"nodes" 0 and 1 (``NNODES=2``, ``NODE_RANK``, ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``,
``GPUS_PER_NODE=2``, ``TP=2``): the script's own torchrun rendezvous and log tee, and its real
``PARALLEL_ARGS`` (sequence parallel, distributed optimizer), ``TRAIN_ARGS`` (bf16, the 7B
recipe's batch sizes and schedule), ``DATA_ARGS``, ``CKPT_ARGS`` (``--finetune`` from a
converted checkpoint) and ``OUTPUT_ARGS`` run. Only the model shape (its ``OVERRIDES`` hook),
the data, the checkpoint paths and the iteration count are swapped. World 4 = TP 2 inside each
node x DP 2 across the nodes, the layout of a real multi-node job, on gloo.
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.data_utils import write_packed_instruction_dataset
from tests.dist_harness import free_port
from tests.model_utils import TINY_FLAGS, write_converted_tiny_qwen2

REPO = Path(__file__).resolve().parents[1]
TUNE = REPO / "examples" / "qwen25" / "tune_qwen25_7b_4k_full_pack.sh"
SEQ_LENGTH = 128
TRAIN_ITERS = 3
TIMEOUT_S = 300
ITERATION_LINE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.* lm loss: (\S+) \|")


def _tiny_overrides(path: Path) -> Path:
    """Bash sourced by the tune script after its arrays: a tiny model shape and three iterations."""
    model = " ".join(f"'{x}'" for x in TINY_FLAGS + ["--seq-length", str(SEQ_LENGTH)])
    path.write_text(
        f"MODEL_ARGS=({model})\n"
        # the real TRAIN_ARGS, only the iteration count replaced
        "for i in \"${!TRAIN_ARGS[@]}\"; do\n"
        f"  if [[ ${{TRAIN_ARGS[$i]}} == --train-iters ]]; then TRAIN_ARGS[$((i + 1))]={TRAIN_ITERS}; fi\n"
        "done\n"
    )
    return path


def _launch_node(rank: int, env: dict, log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        # own session: on a timeout the whole node (launcher, torchrun, workers) is stopped together
        return subprocess.Popen(["bash", str(TUNE)], env={**env, "NODE_RANK": str(rank)}, stdout=out,
                                stderr=subprocess.STDOUT, cwd=log.parent, start_new_session=True)


def _wait(nodes, timeout: float) -> list:
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in nodes):
        failed = any(p.poll() not in (None, 0) for p in nodes)
        if failed or time.monotonic() > deadline:
            time.sleep(5 if failed else 0)  # a failed node's peer would wait for it until its own timeout
            for p in nodes:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGTERM)
            for p in nodes:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            break
        time.sleep(0.2)
    return [p.returncode for p in nodes]


@pytest.mark.slow
def test_two_node_launch_trains_tp2_dp2(tmp_path):
    data = write_packed_instruction_dataset(str(tmp_path / "data" / "toy"), num_packs=32, seq_length=SEQ_LENGTH)
    logs = tmp_path / "logs"
    env = {k: os.environ[k] for k in ("HOME", "LANG", "TMPDIR", "PYTHONPATH") if k in os.environ}
    env.update(
        PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin"),
        OMP_NUM_THREADS="1",
        NNODES="2", GPUS_PER_NODE="2", TP="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
        DATA_PATH=data,
        CKPT_LOAD_DIR=write_converted_tiny_qwen2(tmp_path / "converted", tp=2),
        CKPT_SAVE_DIR=str(tmp_path / "ckpt"),
        TOKENIZER_PATH=str(tmp_path / "unused-tokenizer"),  # --padded-vocab-size is given: never loaded
        LOG_DIR=str(logs),
        TENSORBOARD_DIR=str(logs / "tb"),
        OVERRIDES=str(_tiny_overrides(tmp_path / "tiny.sh")),
    )
    outputs = [tmp_path / f"node{r}.out" for r in (0, 1)]
    nodes = [_launch_node(r, env, outputs[r]) for r in (0, 1)]
    codes = _wait(nodes, TIMEOUT_S)
    tails = "\n".join(f"--- node {r} (exit {codes[r]}):\n{outputs[r].read_text()[-3000:]}" for r in (0, 1))
    assert codes == [0, 0], tails

    # the script tees each node's output into its own log
    node_logs = [(logs / f"tune_qwen25_7b_4k_full_pack_node{r}.log").read_text() for r in (0, 1)]
    # only the logging rank (last pipeline stage, first TP and DP rank = global rank 0, on node 0) prints steps
    steps = [m.groups() for m in ITERATION_LINE.finditer(node_logs[0])]
    assert [int(it) for it, _, _ in steps] == list(range(1, TRAIN_ITERS + 1)), tails
    assert all(math.isfinite(float(loss)) and float(loss) > 0 for _, _, loss in steps), steps
    assert not ITERATION_LINE.search(node_logs[1]), "node 1 holds no logging rank but printed steps"

    lines = [json.loads(line) for line in (logs / "tune_qwen25_7b_4k_full_pack.metrics.jsonl").read_text().splitlines()]
    # first line: what the run really used, the 7B recipe's precision and parallel flags included
    assert lines[0]["split"] == "setup", lines[0]
    precision = lines[0]["precision"]
    assert (precision["params"], precision["grads (main_grad buffers)"], precision["master weights"]) == \
        ("bfloat16", "float32", "float32"), precision
    assert precision["optimizer"] == "DistributedOptimizer" and precision["distributed optimizer"], precision
    assert precision["sequence parallel"], precision
    records = lines[1:]
    assert [r["iteration"] for r in records] == list(range(1, TRAIN_ITERS + 1))
    assert all(math.isfinite(r["lm loss"]) and math.isfinite(r["grad norm"]) for r in records), records
    assert all(math.isclose(r["lm loss"], float(loss), rel_tol=1e-5) for r, (_, _, loss) in zip(records, steps))
    assert records[-1]["consumed samples"] == 8 * TRAIN_ITERS  # the recipe's --global-batch-size 8

    # both tensor-parallel shards of the final checkpoint were written (by ranks on node 0; DP copies skip)
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(TRAIN_ITERS)
    for tp_rank in (0, 1):
        assert (ckpt / f"iter_{TRAIN_ITERS:07d}" / f"mp_rank_{tp_rank:02d}" / "model_optim_rng.pt").is_file()


def test_world_size_without_a_launcher_is_one_error_line_naming_torchrun(tmp_path):
    """``WORLD_SIZE=4 python posttrain.py ...`` (no torchrun: no RANK) used to wait for three peers that never
    come, silently, until the rendezvous timeout; now it stops at once, naming the launcher to use."""
    from tests.train_utils import run_posttrain

    data = write_packed_instruction_dataset(str(tmp_path / "copy"), num_packs=8)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    started = time.monotonic()
    proc, _ = run_posttrain(["--data-path", data, "--seq-length", "128", "--neat-pack", "--train-iters", "1",
                             "--global-batch-size", "4"], env={**env, "WORLD_SIZE": "4"}, check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert time.monotonic() - started < 60
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert errors == ["posttrain.py: error: WORLD_SIZE=4 but RANK is not set: this process was not started by a "
                      "launcher. Start the job with torchrun (torchrun --nproc-per-node 4 posttrain.py ...), or unset "
                      "WORLD_SIZE to run one process"], proc.stderr[-2000:]


def _init_with_rank_flags(prefix: str, per_rank: dict) -> str:
    """One rank of a job whose nodes were started with different flags: its flags parsed, then the process
    groups made from them; returns the error line (or "ok")."""
    from mindspeed_pack.config.arguments import parse_args
    from mindspeed_pack.config.resolved_config import flag_values
    from mindspeed_pack.runtime.process_groups import LaunchError, initialize_from_args

    rank = int(os.environ["RANK"])
    args = parse_args([*TINY_FLAGS, "--seq-length", str(SEQ_LENGTH), "--neat-pack", "--data-path", prefix,
                       "--train-iters", "3", "--global-batch-size", "2", *per_rank.get(rank, [])], world_size=2)
    os.environ["GROUP_RANK"] = str(rank)  # one process per "node"
    try:
        initialize_from_args(args, flags=flag_values(args))
    except LaunchError as e:
        return str(e)
    return "ok"


def test_nodes_started_with_different_flags_are_refused_naming_the_flag(tmp_path):
    """Node 1 started with another --lr (or --train-iters): its data-parallel replica trained apart from node 0's
    without a word (another --train-iters waited 10 minutes in mismatched collectives, then blamed a hung peer);
    now every rank stops at the rendezvous naming the rank, node and the flags' values."""
    from tests.dist_harness import run_distributed

    prefix = write_packed_instruction_dataset(str(tmp_path / "toy"), num_packs=8, seq_length=SEQ_LENGTH)
    same = run_distributed(_init_with_rank_flags, 2, prefix, {1: ["--metrics-file", str(tmp_path / "m.jsonl")]})
    assert same == ["ok", "ok"]  # where the logging rank writes may differ per node
    errors = run_distributed(_init_with_rank_flags, 2, prefix, {1: ["--lr", "5e-4", "--train-iters", "4"]})
    assert errors[0] == errors[1], errors
    assert errors[0].startswith("the ranks were started with different flags: rank 1 (node 1, host "), errors
    assert "--lr 0.0005 there, " in errors[0] and "--train-iters 4 there, 3 on rank 0" in errors[0], errors
    assert errors[0].endswith("start every node with the same command (only --node-rank differs)"), errors
    # node-local copies of the data at different paths: refused, saying what to do about it
    copy = write_packed_instruction_dataset(str(tmp_path / "node1" / "toy"), num_packs=8, seq_length=SEQ_LENGTH)
    errors = run_distributed(_init_with_rank_flags, 2, prefix, {1: ["--data-path", copy]})
    assert f"--data-path [{copy!r}] there, [{prefix!r}] on rank 0" in errors[0], errors
    assert errors[0].endswith("(only --node-rank differs); per-node copies of the data must sit at the same path on "
                              "every node (a symlink will do), or on a filesystem every node shares"), errors


def test_the_training_log_says_the_layout_every_node_joined(tmp_path, monkeypatch):
    """Two "nodes" of one process each: the log showed the steps but not the world they formed (Megatron-LM prints
    'using world size: 2, data-parallel size: 2, ...'), so a user could not see that both nodes joined as DP 2. Now
    the logging rank prints the layout once at start, with torchrun's node count."""
    from mindspeed_pack.config.arguments import parse_args
    from mindspeed_pack.training.layout import layout_line
    from tests.train_utils import run_posttrain

    data = write_packed_instruction_dataset(str(tmp_path / "toy"), num_packs=8, seq_length=SEQ_LENGTH)
    argv = ["--data-path", data, "--seq-length", str(SEQ_LENGTH), "--neat-pack", "--train-iters", "1",
            "--global-batch-size", "4"]
    proc, _ = run_posttrain(argv, nproc=2, timeout=300)  # the test harness's ranks are one node
    layouts = [line[line.index("layout: "):] for line in proc.stderr.splitlines() if ": layout: world " in line]
    rest = f"TP 1 x PP 1 x CP 1 x DP 2 (EP 1); global batch 4 = micro-batch 1 x DP 2 x 2 micro-batches of {SEQ_LENGTH} "
    assert layouts == [f"layout: world 2 = {rest}tokens per row"], proc.stderr[-3000:]
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")  # torchrun --nnodes 2
    assert layout_line(parse_args([*TINY_FLAGS, *argv], world_size=2)) == \
        f"layout: world 2 (2 nodes x 1 process) = {rest}tokens per row"


class _Copy:
    """A rank's data at the one --data-path every node was given: what its node's copy holds."""

    def __init__(self, prefix: str, fingerprint: str):
        self.prefix, self._fingerprint = prefix, fingerprint

    def fingerprint(self) -> str:
        return self._fingerprint


def _check_copies(fingerprints: list) -> str:
    import types

    import torch.distributed as dist

    from mindspeed_pack.datasets.packed_documents import DataError
    from mindspeed_pack.training.trainer import Trainer

    dist.init_process_group("gloo")
    os.environ["GROUP_RANK"] = os.environ["RANK"]  # one process per "node"
    fake = types.SimpleNamespace(source=types.SimpleNamespace(docs=[_Copy("data/sft", fingerprints[dist.get_rank()])]))
    try:
        Trainer._same_data_on_every_rank(fake)
    except DataError as e:
        return str(e)
    return "ok"


def test_per_node_copies_of_the_data_that_differ_are_refused(tmp_path):
    """Each node kept its own copy of the packs at the same --data-path (the flags agree), node 1's a stale one of
    another preprocessing: the run trained on both datasets mixed, each node's replicas reading theirs, without a
    word. Now every rank stops naming what each node holds; copies preprocessed alike from the same input, kept at
    different places, are the same data."""
    from mindspeed_pack.datasets.packed_documents import PackedDocuments
    from tests.dist_harness import run_distributed

    node0 = PackedDocuments(write_packed_instruction_dataset(str(tmp_path / "n0" / "sft"), num_packs=8, meta=True))
    twin = PackedDocuments(write_packed_instruction_dataset(str(tmp_path / "twin" / "sft"), num_packs=8, meta=True))
    stale = PackedDocuments(write_packed_instruction_dataset(str(tmp_path / "n1" / "sft"), num_packs=6, meta=True))
    assert node0.fingerprint() == twin.fingerprint() != stale.fingerprint()
    assert stale.fingerprint().startswith("6 documents, data ")
    assert run_distributed(_check_copies, 2, [node0.fingerprint(), twin.fingerprint()]) == ["ok", "ok"]
    errors = run_distributed(_check_copies, 2, [node0.fingerprint(), stale.fingerprint()])
    assert errors[0] == errors[1], errors
    assert errors[0] == (f"the ranks read different data at data/sft: node 0 (host {socket.gethostname()}, rank 0): "
                         f"{node0.fingerprint()}; node 1 (host {socket.gethostname()}, rank 1): {stale.fingerprint()}; "
                         "per-node copies must be the same files (copy node 0's to every node, or use a filesystem "
                         "every node shares)"), errors

"""Tiny packed datasets and posttrain runs for the training tests."""
import json
import os
import subprocess
import sys

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from tests.dist_harness import free_port
from tests.model_utils import TINY_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IGNORE = -100


def write_copy_task(prefix, num_packs=48, seq_length=128, seed=0, neat_pack=True, meta=True):
    """Packs of samples whose second half repeats the first (learnable); labels on the copy.

    Written like preprocess_data.py's output: aligned labels, first token of a sample -100,
    segment ids 1..k then 0 (or all ones without ``neat_pack``).
    """
    rng = np.random.default_rng(seed)
    builders = {k: IndexedDatasetBuilder(f"{prefix}_packed_{k}_document.bin", dtype=np.int32)
                for k in ("input_ids", "attention_mask", "labels")}
    for _ in range(num_packs):
        ids = np.zeros(seq_length, np.int32)
        labels = np.full(seq_length, IGNORE, np.int32)
        seg = np.zeros(seq_length, np.int32)
        pos, k = 0, 0
        while True:
            n = int(rng.integers(8, 40))
            if pos + n > seq_length:
                break
            x = rng.integers(3, 200, n)
            x[n // 2:] = x[: n - n // 2]
            k += 1
            ids[pos:pos + n], labels[pos + n // 2:pos + n], seg[pos:pos + n] = x, x[n // 2:], k
            pos += n
        mask = seg if neat_pack else np.ones(seq_length, np.int32)
        for key, arr in (("input_ids", ids), ("attention_mask", mask), ("labels", labels)):
            builders[key].add_document(arr, [seq_length])
    for key, b in builders.items():
        b.finalize(f"{prefix}_packed_{key}_document.idx")
    if meta:
        with open(f"{prefix}_packed_meta.json", "w") as f:
            json.dump({"layout": {"kind": "packed", "neat_pack": neat_pack, "seq_length": seq_length}}, f)
    return prefix


def run_posttrain(extra, nproc=1, metrics=None, timeout=600, check=True, env=None):
    """Run posttrain.py (torchrun for nproc > 1); returns (completed process, metrics records)."""
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(free_port())]
    cmd += [os.path.join(ROOT, "posttrain.py"), *TINY_FLAGS, *extra]
    if metrics:
        cmd += ["--metrics-file", metrics]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1" if nproc > 1 else "2", **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"posttrain failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    records = []
    if metrics and os.path.exists(metrics):
        with open(metrics) as f:
            records = [json.loads(line) for line in f if line.strip()]
    return proc, records


def train_losses(records):
    return [r["lm loss"] for r in records if r["split"] == "train"]

"""Dynamic context parallelism (--sequence-packing-scheduler default_dynamic_cp) trains exactly what one sample
per row on one rank trains, with short samples on single ranks and long ones split over CP groups.

Long-tail data: most samples under N tokens, some between N and 4N (up to 128 tokens), unpacked (one sample a
document). Reference: one sample per row of 128 tokens on one rank (scheduler none). Dynamic CP must give the
same loss and gradient norm every step (rel <= 1e-5) on 2 ranks (CP groups of 1 and 2, N = 64) and on 4 ranks
(groups of 1, 2 and 4, N = 32), with steps that really mix group sizes, and resume exactly mid-epoch.
"""
import json

import numpy as np
import pytest

from tests.data_utils import IGNORE_INDEX, _builder, read_metrics, rel_err
from tests.train_utils import run_posttrain

ITERS = 3
GBS = 8
COMMON = ["--seq-length", "128", "--micro-batch-size", "1", "--global-batch-size", str(GBS), "--lr", "1e-3",
          "--min-lr", "1e-4", "--lr-warmup-iters", "1", "--log-interval", "1", "--train-iters", str(ITERS),
          "--no-shuffle", "--split", "100,0,0",
          "--rotary-base", "100"]  # positions matter to every dimension: a CP rank's misplaced share shows
DYNAMIC = ["--sequence-packing-scheduler", "default_dynamic_cp"]

# most samples short, one in four long: 33..128 tokens (over N = 32 at CP 4, over N = 64 for some at CP 2)
LENGTHS = [9, 17, 100, 5, 23, 30, 41, 12, 7, 26, 3, 128, 19, 70, 11, 28, 6, 14, 57, 21, 31, 2, 95, 16,
           8, 29, 13, 66, 4, 25]


def write_long_tail(prefix, lengths=LENGTHS, seed=0, vocab=200):
    """One sample per document (preprocess_data.py without --pack): prompt = first half, answer copies it."""
    rng = np.random.default_rng(seed)
    keys = ("input_ids", "attention_mask", "labels")
    builders = {k: _builder(f"{prefix}_packed_{k}_document.bin") for k in keys}
    for n in lengths:
        x = rng.integers(3, vocab, n).astype(np.int32)
        x[n // 2:] = x[: n - n // 2]
        labels = np.full(n, IGNORE_INDEX, np.int32)
        labels[max(1, n // 2):] = x[max(1, n // 2):]
        for key, arr in zip(keys, (x, np.ones(n, np.int32), labels)):
            builders[key].add_document(arr, [n])
    for key, b in builders.items():
        b.finalize(f"{prefix}_packed_{key}_document.idx")
    with open(f"{prefix}_packed_meta.json", "w") as f:
        json.dump({"layout": {"kind": "unpacked", "seq_length": 128, "neat_pack": False}}, f)
    return prefix


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_long_tail(str(tmp_path_factory.mktemp("long_tail") / "docs"))


def _run(tmp_path, name, data, nproc, *extra):
    metrics = str(tmp_path / f"{name}.jsonl")
    run_posttrain([*COMMON, "--data-path", data, *extra], nproc=nproc, metrics=metrics)
    return read_metrics(metrics)


@pytest.fixture(scope="module")
def one_per_row(tmp_path_factory, data):
    return _run(tmp_path_factory.mktemp("ref"), "ref", data, 1)


def _assert_same_steps(got, want, rel=1e-5):
    assert sorted(got) == sorted(want) == list(range(1, ITERS + 1))
    for it in want:
        for key in ("lm loss", "grad norm"):
            assert rel_err(got[it][key], want[it][key]) <= rel, (it, key, got[it][key], want[it][key])
        assert got[it]["tokens"] == want[it]["tokens"]  # every real token trained, none twice


def _group_sizes_used(records):
    return [sorted(int(k.rsplit(" ", 1)[1]) for k in rec if k.startswith("samples at CP ")) for rec in records.values()]


def test_dynamic_cp2_equals_one_sample_per_row_and_resumes_exactly(tmp_path, data, one_per_row):
    ckpt = str(tmp_path / "ckpt")
    flags = [*DYNAMIC, "--context-parallel-size", "2", "--max-seqlen-per-dp-cp-rank", "64"]
    first = _run(tmp_path, "first", data, 2, *flags, "--save", ckpt, "--save-interval", "2", "--exit-interval", "2")
    assert sorted(first) == [1, 2]
    resumed = _run(tmp_path, "resumed", data, 2, *flags, "--load", ckpt)
    assert sorted(resumed) == [3]
    got = {**first, **resumed}
    _assert_same_steps(got, one_per_row)
    assert [1, 2] in _group_sizes_used(got)  # short samples alone, long ones over two ranks, in one step
    for rec in got.values():
        assert sum(v for k, v in rec.items() if k.startswith("samples at CP ")) == GBS


def test_dynamic_cp4_equals_one_sample_per_row_and_fixed_cp(tmp_path, data, one_per_row):
    got = _run(tmp_path, "dyn4", data, 4, *DYNAMIC, "--context-parallel-size", "4", "--max-seqlen-per-dp-cp-rank", "32")
    _assert_same_steps(got, one_per_row)
    assert [1, 2, 4] in _group_sizes_used(got)
    # fixed CP 4 (dp_balanced: every sample split over all four ranks) trains the same
    fixed = _run(tmp_path, "fixed4", data, 4, "--sequence-packing-scheduler", "dp_balanced",
                 "--context-parallel-size", "4", "--max-seqlen-per-dp-cp-rank", "32")
    _assert_same_steps(got, fixed)

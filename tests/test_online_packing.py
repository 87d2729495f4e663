"""Online packing (--sequence-packing-scheduler dp_balanced) trains exactly the samples of one-per-row runs.

Reference: unpacked data, one sample per row (--seq-length 128, scheduler none). Online packing
packs the same global batches into rows of 128 tokens, balanced over DP ranks; the per-token
mean loss over the global batch must not change, at DP1/DP2 and with TP2/PP2.
"""
import json

import numpy as np
import pytest
import torch

import posttrain
from tests.data_utils import IGNORE_INDEX, _builder, read_metrics, rel_err
from tests.model_utils import TINY_FLAGS
from tests.train_utils import run_posttrain

ITERS = 4
COMMON = ["--seq-length", "128", "--micro-batch-size", "1", "--global-batch-size", "8", "--lr", "1e-3",
          "--min-lr", "1e-4", "--lr-warmup-iters", "1", "--log-interval", "1", "--train-iters", str(ITERS),
          "--split", "90,10,0", "--eval-interval", "2", "--eval-iters", "1"]
ONLINE = ["--sequence-packing-scheduler", "dp_balanced"]


def write_unpacked(prefix, num_docs=44, seed=0, vocab=200, meta=True):
    """One sample per document (preprocess_data.py without --pack), 6..120 tokens, skewed short."""
    rng = np.random.default_rng(seed)
    keys = ("input_ids", "attention_mask", "labels")
    builders = {k: _builder(f"{prefix}_packed_{k}_document.bin") for k in keys}
    for _ in range(num_docs):
        n = int(min(120, 6 + rng.exponential(30)))
        x = rng.integers(3, vocab, n).astype(np.int32)
        x[n // 2:] = x[: n - n // 2]
        labels = np.full(n, IGNORE_INDEX, np.int32)
        labels[n // 2:] = x[n // 2:]
        for key, arr in zip(keys, (x, np.ones(n, np.int32), labels)):
            builders[key].add_document(arr, [n])
    for key, b in builders.items():
        b.finalize(f"{prefix}_packed_{key}_document.idx")
    if meta:
        with open(f"{prefix}_packed_meta.json", "w") as f:
            json.dump({"layout": {"kind": "unpacked", "seq_length": 128, "neat_pack": False}}, f)
    return prefix


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_unpacked(str(tmp_path_factory.mktemp("unpacked") / "docs"))


def _main(argv, metrics):
    """posttrain in this process (TP1 runs); returns {'train': {it: record}, 'valid': {it: record}}."""
    posttrain.main([*TINY_FLAGS, *argv, "--metrics-file", metrics])
    return _records(metrics)


def _records(metrics):
    return {split: read_metrics(metrics, split) for split in ("train", "valid")}


@pytest.fixture(scope="module")
def one_per_row(tmp_path_factory, data):
    return _main([*COMMON, "--data-path", data], str(tmp_path_factory.mktemp("ref") / "m.jsonl"))


@pytest.fixture(scope="module")
def online_dp1(tmp_path_factory, data):
    return _main([*COMMON, *ONLINE, "--data-path", data], str(tmp_path_factory.mktemp("online") / "m.jsonl"))


def _assert_same_losses(got: dict, want: dict, rel=1e-5):
    """Same train losses every step and same validation losses (evaluated at steps 2 and 4)."""
    assert sorted(got["train"]) == sorted(want["train"]) == list(range(1, ITERS + 1))
    assert sorted(got["valid"]) == sorted(want["valid"]) == [2, 4]
    for split in ("train", "valid"):
        for it, rec in want[split].items():
            assert rel_err(got[split][it]["lm loss"], rec["lm loss"]) <= rel, (split, it, got[split][it], rec)


def test_online_packing_equals_one_sample_per_row(online_dp1, one_per_row):
    _assert_same_losses(online_dp1, one_per_row)
    # the packed run used fewer, fuller rows for the same real tokens and model FLOPs
    got, want = online_dp1["train"], one_per_row["train"]
    for it in want:
        assert got[it]["tokens"] == want[it]["tokens"]
        assert got[it]["padding ratio"] < 0.5 * want[it]["padding ratio"]
        assert got[it]["model TFLOPs"] == pytest.approx(want[it]["model TFLOPs"], rel=1e-12)
        assert got[it]["rank imbalance"] == 1.0


@pytest.mark.parametrize("layout", [[], ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"],
                                    # rows of 2 x 64 tokens split over CP2, samples padded to multiples of 4
                                    ["--context-parallel-size", "2", "--max-seqlen-per-dp-cp-rank", "64"]],
                         ids=["dp2", "tp2", "pp2", "cp2"])
def test_online_packing_in_parallel_equals_one_sample_per_row(tmp_path, data, one_per_row, layout):
    metrics = str(tmp_path / "m.jsonl")
    run_posttrain([*COMMON, *ONLINE, "--data-path", data, *layout], nproc=2, metrics=metrics)
    got = _records(metrics)
    _assert_same_losses(got, one_per_row)
    assert all(got["train"][it]["tokens"] == rec["tokens"] for it, rec in one_per_row["train"].items())
    if not layout:
        assert all(1.0 <= r["rank imbalance"] < 1.5 for r in got["train"].values())


def test_resume_mid_epoch_under_online_packing_is_exact(tmp_path, data, online_dp1):
    # 40 training documents, 8 per global batch: iteration 2 ends mid-epoch
    ckpt = str(tmp_path / "ckpt")
    _main([*COMMON, *ONLINE, "--data-path", data, "--save", ckpt, "--exit-interval", "2"], str(tmp_path / "a.jsonl"))
    resumed = _main([*COMMON, *ONLINE, "--data-path", data, "--load", ckpt], str(tmp_path / "b.jsonl"))["train"]
    assert sorted(resumed) == [3, 4]
    for it in resumed:
        assert rel_err(resumed[it]["lm loss"], online_dp1["train"][it]["lm loss"]) <= 1e-6
        assert resumed[it]["consumed samples"] == online_dp1["train"][it]["consumed samples"]


def test_max_seqlen_per_rank_changes_rows_not_losses(tmp_path, data, one_per_row):
    got = _main([*COMMON, *ONLINE, "--max-seqlen-per-dp-cp-rank", "256", "--data-path", data], str(tmp_path / "m.jsonl"))
    _assert_same_losses(got, one_per_row)


def test_micro_batch_size_above_one_is_refused_under_online_packing(tmp_path, data):
    from mindspeed_pack.datasets.packed_dataset import DataError

    with pytest.raises(DataError, match="use --micro-batch-size 1"):
        _main([*COMMON, *ONLINE, "--micro-batch-size", "2", "--data-path", data], str(tmp_path / "m.jsonl"))


def test_online_rows_under_cp_hold_at_most_max_seqlen_per_cp_rank(data, monkeypatch):
    """Megatron-LM's cap: cap 32 per rank at CP2 gave micro-batches of 36, 34 and 36 tokens per rank."""
    from megatron.core import parallel_state as ps

    from mindspeed_pack.config.arguments import parse_args
    from mindspeed_pack.datasets.online_packing import BalancedBatchSource
    from mindspeed_pack.packing import context_parallel as cp_view
    from mindspeed_pack.packing.segments import build_packed_batch
    from mindspeed_pack.training.batches import to_packed_batch

    cap, cp = 32, 2
    monkeypatch.setattr(ps, "get_data_parallel_rank", lambda: 0)
    monkeypatch.setattr(ps, "get_data_parallel_world_size", lambda: 1)
    args = parse_args([*TINY_FLAGS, *COMMON, *ONLINE, "--data-path", data, "--context-parallel-size", str(cp),
                       "--max-seqlen-per-dp-cp-rank", str(cap)], world_size=cp)
    source = BalancedBatchSource()
    source.setup(args, {"train": ITERS * 8})
    multiple = cp_view.padding_multiple(cp)
    for consumed in range(0, ITERS * 8, 8):
        batches = [to_packed_batch(mb, args) for mb in source.micro_batches("train", consumed)]
        sizes = [cp_view.padded_size(b, multiple) // cp for b in batches]
        assert sizes == [cap] * len(batches), (consumed, sizes)  # every row full size, none over
        views, _ = cp_view.step_views(batches, cp, 1, multiple, same_length=False, max_per_rank=cap)
        assert all(v.tokens.shape[1] == cap for v in views)
        assert sum(len(row) for row in source._plan("train", consumed)["rows"]) == 8  # every sample of the batch
    # the trainer's check: a micro-batch that would exceed the cap stops the run
    seg = torch.tensor([[1] * 35 + [2] * 29])  # 35 -> 36 and 29 -> 32 once padded to 4: 68 tokens
    batch = build_packed_batch(torch.ones_like(seg), torch.ones_like(seg), seg)
    with pytest.raises(ValueError, match=r"68 tokens, 34 per CP rank, over --max-seqlen-per-dp-cp-rank 32 \(CP 2\)"):
        cp_view.step_views([batch], cp, 0, multiple, same_length=False, max_per_rank=cap)

"""posttrain.py end to end: parallel layouts, micro-batches, metrics, data order, errors."""
import os

import numpy as np
import pytest

from mindspeed_pack.datasets.packed_dataset import PackedDocuments, split_ranges
from mindspeed_pack.datasets.sample_index import build_sample_index
from tests.train_utils import run_posttrain, train_losses, write_copy_task

BASE = ["--seq-length", "128", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "2", "--neat-pack",
        "--no-shuffle", "--log-interval", "1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_copy_task(str(tmp_path_factory.mktemp("data") / "copy"))


def _run(tmp_path, data, name, extra, nproc=1):
    _, records = run_posttrain(BASE + ["--data-path", data] + extra, nproc=nproc,
                               metrics=str(tmp_path / f"{name}.jsonl"))
    return train_losses(records)


def _assert_close(a, b, rel):
    assert len(a) == len(b) and len(a) > 0
    err = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    assert err <= rel, f"max relative error {err:.3e} > {rel}: {a} vs {b}"


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory, data):
    tmp = tmp_path_factory.mktemp("ref")
    return _run(tmp, data, "tp1", ["--train-iters", "5", "--micro-batch-size", "2", "--global-batch-size", "4"])


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]],
                         ids=["tp2", "pp2"])
def test_tp2_and_pp2_match_tp1(tmp_path, data, reference_losses, layout):
    losses = _run(tmp_path, data, "par", ["--train-iters", "5", "--micro-batch-size", "2", "--global-batch-size", "4",
                                          *layout], nproc=2)
    _assert_close(losses, reference_losses, 1e-4)


def test_data_parallel_2_matches_single_process(tmp_path, data, reference_losses):
    losses = _run(tmp_path, data, "dp2", ["--train-iters", "5", "--micro-batch-size", "1", "--global-batch-size", "4"],
                  nproc=2)
    _assert_close(losses, reference_losses, 1e-4)


def test_micro_batch_2_equals_accumulation_2(tmp_path, data):
    mbs2 = _run(tmp_path, data, "mbs2", ["--train-iters", "4", "--micro-batch-size", "2", "--global-batch-size", "2"])
    acc2 = _run(tmp_path, data, "acc2", ["--train-iters", "4", "--micro-batch-size", "1", "--global-batch-size", "2"])
    _assert_close(mbs2, acc2, 1e-5)


def test_metrics_file_and_tensorboard(tmp_path, data):
    tb = tmp_path / "tb"
    proc, records = run_posttrain(BASE + ["--data-path", data, "--train-iters", "3", "--global-batch-size", "2",
                                          "--tensorboard-dir", str(tb)], metrics=str(tmp_path / "m.jsonl"))
    assert [r["iteration"] for r in records] == [1, 2, 3]
    for field in ("iteration", "split", "lm loss", "lr", "grad norm", "tokens", "tokens/s", "padding ratio",
                  "samples per pack"):
        assert field in records[0], field
    assert all(np.isfinite(r["lm loss"]) and r["tokens"] > 0 for r in records)
    assert records[0]["samples per pack"] > 1.5  # the copy-task packs hold several samples
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tb))
    assert "lm loss:" in proc.stdout and "tokens/s:" in proc.stdout


def test_loss_falls_over_a_short_run(tmp_path, data):
    losses = _run(tmp_path, data, "long", ["--train-iters", "60", "--micro-batch-size", "2", "--global-batch-size", "4",
                                           "--lr", "3e-3", "--lr-warmup-iters", "5"])
    assert np.mean(losses[-5:]) < 0.9 * np.mean(losses[:5]), losses


def test_neat_pack_on_data_without_segment_ids_is_refused(tmp_path):
    plain = write_copy_task(str(tmp_path / "plain"), num_packs=4, neat_pack=False)
    proc, _ = run_posttrain(BASE + ["--data-path", plain, "--train-iters", "1"], check=False)
    assert proc.returncode != 0
    assert "--neat-pack" in proc.stderr and "segment ids" in proc.stderr


@pytest.mark.parametrize("flags,message", [
    (["--tensor-model-parallel-size", "3"], "must divide the query groups"),
    (["--global-batch-size", "3", "--micro-batch-size", "2"], "--global-batch-size"),
    (["--seq-length", "1"], "--seq-length"),
])
def test_invalid_flags_fail_clearly(tmp_path, data, flags, message):
    proc, _ = run_posttrain(BASE + ["--data-path", data, "--train-iters", "1", *flags], check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]


def test_missing_data_prefix_names_the_files(tmp_path):
    proc, _ = run_posttrain(BASE + ["--data-path", str(tmp_path / "nope"), "--train-iters", "1",
                                    "--padded-vocab-size", "256"], check=False)
    assert proc.returncode == 2 and "nope_packed_input_ids_document.bin" in proc.stderr
    assert "posttrain.py: error:" in proc.stderr and "Traceback" not in proc.stderr


def test_no_shuffle_reads_packs_in_order_and_padded_samples_complete_the_batch(data):
    docs = PackedDocuments(data)
    start, end = split_ranges(len(docs), "90,10,0")[0]
    assert (start, end) == (0, 43)
    ordered = build_sample_index(end - start, 86, seed=1, shuffle=False)
    assert ordered.tolist() == list(range(43)) * 2
    padded = build_sample_index(end - start, 88, seed=1, shuffle=False, padded_samples=True, global_batch_size=4)
    # 43 packs -> 44 per epoch: the epoch's first pack completes its last global batch
    assert padded[:44].tolist() == list(range(43)) + [0]
    shuffled = build_sample_index(end - start, 43, seed=1, shuffle=True)
    assert sorted(shuffled.tolist()) == list(range(43)) and shuffled.tolist() != list(range(43))
    assert build_sample_index(end - start, 43, seed=2, shuffle=True).tolist() != shuffled.tolist()


def test_trained_checkpoint_resharded_to_tp2_gives_the_same_validation_loss(tmp_path, data):
    """train (TP1, --save) -> convert_ckpt.py mg->mg TP2 -> --skip-train at TP2: same valid loss."""
    from tests.preloaded import run_script

    common = BASE + ["--data-path", data, "--split", "80,20,0", "--eval-iters", "1", "--global-batch-size", "2"]
    _, trained = run_posttrain(common + ["--train-iters", "2", "--eval-interval", "2", "--save", str(tmp_path / "tp1")],
                               metrics=str(tmp_path / "train.jsonl"))
    converted = run_script("convert_ckpt.py", ["--load-model-type", "mg", "--save-model-type", "mg", "--load-dir",
                                               str(tmp_path / "tp1"), "--save-dir", str(tmp_path / "tp2"),
                                               "--target-tensor-parallel-size", "2"])
    assert converted.returncode == 0, converted.stderr[-3000:]
    _, evaluated = run_posttrain(common + ["--skip-train", "--load", str(tmp_path / "tp2"),
                                           "--tensor-model-parallel-size", "2"], nproc=2,
                                 metrics=str(tmp_path / "eval.jsonl"))
    # training validated at 2 and again at the end (the next samples); --skip-train reads the first ones
    before = [r["lm loss"] for r in trained if r["split"] == "valid"]
    after = [r["lm loss"] for r in evaluated if r["split"] == "valid"]
    assert len(before) == 2 and len(after) == 1
    assert abs(before[0] - after[0]) <= 1e-5 * abs(before[0])


def test_neat_pack_without_sidecar_still_detects_missing_segment_ids(tmp_path):
    plain = write_copy_task(str(tmp_path / "plain"), num_packs=4, neat_pack=False, meta=False)
    proc, _ = run_posttrain(BASE + ["--data-path", plain, "--train-iters", "1"], check=False)
    assert proc.returncode == 2 and "holds no segment ids" in proc.stderr


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_non_finite_loss_is_skipped_or_stops_naming_the_iteration(tmp_path, data, policy):
    # an absurd learning rate blows the weights up after the first update
    flags = BASE + ["--data-path", data, "--train-iters", "3", "--global-batch-size", "2", "--lr", "1e30", "--lr-warmup-iters", "0",
                    "--clip-grad", "0", "--nan-policy", policy]
    proc, records = run_posttrain(flags, metrics=str(tmp_path / "m.jsonl"), check=False)
    if policy == "skip":
        assert proc.returncode == 0
        assert [r["skipped"] for r in records] == [0, 1, 2]
    else:
        assert proc.returncode == 1
        assert "non-finite loss" in proc.stderr and "iteration 2" in proc.stderr and "Traceback" not in proc.stderr

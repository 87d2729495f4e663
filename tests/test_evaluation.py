"""Evaluation: validation loss every --eval-interval, and --skip-train reproduces it from a checkpoint."""
import os
import shutil

import pytest

import posttrain
from mindspeed_pack import checkpoint_layout as layout
from tests.data_utils import read_metrics, rel_err, write_packed_instruction_dataset
from tests.model_utils import TINY_FLAGS


def argv(data, metrics, *extra):
    return [*TINY_FLAGS, "--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--lr", "1e-3", "--neat-pack", "--split", "80,20,0", "--eval-iters", "2", "--data-path", data,
            "--metrics-file", metrics, *extra]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """4 steps evaluating and saving every 2: (data, dir, valid records, console output)."""
    d = tmp_path_factory.mktemp("eval")
    data = write_packed_instruction_dataset(str(d / "toy"), num_packs=40, seed=3)
    posttrain.main(argv(data, str(d / "m.jsonl"), "--train-iters", "4", "--eval-interval", "2",
                        "--save", str(d / "ckpt"), "--save-interval", "2", "--tensorboard-dir", str(d / "tb")))
    return data, d, read_metrics(str(d / "m.jsonl"), "valid")


def test_validation_loss_is_logged_every_interval(trained, capsys):
    _, d, valid = trained
    assert sorted(valid) == [2, 4]
    assert all(r["tokens"] > 0 and 0 < r["lm loss"] < 10 for r in valid.values())
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(d / "tb"))
    events.Reload()
    scalars = events.Scalars("valid/lm loss")
    assert [s.step for s in scalars] == [2, 4]
    assert rel_err(scalars[1].value, valid[4]["lm loss"]) <= 1e-6  # float32 in TensorBoard


@pytest.mark.parametrize("iteration", [2, 4])
def test_skip_train_reports_the_training_runs_validation_loss(trained, tmp_path, capsys, iteration):
    data, d, valid = trained
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(d / "ckpt", ckpt)
    layout.write_tracker(ckpt, iteration)
    metrics = str(tmp_path / "eval.jsonl")
    capsys.readouterr()
    posttrain.main(argv(data, metrics, "--skip-train", "--load", ckpt))
    got = read_metrics(metrics, "valid")
    assert list(got) == [iteration]
    assert rel_err(got[iteration]["lm loss"], valid[iteration]["lm loss"]) <= 1e-9
    assert read_metrics(metrics) == {}  # nothing trained ...
    assert sorted(os.listdir(ckpt)) == sorted(os.listdir(d / "ckpt"))  # ... nor saved
    assert f"validation loss at iteration {iteration} | lm loss value:" in capsys.readouterr().out


def test_skip_train_without_validation_split_fails(trained, tmp_path):
    data, d, _ = trained
    with pytest.raises(ValueError, match="validation split is empty"):
        posttrain.main(argv(data, str(tmp_path / "m.jsonl"), "--skip-train", "--load", str(d / "ckpt"),
                            "--split", "100,0,0"))

"""Evaluation as in Megatron-LM: every --eval-interval and at the end, each validation on the next
--eval-iters global batches of the validation split (cycling), a resume continuing there; --skip-train
evaluates the split's first batches."""
import json
import os
import shutil

import pytest

import posttrain
from mindspeed_pack.convert import megatron_layout as layout
from tests.data_utils import read_metrics, rel_err, write_packed_instruction_dataset
from tests.model_utils import TINY_FLAGS


def argv(data, metrics, *extra):
    return [*TINY_FLAGS, "--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--lr", "1e-3", "--neat-pack", "--split", "80,20,0", "--eval-iters", "1", "--data-path", data,
            "--metrics-file", metrics, *extra]


def valid_records(metrics: str) -> list:
    """Every validation record in order (the end of training re-evaluates the last iteration)."""
    with open(metrics) as f:
        return [r for r in map(json.loads, f) if r.get("split") == "valid"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """4 steps evaluating and saving every 2 (8 validation packs, 4 per evaluation): (data, dir, valid records)."""
    d = tmp_path_factory.mktemp("eval")
    data = write_packed_instruction_dataset(str(d / "toy"), num_packs=40, seed=3)
    posttrain.main(argv(data, str(d / "m.jsonl"), "--train-iters", "4", "--eval-interval", "2",
                        "--save", str(d / "ckpt"), "--save-interval", "2", "--tensorboard-dir", str(d / "tb")))
    return data, d, valid_records(str(d / "m.jsonl"))


def test_validation_loss_is_logged_every_interval_and_at_the_end(trained, capsys):
    _, d, valid = trained
    assert [r["iteration"] for r in valid] == [2, 4, 4]
    # the two records of iteration 4 are told apart: the interval's evaluation and the end of training's
    assert [r.get("label") for r in valid] == [None, None, "the end of training for val data"]
    assert all(r["tokens"] > 0 and 0 < r["lm loss"] < 10 for r in valid)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(d / "tb"))
    events.Reload()
    scalars = events.Scalars("valid/lm loss")
    assert [s.step for s in scalars] == [2, 4, 4]
    assert rel_err(scalars[2].value, valid[2]["lm loss"]) <= 1e-6  # float32 in TensorBoard


def test_each_validation_reads_the_next_samples_of_the_split(trained, tmp_path):
    """Two evaluations of the same weights see different samples; the third cycles to the first."""
    from mindspeed_pack.config.arguments import parse_args
    from mindspeed_pack.datasets.packed_dataset import PackedBatchSource
    from tests.train_utils import sft_trainer

    data, d, _ = trained
    trainer = sft_trainer(parse_args(argv(data, str(tmp_path / "m.jsonl"), "--train-iters", "4", "--eval-interval",
                                      "2")), PackedBatchSource())
    trainer.setup()
    try:
        losses = [trainer.evaluate() for _ in range(3)]  # the run's 3 evaluations (at 2, 4 and the end)
    finally:
        trainer.cleanup()
    assert losses[0] != losses[1] and losses[2] == losses[0], losses  # 8 packs in the split: windows 0, 4, 0


def test_a_resumed_run_evaluates_what_the_uninterrupted_run_did(trained, tmp_path):
    data, d, valid = trained
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(d / "ckpt", ckpt)
    layout.write_tracker(ckpt, 2)
    metrics = str(tmp_path / "resumed.jsonl")
    posttrain.main(argv(data, metrics, "--train-iters", "4", "--eval-interval", "2", "--load", ckpt))
    resumed = valid_records(metrics)
    assert [r["iteration"] for r in resumed] == [4, 4]
    for got, want in zip(resumed, valid[1:]):
        assert rel_err(got["lm loss"], want["lm loss"]) <= 1e-9, (resumed, valid)


@pytest.mark.parametrize("iteration", [2])
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
    # the split's first samples, as the training run's first validation (at iteration 2) read them
    assert rel_err(got[iteration]["lm loss"], valid[0]["lm loss"]) <= 1e-9
    assert read_metrics(metrics) == {}  # nothing trained ...
    assert sorted(os.listdir(ckpt)) == sorted(os.listdir(d / "ckpt"))  # ... nor saved
    assert f"validation loss at iteration {iteration} | lm loss value:" in capsys.readouterr().out


def test_skip_train_without_validation_split_fails(trained, tmp_path):
    data, d, _ = trained
    with pytest.raises(ValueError, match="validation split is empty"):
        posttrain.main(argv(data, str(tmp_path / "m.jsonl"), "--skip-train", "--load", str(d / "ckpt"),
                            "--split", "100,0,0"))


def test_evaluation_asked_for_without_validation_data_is_said(trained, tmp_path, caplog):
    """--eval-interval given with the whole data in the training split: no evaluation can run, and the run says so
    (it was skipped without a word); with the defaults alone nothing is said."""
    data = trained[0]
    with caplog.at_level("WARNING"):
        posttrain.main([*argv(data, str(tmp_path / "m.jsonl"), "--train-iters", "1", "--eval-interval", "1"),
                        "--split", "100,0,0"])
    assert "--eval-interval and --eval-iters given, but there is no validation data (--split 100,0,0" in caplog.text
    assert valid_records(str(tmp_path / "m.jsonl")) == []
    caplog.clear()
    with caplog.at_level("WARNING"):
        posttrain.main([*TINY_FLAGS, "--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "4",
                        "--neat-pack", "--data-path", data, "--train-iters", "1"])
    assert "no validation data" not in caplog.text


@pytest.mark.parametrize("skip_train", [True, False])
def test_skip_train_from_a_hugging_face_model_does_not_warn_that_nothing_is_exported(tmp_path, caplog, skip_train):
    """--skip-train trains nothing, so 'the trained model will not be written' was noise on every evaluation run."""
    import logging

    import transformers

    from mindspeed_pack.config.arguments import parse_args

    config = transformers.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    transformers.Qwen2ForCausalLM(config).save_pretrained(str(tmp_path / "hf"))
    data = write_packed_instruction_dataset(str(tmp_path / "toy"), num_packs=8, seed=3)
    flags = ["--skip-train"] if skip_train else ["--train-iters", "2"]
    with caplog.at_level(logging.WARNING, logger="mindspeed_pack.config.finetune_defaults"):
        parse_args(["--seq-length", "128", "--neat-pack", "--global-batch-size", "2", "--eval-iters", "1",
                    "--data-path", data, "--load", str(tmp_path / "hf"), *flags], world_size=1)
    assert ("will not be written" in caplog.text) is not skip_train

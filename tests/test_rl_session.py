"""The in-process RL session is the file path's twin: scoring and GRPO steps on rollouts handed
over in memory equal ``posttrain.py --stage score`` / ``--stage grpo`` on the same rollouts in a file."""
import json

import numpy as np
import pytest
import torch
import transformers

import posttrain
from mindspeed_pack.convert.megatron_layout import checkpoint_file
from mindspeed_pack.datasets.packed_dataset import DataError
from mindspeed_pack.training.rl_session import RLSession
from tests.model_utils import TINY_FLAGS, write_converted_tiny_qwen2
from tests.rollout_utils import random_rollouts, write_jsonl

DETERMINISTIC = ("lm loss", "grad norm", "lr", "pg loss", "clip fraction", "approx kl", "ratio mean", "ratio max",
                 "response length", "padding ratio", "tokens", "consumed samples", "samples per pack")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return write_converted_tiny_qwen2(tmp_path_factory.mktemp("rl_session_qwen2"))


def _flags(converted):
    return [*TINY_FLAGS, "--seq-length", "128", "--micro-batch-size", "1", "--global-batch-size", "4",
            "--load", converted, "--finetune", "--max-seqlen-per-dp-cp-rank", "48", "--lr", "3e-3",
            "--clip-grad", "1.0", "--train-iters", "2", "--clip-ratio", "0.1", "0.2"]


def _model(ckpt, iteration):
    return torch.load(checkpoint_file(ckpt, iteration, 0, 0, 1), weights_only=False)["model"]


def test_session_score_and_step_equal_posttrain_on_the_same_file(converted, tmp_path):
    rows = random_rollouts(8, seed=11)
    for row in rows[4:]:  # half with a scalar reward and a group instead of per-token advantages
        row["reward"], row["group"] = float(len(row["response_ids"]) % 3), len(row["prompt_ids"]) % 2
        del row["advantages"]
    flags = _flags(converted)
    scored = str(tmp_path / "scored.jsonl")
    posttrain.main(["--stage", "score", "--rollout-path", write_jsonl(tmp_path / "r.jsonl", rows),
                    "--score-output", scored, *flags])
    posttrain.main(["--stage", "grpo", "--rollout-path", scored, "--save", str(tmp_path / "file"),
                    "--metrics-file", str(tmp_path / "file.jsonl"), *flags])
    with open(tmp_path / "file.jsonl") as f:
        expected = [r for r in map(json.loads, f) if r["split"] == "train"]
    with open(scored) as f:
        file_logps = [r["old_logprobs"] for r in map(json.loads, f)]

    with RLSession.from_argv(flags) as session:
        logps = session.score(rows)
        for row, mine, theirs in zip(rows, logps, file_logps):
            assert len(mine) == len(row["response_ids"])
            np.testing.assert_array_equal(mine, theirs)
            row["old_logprobs"] = mine.tolist()
        records = session.step(rows)
        session.save(str(tmp_path / "session"))
        # the HF export is the current step's model: transformers' log-probs equal the session's
        session.export_hf(str(tmp_path / "hf"))
        now = session.score(rows)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32,
                                                           attn_implementation="eager")
    with torch.no_grad():
        for row, mine in zip(rows, now):
            p = len(row["prompt_ids"])
            ids = torch.tensor(row["prompt_ids"] + row["response_ids"])
            theirs = torch.log_softmax(hf(ids[None]).logits[0, p - 1:-1].double(), -1).gather(1, ids[p:, None])[:, 0]
            assert float((torch.from_numpy(mine) - theirs).abs().max() / theirs.abs().max()) <= 1e-5
        assert not np.allclose(now[0], logps[0])  # the weights did change
    assert [r["iteration"] for r in records] == [1, 2]
    assert records[0]["ratio mean"] == records[0]["ratio max"] == 1.0 and records[0]["clip fraction"] == 0.0
    assert records[1]["ratio max"] != 1.0  # the second step sees the first one's update
    for mine, theirs in zip(records, expected):
        assert {k: mine[k] for k in DETERMINISTIC} == {k: theirs[k] for k in DETERMINISTIC}
    a, b = _model(str(tmp_path / "file"), 2), _model(str(tmp_path / "session"), 2)
    assert a.keys() == b.keys()
    for name in a:
        if isinstance(a[name], torch.Tensor):
            assert torch.equal(a[name], b[name]), name
    assert not torch.equal(a["embedding.word_embeddings.weight"],
                           _model_release(converted)["embedding.word_embeddings.weight"])


def _model_release(converted):
    return torch.load(checkpoint_file(converted, "release", 0, 0, 1), weights_only=False)["model"]


def test_session_names_a_bad_handed_rollout_and_keeps_row_order_when_dropping(converted):
    with RLSession.from_argv([*_flags(converted), "--rollout-overlong", "drop"]) as session:
        good = {"prompt_ids": [1, 2], "response_ids": [3, 4], "advantages": [1.0, -1.0]}
        long = {"prompt_ids": [1] * 40, "response_ids": [2] * 20, "advantages": [0.0] * 20}
        scores = session.score([long, good, long, {**good, "response_ids": [5, 6, 7], "advantages": [0, 0, 0]}])
        assert scores[0] is None and scores[2] is None and [len(scores[1]), len(scores[3])] == [2, 3]
        with pytest.raises(DataError, match=r"rollout 1: field 'response_ids'\[0\] = 999 does not fit"):
            session.step([good, {**good, "response_ids": [999, 4]}])
        with pytest.raises(DataError, match="rollout 0: neither 'advantages'"):
            session.step([{"prompt_ids": [1], "response_ids": [2]}])


def _session_run(flags, rows, save_dir):
    """One rank of a session job: score the rows, step on them, save; every rank returns what it saw."""
    with RLSession.from_argv(flags) as session:
        logps = session.score(rows)
        for row, mine in zip(rows, logps):
            row["old_logprobs"] = mine.tolist()
        records = session.step(rows)
        session.save(save_dir)
    return [lp.tolist() for lp in logps], records


def test_session_at_dp2_equals_the_file_path_at_dp2(converted, tmp_path):
    from tests.dist_harness import run_distributed
    from tests.train_utils import run_posttrain

    rows = random_rollouts(8, seed=5)
    flags = _flags(converted)
    extra = flags[len(TINY_FLAGS):]  # run_posttrain adds the tiny model's flags itself
    scored = str(tmp_path / "scored.jsonl")
    run_posttrain(["--stage", "score", "--rollout-path", write_jsonl(tmp_path / "r.jsonl", rows),
                   "--score-output", scored, *extra], nproc=2)
    _, expected = run_posttrain(["--stage", "grpo", "--rollout-path", scored, "--save", str(tmp_path / "file"),
                                 *extra], nproc=2, metrics=str(tmp_path / "file.jsonl"))
    with open(scored) as f:
        file_logps = [r["old_logprobs"] for r in map(json.loads, f)]
    results = run_distributed(_session_run, 2, flags, rows, str(tmp_path / "session"), timeout=300)
    for logps, records in results:  # every rank holds the whole table and the same step records
        assert logps == file_logps
        assert [{k: r[k] for k in DETERMINISTIC} for r in records] == \
            [{k: r[k] for k in DETERMINISTIC} for r in expected if r["split"] == "train"]
    a, b = _model(str(tmp_path / "file"), 2), _model(str(tmp_path / "session"), 2)
    for name in a:
        if isinstance(a[name], torch.Tensor):
            assert torch.equal(a[name], b[name]), name


def test_step_says_when_its_last_global_batch_repeats_rollouts(converted, caplog):
    """6 rollouts at --global-batch-size 4: step() takes 2 steps, the second fills up with rollouts 0 and 1
    again (cycling); said, since "each row once" is not what happens."""
    rows = random_rollouts(6, seed=3)
    with RLSession.from_argv(_flags(converted)) as session:
        with caplog.at_level("WARNING", logger="mindspeed_pack.training.rl_session"):
            records = session.step(rows)
        assert [r["consumed samples"] for r in records] == [4, 8]
        assert "6 rollouts are not a multiple of --global-batch-size 4" in caplog.text
        assert "2 of them (rollout 0 to rollout 1) are trained twice" in caplog.text
        caplog.clear()
        with caplog.at_level("WARNING", logger="mindspeed_pack.training.rl_session"):
            session.step(rows[:4])
            session.step(rows, steps=1)  # steps given: the caller's choice
        assert "not a multiple" not in caplog.text


def test_export_hf_into_a_taken_directory_is_named_by_the_call(converted, tmp_path):
    """export_hf(DIR) twice: the error names the call and DIR (not --save-hf or the converter's --save-dir)."""
    with RLSession.from_argv(_flags(converted)) as session:
        session.export_hf(str(tmp_path / "hf"))
        before = sorted(p.name for p in (tmp_path / "hf").iterdir())
        with pytest.raises(DataError) as e:
            session.export_hf(str(tmp_path / "hf"))
        assert str(e.value).startswith(f"export_hf({str(tmp_path / 'hf')!r}): it exists and is not an empty "
                                       "directory"), str(e.value)
        assert "--save" not in str(e.value)
        assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == before
        (tmp_path / "empty").mkdir()
        session.export_hf(str(tmp_path / "empty"))  # an empty directory is fine
        assert (tmp_path / "empty" / "config.json").is_file()

"""The RL examples work end to end as a user runs them (in process here, to share the imports):
a GRPO loop on self-sampled rollouts raises the reward; rollout files replay round after round."""
import importlib.util
import json
import os

import pytest

from mindspeed_pack.datasets.packed_dataset import DataError
from tests.model_utils import TINY_FLAGS, write_converted_tiny_qwen2
from tests.rollout_utils import random_rollouts, write_jsonl

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "rl")


def _example(name):
    spec = importlib.util.spec_from_file_location(f"rl_example_{name}", os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grpo_loop_on_self_sampled_rollouts_raises_the_reward(tmp_path):
    """7 rounds of 16 prompts x 8 samples (2 tokens each) from the model's own HF export: the mean
    sampled reward (256 tokens a round; ~0.03 sampling noise) rises by far more than chance allows."""
    rounds = 7
    history = _example("reward_loop").main([
        *TINY_FLAGS, "--padded-vocab-size", "8", "--seq-length", "512", "--max-seqlen-per-dp-cp-rank", "512",
        "--micro-batch-size", "1", "--global-batch-size", "128", "--train-iters", str(2 * rounds),
        "--lr", "5e-3", "--min-lr", "0", "--lr-decay-style", "constant", "--clip-grad", "1.0", "--seed", "1",
        "--clip-ratio", "0.2", "--rl-output-dir", str(tmp_path), "--rounds", str(rounds), "--steps-per-round", "2",
        "--prompts-per-round", "16", "--samples-per-prompt", "8", "--prompt-length", "2", "--response-length", "2"])
    rewards = [h["sampled reward"] for h in history]
    assert len(rewards) == rounds and all(h["ratio max (first step)"] == 1.0 for h in history), history
    assert (rewards[-1] + rewards[-2]) / 2 > rewards[0] + 0.2, rewards
    with open(tmp_path / "rounds.jsonl") as f:
        assert [json.loads(line)["sampled reward"] for line in f] == rewards
    assert sorted(os.listdir(tmp_path / "hf")) == [f"iter_{2 * k:07d}" for k in range(rounds)]


def test_replay_scores_steps_saves_and_exports_each_round(tmp_path, capsys):
    converted = write_converted_tiny_qwen2(tmp_path / "model")
    files = []
    for k in range(2):
        rows = random_rollouts(8, seed=20 + k, advantages=False)
        for i, row in enumerate(rows):
            row["reward"], row["group"] = float(i % 3), i // 4
        files.append(write_jsonl(tmp_path / f"round_{k:03d}.jsonl", rows))
    flags = [*TINY_FLAGS, "--seq-length", "128", "--max-seqlen-per-dp-cp-rank", "64", "--micro-batch-size", "1",
             "--global-batch-size", "4", "--train-iters", "8", "--lr", "1e-3", "--load", converted, "--finetune",
             "--save", str(tmp_path / "ckpt"), "--rl-output-dir", str(tmp_path / "out")]
    replay = _example("replay_rollouts")
    capsys.readouterr()
    replay.main([*flags, "--rollout-rounds", *files])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"round"')]
    assert [(r["round"], r["iteration"], r["old_logprobs scored"]) for r in lines] == [(0, 2, True), (1, 4, True)]
    assert all(r["ratio max"] != 1.0 for r in lines)  # the second step of a round sees the first one's update
    assert sorted(os.listdir(tmp_path / "out" / "hf")) == ["iter_0000002", "iter_0000004"]
    assert open(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read().strip() == "4"
    bad = write_jsonl(tmp_path / "round_bad.jsonl", [{"prompt_ids": [1], "response_ids": [2], "reward": 1.0,
                                                      "group": 0}, {"prompt_ids": [1], "response_ids": [999]}])
    with pytest.raises(DataError, match=r"round_bad.jsonl: line 2: field 'response_ids'\[0\] = 999"):
        replay.main([*flags, "--rollout-rounds", bad])


def test_replay_drops_an_over_long_rollout_under_rollout_overlong_drop(tmp_path, capsys):
    """--rollout-overlong drop: the session scores None for the dropped row; the replay steps on the others."""
    converted = write_converted_tiny_qwen2(tmp_path / "model")
    rows = random_rollouts(8, seed=30, advantages=False)
    for i, row in enumerate(rows):
        row["reward"], row["group"] = float(i % 3), i // 4
    rows[2]["response_ids"] = [5] * 70  # > --max-seqlen-per-dp-cp-rank 64
    rows[2]["response_mask"] = [1] * 70
    path = write_jsonl(tmp_path / "round_000.jsonl", rows)
    flags = [*TINY_FLAGS, "--seq-length", "128", "--max-seqlen-per-dp-cp-rank", "64", "--micro-batch-size", "1",
             "--global-batch-size", "4", "--train-iters", "4", "--lr", "1e-3", "--load", converted, "--finetune",
             "--rollout-overlong", "drop", "--no-export-hf", "--rl-output-dir", str(tmp_path / "out")]
    capsys.readouterr()
    _example("replay_rollouts").main([*flags, "--rollout-rounds", path])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"round"')]
    assert [(r["round"], r["iteration"]) for r in lines] == [(0, 2)]

"""Rollout files: checked on load (each bad row named), advantages from rewards, and the packed
layout that puts response token j's fields where token j is predicted."""
import numpy as np
import pytest
import torch

from mindspeed_pack.datasets.packed_dataset import DataError
from mindspeed_pack.datasets.rollouts import load_rollouts, rollout_row
from mindspeed_pack.packing.segments import build_packed_batch
from tests.rollout_utils import random_rollouts, write_jsonl

GOOD = {"prompt_ids": [1, 2, 3], "response_ids": [4, 5], "advantages": [0.5, -1.0]}


@pytest.mark.parametrize("bad,message", [
    ({"prompt_ids": [1, 2], "response_ids": [4, 5], "advantages": [0.5]}, "field 'advantages' has 1 values but "
                                                                         "response_ids has 2"),
    ({"prompt_ids": [1, 300], "response_ids": [4], "advantages": [0.1]}, "field 'prompt_ids'[1] = 300 does not fit"),
    ({"prompt_ids": [1], "response_ids": [4, 5], "response_mask": [1], "advantages": [0, 0]},
     "field 'response_mask' has 1 values"),
    ({"prompt_ids": [1], "response_ids": [4, 5], "old_logprobs": [0.1, 0.2, 0.3], "advantages": [0, 0]},
     "field 'old_logprobs' has 3 values"),
    ({"prompt_ids": [1], "response_ids": [4, 5]}, "neither 'advantages'"),
    ({"prompt_ids": [1], "response_ids": [4, 5], "reward": 1.0}, "needs a 'group'"),
    ({"prompt_ids": "hello", "response_ids": [4], "advantages": [0]}, "field 'prompt_ids' must be a non-empty list"),
    ({"prompt_ids": [1], "response_ids": [], "advantages": []}, "field 'response_ids' must be a non-empty list"),
    # beyond int64 (JSON integers have no limit): not an OverflowError traceback
    ({"prompt_ids": [1, 2 ** 70], "response_ids": [4], "advantages": [0.1]},
     "field 'prompt_ids'[1] = 1180591620717411303424 does not fit the vocabulary of 256"),
    ({"prompt_ids": [1], "response_ids": [4, -2 ** 64], "advantages": [0.1, 0.2]}, "field 'response_ids'[1] = -1844"),
    # nested per-token fields have the right length, then would fail to broadcast mid-step
    ({"prompt_ids": [1], "response_ids": [4, 5], "advantages": [[0.5], [1.0]]},
     "field 'advantages' must be a flat list of numbers (one per response token), got [[0.5], [1.0]]"),
    ({"prompt_ids": [1], "response_ids": [4, 5], "old_logprobs": [[-1.0, -2.0], [-3.0]], "advantages": [0, 0]},
     "field 'old_logprobs' must be a flat list of numbers"),
    ({"prompt_ids": [1], "response_ids": [4, 5], "response_mask": [[1], [0]], "advantages": [0, 0]},
     "field 'response_mask' must be a flat list of numbers"),
    ({"prompt_ids": [1], "response_ids": [4, 5], "advantages": ["0.5", 1]}, "field 'advantages' must hold numbers"),
    ({"prompt_ids": [1], "response_ids": [4, 5], "advantages": [10 ** 400, 1]}, "field 'advantages'[0] is not finite"),
    ({"prompt_ids": [1], "response_ids": [4, 5], "reward": 10 ** 400, "group": 0}, "field 'reward' must be a finite"),
])
def test_bad_rows_are_named(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "r.jsonl", [GOOD, GOOD, bad])
    with pytest.raises(DataError) as e:
        load_rollouts(path, vocab_size=256, max_length=64)
    assert "r.jsonl: line 3: " in str(e.value) and message in str(e.value), str(e.value)


def test_over_long_rollouts_are_refused_or_dropped_never_truncated(tmp_path):
    long = {"prompt_ids": [1] * 10, "response_ids": [2] * 10, "advantages": [0.0] * 10}
    path = write_jsonl(tmp_path / "r.jsonl", [GOOD, long, GOOD])
    with pytest.raises(DataError, match=r"r.jsonl: line 2: 10 prompt \+ 10 response tokens = 20 > "):
        load_rollouts(path, vocab_size=256, max_length=16)
    rollouts, counts = load_rollouts(path, vocab_size=256, max_length=16, overlong="drop")
    assert counts == {"rollouts": 2, "dropped over-long": 1}
    assert all(len(r) == 5 for r in rollouts)


def test_group_advantages_grpo_and_rloo(tmp_path):
    rows = [{"prompt_ids": [1], "response_ids": [2, 3], "reward": r, "group": g}
            for r, g in ((1.0, "a"), (0.0, "a"), (0.0, "a"), (2.0, 7), (4.0, 7))]
    path = write_jsonl(tmp_path / "r.jsonl", rows)
    grpo, _ = load_rollouts(path, 256, 64)
    a = np.array([1.0, 0.0, 0.0])
    expected = (a - a.mean()) / (a.std(ddof=1) + 1e-6)
    np.testing.assert_allclose([r.advantages[0] for r in grpo[:3]], expected)
    assert all(np.all(r.advantages == r.advantages[0]) for r in grpo)
    rloo, _ = load_rollouts(path, 256, 64, estimator="rloo")
    np.testing.assert_allclose([r.advantages[0] for r in rloo], [1.0, -0.5, -0.5, -2.0, 2.0])
    single = write_jsonl(tmp_path / "s.jsonl", rows + [{"prompt_ids": [1], "response_ids": [2], "reward": 1, "group": 9}])
    with pytest.raises(DataError, match="s.jsonl: line 6: group 9 has one sample"):
        load_rollouts(single, 256, 64, estimator="rloo")


def test_parquet_rollouts_read_like_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = random_rollouts(4, seed=3)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "r.parquet")
    a, _ = load_rollouts(str(tmp_path / "r.parquet"), 256, 64)
    b, _ = load_rollouts(write_jsonl(tmp_path / "r.jsonl", rows), 256, 64)
    for x, y in zip(a, b):
        assert np.array_equal(x.response_ids, y.response_ids) and np.array_equal(x.advantages, y.advantages)
        assert np.array_equal(x.response_mask, y.response_mask)


def test_response_token_fields_sit_where_the_token_is_predicted(tmp_path):
    rows = random_rollouts(3, seed=1)
    for row in rows:
        row["old_logprobs"] = [-(k + 1) / 10 for k in range(len(row["response_ids"]))]
    rollouts, _ = load_rollouts(write_jsonl(tmp_path / "r.jsonl", rows), 256, 64)
    mb = rollout_row(rollouts, 64)
    batch = build_packed_batch(mb["input_ids"], mb["labels"], mb["segment_ids"])
    pos = 0
    for r, start in zip(rollouts, mb["response_starts"]):
        p = len(r.prompt_ids)
        assert start == pos + p - 1
        for j, (tok, m) in enumerate(zip(r.response_ids, r.response_mask)):
            at = pos + p + j - 1  # the position whose target is response token j
            assert float(batch.loss_mask[0, at]) == float(m)
            if m:
                assert int(batch.target[0, at]) == tok
            assert float(mb["advantages"][0, at]) == r.advantages[j]
            assert float(mb["old_logprobs"][0, at]) == r.old_logprobs[j]
        # the prompt predicts nothing, nor does the sample's last token (it would predict the next sample)
        assert float(batch.loss_mask[0, pos:pos + p - 1].sum()) == 0
        assert float(batch.loss_mask[0, pos + len(r) - 1]) == 0
        pos += len(r)
    assert float(batch.loss_mask[0, pos:].sum()) == 0
    assert torch.equal(batch.position_ids[0, :len(rollouts[0])], torch.arange(len(rollouts[0])))


def test_response_token_fields_follow_their_tokens_to_each_cp_rank(tmp_path):
    """At CP2 each rank holds, at every trained position, the advantage of the very token that position predicts."""
    from mindspeed_pack.packing.context_parallel import context_parallel_view, rank_share, whole_from_shares

    rows = random_rollouts(5, seed=4)
    for s, row in enumerate(rows):  # advantage = 1000 x sample + j: names the token it belongs to
        row["advantages"] = [1000.0 * s + j for j in range(len(row["response_ids"]))]
    rollouts, _ = load_rollouts(write_jsonl(tmp_path / "r.jsonl", rows), 256, 128)
    mb = rollout_row(rollouts, 128, multiple=4)
    batch = build_packed_batch(mb["input_ids"], mb["labels"], mb["segment_ids"])
    shares, trained = [], 0
    for rank in (0, 1):
        view = context_parallel_view(batch, 2, rank, 4)
        adv = rank_share(mb["advantages"], view, 2, rank)
        shares.append(adv)
        for at in torch.nonzero(view.loss_mask[0]).flatten().tolist():
            s, j = divmod(int(adv[0, at]), 1000)
            assert int(view.target[0, at]) == rollouts[s].response_ids[j]
            trained += 1
    assert trained == int(batch.loss_mask.sum()) == sum(int(r.response_mask.sum()) for r in rollouts)
    assert torch.equal(whole_from_shares(shares, view, 128), mb["advantages"])


def test_grpo_says_when_groups_of_one_sample_train_nothing(tmp_path, caplog):
    """A group of one sample has advantage 0 under grpo (rloo refuses it): said, not a silent zero-gradient step."""
    rows = [{"prompt_ids": [1], "response_ids": [2, 3], "reward": float(i), "group": i} for i in range(3)]
    rows.append({"prompt_ids": [1], "response_ids": [2], "reward": 0.5, "group": 0})
    with caplog.at_level("WARNING", logger="mindspeed_pack.datasets.rollouts"):
        rollouts, _ = load_rollouts(write_jsonl(tmp_path / "r.jsonl", rows), 256, 64)
    assert [float(r.advantages[0]) for r in rollouts[1:3]] == [0.0, 0.0]
    assert "2 of 3 groups have one sample (the first: " in caplog.text and "r.jsonl: line 2, group 1)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="mindspeed_pack.datasets.rollouts"):
        load_rollouts(write_jsonl(tmp_path / "ok.jsonl", rows[:1] + rows[3:]), 256, 64)
    assert "one sample" not in caplog.text

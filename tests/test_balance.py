"""The DP balancer and the online-packing plan: balanced, deterministic, every sample exactly once."""
import types

import numpy as np
import pytest

from mindspeed_pack.packing.balance import (
    CostModel,
    balance_partition,
    contiguous_partition,
    cost_model,
    imbalance,
    plan_online_packing,
    segment_lengths,
)

MODEL = CostModel(linear=1.0, attention=1.0 / 64)


def heavy_tailed(n, seed=0, cap=4096):
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(5.0, 1.0, n).astype(np.int64) + 1, 1, cap)


def test_lpt_balances_heavy_tailed_costs_far_better_than_contiguous_slices():
    costs = MODEL.sample_costs(heavy_tailed(512))
    naive = imbalance([costs[p].sum() for p in contiguous_partition(512, 8)])
    parts = balance_partition(costs, 8)
    balanced = imbalance([costs[p].sum() for p in parts])
    assert balanced <= 1.05 < naive


@pytest.mark.parametrize("equal_counts", [False, True])
def test_every_item_exactly_once_deterministic_and_in_order(equal_counts):
    costs = MODEL.sample_costs(heavy_tailed(96, seed=3))
    parts = balance_partition(costs, 4, equal_counts=equal_counts)
    assert sorted(np.concatenate(parts).tolist()) == list(range(96))
    assert all(np.all(np.diff(p) > 0) for p in parts)
    again = balance_partition(costs.copy(), 4, equal_counts=equal_counts)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    if equal_counts:
        assert [len(p) for p in parts] == [24] * 4


def test_equal_counts_still_balances_and_refuses_uneven_counts():
    costs = MODEL.sample_costs(heavy_tailed(256, seed=5))
    parts = balance_partition(costs, 4, equal_counts=True)
    assert imbalance([costs[p].sum() for p in parts]) <= 1.05
    with pytest.raises(ValueError, match="equal count"):
        balance_partition(costs[:10], 4, equal_counts=True)


def test_online_plan_packs_every_sample_once_with_equal_row_counts_within_capacity():
    lengths = heavy_tailed(64, seed=1, cap=512)
    ranks = plan_online_packing(lengths, 4, 512, MODEL)
    rows = [len(r.rows) for r in ranks]
    assert len(set(rows)) == 1
    seen = np.concatenate([row for r in ranks for row in r.rows])
    assert sorted(seen.tolist()) == list(range(64))
    assert all(lengths[row].sum() <= 512 for r in ranks for row in r.rows)
    assert imbalance([r.cost for r in ranks]) <= 1.1


def test_ranks_short_of_rows_split_rows_then_add_empty_ones():
    # one rank gets the single long sample (1 row); the other gets the short ones (1 packed row)
    lengths = np.array([100, 30, 30, 30, 10])
    ranks = plan_online_packing(lengths, 2, 100, CostModel(1.0, 0.0))
    assert [len(r.rows) for r in ranks] == [1, 1]
    # three ranks, two samples: the third rank gets an empty (all padding) row
    ranks = plan_online_packing(np.array([50, 50]), 3, 100, CostModel(1.0, 0.0))
    assert [len(r.rows) for r in ranks] == [1, 1, 1] and sum(len(r.rows[0]) for r in ranks) == 2
    # a rank that needs 3 rows forces the others to split their packed rows
    lengths = np.array([90, 90, 90, 20, 20, 20, 20])
    ranks = plan_online_packing(lengths, 2, 100, CostModel(1.0, 0.0))
    assert len(set(len(r.rows) for r in ranks)) == 1
    assert sorted(np.concatenate([row for r in ranks for row in r.rows]).tolist()) == list(range(7))


def test_cost_model_counts_linear_weights_and_causal_attention():
    args = types.SimpleNamespace(hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
                                 ffn_hidden_size=128, swiglu=True, padded_vocab_size=256, kv_channels=None)
    m = cost_model(args)
    per_layer = 64 * (4 + 2 * 2) * 16 + 64 * 64 + 64 * 256 + 128 * 64
    assert m.linear == 2 * (2 * per_layer + 64 * 256)
    assert m.attention == 2 * 2 * 64
    # attention by actual segment lengths: two 64-token samples cost less than one 128-token one
    assert m.flops(128, 2 * 64**2) < m.flops(128, 128**2)


def test_segment_lengths_skip_padding():
    assert segment_lengths(np.array([1, 1, 2, 2, 2, 0, 0])).tolist() == [2, 3]
    assert segment_lengths(np.array([0, 0])).tolist() == []


def _offline_source(prefix, dp_rank, dp_size, monkeypatch, gbs=8):
    """A dp_balanced source over offline packs as rank ``dp_rank`` of ``dp_size`` sees it."""
    from megatron.core import parallel_state as ps

    from mindspeed_pack.config.arguments import parse_args
    from mindspeed_pack.datasets.online_packing import BalancedBatchSource
    from tests.model_utils import TINY_FLAGS

    monkeypatch.setattr(ps, "get_data_parallel_rank", lambda: dp_rank)
    monkeypatch.setattr(ps, "get_data_parallel_world_size", lambda: dp_size)
    args = parse_args([*TINY_FLAGS, "--seq-length", "128", "--neat-pack", "--data-path", prefix, "--train-iters", "3",
                       "--global-batch-size", str(gbs), "--micro-batch-size", "2", "--sequence-packing-scheduler",
                       "dp_balanced"], world_size=dp_size)
    source = BalancedBatchSource()
    source.setup(args, {"train": 3 * gbs})
    return source


def test_offline_packs_are_balanced_over_ranks_each_exactly_once(tmp_path, monkeypatch):
    from tests.data_utils import write_packed_instruction_dataset

    prefix = write_packed_instruction_dataset(str(tmp_path / "packs"), num_packs=20, meta=True)
    sources = [_offline_source(prefix, r, 2, monkeypatch) for r in range(2)]
    assert not sources[0].online
    for consumed in (0, 8, 16):
        plans = [s._plan("train", consumed) for s in sources]
        docs = np.concatenate([p["docs"] for p in plans])
        index = sources[0].splits["train"].index
        assert sorted(docs.tolist()) == sorted(int(d) for d in index[consumed:consumed + 8])
        assert [len(p["docs"]) for p in plans] == [4, 4]
        assert plans[0]["imbalance"] == plans[1]["imbalance"] <= 1.05
        mbs = list(sources[0].micro_batches("train", consumed))
        assert len(mbs) == 2 and mbs[0]["input_ids"].shape == (2, 128)
        assert sources[0].step_shape("train", consumed)[:2] == (2, 256)


def test_step_metrics_count_attention_by_segment_lengths_and_give_mfu():
    from mindspeed_pack.training.throughput import add_micro_batch, step_fields

    args = types.SimpleNamespace(hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
                                 ffn_hidden_size=128, swiglu=True, padded_vocab_size=256, kv_channels=None,
                                 peak_tflops=1e-6)
    seg = np.array([[1] * 30 + [2] * 50 + [0] * 48])  # two samples and padding in a 128-token row
    stats = {}
    add_micro_batch(stats, {"input_ids": np.zeros((1, 128)), "segment_ids": seg})
    assert (stats["real tokens"], stats["sum sq lengths"]) == (80, 30**2 + 50**2)
    fields = step_fields(args, stats, elapsed=2.0, dp=1, world_size=2)
    assert fields["model TFLOPs"] * 1e12 == pytest.approx(cost_model(args).flops(80, 30**2 + 50**2))
    assert fields["MFU"] == pytest.approx(fields["model TFLOPs"] / 2.0 / 2 / 1e-6)
    stats["rank imbalance"] = 1.02
    fields = step_fields(args, stats, elapsed=2.0, dp=2, world_size=2)
    assert fields["model TFLOPs"] * 1e12 == pytest.approx(cost_model(args).flops(160, 2 * (30**2 + 50**2)))
    assert fields["rank imbalance"] == 1.02


def test_segment_lengths_leave_out_the_pads_that_end_a_sample():
    from mindspeed_pack.packing.balance import segment_lengths

    seg = np.array([1, 1, 1, 1, 2, 2, 2, 2, 3, 0, 0])
    pad = np.array([0, 1, 0, 1, 0, 0, 1, 1, 1, 1, 1], bool)  # a pad inside sample 1 is a token of it
    assert segment_lengths(seg).tolist() == [4, 4, 1]
    assert segment_lengths(seg, pad).tolist() == [3, 2, 0]

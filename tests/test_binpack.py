"""Guarantees of the packer: every item packed once, no pack overflows, near-optimal, deterministic."""
import numpy as np
import pytest

from mindspeed_pack import _helpers
from mindspeed_pack.packing.binpack import ALGORITHMS, PackPlan, lower_bound, pack_lengths


def reference_best_fit_decreasing(lengths, capacity):
    """Plain O(n * bins) BFD with the packer's tie rules, for cross-checking the C++ one.

    Items longest first (ties: lower index first); each goes to the bin with the least room
    that fits it, among equal rooms the bin that has had that room the longest; else a new bin.
    """
    rooms, touched, members = [], [], []
    clock = 0
    for item in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fitting = [b for b in range(len(rooms)) if rooms[b] >= lengths[item]]
        if fitting:
            b = min(fitting, key=lambda b: (rooms[b], touched[b], b))
        else:
            b = len(rooms)
            rooms.append(capacity)
            touched.append(0)
            members.append([])
        rooms[b] -= lengths[item]
        clock += 1
        touched[b] = clock
        members[b].append(item)
    return [sorted(m) for m in members]


def check_valid(plan: PackPlan, lengths, capacity):
    lengths = np.asarray(lengths)
    assert plan.item_order.dtype == np.int64 and plan.bin_offsets.dtype == np.int64
    assert plan.bin_offsets[0] == 0 and plan.bin_offsets[-1] == len(lengths)
    assert np.all(np.diff(plan.bin_offsets) >= 1), "empty bin"
    assert np.array_equal(np.sort(plan.item_order), np.arange(len(lengths))), "items not packed exactly once"
    for members in plan.bins():
        assert lengths[members].sum() <= capacity
        assert np.all(np.diff(members) > 0), "items inside a bin must be in ascending index order"


def lognormal_lengths(n, capacity, seed):
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(np.log(capacity / 12), 1.3, n)), 1, capacity).astype(np.int64)


def test_matches_reference_bfd_on_tiny_random_instances():
    rng = np.random.default_rng(1234)
    for _ in range(400):
        capacity = int(rng.integers(1, 40))
        n = int(rng.integers(0, 30))
        lengths = rng.integers(1, capacity + 1, size=n).tolist()
        plan = pack_lengths(lengths, capacity, algorithm="best_fit_decreasing")
        check_valid(plan, lengths, capacity)
        assert [b.tolist() for b in plan.bins()] == reference_best_fit_decreasing(lengths, capacity), (lengths, capacity)


def test_all_internal_code_paths_agree():
    # Huge capacities switch to an ordered map of rooms, and >= 2^31 items to 64-bit bin ids;
    # every combination must give the same plan.
    rng = np.random.default_rng(7)
    for capacity in (1, 5, 64, 65, 4097, 300_000):
        lengths = rng.integers(1, capacity + 1, size=3000).astype(np.int64)
        for refine in (False, True):
            dense = _helpers.pack_best_fit_decreasing(lengths, capacity, refine=refine)
            for limit, wide in [(0, False), (0, True), (capacity, True)]:
                other = _helpers.pack_best_fit_decreasing(lengths, capacity, dense_capacity_limit=limit, wide_bin_ids=wide,
                                                          refine=refine)
                assert np.array_equal(dense[0], other[0]) and np.array_equal(dense[1], other[1]), (capacity, limit, wide)
    # A narrow range, where the refinement does replace BFD's plan, through every code path.
    lengths = rng.integers(100, 701, size=5000).astype(np.int64) * 1000
    dense = _helpers.pack_best_fit_decreasing(lengths, 1_024_000, refine=True)
    assert len(dense[1]) - 1 < len(_helpers.pack_best_fit_decreasing(lengths, 1_024_000)[1]) - 1
    for limit, wide in [(0, False), (0, True), (1_024_000, True)]:
        other = _helpers.pack_best_fit_decreasing(lengths, 1_024_000, dense_capacity_limit=limit, wide_bin_ids=wide, refine=True)
        assert np.array_equal(dense[0], other[0]) and np.array_equal(dense[1], other[1]), (limit, wide)


def test_perfect_fits_are_found():
    plan = pack_lengths([6, 4, 6, 4, 6, 4], 10)
    assert [b.tolist() for b in plan.bins()] == [[0, 1], [2, 3], [4, 5]]
    assert plan.fill_rate([6, 4, 6, 4, 6, 4]) == 1.0

    lengths = [5, 5, 3, 7, 2, 8]  # 8+2, 7+3, 5+5
    plan = pack_lengths(lengths, 10)
    assert plan.num_bins == 3 == lower_bound(lengths, 10)
    assert [b.tolist() for b in plan.bins()] == [[4, 5], [2, 3], [0, 1]]  # bins in opening order

    # The full capacity is usable (not capacity - 1).
    assert pack_lengths([10, 10, 10], 10).num_bins == 3
    assert pack_lengths([1] * 7, 1).num_bins == 7
    assert pack_lengths([2, 3, 4, 1], 10).bins()[0].tolist() == [0, 1, 2, 3]


def test_item_goes_to_the_tightest_bin_that_fits():
    # 8 -> bin 0 (room 2), 6 -> bin 1 (room 4), 3 -> bin 1 (room 1); the 1 then fits both bins
    # and best fit takes bin 1 (room 1), where first fit would take bin 0 (room 2).
    plan = pack_lengths([8, 6, 3, 1], 10)
    assert [b.tolist() for b in plan.bins()] == [[0], [1, 2, 3]]


def uniform_lengths(n, low, high, seed):
    return np.random.default_rng(seed).integers(low, high + 1, n).astype(np.int64)


def test_algorithms_are_listed():
    assert ALGORITHMS == ("best_fit_decreasing_refined", "best_fit_decreasing")


@pytest.mark.parametrize("seed", [0, 1])
def test_refined_reaches_the_lower_bound_on_a_narrow_uniform_range(seed):
    # No short items: BFD leaves gaps shorter than every item left (~0.4% extra packs here).
    lengths = uniform_lengths(100_000, 20, 80, seed)
    bound = lower_bound(lengths, 1024)
    bfd = pack_lengths(lengths, 1024, algorithm="best_fit_decreasing")
    refined = pack_lengths(lengths, 1024)
    check_valid(refined, lengths, 1024)
    assert bfd.num_bins > 1.002 * bound  # the case is a real one for BFD
    assert refined.num_bins <= 1.001 * bound, (refined.num_bins, bound, bfd.num_bins)


def test_refined_reaches_the_lower_bound_on_short_instruction_like_lengths():
    # Most samples a little above a long shared prompt (like the toy Alpaca data), a thin tail.
    rng = np.random.default_rng(5)
    lengths = np.concatenate([rng.integers(27, 41, 80_000), np.clip(rng.lognormal(4.3, 0.6, 20_000), 41, 400)]).astype(np.int64)
    rng.shuffle(lengths)
    bound = lower_bound(lengths, 1024)
    refined = pack_lengths(lengths, 1024)
    check_valid(refined, lengths, 1024)
    assert refined.num_bins <= 1.001 * bound < pack_lengths(lengths, 1024, algorithm="best_fit_decreasing").num_bins


def test_refined_is_never_worse_than_best_fit_decreasing():
    rng = np.random.default_rng(99)
    improved = 0
    for trial in range(300):
        capacity = int(rng.integers(1, 200))
        low = int(rng.integers(1, capacity + 1))
        high = int(rng.integers(low, capacity + 1))
        lengths = rng.integers(low, high + 1, size=int(rng.integers(0, 400))).astype(np.int64)
        bfd = pack_lengths(lengths, capacity, algorithm="best_fit_decreasing")
        refined = pack_lengths(lengths, capacity)
        check_valid(refined, lengths, capacity)
        assert lower_bound(lengths, capacity) <= refined.num_bins <= bfd.num_bins, (trial, capacity, low, high)
        if refined.num_bins < bfd.num_bins:
            improved += 1
        else:  # no saving: BFD's plan is kept as is
            assert np.array_equal(refined.item_order, bfd.item_order) and np.array_equal(refined.bin_offsets, bfd.bin_offsets)
    assert improved >= 10  # the refinement did run and win on some of them


def test_refined_plan_is_deterministic():
    lengths = uniform_lengths(30_000, 100, 700, seed=4)
    first = pack_lengths(lengths, 1024)
    assert first.num_bins < pack_lengths(lengths, 1024, algorithm="best_fit_decreasing").num_bins
    for variant in (lengths.astype(np.int32), lengths.tolist()):
        again = pack_lengths(variant, 1024)
        assert np.array_equal(first.item_order, again.item_order) and np.array_equal(first.bin_offsets, again.bin_offsets)


def test_empty_input():
    for algorithm in ALGORITHMS:
        assert pack_lengths([], 16, algorithm=algorithm).num_bins == 0
    plan = pack_lengths([], 16)
    assert plan.num_bins == 0 and plan.item_order.size == 0 and plan.bins() == []
    assert lower_bound([], 16) == 0


@pytest.mark.parametrize("capacity", [1024, 4096, 32768])
def test_within_a_thousandth_of_the_lower_bound_on_lognormal_lengths(capacity):
    lengths = lognormal_lengths(200_000, capacity, seed=capacity)
    plan = pack_lengths(lengths, capacity)
    check_valid(plan, lengths, capacity)
    bound = lower_bound(lengths, capacity)
    assert bound == -(-int(lengths.sum()) // capacity)
    assert bound <= plan.num_bins <= 1.001 * bound
    assert plan.fill_rate(lengths) == pytest.approx(lengths.sum() / (plan.num_bins * capacity))
    assert np.array_equal(plan.bin_lengths(lengths), [lengths[b].sum() for b in plan.bins()])


def test_deterministic_and_independent_of_input_type():
    lengths = lognormal_lengths(50_000, 2048, seed=3)
    first = pack_lengths(lengths, 2048)
    for variant in (lengths.copy(), lengths.astype(np.int32), lengths.astype(np.uint16), lengths.tolist(),
                    lengths[::-1].copy()[::-1]):
        again = pack_lengths(variant, 2048)
        assert np.array_equal(first.item_order, again.item_order)
        assert np.array_equal(first.bin_offsets, again.bin_offsets)


@pytest.mark.parametrize(
    "lengths, capacity, message",
    [
        ([3, 4, 11, 2], 10, "item 2 has length 11: longer than the capacity 10"),
        ([3, 0, 2], 10, "item 1 has length 0"),
        ([3, 2, -5], 10, "item 2 has length -5"),
        ([1, 2], 0, "capacity must be >= 1, got 0"),
        ([[1, 2], [3, 4]], 10, "1-D"),
        ([1.0, 2.5], 10, "integers"),
        ([1, 2], 2.0, "capacity must be an integer"),
    ],
)
def test_bad_input_raises_a_clear_error(lengths, capacity, message):
    with pytest.raises(ValueError, match=message):
        pack_lengths(lengths, capacity)


def test_cpp_side_validates_too():
    with pytest.raises(ValueError, match="item 1 has length 0"):
        _helpers.pack_best_fit_decreasing(np.array([1, 0], dtype=np.int64), 4)
    with pytest.raises(ValueError, match="item 0 has length 5: longer than the capacity 4"):
        _helpers.pack_best_fit_decreasing(np.array([5], dtype=np.int64), 4)


def test_unknown_algorithm():
    with pytest.raises(ValueError, match="unknown packing algorithm"):
        pack_lengths([1, 2], 4, algorithm="first_fit")


def test_packing_releases_the_gil():
    from tests.gil_utils import longest_main_thread_stall

    lengths = np.random.default_rng(0).integers(1, 4096, 4_000_000).astype(np.int64)
    stall, duration = longest_main_thread_stall(lambda: _helpers.pack_best_fit_decreasing(lengths, 4096))
    assert stall < 0.5 * duration, (stall, duration)


def test_bench_baseline_is_a_valid_packing():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "bench_packing.py"
    spec = importlib.util.spec_from_file_location("bench_packing", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    lengths = bench.heavy_tailed_lengths(5000, 512)
    assert lengths.min() >= 1 and lengths.max() <= 512
    packs = bench.greedy_knapsack_baseline(np.minimum(lengths, 511).tolist(), 511)
    assert sorted(x for p in packs for x in p) == sorted(np.minimum(lengths, 511).tolist())
    assert all(sum(p) <= 511 for p in packs)
    assert len(packs) >= pack_lengths(lengths, 512).num_bins
    bench.main(["--sizes", "2000", "--seq-lengths", "256", "--repeats", "1"])
    bench.main(["--sizes", "2000", "--seq-lengths", "1024", "--repeats", "1", "--dist", "uniform20-80"])

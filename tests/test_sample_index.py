"""Guarantees of the training sample index: epoch structure, seeding, padding, on-disk cache."""
import os
import shutil

import numpy as np
import pytest

from mindspeed_pack.datasets import sample_index as si
from mindspeed_pack.datasets.sample_index import build_sample_index, get_sample_index, sample_index_key


def epochs_of(index, epoch_length):
    return [index[s:s + epoch_length] for s in range(0, len(index), epoch_length)]


def test_no_shuffle_repeats_documents_in_order():
    index = build_sample_index(7, 30, seed=1, shuffle=False)
    assert index.dtype == np.int64 and index.shape == (30,)
    assert index.tolist() == (list(range(7)) * 5)[:30]


def test_zero_samples_and_truncation():
    assert build_sample_index(5, 0, seed=0).shape == (0,)
    assert build_sample_index(5, 3, seed=0, shuffle=False).tolist() == [0, 1, 2]


def test_shuffle_gives_a_new_permutation_every_epoch():
    num_docs = 50
    index = build_sample_index(num_docs, 4 * num_docs + 10, seed=123)
    epochs = epochs_of(index, num_docs)
    for epoch in epochs[:4]:
        assert sorted(epoch.tolist()) == list(range(num_docs))
    assert len({tuple(e.tolist()) for e in epochs[:4]}) == 4, "epochs must differ"
    assert not np.array_equal(epochs[0], np.arange(num_docs))
    assert set(epochs[4].tolist()) <= set(range(num_docs)) and len(set(epochs[4].tolist())) == 10


def test_seed_changes_order_and_same_seed_repeats_it():
    a = build_sample_index(1000, 1000, seed=1)
    assert np.array_equal(a, build_sample_index(1000, 1000, seed=1))
    assert not np.array_equal(a, build_sample_index(1000, 1000, seed=2))


def test_shorter_index_is_a_prefix_of_longer_one():
    long = build_sample_index(13, 200, seed=5, padded_samples=True, global_batch_size=4)
    short = build_sample_index(13, 37, seed=5, padded_samples=True, global_batch_size=4)
    assert np.array_equal(short, long[:37])


class Mt19937_64:
    """Pure-Python std::mt19937_64 (the C++ standard fixes its algorithm and parameters)."""

    MASK = (1 << 64) - 1

    def __init__(self, seed):
        self.state = [seed & self.MASK]
        for i in range(1, 312):
            prev = self.state[-1]
            self.state.append((6364136223846793005 * (prev ^ (prev >> 62)) + i) & self.MASK)
        self.pos = 312

    def __call__(self):
        if self.pos == 312:
            s = self.state
            for i in range(312):
                y = (s[i] & 0xFFFFFFFF80000000) | (s[(i + 1) % 312] & 0x7FFFFFFF)
                s[i] = s[(i + 156) % 312] ^ (y >> 1) ^ (0xB5026F5AA96619E9 if y & 1 else 0)
            self.pos = 0
        y = self.state[self.pos]
        self.pos += 1
        y ^= (y >> 29) & 0x5555555555555555
        y ^= (y << 17) & 0x71D67FFFEDA60000
        y ^= (y << 37) & 0xFFF7EEE000000000
        y ^= y >> 43
        return y & self.MASK


def splitmix64(x):
    mask = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


def reference_epoch_order(num_docs, seed, epoch):
    """The documented shuffle, re-derived in Python: forward Fisher-Yates, Lemire's bounded draw."""
    mask = (1 << 64) - 1
    rng = Mt19937_64(splitmix64((splitmix64(seed & mask) + epoch) & mask))
    order = list(range(num_docs))
    for i in range(num_docs - 1):
        bound = num_docs - i
        product = rng() * bound
        if product & mask < bound:
            threshold = (1 << 64) % bound
            while product & mask < threshold:
                product = rng() * bound
        j = i + (product >> 64)
        order[i], order[j] = order[j], order[i]
    return order


def test_reference_mt19937_64_matches_the_cpp_standard():
    rng = Mt19937_64(5489)  # the standard requires this 10000th value of a default-seeded engine
    for _ in range(9999):
        rng()
    assert rng() == 9981545732273789042


@pytest.mark.parametrize("num_docs, seed", [(10, 0), (97, 42), (3, -7), (1, 5)])
def test_shuffle_is_the_documented_platform_independent_one(num_docs, seed):
    index = build_sample_index(num_docs, 3 * num_docs, seed=seed)
    expected = sum((reference_epoch_order(num_docs, seed, e) for e in range(3)), [])
    assert index.tolist() == expected


def test_shuffle_is_roughly_uniform():
    # First position of a 4-doc shuffle over many epochs: each doc about 1/4 of the time.
    index = build_sample_index(4, 4 * 8000, seed=9)
    counts = np.bincount(index[::4], minlength=4)
    assert np.all(np.abs(counts - 2000) < 200), counts


@pytest.mark.parametrize("shuffle", [False, True])
def test_padded_samples_fill_every_global_batch_from_the_same_epoch(shuffle):
    num_docs, gbs = 10, 4
    index = build_sample_index(num_docs, 60, seed=3, shuffle=shuffle, padded_samples=True, global_batch_size=gbs)
    epoch_length = 12  # next multiple of 4
    for epoch in epochs_of(index, epoch_length):
        assert sorted(set(epoch.tolist())) == list(range(num_docs))
        assert epoch[num_docs:].tolist() == epoch[:2].tolist(), "padding repeats the epoch's first entries"
    if not shuffle:
        assert index[:12].tolist() == list(range(10)) + [0, 1]


def test_padded_samples_with_batch_larger_than_the_epoch():
    index = build_sample_index(3, 16, seed=0, shuffle=False, padded_samples=True, global_batch_size=8)
    assert index.tolist() == [0, 1, 2, 0, 1, 2, 0, 1] * 2


def test_padding_is_a_no_op_when_the_batch_divides_the_epoch():
    plain = build_sample_index(12, 50, seed=4)
    padded = build_sample_index(12, 50, seed=4, padded_samples=True, global_batch_size=4)
    assert np.array_equal(plain, padded)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_docs=0, num_samples=4), "num_docs must be >= 1, got 0"),
        (dict(num_docs=3, num_samples=-1), "num_samples must be >= 0, got -1"),
        (dict(num_docs=3, num_samples=4, global_batch_size=0), "global_batch_size must be >= 1, got 0"),
        (dict(num_docs=3.5, num_samples=4), "num_docs must be an integer"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_sample_index(seed=0, **kwargs)


def test_cache_hit_returns_the_same_array(tmp_path, monkeypatch):
    args = dict(seed=11, shuffle=True, padded_samples=True, global_batch_size=8, tag="data/prefix")
    first = get_sample_index(str(tmp_path), 37, 500, **args)
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 2 and files[0].endswith(".json") and files[1] == files[0][:-5] + ".npy", files  # + record
    assert isinstance(first, np.memmap)

    def must_not_rebuild(*a, **k):
        raise AssertionError("cache miss on identical inputs")

    monkeypatch.setattr(si, "build_sample_index", must_not_rebuild)
    second = get_sample_index(str(tmp_path), 37, 500, **args)
    assert np.array_equal(first, second)
    assert np.array_equal(second, si._helpers.build_sample_index(37, 500, 11, True, True, 8))


def test_any_changed_input_changes_the_cache_key():
    base = dict(num_docs=37, num_samples=500, seed=11, shuffle=True, padded_samples=True, global_batch_size=8,
                tag="a")
    key = sample_index_key(**base)
    for field, value in [("num_docs", 38), ("num_samples", 501), ("seed", 12), ("shuffle", False),
                         ("padded_samples", False), ("global_batch_size", 16), ("tag", "b")]:
        assert sample_index_key(**{**base, field: value}) != key, field


def test_changed_input_writes_a_new_file_and_a_corrupt_file_is_rebuilt(tmp_path):
    a = get_sample_index(str(tmp_path), 20, 40, seed=1, shuffle=True, padded_samples=False, global_batch_size=1)
    b = get_sample_index(str(tmp_path), 20, 40, seed=2, shuffle=True, padded_samples=False, global_batch_size=1)
    assert len(os.listdir(tmp_path)) == 4 and not np.array_equal(a, b)  # two indices and their records
    # A truncated file (e.g. from a crashed writer that bypassed the rename) is rebuilt, not trusted.
    path = tmp_path / f"sample_index_{sample_index_key(20, 40, seed=1, shuffle=True, padded_samples=False, global_batch_size=1)}.npy"
    path.write_bytes(path.read_bytes()[:100])
    again = get_sample_index(str(tmp_path), 20, 40, seed=1, shuffle=True, padded_samples=False, global_batch_size=1)
    assert np.array_equal(again, build_sample_index(20, 40, seed=1))
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")], "temporary files left behind"


def test_building_releases_the_gil():
    from tests.gil_utils import longest_main_thread_stall

    stall, duration = longest_main_thread_stall(lambda: si._helpers.build_sample_index(3_000_000, 6_000_000, 1, True,
                                                                                        False, 1))
    assert stall < 0.5 * duration, (stall, duration)


def test_no_cache_dir_builds_in_memory():
    index = get_sample_index(None, 5, 7, seed=0, shuffle=False, padded_samples=False, global_batch_size=1)
    assert index.tolist() == [0, 1, 2, 3, 4, 0, 1]



def test_a_cache_file_is_checked_against_what_built_it_not_trusted_by_its_name(tmp_path, caplog):
    """Another seed's index copied under this run's name, or one with out-of-range values, is rebuilt (with a
    warning saying why), never used: the cache records what built it and its bytes' digest."""
    import logging

    key = sample_index_key(20, 40, seed=1, shuffle=True, padded_samples=False, global_batch_size=1)
    other = get_sample_index(str(tmp_path / "other"), 20, 40, seed=2, shuffle=True, padded_samples=False,
                             global_batch_size=1)
    os.makedirs(tmp_path / "run")
    np.save(tmp_path / "run" / f"sample_index_{key}.npy", np.asarray(other))
    want = build_sample_index(20, 40, seed=1)
    assert not np.array_equal(other, want)
    with caplog.at_level(logging.WARNING):
        got = get_sample_index(str(tmp_path / "run"), 20, 40, seed=1, shuffle=True, padded_samples=False,
                               global_batch_size=1)
    assert np.array_equal(got, want) and "rebuilding it" in caplog.text
    # the record copied along with another seed's file names the seed that built it
    for name in os.listdir(tmp_path / "other"):
        shutil.copy(tmp_path / "other" / name, tmp_path / "run" / name.replace(
            sample_index_key(20, 40, seed=2, shuffle=True, padded_samples=False, global_batch_size=1), key))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        got = get_sample_index(str(tmp_path / "run"), 20, 40, seed=1, shuffle=True, padded_samples=False,
                               global_batch_size=1)
    assert np.array_equal(got, want) and "rebuilding it" in caplog.text
    # values past the documents (same dtype and shape)
    np.save(tmp_path / "run" / f"sample_index_{key}.npy", np.full(40, 99, dtype=np.int64))
    got = get_sample_index(str(tmp_path / "run"), 20, 40, seed=1, shuffle=True, padded_samples=False,
                           global_batch_size=1)
    assert np.array_equal(got, want)

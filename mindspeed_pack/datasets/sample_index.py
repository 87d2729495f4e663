"""The training sample index: which document (pack) every training sample reads.

``index[k]`` is the document index of training sample ``k`` (int64). It is built in C++
(:func:`mindspeed_pack._helpers.build_sample_index`) and cached on disk.

Semantics::

    num_docs=5, global_batch_size=4, num_samples=12

    shuffle=False                      0 1 2 3 4 | 0 1 2 3 4 | 0 1
    shuffle=False, padded_samples      0 1 2 3 4 0 1 2 | 0 1 2 3          (epoch = 8 entries)
    shuffle=True,  padded_samples      p0 p1 p2 p3 p4 p0 p1 p2 | q0 q1 q2 q3

* Epochs are concatenated until at least ``num_samples`` entries exist, then the result is
  truncated to ``num_samples``. The index for ``n`` samples is a prefix of the index for any
  larger ``n``, so extending a run does not reorder what was already seen.
* Each epoch is a permutation of ``range(num_docs)``: the identity with ``shuffle=False``
  (``--no-shuffle``, for loss comparison runs), otherwise a forward Fisher-Yates shuffle
  (position i swaps with a uniform pick among positions i..n-1) drawn from
  ``std::mt19937_64`` seeded with ``splitmix64(splitmix64(seed) + epoch)``, with Lemire's
  unbiased multiply-shift bounded draw. Every step is fully specified (no std::shuffle or
  std::uniform_int_distribution), so the same inputs give the same index on every platform
  and compiler; each epoch has its own permutation.
* ``padded_samples=True`` (``--padded-samples``): when ``num_docs`` is not a multiple of
  ``global_batch_size``, every epoch's order is extended by repeating its own first entries
  (cyclically, if the batch is larger than the epoch) up to the next multiple of
  ``global_batch_size``. Every global batch is then full and never mixes two epochs.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile

import numpy as np

from mindspeed_pack import _helpers

logger = logging.getLogger(__name__)

_CACHE_FORMAT_VERSION = 1  # bump when the index semantics change


def _check_int(name: str, value, minimum: int, maximum: int = 2**63 - 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return int(value)


def build_sample_index(num_docs: int, num_samples: int, *, seed: int, shuffle: bool = True,
                       padded_samples: bool = False, global_batch_size: int = 1) -> np.ndarray:
    """Document index of every training sample (int64[num_samples]); see module docstring."""
    num_docs = _check_int("num_docs", num_docs, 1)
    num_samples = _check_int("num_samples", num_samples, 0)
    global_batch_size = _check_int("global_batch_size", global_batch_size, 1)
    seed = _check_int("seed", seed, -(2**63))
    return _helpers.build_sample_index(num_docs, num_samples, seed, bool(shuffle), bool(padded_samples),
                                       global_batch_size)


def whole_epochs(num_docs: int, num_samples: int, *, padded_samples: bool = False, global_batch_size: int = 1) -> int:
    """``num_samples`` rounded up to whole epochs, as megatron-core sizes its sample indices.

    An epoch is ``num_docs`` entries, or the next multiple of ``global_batch_size`` with
    ``padded_samples``. Since an index is a prefix of any longer one, rounding up changes no
    sample that was asked for; it leaves slack for a resume that reads further (e.g. with a
    smaller global batch size, so more steps from the same ``consumed_samples``).
    """
    num_docs = _check_int("num_docs", num_docs, 1)
    num_samples = _check_int("num_samples", num_samples, 0)
    gbs = _check_int("global_batch_size", global_batch_size, 1)
    epoch = -(-num_docs // gbs) * gbs if padded_samples else num_docs
    return -(-num_samples // epoch) * epoch


def _built_from(num_docs: int, num_samples: int, *, seed: int, shuffle: bool, padded_samples: bool,
                global_batch_size: int, tag: str = "") -> dict:
    """Every input that changes the index, plus ``tag``: the cache key's fields, and its record's."""
    return {
        "version": _CACHE_FORMAT_VERSION,
        "num_docs": int(num_docs),
        "num_samples": int(num_samples),
        "seed": int(seed),
        "shuffle": bool(shuffle),
        "padded_samples": bool(padded_samples),
        # Without padding the batch size does not change the index; keep it out of the key then.
        "global_batch_size": int(global_batch_size) if padded_samples else None,
        "tag": str(tag),
    }


def sample_index_key(num_docs: int, num_samples: int, *, seed: int, shuffle: bool, padded_samples: bool,
                     global_batch_size: int, tag: str = "") -> str:
    """Cache key: a hash of every input that changes the index, plus ``tag``."""
    fields = _built_from(num_docs, num_samples, seed=seed, shuffle=shuffle, padded_samples=padded_samples,
                         global_batch_size=global_batch_size, tag=tag)
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]


def _digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _why_stale(path: str, record_path: str, built_from: dict):
    """Why the cached index at ``path`` is not the one ``built_from`` describes (None: it is). A file is trusted
    only with its record: the inputs that built it and the digest of its bytes (its name alone says nothing
    of a file copied or damaged under it)."""
    try:
        with open(record_path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return f"has no readable record of what built it ({os.path.basename(record_path)})"
    recorded = record.get("built_from") if isinstance(record, dict) else None
    if recorded != built_from:
        differ = sorted(k for k in built_from if not isinstance(recorded, dict) or recorded.get(k) != built_from[k])
        return "was built from other inputs (" + ", ".join(
            f"{k} {recorded.get(k) if isinstance(recorded, dict) else None}, not {built_from[k]}" for k in differ) + ")"
    if record.get("sha256") != _digest(path):
        return "does not hold the bytes its record describes (copied over or damaged)"
    return None


def _write_atomic(cache_dir: str, name: str, write) -> None:
    """``write(file)`` into ``cache_dir/name`` under a temporary name, then renamed: readers never see half."""
    fd, tmp_path = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=cache_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp_path, os.path.join(cache_dir, name))
    except BaseException:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise


def get_sample_index(cache_dir: str | None, num_docs: int, num_samples: int, *, seed: int, shuffle: bool = True,
                     padded_samples: bool = False, global_batch_size: int = 1, tag: str = "") -> np.ndarray:
    """:func:`build_sample_index`, cached as ``cache_dir/sample_index_<key>.npy`` (memory-mapped).

    ``tag`` should identify the dataset (e.g. its path prefix), so different datasets with equal
    document counts do not share a file. ``cache_dir=None`` disables the cache. Beside the file,
    ``sample_index_<key>.json`` records what built it (seed, sizes, shuffle, padding, tag) and the
    digest of its bytes; a file whose record is missing or differs is rebuilt, with a warning. Both
    are written under temporary names and renamed, so concurrent ranks never read a partial file.
    """
    build_args = dict(seed=seed, shuffle=shuffle, padded_samples=padded_samples, global_batch_size=global_batch_size)
    if cache_dir is None:
        return build_sample_index(num_docs, num_samples, **build_args)
    built_from = _built_from(num_docs, num_samples, tag=tag, **build_args)
    key = sample_index_key(num_docs, num_samples, tag=tag, **build_args)
    name, record_name = f"sample_index_{key}.npy", f"sample_index_{key}.json"
    path, record_path = os.path.join(cache_dir, name), os.path.join(cache_dir, record_name)
    if os.path.exists(path):
        why = _why_stale(path, record_path, built_from)
        if why is None:
            return np.load(path, mmap_mode="r")
        logger.warning("sample index cache %s %s; rebuilding it", path, why)
    index = build_sample_index(num_docs, num_samples, **build_args)
    os.makedirs(cache_dir, exist_ok=True)
    _write_atomic(cache_dir, name, lambda f: np.save(f, index))
    record = {"built_from": built_from, "sha256": _digest(path)}
    _write_atomic(cache_dir, record_name, lambda f: f.write(json.dumps(record, indent=1).encode()))
    logger.info("built sample index %s (%d samples over %d documents)", path, num_samples, num_docs)
    return np.load(path, mmap_mode="r")

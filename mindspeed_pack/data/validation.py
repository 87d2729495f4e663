"""Integrity checks of the training data, run once before the first step.

A bad file must stop the run at setup with the file and what is wrong, not crash a step
hours in (a truncated ``.bin``) or train silently on garbage (an ``.idx`` from another
dataset, packs of another length, segment ids that are not ``1..k`` then ``0``, token ids
the embedding does not have). What is checked, cheapest first:

* every ``.bin`` is exactly as long as its ``.idx`` says (sizes and pointers agree);
* the three files of a packed prefix describe the same documents (lengths), and agree with
  the document count the preprocessing sidecar recorded;
* packs are ``--seq-length`` tokens (packed data) or at most that (unpacked samples);
* with isolation (``--neat-pack``), every pack's ``attention_mask`` is ``1..k`` then ``0``::

      good   1 1 1 2 2 3 3 3 0 0      bad  1 1 3 3 0 0   (skips 2)
                                           1 1 0 2 2 0   (a sample after padding)
* token ids lie in ``[0, --padded-vocab-size)``; labels are ``-100`` or the token itself
  (labels are stored aligned; the trainer shifts them).

The scans are vectorised over chunks of packs, so they read the data once at disk speed.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Optional

import numpy as np

from mindspeed_pack.data.packed_dataset import DataError, PackedDocuments, check_index_header
from mindspeed_pack.packing.segments import IGNORE_INDEX

log = logging.getLogger(__name__)

CHUNK_TOKENS = 1 << 22  # tokens per vectorised chunk (16 MiB of int32 per file)
PREPROCESS_HINT = "re-run preprocess_data.py (or copy the .bin and .idx of one run together)"


def check_index_matches_bin(prefix: str, dataset) -> None:
    """``prefix.bin`` holds exactly the bytes ``prefix.idx`` describes."""
    index = dataset.index
    sizes = np.asarray(index.sequence_lengths, dtype=np.int64)
    pointers = np.asarray(index.sequence_pointers, dtype=np.int64)
    item = index.dtype_size
    bin_path, idx_path = prefix + ".bin", prefix + ".idx"
    if len(sizes):
        expected_pointers = np.concatenate([[0], np.cumsum(sizes[:-1] * item)])
        bad = np.flatnonzero(pointers != expected_pointers)
        if len(bad):
            raise DataError(f"{idx_path}: corrupt index: document {int(bad[0])} starts at byte {int(pointers[bad[0]])}"
                            f", but the lengths before it put it at {int(expected_pointers[bad[0]])}; {PREPROCESS_HINT}")
    expected = int(pointers[-1] + sizes[-1] * item) if len(sizes) else 0
    actual = os.path.getsize(bin_path)
    if actual < expected:
        raise DataError(f"{bin_path}: truncated: {actual} bytes, but {idx_path} describes {len(sizes)} documents "
                        f"ending at byte {expected} ({expected - actual} bytes missing): an interrupted copy or write, "
                        f"or an .idx of another dataset; {PREPROCESS_HINT}")
    if actual > expected:
        raise DataError(f"{idx_path} does not describe {bin_path}: the index covers {expected} bytes "
                        f"({len(sizes)} documents of {index.dtype.__name__}), the data file has {actual}; the .idx "
                        f"belongs to another dataset: {PREPROCESS_HINT}")


def _first_bad_segment_position(row: np.ndarray) -> tuple:
    prev = 0
    for p, v in enumerate(row.tolist()):
        ok = v == 0 if prev == 0 and p > 0 else (v == 1 if p == 0 else v in (0, prev, prev + 1))
        if not ok:
            return p, v, prev
        prev = v
    return -1, 0, 0


def _check_segments(path: str, start: int, mask: np.ndarray) -> None:
    """Rows of ``mask`` are 1..k (each id one more than the last) and then only 0."""
    nxt, cur = mask[:, 1:], mask[:, :-1]
    step = nxt - cur
    bad = (mask[:, 0] != 1) | (mask < 0).any(1) | ((nxt > 0) & ((step < 0) | (step > 1))).any(1) | \
        ((cur == 0) & (nxt != 0)).any(1)
    rows = np.flatnonzero(bad)
    if len(rows):
        r = int(rows[0])
        p, v, prev = _first_bad_segment_position(mask[r])
        what = (f"starts with {v} instead of 1" if p == 0 else
                f"has segment id {v} at position {p} after {prev}")
        raise DataError(f"{path}: pack {start + r} {what}; the attention_mask of a --neat-pack pack must hold segment "
                        "ids 1..k in order, then 0 for padding: the file is corrupt or not a neat-pack mask; "
                        "re-run preprocess_data.py --pack --neat-pack")


def _check_vocab(path: str, ids: np.ndarray, vocab: Optional[int], where) -> None:
    """Token ids in [0, vocab); ``where(row)`` names the pack/document of a row of ``ids``."""
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0:
        r = int(np.flatnonzero((ids < 0).any(1))[0])
        raise DataError(f"{path}: {where(r)} holds the negative token id {lo}; the file is corrupt: "
                        f"{PREPROCESS_HINT}")
    if vocab is not None and hi >= vocab:
        r = int(np.flatnonzero((ids >= vocab).any(1))[0])
        raise DataError(f"{path}: token id {hi} (first in {where(r)}) is outside the model's vocabulary: the "
                        f"largest id in the data is {hi}, the model's vocab size (--padded-vocab-size) is {vocab}; "
                        f"the data was tokenized with another tokenizer: preprocess it with the model's tokenizer, "
                        f"or train a model with --padded-vocab-size > {hi}")


def _check_labels(path: str, start: int, labels: np.ndarray, ids: np.ndarray) -> None:
    bad = (labels != IGNORE_INDEX) & (labels != ids)
    rows = np.flatnonzero(bad.any(1))
    if len(rows):
        r = int(rows[0])
        p = int(np.flatnonzero(bad[r])[0])
        raise DataError(f"{path}: pack {start + r} position {p} has label {int(labels[r, p])} where input_ids has "
                        f"{int(ids[r, p])}; labels are stored aligned ({IGNORE_INDEX} or the token itself), so this "
                        f"labels file belongs to another dataset: {PREPROCESS_HINT}")


def validate_packed_documents(docs: PackedDocuments, args) -> None:
    """All checks of the module for one ``P_packed_*`` prefix; raises :class:`DataError`."""
    t0 = time.perf_counter()
    paths = {k: f"{docs.prefix}_packed_{k}_document" for k in docs.datasets}
    for key, ds in docs.datasets.items():
        check_index_matches_bin(paths[key], ds)
    sizes = {k: np.asarray(ds.index.sequence_lengths) for k, ds in docs.datasets.items()}
    for key in ("attention_mask", "labels"):
        if not np.array_equal(sizes[key], sizes["input_ids"]):
            d = int(np.flatnonzero(sizes[key] != sizes["input_ids"])[0])
            raise DataError(f"{paths[key]}.idx: document {d} has {int(sizes[key][d])} tokens but "
                            f"{int(sizes['input_ids'][d])} in {paths['input_ids']}.idx: the files come from different "
                            f"preprocessing runs; {PREPROCESS_HINT}")
    meta = docs.meta or {}
    layout = meta.get("layout") or {}
    stats = meta.get("statistics") or {}
    recorded = stats.get("packs") if layout.get("kind") == "packed" else stats.get("documents")
    if recorded is not None and int(recorded) != len(docs):
        raise DataError(f"{paths['input_ids']}.idx holds {len(docs)} documents but the sidecar "
                        f"{docs.prefix}_packed_meta.json recorded {recorded}: the files and the sidecar come from "
                        f"different preprocessing runs; {PREPROCESS_HINT}")
    lengths = sizes["input_ids"]
    seq = args.seq_length
    packed = layout.get("kind") == "packed" or (not layout and args.neat_pack)
    wrong = np.flatnonzero(lengths != seq) if packed else np.flatnonzero(lengths > seq)
    if len(wrong):
        d = int(wrong[0])
        rule = f"every pack is exactly --seq-length {seq} tokens" if packed else \
            f"a sample longer than --seq-length {seq} would be cut"
        raise DataError(f"{paths['input_ids']}: {'pack' if packed else 'document'} {d} has {int(lengths[d])} tokens "
                        f"({len(wrong)} of {len(lengths)} differ); {rule}: the data was prepared for another length, "
                        f"re-run preprocess_data.py --seq-length {seq} (or train with the data's length)")
    if len(lengths) and np.all(lengths == lengths[0]):
        _scan_rows(docs, paths, int(lengths[0]), args)
    else:
        for d in range(len(lengths)):  # unpacked samples of varying length: one at a time
            _scan_rows_of(docs, paths, d, args)
    log.info("validated %s: %d documents in %.2fs", docs.prefix, len(docs), time.perf_counter() - t0)


def _scan_rows(docs, paths, doc_len: int, args) -> None:
    step = max(1, CHUNK_TOKENS // max(doc_len, 1))
    n = len(docs)
    for start in range(0, n, step):
        count = min(step, n - start)
        rows = {k: _rows(ds, start, count, doc_len) for k, ds in docs.datasets.items()}
        _check_rows(paths, start, rows, args)


def _scan_rows_of(docs, paths, d: int, args) -> None:
    rows = {k: np.asarray(ds[d], dtype=np.int64)[None, :] for k, ds in docs.datasets.items()}
    _check_rows(paths, d, rows, args)


def _check_rows(paths, start, rows, args) -> None:
    if rows["input_ids"].size == 0:
        return
    _check_vocab(paths["input_ids"] + ".bin", rows["input_ids"], args.padded_vocab_size,
                 lambda r: f"pack {start + r}")
    _check_labels(paths["labels"] + ".bin", start, rows["labels"], rows["input_ids"])
    if args.isolate_segments:
        _check_segments(paths["attention_mask"] + ".bin", start, rows["attention_mask"])


def _rows(dataset, start: int, count: int, doc_len: int) -> np.ndarray:
    """Documents ``start..start+count`` (all ``doc_len`` long, stored back to back) as one array."""
    first = np.asarray(dataset.get(start, 0, None))  # dtype from the index
    if count == 1:
        return first.astype(np.int64)[None, :]
    flat = dataset.bin_reader.read(dtype=dataset.index.dtype, count=count * doc_len,
                                   offset=int(dataset.index.sequence_pointers[start]))
    return np.asarray(flat, dtype=np.int64).reshape(count, doc_len)


def validate_text_documents(prefixes, padded_vocab_size: Optional[int]) -> None:
    """pretrain_gpt.py's ``P_text_document`` files: index matches data, ids inside the vocabulary."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for prefix in prefixes:
        check_index_header(prefix)
        ds = IndexedDataset(prefix, mmap=True)
        check_index_matches_bin(prefix, ds)
        ends = np.cumsum(np.asarray(ds.index.sequence_lengths, dtype=np.int64))
        total = int(ends[-1]) if len(ends) else 0
        for offset in range(0, total, CHUNK_TOKENS):
            count = min(CHUNK_TOKENS, total - offset)
            flat = np.asarray(ds.bin_reader.read(dtype=ds.index.dtype, count=count,
                                                 offset=offset * ds.index.dtype_size), dtype=np.int64)
            _check_vocab(prefix + ".bin", flat[None, :], padded_vocab_size,
                         lambda r: _document_at(ends, offset, flat, padded_vocab_size))


def _document_at(ends: np.ndarray, offset: int, flat: np.ndarray, vocab: Optional[int]) -> str:
    bad = (flat < 0) | (flat >= vocab) if vocab is not None else flat < 0
    token = offset + int(np.flatnonzero(bad)[0])
    return f"document {int(np.searchsorted(ends, token, side='right'))}"

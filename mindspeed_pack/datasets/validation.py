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
  (labels are stored aligned; the trainer shifts them), or at a process reward sample's step tag one of
  the reward tokens its sidecar names (``layout.step_tags``);
* plain ``--pack`` data's recorded sample boundaries (``P_packed_sample_lengths``, named in the
  sidecar): one entry per pack, as many samples as the sidecar counts, positive lengths that
  fit the pack, each sample starting with an unlabelled token (as every sample is stored).

The scans are vectorised over chunks of packs, so they read the data once at disk speed.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Optional

import numpy as np
import torch

from mindspeed_pack.datasets.packed_documents import DataError, PackedDocuments, check_index_header
from mindspeed_pack.packing.segments import IGNORE_INDEX, segment_ids_at_eos

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


class _Chunk:
    """Documents ``first..first+len(starts)`` of a file as one flat token array, read in one go."""

    def __init__(self, dataset, first: int, last: int, ends: np.ndarray):
        base = int(ends[first - 1]) if first else 0
        self.first = first
        self.ends = ends[first:last] - base  # end offset of each document inside the chunk
        item = dataset.index.dtype_size
        self.tokens = dataset.bin_reader.read(dtype=dataset.index.dtype, count=int(self.ends[-1]),
                                              offset=base * item)  # the file's dtype: no copy from the mmap
        starts = np.concatenate([[0], self.ends[:-1]])
        self.is_start = np.zeros(len(self.tokens), bool)
        self.is_start[starts[starts < len(self.tokens)]] = True  # (empty documents start nowhere)

    def locate(self, pos: int) -> tuple:
        """(document, position in it) of flat position ``pos``."""
        d = int(np.searchsorted(self.ends, pos, side="right"))
        return self.first + d, pos - (int(self.ends[d - 1]) if d else 0)


def _chunks(dataset, lengths: np.ndarray):
    """:class:`_Chunk` s of whole documents, about CHUNK_TOKENS tokens each."""
    ends = np.cumsum(lengths.astype(np.int64))
    first = 0
    while first < len(lengths):
        budget = (int(ends[first - 1]) if first else 0) + CHUNK_TOKENS
        last = max(first + 1, int(np.searchsorted(ends, budget, side="right")))
        yield _Chunk(dataset, first, last, ends)
        first = last


def _check_segments(path: str, chunk: _Chunk, unit: str) -> None:
    """Each document's ids are 1..k (each one more than the last, or equal) and then only 0."""
    m = chunk.tokens
    cur, nxt = m[:-1], m[1:]
    # inside a document the id stays, goes up by one (not from padding), or drops to padding for good
    bad_inner = (nxt != 0) & (nxt != cur) & ((nxt != cur + 1) | (cur == 0)) & ~chunk.is_start[1:]
    bad = np.concatenate([[False], bad_inner]) | (chunk.is_start & (m != 1))
    where = np.flatnonzero(bad)
    if len(where):
        pos = int(where[0])
        doc, p = chunk.locate(pos)
        what = f"starts with {m[pos]} instead of 1" if p == 0 else \
            f"has segment id {m[pos]} at position {p} after {m[pos - 1]}"
        raise DataError(f"{path}: {unit} {doc} {what}; the attention_mask of a --neat-pack pack must hold segment "
                        "ids 1..k in order, then 0 for padding: the file is corrupt or not a neat-pack mask; "
                        "re-run preprocess_data.py --pack --neat-pack")


def _check_vocab(path: str, chunk: _Chunk, vocab: Optional[int], unit: str) -> None:
    """Token ids in [0, vocab)."""
    ids = chunk.tokens
    if not ids.size:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0:
        doc, p = chunk.locate(int(np.flatnonzero(ids < 0)[0]))
        raise DataError(f"{path}: {unit} {doc} position {p} holds the negative token id {lo}; the file is corrupt: "
                        f"{PREPROCESS_HINT}")
    if vocab is not None and hi >= vocab:
        doc, p = chunk.locate(int(np.flatnonzero(ids >= vocab)[0]))
        raise DataError(f"{path}: token id {hi} (first in {unit} {doc}) is outside the model's vocabulary: the "
                        f"largest id in the data is {hi}, the model's vocab size (--padded-vocab-size) is {vocab}; "
                        f"the data was tokenized with another tokenizer: preprocess it with the model's tokenizer, "
                        f"or train a model with --padded-vocab-size > {hi}")


def _check_labels(path: str, labels: _Chunk, ids: _Chunk, unit: str, steps: Optional[dict] = None) -> None:
    wrong = (labels.tokens != IGNORE_INDEX) & (labels.tokens != ids.tokens)
    if steps:  # a step tag is labelled with its step's reward token
        wrong &= ~((ids.tokens == steps["placeholder_id"]) & np.isin(labels.tokens, steps["reward_token_ids"]))
    bad = np.flatnonzero(wrong)
    if len(bad):
        pos = int(bad[0])
        doc, p = ids.locate(pos)
        raise DataError(f"{path}: {unit} {doc} position {p} has label {int(labels.tokens[pos])} where input_ids has "
                        f"{int(ids.tokens[pos])}; labels are stored aligned ({IGNORE_INDEX} or the token itself), so "
                        f"this labels file belongs to another dataset: {PREPROCESS_HINT}")


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
    unit = "pack" if packed else "document"
    starts = _recorded_sample_starts(docs, stats, seq) if docs.sample_lengths is not None else None
    chunks = {k: _chunks(ds, lengths) for k, ds in docs.datasets.items()}
    for ids, labels, mask in zip(chunks["input_ids"], chunks["labels"], chunks["attention_mask"]):
        _check_vocab(paths["input_ids"] + ".bin", ids, args.padded_vocab_size, unit)
        _check_labels(paths["labels"] + ".bin", labels, ids, unit, layout.get("step_tags"))
        if args.isolate_segments:
            _check_segments(paths["attention_mask"] + ".bin", mask, unit)
        if starts is not None:
            _check_sample_starts(docs, labels, starts, seq)
    log.info("validated %s: %d documents in %.2fs", docs.prefix, len(docs), time.perf_counter() - t0)


def _sample_lengths_path(docs: PackedDocuments) -> str:
    return os.path.join(os.path.dirname(docs.prefix), docs.meta["layout"]["sample_lengths"])


def _recorded_sample_starts(docs: PackedDocuments, stats: dict, seq: int) -> np.ndarray:
    """Flat positions (pack x seq + offset) where the recorded samples start, after checking the file."""
    path = _sample_lengths_path(docs)
    ds = docs.sample_lengths
    check_index_matches_bin(path, ds)
    counts = np.asarray(ds.index.sequence_lengths, dtype=np.int64)
    if len(counts) != len(docs):
        raise DataError(f"{path}.idx holds the samples of {len(counts)} packs but the packs are {len(docs)}: the "
                        f"files come from different preprocessing runs; {PREPROCESS_HINT}")
    written = stats.get("samples_written")
    if written is not None and int(counts.sum()) != int(written):
        raise DataError(f"{path}: {int(counts.sum())} sample lengths, but the sidecar {docs.prefix}_packed_meta.json "
                        f"recorded {written} samples written; {PREPROCESS_HINT}")
    lengths = ds.bin_reader.read(dtype=ds.index.dtype, count=int(counts.sum()), offset=0).astype(np.int64)
    pack = np.repeat(np.arange(len(counts)), counts)
    first = np.cumsum(counts) - counts
    used = np.add.reduceat(lengths, first[counts > 0]) if len(lengths) else np.zeros(0, np.int64)
    bad = np.flatnonzero(lengths <= 0)
    over = np.flatnonzero(used > seq)
    if len(bad) or len(over):
        p = int(pack[bad[0]]) if len(bad) else int(np.flatnonzero(counts > 0)[over[0]])
        what = f"a sample of length {int(lengths[bad[0]])}" if len(bad) else \
            f"samples of {int(used[over[0]])} tokens in all, more than the {seq} a pack holds"
        raise DataError(f"{path}: pack {p} has {what}; {PREPROCESS_HINT}")
    start = np.cumsum(lengths) - lengths  # over all packs; minus the pack's first gives the offset in it
    return pack * seq + start - np.repeat(start[first[counts > 0]], counts[counts > 0])


def _check_sample_starts(docs: PackedDocuments, labels: _Chunk, starts: np.ndarray, seq: int) -> None:
    """Every recorded sample starts with an unlabelled token (as preprocessing stores every sample)."""
    lo, hi = labels.first * seq, labels.first * seq + len(labels.tokens)
    mine = starts[np.searchsorted(starts, lo):np.searchsorted(starts, hi)]  # starts are in file order
    bad = mine[labels.tokens[mine - lo] != IGNORE_INDEX]
    if len(bad):
        pack, pos = divmod(int(bad[0]), seq)
        raise DataError(f"{_sample_lengths_path(docs)}: pack {pack} has a sample starting at position {pos}, where "
                        f"{docs.prefix}_packed_labels_document holds a trained label: the boundaries do not belong to "
                        f"these packs; {PREPROCESS_HINT}")


def count_samples_at_eos(docs: PackedDocuments, eos_id: int, pad_id: int) -> int:
    """Samples MindSpeed-LLM's EOS rule finds in plain packs (all of them ``seq`` tokens long)."""
    lengths = np.asarray(docs.datasets["input_ids"].index.sequence_lengths)
    found = 0
    for ids, labels in zip(_chunks(docs.datasets["input_ids"], lengths), _chunks(docs.datasets["labels"], lengths)):
        rows = len(ids.ends)
        sample_ids = segment_ids_at_eos(torch.from_numpy(ids.tokens.astype(np.int64).reshape(rows, -1)),
                                        torch.from_numpy(labels.tokens.astype(np.int64).reshape(rows, -1)),
                                        eos_id, pad_id)
        found += int(sample_ids.max(dim=1).values.sum())  # ids run 1..k per pack (0: padding)
    return found


def validate_text_documents(prefixes, padded_vocab_size: Optional[int]) -> None:
    """pretrain_gpt.py's ``P_text_document`` files: index matches data, ids inside the vocabulary."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for prefix in prefixes:
        check_index_header(prefix)
        ds = IndexedDataset(prefix, mmap=True)
        check_index_matches_bin(prefix, ds)
        for chunk in _chunks(ds, np.asarray(ds.index.sequence_lengths)):
            _check_vocab(prefix + ".bin", chunk, padded_vocab_size, "document")


def document_segment_lengths(docs: PackedDocuments, segments: int) -> np.ndarray:
    """``[documents, segments]``: the tokens of each document's segments ``1..segments``, read from its
    attention mask in one pass (documents that are units of several sequences: a preference pair, a KTO couple
    written without ``--pack``). A document whose mask holds another id, or lacks one of them, stops the run."""
    ds = docs.datasets["attention_mask"]
    lengths = np.asarray(ds.index.sequence_lengths, dtype=np.int64)
    out = np.zeros((len(lengths), segments), np.int64)
    for chunk in _chunks(ds, lengths):
        n = len(chunk.ends)
        mask = np.asarray(chunk.tokens, dtype=np.int64)
        doc = np.repeat(np.arange(n), np.diff(np.concatenate([[0], chunk.ends])))
        bad = np.flatnonzero((mask < 1) | (mask > segments))
        if len(bad):
            d, p = chunk.locate(int(bad[0]))
            raise DataError(f"{docs.prefix}_packed_attention_mask_document: document {d} has segment id "
                            f"{int(mask[bad[0]])} at position {p}; a document of this data is one unit of segments "
                            f"1..{segments}: {PREPROCESS_HINT}")
        counts = np.bincount(doc * (segments + 1) + mask, minlength=n * (segments + 1)).reshape(n, segments + 1)
        out[chunk.first:chunk.first + n] = counts[:, 1:]
    empty = np.flatnonzero((out == 0).any(1))
    if len(empty):
        raise DataError(f"{docs.prefix}_packed_attention_mask_document: document {int(empty[0])} holds segments "
                        f"{(np.flatnonzero(out[empty[0]]) + 1).tolist()}, not 1..{segments} ({len(empty)} such "
                        f"documents): {PREPROCESS_HINT}")
    return out

"""The three aligned indexed datasets of one preprocessed prefix, opened and checked.

Below both the training view (``packed_dataset``) and the deep checks (``validation``), so
neither has to import the other for the shared types.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Optional

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDataset

KEYS = ("input_ids", "attention_mask", "labels")


def is_blend_weight(text: str) -> bool:
    """Whether a ``--data-path`` item is a blend's weight (``0.3 A 0.7 B``), not a prefix."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def data_prefixes(args) -> list:
    """Every prefix a run reads, each once: ``--data-path``'s (a blend's weights skipped), then
    ``--train/--valid/--test-data-path``'s (pretrain_gpt.py: each may be a blend too)."""
    found = []
    for dest in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        found += [p for p in getattr(args, dest, None) or [] if not is_blend_weight(p)]  # pretrain_gpt.py: blends
    return list(dict.fromkeys(found))


def dataset_paths(prefix: str) -> dict:
    return {k: f"{prefix}_packed_{k}_document" for k in KEYS}


def read_meta(prefix: str) -> Optional[dict]:
    """The preprocessing sidecar (arguments, tokenizer, statistics), if present: a pack's ``P_packed_meta.json``,
    or pretraining documents' ``P_text_meta.json`` beside ``P_text_document``."""
    names = [f"{prefix}_packed_meta.json", f"{prefix}_meta.json"]
    if prefix.endswith("_text_document"):
        names.append(f"{prefix[:-len('_document')]}_meta.json")
    for name in names:
        if os.path.isfile(name):
            with open(name) as f:
                return json.load(f)
    return None


class DataError(ValueError):
    """Missing or inconsistent training data."""


INDEX_HEADER_BYTES = 34  # magic (9), version (8), dtype code (1), sequence count (8), document count (8)


def check_index_header(path: str) -> None:
    """``path.idx`` is a whole Megatron index: its magic, version 1, a known dtype, and as long as its counts
    say (lengths int32 and pointers int64 per sequence, an int64 per document boundary). On a damaged
    header megatron-core would only assert, or fail mid-construction."""
    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

    idx = path + ".idx"
    with open(idx, "rb") as f:
        head = f.read(INDEX_HEADER_BYTES)
    if not head.startswith(_INDEX_HEADER):
        raise DataError(f"{idx}: not a readable Megatron index (it does not start with {_INDEX_HEADER!r}); re-run "
                        "preprocess_data.py")
    problem = None
    if len(head) < INDEX_HEADER_BYTES:
        problem = f"it ends after {len(head)} bytes, inside its {INDEX_HEADER_BYTES}-byte header"
    else:
        version, code, sequences, documents = struct.unpack("<QBQQ", head[len(_INDEX_HEADER):])
        expected = INDEX_HEADER_BYTES + 12 * sequences + 8 * documents
        if version != 1:
            problem = f"its header gives version {version}, not 1"
        elif code not in {d.value for d in DType}:
            problem = f"its header gives dtype code {code}, not one of {sorted(d.value for d in DType)}"
        elif os.path.getsize(idx) != expected:
            problem = (f"its header counts {sequences} documents and {documents} document boundaries, which take "
                       f"{expected} bytes, but the file has {os.path.getsize(idx)}")
    if problem:
        raise DataError(f"{idx} does not describe {path}.bin: {problem} (a damaged or partly copied index); re-run "
                        "preprocess_data.py (or copy the .bin and .idx of one run together)")


class PackedDocuments:
    """The three aligned indexed datasets of one prefix."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.datasets = {}
        for key, path in dataset_paths(prefix).items():
            missing = [path + ext for ext in (".bin", ".idx") if not os.path.isfile(path + ext)]
            if missing:
                raise DataError(f"data prefix {prefix!r}: missing {', '.join(missing)} "
                                f"(run preprocess_data.py with --output-prefix {prefix})")
            check_index_header(path)
            self.datasets[key] = IndexedDataset(path, mmap=True)
        sizes = {k: len(d) for k, d in self.datasets.items()}
        if len(set(sizes.values())) != 1:
            odd = next(k for k, n in sizes.items() if n != sizes["input_ids"])
            raise DataError(f"{dataset_paths(prefix)[odd]}.idx holds {sizes[odd]} documents but "
                            f"{dataset_paths(prefix)['input_ids']}.idx {sizes['input_ids']}: the files come from "
                            "different preprocessing runs (an .idx of another dataset?); re-run preprocess_data.py")
        self.meta = read_meta(prefix)
        self.sample_lengths = self.recorded("sample_lengths", "the packs' sample boundaries")
        self.pair_margins = self.recorded("pair_margins", "the pairs' reward margins")
        if self.pair_margins is not None and len(self.pair_margins) != len(self):
            raise DataError(f"{self.prefix}: the pairs' reward margins hold {len(self.pair_margins)} packs, the packs "
                            f"{len(self)}: the files come from different preprocessing runs; re-run preprocess_data.py")

    def recorded(self, key: str, what: str) -> Optional[IndexedDataset]:
        """A per-pack file beside the packs (one document per pack) that the sidecar's layout names under ``key``
        (``sample_lengths``, ``pair_margins``, ``kto_labels``), opened; None when the sidecar names none."""
        name = ((self.meta or {}).get("layout") or {}).get(key)
        if not name:
            return None
        path = os.path.join(os.path.dirname(self.prefix), name)
        missing = [path + ext for ext in (".bin", ".idx") if not os.path.isfile(path + ext)]
        if missing:
            raise DataError(f"{self.prefix}_packed_meta.json names {what} {name}, but "
                            f"{', '.join(missing)} cannot be found; copy it with the packs or re-run preprocess_data.py")
        check_index_header(path)
        return IndexedDataset(path, mmap=True)

    def __len__(self) -> int:
        return len(self.datasets["input_ids"])

    def get(self, doc: int) -> dict:
        """The document's arrays; plain packs with recorded boundaries add ``sample_ids`` (1..k, 0 = padding)."""
        out = {k: np.asarray(d[doc], dtype=np.int64) for k, d in self.datasets.items()}
        if self.sample_lengths is not None:
            lengths = np.asarray(self.sample_lengths[doc], dtype=np.int64)
            ids = np.zeros(len(out["input_ids"]), np.int64)
            ids[:int(lengths.sum())] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
            out["sample_ids"] = ids
        if self.pair_margins is not None:
            out["pair_margins"] = np.asarray(self.pair_margins[doc], dtype=np.float64)
        return out

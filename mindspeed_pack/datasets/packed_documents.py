"""The three aligned indexed datasets of one preprocessed prefix, opened and checked.

Below both the training view (``packed_dataset``) and the deep checks (``validation``), so
neither has to import the other for the shared types.
"""
from __future__ import annotations

import hashlib
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


_IDENTITIES: dict = {}  # (prefix, its files' sizes and mtimes) -> identity: hashed once per process


def _recorded_identity(meta: dict) -> Optional[dict]:
    """What preprocessing recorded that names the data's content wherever it lies: its cache key (the inputs'
    digests, tokenizer, template, flags) without the inputs' paths, and the written data's fingerprint (pairs,
    KTO); None when the sidecar records neither."""
    key = json.loads(json.dumps(meta.get("cache_key"))) if isinstance(meta.get("cache_key"), dict) else None
    if key is not None and isinstance(key.get("inputs"), list):
        key["inputs"] = [{k: v for k, v in i.items() if k != "path"} if isinstance(i, dict) else i
                         for i in key["inputs"]]
    fingerprint = (meta.get("statistics") or {}).get("data_fingerprint")
    if key is None and fingerprint is None:
        return None
    return {"cache_key": key, "data_fingerprint": fingerprint}


def content_identity(prefix: str) -> Optional[str]:
    """What ``prefix``'s data is, wherever it lies (a copy moved to another disk has the same): sha256 over its
    index files (``.idx``: every document's length and offset), the sizes of their ``.bin`` and what its sidecar
    records of the content (:func:`_recorded_identity`). A ``.bin`` is never read: tokens edited in place with
    every length and the sidecar kept go unseen. None when the prefix has no index here (packs
    ``P_packed_*_document`` or documents ``P``), or for packs whose sidecar records nothing of their content
    (every pack is ``--seq-length`` long: their index tells only how many there are)."""
    parts = [(key, path) for key, path in dataset_paths(prefix).items() if os.path.isfile(path + ".idx")]
    if not parts and os.path.isfile(prefix + ".idx"):
        parts = [("documents", prefix)]
    if not parts:
        return None
    stats = tuple((path, os.stat(path + ".idx").st_size, os.stat(path + ".idx").st_mtime_ns,
                   os.path.getsize(path + ".bin") if os.path.isfile(path + ".bin") else None) for _, path in parts)
    key = (os.path.abspath(prefix), stats)
    if key not in _IDENTITIES:
        from mindspeed_pack.data.digest import sha256_of_files

        try:
            recorded = _recorded_identity(read_meta(prefix) or {})
        except (OSError, ValueError, AttributeError):  # an unreadable sidecar: the index alone (never stops a save)
            recorded = None
        if recorded is None and parts[0][0] != "documents":
            _IDENTITIES[key] = None
        else:
            what = {"parts": [k for k, _ in parts], "bin_bytes": [s[3] for s in stats], "recorded": recorded,
                    "idx_sha256": sha256_of_files([path + ".idx" for _, path in parts], names=False)}
            _IDENTITIES[key] = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
    return _IDENTITIES[key]


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

    def fingerprint(self) -> str:
        """'135 documents, data 1a2b3c4d5e6f': what these files are, cheaply (the sidecar's record of the inputs,
        their hashes and the preprocessing flags; else the files' sizes), so ranks reading per-node copies at one
        path can tell that their copies differ (a stale copy, another preprocessing)."""
        record = _recorded_identity(self.meta or {}) or \
            {key: [int(d.sequence_lengths.sum()), len(d)] for key, d in self.datasets.items()}
        digest = hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()[:12]
        return f"{len(self)} documents, data {digest}"

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

"""Training-side view of packed indexed datasets, and the micro-batch iterator.

``P_packed_{input_ids,attention_mask,labels}_document`` hold one pack (or, unpacked, one
sample) per document. A split (``--split 98,2,0``) is a contiguous range of documents;
within it the C++ sample index (seeded shuffle or ``--no-shuffle``, ``--padded-samples``)
says which document each training sample is. Global batch ``g`` is samples
``[g*GBS, (g+1)*GBS)`` of the index, so the position in the data is one integer
(``consumed_samples``) and resuming is exact.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterator, List, Optional

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset

from mindspeed_pack.data.sample_index import get_sample_index
from mindspeed_pack.packing.balance import segment_lengths
from mindspeed_pack.packing.segments import IGNORE_INDEX

KEYS = ("input_ids", "attention_mask", "labels")


def dataset_paths(prefix: str) -> dict:
    return {k: f"{prefix}_packed_{k}_document" for k in KEYS}


def read_meta(prefix: str) -> Optional[dict]:
    """The preprocessing sidecar (arguments, tokenizer, statistics), if present."""
    for name in (f"{prefix}_packed_meta.json", f"{prefix}_meta.json"):
        if os.path.isfile(name):
            with open(name) as f:
                return json.load(f)
    return None


class DataError(ValueError):
    """Missing or inconsistent training data."""


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
            self.datasets[key] = IndexedDataset(path, mmap=True)
        sizes = {k: len(d) for k, d in self.datasets.items()}
        if len(set(sizes.values())) != 1:
            raise DataError(f"data prefix {prefix!r}: datasets differ in document count {sizes}")
        self.meta = read_meta(prefix)

    def __len__(self) -> int:
        return len(self.datasets["input_ids"])

    def get(self, doc: int) -> dict:
        return {k: np.asarray(d[doc], dtype=np.int64) for k, d in self.datasets.items()}


def split_ranges(num_docs: int, split: str) -> List[tuple]:
    """Megatron's ``--split a,b,c``: contiguous [start, end) document ranges per split."""
    weights = [float(x) for x in split.replace("/", ",").split(",")]
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    if total <= 0:
        raise DataError(f"--split {split!r}: weights must sum to a positive number")
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w / total * num_docs)))
    bounds[-1] = num_docs
    bounds = [min(b, num_docs) for b in bounds]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


@dataclass
class SplitDataset:
    """One split's documents and its sample index."""

    docs: PackedDocuments
    start: int
    end: int
    index: np.ndarray  # int64 offsets into [start, end)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict:
        return self.docs.get(self.start + int(self.index[i]))


def build_split_datasets(args, num_samples: dict) -> dict:
    """{'train'|'valid'|'test': SplitDataset or None} for ``args.data_path`` (one prefix)."""
    if len(args.data_path) != 1:
        raise DataError("posttrain takes one --data-path prefix (blends are for pretrain_gpt.py)")
    docs = PackedDocuments(args.data_path[0])
    _check_against_meta(docs, args)
    ranges = split_ranges(len(docs), args.split)
    cache = args.data_cache_path or os.path.dirname(os.path.abspath(args.data_path[0]))
    out = {}
    for name, (start, end) in zip(("train", "valid", "test"), ranges):
        n = num_samples.get(name, 0)
        if end <= start or n <= 0:
            out[name] = None
            continue
        index = get_sample_index(
            cache, end - start, n, seed=args.seed, shuffle=not args.no_shuffle and name == "train",
            padded_samples=args.padded_samples and name == "train", global_batch_size=args.global_batch_size,
            tag=f"{os.path.abspath(args.data_path[0])}-{name}-{start}-{end}",
        )
        out[name] = SplitDataset(docs, start, end, index)
    return out


def _check_against_meta(docs: PackedDocuments, args) -> None:
    """Refuse flag/data mismatches that would silently train the wrong thing."""
    layout = (docs.meta or {}).get("layout", {})
    if args.neat_pack and not layout:
        # no sidecar (data from elsewhere): segment-id masks have padding (0) or several ids
        masks = docs.datasets["attention_mask"]
        if all(np.all(np.asarray(masks[i]) == 1) for i in range(min(len(docs), 16))):
            raise DataError(f"--neat-pack: the attention_mask of {docs.prefix!r} is all ones in its first packs, "
                            "so it holds no segment ids; re-run preprocess_data.py --pack --neat-pack")
    if args.neat_pack and layout.get("kind") == "packed" and not layout.get("neat_pack", False):
        raise DataError(f"--neat-pack: {docs.prefix!r} was preprocessed without --neat-pack, so its "
                        "attention_mask holds no segment ids; re-run preprocess_data.py --pack --neat-pack")
    seq = layout.get("seq_length")
    if layout.get("kind") == "packed" and seq and int(seq) != args.seq_length:
        raise DataError(f"--seq-length {args.seq_length} differs from the packs' length {seq} in {docs.prefix!r}")


def collate(samples: List[dict], seq_length: int, isolate: bool) -> dict:
    """Stack documents into [b, seq_length]; shorter (unpacked) ones get a padding segment."""
    b = len(samples)
    input_ids = np.zeros((b, seq_length), np.int64)
    labels = np.full((b, seq_length), IGNORE_INDEX, np.int64)
    segments = np.zeros((b, seq_length), np.int64)
    for r, s in enumerate(samples):
        n = min(len(s["input_ids"]), seq_length)
        input_ids[r, :n] = s["input_ids"][:n]
        labels[r, :n] = s["labels"][:n]
        segments[r, :n] = s["attention_mask"][:n]
    if not isolate:
        # no isolation: each row is one causal sequence; padding stays untrained
        segments_t = None
    else:
        segments_t = torch.from_numpy(segments)
    return {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels),
            "segment_ids": segments_t,
            # the samples' real lengths (padding excluded) for throughput metrics
            "segment_lengths": np.concatenate([segment_lengths(row) for row in segments])}


def micro_batches(dataset: SplitDataset, consumed_samples: int, args, dp_rank: int, dp_size: int) -> Iterator[dict]:
    """Yield this rank's micro-batches from ``consumed_samples`` on (Megatron's sampler order)."""
    mbs = args.micro_batch_size
    pos = consumed_samples
    while pos + mbs * dp_size <= len(dataset):
        first = pos + dp_rank * mbs
        yield collate([dataset[i] for i in range(first, first + mbs)], args.seq_length, args.isolate_segments)
        pos += mbs * dp_size


class PackedBatchSource:
    """posttrain's data: packed (or unpacked) instruction documents, split and indexed."""

    def setup(self, args, num_samples: dict) -> None:
        from megatron.core import parallel_state as ps

        self.args = args
        self.splits = build_split_datasets(args, num_samples)
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()

    def has_split(self, split: str) -> bool:
        return self.splits.get(split) is not None

    def micro_batches(self, split: str, consumed_samples: int):
        dataset = self.splits.get(split)
        if dataset is None:
            raise DataError(f"the {split} split is empty: check --split {self.args.split}")
        return micro_batches(dataset, consumed_samples, self.args, self.dp_rank, self.dp_size)


def resolve_vocab_size(args) -> None:
    """Fill ``--padded-vocab-size`` from the data's sidecar or the tokenizer when not given."""
    from mindspeed_pack.model.gpt import padded_vocab_size

    if args.padded_vocab_size is not None:
        return
    vocab = args.vocab_size
    meta = read_meta(args.data_path[0]) if args.data_path else None
    if vocab is None and meta:
        vocab = meta.get("cache_key", {}).get("tokenizer", {}).get("vocab_size")
    if vocab is None and args.tokenizer_name_or_path:
        from transformers import AutoTokenizer

        vocab = len(AutoTokenizer.from_pretrained(args.tokenizer_name_or_path))
    if vocab is None:
        raise DataError("cannot tell the vocabulary size: pass --padded-vocab-size, --vocab-size or "
                        "--tokenizer-name-or-path")
    args.vocab_size = int(vocab)
    args.padded_vocab_size = padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by,
                                               args.tensor_model_parallel_size)

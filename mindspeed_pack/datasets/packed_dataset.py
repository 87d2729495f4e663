"""Training-side view of packed indexed datasets, and the micro-batch iterator.

``P_packed_{input_ids,attention_mask,labels}_document`` hold one pack (or, unpacked, one
sample) per document. A split (``--split 98,2,0``) is a contiguous range of documents (with
Megatron's ``--train-data-path``/``--valid-data-path``, a whole prefix of its own);
within it the C++ sample index (seeded shuffle or ``--no-shuffle``, ``--padded-samples``)
says which document each training sample is. Global batch ``g`` is samples
``[g*GBS, (g+1)*GBS)`` of the index, so the position in the data is one integer
(``consumed_samples``) and resuming is exact.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Iterator, List, Optional

import numpy as np
import torch

from mindspeed_pack.datasets.packed_documents import DataError, PackedDocuments, read_meta
from mindspeed_pack.datasets.sample_index import get_sample_index, whole_epochs
from mindspeed_pack.datasets.validation import validate_packed_documents
from mindspeed_pack.packing.balance import segment_lengths
from mindspeed_pack.packing.segments import IGNORE_INDEX, segment_ids_at_eos

log = logging.getLogger(__name__)


def split_ranges(num_docs: int, split: str) -> List[tuple]:
    """Megatron's ``--split a,b,c``: contiguous [start, end) document ranges per split.

    megatron-core's rule (``convert_split_vector_to_split_matrix``): each split ends at the
    rounded *cumulative* fraction, so rounding never hands documents to a later split
    (25 packs at ``98,2,0`` give 24/1/0, as ``GPTDataset`` splits them).
    """
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    try:
        weights = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        raise DataError(f"--split {split!r}: give comma-separated weights, e.g. 98,2,0") from None
    if len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise DataError(f"--split {split!r}: up to three non-negative weights with a positive sum")
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(",".join(map(str, weights))))
    out = []
    for bookends in matrix:
        if bookends is None:
            prev = out[-1][1] if out else 0
            out.append((prev, prev))
        else:
            out.append((int(round(bookends[0] * num_docs)), int(round(bookends[1] * num_docs))))
    return out


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


def _split_sources(args) -> dict:
    """{'train'|'valid'|'test': (PackedDocuments, start, end) or None}: --split ranges of one
    --data-path prefix, or Megatron's --train/--valid/--test-data-path prefixes used whole."""

    per_split = {name: getattr(args, f"{name}_data_path", None) for name in ("train", "valid", "test")}
    if not any(per_split.values()):
        if len(args.data_path) != 1:
            from mindspeed_pack.config.arguments import ONE_PREFIX

            raise DataError(f"--data-path {' '.join(args.data_path)}: {ONE_PREFIX}")
        docs = PackedDocuments(args.data_path[0])
        validate_packed_documents(docs, args)  # corrupt or mismatched files stop here, before the first step
        return {name: (docs, start, end)
                for name, (start, end) in zip(("train", "valid", "test"), split_ranges(len(docs), args.split))}
    out = {}
    for name, paths in per_split.items():
        if not paths:
            out[name] = None
            continue
        if len(paths) != 1:
            raise DataError(f"--{name}-data-path takes one prefix, got {len(paths)}: {' '.join(paths)}")
        docs = PackedDocuments(paths[0])
        validate_packed_documents(docs, args)
        out[name] = (docs, 0, len(docs))
    return out


def build_split_datasets(args, num_samples: dict) -> tuple:
    """({'train'|'valid'|'test': SplitDataset or None}, [PackedDocuments read]) (see :func:`_split_sources`).

    The flags are checked against each prefix's data by ``mindspeed_pack.checkpoint.identity``."""
    out = {}
    sources = _split_sources(args)
    docs_read = []
    for source in sources.values():
        if source is not None and all(source[0] is not d for d in docs_read):
            docs_read.append(source[0])
    for name, source in sources.items():
        n = num_samples.get(name, 0)
        if source is None or source[2] <= source[1] or n <= 0:
            out[name] = None
            continue
        docs, start, end = source
        prefix = os.path.abspath(docs.prefix)
        cache = args.data_cache_path or os.path.dirname(prefix)
        # whole epochs, as megatron-core builds its indices: a resume with a smaller global
        # batch size (more steps from the same consumed samples) still finds its samples
        n = whole_epochs(end - start, n, padded_samples=args.padded_samples and name == "train",
                         global_batch_size=args.global_batch_size)
        index = get_sample_index(
            cache, end - start, n, seed=args.seed, shuffle=not args.no_shuffle and name == "train",
            padded_samples=args.padded_samples and name == "train", global_batch_size=args.global_batch_size,
            tag=f"{prefix}-{name}-{start}-{end}",
        )
        out[name] = SplitDataset(docs, start, end, index)
    return out, docs_read


def micro_batch(samples: List[dict], args, seq_length: Optional[int] = None, isolate: Optional[bool] = None) -> dict:
    """Stack documents into one micro-batch ``[b, seq_length]``: the only way documents become one,
    for every scheduler (``none``, ``dp_balanced`` offline packs and online rows), so all find the
    same samples, positions and real lengths.

    Shorter (unpacked) documents get a padding segment. Plain ``--pack`` rows (attention_mask all
    ones) find their samples when the sidecar checks say the flags need them (``args.plain_pack_samples``):
    the boundaries recorded at preprocessing (the documents' ``sample_ids``), else at EOS; they
    become the isolated segments when ``isolate`` (default ``args.isolate_segments``), else only
    the groups of ``--per-sample-loss``. The untrained pads that end a sample (``--pad-to-multiple-of``'s,
    ``args.sample_pad_id``, or a document's ``pad_mask``) are left out of the real lengths
    reported for throughput.
    """
    seq_length = seq_length or args.seq_length
    isolate = args.isolate_segments if isolate is None else isolate
    b = len(samples)
    input_ids = np.zeros((b, seq_length), np.int64)
    labels = np.full((b, seq_length), IGNORE_INDEX, np.int64)
    segments = np.zeros((b, seq_length), np.int64)
    pads = np.zeros((b, seq_length), bool)  # untrained pads that end a sample: no real tokens
    pad_id = getattr(args, "sample_pad_id", None)
    for r, s in enumerate(samples):
        n = min(len(s["input_ids"]), seq_length)
        input_ids[r, :n] = s["input_ids"][:n]
        labels[r, :n] = s["labels"][:n]
        segments[r, :n] = s["attention_mask"][:n]
        if "pad_mask" in s:
            pads[r, :n] = s["pad_mask"][:n]
    if pad_id is not None:
        pads |= (input_ids == pad_id) & (labels == IGNORE_INDEX)
    ids_t, labels_t = torch.from_numpy(input_ids), torch.from_numpy(labels)
    sample_ids = _plain_pack_samples(samples, ids_t, labels_t, seq_length, args)
    if not isolate:
        # no isolation: each row is one causal sequence; padding stays untrained
        segments_t = None
    elif sample_ids is not None:
        segments_t, sample_ids = sample_ids, None
    else:
        segments_t = torch.from_numpy(segments)
    margins = {} if not all("pair_margins" in s for s in samples) else {  # pairs' reward margins, in segment order
        "pair_margins": torch.from_numpy(np.concatenate([s["pair_margins"] for s in samples]))}
    if segments_t is None and sample_ids is None and all("sample_ids" in s for s in samples):
        # plain packs trained as whole rows still hold the samples preprocessing recorded: the metrics count
        # those (samples per pack), not one per row
        margins["sample_count"] = sum(int(s["sample_ids"][:seq_length].max(initial=0)) for s in samples)
    return {"input_ids": ids_t, "labels": labels_t, "segment_ids": segments_t, "sample_ids": sample_ids, **margins,
            # the samples' real lengths (padding excluded) for throughput metrics
            "segment_lengths": np.concatenate([
                segment_lengths(row, pad) for row, pad in zip(segments if segments_t is None else segments_t.numpy(),
                                                              pads)])}


def _plain_pack_samples(samples: List[dict], input_ids, labels, seq_length: int, args) -> Optional[torch.Tensor]:
    """Sample ids of plain-pack rows (see :func:`micro_batch`), or None when they are not needed:
    the boundaries recorded at preprocessing, else (data written before) those at EOS."""
    if not getattr(args, "plain_pack_samples", None):
        return None
    if all("sample_ids" in s for s in samples):
        out = np.zeros((len(samples), seq_length), np.int64)
        for r, s in enumerate(samples):
            n = min(len(s["sample_ids"]), seq_length)
            out[r, :n] = s["sample_ids"][:n]
        return torch.from_numpy(out)
    return segment_ids_at_eos(input_ids, labels, args.pack_eos_id, args.pack_pad_id)


def micro_batches(dataset: SplitDataset, consumed_samples: int, args, dp_rank: int, dp_size: int) -> Iterator[dict]:
    """Yield this rank's micro-batches from ``consumed_samples`` on (Megatron's sampler order)."""
    mbs = args.micro_batch_size
    pos = consumed_samples
    while pos + mbs * dp_size <= len(dataset):
        first = pos + dp_rank * mbs
        batch = micro_batch([dataset[i] for i in range(first, first + mbs)], args)
        # which packs these are (documents of the prefix): per-pack data kept beside it (reference log-probs)
        batch["documents"] = [dataset.start + int(dataset.index[i]) for i in range(first, first + mbs)]
        yield batch
        pos += mbs * dp_size


class PackedBatchSource:
    """posttrain's data: packed (or unpacked) instruction documents, split and indexed."""

    def setup(self, args, num_samples: dict) -> None:
        from megatron.core import parallel_state as ps

        self.args = args
        self.splits, self.docs = build_split_datasets(args, num_samples)
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()

    def has_split(self, split: str) -> bool:
        return self.splits.get(split) is not None

    def micro_batches(self, split: str, consumed_samples: int):
        dataset = self.splits.get(split)
        if dataset is None:
            where = f"--{split}-data-path" if getattr(self.args, "train_data_path", None) else f"--split {self.args.split}"
            raise DataError(f"the {split} split is empty: check {where}")
        return micro_batches(dataset, consumed_samples, self.args, self.dp_rank, self.dp_size)


def resolve_vocab_size(args) -> None:
    """The model's real vocabulary rows (``args.vocab_size``: the rows its softmax covers, past them only
    Megatron's padding, masked) and ``--padded-vocab-size``.

    A loaded model sets its rows before this (config.json's ``vocab_size``, or those a Megatron checkpoint
    records: :mod:`~mindspeed_pack.config.hf_flags`, :mod:`~mindspeed_pack.config.checkpoint_flags`); the
    tokens the data's tokenizer holds past them (markers a template added at preprocessing, recorded in the
    sidecar) are real rows too, as ``resize_token_embeddings(len(tokenizer))`` makes them. Without either,
    the data's tokenizer tells the rows; ``--padded-vocab-size`` alone makes every row real.
    """
    from mindspeed_pack.model.gpt import padded_vocab_size

    prefix = (args.data_path or getattr(args, "train_data_path", None) or [None])[0]
    meta = read_meta(prefix) if prefix else None
    listed = ((meta or {}).get("cache_key") or {}).get("tokenizer", {}).get("vocab_size")
    if args.vocab_size is not None and listed and listed > args.vocab_size:
        rows = min(int(listed), args.padded_vocab_size or int(listed))
        log.info("the data's tokenizer has %d tokens, past the model's %d vocabulary rows: rows %d..%d (tokens "
                 "added at preprocessing) are real rows too", listed, args.vocab_size, args.vocab_size, rows - 1)
        args.vocab_size = rows
    if args.padded_vocab_size is not None:
        return
    vocab = args.vocab_size if args.vocab_size is not None else listed
    if vocab is None and args.tokenizer_name_or_path:
        from transformers import AutoTokenizer

        vocab = len(AutoTokenizer.from_pretrained(args.tokenizer_name_or_path,
                                                  use_fast=not args.tokenizer_not_use_fast))
    if vocab is None:
        raise DataError("cannot tell the vocabulary size: pass --padded-vocab-size, --vocab-size or "
                        "--tokenizer-name-or-path")
    args.vocab_size = int(vocab)
    args.padded_vocab_size = padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by,
                                               args.tensor_model_parallel_size)

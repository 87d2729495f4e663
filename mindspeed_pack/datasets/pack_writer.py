"""Assemble packs from tokenized samples and write them as Megatron indexed datasets.

Pack layout (the contract the training side reads, see ``mindspeed_pack.packing.segments``)
---------------------------------------------------------------------------------------
Three int32 indexed datasets, written with megatron-core's ``IndexedDatasetBuilder`` and read
with its ``IndexedDataset``::

    P_packed_input_ids_document       P_packed_labels_document       P_packed_attention_mask_document

One pack is one document of exactly ``seq_length`` tokens. Two samples ``a`` (prompt a0 a1,
answer a2 a3) and ``b`` (prompt b0, answer b1 b2), seq_length 10, ``--neat-pack``::

    position        0    1    2    3    4    5    6    7    8    9
    input_ids       a0   a1   a2   a3   b0   b1   b2   P    P    P     P = pad id (else EOS)
    labels          -    -    a2   a3   -    b1   b2   -    -    -     - = -100, labels ALIGNED
    attention_mask  1    1    1    1    2    2    2    0    0    0     segment ids, 0 = padding

* labels are not shifted: ``labels[i]`` is ``input_ids[i]`` where trained, else -100
  (prompt, padding). The FIRST token of every sample is always -100, so no label can cross a
  sample boundary even when the mask does not isolate samples. Process reward samples
  (``mindspeed_pack/data/process_reward.py``) are the one exception: at each step tag the label is
  the step's reward token (``+``/``-``), from the store's trained codes past 1 (:func:`label_values`).
* ``--neat-pack``: ``attention_mask`` holds segment ids 1..k in pack order, then 0 for padding.
* plain ``--pack``: ``attention_mask`` is all 1s. Samples are NOT isolated: a model that
  honours only causality attends across samples of a pack (MindSpeed-LLM's behaviour; use
  ``--neat-pack`` for exact packing). The three files stay as MindSpeed-LLM reads them; a fourth,
  ``P_packed_sample_lengths`` (int32, one document per pack: its samples' lengths in pack order,
  ``[4, 3]`` above), records where samples end, for ``--reset-attention-mask``,
  ``--reset-position-ids`` and ``--per-sample-loss`` (a chat template's EOS also ends system and
  user turns, so the EOS cannot tell). Its name is outside MindSpeed-LLM's ``P_packed_*_document``.
* preference pairs: ``P_packed_pair_margins`` (float32, one document per pack: its pairs' reward margins in
  pack order, 0 where a row gave none) for ``--stage orm``.
* KTO handlers (``mindspeed_pack/data/kto.py``): segments ``2k-1``/``2k`` are a sample and its KL partner, and
  ``P_packed_kto_labels`` (int32, one document per pack) holds each segment's label: 1 desirable, 0
  undesirable, -1 a KL partner (``[1, -1, 0, -1]`` for a pack of two couples).
* no ``--pack``: one sample per document, of its own length, attention_mask all 1s; the same
  three names, so unpacked training and packed-vs-unpacked comparisons read one format. Preference pairs
  and KTO couples stay units (:func:`write_units`): one document each, its two sequences segments 1 and 2,
  the margins and KTO labels files one document per unit (dynamic context parallelism plans them whole).
* ``--pad-to-multiple-of N`` (context parallelism): every sample is stored with pad tokens
  appended up to a multiple of N (:func:`pad_samples`, in :class:`TokenStore`), so packer,
  packs and unpacked documents all see the padded length. The pads are part of the sample:
  label -100 and, under ``--neat-pack``, the sample's own segment id. With N = 2 above, ``b``
  (3 tokens) takes 4: position 7 holds ``P`` with segment id 2; 8 and 9 stay pack padding (0).

Packs come from the C++ packer (:func:`mindspeed_pack.packing.binpack.pack_lengths`) run over
the lengths of the WHOLE dataset at once, samples in a pack in ascending input order. Packs are
written in a seeded pseudo-random, stratified order (:func:`pack_order`): the packer opens its
bins from the longest samples to the shortest, so in opening order Megatron's contiguous
``--split 98,2,0`` would hand validation the packer's tail (short samples, many per pack).
In this order any contiguous range of packs is a fair sample. Deterministic: the same input and
seed give byte-identical files.

Memory stays bounded: samples are streamed to an on-disk :class:`TokenStore` (token ids int32
+ trained mask uint8), packing needs only the lengths, and packs are assembled in batches from
the memory-mapped store.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np

from mindspeed_pack.data.errors import PreprocessError

IGNORE_INDEX = -100
PACKED_KEYS = ("input_ids", "attention_mask", "labels")


def packed_prefixes(output_prefix: str) -> dict[str, str]:
    """Output path prefix (no .bin/.idx) of each packed dataset."""
    return {key: f"{output_prefix}_packed_{key}_document" for key in PACKED_KEYS}


def sample_lengths_prefix(output_prefix: str) -> str:
    """Plain packs' sample boundaries (see the module docstring)."""
    return f"{output_prefix}_packed_sample_lengths"


def pair_margins_prefix(output_prefix: str) -> str:
    """Preference pairs' reward margins, one document per pack (see the module docstring)."""
    return f"{output_prefix}_packed_pair_margins"


def kto_labels_prefix(output_prefix: str) -> str:
    """KTO packs' per-segment labels (``mindspeed_pack/data/kto.py``): one document per pack."""
    return f"{output_prefix}_packed_kto_labels"


def text_prefix(output_prefix: str) -> str:
    return f"{output_prefix}_text_document"


def step_label_table(label_ids, first_code: int) -> np.ndarray:
    """Label id of each trained code: codes ``first_code + k`` -> ``label_ids[k]`` (codes 0 and 1 unused here)."""
    table = np.zeros(first_code + len(label_ids), dtype=np.int64)
    table[first_code:] = label_ids
    return table


def label_values(ids: np.ndarray, codes: np.ndarray, table=None) -> np.ndarray:
    """The stored label of trained tokens: the token itself (code 1), or ``table[code]`` for codes past 1."""
    if table is None:
        return ids
    return np.where(codes > 1, table[np.minimum(codes, len(table) - 1)], ids).astype(ids.dtype)


def pad_samples(input_ids: np.ndarray, trained: np.ndarray, lengths: np.ndarray, multiple: int,
                pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat samples with ``pad_id`` (untrained) appended to each, up to a multiple of ``multiple``.

    Pads go at the END of a sample: under causal attention no real token attends to them and
    they carry no label, so the sample trains exactly as unpadded, while context parallelism
    can split it into ``multiple`` equal chunks without padding anything at training time.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    padded = -(-lengths // multiple) * multiple
    if multiple == 1 or np.array_equal(padded, lengths):
        return input_ids, trained, lengths
    shift = (np.cumsum(padded) - padded) - (np.cumsum(lengths) - lengths)  # new start - old start
    dest = np.arange(int(lengths.sum())) + np.repeat(shift, lengths)
    ids = np.full(int(padded.sum()), pad_id, dtype=np.int32)
    mask = np.zeros(int(padded.sum()), dtype=np.uint8)
    ids[dest], mask[dest] = input_ids, trained
    return ids, mask, padded


class TokenStore:
    """Append-only on-disk store of samples: flat ids/trained files plus per-sample lengths.

    With ``pad_to_multiple_of`` > 1 every sample is stored padded (:func:`pad_samples`), so
    every reader (packer, pack and document writers) sees one length per sample;
    ``pad_tokens`` counts the pads added.
    """

    def __init__(self, directory: Path, pad_to_multiple_of: int = 1, pad_id: int = 0):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._ids = open(self.directory / "ids.int32", "wb")
        self._trained = open(self.directory / "trained.uint8", "wb")
        self._lengths: list[np.ndarray] = []
        self.pad_to_multiple_of, self.pad_id = pad_to_multiple_of, pad_id
        self.num_tokens = 0  # stored tokens, pads included
        self.pad_tokens = 0
        self._margins: list[np.ndarray] = []  # preference pairs: one margin per pair (samples 2i, 2i+1)

    def append(self, input_ids: np.ndarray, trained: np.ndarray, lengths: np.ndarray) -> None:
        if self.pad_to_multiple_of > 1:
            n = len(input_ids)
            input_ids, trained, lengths = pad_samples(input_ids, trained, lengths, self.pad_to_multiple_of, self.pad_id)
            self.pad_tokens += len(input_ids) - n
        self._ids.write(np.ascontiguousarray(input_ids, dtype=np.int32).tobytes())
        self._trained.write(np.ascontiguousarray(trained, dtype=np.uint8).tobytes())
        self._lengths.append(np.asarray(lengths, dtype=np.int32))
        self.num_tokens += int(len(input_ids))

    def append_pair_margins(self, margins: np.ndarray) -> None:
        self._margins.append(np.asarray(margins, dtype=np.float64))

    def close(self) -> "TokenStore":
        """Finish writing and map the tokens for reading."""
        self._ids.close()
        self._trained.close()
        self.pair_margins = np.concatenate(self._margins) if self._margins else np.zeros(0)
        self.lengths = np.concatenate(self._lengths).astype(np.int64) if self._lengths else np.zeros(0, np.int64)
        self._lengths = []
        self.offsets = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=self.offsets[1:])
        if self.num_tokens:
            self.ids = np.memmap(self.directory / "ids.int32", dtype=np.int32, mode="r")
            self.trained = np.memmap(self.directory / "trained.uint8", dtype=np.uint8, mode="r")
        else:
            self.ids, self.trained = np.zeros(0, np.int32), np.zeros(0, np.uint8)
        return self

    def __len__(self) -> int:
        return len(self.lengths)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        s, e = self.offsets[i], self.offsets[i + 1]
        return np.asarray(self.ids[s:e]), np.asarray(self.trained[s:e])


def indexed_dataset_module():
    """megatron-core's ``indexed_dataset``, imported without the warnings its package prints on a machine without
    Transformer Engine and Apex: they name training kernels, nothing that writing data uses."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def _builder(prefix: str, dtype=np.int32):
    return indexed_dataset_module().IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)


def _finalize(builders: dict, prefixes: dict) -> None:
    for key, builder in builders.items():
        builder.finalize(prefixes[key] + ".idx")


def assemble_packs(store: TokenStore, item_order: np.ndarray, bin_offsets: np.ndarray, bins: slice,
                   seq_length: int, pad_id: int, neat_pack: bool, labels_of=None) -> dict[str, np.ndarray]:
    """Rows ``bins`` of the pack arrays, ``{key: int32[num_bins, seq_length]}``, vectorised (``labels_of``: the
    label table of trained codes past 1, :func:`step_label_table`)."""
    b0, b1 = bins.start, bins.stop
    first, last = int(bin_offsets[b0]), int(bin_offsets[b1])
    items = item_order[first:last]
    lens = store.lengths[items]
    counts = np.diff(bin_offsets[b0:b1 + 1])
    bin_of_item = np.repeat(np.arange(b1 - b0), counts)
    first_item_of_bin = bin_offsets[b0:b1] - first
    exclusive = np.cumsum(lens) - lens
    pos_in_bin = exclusive - exclusive[first_item_of_bin][bin_of_item]
    rank_in_bin = np.arange(len(items)) - first_item_of_bin[bin_of_item] + 1
    if np.any(pos_in_bin + lens > seq_length):
        raise PreprocessError("internal error: a pack overflows seq_length (packer contract broken)")

    token_item = np.repeat(np.arange(len(items)), lens)
    within = np.arange(int(lens.sum())) - np.repeat(exclusive, lens)
    src = store.offsets[items][token_item] + within
    row = bin_of_item[token_item]
    col = pos_in_bin[token_item] + within

    ids = np.asarray(store.ids[src])
    codes = np.asarray(store.trained[src])
    trained = codes.astype(bool)
    shape = (b1 - b0, seq_length)
    out_ids = np.full(shape, pad_id, dtype=np.int32)
    out_ids[row, col] = ids
    labels = np.full(shape, IGNORE_INDEX, dtype=np.int32)
    labels[row[trained], col[trained]] = label_values(ids, codes, labels_of)[trained]
    if neat_pack:
        mask = np.zeros(shape, dtype=np.int32)
        mask[row, col] = rank_in_bin[token_item]
    else:
        mask = np.ones(shape, dtype=np.int32)
    return {"input_ids": out_ids, "labels": labels, "attention_mask": mask}


_GOLDEN = (5 ** 0.5 - 1) / 2


def pack_order(counts: np.ndarray, seed: int) -> np.ndarray:
    """A seeded order of packs in which every contiguous range is a fair, stratified sample.

    A plain shuffle is fair only on average: a 2% validation range of a few hundred packs
    can easily hold 15% longer samples. Here packs are ranked by their number of samples
    (ties broken at random), and position ``p`` takes the rank of ``frac(p * golden + u)``
    (``u`` random): that sequence is evenly spread over [0, 1) in every window (three-gap
    theorem), so any range of positions takes packs from all strata in proportion.
    """
    n = len(counts)
    rng = np.random.default_rng(seed)
    by_count = np.lexsort((rng.random(n), counts))
    spread = np.mod(np.arange(n, dtype=np.float64) * _GOLDEN + rng.random(), 1.0)
    rank_at_position = np.empty(n, dtype=np.int64)
    rank_at_position[np.argsort(spread, kind="stable")] = np.arange(n)
    return by_count[rank_at_position]


def shuffle_bins(item_order: np.ndarray, bin_offsets: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The same bins (CSR: items of bin b are ``item_order[bin_offsets[b]:bin_offsets[b+1]]``) in :func:`pack_order`."""
    counts = np.diff(bin_offsets)
    perm = pack_order(counts, seed)
    new_counts = counts[perm]
    new_offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(new_counts, out=new_offsets[1:])
    starts = np.repeat(bin_offsets[:-1][perm], new_counts)
    within = np.arange(new_offsets[-1]) - np.repeat(new_offsets[:-1], new_counts)
    return item_order[starts + within], new_offsets


def write_packed(store: TokenStore, plan, seq_length: int, pad_id: int, neat_pack: bool, prefixes: dict,
                 *, seed: int, batch_bins: int = 1024, progress=None, labels=None, sample_values=None) -> None:
    """Write every pack of ``plan`` (a ``PackPlan``), in the order :func:`shuffle_bins` draws from ``seed``;
    with a ``sample_lengths`` prefix (plain packs) also each pack's sample lengths, and for every
    ``sample_values`` {prefix key: one int per sample of ``store``} each pack's values of its samples, in
    pack order (KTO labels); with a ``pair_margins`` prefix each pack's pairs' margins; ``labels``: the label
    table of trained codes past 1 (process reward steps)."""
    per_pack = {"sample_lengths": store.lengths} if "sample_lengths" in prefixes else {}
    per_pack.update(sample_values or {})
    builders = {key: _builder(prefixes[key]) for key in (*PACKED_KEYS, *per_pack)}
    if "pair_margins" in prefixes:  # preference pairs: samples 2i and 2i+1 are pair i
        builders["pair_margins"] = _builder(prefixes["pair_margins"], dtype=np.float32)
    item_order, bin_offsets = shuffle_bins(np.asarray(plan.item_order, dtype=np.int64),
                                           np.asarray(plan.bin_offsets, dtype=np.int64), seed)
    for b0 in range(0, plan.num_bins, batch_bins):
        b1 = min(plan.num_bins, b0 + batch_bins)
        rows = assemble_packs(store, item_order, bin_offsets, slice(b0, b1), seq_length, pad_id, neat_pack, labels)
        for key in PACKED_KEYS:
            builder, arr = builders[key], rows[key]
            for r in range(arr.shape[0]):
                builder.add_document(arr[r], [seq_length])
        for key, values in per_pack.items():
            for b in range(b0, b1):
                mine = np.asarray(values)[item_order[bin_offsets[b]:bin_offsets[b + 1]]].astype(np.int32)
                builders[key].add_document(mine, [len(mine)])
        if "pair_margins" in builders:
            for b in range(b0, b1):
                pairs = item_order[bin_offsets[b]:bin_offsets[b + 1]:2] // 2
                builders["pair_margins"].add_document(store.pair_margins[pairs].astype(np.float32), [len(pairs)])
        if progress is not None:
            progress.update(b1 - b0)
    _finalize(builders, prefixes)


def write_unpacked(store: TokenStore, prefixes: dict, *, progress=None, labels=None) -> None:
    """One sample per document, in input order, same three datasets as packs (``labels``: as :func:`write_packed`'s)."""
    table = labels
    builders = {key: _builder(prefixes[key]) for key in PACKED_KEYS}
    for i in range(len(store)):
        ids, trained = store.sample(i)
        labels = np.where(trained.astype(bool), label_values(ids, trained, table), IGNORE_INDEX).astype(np.int32)
        n = len(ids)
        builders["input_ids"].add_document(ids, [n])
        builders["labels"].add_document(labels, [n])
        builders["attention_mask"].add_document(np.ones(n, dtype=np.int32), [n])
        if progress is not None:
            progress.update(1)
    _finalize(builders, prefixes)


def write_units(store: TokenStore, prefixes: dict, *, progress=None, kto_labels=None) -> None:
    """Preference pairs or KTO couples without ``--pack``: samples ``2i`` and ``2i+1`` of the store as one document
    (segment ids 1 and 2 in its attention mask), in input order; with the ``pair_margins`` prefix each pair's
    margin, with ``kto_labels`` (one per stored sample) each couple's ``[label, -1]``, one document per unit."""
    builders = {key: _builder(prefixes[key]) for key in PACKED_KEYS}
    if "pair_margins" in prefixes:
        builders["pair_margins"] = _builder(prefixes["pair_margins"], dtype=np.float32)
    if kto_labels is not None:
        builders["kto_labels"] = _builder(prefixes["kto_labels"])
    for unit in range(len(store) // 2):
        parts = [store.sample(2 * unit), store.sample(2 * unit + 1)]
        ids = np.concatenate([i for i, _ in parts])
        trained = np.concatenate([t for _, t in parts]).astype(bool)
        n = len(ids)
        builders["input_ids"].add_document(ids, [n])
        builders["labels"].add_document(np.where(trained, ids, IGNORE_INDEX).astype(np.int32), [n])
        builders["attention_mask"].add_document(np.repeat(np.array([1, 2], np.int32), [len(i) for i, _ in parts]),
                                                [n])
        if "pair_margins" in builders:
            builders["pair_margins"].add_document(store.pair_margins[unit:unit + 1].astype(np.float32), [1])
        if kto_labels is not None:
            builders["kto_labels"].add_document(np.asarray(kto_labels[2 * unit:2 * unit + 2], np.int32), [2])
        if progress is not None:
            progress.update(1)
    _finalize(builders, prefixes)


def write_text_documents(store: TokenStore, prefix: str, vocab_size: int, *, progress=None) -> None:
    """Pretraining output: one document per row, in the smallest dtype that holds the vocab."""
    builder = _builder(prefix, dtype=indexed_dataset_module().DType.optimal_dtype(vocab_size))
    for i in range(len(store)):
        ids, _ = store.sample(i)
        builder.add_document(ids, [len(ids)])
        if progress is not None:
            progress.update(1)
    builder.finalize(prefix + ".idx")


def output_files(prefixes) -> list[str]:
    prefixes = prefixes.values() if isinstance(prefixes, dict) else [prefixes]
    return [p + ext for p in prefixes for ext in (".bin", ".idx")]


def content_fingerprint(prefixes: dict) -> str:
    """sha256 of the written datasets' bytes (.bin and .idx, in key order): names exactly these packs."""
    import hashlib

    h = hashlib.sha256()
    for path in output_files({k: prefixes[k] for k in sorted(prefixes)}):
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def remove_quietly(paths) -> None:
    for p in paths:
        try:
            os.remove(p)
        except FileNotFoundError:
            pass

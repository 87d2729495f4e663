"""pretrain_gpt.py's data: plain documents through megatron-core's ``GPTDataset``.

``P_text_document.{bin,idx}`` holds one document per row (int32 tokens, each ending with
EOD). megatron-core's ``BlendedMegatronDatasetBuilder`` splits (``--split``), blends
(``--data-path 0.3 A 0.7 B``), shuffles and cuts the token stream into samples of
``seq_length + 1`` tokens; those indices are identical to Megatron-LM's, and cached under a key that
holds the documents' content (documents written again at the same prefix build their own).
``--train-data-path``/``--valid-data-path``/``--test-data-path`` give each split its own
prefix or blend, used whole (megatron-core's ``blend_per_split``; ``--split`` is not used).

Each sample becomes one row of the trainer's micro-batch contract, labels *aligned*::

    sample (s+1)    a0  a1  E   b0  b1  b2  E   c0  c1  | c2       (E = EOD; the extra
    input_ids       a0  a1  E   b0  b1  b2  E   c0  c1             token is not used)
    labels          a0  a1  E   b0  b1  b2  E   c0  c1
    segment_ids     1   1   1   2   2   2   2   3   3              (--reset-attention-mask)
    loss_mask       1   1   0   1   1   1   0   1   1              (--eod-mask-loss)

The trainer shifts labels within segments, so with isolation ``E`` (a document's last
token) never predicts the next document's first token, and positions and attention
restart per document through ``cu_seqlens``: never a dense s x s mask. Without
``--reset-attention-mask`` a row is one causal sequence (segment_ids None).
``--eod-mask-loss`` is Megatron's: the loss at positions whose *input* is EOD (the
prediction made from EOD, i.e. of the next document's start) is dropped; predicting EOD
itself stays trained, so the model still learns to stop. The row's last position has no
target (its target would be the extra token): a row trains at most s-1 targets, where
Megatron-LM trains s.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Iterator, List, Optional

import torch

from mindspeed_pack.datasets.packed_dataset import DataError
from mindspeed_pack.packing.segments import IGNORE_INDEX, segment_ids_from_eod

log = logging.getLogger(__name__)


@dataclass
class EodTokenizer:
    """The part of a tokenizer GPTDataset uses: the EOD id, the vocabulary size and an identity.

    No ``pad``: GPTDataset then pads short samples with -1, which cannot be a real token.
    """

    eod: int
    vocab_size: Optional[int]
    name: str = "eod-only"
    unique_identifiers: dict = field(init=False)

    def __post_init__(self):
        # part of GPTDataset's cache key: a cache is never reused with another EOD or vocabulary
        self.unique_identifiers = {"class": type(self).__name__, "name": self.name, "eod": self.eod,
                                   "vocab_size": self.vocab_size}


def sidecar_info(prefix: str) -> dict:
    """What preprocess_data.py recorded for ``P_text_document`` in ``P_text_meta.json``:
    ``eod_id``, ``append_eod`` and the tokenizer's ``vocab_size`` (those present)."""
    base = prefix[: -len("_document")] if prefix.endswith("_text_document") else prefix
    for path in (f"{base}_meta.json", f"{prefix}_meta.json"):
        if os.path.isfile(path):
            with open(path) as f:
                meta = json.load(f)
            tok = meta.get("tokenizer") or (meta.get("cache_key") or {}).get("tokenizer") or {}
            layout = meta.get("layout") or {}
            info = {"eod_id": layout.get("eod_id", tok.get("eos_id")), "vocab_size": tok.get("vocab_size"),
                    "append_eod": layout.get("append_eod"), "path": path}
            return {k: v for k, v in info.items() if v is not None}
    return {}


def _from_sidecars(args, key: str) -> Optional[int]:
    """``key`` of the sidecars of every prefix the run reads; the prefixes must agree on it."""
    values = {}
    for prefix in all_prefixes(args):
        value = sidecar_info(prefix).get(key)
        if value is not None:
            values[prefix] = int(value)
    if len(set(values.values())) > 1:
        raise DataError(f"{data_flags(args)}: the datasets were tokenized differently ({key}: {values})")
    return next(iter(values.values()), None)


def _check_documents_end_with_eod(args) -> None:
    if not (args.isolate_segments or args.eod_mask_loss):
        return
    for prefix in all_prefixes(args):
        info = sidecar_info(prefix)
        if info.get("append_eod") is False:
            raise DataError(f"{prefix}: written without --append-eod ({info['path']}), so documents carry no EOD "
                            "for --reset-attention-mask/--eod-mask-loss to find; re-run preprocess_data.py "
                            "with --append-eod")


def build_tokenizer(args) -> EodTokenizer:
    """EOD id from ``--eod-id``, else the preprocessing sidecar's EOS, else ``--tokenizer-name-or-path``'s EOS
    (MindSpeed's convention: documents end with the tokenizer's EOS)."""
    eod = getattr(args, "eod_id", None)
    _check_documents_end_with_eod(args)
    recorded = _from_sidecars(args, "eod_id")
    if eod is not None and recorded is not None and eod != recorded:
        raise DataError(f"--eod-id {eod}, but preprocessing ended the documents with {recorded} (its "
                        "_text_meta.json): drop --eod-id or pass the recorded id")
    source = "--eod-id" if eod is not None else "the end-of-document id preprocessing recorded (_text_meta.json)"
    eod = recorded if eod is None else eod
    vocab = args.vocab_size or _from_sidecars(args, "vocab_size")
    name = "eod-only"
    if args.tokenizer_name_or_path:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer_name_or_path, use_fast=not args.tokenizer_not_use_fast)
        name = os.path.basename(os.path.normpath(args.tokenizer_name_or_path))
        vocab = vocab or len(tok)
        if eod is None:
            eod = tok.eos_token_id
            source = f"the EOS of --tokenizer-name-or-path {args.tokenizer_name_or_path}"
            if eod is None:
                raise DataError(f"--tokenizer-name-or-path {args.tokenizer_name_or_path}: the tokenizer has no "
                                "EOS token to end documents with; pass --eod-id")
    if eod is None:
        raise DataError("pretraining needs the end-of-document id: pass --eod-id or --tokenizer-name-or-path")
    if args.padded_vocab_size is not None and not 0 <= eod < args.padded_vocab_size:
        raise DataError(f"{source}, {eod}, is outside the vocabulary [0, {args.padded_vocab_size}) of "
                        "--padded-vocab-size: the data was tokenized with a larger vocabulary")
    return EodTokenizer(eod=int(eod), vocab_size=vocab, name=name)


def resolve_pretrain_vocab_size(args) -> None:
    """``--padded-vocab-size`` from the flags, the preprocessing sidecars or the tokenizer."""
    from mindspeed_pack.datasets.packed_dataset import resolve_vocab_size

    if args.padded_vocab_size is None and args.vocab_size is None:
        args.vocab_size = _from_sidecars(args, "vocab_size")
        if args.vocab_size is None and not args.tokenizer_name_or_path:
            # a prefix that is not there has no sidecar either: name its missing files, not the vocabulary
            check_prefix_files(all_prefixes(args))
    resolve_vocab_size(args)


SPLITS = ("train", "valid", "test")


def blend_from_list(paths: List[str], flag: str = "--data-path") -> tuple:
    """(prefixes, weights or None) of ``flag``'s value (``P`` or ``w1 P1 w2 P2 ...``), as megatron-core reads it."""
    from megatron.core.datasets.utils import get_blend_from_list

    from mindspeed_pack.datasets.packed_documents import is_blend_weight

    try:
        blend = get_blend_from_list(paths)
    except AssertionError:
        blend = None
    # megatron-core reads an odd-length '0.5 A B' as three prefixes, the first named 0.5
    if blend is None or (blend[1] is None and any(is_blend_weight(p) for p in blend[0])):
        raise DataError(f"{flag} {' '.join(paths)}: give prefixes, or weight-prefix pairs "
                        "'0.3 A 0.7 B' (all weighted or none)")
    for i, (prefix, weight) in enumerate(zip(blend[0], blend[1] or ())):
        if not weight > 0:  # megatron-core's BlendedDataset asserts it, bare, after the model is built
            raise DataError(f"{flag} {' '.join(paths)}: the weight of {prefix} is {paths[2 * i]}: blend weights "
                            "must be > 0 (leave a prefix out to read none of it)")
    return blend


def split_blends(args) -> Optional[list]:
    """Megatron-LM's ``blend_per_split`` (``get_blend_and_blend_per_split``): a blend, or None, for each of
    ``--train/--valid/--test-data-path``; None when the run reads ``--data-path`` (divided by ``--split``)."""
    paths = [getattr(args, f"{name}_data_path", None) for name in SPLITS]
    if not any(paths):
        return None
    return [blend_from_list(p, f"--{name}-data-path") if p else None for name, p in zip(SPLITS, paths)]


def all_prefixes(args) -> List[str]:
    """Every prefix the run reads, each once (a blend's weights skipped)."""
    from mindspeed_pack.datasets.packed_documents import data_prefixes

    split_blends(args)  # a malformed blend is refused, naming its flag
    if args.data_path:
        blend_from_list(args.data_path)
    return data_prefixes(args)


def data_flags(args) -> str:
    """The flags that name the run's data, as given (for messages)."""
    given = [(f"--{dest.replace('_', '-')}", getattr(args, dest, None))
             for dest in ("data_path", *(f"{name}_data_path" for name in SPLITS))]
    return "; ".join(f"{flag} {' '.join(v)}" for flag, v in given if v)


_JSON_KEY_PREFIX = re.compile(r"^(?P<base>.+)_(?P<key>[^_/]+)_document$")
_PACK_PART = re.compile(r"^(?P<base>.+)_packed_(?:input_ids|attention_mask|labels)_document$")


def _fine_tuning_pack(prefix: str) -> Optional[str]:
    """The base of a fine-tuning pack (``BASE_packed_*_document`` beside its labels or sidecar), else None."""
    match = _PACK_PART.match(prefix)
    if match is None:
        return None
    base = match.group("base")
    siblings = (f"{base}_packed_meta.json", f"{base}_packed_labels_document.idx")
    return base if any(os.path.isfile(p) for p in siblings) else None


def check_prefix_files(prefixes: List[str]) -> None:
    for prefix in prefixes:
        base = _fine_tuning_pack(prefix)
        if base is not None:  # GPTDataset would read one part of it: prompts trained, pairs run together
            raise DataError(f"data prefix {prefix!r} is one part of the fine-tuning dataset {base!r} (written with "
                            "--handler-name/--pack): pretraining reads plain documents (preprocess_data.py without "
                            f"a handler: {base}_text_document); train this one with posttrain.py --data-path {base}")
        missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        if missing:
            hint = "" if prefix.endswith("_document") else " (prefixes usually end with _text_document)"
            keyed = _JSON_KEY_PREFIX.match(prefix)
            if keyed and os.path.isfile(f"{keyed.group('base')}_text_document.idx"):
                hint = (f"; {keyed.group('base')}_text_document is there: preprocess_data.py names the documents "
                        f"_text_document whatever --json-keys reads (Megatron-LM's preprocessing names them after "
                        f"the key, _{keyed.group('key')}_document): pass that prefix")
            raise DataError(f"data prefix {prefix!r}: missing {', '.join(missing)}{hint}")


@functools.lru_cache(maxsize=None)  # one class for every build (megatron-core imported only when data is built)
def _documents_dataset_classes():
    """megatron-core's ``GPTDataset`` and its config, with the documents' content in the cache key.

    megatron-core names its cached sample indices (``--data-cache-path``, else ``P_text_document/cache/``) by a
    hash of the prefix's *path* and the config: preprocess_data.py run again into the same ``--output-prefix``
    (a corrected or larger corpus) had its new documents read through the old indices, a sample cut at the old
    documents' lengths (an IndexError in the first step, or, with as many documents or more, training on the old
    ones' spans without a word). ``data_identity`` ({absolute prefix: content identity: the ``.idx``'s sha256, the
    ``.bin``'s size, the sidecar's record}) joins the key, so other documents build their own indices."""
    from dataclasses import dataclass, field

    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    @dataclass
    class DocumentsConfig(GPTDatasetConfig):
        data_identity: dict = field(default_factory=dict)

    class DocumentsDataset(GPTDataset):
        @staticmethod
        def _key_config_attributes() -> List[str]:
            return [*GPTDataset._key_config_attributes(), "data_identity"]

    return DocumentsDataset, DocumentsConfig


def build_gpt_datasets(args, num_samples: dict, tokenizer: EodTokenizer) -> dict:
    """{'train'|'valid'|'test': GPTDataset/BlendedDataset or None}, built on every rank: ``--data-path`` divided by
    ``--split``, or each split's own ``--train/--valid/--test-data-path`` blend (megatron-core's
    ``blend_per_split``, as Megatron-LM passes it)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    from mindspeed_pack.datasets.packed_documents import content_identity
    from mindspeed_pack.datasets.validation import validate_text_documents

    per_split = split_blends(args)
    blend = blend_from_list(args.data_path) if per_split is None else None
    prefixes = all_prefixes(args)
    check_prefix_files(prefixes)
    validate_text_documents(prefixes, args.padded_vocab_size)  # before the first step, not in it
    sizes = [num_samples.get(name, 0) for name in SPLITS]
    if per_split is not None:
        per_split = [b if n else None for b, n in zip(per_split, sizes)]  # a split not read is not built
        _refuse_empty_prefixes(per_split)
        if not any(per_split):  # megatron-core would build mock data from no blend at all
            return dict.fromkeys(SPLITS)
    dataset_class, config_class = _documents_dataset_classes()
    config = config_class(
        data_identity={os.path.abspath(p): content_identity(p) for p in prefixes},
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=per_split,
        split=args.split if per_split is None else None,  # each split is its prefixes whole
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        # masks and positions are derived per batch from segment ids (below), not by GPTDataset
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    if per_split is None:
        _drop_or_refuse_empty_splits(config, blend, sizes)
    datasets = BlendedMegatronDatasetBuilder(dataset_class, sizes, lambda: True, config).build()
    for name, ds, n in zip(SPLITS, datasets, sizes):
        if n and ds is not None and len(ds) < n:  # else the run stops when it reaches the end, unsaved
            where = (f"--data-path {' '.join(args.data_path)}: the {name} split" if per_split is None else
                     f"--{name}-data-path {' '.join(getattr(args, f'{name}_data_path'))}")
            raise DataError(f"{where} holds {len(ds)} samples of --seq-length {args.seq_length}, and this run reads "
                            f"{n}: megatron-core blends prefixes given without weights over one epoch only; give each "
                            "a weight ('W1 P1 W2 P2 ...', e.g. their token counts) to draw more epochs, or read fewer "
                            "samples (--train-iters, --eval-iters)")
    return {name: (ds if n else None) for name, ds, n in zip(SPLITS, datasets, sizes)}


def _refuse_empty_prefixes(per_split: list) -> None:
    """A read split's prefix that holds no document (megatron-core's GPTDataset would count epochs of 0 tokens
    forever); an unweighted blend of several prefixes is one epoch of each: no loop."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for name, blend in zip(SPLITS, per_split):
        if blend is None or (blend[1] is None and len(blend[0]) > 1):
            continue
        for prefix in blend[0]:
            if len(IndexedDataset(prefix, mmap=True)) == 0:
                raise DataError(f"--{name}-data-path: {prefix} holds no document, and {name} samples are read "
                                "from it; give that split data")


def _drop_or_refuse_empty_splits(config, blend: tuple, sizes: List[int]) -> None:
    """A split that holds no document of a prefix (``--split 949,50,1`` on fewer than 500 documents leaves the
    test split empty) would make megatron-core's GPTDataset loop forever counting epochs of 0 tokens: the test
    split (read once, at the end) is then skipped with a warning, a training or validation split that is read is
    refused with the counts."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefixes, weights = blend
    if weights is None and len(prefixes) > 1:
        return  # an unweighted blend builds one epoch of each prefix: no loop
    counts = {prefix: len(IndexedDataset(prefix, mmap=True)) for prefix in prefixes}
    for i, (name, bookends) in enumerate(zip(("train", "valid", "test"), config.split_matrix)):
        if bookends is None:
            continue
        empty = [p for p, n in counts.items() if int(round(bookends[1] * n)) == int(round(bookends[0] * n))]
        if not empty:
            continue
        if not sizes[i] or name == "test":
            if sizes[i]:  # read once, at the end: a tiny share of a small corpus rounds to no document
                log.warning("--split %s: the test split holds no document of %s: no test evaluation at the end",
                            config.split, ", ".join(f"{p} ({counts[p]} documents)" for p in empty))
            config.split_matrix[i] = None  # nothing is read from it
            continue
        raise DataError(f"--split {config.split}: the {name} split holds no document of "
                        + ", ".join(f"{p} ({counts[p]} documents)" for p in empty)
                        + f", but {sizes[i]} {name} samples are needed; give that split a larger share")


def row_from_sample(sample: dict, eod: int, isolate: bool, eod_mask_loss: bool,
                    reset_positions: bool = False) -> dict:
    """One GPTDataset sample (built with all mask flags off) -> one aligned row of the contract; positions restart
    after each EOD with ``reset_positions`` even where the documents are not isolated (Megatron-LM's
    ``--reset-position-ids`` alone)."""
    tokens = sample["tokens"].long()  # text[:s], padding already replaced by 0
    s = tokens.numel()
    # GPTDataset zeroes loss_mask where the shifted label is padding; padding is a suffix
    pad_label = sample["loss_mask"] == 0
    real = s if not bool(pad_label.any()) else int(torch.nonzero(pad_label)[0]) + 1
    labels = tokens.clone()
    labels[real:] = IGNORE_INDEX
    row = {"input_ids": tokens, "labels": labels}
    if isolate:
        seg = segment_ids_from_eod(tokens, eod)
        seg[real:] = 0
        row["segment_ids"] = seg
    elif reset_positions:
        row["position_groups"] = segment_ids_from_eod(tokens, eod)
    if eod_mask_loss:
        row["loss_mask"] = (tokens != eod).float()
    return row


def collate_rows(rows: List[dict]) -> dict:
    batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    batch.setdefault("segment_ids", None)
    return batch


class GPTBatchSource:
    """Micro-batches of GPTDataset samples in Megatron's sampler order (resumable by position)."""

    def setup(self, args, num_samples: dict) -> None:
        from megatron.core import parallel_state as ps

        if args.sequence_packing_scheduler == "default_dynamic_cp":
            raise DataError("--sequence-packing-scheduler default_dynamic_cp packs instruction samples at load time "
                            "(posttrain.py); pretrain_gpt.py reads documents in rows of --seq-length")
        self.args = args
        self.tokenizer = build_tokenizer(args)
        self.splits = build_gpt_datasets(args, num_samples, self.tokenizer)
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()

    def has_split(self, split: str) -> bool:
        return self.splits.get(split) is not None

    def micro_batches(self, split: str, consumed_samples: int) -> Iterator[dict]:
        dataset = self.splits.get(split)
        if dataset is None:
            where = f"--{split}-data-path" if split_blends(self.args) else f"--split {self.args.split}"
            raise DataError(f"the {split} split is empty: check {where}")
        args = self.args
        mbs = args.micro_batch_size
        pos = consumed_samples
        while pos + mbs * self.dp_size <= len(dataset):
            first = pos + self.dp_rank * mbs
            rows = [row_from_sample(dataset[i], self.tokenizer.eod, args.isolate_segments, args.eod_mask_loss,
                                    args.reset_position_ids) for i in range(first, first + mbs)]
            batch = collate_rows(rows)
            top = int(batch["input_ids"].max())
            if top >= args.padded_vocab_size:
                raise DataError(f"{split} sample {first}: token id {top} >= padded vocabulary size "
                                f"{args.padded_vocab_size}; the data was tokenized with a larger vocabulary")
            yield batch
            pos += mbs * self.dp_size

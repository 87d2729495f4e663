"""The tokenizer a checkpoint's embedding rows belong to: written with every conversion and training save,
compared at every load, so no model is trained, or used as a DPO reference, on ids that mean other tokens to it.

A record is the vocabulary (id -> token), not the tokenizer's files: the same tokenizer saved by another
transformers version, or re-saved beside preprocessed data, has other files but the same ids. The base
vocabulary is kept as a digest, the added tokens (chat markers, the tokens preprocessing adds for a
template: a few) by id::

    {"source": "QWEN_DIR", "base_size": 151643, "base_sha256": "3f9c...", "added": {"151643": "<|endoftext|>", ...}}

Two records agree when their base vocabularies are equal and no id is a different added token in each:
the tokenizer that preprocessing extended with a template's markers agrees with the one it extends.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Optional

from mindspeed_pack.convert.hf_io import TOKENIZER_FILES

log = logging.getLogger(__name__)


def has_tokenizer(path: Optional[str]) -> bool:
    return bool(path) and os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


def _digest(pairs) -> str:
    return hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode("utf-8")).hexdigest()


def record_of(tokenizer, source: str) -> dict:
    """The record of a loaded transformers tokenizer (``len(tokenizer)`` ids: base vocabulary and added tokens)."""
    vocab = sorted((i, t) for t, i in tokenizer.get_vocab().items())
    base_size = int(tokenizer.vocab_size)
    # a directory as an absolute path: a conversion or run started elsewhere finds the files to copy
    # (recorded_directory); a hub name stays a name
    source = os.path.abspath(str(source)) if os.path.isdir(str(source)) else str(source)
    return {"source": source, "base_size": base_size,
            "base_sha256": _digest([[i, t] for i, t in vocab if i < base_size]),
            "added": {str(i): t for i, t in vocab if i >= base_size}}


def read_tokenizer_record(path: Optional[str]) -> Optional[dict]:
    """The record of the tokenizer in directory ``path``; None when it holds none (or none that loads: warned)."""
    if not has_tokenizer(path):
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises many kinds
        log.warning("%s: the tokenizer does not load (%s: %s), so checkpoints cannot record it", path,
                    type(e).__name__, e)
        return None
    return record_of(tokenizer, path)


def recorded_directory(record: Optional[dict]) -> Optional[str]:
    """The directory ``record`` was read from, when it still holds a tokenizer with the same vocabulary (a run
    resumed from a checkpoint, or a conversion, finds the tokenizer files to copy there), else None."""
    path = (record or {}).get("source")
    found = read_tokenizer_record(path) if has_tokenizer(path) else None
    return path if found is not None and disagreement(record, found) is None else None


def describe(record: dict) -> str:
    return (f"{record['source']}: {record['base_size']} base tokens, sha256 {record['base_sha256'][:12]}, "
            f"{len(record['added'])} added")


def disagreement(checkpoint: dict, run: dict) -> Optional[str]:
    """None when the two records give every id they both have the same token, else the first difference."""
    if (checkpoint["base_size"], checkpoint["base_sha256"]) != (run["base_size"], run["base_sha256"]):
        return "the base vocabularies differ"
    for i in sorted(set(checkpoint["added"]) & set(run["added"]), key=int):
        if checkpoint["added"][i] != run["added"][i]:
            return f"id {i} is {checkpoint['added'][i]!r} in the checkpoint's and {run['added'][i]!r} in this run's"
    return None

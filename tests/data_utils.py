"""Small deterministic training datasets in Megatron's indexed format, for tests.

* :func:`write_packed_instruction_dataset`: ``P_packed_{input_ids,attention_mask,labels}_document``
  as ``preprocess_data.py --pack --neat-pack`` writes them (segment ids 1..k, labels -100 on
  the prompt half and on padding). The answer half repeats the prompt half, so a tiny model
  learns and losses move.
* :func:`write_pretrain_documents`: ``P_text_document`` (int32, one document per row, each
  ending with EOD), as the pretraining handler writes it; :func:`random_documents` makes them.
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence

import numpy as np

IGNORE_INDEX = -100


def _builder(path_bin: str):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    os.makedirs(os.path.dirname(os.path.abspath(path_bin)), exist_ok=True)
    return IndexedDatasetBuilder(path_bin, dtype=np.int32)


def write_packed_instruction_dataset(prefix: str, num_packs: int = 64, seq_length: int = 128, seed: int = 0,
                                     vocab: int = 200, neat_pack: bool = True, meta: bool = False,
                                     eos_id: Optional[int] = None, pad_id: int = 0,
                                     prompt_type: Optional[str] = None) -> str:
    """Write ``num_packs`` packs of samples 8..39 tokens long; returns ``prefix``.

    ``neat_pack=False`` writes an all-ones attention mask (plain ``--pack``); ``meta`` adds the
    sidecar's ``layout`` entry so training can check the flags against the data. ``eos_id``:
    every sample ends with that (trained) token and each pack keeps at least one ``pad_id``,
    as preprocess_data.py writes them; the sidecar then records both ids and ``prompt_type``.
    """
    meta = meta or eos_id is not None
    room = seq_length - (1 if eos_id is not None else 0)
    rng = np.random.default_rng(seed)
    keys = ("input_ids", "attention_mask", "labels")
    builders = {k: _builder(f"{prefix}_packed_{k}_document.bin") for k in keys}
    for _ in range(num_packs):
        ids = np.full(seq_length, pad_id, np.int32)
        labels = np.full(seq_length, IGNORE_INDEX, np.int32)
        seg = np.zeros(seq_length, np.int32)
        pos, k = 0, 0
        while True:
            n = int(rng.integers(8, 40))
            if pos + n > room:
                break
            x = rng.integers(3, vocab, n)
            if eos_id is None:
                x[n // 2:] = x[: n - n // 2]  # the answer copies the prompt
            else:
                x[n // 2:-1] = x[: n - 1 - n // 2]
                x[-1] = eos_id
            k += 1
            ids[pos:pos + n], seg[pos:pos + n] = x, k
            labels[pos + n // 2:pos + n] = x[n // 2:]
            pos += n
        mask = seg if neat_pack else np.ones(seq_length, np.int32)
        for key, arr in zip(keys, (ids, mask, labels)):
            builders[key].add_document(arr, [seq_length])
    for key, b in builders.items():
        b.finalize(f"{prefix}_packed_{key}_document.idx")
    if meta:
        import json

        sidecar = {"layout": {"kind": "packed", "neat_pack": neat_pack, "seq_length": seq_length}}
        if eos_id is not None:
            sidecar["layout"].update(eos_id=eos_id, pad_id=pad_id)
            sidecar["cache_key"] = {"arguments": {"prompt_type": prompt_type}}
        with open(f"{prefix}_packed_meta.json", "w") as f:
            json.dump(sidecar, f)
    return prefix


def random_documents(num_docs: int, eod_id: int, seed: int = 0, min_len: int = 5, max_len: int = 60,
                     vocab: int = 200) -> List[np.ndarray]:
    """Documents of random tokens in [3, vocab) (never ``eod_id``), each ending with ``eod_id``."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(num_docs):
        n = int(rng.integers(min_len, max_len + 1))
        body = rng.integers(3, vocab, n - 1)
        body[body == eod_id] = 3 if eod_id != 3 else 4
        docs.append(np.append(body, eod_id).astype(np.int32))
    return docs


def write_pretrain_documents(prefix: str, documents: Sequence[np.ndarray]) -> str:
    """Write ``prefix.{bin,idx}`` (pass ``P_text_document``), one document per row."""
    b = _builder(f"{prefix}.bin")
    for doc in documents:
        b.add_document(np.asarray(doc, np.int32), [len(doc)])
    b.finalize(f"{prefix}.idx")
    return prefix


def read_metrics(path: str, split: str = "train") -> dict:
    """{iteration: record} of one split from a ``--metrics-file`` (JSON lines; the last record wins)."""
    import json

    out = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("split") == split:
                out[rec["iteration"]] = rec
    return out


def rel_err(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def fingerprint(root: str) -> dict:
    """SHA-1 of every file below ``root`` (relative path -> digest): proves a run wrote nothing."""
    import hashlib

    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha1(f.read()).hexdigest()
    return out

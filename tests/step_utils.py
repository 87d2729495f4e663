"""Packed process reward samples for the PRM tests, written as preprocess_data.py writes them.

A sample = a question and steps, each step's text followed by the step tag; the stored label at a tag is
the step's reward token (``+`` or ``-``), unshifted, -100 elsewhere. Tokens are random ids of the tiny
models' vocabulary (ids ``4..249``; the tag and the reward tokens below), so no tokenizer is needed.
"""
from __future__ import annotations

import json

import numpy as np

from mindspeed_pack.datasets.pack_writer import content_fingerprint, packed_prefixes
from tests.data_utils import IGNORE_INDEX, _builder

TAG, PLUS, MINUS = 3, 1, 2  # the step tag and the reward tokens (right, wrong): ids no random token takes
STEP_TAGS = {"placeholder_token": "<tag>", "placeholder_id": TAG, "reward_tokens": ["+", "-"],
             "reward_token_ids": [PLUS, MINUS]}


def random_step_samples(n: int, seed: int = 0, vocab: int = 250, question=(3, 10), steps=(1, 5), step=(2, 8),
                        rule: bool = False):
    """[(ids, labels)] of ``n`` samples (labels aligned: the reward token at each tag). ``rule``: a step is
    right exactly when its text holds id 4 (a tiny model can learn it); else labels are random."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = list(rng.integers(5, vocab, int(rng.integers(*question))))
        labels = [IGNORE_INDEX] * len(ids)
        for _ in range(int(rng.integers(*steps))):
            text = list(rng.integers(5, vocab, int(rng.integers(*step))))
            right = bool(rng.integers(2))
            if rule and right:
                text[int(rng.integers(len(text)))] = 4
            ids += text + [TAG]
            labels += [IGNORE_INDEX] * len(text) + [PLUS if right else MINUS]
        out.append((np.asarray(ids, np.int64), np.asarray(labels, np.int64)))
    return out


def pack_step_rows(samples, groups, seq_length):
    """Rows (ids, labels, segment ids) [len(groups), seq_length]: pack g holds samples ``groups[g]``."""
    ids = np.zeros((len(groups), seq_length), np.int64)
    labels = np.full((len(groups), seq_length), IGNORE_INDEX, np.int64)
    seg = np.zeros((len(groups), seq_length), np.int64)
    for row, group in enumerate(groups):
        pos = 0
        for k, j in enumerate(group, start=1):
            i, lab = samples[j]
            assert pos + len(i) <= seq_length, "samples do not fit the pack"
            ids[row, pos:pos + len(i)], labels[row, pos:pos + len(i)], seg[row, pos:pos + len(i)] = i, lab, k
            pos += len(i)
    return ids, labels, seg


def greedy_step_groups(samples, seq_length):
    groups, room = [], 0
    for j, (i, _) in enumerate(samples):
        if not groups or len(i) > room:
            groups.append([])
            room = seq_length
        groups[-1].append(j)
        room -= len(i)
    return groups


def write_step_dataset(prefix: str, samples, seq_length: int = 128, groups=None):
    """Packs of process reward ``samples`` (``groups``: sample indices per pack, default greedy) with their sidecar."""
    groups = groups or greedy_step_groups(samples, seq_length)
    ids, labels, seg = pack_step_rows(samples, groups, seq_length)
    prefixes = packed_prefixes(prefix)
    arrays = {"input_ids": ids, "labels": labels, "attention_mask": seg}
    for key, path in prefixes.items():
        b = _builder(path + ".bin")
        for row in arrays[key]:
            b.add_document(row.astype(np.int32), [seq_length])
        b.finalize(path + ".idx")
    meta = {"layout": {"kind": "packed", "seq_length": seq_length, "neat_pack": True, "pad_id": 0,
                       "pad_to_multiple_of": 1, "step_tags": STEP_TAGS},
            "cache_key": {"tokenizer": {"name": "toy"}, "template": None},
            "statistics": {"packs": len(groups), "samples_written": len(samples),
                           "data_fingerprint": content_fingerprint(prefixes)}}
    with open(f"{prefix}_packed_meta.json", "w") as f:
        json.dump(meta, f)
    return prefix

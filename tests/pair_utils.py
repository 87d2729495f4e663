"""Packed preference pairs and KTO couples for the DPO, reward model and KTO tests, written as preprocess_data.py writes them.

A pair = a prompt and two answers; in a pack, segment 2k-1 is prompt + chosen, 2k prompt +
rejected. A KTO couple = a prompt, its completion and another row's (its KL partner): segments
2k-1 and 2k. Tokens are random ids (the tiny models' vocabulary), so no tokenizer is needed.
"""
from __future__ import annotations

import json

import numpy as np

from mindspeed_pack.datasets.pack_writer import content_fingerprint, packed_prefixes
from tests.data_utils import IGNORE_INDEX, _builder


def random_pairs(num_pairs: int, seed: int = 0, vocab: int = 250, prompt=(3, 10), answer=(2, 12)):
    """[(prompt ids, chosen ids, rejected ids)]; a rejected answer repeats a token the chosen never
    uses (id 3), so a tiny model can learn to prefer chosen answers."""
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(num_pairs):
        p = rng.integers(4, vocab, int(rng.integers(*prompt)))
        c = rng.integers(4, vocab, int(rng.integers(*answer)))
        r = rng.integers(4, vocab, int(rng.integers(*answer)))
        r[::2] = 3
        pairs.append((p, c, r))
    return pairs


def sequence(prompt, answer):
    """(ids, aligned labels) of prompt + answer; the first token is never labelled."""
    ids = np.concatenate([prompt, answer]).astype(np.int64)
    labels = np.full(len(ids), IGNORE_INDEX, np.int64)
    labels[len(prompt):] = answer
    labels[0] = IGNORE_INDEX
    return ids, labels


def pack_rows(pairs, groups, seq_length):
    """Rows (ids, labels, segment ids) [len(groups), seq_length]: pack g holds pairs ``groups[g]``."""
    ids = np.zeros((len(groups), seq_length), np.int64)
    labels = np.full((len(groups), seq_length), IGNORE_INDEX, np.int64)
    seg = np.zeros((len(groups), seq_length), np.int64)
    for row, group in enumerate(groups):
        pos, k = 0, 0
        for j in group:
            p, c, r = pairs[j]
            for answer in (c, r):
                i, lab = sequence(p, answer)
                k += 1
                assert pos + len(i) <= seq_length, "pairs do not fit the pack"
                ids[row, pos:pos + len(i)], labels[row, pos:pos + len(i)], seg[row, pos:pos + len(i)] = i, lab, k
                pos += len(i)
    return ids, labels, seg


def greedy_groups(pairs, seq_length):
    groups, room = [], 0
    for j, (p, c, r) in enumerate(pairs):
        n = 2 * len(p) + len(c) + len(r)
        if not groups or n > room:
            groups.append([])
            room = seq_length
        groups[-1].append(j)
        room -= n
    return groups


def write_pair_dataset(prefix: str, pairs, seq_length: int = 128, groups=None, tokenizer="toy", template="qwen"):
    """Packs of ``pairs`` (``groups``: pair indices per pack, default greedy) with their sidecar."""
    groups = groups or greedy_groups(pairs, seq_length)
    return _write_packs(prefix, pairs, groups, seq_length, tokenizer, template,
                        {"pairs": "segments 2k-1 (chosen) and 2k (rejected)"}, {"pairs": len(pairs)})


def _write_packs(prefix, units, groups, seq_length, tokenizer, template, layout, statistics, per_pack=None):
    """The packs of ``units`` (two sequences each) as ``groups``, the ``per_pack`` files ({key: (name, [values of
    each pack])}) and the sidecar naming them."""
    ids, labels, seg = pack_rows(units, groups, seq_length)
    prefixes = packed_prefixes(prefix)
    arrays = {"input_ids": ids, "labels": labels, "attention_mask": seg}
    for key, (path, values) in (per_pack or {}).items():
        prefixes[key], arrays[key] = path, values
    for key, path in prefixes.items():
        b = _builder(path + ".bin")
        for row in arrays[key]:
            row = np.asarray(row, np.int32)
            b.add_document(row, [len(row)])
        b.finalize(path + ".idx")
    meta = {"layout": {"kind": "packed", "seq_length": seq_length, "neat_pack": True, "pad_id": 0,
                       "pad_to_multiple_of": 1, **layout},
            "cache_key": {"tokenizer": {"name": tokenizer}, "template": {"name": template}},
            "statistics": {**statistics, "data_fingerprint": content_fingerprint(prefixes)}}
    with open(f"{prefix}_packed_meta.json", "w") as f:
        json.dump(meta, f)
    return prefix


def packed_orm(model, stage, pairs, groups, seq_length, reports=None, margins=None):
    """(loss sum, pairs, rewards [pairs, 2] in pair order) of an outcome reward ``stage`` on ``pairs`` packed as
    ``groups`` in one micro-batch (the logged means go into ``reports`` when given; ``margins``: each pair's margin,
    in pair order, as the packs' margins file gives them)."""
    import torch

    from mindspeed_pack.packing.segments import build_packed_batch
    from mindspeed_pack.training.batches import packed_seq_params
    from mindspeed_pack.training.stages.sequences import pair_segments

    ids, labels, seg = (torch.from_numpy(x) for x in pack_rows(pairs, groups, seq_length))
    batch = build_packed_batch(ids, labels, seg)
    mb = {"input_ids": ids, "segment_ids": seg}
    if margins is not None:
        mb["pair_margins"] = torch.tensor([float(margins[j]) for g in groups for j in g], dtype=torch.float64)
    stage.prepare(None, [batch], [mb], "train", seq_length)
    out = model(batch.tokens, batch.position_ids, None, labels=batch.target, packed_seq_params=packed_seq_params(batch))
    loss, count, shown = stage.loss_func(batch, out)
    for name, (total, n) in (shown.items() if reports is not None else ()):
        reports[name] = float(total / n)
    rewards = stage.sequence_rewards(batch, out)
    chosen, rejected = pair_segments(batch)
    mine = torch.stack([rewards[chosen], rewards[rejected]], 1)
    back = torch.empty_like(mine)
    back[[j for g in groups for j in g]] = mine
    return loss, int(count), back


def hf_reward(hf, prompt, answer):
    """A transformers sequence classifier's reward of prompt + answer, the sample alone."""
    import torch

    ids, _ = sequence(prompt, answer)
    return hf(torch.from_numpy(ids)[None]).logits[0, 0]


# ---------------------------------------------------------------------------- KTO
def random_kto_rows(n: int, seed: int = 0, vocab: int = 250, prompt=(3, 8), answer=(2, 10), desirable=0.5):
    """([(prompt ids, completion ids)], [desirable?]) with ``desirable`` the chance of a desirable row; an
    undesirable completion repeats a token the desirable ones never use (id 3), so a tiny model can learn the
    label."""
    rng = np.random.default_rng(seed)
    rows, labels = [], []
    for _ in range(n):
        p = rng.integers(4, vocab, int(rng.integers(*prompt)))
        c = rng.integers(4, vocab, int(rng.integers(*answer)))
        good = bool(rng.random() < desirable)
        if not good:
            c[::2] = 3
        rows.append((p, c))
        labels.append(good)
    return rows, labels


def kto_couples(rows):
    """[(prompt, completion, KL partner's completion)]: row i's partner takes row i-1's completion (row 0: the
    last row's), as TRL's KTOTrainer shifts the completions of a batch."""
    return [(p, c, rows[i - 1][1]) for i, (p, c) in enumerate(rows)]


def write_kto_dataset(prefix: str, rows, labels, seq_length: int = 128, groups=None, tokenizer="toy",
                      template="qwen"):
    """Packs of KTO couples (``groups``: row indices per pack, default greedy), the per-segment labels file
    (1 desirable, 0 undesirable, -1 a KL partner) and the sidecar, as preprocess_data.py writes them."""
    from mindspeed_pack.datasets.pack_writer import kto_labels_prefix

    couples = kto_couples(rows)
    groups = groups or greedy_groups(couples, seq_length)
    per_segment = [[v for j in group for v in (int(labels[j]), -1)] for group in groups]
    path = kto_labels_prefix(prefix)
    return _write_packs(prefix, couples, groups, seq_length, tokenizer, template,
                        {"kto": "segments 2k-1 (sample) and 2k (its KL partner)", "kto_labels": path.split("/")[-1]},
                        {"kto_samples": len(rows)}, {"kto_labels": (path, per_segment)})


# ---------------------------------------------------------------------------- one unit a document (no --pack)
def write_pair_units(prefix: str, pairs, seq_length: int = 128, margins=None, pad_id: int = 0):
    """``pairs`` one a document, as preprocess_data.py writes them without --pack: segment 1 the chosen, 2 the
    rejected answer; ``margins`` (one per pair) in the pair margins file."""
    extra = {}
    if margins is not None:
        extra["pair_margins"] = (f"{prefix}_packed_pair_margins", [[m] for m in margins], np.float32)
    return _write_units(prefix, pairs, seq_length, pad_id, {"pairs": "segments 1 (chosen) and 2 (rejected)"},
                        {"pairs": len(pairs)}, extra)


def write_kto_units(prefix: str, rows, labels, seq_length: int = 128):
    """KTO couples one a document, as preprocess_data.py writes them without --pack: segment 1 the sample, 2 its KL
    partner, labelled ``[label, -1]``."""
    from mindspeed_pack.datasets.pack_writer import kto_labels_prefix

    path = kto_labels_prefix(prefix)
    return _write_units(prefix, kto_couples(rows), seq_length, 0,
                        {"kto": "segments 1 (sample) and 2 (its KL partner)", "kto_labels": path.split("/")[-1]},
                        {"kto_samples": len(rows)}, {"kto_labels": (path, [[int(g), -1] for g in labels], np.int32)})


def _write_units(prefix, units, seq_length, pad_id, layout, statistics, per_unit):
    keys = ("input_ids", "labels", "attention_mask")
    prefixes = packed_prefixes(prefix)
    builders = {k: _builder(prefixes[k] + ".bin") for k in keys}
    for p, a, b in units:
        (ia, la), (ib, lb) = sequence(p, a), sequence(p, b)
        for key, arr in zip(keys, (np.concatenate([ia, ib]), np.concatenate([la, lb]),
                                   np.repeat([1, 2], [len(ia), len(ib)]))):
            arr = np.asarray(arr, np.int32)
            builders[key].add_document(arr, [len(arr)])
    for key, b in builders.items():
        b.finalize(prefixes[key] + ".idx")
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    for path, values, dtype in per_unit.values():
        b = IndexedDatasetBuilder(path + ".bin", dtype=dtype)
        for v in values:
            b.add_document(np.asarray(v, dtype), [len(v)])
        b.finalize(path + ".idx")
    layout = {"kind": "unpacked", "seq_length": seq_length, "neat_pack": True, "pad_id": pad_id,
              "pad_to_multiple_of": 1, **layout,
              **{k: path.split("/")[-1] for k, (path, _, _) in per_unit.items()}}
    meta = {"layout": layout, "cache_key": {"tokenizer": {"name": "toy"}, "template": {"name": "qwen"}},
            "statistics": {**statistics, "documents": len(units), "data_fingerprint": content_fingerprint(prefixes)}}
    with open(f"{prefix}_packed_meta.json", "w") as f:
        json.dump(meta, f)
    return prefix

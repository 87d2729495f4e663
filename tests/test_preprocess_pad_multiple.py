"""``--pad-to-multiple-of N``: every sample padded at its end to a multiple of N (context parallelism).

The pads belong to their sample (pad id, label -100, the sample's segment id), so each segment
of a ``--neat-pack`` pack is a multiple of N long, packs stay exactly ``--seq-length``, and
stripping the pads gives back the samples of the run without the flag, token for token.
"""
import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

SEQ = 256  # the toy ShareGPT tail is truncated at this length
N = 8
PAD_ID = 0  # <|endoftext|> in the toy tokenizer; the toy texts never produce it
KEYS = ("input_ids", "labels", "attention_mask")


def _read(read_indexed, prefix):
    return {k: read_indexed(f"{prefix}_packed_{k}_document") for k in KEYS}


def _meta(prefix):
    return json.loads(Path(f"{prefix}_packed_meta.json").read_text())


def _strip_pads(ids, labels):
    """(real ids, real labels, number of pads): the trailing pad tokens of one padded sample."""
    n = len(ids)
    while n and ids[n - 1] == PAD_ID:
        n -= 1
    assert (labels[n:] == -100).all(), "a CP pad carries a label"
    return ids[:n], labels[:n], len(ids) - n


def _segments(pack):
    """(ids, labels) of every segment 1..k of one --neat-pack pack."""
    seg = pack["attention_mask"]
    for s in range(1, int(seg.max()) + 1):
        where = np.flatnonzero(seg == s)
        yield pack["input_ids"][where], pack["labels"][where]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, toy_sharegpt_jsonl, toy_tokenizer_dir):
    """The toy ShareGPT data, --pack --neat-pack without the flag, with N and with 1, and unpacked without/with N."""
    from mindspeed_pack.datasets.preprocess import main

    out = tmp_path_factory.mktemp("pad_multiple")
    common = ["--input", str(toy_sharegpt_jsonl), "--tokenizer-name-or-path", str(toy_tokenizer_dir),
              "--handler-name", "SharegptStyleInstructionHandler", "--prompt-type", "qwen", "--seq-length", str(SEQ)]
    neat = ["--pack", "--neat-pack"]
    runs = {"neat": neat, f"neat{N}": neat + ["--pad-to-multiple-of", str(N)],
            "neat1": neat + ["--pad-to-multiple-of", "1"], "plain": [], f"plain{N}": ["--pad-to-multiple-of", str(N)]}
    for name, flags in runs.items():
        assert main(common + flags + ["--output-prefix", str(out / name)]) == 0, name
    return out


def test_neat_packs_hold_segments_padded_to_the_multiple_with_the_same_samples(outputs, read_indexed):
    from mindspeed_pack.datasets.packed_dataset import PackedDocuments
    from mindspeed_pack.datasets.validation import validate_packed_documents

    base = _read(read_indexed, outputs / "neat")
    padded = _read(read_indexed, outputs / f"neat{N}")
    expected = Counter((ids.tobytes(), lab.tobytes()) for pack in zip(*base.values())
                       for ids, lab in _segments(dict(zip(KEYS, pack))))
    found, pads, lengths = Counter(), 0, []
    for pack in zip(*padded.values()):
        pack = dict(zip(KEYS, pack))
        seg = pack["attention_mask"]
        assert all(len(pack[k]) == SEQ for k in KEYS)  # packs keep exactly --seq-length
        n_real = int((seg > 0).sum())
        assert not seg[n_real:].any() and (pack["input_ids"][n_real:] == PAD_ID).all()  # pack padding: segment 0
        for ids, labels in _segments(pack):
            lengths.append(len(ids))
            real_ids, real_labels, n_pad = _strip_pads(ids, labels)
            assert n_pad < N and labels[0] == -100
            found[(real_ids.tobytes(), real_labels.tobytes())] += 1
            pads += n_pad
    assert all(n % N == 0 for n in lengths), sorted(set(n % N for n in lengths))
    assert found == expected  # every sample once, its own tokens and labels unchanged
    meta = _meta(outputs / f"neat{N}")
    assert pads == meta["statistics"]["cp_pad_tokens"] > 0
    assert meta["arguments"]["pad_to_multiple_of"] == N and meta["layout"]["pad_to_multiple_of"] == N
    assert meta["statistics"]["tokens"] == _meta(outputs / "neat")["statistics"]["tokens"]
    assert meta["statistics"]["lower_bound"] <= meta["statistics"]["packs"]
    # the training side's integrity checks accept the packs (segment ids still 1..k then 0)
    args = SimpleNamespace(seq_length=SEQ, neat_pack=True, padded_vocab_size=None, isolate_segments=True)
    validate_packed_documents(PackedDocuments(str(outputs / f"neat{N}")), args)


def test_seq_length_not_a_multiple_is_refused(tmp_path, run_preprocess, toy_sharegpt_jsonl):
    code, _, err = run_preprocess(input=toy_sharegpt_jsonl, output_prefix=tmp_path / "out" / "x",
                                  handler_name="SharegptStyleInstructionHandler", prompt_type="qwen",
                                  seq_length=100, pack=True, neat_pack=True, pad_to_multiple_of=N)
    assert code == 2
    assert "--seq-length 100" in err and f"--pad-to-multiple-of {N}" in err and "e.g. 104" in err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    code, _, err = run_preprocess(input=toy_sharegpt_jsonl, output_prefix=tmp_path / "y",
                                  handler_name="SharegptStyleInstructionHandler", prompt_type="qwen",
                                  seq_length=SEQ, pad_to_multiple_of=0)
    assert code == 2 and "--pad-to-multiple-of must be >= 1, got 0" in err
    # plain packs are split at EOS when trained: pads after an EOS would start a false sample
    code, _, err = run_preprocess(input=toy_sharegpt_jsonl, output_prefix=tmp_path / "z",
                                  handler_name="SharegptStyleInstructionHandler", prompt_type="qwen",
                                  seq_length=SEQ, pack=True, pad_to_multiple_of=N)
    assert code == 2 and "needs --neat-pack" in err


def test_multiple_of_one_is_byte_identical_to_no_flag(outputs):
    files = sorted(p.name[len("neat"):] for p in outputs.glob("neat_packed_*_document.*"))
    assert len(files) == 6
    for suffix in files:
        assert (outputs / f"neat{suffix}").read_bytes() == (outputs / f"neat1{suffix}").read_bytes(), suffix
    assert _meta(outputs / "neat1")["statistics"]["cp_pad_tokens"] == 0


def test_unpacked_documents_are_padded_to_the_multiple(outputs, read_indexed):
    base = _read(read_indexed, outputs / "plain")
    padded = _read(read_indexed, outputs / f"plain{N}")
    assert len(padded["input_ids"]) == len(base["input_ids"])
    pads = 0
    for ids, labels, mask, want_ids, want_labels in zip(*padded.values(), base["input_ids"], base["labels"]):
        assert len(ids) % N == 0 and len(ids) <= SEQ and (mask == 1).all()
        real_ids, real_labels, n_pad = _strip_pads(ids, labels)
        assert n_pad < N and np.array_equal(real_ids, want_ids) and np.array_equal(real_labels, want_labels)
        pads += n_pad
    assert pads == _meta(outputs / f"plain{N}")["statistics"]["cp_pad_tokens"] > 0


def test_summary_counts_cp_pad_tokens(tmp_path, run_preprocess, toy_alpaca_rows):
    from mindspeed_pack.data import toy

    data = toy.write_dataset(tmp_path / "a.jsonl", toy_alpaca_rows[:40])
    code, out, err = run_preprocess(input=data, output_prefix=tmp_path / "a", prompt_type="qwen", seq_length=128,
                                    pack=True, neat_pack=True, pad_to_multiple_of=4)
    assert code == 0, err
    pads = _meta(tmp_path / "a")["statistics"]["cp_pad_tokens"]
    assert pads > 0 and f"cp pad tokens {pads} (every sample padded to a multiple of 4)" in out

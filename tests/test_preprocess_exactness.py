"""Preprocessing keeps every sample intact and its splits fair.

* ids equal transformers' ``tokenizer(text, add_special_tokens=False)`` even when the
  tokenizer files carry saved truncation/padding settings (nothing cut, nothing padded);
* packs are written in a seeded random order: the validation range of ``--split`` has the
  same sample lengths as the training range;
* a template's missing tokens (chatml's ``<|im_end|>`` on a base tokenizer) are added once,
  saved as ``P_tokenizer/``, and the data trains (with a separately preprocessed valid set).
"""
import json
import shutil

import numpy as np
import pytest
from tokenizers import Tokenizer

from mindspeed_pack.data import toy
from mindspeed_pack.data.tokenizer import HFTokenizer
from mindspeed_pack.datasets.packed_dataset import split_ranges

SHORT = "Say the first word.\nred cat"
LONG = " ".join(["Sort the words alphabetically."] + toy.WORDS * 6)


@pytest.fixture(scope="module")
def saved_truncating_tokenizer(tmp_path_factory, toy_tokenizer_dir):
    """The toy tokenizer saved after a "padded call": tokenizer.json truncates to 8 and pads to 16."""
    out = tmp_path_factory.mktemp("truncating_tokenizer")
    shutil.copytree(toy_tokenizer_dir, out, dirs_exist_ok=True)
    backend = Tokenizer.from_file(str(out / "tokenizer.json"))
    backend.enable_truncation(max_length=8)
    backend.enable_padding(length=16, pad_id=backend.token_to_id(toy.PAD_TOKEN), pad_token=toy.PAD_TOKEN)
    backend.save(str(out / "tokenizer.json"))
    return out


def test_saved_truncation_and_padding_do_not_change_ids(saved_truncating_tokenizer, toy_tokenizer_dir):
    from transformers import AutoTokenizer

    raw = Tokenizer.from_file(str(saved_truncating_tokenizer / "tokenizer.json"))
    pad = raw.token_to_id(toy.PAD_TOKEN)
    assert raw.encode(LONG, add_special_tokens=False).ids[8:] == [pad] * 8  # the files truncate to 8 ...
    assert raw.encode(SHORT, add_special_tokens=False).ids[-1] == pad  # ... and pad to 16
    hf = AutoTokenizer.from_pretrained(str(saved_truncating_tokenizer))
    clean = AutoTokenizer.from_pretrained(str(toy_tokenizer_dir))
    texts = [SHORT, LONG, "", "<|im_start|>user\n" + LONG + "<|im_end|>"]
    expected = [hf(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert expected == [clean(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert len(expected[1]) > 100
    ours = HFTokenizer(str(saved_truncating_tokenizer))
    assert ours.encode_batch(texts) == expected
    assert [ours.encode(t) for t in texts] == expected


def test_saved_truncation_does_not_shorten_samples_end_to_end(tmp_path, run_preprocess, read_indexed,
                                                               saved_truncating_tokenizer, toy_tokenizer_dir):
    data = toy.write_dataset(tmp_path / "a.jsonl", toy.generate_alpaca(60, seed=3, max_words=80))
    outputs = {}
    for name, tok in (("clean", toy_tokenizer_dir), ("saved", saved_truncating_tokenizer)):
        code, out, err = run_preprocess(input=data, output_prefix=tmp_path / name, tokenizer_name_or_path=tok,
                                        prompt_type="qwen", seq_length=2048, pack=True, neat_pack=True)
        assert code == 0, err
        assert "truncated 0" in out
        outputs[name] = read_indexed(tmp_path / f"{name}_packed_input_ids_document")
    assert all(np.array_equal(a, b) for a, b in zip(outputs["clean"], outputs["saved"]))
    meta = json.loads((tmp_path / "saved_packed_meta.json").read_text())
    assert meta["statistics"]["max_sample_length"] > 100


def test_truncation_happens_only_at_seq_length_and_is_counted(tmp_path, run_preprocess, saved_truncating_tokenizer):
    data = toy.write_dataset(tmp_path / "a.jsonl", toy.generate_alpaca(60, seed=3, max_words=80))
    code, out, err = run_preprocess(input=data, output_prefix=tmp_path / "p", tokenizer_name_or_path=saved_truncating_tokenizer,
                                    prompt_type="qwen", seq_length=64, pack=True, neat_pack=True)
    assert code == 0, err
    stats = json.loads((tmp_path / "p_packed_meta.json").read_text())["statistics"]
    assert stats["truncated"] > 0 and f"truncated {stats['truncated']}" in out
    assert stats["max_sample_length"] == 64


def _sample_lengths(masks):
    """Per pack: lengths of its segments (segment ids 1..k, 0 = padding)."""
    return [np.bincount(m[m > 0])[1:] for m in masks]


@pytest.fixture(scope="module")
def heavy_tailed_jsonl(tmp_path_factory):
    rows = toy.generate_alpaca(4000, seed=5, max_words=250)
    return toy.write_dataset(tmp_path_factory.mktemp("heavy") / "heavy.jsonl", rows)


def test_valid_split_has_the_train_splits_sample_lengths(tmp_path, run_preprocess, read_indexed, heavy_tailed_jsonl):
    code, _, err = run_preprocess(input=heavy_tailed_jsonl, output_prefix=tmp_path / "p", prompt_type="qwen",
                                  seq_length=512, pack=True, neat_pack=True)
    assert code == 0, err
    packs = _sample_lengths(read_indexed(tmp_path / "p_packed_attention_mask_document"))
    (t0, t1), (v0, v1), _ = split_ranges(len(packs), "90,10,0")
    train, valid = packs[t0:t1], packs[v0:v1]
    assert len(valid) >= 40
    mean_len = [np.concatenate(s).mean() for s in (train, valid)]
    per_pack = [np.mean([len(p) for p in s]) for s in (train, valid)]
    assert abs(mean_len[1] / mean_len[0] - 1) < 0.10, mean_len
    assert abs(per_pack[1] / per_pack[0] - 1) < 0.10, per_pack


def test_pack_order_is_a_function_of_the_seed(tmp_path, run_preprocess, heavy_tailed_jsonl):
    def build(name, seed):
        code, _, err = run_preprocess(input=heavy_tailed_jsonl, output_prefix=tmp_path / name, prompt_type="qwen",
                                      seq_length=512, pack=True, neat_pack=True, seed=seed, workers=2 if name == "b" else 1)
        assert code == 0, err
        return {key: (tmp_path / f"{name}_packed_{key}_document.bin").read_bytes() for key in ("input_ids", "labels")}

    a, b, c = build("a", 7), build("b", 7), build("c", 8)
    assert a == b  # same input and seed: same bytes (whatever --workers)
    assert a["input_ids"] != c["input_ids"]  # another seed: another order of the same packs
    rows = [np.frombuffer(x["input_ids"], np.int32).reshape(-1, 512) for x in (a, c)]
    assert sorted(map(bytes, rows[0])) == sorted(map(bytes, rows[1]))


# ---------------------------------------------------------------- missing template tokens
@pytest.fixture(scope="module")
def base_tokenizer_dir(tmp_path_factory):
    """A byte-level BPE with no chat tokens: EOS and pad are <|endoftext|>."""
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=[toy.PAD_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rows = toy.generate_alpaca(300, seed=0)
    backend.train_from_iterator([f"{r['instruction']}\n{r['input']}\n{r['output']}" for r in rows], trainer=trainer)
    out = tmp_path_factory.mktemp("base_tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=toy.PAD_TOKEN, pad_token=toy.PAD_TOKEN).save_pretrained(str(out))
    return out


def test_chatml_on_a_tokenizer_without_im_end_adds_the_tokens_once_and_trains(tmp_path, run_preprocess, read_indexed,
                                                                              base_tokenizer_dir):
    from transformers import AutoTokenizer

    from tests.train_utils import run_posttrain

    base = AutoTokenizer.from_pretrained(str(base_tokenizer_dir))
    assert len(base(toy.IM_END, add_special_tokens=False)["input_ids"]) > 1
    prefixes = {}
    for split, seed in (("train", 1), ("valid", 2)):
        data = toy.write_dataset(tmp_path / f"{split}.jsonl", toy.generate_sharegpt(80, seed=seed, turns=(1, 2), max_words=12))
        prefix = tmp_path / split
        code, out, err = run_preprocess(input=data, output_prefix=prefix, tokenizer_name_or_path=base_tokenizer_dir,
                                        handler_name="SharegptStyleInstructionHandler", prompt_type="chatml",
                                        seq_length=128, pack=True, neat_pack=True, workers=2)
        assert code == 0, err
        assert "truncated 0" in out
        warnings = [line for line in err.splitlines() if line.startswith("warning:")]
        assert len(warnings) == 1, err  # once, from the main process, not once per worker
        assert toy.IM_END in warnings[0] and toy.IM_START in warnings[0] and f"-> {len(base) + 2}" in warnings[0]
        assert f"{split}_tokenizer/" in out
        prefixes[split] = prefix

    extended = AutoTokenizer.from_pretrained(str(tmp_path / "train_tokenizer"))
    assert len(extended) == len(base) + 2  # each token added once
    im_end = extended.convert_tokens_to_ids(toy.IM_END)
    assert extended(toy.IM_END, add_special_tokens=False)["input_ids"] == [im_end]
    meta = json.loads((tmp_path / "train_packed_meta.json").read_text())
    assert meta["extended_tokenizer"] == {"path": "train_tokenizer", "added_tokens": [toy.IM_END, toy.IM_START],
                                          "vocab_size": len(base) + 2}
    assert meta["cache_key"]["tokenizer"]["vocab_size"] == len(base) + 2
    ids, labels, masks = (read_indexed(tmp_path / f"train_packed_{k}_document") for k in ("input_ids", "labels", "attention_mask"))
    for row, lab, mask in zip(ids, labels, masks):
        ends = np.flatnonzero(np.diff(np.append(mask, 0)) != 0)  # last position of each segment
        ends = ends[mask[ends] > 0]
        assert np.all(row[ends] == im_end) and np.all(lab[ends] == im_end)  # every answer ends on the new token, trained
    text = extended.decode(ids[0].tolist())
    assert "<|im_start|>user\n" in text and "<|im_end|>" in text

    # a separately preprocessed validation set (Megatron's --train-data-path/--valid-data-path)
    vocab = -(-(len(base) + 2) // 128) * 128
    proc, records = run_posttrain(["--train-data-path", str(prefixes["train"]), "--valid-data-path", str(prefixes["valid"]),
                                   "--seq-length", "128", "--neat-pack", "--padded-vocab-size", str(vocab),
                                   "--lr", "1e-3", "--train-iters", "1", "--global-batch-size", "2",
                                   "--eval-interval", "1", "--eval-iters", "1", "--log-interval", "1"],
                                  metrics=str(tmp_path / "m.jsonl"))
    splits = [r["split"] for r in records]
    assert "train" in splits and "valid" in splits, records
    assert all(np.isfinite(r["lm loss"]) for r in records)


def test_per_split_paths_and_data_path_are_exclusive(capsys):
    from mindspeed_pack.config.arguments import parse_args, per_split_data_args
    from tests.model_utils import TINY_FLAGS

    with pytest.raises(SystemExit):
        parse_args([*TINY_FLAGS, "--data-path", "x", "--train-data-path", "y", "--seq-length", "128", "--train-iters", "1"],
                   world_size=1, extra_args_provider=per_split_data_args)
    assert "not both" in capsys.readouterr().err


def test_a_tokenizer_without_eos_takes_the_templates_stop_word(tmp_path, run_preprocess, toy_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = tmp_path / "tok"
    shutil.copytree(toy_tokenizer_dir, tok)
    config = json.loads((tok / "tokenizer_config.json").read_text())
    config.pop("eos_token", None)
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    data = toy.write_dataset(tmp_path / "a.jsonl", toy.generate_alpaca(20, seed=3))
    code, out, err = run_preprocess(input=data, output_prefix=tmp_path / "p", tokenizer_name_or_path=tok,
                                    prompt_type="qwen", seq_length=256, pack=True, neat_pack=True)
    assert code == 0, err
    assert "made <|im_end|> the EOS" in err
    extended = AutoTokenizer.from_pretrained(str(tmp_path / "p_tokenizer"))
    assert extended.eos_token == toy.IM_END and len(extended) == len(AutoTokenizer.from_pretrained(str(tok)))

"""Which vocabulary rows are real: every row of the model's embedding, and the tokens added at preprocessing.

Preprocessing adds chatml markers to a base tokenizer (``P_tokenizer/``), training trains
their rows past the converted model's ``vocab_size``; converting back must keep them
(``len(tokenizer)`` rows, as ``resize_token_embeddings`` gives) so the HF model embeds
``<|im_end|>`` with the trained row instead of failing with an IndexError.

A model's embedding may be larger than its tokenizer (Qwen2.5: 152,064 rows, 151,665 tokens): every
row is in its softmax, so training masks only Megatron's own padding past the rows, whether the model
comes from a HF directory or from its converted checkpoint.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from mindspeed_pack.convert import ConversionError, hf_to_megatron, megatron_to_hf, megatron_to_megatron
from mindspeed_pack.convert.megatron_layout import RELEASE, checkpoint_file
from mindspeed_pack.datasets.packed_documents import PackedDocuments
from tests.data_utils import write_packed_instruction_dataset
from tests.model_utils import TINY_FLAGS, write_converted_tiny_qwen2
from tests.train_utils import RUN_FLAGS, first_loss

MARKERS = ["<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A base tokenizer, its extended copy, and a Megatron checkpoint whose added-token rows were 'trained'."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("vocab_rows")
    vocab = {w: i for i, w in enumerate(["<unk>", "<|endoftext|>"] + [f"w{i}" for i in range(38)])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    base = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>",
                                                pad_token="<|endoftext|>", unk_token="<unk>")
    base.save_pretrained(root / "base_tok")
    base.add_special_tokens({"additional_special_tokens": MARKERS})  # what preprocessing does for chatml
    base.save_pretrained(root / "extended_tok")
    assert len(base) == len(vocab) + 2

    config = transformers.Qwen2Config(vocab_size=len(vocab), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(root / "hf")
    mg = str(root / "mg")
    hf_to_megatron(str(root / "hf"), mg, 1, 1, padded_vocab_size=128)
    path = checkpoint_file(mg, RELEASE, 0, 0, 1)
    record = torch.load(path, weights_only=True)
    rows = {}
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        new = torch.randn(2, 32, generator=torch.Generator().manual_seed(len(name)))
        record["model"][name][len(vocab):len(vocab) + 2] = new  # the rows training gave the new tokens
        rows[name] = new
    torch.save(record, path)
    return {"root": root, "mg": mg, "vocab": len(vocab), "rows": rows}


def _check_hf(out, trained):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert json.load(open(os.path.join(out, "config.json")))["vocab_size"] == trained["vocab"] + 2 == len(tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end == trained["vocab"] + 1
    ids = tok("w1 w2 <|im_end|>", add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert ids[0, -1] == im_end
    with torch.no_grad():
        assert torch.equal(model.get_input_embeddings()(ids)[0, -1], trained["rows"]["embedding.word_embeddings.weight"][1])
        assert torch.equal(model.lm_head.weight[im_end], trained["rows"]["output_layer.weight"][1])
        assert torch.isfinite(model(ids).logits).all()


def test_mg_to_hf_keeps_the_rows_of_added_tokens(trained, caplog):
    out = str(trained["root"] / "hf_back")
    with caplog.at_level("WARNING"):
        megatron_to_hf(trained["mg"], out, tokenizer_dir=str(trained["root"] / "extended_tok"))
    _check_hf(out, trained)
    assert "keeping 42 vocabulary rows" in caplog.text


def test_mg_to_mg_resharding_keeps_them_too(trained):
    tp2 = str(trained["root"] / "mg_tp2")
    megatron_to_megatron(trained["mg"], tp2, 2, 1, tokenizer_dir=str(trained["root"] / "extended_tok"))
    out = str(trained["root"] / "hf_from_tp2")
    megatron_to_hf(tp2, out, tokenizer_dir=str(trained["root"] / "extended_tok"))
    _check_hf(out, trained)


def test_trained_rows_are_not_dropped_silently(trained, tmp_path):
    with pytest.raises(ConversionError, match=r"word-embedding rows 40\.\.41 past the vocab_size 40 were trained.*"
                                              r"--tokenizer-dir"):
        megatron_to_hf(trained["mg"], str(tmp_path / "out"))
    with pytest.raises(ConversionError, match=r"rows 40\.\.41 past the vocab_size 40"):
        megatron_to_megatron(trained["mg"], str(tmp_path / "out"), 2, 1)
    unpadded = str(trained["root"] / "mg_unpadded")  # no room for the added tokens
    hf_to_megatron(str(trained["root"] / "hf"), unpadded, 1, 1, padded_vocab_size=trained["vocab"])
    with pytest.raises(ConversionError, match="42 tokens, but the checkpoint's embedding has only 40 rows"):
        megatron_to_hf(unpadded, str(tmp_path / "out"), tokenizer_dir=str(trained["root"] / "extended_tok"))
    assert not os.listdir(tmp_path)


# --------------------------------------------------------------------------- an embedding larger than the tokenizer
ROWS, TOKENS = 200, 150  # embedding rows > tokenizer entries, as Qwen2.5's 152,064 > 151,665; padded to 256


def _transformers_loss(hf_dir: str, prefix: str, rows: int = ROWS) -> float:
    """The loss transformers gives the packs of ``prefix`` (each sample on its own, the token mean over all
    of them: the trainer's first step when it takes every pack), with the softmax over the first ``rows``
    (past the model's own: zero rows, as Megatron pads, resized in)."""
    import transformers

    model = transformers.Qwen2ForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    own = model.config.vocab_size
    if rows > own:
        model.resize_token_embeddings(rows)
        with torch.no_grad():
            model.get_input_embeddings().weight[own:] = 0
            model.get_output_embeddings().weight[own:] = 0
    docs = PackedDocuments(prefix)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(docs)):
            pack = docs.get(i)
            for sample in sorted(set(pack["attention_mask"].tolist()) - {0}):
                where = pack["attention_mask"] == sample
                ids, labels = torch.from_numpy(pack["input_ids"][where]), torch.from_numpy(pack["labels"][where])[1:]
                logits = model(ids[None]).logits[0, :-1, :rows].double()
                trained = labels != -100
                total += float(F.cross_entropy(logits[trained], labels[trained], reduction="sum"))
                count += int(trained.sum())
    return total / count


def _packs_of(prefix: str, tokens: int) -> str:
    """Four packs (one global batch) of ids below ``tokens``, the sidecar recording a tokenizer of ``tokens``
    entries as preprocess_data.py records its (extended) tokenizer."""
    write_packed_instruction_dataset(prefix, num_packs=4, vocab=tokens, meta=True)
    sidecar = f"{prefix}_packed_meta.json"
    meta = json.load(open(sidecar))
    meta["cache_key"] = {"tokenizer": {"vocab_size": tokens}}
    json.dump(meta, open(sidecar, "w"))
    return prefix


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A Qwen2 of ROWS embedding rows (hf/), converted as the README converts (mg/: padded to 256 rows), and
    packs of its TOKENS-entry tokenizer's ids."""
    root = tmp_path_factory.mktemp("wide_embedding")
    mg = write_converted_tiny_qwen2(root, vocab_size=ROWS)
    data = _packs_of(str(root / "data" / "toy"), TOKENS)
    return {"root": root, "hf": str(root / "hf"), "mg": mg, "data": data, "loss": _transformers_loss(str(root / "hf"), data)}


def _load_flags(wide, load: str) -> list:
    """``--load HF_DIR``, or the converted checkpoint with the README's ``--load ckpt --finetune`` and the model
    flags (``--padded-vocab-size`` too where ``load`` says so)."""
    if load == "hf":
        return ["--load", wide["hf"]]
    model_flags = TINY_FLAGS if "padded" in load else _without(TINY_FLAGS, "--padded-vocab-size")
    return [*model_flags, "--load", wide["mg"], "--finetune"]


def _without(flags, name):
    i = flags.index(name)
    return flags[:i] + flags[i + 2:]


@pytest.mark.parametrize("load", ["hf", "mg", "mg --padded-vocab-size"])
def test_every_row_of_the_model_is_in_the_softmax_whether_loaded_or_converted(wide, tmp_path, load):
    """First loss = transformers' over all ROWS rows (fp32), for ``--load HF_DIR`` and for the converted
    checkpoint (with or without ``--padded-vocab-size``)."""
    masked = _transformers_loss(wide["hf"], wide["data"], rows=TOKENS)
    assert abs(masked / wide["loss"] - 1) > 1e-3  # leaving the rows past the tokenizer out shows
    loss = first_loss([*RUN_FLAGS, "--data-path", wide["data"], *_load_flags(wide, load)],
                      str(tmp_path / "metrics.jsonl"))
    assert abs(loss / wide["loss"] - 1) <= 1e-6, (loss, wide["loss"], masked)


@pytest.mark.parametrize("load", ["hf", "mg"])
def test_tokens_added_at_preprocessing_past_the_models_rows_are_in_the_softmax_too(wide, tmp_path, load):
    """Data of a tokenizer extended past the model's ROWS rows (a template's markers on a base tokenizer): the
    added tokens' (zero) rows are real rows, as transformers' ``resize_token_embeddings`` makes them."""
    extended = ROWS + 10
    data = _packs_of(str(wide["root"] / "extended" / "toy"), extended)
    want = _transformers_loss(wide["hf"], data, rows=extended)
    loss = first_loss([*RUN_FLAGS, "--data-path", data, *_load_flags(wide, load)], str(tmp_path / "metrics.jsonl"))
    assert abs(loss / want - 1) <= 1e-6, (loss, want)


def test_vocabulary_flags_that_disagree_with_the_checkpoints_record_are_refused(wide, capsys):
    """The converted checkpoint records its rows and padding; a flag given with other values names both."""
    from mindspeed_pack.config.arguments import parse_args

    record = checkpoint_file(wide["mg"], RELEASE, 0, 0, 1)
    with pytest.raises(SystemExit):
        parse_args([*_without(TINY_FLAGS, "--padded-vocab-size"), *RUN_FLAGS, "--data-path", wide["data"],
                    "--load", wide["mg"], "--finetune", "--padded-vocab-size", str(ROWS), "--vocab-size", str(TOKENS)],
                   world_size=1)
    assert (f"--padded-vocab-size {ROWS} but {record} records --padded-vocab-size 256; --vocab-size {TOKENS} but "
            f"{record} records --vocab-size {ROWS}") in capsys.readouterr().err

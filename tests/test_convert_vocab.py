"""Rows of tokens added at preprocessing survive conversion back to Hugging Face and resharding.

Preprocessing adds chatml markers to a base tokenizer (``P_tokenizer/``), training trains
their rows past the converted model's ``vocab_size``; converting back must keep them
(``len(tokenizer)`` rows, as ``resize_token_embeddings`` gives) so the HF model embeds
``<|im_end|>`` with the trained row instead of failing with an IndexError.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from mindspeed_pack.convert import ConversionError, hf_to_megatron, megatron_to_hf, megatron_to_megatron
from mindspeed_pack.convert.megatron_layout import RELEASE, checkpoint_file

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

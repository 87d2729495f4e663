"""GeneralPretrainHandler writes the tokens Megatron-LM's preprocessing writes: BOS as the tokenizer adds it, no empty documents."""
import json

import pytest

from mindspeed_pack.data import toy


@pytest.fixture(scope="module")
def llama_tokenizer_dir(tmp_path_factory):
    """A Llama-style tokenizer (<s> BOS added by its own encoding, </s> EOS), saved and reloaded by transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaTokenizer

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    backend.train_from_iterator([r["text"] for r in toy.generate_pretrain_text(200, seed=0)], trainer=trainer)
    out = tmp_path_factory.mktemp("llama_tokenizer")
    LlamaTokenizer(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                   add_bos_token=True).save_pretrained(str(out))
    return out


def _pretrain(run_preprocess, data, prefix, **flags):
    code, out, err = run_preprocess(input=data, output_prefix=prefix, handler_name="GeneralPretrainHandler",
                                    append_eod=True, **flags)
    assert code == 0, err
    meta = json.loads(open(f"{prefix}_text_meta.json").read())
    return out, meta


def test_llama_documents_start_with_bos_as_the_tokenizer_encodes(tmp_path, run_preprocess, read_indexed,
                                                                  llama_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(llama_tokenizer_dir))
    rows = toy.generate_pretrain_text(12, seed=4)
    data = toy.write_dataset(tmp_path / "corpus.jsonl", rows)
    out, meta = _pretrain(run_preprocess, data, tmp_path / "follow", tokenizer_name_or_path=llama_tokenizer_dir)
    docs = [d.tolist() for d in read_indexed(tmp_path / "follow_text_document")]
    # exactly Megatron-LM's document: tokenizer(text).input_ids (BOS first), then the EOD
    assert docs == [tok(r["text"])["input_ids"] + [tok.eos_token_id] for r in rows]
    assert all(d[0] == tok.bos_token_id == 1 for d in docs)
    assert (meta["layout"]["add_bos"], meta["layout"]["add_bos_from"], meta["layout"]["bos_id"]) == (True, "tokenizer", 1)
    assert "BOS (id 1) starts every document (the tokenizer adds it; --no-add-bos leaves it out)" in out

    out, meta = _pretrain(run_preprocess, data, tmp_path / "off", tokenizer_name_or_path=llama_tokenizer_dir,
                          no_add_bos=True)
    docs = [d.tolist() for d in read_indexed(tmp_path / "off_text_document")]
    assert docs == [tok(r["text"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in rows]
    assert meta["layout"]["add_bos_from"] == "--no-add-bos" and "no BOS added (--no-add-bos)" in out


def test_tokenizer_without_bos_adds_none_and_refuses_add_bos(tmp_path, run_preprocess, read_indexed, toy_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(toy_tokenizer_dir))
    rows = toy.generate_pretrain_text(5, seed=5)
    data = toy.write_dataset(tmp_path / "corpus.txt", rows)
    out, meta = _pretrain(run_preprocess, data, tmp_path / "q")
    assert [d.tolist() for d in read_indexed(tmp_path / "q_text_document")] == \
        [tok(r["text"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in rows]
    assert meta["layout"]["add_bos"] is False and "no BOS (the tokenizer has none)" in out
    code, _, err = run_preprocess(input=data, output_prefix=tmp_path / "b", handler_name="GeneralPretrainHandler",
                                  add_bos=True)
    assert code == 2 and "--add-bos" in err and "has no BOS token" in err
    code, _, err = run_preprocess(input=data, output_prefix=tmp_path / "i", prompt_type="qwen", no_add_bos=True)
    assert code == 2 and "--no-add-bos applies to GeneralPretrainHandler" in err


def test_blank_lines_are_no_documents(tmp_path, run_preprocess, read_indexed, toy_tokenizer_dir):
    """With --append-eod a blank line used to become a document that is only EOS."""
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(str(toy_tokenizer_dir)).eos_token_id
    data = tmp_path / "corpus.txt"
    data.write_text("first document\n\nsecond document\n\n\nthird\n")
    out, meta = _pretrain(run_preprocess, data, tmp_path / "p")
    docs = read_indexed(tmp_path / "p_text_document")
    assert len(docs) == 3 and all(len(d) > 1 and d[-1] == eos for d in docs)
    assert meta["statistics"]["skipped"] == {"empty text or conversation": 3}
    assert meta["statistics"]["first_skipped"] == {"empty text or conversation": f"{data}: line 2"}
    assert "skipped 3 (3 empty text or conversation)" in out


def test_megatron_json_keys_without_a_handler_writes_pretraining_documents(tmp_path, run_preprocess, read_indexed,
                                                                           toy_tokenizer_dir):
    """Megatron-LM's `preprocess_data.py --json-keys content --append-eod` names no handler: the documents of
    --handler-name GeneralPretrainHandler (it was read as Alpaca rows: 'needs --prompt-type')."""
    rows = [{"content": r["text"]} for r in toy.generate_pretrain_text(6, seed=6)]
    data = toy.write_dataset(tmp_path / "corpus.jsonl", rows)
    code, _, err = run_preprocess(input=data, output_prefix=tmp_path / "m", json_keys="content", append_eod=True)
    assert code == 0, err
    meta = json.loads(open(f"{tmp_path / 'm'}_text_meta.json").read())
    assert meta["cache_key"]["arguments"]["handler_name"] == "GeneralPretrainHandler"
    _pretrain(run_preprocess, data, tmp_path / "g", map_keys='{"text": "content"}')
    assert [d.tolist() for d in read_indexed(tmp_path / "m_text_document")] == \
        [d.tolist() for d in read_indexed(tmp_path / "g_text_document")]
    # MindSpeed-LLM's pretraining data script passes no handler and no --json-keys: the default is named
    code, _, err = run_preprocess(input=data, output_prefix=tmp_path / "n", append_eod=True)
    assert code == 2 and "it is the default --handler-name" in err and "GeneralPretrainHandler" in err

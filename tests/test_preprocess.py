"""End-to-end preprocessing: packs hold every sample exactly once, intact; output is deterministic."""
import json
import os
import signal
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from mindspeed_pack.data import toy

SEQ = 256  # small enough that the toy tail gets truncated and packs hold several samples
PAD_ID = 0  # <|endoftext|> in the toy tokenizer


def _sg_flags(tmp_path, toy_sharegpt_jsonl, name, **extra):
    flags = dict(input=toy_sharegpt_jsonl, output_prefix=tmp_path / name, handler_name="SharegptStyleInstructionHandler",
                 prompt_type="qwen", seq_length=SEQ)
    flags.update(extra)
    return flags


def _packed(read_indexed, prefix):
    return {k: read_indexed(f"{prefix}_packed_{k}_document") for k in ("input_ids", "labels", "attention_mask")}


@pytest.fixture(scope="module")
def sharegpt_outputs(tmp_path_factory, toy_sharegpt_jsonl, toy_tokenizer_dir):
    """The same ShareGPT data preprocessed unpacked, --pack --neat-pack, and --pack."""
    from mindspeed_pack.datasets.preprocess import main

    out = tmp_path_factory.mktemp("sg_out")
    common = ["--input", str(toy_sharegpt_jsonl), "--tokenizer-name-or-path", str(toy_tokenizer_dir),
              "--handler-name", "SharegptStyleInstructionHandler", "--prompt-type", "qwen", "--seq-length", str(SEQ)]
    assert main(common + ["--output-prefix", str(out / "plain")]) == 0
    assert main(common + ["--output-prefix", str(out / "neat"), "--pack", "--neat-pack"]) == 0
    assert main(common + ["--output-prefix", str(out / "pack"), "--pack"]) == 0
    return out


def test_every_sample_appears_exactly_once_intact_in_one_segment(sharegpt_outputs, read_indexed):
    unpacked = _packed(read_indexed, sharegpt_outputs / "plain")
    packed = _packed(read_indexed, sharegpt_outputs / "neat")
    expected = Counter((ids.tobytes(), lab.tobytes()) for ids, lab in zip(unpacked["input_ids"], unpacked["labels"]))
    found = Counter()
    for ids, labels, seg in zip(packed["input_ids"], packed["labels"], packed["attention_mask"]):
        assert len(ids) == len(labels) == len(seg) == SEQ
        k = int(seg.max())
        n_real = int((seg > 0).sum())
        # segment ids are 1..k in order, then 0 padding to the end
        assert np.array_equal(seg[:n_real], np.sort(seg[:n_real])) and set(seg[:n_real]) == set(range(1, k + 1))
        assert not seg[n_real:].any()
        assert (ids[n_real:] == PAD_ID).all() and (labels[n_real:] == -100).all()
        for s in range(1, k + 1):
            where = np.flatnonzero(seg == s)
            assert labels[where[0]] == -100  # the first token of every sample is never trained
            found[(ids[where].tobytes(), labels[where].tobytes())] += 1
    assert found == expected
    assert len(packed["input_ids"]) < len(unpacked["input_ids"]) / 2  # it did pack


def test_labels_are_aligned_prompts_masked(sharegpt_outputs, read_indexed, toy_tokenizer_dir, toy_sharegpt_rows):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(toy_tokenizer_dir))
    unpacked = _packed(read_indexed, sharegpt_outputs / "plain")
    meta = json.loads(Path(f"{sharegpt_outputs / 'plain'}_packed_meta.json").read_text())
    assert meta["statistics"]["skipped"] == {} and len(unpacked["input_ids"]) == len(toy_sharegpt_rows)
    checked = 0
    for ids, labels, mask, row in zip(unpacked["input_ids"], unpacked["labels"], unpacked["attention_mask"], toy_sharegpt_rows):
        trained = labels != -100
        assert np.array_equal(labels[trained], ids[trained]) and (mask == 1).all() and not trained[0]
        if len(ids) < SEQ:  # not truncated: trained text is exactly the answers, each closed by <|im_end|>
            answers = "".join(m["value"] + "<|im_end|>" for m in row["conversations"] if m["from"] == "gpt")
            assert tok.decode(ids[trained].tolist()) == answers
            checked += 1
    assert checked > len(toy_sharegpt_rows) // 2


def test_truncation_is_counted_and_bounded(sharegpt_outputs, read_indexed):
    stats = json.loads(Path(f"{sharegpt_outputs / 'plain'}_packed_meta.json").read_text())["statistics"]
    lengths = [len(x) for x in read_indexed(f"{sharegpt_outputs / 'plain'}_packed_input_ids_document")]
    assert max(lengths) == SEQ and stats["truncated"] == sum(1 for n in lengths if n == SEQ) > 0


def test_plain_pack_has_all_ones_mask_and_same_packs(sharegpt_outputs, read_indexed):
    neat = _packed(read_indexed, sharegpt_outputs / "neat")
    plain = _packed(read_indexed, sharegpt_outputs / "pack")
    assert all((m == 1).all() for m in plain["attention_mask"])
    assert all(np.array_equal(a, b) for a, b in zip(neat["input_ids"], plain["input_ids"]))
    assert all(np.array_equal(a, b) for a, b in zip(neat["labels"], plain["labels"]))


def test_sidecar_records_tokenizer_template_and_statistics(sharegpt_outputs, read_indexed):
    meta = json.loads(Path(f"{sharegpt_outputs / 'neat'}_packed_meta.json").read_text())
    s = meta["statistics"]
    assert meta["cache_key"]["tokenizer"]["eos_id"] == 2 and meta["cache_key"]["tokenizer"]["pad_id"] == PAD_ID
    assert len(meta["cache_key"]["tokenizer"]["files_sha256"]) == 64
    assert meta["cache_key"]["template"]["name"] == "qwen"
    assert meta["layout"]["neat_pack"] and meta["layout"]["seq_length"] == SEQ
    assert s["packs"] == len(read_indexed(f"{sharegpt_outputs / 'neat'}_packed_input_ids_document"))
    assert s["lower_bound"] <= s["packs"] and 0.9 < s["fill_rate"] <= 1.0
    assert s["fill_rate"] == pytest.approx(s["tokens"] / (s["packs"] * SEQ), abs=1e-6)


def test_rates_leave_out_the_writers_import(tmp_path, toy_alpaca_rows, run_preprocess, monkeypatch):
    """megatron-core's import (4-10 s on 2 cores) was counted in the build: 200 rows reported 2,900 tokens/s where
    they were written at 195,000. It is setup now, as loading the tokenizer is."""
    import time

    from mindspeed_pack.datasets import pack_writer

    module = pack_writer.indexed_dataset_module()
    calls = []

    def slow_first_import():
        if not calls:
            time.sleep(1.0)
        calls.append(1)
        return module

    monkeypatch.setattr(pack_writer, "indexed_dataset_module", slow_first_import)
    data = toy.write_dataset(tmp_path / "a.jsonl", toy_alpaca_rows[:20])
    code, out, err = run_preprocess(input=data, output_prefix=tmp_path / "a", prompt_type="qwen", seq_length=128,
                                    pack=True)
    assert code == 0, err
    s = json.loads(Path(f"{tmp_path / 'a'}_packed_meta.json").read_text())["statistics"]
    assert s["setup_seconds"] >= 1.0 and s["elapsed_seconds"] - s["setup_seconds"] < 1.0, s
    assert "megatron-core import)" in out


def test_workers_2_output_is_byte_identical_to_workers_1(tmp_path, toy_sharegpt_jsonl, run_preprocess, monkeypatch):
    from mindspeed_pack.datasets import preprocess

    monkeypatch.setattr(preprocess, "CHUNK_ROWS", 37)  # several chunks in flight across both workers
    for workers in (1, 2):
        code, _, err = run_preprocess(**_sg_flags(tmp_path, toy_sharegpt_jsonl, f"w{workers}", pack=True,
                                                  neat_pack=True, workers=workers))
        assert code == 0, err
    names = sorted(p.name[len("w1"):] for p in tmp_path.glob("w1_packed_*_document.*"))
    assert len(names) == 6
    for suffix in names:
        assert (tmp_path / f"w1{suffix}").read_bytes() == (tmp_path / f"w2{suffix}").read_bytes(), suffix


def _sigint_disposition(chunk):
    return signal.getsignal(signal.SIGINT)


def test_ctrl_c_is_left_to_the_main_process_not_a_traceback_per_worker(monkeypatch):
    """Ctrl-C signals the whole process group: the workers ignore it, the main process ends the pool and prints
    one line (each worker printed a KeyboardInterrupt traceback before it)."""
    from mindspeed_pack.datasets import preprocess

    monkeypatch.setattr(preprocess, "_encode_chunk", _sigint_disposition)
    got = list(preprocess.encode_in_order(iter(range(4)), None, workers=2, encoder=object()))
    assert got == [signal.SIG_IGN] * 4
    assert signal.getsignal(signal.SIGINT) is not signal.SIG_IGN


def test_cache_is_reused_then_rebuilt(tmp_path, toy_alpaca_rows, run_preprocess):
    data = toy.write_dataset(tmp_path / "a.jsonl", toy_alpaca_rows[:50])
    flags = dict(input=data, output_prefix=tmp_path / "out" / "a", prompt_type="qwen", seq_length=128, pack=True)
    bin_path = tmp_path / "out" / "a_packed_input_ids_document.bin"
    code, out, _ = run_preprocess(**flags)
    assert code == 0 and "reusing" not in out
    first = bin_path.stat().st_mtime_ns
    code, out, _ = run_preprocess(**flags)
    assert code == 0 and "reusing cached output" in out and bin_path.stat().st_mtime_ns == first
    code, out, _ = run_preprocess(**flags, overwrite_cache=True)
    assert code == 0 and "reusing" not in out and bin_path.stat().st_mtime_ns != first
    # a changed argument or a changed input invalidates the cache
    code, out, _ = run_preprocess(**{**flags, "seq_length": 64})
    assert code == 0 and "reusing" not in out
    toy.write_dataset(data, toy_alpaca_rows[:60])
    os.utime(data, ns=(first + 10**9, first + 10**9))
    code, out, _ = run_preprocess(**{**flags, "seq_length": 64})
    assert code == 0 and "reusing" not in out and "rows read 60" in out
    assert not [p for p in (tmp_path / "out").iterdir() if ".tmp" in p.name or ".tokens" in p.name]


@pytest.mark.parametrize("ext", ["json", "parquet", "arrow", "csv"])
def test_each_input_format_gives_the_jsonl_result(tmp_path, toy_alpaca_rows, run_preprocess, ext):
    """Rows with a ``system`` only where they have one (not on the first): toy.write_dataset's Parquet and Arrow
    took their columns from the first row (pyarrow's from_pylist), so the system column was silently not written."""
    rows = [row if i % 3 == 1 else {k: v for k, v in row.items() if k != "system"}
            for i, row in enumerate(toy_alpaca_rows[:80])]
    outputs = {}
    for e in ("jsonl", ext):
        data = toy.write_dataset(tmp_path / e / f"data.{e}", rows)
        code, _, err = run_preprocess(input=data, output_prefix=tmp_path / f"out_{e}", prompt_type="qwen",
                                      seq_length=128, pack=True, neat_pack=True)
        assert code == 0, err
        outputs[e] = [(tmp_path / f"out_{e}_packed_{k}_document.bin").read_bytes() for k in ("input_ids", "labels", "attention_mask")]
    assert outputs["jsonl"] == outputs[ext]


def test_directory_input_reads_all_files_in_order(tmp_path, toy_alpaca_rows, run_preprocess, read_indexed):
    toy.write_dataset(tmp_path / "d" / "part-0.parquet", toy_alpaca_rows[:30])
    toy.write_dataset(tmp_path / "d" / "part-1.parquet", toy_alpaca_rows[30:50])
    toy.write_dataset(tmp_path / "one.jsonl", toy_alpaca_rows[:50])
    for name, data in (("dir", tmp_path / "d"), ("file", tmp_path / "one.jsonl")):
        code, _, err = run_preprocess(input=data, output_prefix=tmp_path / name, prompt_type="qwen", seq_length=128)
        assert code == 0, err
    a = read_indexed(tmp_path / "dir_packed_input_ids_document")
    b = read_indexed(tmp_path / "file_packed_input_ids_document")
    assert len(a) == 50 and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_pretrain_handler_writes_documents_with_eod(tmp_path, run_preprocess, read_indexed, toy_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(toy_tokenizer_dir))
    rows = toy.generate_pretrain_text(40, seed=3)
    data = toy.write_dataset(tmp_path / "corpus.txt", rows)
    code, out, err = run_preprocess(input=data, output_prefix=tmp_path / "pt", handler_name="GeneralPretrainHandler",
                                    append_eod=True)
    assert code == 0, err
    docs = read_indexed(tmp_path / "pt_text_document")
    assert len(docs) == 40
    for doc, row in zip(docs, rows):
        assert doc[-1] == tok.eos_token_id and tok.decode(doc[:-1].tolist()) == row["text"]


def test_sentencepiece_tokenizer(tmp_path, toy_alpaca_rows, run_preprocess, read_indexed):
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"{r['instruction']} {r['input']} {r['output']}" for r in toy_alpaca_rows))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=120,
                                   pad_id=3, minloglevel=2)
    data = toy.write_dataset(tmp_path / "a.jsonl", toy_alpaca_rows[:40])
    code, _, err = run_preprocess(input=data, output_prefix=tmp_path / "sp_out", tokenizer_type="SentencePiece",
                                  tokenizer_model=tmp_path / "sp.model", tokenizer_name_or_path=None,
                                  prompt_type="alpaca", seq_length=256, pack=True, neat_pack=True)
    assert code == 0, err
    labels = read_indexed(tmp_path / "sp_out_packed_labels_document")
    assert labels and all(len(x) == 256 for x in labels) and any((x != -100).any() for x in labels)


def test_sentencepiece_llama2_answers_take_no_extra_word_mark(tmp_path, run_preprocess, read_indexed):
    # Llama-2's sentencepiece (dummy prefix, whitespace kept): the llama2 template's answer run " {{content}} " alone
    # became a lone "\u2581" (29871) then "\u2581word", trained before every answer; Meta encodes a turn in one call
    import sentencepiece as spm

    words = "paris is the capital of france two plus four hello world cat dog runs".split()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(i % 9 + 3)) for i in range(300)))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=320, hard_vocab_limit=False, minloglevel=2,
                                   remove_extra_whitespaces=False, byte_fallback=True, normalization_rule_name="identity")
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    turns = [("where is paris", "paris is in france"), ("two plus two", "four")]
    row = {"conversations": [{"from": f, "value": v} for q, a in turns for f, v in (("human", q), ("gpt", a))]}
    data = toy.write_dataset(tmp_path / "s.jsonl", [row])
    code, _, err = run_preprocess(input=data, output_prefix=tmp_path / "o", tokenizer_type="SentencePiece",
                                  tokenizer_model=tmp_path / "sp.model", tokenizer_name_or_path=None,
                                  handler_name="SharegptStyleInstructionHandler", prompt_type="llama2", seq_length=128)
    assert code == 0, err
    ids, labels = [], []
    for q, a in turns:  # Meta's chat_completion: [INST] q [/INST] a, one call per turn, BOS and EOS around it
        prompt = [sp.bos_id()] + sp.encode(f"[INST] {q.strip()} [/INST]")
        answer = sp.encode(f"[INST] {q.strip()} [/INST] {a.strip()} ")[len(prompt) - 1:] + [sp.eos_id()]
        ids += prompt + answer
        labels += [-100] * len(prompt) + answer
    (got_ids,), (got_labels,) = read_indexed(tmp_path / "o_packed_input_ids_document"), read_indexed(
        tmp_path / "o_packed_labels_document")
    assert got_ids.tolist() == ids and got_labels.tolist() == labels


def test_inspect_pack_lists_segments_and_draws_mask(sharegpt_outputs, capsys, tmp_path):
    from mindspeed_pack.tools.inspect_pack import main as inspect_main

    png = tmp_path / "mask.png"
    assert inspect_main([str(sharegpt_outputs / "neat"), "--index", "0", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "segment 1" in out and "trained" in out and png.stat().st_size > 1000
    assert inspect_main([str(sharegpt_outputs / "neat"), "--index", "100000"]) == 2
    assert inspect_main([str(sharegpt_outputs / "neat"), "--index", "0", "--context-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "rank 1:" in out and "causal work max/mean 1.0000" in out


@pytest.mark.parametrize("prompt_type", ["empty", "hf"])
def test_first_token_of_a_sample_is_never_trained_even_without_prompt(prompt_type, tmp_path, run_preprocess,
                                                                      read_indexed):
    # an empty instruction under a template that writes nothing around it (the JSON "empty" template, or a model's
    # own template that writes only the messages' text): the answer starts the sample
    rows = [{"instruction": "", "output": f"red cat {'blue ' * i}dog"} for i in range(12)]
    data = toy.write_dataset(tmp_path / "a.jsonl", rows)
    chat_template = None
    if prompt_type == "hf":
        chat_template = tmp_path / "text_only.jinja"
        chat_template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    code, _, err = run_preprocess(input=data, output_prefix=tmp_path / "e", prompt_type=prompt_type, seq_length=64,
                                  pack=True, neat_pack=True, chat_template=chat_template)
    assert code == 0, err
    labels = read_indexed(tmp_path / "e_packed_labels_document")
    ids = read_indexed(tmp_path / "e_packed_input_ids_document")
    segs = read_indexed(tmp_path / "e_packed_attention_mask_document")
    n_segments = 0
    for lab, tok, seg in zip(labels, ids, segs):
        for s in range(1, int(seg.max()) + 1):
            where = np.flatnonzero(seg == s)
            assert lab[where[0]] == -100  # would be the answer's first token
            assert np.array_equal(lab[where[1:]], tok[where[1:]])  # everything else is answer
            n_segments += 1
    assert n_segments == len(rows)


def test_hf_save_to_disk_directory_is_read(tmp_path, toy_alpaca_rows, run_preprocess, read_indexed):
    d = tmp_path / "hf"
    toy.write_dataset(d / "data-00000-of-00001.arrow", toy_alpaca_rows[:25])
    (d / "state.json").write_text("{}")
    (d / "dataset_info.json").write_text("{}")
    code, _, err = run_preprocess(input=d, output_prefix=tmp_path / "hf_out", prompt_type="qwen", seq_length=128)
    assert code == 0, err
    assert len(read_indexed(tmp_path / "hf_out_packed_input_ids_document")) == 25


def test_hf_dataset_dict_directory_names_its_splits(tmp_path, toy_alpaca_rows, run_preprocess):
    """save_to_disk of a DatasetDict (what load_dataset returns): dataset_dict.json beside one directory per split.
    Its metadata file is not data (it was read as the input: "column 'instruction' not found; columns: splits")."""
    d = tmp_path / "dd"
    toy.write_dataset(d / "train" / "data-00000-of-00001.arrow", toy_alpaca_rows[:5])
    (d / "train" / "state.json").write_text("{}")
    (d / "dataset_dict.json").write_text('{"splits": ["train"]}')
    code, _, err = run_preprocess(input=d, output_prefix=tmp_path / "dd_out", prompt_type="qwen", seq_length=128)
    assert code == 2 and f"{d}: a saved HF DatasetDict" in err and str(d / "train") in err, err
    assert not list(tmp_path.glob("dd_out*"))


def test_tokenize_bar_knows_its_total_on_a_terminal(tmp_path, toy_alpaca_rows, run_preprocess, monkeypatch):
    """On a terminal the tokenize bar has the row count as its total (an ETA for a 300k-row corpus), from Parquet's
    metadata and the JSON lines' non-blank lines; it showed a bare counter. Not known without parsing (a JSON
    array, CSV): no total, as before."""
    from mindspeed_pack.data import readers
    from mindspeed_pack.datasets import preprocess

    shards = tmp_path / "shards"
    toy.write_dataset(shards / "part-0.parquet", toy_alpaca_rows[:30])
    toy.write_dataset(shards / "part-1.parquet", toy_alpaca_rows[30:55])
    lines = toy.write_dataset(tmp_path / "a.jsonl", toy_alpaca_rows[:20])
    lines.write_text(lines.read_text().replace("\n", "\n\n", 3))  # blank lines are not rows
    assert readers.count_rows(readers.resolve_input_files(shards)) == 55
    assert readers.count_rows([lines]) == 20
    assert readers.count_rows([toy.write_dataset(tmp_path / "a.json", toy_alpaca_rows[:5])]) is None

    totals = {}
    real = preprocess._Progress

    class Recorded(real):
        def __init__(self, desc, unit, log_interval, total=None):
            totals[desc] = total
            super().__init__(desc, unit, log_interval, total)

    monkeypatch.setattr(preprocess, "_Progress", Recorded)
    monkeypatch.setattr(preprocess.sys.stderr, "isatty", lambda: True, raising=False)
    code, out, err = run_preprocess(input=shards, output_prefix=tmp_path / "out" / "p", prompt_type="qwen",
                                    seq_length=128, pack=True, neat_pack=True)
    assert code == 0, err
    assert totals["tokenize"] == 55 and "rows read 55" in out

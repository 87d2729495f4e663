"""Bad rows inside good data, and input encodings: the row policy of ``mindspeed_pack/data/errors.py``.

A malformed row stops the run naming file, row and field (and ``--skip-bad-rows``); under
``--skip-bad-rows`` it is skipped and counted by reason. Well-formed but unusable rows are
skipped and counted by their true reason without any flag. UTF-8 with a byte-order mark is
read; another encoding is one ``error:`` line naming file, line and byte offset.
"""
import json

import pytest

from mindspeed_pack.data import toy
from tests.chat_corpus import TEMPLATES

CHATML = str(TEMPLATES / "qwen2_5.jinja")  # --prompt-type hf rows: Qwen2.5's own template


def _turns(*roles):
    return {"conversations": [{"from": r, "value": f"{r} says {i}"} for i, r in enumerate(roles)]}


GOOD = _turns("human", "gpt")
SG = dict(handler_name="SharegptStyleInstructionHandler", prompt_type="qwen", seq_length=128)


def _meta(prefix):
    return json.loads(open(f"{prefix}_packed_meta.json").read())


def _write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_unusable_rows_are_skipped_under_their_true_reason(tmp_path, run_preprocess):
    # a system message after position 0 is a known role in the wrong place, not an unknown role;
    # human, human, gpt ends with an answer: its roles are out of order
    rows = [GOOD, _turns("human", "system", "gpt"), _turns("human", "human", "gpt"), _turns("human", "gpt", "human"), GOOD]
    data = toy.write_dataset(tmp_path / "s.jsonl", rows)
    code, out, err = run_preprocess(input=data, output_prefix=tmp_path / "o", **SG)
    assert code == 0, err
    stats = _meta(tmp_path / "o")["statistics"]
    assert stats["samples_written"] == 2
    assert stats["skipped"] == {"system message after the first message": 1, "roles out of order": 1,
                                "conversation does not end with an answer": 1}
    assert stats["first_skipped"]["roles out of order"] == (f"{data}: line 3: turn 1 is a user message where an assistant "
                                                            "answer should be (turns alternate user/tool results and "
                                                            "assistant, from a user turn)")
    assert f"first skipped (system message after the first message): {data}: line 2" in out


@pytest.mark.parametrize("workers", [1, 2])
def test_malformed_row_stops_naming_it_and_the_flag(tmp_path, run_preprocess, workers):
    rows = [json.dumps(GOOD)] * 3 + [json.dumps(_turns("human", "bot"))] + [json.dumps(GOOD)]
    data = _write_lines(tmp_path / "s.jsonl", rows)
    out = tmp_path / "out"
    code, _, err = run_preprocess(input=data, output_prefix=out / "o", workers=workers, **SG)
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err, err
    assert f"{data}: line 4: message 1 has unknown 'from' 'bot'" in err and "--skip-bad-rows" in err
    assert ("known: 'human', 'gpt', 'observation', 'function_call', 'user', 'assistant', 'tool' and 'system' as the "
            "first message") in err
    assert not out.exists() or not any(out.iterdir())


def test_skip_bad_rows_counts_each_reason_with_its_first_row(tmp_path, run_preprocess, read_indexed):
    lines = [json.dumps(GOOD), "{broken", json.dumps(_turns("human", "bot")), json.dumps({"conversations": 3}),
             json.dumps({"other": 1}), json.dumps(_turns("human", "bot")), json.dumps(GOOD)]
    data = _write_lines(tmp_path / "s.jsonl", lines)
    code, out, err = run_preprocess(input=data, output_prefix=tmp_path / "o", skip_bad_rows=True, workers=2, **SG)
    assert code == 0, err
    stats = _meta(tmp_path / "o")["statistics"]
    assert (stats["samples_read"], stats["samples_written"]) == (7, 2)
    assert stats["skipped"] == {"malformed JSON": 1, "unknown role": 2, "wrong type": 1, "missing field": 1}
    assert stats["first_skipped"]["unknown role"].startswith(f"{data}: line 3: message 1 has unknown")
    assert stats["first_skipped"]["malformed JSON"].startswith(f"{data}: line 2: malformed JSON")
    assert stats["first_skipped"]["missing field"].startswith(f"{data}: line 5: missing field 'conversations'")
    assert "2 unknown role" in out and f"first skipped (wrong type): {data}: line 4" in out
    # the good rows are written exactly as a run on the good rows alone writes them
    clean = _write_lines(tmp_path / "clean.jsonl", [json.dumps(GOOD)] * 2)
    assert run_preprocess(input=clean, output_prefix=tmp_path / "c", **SG)[0] == 0
    got, want = read_indexed(tmp_path / "o_packed_input_ids_document"), read_indexed(tmp_path / "c_packed_input_ids_document")
    assert [x.tolist() for x in got] == [x.tolist() for x in want]


def test_malformed_first_line_is_a_bad_row_too(tmp_path, run_preprocess, toy_alpaca_rows):
    data = _write_lines(tmp_path / "a.jsonl", ["{broken"] + [json.dumps(r) for r in toy_alpaca_rows[:3]])
    code, _, err = run_preprocess(input=data, output_prefix=tmp_path / "o", prompt_type="qwen", seq_length=128)
    assert code == 2 and f"{data}: line 1: malformed JSON" in err and "--skip-bad-rows" in err
    code, _, err = run_preprocess(input=data, output_prefix=tmp_path / "o", prompt_type="qwen", seq_length=128,
                                  skip_bad_rows=True)
    assert code == 0, err
    assert json.loads((tmp_path / "o_packed_meta.json").read_text())["statistics"]["skipped"] == {"malformed JSON": 1}


@pytest.mark.parametrize("ext", ["csv", "jsonl", "parquet", "arrow"])
def test_empty_file_in_a_directory_is_skipped_with_a_warning(tmp_path, run_preprocess, toy_alpaca_rows, ext):
    toy.write_dataset(tmp_path / "d" / f"a.{ext}", toy_alpaca_rows[:10])
    (tmp_path / "d" / f"b.{ext}").write_text("")
    code, _, err = run_preprocess(input=tmp_path / "d", output_prefix=tmp_path / "o", prompt_type="qwen", seq_length=128)
    assert code == 0, err
    assert f"warning: {tmp_path / 'd' / f'b.{ext}'}: no rows (an empty file); skipped" in err
    assert _meta(tmp_path / "o")["statistics"]["samples_written"] == 10


def test_data_files_in_a_subdirectory_are_named_not_left_out_silently(tmp_path, run_preprocess, toy_alpaca_rows):
    """--input DIR reads DIR's own files: shards in DIR/part2/ were left out without a word (walk 37)."""
    toy.write_dataset(tmp_path / "d" / "a.jsonl", toy_alpaca_rows[:10])
    toy.write_dataset(tmp_path / "d" / "part2" / "b.jsonl", toy_alpaca_rows[10:20])
    (tmp_path / "d" / ".cache").mkdir()
    toy.write_dataset(tmp_path / "d" / ".cache" / "c.jsonl", toy_alpaca_rows[:2])
    code, _, err = run_preprocess(input=tmp_path / "d", output_prefix=tmp_path / "o", prompt_type="qwen", seq_length=128)
    assert code == 0, err
    warned = [line for line in err.splitlines() if "subdirectory" in line]
    assert warned == [f"warning: {tmp_path / 'd' / 'part2'}: 1 data file(s) in a subdirectory, not read (only "
                      f"{tmp_path / 'd'}'s own files are): pass it as another --input, or move its files up"], err
    assert _meta(tmp_path / "o")["statistics"]["samples_written"] == 10


@pytest.mark.parametrize("ext", ["csv", "jsonl", "json", "txt"])
def test_utf8_with_byte_order_mark_is_read(tmp_path, run_preprocess, toy_alpaca_rows, ext):
    """Excel's "CSV UTF-8" (and some editors) put U+FEFF first: the output equals the file's without it."""
    if ext == "txt":
        rows, flags = toy.generate_pretrain_text(5, seed=1), dict(handler_name="GeneralPretrainHandler")
        rows[0]["text"] = "é " + rows[0]["text"]
    else:
        rows, flags = [dict(r, instruction="é " + r["instruction"]) for r in toy_alpaca_rows[:10]], \
            dict(prompt_type="qwen", seq_length=128)
    plain = toy.write_dataset(tmp_path / "plain" / f"a.{ext}", rows)
    bom = tmp_path / "bom" / f"a.{ext}"
    bom.parent.mkdir()
    bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    outputs = []
    for name, data in (("plain", plain), ("bom", bom)):
        code, _, err = run_preprocess(input=data, output_prefix=tmp_path / name / "o", **flags)
        assert code == 0, err
        outputs.append(sorted((p.name, p.read_bytes()) for p in (tmp_path / name).glob("o_*.bin")))
    assert outputs[0] == outputs[1] and outputs[0]


@pytest.mark.parametrize("ext", ["csv", "jsonl", "json", "txt"])
def test_non_utf8_file_names_line_and_byte(tmp_path, run_preprocess, ext):
    lines = {"csv": ["instruction,output", "a,b", "caf\xe9,b"],
             "jsonl": ['{"instruction": "a", "output": "b"}', '{"instruction": "caf\xe9", "output": "b"}'],
             "json": ['[{"instruction": "a", "output": "b"},', '{"instruction": "caf\xe9", "output": "b"}]'],
             "txt": ["a", "caf\xe9"]}[ext]
    data = tmp_path / f"latin1.{ext}"
    data.write_bytes("\n".join(lines).encode("latin-1") + b"\n")
    offset = len("\n".join(lines[:-1]).encode()) + 1 + lines[-1].index("\xe9")
    flags = dict(handler_name="GeneralPretrainHandler") if ext == "txt" else dict(prompt_type="qwen", seq_length=128)
    out = tmp_path / "out"
    code, _, err = run_preprocess(input=data, output_prefix=out / "o", **flags)
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err, err
    assert f"{data}: line {len(lines)}: byte 0xe9 at byte offset {offset} is not UTF-8 text" in err
    assert not out.exists() or not any(out.iterdir())


def test_openai_messages_need_only_the_role_and_content_keys_with_a_json_template(tmp_path, run_preprocess,
                                                                                 read_indexed):
    """docs/chat_templates.md's OpenAI --map-keys: the named templates read OpenAI's role names too (they said
    "unknown 'role' 'user'", while --prompt-type hf read them)."""
    row = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say one"},
                        {"role": "assistant", "content": "one"}]}
    keys = json.dumps({"messages": "messages", "role": "role", "content": "content"})
    data = toy.write_dataset(tmp_path / "o.jsonl", [row])
    sharegpt = toy.write_dataset(tmp_path / "s.jsonl", [{"conversations": [
        {"from": "human", "value": "say one"}, {"from": "gpt", "value": "one"}], "system": "be brief"}])
    assert run_preprocess(input=data, output_prefix=tmp_path / "o", map_keys=keys, **SG)[0] == 0
    assert run_preprocess(input=sharegpt, output_prefix=tmp_path / "s", **SG)[0] == 0
    assert [list(x) for x in read_indexed(tmp_path / "o_packed_input_ids_document")] == \
        [list(x) for x in read_indexed(tmp_path / "s_packed_input_ids_document")]


@pytest.mark.parametrize("prompt_type", ["qwen", "hf"])
def test_an_empty_answer_is_skipped_as_empty_text(tmp_path, run_preprocess, prompt_type):
    """README: well-formed rows with empty text are skipped and counted (they were written, training only EOS)."""
    rows = [{"instruction": "hi", "input": "", "output": ""}, {"instruction": "", "input": "", "output": "x"},
            {"instruction": "", "input": "", "output": "  "}, {"instruction": "say", "input": "", "output": "x"}]
    data = toy.write_dataset(tmp_path / "a.jsonl", rows)
    extra = {"chat_template": CHATML} if prompt_type == "hf" else {}
    code, _, err = run_preprocess(input=data, output_prefix=tmp_path / "o", handler_name="AlpacaStyleInstructionHandler",
                                  prompt_type=prompt_type, seq_length=128, **extra)
    assert code == 0, err
    stats = _meta(tmp_path / "o")["statistics"]
    assert stats["samples_written"] == 2 and stats["skipped"] == {"empty text or conversation": 2}
    assert stats["first_skipped"]["empty text or conversation"] == f"{data}: line 1"


def test_csv_and_jsonl_errors_name_the_line_and_column(tmp_path, run_preprocess, read_indexed):
    csv = tmp_path / "a.csv"
    csv.write_text('instruction,input,output\nsay,one,one\n"only one column"\nsay,two,two\n')
    code, _, err = run_preprocess(input=csv, output_prefix=tmp_path / "c", handler_name="AlpacaStyleInstructionHandler",
                                  prompt_type="qwen", seq_length=128)
    assert code == 2 and f"{csv}: line 3: malformed CSV row: expected 3 columns, got 1" in err, err
    code, _, err = run_preprocess(input=csv, output_prefix=tmp_path / "c", handler_name="AlpacaStyleInstructionHandler",
                                  prompt_type="qwen", seq_length=128, skip_bad_rows=True)
    assert code == 0, err
    stats = _meta(tmp_path / "c")["statistics"]
    assert stats["samples_written"] == 2 and stats["skipped"] == {"malformed CSV row": 1}
    cut = _write_lines(tmp_path / "cut.jsonl", ['{"instruction": "x", "output": "y"}', '{"instruction": "x", "output": "y"'])
    code, _, err = run_preprocess(input=cut, output_prefix=tmp_path / "j", handler_name="AlpacaStyleInstructionHandler",
                                  prompt_type="qwen", seq_length=128)
    assert code == 2 and f"{cut}: line 2: malformed JSON at column 35" in err, err
    null = toy.write_dataset(tmp_path / "n.jsonl", [{"instruction": "x", "output": None}])
    code, _, err = run_preprocess(input=null, output_prefix=tmp_path / "n", handler_name="AlpacaStyleInstructionHandler",
                                  prompt_type="qwen", seq_length=128)
    assert code == 2 and f"{null}: line 1: field 'output' (--map-keys response) is null" in err, err


def test_an_empty_map_keys_name_means_no_such_column(tmp_path, run_preprocess):
    """MindSpeed-LLM's pairwise scripts pass --map-keys '{"query": ""}': no such column (it was "column '' not
    found"); an empty name for a column the handler needs is refused by name."""
    rows = [{"instruction": "say one", "chosen": "one", "rejected": "two"}] * 2
    data = toy.write_dataset(tmp_path / "p.jsonl", rows)
    flags = dict(input=data, handler_name="AlpacaStylePairwiseHandler", prompt_type="qwen", seq_length=128)
    keys = {"prompt": "instruction", "query": "", "chosen": "chosen", "rejected": "rejected"}
    code, _, err = run_preprocess(output_prefix=tmp_path / "o", map_keys=json.dumps(keys), **flags)
    assert code == 0, err
    assert _meta(tmp_path / "o")["statistics"]["samples_written"] == 4  # two pairs, two answers each
    code, _, err = run_preprocess(output_prefix=tmp_path / "bad", map_keys=json.dumps({**keys, "chosen": ""}), **flags)
    assert code == 2 and "--map-keys: 'chosen' is empty, but AlpacaStylePairwiseHandler reads that column" in err


def test_a_large_csv_with_multiline_values_is_read(tmp_path):
    """Quoted values spanning lines (answers with newlines, as csv.writer and pandas write them) in a CSV larger than
    pyarrow's 1 MiB read block: every row is read as the csv module reads it (it was refused as 'malformed CSV:
    CSV parser got out of sync with chunker')."""
    import csv

    from mindspeed_pack.data import readers

    path = tmp_path / "multiline.csv"
    rows = [[f"q{i}\nline two", f"a{i} " + 'x\ny, "z"\n' * (i % 30)] for i in range(8000)]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["instruction", "output"])
        writer.writerows(rows)
    assert path.stat().st_size > 1 << 20
    got = [(where, row) for chunk in readers.iter_chunks([path], 1000) for where, row in readers.chunk_rows(chunk)]
    assert [[r["instruction"], r["output"]] for _, r in got] == rows
    assert got[-1][0] == f"{path}: row {len(rows)}"
    # one value longer than pyarrow's 1 MiB block, after other rows: it 'straddled two block boundaries'
    rows = [[f"q{i}", f"a{i}"] for i in range(2000)] + [["long", "line\n" * 700_000], ["last", "z"]]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["instruction", "output"])
        writer.writerows(rows)
    got = [row for chunk in readers.iter_chunks([path], 1000) for _, row in readers.chunk_rows(chunk)]
    assert [[r["instruction"], r["output"]] for r in got] == rows


@pytest.mark.parametrize("tags", [
    {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
     "system_tag": "system"},  # MindSpeed-LLM's documented OpenAI form
    {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"},
])
def test_map_keys_tags_as_mindspeed_llm_documents_them(tmp_path, run_preprocess, read_indexed, tags):
    """MindSpeed-LLM's ShareGPT --map-keys nests the role and content names under "tags"
    ('{"messages": "messages", "tags": {"role_tag": "role", ...}}'): read as the same names given flat (it was
    "unknown key 'tags'")."""
    rows = [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say one"},
                          {"role": "assistant", "content": "one"}]}] * 2
    data = toy.write_dataset(tmp_path / "m.jsonl", rows)
    flags = dict(input=data, handler_name="SharegptStyleInstructionHandler", prompt_type="qwen", seq_length=128)
    code, _, err = run_preprocess(output_prefix=tmp_path / "flat", map_keys=json.dumps({"messages": "messages", **tags}),
                                  **flags)
    assert code == 0, err
    code, _, err = run_preprocess(output_prefix=tmp_path / "tags", map_keys=json.dumps({"messages": "messages",
                                                                                        "tags": tags}), **flags)
    assert code == 0, err
    for key in ("input_ids", "labels"):
        flat, nested = (read_indexed(tmp_path / f"{p}_packed_{key}_document") for p in ("flat", "tags"))
        assert [a.tolist() for a in flat] == [b.tolist() for b in nested]
    code, _, err = run_preprocess(output_prefix=tmp_path / "bad", map_keys=json.dumps({"tags": {"speaker": "role"}}),
                                  **flags)
    assert code == 2 and "--map-keys: unknown key 'speaker' in 'tags'" in err, err
    code, _, err = run_preprocess(output_prefix=tmp_path / "twice", map_keys=json.dumps(
        {"messages": "messages", "role": "speaker", "tags": tags}), **flags)  # which one? it took the flat one
    assert code == 2 and "--map-keys: role_tag given both in 'tags' and beside it" in err, err


def test_mindspeed_llms_openai_handler_reads_openai_rows(tmp_path, run_preprocess, read_indexed):
    """MindSpeed-LLM's --handler-name OpenAIInstructionHandler (OpenAI rows: messages of role/content, tool calls,
    tool results) was refused as an unknown choice: it is the ShareGPT handler under OpenAI's key names, giving the
    packs of --map-keys '{"messages": "messages", "role": "role", "content": "content"}'."""
    call = {"type": "function", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}
    rows = [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say one"},
                          {"role": "assistant", "content": "one"}]},
            {"messages": [{"role": "user", "content": "time?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                          {"role": "tool", "content": "12:00"}, {"role": "assistant", "content": "noon"}]}]
    data = toy.write_dataset(tmp_path / "m.jsonl", rows)
    flags = dict(input=data, prompt_type="qwen2_5", seq_length=128)
    code, _, err = run_preprocess(output_prefix=tmp_path / "mapped", handler_name="SharegptStyleInstructionHandler",
                                  map_keys=json.dumps({"messages": "messages", "role": "role", "content": "content"}),
                                  **flags)
    assert code == 0, err
    code, _, err = run_preprocess(output_prefix=tmp_path / "openai", handler_name="OpenAIInstructionHandler", **flags)
    assert code == 0, err
    for key in ("input_ids", "labels"):
        mapped, openai = (read_indexed(tmp_path / f"{p}_packed_{key}_document") for p in ("mapped", "openai"))
        assert len(openai) == 2 and [a.tolist() for a in mapped] == [b.tolist() for b in openai]


def test_a_json_object_of_columns_is_read_as_its_rows(tmp_path, run_preprocess, read_indexed):
    """A .json file holding one object of equal-length columns, written over several lines (json.dump(..., indent=2)
    of a dict of lists), is read as its rows, as HF datasets' json loader reads it; it was taken for JSON lines and
    refused as 'line 1: malformed JSON'. Another pretty-printed object is refused as what it is."""
    rows = [{"instruction": f"say {i}", "output": f"{i}"} for i in range(3)]
    toy.write_dataset(tmp_path / "rows.json", rows)
    (tmp_path / "cols.json").write_text(json.dumps({k: [r[k] for r in rows] for k in rows[0]}, indent=2))
    flags = dict(handler_name="AlpacaStyleInstructionHandler", prompt_type="qwen", seq_length=128)
    for name in ("rows", "cols"):
        code, _, err = run_preprocess(input=tmp_path / f"{name}.json", output_prefix=tmp_path / name, **flags)
        assert code == 0, err
    for key in ("input_ids", "labels"):
        a, b = (read_indexed(tmp_path / f"{p}_packed_{key}_document") for p in ("rows", "cols"))
        assert [x.tolist() for x in a] == [y.tolist() for y in b]
    (tmp_path / "one.json").write_text(json.dumps({"instruction": "say", "output": ["a", "b"], "n": 3}, indent=2))
    code, _, err = run_preprocess(input=tmp_path / "one.json", output_prefix=tmp_path / "one", **flags)
    assert code == 2 and f"{tmp_path / 'one.json'}: one JSON object that is not columns of equal length" in err, err


def test_csv_rows_after_a_malformed_one_keep_their_numbers(tmp_path, run_preprocess):
    """Under --skip-bad-rows a CSV row is named by its number in the file, counting the malformed rows before it
    (pyarrow's reader drops those: the rows after one were named one number too low), blank lines not counted."""
    csv = tmp_path / "a.csv"
    csv.write_text('instruction,output,history\nsay,one,[]\n"only one column"\n\nsay,"two\nlines",[]\n'
                   'too,many,[],columns\nsay,three,[["a"\n')
    code, out, err = run_preprocess(input=csv, output_prefix=tmp_path / "c", handler_name="AlpacaStyleInstructionHandler",
                                    prompt_type="qwen", seq_length=128, skip_bad_rows=True)
    assert code == 0, err
    first = _meta(tmp_path / "c")["statistics"]["first_skipped"]
    assert first["malformed CSV row"].startswith(f"{csv}: line 3: malformed CSV row: expected 3 columns, got 1")
    assert first["malformed JSON"].startswith(f"{csv}: row 5: field 'history' is not valid JSON"), first


@pytest.mark.parametrize("prompt_type", ["qwen", "hf"])
def test_an_empty_instruction_leaves_the_input_alone_as_the_prompt(tmp_path, run_preprocess, read_indexed,
                                                                    prompt_type):
    """Alpaca rows whose question is all in ``input`` (``instruction`` empty): the prompt is the input, as
    LLaMA-Factory and MindSpeed-LLM join the non-empty parts with a newline; it was ``"\\n" + input``, a token the
    same row never has in their data."""
    flags = dict(prompt_type=prompt_type, seq_length=128, **({"chat_template": CHATML} if prompt_type == "hf" else {}))
    documents = {}
    for name, row in (("in_input", {"instruction": "", "input": "two plus two?", "output": "four"}),
                      ("in_instruction", {"instruction": "two plus two?", "input": "", "output": "four"})):
        data = toy.write_dataset(tmp_path / f"{name}.jsonl", [row])
        code, _, err = run_preprocess(input=data, output_prefix=tmp_path / name, **flags)
        assert code == 0, err
        documents[name] = [d.tolist() for d in read_indexed(tmp_path / f"{name}_packed_input_ids_document")]
    assert documents["in_input"] == documents["in_instruction"]

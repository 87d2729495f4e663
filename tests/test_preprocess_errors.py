"""Bad input: a clear ``error: ...`` naming file, row and field, exit code 2, and no files left behind."""
import json
import os
import shutil

import pytest

from mindspeed_pack.data import toy
from tests.chat_corpus import TEMPLATES

CHATML_JINJA = str(TEMPLATES / "qwen2_5.jinja")  # --prompt-type hf rows below: Qwen2.5's own template


def _assert_failed_cleanly(result, out_dir, *needles):
    code, _, err = result
    assert code == 2, err
    assert err.startswith("error: "), err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"
    assert not out_dir.exists() or not any(out_dir.iterdir()), sorted(p.name for p in out_dir.iterdir())


@pytest.fixture
def alpaca_file(tmp_path, toy_alpaca_rows):
    return toy.write_dataset(tmp_path / "in" / "a.jsonl", toy_alpaca_rows[:20])


def _flags(data, out_dir, **extra):
    flags = dict(input=data, output_prefix=out_dir / "p", prompt_type="qwen", seq_length=128, pack=True, neat_pack=True)
    flags.update(extra)
    return flags


def test_malformed_json_line_names_file_and_line(tmp_path, run_preprocess, toy_alpaca_rows):
    data = tmp_path / "bad.jsonl"
    lines = [json.dumps(r) for r in toy_alpaca_rows[:5]]
    lines[2] = lines[2][:-3]  # cut the closing quote and brace
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    _assert_failed_cleanly(run_preprocess(**_flags(data, out)), out, "bad.jsonl: line 3", "malformed JSON")


def test_malformed_json_array_names_line(tmp_path, run_preprocess):
    data = tmp_path / "bad.json"
    data.write_text('[\n{"instruction": "a", "output": "b"},\n{"instruction": "a" "output": "b"}\n]\n')
    out = tmp_path / "out"
    _assert_failed_cleanly(run_preprocess(**_flags(data, out)), out, "bad.json: line 3", "malformed JSON")


def test_missing_mapped_column_lists_existing_columns(tmp_path, run_preprocess, alpaca_file):
    out = tmp_path / "out"
    result = run_preprocess(**_flags(alpaca_file, out, map_keys='{"prompt": "question"}'))
    _assert_failed_cleanly(result, out, "a.jsonl", "'question'", "--map-keys prompt", "instruction, input, output, system")


def test_mapped_column_on_later_json_lines_only_is_read(tmp_path, run_preprocess):
    """JSON lines whose tools/system keys are only on the rows that have them (HF datasets reads the others as null):
    a --map-keys naming them is not refused because the first row lacks them; a name no row holds still is."""
    schema = {"type": "function", "function": {"name": "lookup", "description": "d", "parameters": {"type": "object"}}}
    rows = [{"dialog": [{"speaker": "USER", "text": "hi"}, {"speaker": "BOT", "text": "hello"}]},
            {"sys": "be brief", "funcs": json.dumps([schema]), "dialog": [
                {"speaker": "USER", "text": "look it up"}, {"speaker": "CALL", "text": '{"name": "lookup", "arguments": {}}'},
                {"speaker": "OBS", "text": "found"}, {"speaker": "BOT", "text": "done"}]}]
    data = toy.write_dataset(tmp_path / "in" / "sg.jsonl", rows)
    keys = {"messages": "dialog", "role_tag": "speaker", "content_tag": "text", "user_tag": "USER", "assistant_tag": "BOT",
            "function_tag": "CALL", "observation_tag": "OBS", "system": "sys", "tools": "funcs"}
    out = tmp_path / "out"
    code, _, err = run_preprocess(**_flags(data, out, prompt_type="qwen2_5", handler_name="SharegptStyleInstructionHandler",
                                           map_keys=json.dumps(keys), seq_length=512))
    assert code == 0, err
    stats = json.loads((out / "p_packed_meta.json").read_text())["statistics"]
    assert (stats["rows_read"], stats["samples_written"], stats["skipped"]) == (2, 2, {})
    plain = [rows[0], {"dialog": rows[1]["dialog"]}]  # the same rows without system text and tools: fewer tokens
    code, _, err = run_preprocess(**_flags(toy.write_dataset(tmp_path / "in2" / "sg.jsonl", plain), tmp_path / "plain",
                                           prompt_type="qwen2_5", handler_name="SharegptStyleInstructionHandler",
                                           map_keys=json.dumps({k: v for k, v in keys.items() if k not in ("system", "tools")}),
                                           seq_length=512))
    assert code == 0, err
    assert json.loads((tmp_path / "plain" / "p_packed_meta.json").read_text())["statistics"]["tokens"] < stats["tokens"]
    out = tmp_path / "typo"
    result = run_preprocess(**_flags(data, out, prompt_type="qwen2_5", handler_name="SharegptStyleInstructionHandler",
                                     map_keys=json.dumps({**keys, "tools": "fucns"})))
    _assert_failed_cleanly(result, out, "sg.jsonl: column 'fucns' (--map-keys tools) not found; columns: dialog")


def test_missing_column_in_parquet(tmp_path, run_preprocess, toy_alpaca_rows):
    data = toy.write_dataset(tmp_path / "a.parquet", [{"instruction": r["instruction"]} for r in toy_alpaca_rows[:5]])
    out = tmp_path / "out"
    _assert_failed_cleanly(run_preprocess(**_flags(data, out)), out, "a.parquet", "'output'", "columns: instruction")


def test_missing_field_in_one_row_names_the_line(tmp_path, run_preprocess, toy_alpaca_rows):
    rows = [dict(r) for r in toy_alpaca_rows[:6]]
    del rows[4]["output"]
    data = toy.write_dataset(tmp_path / "a.jsonl", rows)
    out = tmp_path / "out"
    _assert_failed_cleanly(run_preprocess(**_flags(data, out)), out, "a.jsonl: line 5", "missing field 'output'")


def test_unknown_sharegpt_role_names_row_and_message(tmp_path, run_preprocess):
    rows = toy.generate_sharegpt(4, seed=0, turns=(1, 1))
    rows[1]["conversations"][1]["from"] = "bot"
    data = toy.write_dataset(tmp_path / "s.jsonl", rows)
    out = tmp_path / "out"
    result = run_preprocess(**_flags(data, out, handler_name="SharegptStyleInstructionHandler"))
    _assert_failed_cleanly(result, out, "s.jsonl: line 2", "message 1", "'bot'", "'gpt'")


def test_unknown_template_lists_known(tmp_path, run_preprocess, alpaca_file):
    out = tmp_path / "out"
    _assert_failed_cleanly(run_preprocess(**_flags(alpaca_file, out, prompt_type="nope")), out,
                           "unknown --prompt-type 'nope'", "qwen", "llama3")


def test_tokenizer_without_eos_or_pad(tmp_path, run_preprocess, alpaca_file, toy_tokenizer_dir):
    tok = tmp_path / "tok"
    shutil.copytree(toy_tokenizer_dir, tok)
    config = json.loads((tok / "tokenizer_config.json").read_text())
    config.pop("eos_token", None)
    config.pop("pad_token", None)
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    # alpaca ends answers with the tokenizer's EOS (qwen/chatml would make their stop word the EOS)
    _assert_failed_cleanly(run_preprocess(**_flags(alpaca_file, out, tokenizer_name_or_path=tok, prompt_type="alpaca")),
                           out, "has no EOS token", str(tok))


def test_neat_pack_without_pack(tmp_path, run_preprocess, alpaca_file):
    out = tmp_path / "out"
    _assert_failed_cleanly(run_preprocess(**_flags(alpaca_file, out, pack=False)), out, "--neat-pack requires --pack")


@pytest.mark.parametrize("seq_length", [1, 0, -5])
def test_seq_length_below_two(tmp_path, run_preprocess, alpaca_file, seq_length):
    out = tmp_path / "out"
    _assert_failed_cleanly(run_preprocess(**_flags(alpaca_file, out, seq_length=seq_length)), out,
                           "--seq-length must be >= 2")


@pytest.mark.parametrize("content", ["", "\n\n"])
def test_empty_input(tmp_path, run_preprocess, content):
    data = tmp_path / "empty.jsonl"
    data.write_text(content)
    out = tmp_path / "out"
    _assert_failed_cleanly(run_preprocess(**_flags(data, out)), out, "empty input", "empty.jsonl")


def test_unsupported_extension(tmp_path, run_preprocess):
    data = tmp_path / "data.xml"
    data.write_text("<rows/>")
    out = tmp_path / "out"
    _assert_failed_cleanly(run_preprocess(**_flags(data, out)), out, "data.xml", "unsupported file extension '.xml'", "jsonl")


def test_damaged_parquet_names_the_file(tmp_path, run_preprocess, toy_alpaca_rows):
    """A shard cut short (a partial download) is one error line naming it, not pyarrow's traceback."""
    whole = toy.write_dataset(tmp_path / "d" / "a.parquet", toy_alpaca_rows[:3]).read_bytes()
    (tmp_path / "d" / "b.parquet").write_bytes(whole[:len(whole) // 2])
    out = tmp_path / "out"
    _assert_failed_cleanly(run_preprocess(**_flags(tmp_path / "d", out)), out, "b.parquet: not a readable Parquet file")


def test_compressed_file_in_a_directory_is_not_left_out_silently(tmp_path, run_preprocess, toy_alpaca_rows):
    import gzip

    toy.write_dataset(tmp_path / "d" / "a.jsonl", toy_alpaca_rows[:3])
    (tmp_path / "d" / "b.jsonl.gz").write_bytes(gzip.compress(b"{}\n"))
    out = tmp_path / "out"
    _assert_failed_cleanly(run_preprocess(**_flags(tmp_path / "d", out)), out, "b.jsonl.gz: compressed input is not "
                           "read; decompress it first")


def test_mixed_directory(tmp_path, run_preprocess, toy_alpaca_rows):
    toy.write_dataset(tmp_path / "d" / "a.jsonl", toy_alpaca_rows[:3])
    toy.write_dataset(tmp_path / "d" / "b.parquet", toy_alpaca_rows[:3])
    out = tmp_path / "out"
    _assert_failed_cleanly(run_preprocess(**_flags(tmp_path / "d", out)), out, "mixed input formats", "jsonl", "parquet")


def test_missing_input(tmp_path, run_preprocess):
    out = tmp_path / "out"
    _assert_failed_cleanly(run_preprocess(**_flags(tmp_path / "nothing.jsonl", out)), out, "does not exist")


def test_bad_map_keys_json(tmp_path, run_preprocess, alpaca_file):
    out = tmp_path / "out"
    _assert_failed_cleanly(run_preprocess(**_flags(alpaca_file, out, map_keys="{prompt: x}")), out, "--map-keys is not valid JSON")


def test_error_in_a_worker_reaches_the_user_and_cleans_up(tmp_path, run_preprocess, toy_alpaca_rows, monkeypatch):
    from mindspeed_pack.datasets import preprocess

    monkeypatch.setattr(preprocess, "CHUNK_ROWS", 10)
    lines = [json.dumps(r) for r in toy_alpaca_rows[:60]]
    lines[47] = "{not json"
    data = tmp_path / "late.jsonl"
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    _assert_failed_cleanly(run_preprocess(**_flags(data, out, workers=2)), out, "late.jsonl: line 48")


def test_failed_rebuild_keeps_previous_complete_output(tmp_path, run_preprocess, alpaca_file):
    out = tmp_path / "out"
    assert run_preprocess(**_flags(alpaca_file, out))[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with open(alpaca_file, "a") as f:
        f.write("{broken\n")
    code, _, err = run_preprocess(**_flags(alpaca_file, out))
    assert code == 2 and "a.jsonl: line 21" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_row_errors_name_the_location_once_and_what_a_message_lacks(tmp_path, run_preprocess, toy_tokenizer_dir):
    """The hf path's row errors name file and line once; a rejected answer given as a message without text says
    so (not "missing"), and one that carries tool calls is refused rather than trained without them."""
    rows = [{"instruction": "a", "output": "b"}, {"instruction": "a"}]
    data = toy.write_dataset(tmp_path / "a.jsonl", rows)
    out = tmp_path / "out"
    code, _, err = run_preprocess(**_flags(data, out, prompt_type="hf", chat_template=CHATML_JINJA))
    _assert_failed_cleanly((code, "", err), out, f"{data}: line 2: missing field 'output'")
    assert err.count(f"{data}: line 2") == 1, err
    pair = {"conversations": [{"from": "human", "value": "q"}], "chosen": {"from": "gpt", "value": "a"},
            "rejected": {"from": "gpt"}}
    called = dict(pair, rejected={"from": "gpt", "value": "", "tool_calls": [{"name": "f", "arguments": {}}]})
    for row, needle in ((pair, "field 'rejected' (--map-keys rejected) is a message with no text in 'value' "
                                "(--map-keys content_tag); the message has: from"),
                        (called, "field 'rejected' (--map-keys rejected) has 'tool_calls', which a preference answer "
                                  "cannot carry (refused, not dropped)")):
        for prompt_type in ("qwen", "hf"):
            data = toy.write_dataset(tmp_path / "p.jsonl", [row])
            extra = {"chat_template": CHATML_JINJA} if prompt_type == "hf" else {}
            result = run_preprocess(**_flags(data, out, prompt_type=prompt_type,
                                             handler_name="SharegptStylePairwiseHandler", **extra))
            _assert_failed_cleanly(result, out, f"{data}: line 1: {needle}")


def test_preprocessing_prints_no_megatron_kernel_warnings(tmp_path, toy_alpaca_rows, toy_tokenizer_dir):
    """A fresh preprocessing process imports megatron-core only to write indexed datasets: none of its Transformer
    Engine/Apex fallback warnings (they concern training kernels) reach the user."""
    import subprocess
    import sys
    from pathlib import Path

    data = toy.write_dataset(tmp_path / "a.jsonl", toy_alpaca_rows[:5])
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "preprocess_data.py"), "--input", str(data), "--output-prefix",
                           str(tmp_path / "o"), "--tokenizer-name-or-path", str(toy_tokenizer_dir), "--prompt-type",
                           "qwen", "--seq-length", "128", "--pack", "--neat-pack"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              filter(None, [str(root), os.environ.get("PYTHONPATH")]))})
    assert proc.returncode == 0, proc.stderr
    assert "packs " in proc.stdout and proc.stderr.strip() == "", proc.stderr


@pytest.mark.parametrize("kind", ["packs", "documents"])
def test_full_disk_is_one_error_line_and_keeps_the_previous_output(tmp_path, run_preprocess, alpaca_file, monkeypatch,
                                                                   kind):
    """The indexed-dataset writer's ENOSPC (a raw OSError traceback before): one line naming the output prefix and
    the space needed; the previous complete output stays, and no temporary file is left."""
    import errno

    from mindspeed_pack.datasets import pack_writer

    out = tmp_path / "out"
    if kind == "packs":
        flags = _flags(alpaca_file, out)
    else:
        docs = tmp_path / "docs.jsonl"
        docs.write_text("".join(json.dumps({"text": f"document {i} " * (i + 3)}) + "\n" for i in range(20)))
        flags = dict(input=docs, output_prefix=out / "p", handler_name="GeneralPretrainHandler", append_eod=True)
    assert run_preprocess(**flags)[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_builder = pack_writer._builder

    class FullDisk:
        def __init__(self, *args, **kwargs):
            self.inner, self.items = real_builder(*args, **kwargs), 0

        def add_document(self, *args, **kwargs):
            self.items += 1
            if self.items > 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.inner.add_document(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    monkeypatch.setattr(pack_writer, "_builder", FullDisk)
    code, _, err = run_preprocess(**flags, overwrite_cache=True)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: --output-prefix {out / 'p'}: the disk is full: this needs about "), err
    assert "GiB are free there" in err and "nothing was written there" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no temporary or partial file either


def test_dry_run_checks_the_flags_and_writes_nothing(tmp_path, run_preprocess):
    """--dry-run (the example scripts' DRY_RUN=1): the parser and its combination checks, nothing read or written
    (the input need not exist yet)."""
    common = dict(input=str(tmp_path / "not_yet.jsonl"), output_prefix=str(tmp_path / "out" / "p"),
                  handler_name="AlpacaStyleInstructionHandler", prompt_type="qwen", seq_length=128, dry_run=True)
    code, out, err = run_preprocess(pack=True, neat_pack=True, **common)
    assert code == 0 and "preprocess_data.py arguments OK" in out, err
    code, out, err = run_preprocess(neat_pack=True, **common)
    assert code == 2 and "--neat-pack requires --pack" in err
    assert not (tmp_path / "out").exists()


def test_output_prefix_naming_a_directory_is_refused_before_any_work(tmp_path, run_preprocess, alpaca_file):
    """``--output-prefix out/sft/`` (a directory, not a prefix): refused by the flag check, --dry-run included; it
    tokenised the whole input, then stopped with a FileNotFoundError traceback from the final rename."""
    out = tmp_path / "out"
    for dry_run in (True, False):
        code, _, err = run_preprocess(**_flags(alpaca_file, out, output_prefix=f"{out}/", dry_run=dry_run))
        assert code == 2 and err.startswith(f"error: --output-prefix {out}/ names a directory"), err
        assert f"{out}/NAME" in err and "Traceback" not in err, err
    assert not out.exists() or not any(out.iterdir())


def test_output_prefix_under_a_file_is_one_error_line(tmp_path, run_preprocess, alpaca_file):
    """A prefix whose directory cannot be made (a file in its path): one ``error:`` line naming the prefix and the
    cause, not a NotADirectoryError traceback."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a directory")
    code, _, err = run_preprocess(**_flags(alpaca_file, blocker, output_prefix=blocker / "sub" / "p"))
    assert code == 2 and err.startswith(f"error: --output-prefix {blocker / 'sub' / 'p'}: cannot create"), err
    assert "Not a directory" in err and "Traceback" not in err, err


def test_unknown_template_points_at_the_models_own(tmp_path, run_preprocess, alpaca_file):
    """A MindSpeed-LLM --prompt-type this templates.json lacks (deepseek3, chatglm3, mistral): the error says how to
    train with it anyway (--prompt-type hf, or an entry in a --prompt-type-path file), not only what is known."""
    out = tmp_path / "out"
    _assert_failed_cleanly(run_preprocess(**_flags(alpaca_file, out, prompt_type="deepseek3")), out,
                           "unknown --prompt-type 'deepseek3'", "--prompt-type hf", "--prompt-type-path")


def test_an_older_mindspeed_llm_handler_name_names_the_handler_that_reads_its_rows(tmp_path, run_preprocess,
                                                                                     alpaca_file, capsys):
    """argparse's 'invalid choice' listed the names without saying which one reads the rows."""
    with pytest.raises(SystemExit) as exit_:
        run_preprocess(**_flags(alpaca_file, tmp_path / "out", handler_name="GeneralInstructionHandler"))
    assert exit_.value.code == 2
    assert ("argument --handler-name: GeneralInstructionHandler is an older MindSpeed-LLM handler: use "
            "AlpacaStyleInstructionHandler") in capsys.readouterr().err


def test_openai_rows_under_the_sharegpt_handler_name_the_openai_handler(tmp_path, run_preprocess):
    """OpenAI rows (``messages`` of role/content) read with SharegptStyleInstructionHandler's default keys: the
    missing 'conversations' column names MindSpeed-LLM's OpenAIInstructionHandler, which reads them."""
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    data = toy.write_dataset(tmp_path / "in" / "m.jsonl", rows)
    out = tmp_path / "out"
    _assert_failed_cleanly(run_preprocess(**_flags(data, out, handler_name="SharegptStyleInstructionHandler")), out,
                           "column 'conversations'", "--handler-name OpenAIInstructionHandler")

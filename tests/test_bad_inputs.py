"""The bad-input corpus: every file under tests/bad_inputs/ is one reported bad input.

A case is a small JSON file::

    {"what": "one line: the bad input",
     "tool": "preprocess" | "convert" | "posttrain" | "pretrain",
     "base": "none" | "packed" | "text" | "hf" | "mg",   generated inputs copied into the case dir
     "edits": [...],                                      how the input is broken (below)
     "args": ["--flag", "{dir}/..."],                     {dir}: the case dir, {tokenizer}: a toy tokenizer
     "expect": "regex the one-line error must match"}

Edits: ``{"write": PATH, "text": S}`` (optionally ``"encoding": E``, default utf-8), ``{"truncate": PATH, "drop_bytes": N}``,
``{"copy": SRC, "to": DST}``, ``{"set_token": PATH, "index": I, "value": V}`` (an int32 of a
``.bin``), ``{"flip_byte": PATH, "offset": B}`` (its bits inverted), ``{"json_set": PATH, "key": K, "value": V}``,
``{"crafted_pickle": PATH}`` (a
pickle whose loading would create ``{dir}/MARKER``). Every case must exit with code 2 and one
``error:`` line (no traceback), create no ``MARKER``, change no input, and leave ``{dir}/out``
absent or empty. A newly reported bad input becomes one more file.
"""
import glob
import hashlib
import json
import os
import re
import shutil
import sys

import numpy as np
import pytest
import torch

from tests.data_utils import random_documents, write_packed_instruction_dataset, write_pretrain_documents
from tests.model_utils import TINY_FLAGS

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bad_inputs")
TRAIN_FLAGS = [*TINY_FLAGS, "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1"]


class _RunsCommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def bases(tmp_path_factory, toy_tokenizer_dir):
    """Generated good inputs the cases break: {name: directory}."""
    root = tmp_path_factory.mktemp("bad_input_bases")
    out = {"none": str(root / "none")}
    os.makedirs(out["none"])
    packed = root / "packed"
    write_packed_instruction_dataset(str(packed / "data"), num_packs=16, seed=0, meta=True)
    write_packed_instruction_dataset(str(packed / "other"), num_packs=16, seed=1)
    write_packed_instruction_dataset(str(packed / "small"), num_packs=8, seed=2)
    write_packed_instruction_dataset(str(packed / "nometa"), num_packs=16, seed=3)
    out["packed"] = str(packed)
    text = root / "text"
    write_pretrain_documents(str(text / "data_text_document"), random_documents(20, eod_id=2, seed=0))
    write_pretrain_documents(str(text / "other_text_document"), random_documents(20, eod_id=2, seed=1, max_len=30))
    out["text"] = str(text)
    import transformers

    from mindspeed_pack.convert import hf_to_megatron

    config = transformers.Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(root / "hf")
    out["hf"] = str(root / "hf")
    hf_to_megatron(out["hf"], str(root / "mg"), 1, 1)
    out["mg"] = str(root / "mg")
    out["tokenizer"] = str(toy_tokenizer_dir)
    return out


def _fill(value, case_dir, bases):
    if isinstance(value, str):
        return value.replace("{dir}", case_dir).replace("{tokenizer}", bases["tokenizer"])
    return value


def _apply(edit, case_dir):
    path = os.path.join(case_dir, next(edit[k] for k in ("write", "truncate", "copy", "set_token", "flip_byte",
                                                          "json_set", "crafted_pickle") if k in edit))
    if "write" in edit:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding=edit.get("encoding", "utf-8")) as f:
            f.write(edit["text"])
    elif "truncate" in edit:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - edit["drop_bytes"])
    elif "copy" in edit:
        shutil.copy(path, os.path.join(case_dir, edit["to"]))
    elif "set_token" in edit:
        tokens = np.memmap(path, dtype=np.int32, mode="r+")
        tokens[edit["index"]] = edit["value"]
        tokens.flush()
        del tokens
    elif "flip_byte" in edit:
        with open(path, "r+b") as f:
            f.seek(edit["offset"])
            byte = f.read(1)[0]
            f.seek(edit["offset"])
            f.write(bytes([byte ^ 0xFF]))
    elif "json_set" in edit:
        with open(path) as f:
            data = json.load(f)
        data[edit["key"]] = edit["value"]
        with open(path, "w") as f:
            json.dump(data, f)
    else:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({"model": {}, "args": _RunsCommand(os.path.join(case_dir, "MARKER"))}, path)


SCRIPTS = {"preprocess": "preprocess_data.py", "convert": "convert_ckpt.py", "posttrain": "posttrain.py",
           "pretrain": "pretrain_gpt.py"}


def _run_tool(tool, argv, capsys):
    """(exit code, stderr) of one tool run in this process, named as its script (argparse's ``prog``)."""
    capsys.readouterr()
    code = None
    saved_argv, sys.argv = sys.argv, [SCRIPTS[tool]]
    try:
        if tool == "preprocess":
            from mindspeed_pack.datasets.preprocess import main

            code = main(argv)
        elif tool == "convert":
            from mindspeed_pack.convert.convert import main

            code = main(argv)
        else:
            from mindspeed_pack.training.cli import run_cli

            module = __import__("posttrain" if tool == "posttrain" else "pretrain_gpt")
            run_cli(f"{tool}.py", lambda: module.main([*TRAIN_FLAGS, *argv]))
            code = 0
    except SystemExit as e:
        code = e.code
    finally:
        sys.argv = saved_argv
    return code, capsys.readouterr().err


def _fingerprint(root):
    out = {}
    for path in glob.glob(os.path.join(root, "**"), recursive=True):
        if os.path.isfile(path) and "/out/" not in path + "/":
            out[os.path.relpath(path, root)] = hashlib.sha1(open(path, "rb").read()).hexdigest()
    return out


def _check_case(path, bases, tmp_path, capsys):
    case = json.load(open(path))
    name = os.path.relpath(path, CORPUS)
    case_dir = str(tmp_path / name.replace(os.sep, "__").removesuffix(".json"))
    shutil.copytree(bases[case.get("base", "none")], case_dir)
    for edit in case.get("edits", []):
        _apply(edit, case_dir)
    before = _fingerprint(case_dir)
    # sample-index caches are data-derived and may be written by a run that then fails
    argv = [_fill(a, case_dir, bases) for a in case["args"]]
    code, err = _run_tool(case["tool"], argv, capsys)
    problems = []
    if os.path.exists(os.path.join(case_dir, "MARKER")):
        problems.append("the input ran a command (MARKER created)")
    if code != 2:
        problems.append(f"exit code {code}, expected 2")
    lines = [x for x in err.splitlines() if re.match(r"^([\w.]+: )?error: ", x)]
    if "Traceback" in err or not lines:
        problems.append("no one-line error (or a traceback)")
    elif not re.search(_fill(case["expect"], case_dir, bases), lines[-1]):
        problems.append(f"error does not match {case['expect']!r}")
    if os.path.exists(os.path.join(case_dir, "out")) and os.listdir(os.path.join(case_dir, "out")):
        problems.append(f"output written: {os.listdir(os.path.join(case_dir, 'out'))}")
    after = {k: v for k, v in _fingerprint(case_dir).items() if not os.path.basename(k).startswith("sample_index_")}
    if after != before:
        problems.append(f"inputs changed: {sorted(set(after.items()) ^ set(before.items()))[:3]}")
    return name, case["tool"], problems, (lines[-1] if lines else err[-2000:])


def test_bad_input_corpus(bases, tmp_path, capsys):
    cases = sorted(glob.glob(os.path.join(CORPUS, "**", "*.json"), recursive=True))
    assert cases, f"no cases under {CORPUS}"
    results = [_check_case(path, bases, tmp_path, capsys) for path in cases]
    tools = {}
    for _, tool, _, _ in results:
        tools[tool] = tools.get(tool, 0) + 1
    failed = [f"{name}: {'; '.join(problems)}\n    got: {line}" for name, _, problems, line in results if problems]
    with capsys.disabled():
        print(f"\nbad-input corpus: ran {len(results)} cases "
              f"({', '.join(f'{t} {n}' for t, n in sorted(tools.items()))}), {len(failed)} failed", file=sys.stderr)
    assert not failed, "\n".join(failed)

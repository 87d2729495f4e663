"""Chat templates render exactly, and only answers are trained."""
import json

import numpy as np
import pytest

from mindspeed_pack.data.errors import PreprocessError
from mindspeed_pack.data.handlers import (
    ALPACA,
    SHAREGPT,
    SampleEncoder,
    resolve_map_keys,
    truncate_turns,
)
from mindspeed_pack.data.templates import get_template, render_text, template_names
from mindspeed_pack.data.tokenizer import TokenizerSpec, load_tokenizer

TWO_TURNS = [("user", "Reverse the words.\nred cat"), ("assistant", "cat red"),
             ("user", "Say the first word.\nsun moon"), ("assistant", "sun")]


def test_qwen_renders_two_turn_conversation_exactly():
    text = render_text(get_template("qwen"), TWO_TURNS, None, eos_token="<|endoftext|>")
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nReverse the words.\nred cat<|im_end|>\n"
        "<|im_start|>assistant\ncat red<|im_end|>\n"
        "<|im_start|>user\nSay the first word.\nsun moon<|im_end|>\n"
        "<|im_start|>assistant\nsun<|im_end|>"
    )


def test_qwen_uses_given_system_and_qwen2_5_default():
    text = render_text(get_template("qwen"), TWO_TURNS[:2], "Be terse.")
    assert text.startswith("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\n")
    text = render_text(get_template("qwen2_5"), TWO_TURNS[:2], None)
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n")


def test_qwen_tool_roles():
    messages = [("user", "weather?"), ("function", '{"name": "w", "arguments": {}}'),
                ("observation", "sunny"), ("assistant", "It is sunny.")]
    text = render_text(get_template("qwen"), messages, None)
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "w", "arguments": {}}\n</tool_call><|im_end|>\n' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\nIt is sunny.<|im_end|>" in text


def test_llama2_puts_system_inside_first_instruction():
    text = render_text(get_template("llama2"), TWO_TURNS, "SYS", eos_token="</s>", bos_token="<s>")
    assert text == ("<s>[INST] <<SYS>>\nSYS\n<</SYS>>\n\nReverse the words.\nred cat [/INST] cat red </s>"
                    "<s>[INST] Say the first word.\nsun moon [/INST] sun </s>")


def test_llama2_strips_message_text_as_llama2_chat_does():
    # Llama-2-chat's template and Meta's chat_completion write "[INST] " + q.strip() + " [/INST] " + a.strip() + " ":
    # an answer " sun\n" was written " [/INST]  sun\n </s>", its edge whitespace trained
    turns = [("user", "  Reverse the words.\nred cat "), ("assistant", " cat red\n"), ("user", "Say it. "), ("assistant", " sun")]
    text = render_text(get_template("llama2"), turns, None, eos_token="</s>", bos_token="<s>")
    assert text == "<s>[INST] Reverse the words.\nred cat [/INST] cat red </s><s>[INST] Say it. [/INST] sun </s>"


def test_mixtral_is_mistrals_official_inst_format():
    # MindSpeed-LLM's tune_mixtral_8x7B_full_ptd.sh passes --prompt-type mixtral: it was an unknown template
    text = render_text(get_template("mixtral"), TWO_TURNS, None, eos_token="</s>", bos_token="<s>")
    assert text == ("<s> [INST] Reverse the words.\nred cat [/INST] cat red</s>"
                    " [INST] Say the first word.\nsun moon [/INST] sun</s>")
    text = render_text(get_template("mixtral"), TWO_TURNS[:2], "SYS", eos_token="</s>", bos_token="<s>")
    assert text == "<s> [INST] SYS\n\nReverse the words.\nred cat [/INST] cat red</s>"


def test_llama3_renders_header_blocks():
    text = render_text(get_template("llama3"), TWO_TURNS[:2], "S", eos_token="<|end_of_text|>", bos_token="<|begin_of_text|>")
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nReverse the words.\nred cat<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\ncat red<|eot_id|>")


@pytest.mark.parametrize("name", ["qwen", "chatml", "llama3", "llama2", "mixtral", "alpaca", "default", "empty"])
def test_required_templates_exist_and_render(name):
    assert name in template_names()
    text = render_text(get_template(name), TWO_TURNS, None, eos_token="</s>", bos_token="<s>")
    assert "cat red" in text and text.index("cat red") < text.index("sun moon")


def test_unknown_template_lists_known_ones():
    with pytest.raises(PreprocessError) as err:
        get_template("qwen9")
    assert "qwen9" in str(err.value) and "qwen" in str(err.value) and "llama3" in str(err.value)


def test_bad_slot_is_rejected(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"x": {"format_user": ["{{content}}"], "format_assistant": [{"token": "sep"}]}}))
    with pytest.raises(PreprocessError, match="bad slot"):
        get_template("x", path)


@pytest.fixture(scope="module")
def toy_tokenizer(toy_tokenizer_dir):
    return load_tokenizer(TokenizerSpec("PretrainedFromHF", str(toy_tokenizer_dir)))


def _encoder(tokenizer, handler=SHAREGPT, seq_length=None, template="qwen", map_keys=None, append_eod=False):
    keys, _ = resolve_map_keys(handler, map_keys)
    return SampleEncoder(handler, tokenizer, get_template(template), keys, seq_length, append_eod)


def test_only_answers_and_their_eos_are_trained(toy_tokenizer):
    (ids, trained), skip, truncated = _encoder(toy_tokenizer).encode_messages(TWO_TURNS, None)
    assert skip is None and not truncated
    assert toy_tokenizer.decode(ids) == render_text(get_template("qwen"), TWO_TURNS, None)
    trained_ids = ids[trained.astype(bool)]
    assert toy_tokenizer.decode(trained_ids) == "cat red<|im_end|>sun<|im_end|>"
    # the newline after the first <|im_end|> is the separator: emitted, untrained
    im_end = toy_tokenizer.token_to_id("<|im_end|>")
    first_answer_end = np.flatnonzero((ids == im_end) & trained.astype(bool))[0]
    assert toy_tokenizer.decode(ids[first_answer_end + 1:first_answer_end + 2]).startswith("\n")
    assert trained[first_answer_end + 1] == 0
    assert trained[0] == 0


def test_append_eod_does_not_double_the_eos(toy_tokenizer):
    plain = _encoder(toy_tokenizer).encode_messages(TWO_TURNS, None)[0][0]
    with_eod = _encoder(toy_tokenizer, append_eod=True).encode_messages(TWO_TURNS, None)[0][0]
    assert np.array_equal(plain, with_eod)


def test_sharegpt_roles_and_openai_style_keys(toy_tokenizer):
    sharegpt = {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    openai = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    a = _encoder(toy_tokenizer).encode_row(sharegpt, "row 1")[0]
    b = _encoder(toy_tokenizer, map_keys={"messages": "messages", "role": "role", "content": "content",
                                          "user": "user", "assistant": "assistant"}).encode_row(openai, "row 1")[0]
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert toy_tokenizer.decode(a[0]).startswith("<|im_start|>system\nS<|im_end|>")


def test_alpaca_history_and_input_join(toy_tokenizer):
    row = {"instruction": "Reverse.", "input": "a b", "output": "b a", "history": [["hi", "hello"]]}
    (ids, trained), _, _ = _encoder(toy_tokenizer, handler=ALPACA).encode_row(row, "row 1")
    text = toy_tokenizer.decode(ids)
    assert "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\nReverse.\na b<|im_end|>" in text
    assert toy_tokenizer.decode(ids[trained.astype(bool)]) == "hello<|im_end|>b a<|im_end|>"


def test_truncation_shares_budget_per_turn():
    p, a = list(range(30)), list(range(100, 110))
    # answer short (10 * 2 < 24): answer kept whole, prompt cut
    (turn,), cut = truncate_turns([(p, a)], 24)
    assert cut and len(turn[1]) == 10 and len(turn[0]) == 14
    # both long: proportional split
    (turn,), cut = truncate_turns([(list(range(60)), list(range(40)))], 50)
    assert cut and (len(turn[0]), len(turn[1])) == (30, 20)
    # a later turn that no longer fits is dropped after the cut
    turns, cut = truncate_turns([(p[:5], a[:5]), (p, a), (p, a)], 20)
    assert cut and len(turns) == 2 and sum(len(x) + len(y) for x, y in turns) == 20
    turns, cut = truncate_turns([(p[:5], a[:5])], 20)
    assert not cut and turns == [(p[:5], a[:5])]


def test_installed_package_ships_its_templates(tmp_path):
    """``pip install .`` copies the package without configs/: the build must ship templates.json beside
    ``mindspeed_pack.data.templates``, or every --prompt-type NAME of an installed package is 'not found'."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    lib = tmp_path / "lib"
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(lib)], cwd=repo, check=True,
                   capture_output=True)
    probe = ("from mindspeed_pack.data import templates; print(templates.DEFAULT_TEMPLATES_PATH); "
             "print(templates.get_template('qwen').name)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(lib)},
                         check=True, capture_output=True, text=True).stdout.split()
    assert out == [str(lib / "mindspeed_pack" / "data" / "templates.json"), "qwen"]

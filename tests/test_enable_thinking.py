"""``--enable-thinking`` (MindSpeed-LLM's reasoning switch): with the qwen3 template, the semantics of
MindSpeed-LLM's reasoning template; with ``--prompt-type hf``, the chat template's ``enable_thinking``.
And the sidecar names its tokenizer by an absolute path, so a pack can be inspected from anywhere."""
import json
import os

import pytest

from mindspeed_pack.data.errors import PreprocessError
from mindspeed_pack.data.templates import get_template, render_turns, with_thinking

THOUGHT = "<think>\n\n</think>\n\n"
CONVERSATION = [("user", "q1"), ("assistant", "<think>\nr1\n</think>\n\na1"), ("user", "q2"), ("assistant", "a2")]


def _turns(enable_thinking, conversation=CONVERSATION):
    """(prompt text, answer text) per turn of ``conversation`` under ``--enable-thinking``."""
    template = with_thinking(get_template("qwen3"), enable_thinking)
    text = (lambda slots: "".join(s if isinstance(s, str) else "<eos>" for s in slots))
    return [(text(p), text(a)) for p, a in render_turns(template, conversation, None)]


def test_true_keeps_thoughts_and_trains_an_empty_one_where_an_answer_has_none():
    (p1, a1), (p2, a2) = _turns(True)
    assert a1 == "<think>\nr1\n</think>\n\na1<eos>" and a2 == THOUGHT + "a2<eos>"
    assert p1.endswith("<|im_start|>assistant\n") and p2.endswith("<|im_start|>assistant\n")


def test_false_removes_thoughts_and_closes_every_prompt_with_an_empty_one_untrained():
    (p1, a1), (p2, a2) = _turns(False)
    assert a1 == "a1<eos>" and a2 == "a2<eos>"
    assert p1.endswith("<|im_start|>assistant\n" + THOUGHT) and p2.endswith("<|im_start|>assistant\n" + THOUGHT)


def test_none_renders_answers_as_written():
    (_, a1), (p2, a2) = _turns(None)
    assert a1 == "<think>\nr1\n</think>\n\na1<eos>" and a2 == "a2<eos>" and THOUGHT not in p2


def test_a_thought_spelled_without_newlines_is_a_thought():
    """``<think>r</think>a`` got a second, empty thought before it under true (MindSpeed-LLM and LLaMA-Factory look
    for the thought words without their newlines), and kept its thought after the prompt's empty one under false."""
    tight = [("user", "q1"), ("assistant", "<think>r1</think>a1")]
    ((_, kept),), ((prompt, removed),) = _turns(True, tight), _turns(False, tight)
    assert kept == "<think>r1</think>a1<eos>"
    assert removed == "a1<eos>" and prompt.endswith("<|im_start|>assistant\n" + THOUGHT)


def test_a_template_without_thought_words_refuses_the_flag():
    with pytest.raises(PreprocessError, match="template 'qwen' has no thought words"):
        with_thinking(get_template("qwen"), True)
    assert with_thinking(get_template("qwen"), None) == get_template("qwen")


def _alpaca(tmp_path):
    rows = [{"instruction": "say one two", "input": "", "output": "<think>\nred blue\n</think>\n\none two"},
            {"instruction": "say cat dog", "input": "", "output": "cat dog"}]
    path = tmp_path / "alpaca.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _trained_texts(prefix, tokenizer_dir, read_indexed):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids = read_indexed(f"{prefix}_packed_input_ids_document")
    labels = read_indexed(f"{prefix}_packed_labels_document")
    return [tok.decode(i[lab != -100].tolist()) for i, lab in zip(ids, labels)]


@pytest.mark.parametrize("value", ["true", "false"])
def test_preprocess_writes_mindspeed_llms_qwen3_reasoning_samples(tmp_path, run_preprocess, read_indexed,
                                                                    toy_tokenizer_dir, value):
    prefix = tmp_path / value
    code, _, err = run_preprocess(input=_alpaca(tmp_path), output_prefix=prefix, prompt_type="qwen3",
                                  seq_length=128, enable_thinking=value, handler_name="AlpacaStyleInstructionHandler")
    assert code == 0, err
    trained = [t.replace(" ", "").replace("\n", "") for t in _trained_texts(prefix, toy_tokenizer_dir, read_indexed)]
    if value == "true":  # thoughts kept, the empty one trained where the answer had none
        assert trained == ["<think>redblue</think>onetwo<|im_end|>", "<think></think>catdog<|im_end|>"]
    else:  # thoughts removed; the empty one is in the prompt, untrained
        assert trained == ["onetwo<|im_end|>", "catdog<|im_end|>"]
    meta = json.loads((tmp_path / f"{value}_packed_meta.json").read_text())
    assert meta["cache_key"]["arguments"]["enable_thinking"] == (value == "true")
    assert os.path.isabs(meta["tokenizer_path"])


def test_preprocess_refuses_the_flag_where_no_template_reads_it(tmp_path, run_preprocess):
    code, _, err = run_preprocess(input=_alpaca(tmp_path), output_prefix=tmp_path / "qwen", prompt_type="qwen",
                                  seq_length=128, enable_thinking="true", handler_name="AlpacaStyleInstructionHandler")
    assert code != 0 and "template 'qwen' has no thought words" in err
    assert not list(tmp_path.glob("qwen_packed_*"))


def test_hf_templates_take_it_as_their_enable_thinking_variable():
    import argparse

    from mindspeed_pack.datasets.preprocess import _fold_enable_thinking

    args = argparse.Namespace(enable_thinking=False, handler_name="AlpacaStyleInstructionHandler", prompt_type="hf",
                              chat_template_kwargs={"date_string": "x"})
    _fold_enable_thinking(args)
    assert args.chat_template_kwargs == {"date_string": "x", "enable_thinking": False}
    args.enable_thinking = True
    with pytest.raises(PreprocessError, match="--chat-template-kwargs sets enable_thinking false"):
        _fold_enable_thinking(args)


def test_inspect_pack_decodes_from_another_working_directory(tmp_path, run_preprocess, toy_tokenizer_dir, capsys,
                                                             monkeypatch):
    """The sidecar's tokenizer path was relative to the preprocessing directory: inspect_pack failed elsewhere."""
    import shutil

    from mindspeed_pack.tools.inspect_pack import main as inspect_main

    shutil.copytree(toy_tokenizer_dir, tmp_path / "tok")
    monkeypatch.chdir(tmp_path)
    code, _, err = run_preprocess(input=_alpaca(tmp_path), output_prefix=tmp_path / "p", prompt_type="qwen",
                                  seq_length=128, pack=True, neat_pack=True, tokenizer_name_or_path="tok",
                                  handler_name="AlpacaStyleInstructionHandler")
    assert code == 0, err
    monkeypatch.chdir(tmp_path.parent)
    capsys.readouterr()
    assert inspect_main([str(tmp_path / "p"), "--index", "0"]) == 0
    assert "cat dog" in capsys.readouterr().out
    assert inspect_main([str(tmp_path / "nothing"), "--index", "0"]) == 2  # not megatron's assertion and a traceback
    assert "nothing: no packs here" in capsys.readouterr().err


def test_hf_template_that_reads_no_enable_thinking_refuses_it():
    """Qwen3-2507's or Llama's template ignores the variable: the flag changed nothing, silently (a JSON template
    without thought words refuses it)."""
    from mindspeed_pack.data.chat_template import ChatTemplate

    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(PreprocessError, match="reads no enable_thinking variable"):
        ChatTemplate(plain, {}, {"enable_thinking": False}, origin="chat.jinja")
    reads = "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}" + plain
    assert ChatTemplate(reads, {}, {"enable_thinking": False}).kwargs["enable_thinking"] is False


def test_reasoning_history_keep_is_refused_where_no_chat_template_reads_it(tmp_path, run_preprocess):
    """A JSON template ignored --reasoning-history keep (it writes each answer as the row gives it), silently."""
    code, _, err = run_preprocess(input=_alpaca(tmp_path), output_prefix=tmp_path / "q", prompt_type="qwen3",
                                  seq_length=128, reasoning_history="keep", handler_name="AlpacaStyleInstructionHandler")
    assert code != 0 and "--reasoning-history keep applies to --prompt-type hf" in err
    assert not list(tmp_path.glob("q_packed_*"))

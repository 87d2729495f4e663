"""--prompt-type hf: samples are the model's own chat template, token for token, and only assistant output is trained.

For each vendored official template (tests/fixtures/chat_templates) and a generated corpus of 260
conversations with the edge cases (tests/chat_corpus.py):

(1) every sample's ids equal transformers' ``apply_chat_template`` of the same messages;
(2) the tokens before each trained turn equal the generation-prompt render of the conversation so far;
(3) trained tokens are exactly the assistant turns, each ending with the end-of-turn token, whose
    separator is not trained; no user, system, tool-result or schema text is trained;
(4) at most one BOS; every tool call and reasoning trace is in the text (and trained);
(5) a Qwen3 conversation with reasoning in two turns trains both traces, neither as untrained history.
"""
import json
import re

import numpy as np
import pytest

from mindspeed_pack.data.chat_messages import REASON_ARGUMENTS, REASON_FIELD, REASON_ROLE
from mindspeed_pack.data.chat_template import (
    DEFAULT_DATE_STRING,
    DEFAULT_NOW,
    NOTE_CALL_IDS,
    REASON_DROPPED,
    REASON_NOT_PREFIX,
    REASON_REASONING,
    REASON_RENDER,
    REASON_TOKEN_BOUNDARY,
    REASON_TOOLS,
    ChatTemplate,
)
from mindspeed_pack.data.errors import PreprocessError, RowError
from mindspeed_pack.data.handlers import ALPACA, SHAREGPT, SKIP_CUT, resolve_map_keys
from mindspeed_pack.data.tokenizer import TokenizerSpec
from mindspeed_pack.datasets.preprocess import EncoderConfig
from tests import chat_corpus

CORPUS = chat_corpus.corpus()
# why a family may refuse a corpus row (anything else fails the test)
ALLOWED_REFUSALS = {
    # parallel tool calls: "This model only supports single tool-calls at once!"; reasoning on a tool-call turn
    "llama3_1": {REASON_RENDER, REASON_DROPPED},
    "llama3_2": {REASON_RENDER, REASON_DROPPED},
    "r1_distill": {REASON_TOOLS, REASON_NOT_PREFIX},  # a turn without a <think> block after the "<think>\n" prompt
    "gemma3": {REASON_TOOLS},
    "phi3_5": {REASON_TOOLS},
}
TAG = re.compile(r"\b([USTDRA])(\d+)(?:_(\d+))?\b")


@pytest.fixture(scope="session")
def family_tokenizer_dir(tmp_path_factory, toy_tokenizer_dir):
    built = {}

    def get(family):
        if family not in built:
            built[family] = chat_corpus.build_tokenizer(toy_tokenizer_dir, tmp_path_factory.mktemp(family), family)
        return built[family]
    return get


def _encoder(tokenizer_dir, handler=SHAREGPT, map_keys=chat_corpus.MAP_KEYS, **config):
    keys, _ = resolve_map_keys(handler, map_keys)
    fields = dict(seq_length=None, append_eod=False, chat_template=None, chat_template_kwargs={}, reasoning_history="split")
    fields.update(config)
    return EncoderConfig(handler, TokenizerSpec("PretrainedFromHF", str(tokenizer_dir)), "hf", None, keys, **fields).build()


def encode_with_plans(encoder, row, where="row 0"):
    """[(SamplePlan, ids, trained)] of one row, plus the messages and tools the template was given."""
    texts = []
    plan, _ = encoder.plan_chat_row(row, where, texts)
    messages, tools = encoder._chat_messages(row, where)
    messages, _ = encoder.chat.adapt(messages, tools)
    if plan is None:
        return [], messages, tools
    results = encoder.finish_chat(plan, encoder.tokenizer.encode_batch_offsets(texts))
    return [(s, r[0][0], r[0][1]) for (s, _), r in zip(plan[1], results) if r[0] is not None], messages, tools


@pytest.fixture(scope="session")
def family_results(family_tokenizer_dir):
    cache = {}

    def get(family):
        if family not in cache:
            encoder = _encoder(family_tokenizer_dir(family))
            accepted, refused = [], []
            for i, row in enumerate(CORPUS):
                try:
                    accepted.append((i, *encode_with_plans(encoder, row, f"row {i}")))
                except RowError as exc:
                    refused.append((i, exc))
            cache[family] = encoder, accepted, refused
        return cache[family]
    return get


def _apply(hf, messages, tools, kwargs, **flags):
    return hf.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True, **kwargs, **flags)


@pytest.mark.parametrize("family", list(chat_corpus.FAMILIES))
def test_samples_are_the_official_template_token_for_token(family, family_results):
    encoder, accepted, refused = family_results(family)
    hf, kwargs = encoder.tokenizer.hf, encoder.chat.kwargs
    assert {exc.reason for _, exc in refused} <= ALLOWED_REFUSALS.get(family, set()), refused[:3]
    assert sum(1 for _, samples, _, _ in accepted if samples) >= 45
    for i, samples, messages, tools in accepted:
        for sample, ids, trained in samples:
            last = sample.turns[-1][0]
            # (1) the sample is the official render of the conversation up to its last trained turn (then the stop
            # token where the template writes no end-of-turn token)
            stop = chat_corpus.APPENDED_STOP.get(family)
            official = _apply(hf, messages[:last + 1], tools, kwargs)["input_ids"]
            assert ids.tolist() == official + ([encoder.tokenizer.token_to_id(stop)] if stop else []), f"row {i}"
            for k, start, end in sample.turns:
                # (2) its context is exactly what inference shows before turn k
                prompt = _apply(hf, messages[:k], tools, kwargs, add_generation_prompt=True)["input_ids"]
                assert ids[:len(prompt)].tolist() == prompt, f"row {i} turn {k}"
                if encoder.chat.has_generation_markers:
                    continue  # the markers say what is trained (R1's cover "<｜Assistant｜>" of the prompt too)
                assert not trained[len(prompt) - 1]
                if end > start:
                    assert trained[len(prompt)], f"row {i} turn {k}: the turn's first token is not trained"


@pytest.mark.parametrize("family", list(chat_corpus.FAMILIES))
def test_only_assistant_output_is_trained_with_its_end_of_turn_token(family, family_results):
    encoder, accepted, _ = family_results(family)
    tok = encoder.tokenizer
    eot = chat_corpus.FAMILIES[family][3]
    eot_ids = {tok.token_to_id(t) for t in ((eot,) if isinstance(eot, str) else eot)}
    bos = chat_corpus.FAMILIES[family][1]
    for i, samples, messages, tools in accepted:
        for sample, ids, trained in samples:
            # (3) runs of trained tokens: assistant text only, each run ends with the end-of-turn token
            runs = np.split(np.arange(len(ids)), np.flatnonzero(np.diff(trained.astype(np.int8))) + 1)
            trained_runs = [r for r in runs if trained[r[0]]]
            assert len(trained_runs) == len([t for t in sample.turns if t[2] > t[1]]), f"row {i}"
            for run in trained_runs:
                text = tok.decode(ids[run])
                kinds = {m.group(1) for m in TAG.finditer(text)}
                assert kinds <= {"A", "R"}, f"row {i}: trained text {text!r} holds {kinds - {'A', 'R'}}"
                if eot_ids:
                    assert ids[run[-1]] in eot_ids, f"row {i}: trained turn {text!r} does not end with {eot}"
                    # the separator after the end-of-turn token (Qwen's and Gemma's newline) is not trained
                    assert run[-1] + 1 == len(ids) or not trained[run[-1] + 1]
            # (4) one BOS at most; every call, argument and reasoning trace of a trained turn is trained
            if bos:
                assert int((ids == tok.token_to_id(bos)).sum()) <= 1, f"row {i}"
            trained_text = tok.decode(ids[trained.astype(bool)])
            for k, _, _ in sample.turns:
                m = messages[k]
                for call in m.get("tool_calls", []):
                    assert call["function"]["name"] in trained_text, f"row {i}"
                    assert re.search(r"V\d+_\d+", trained_text)
                for tag in TAG.findall(m.get("content") or "") + TAG.findall(m.get("reasoning_content") or ""):
                    assert f"{tag[0]}{tag[1]}" + (f"_{tag[2]}" if tag[2] else "") in trained_text, f"row {i}"


def test_qwen3_trains_each_reasoning_trace_once_and_never_as_history(family_tokenizer_dir):
    encoder = _encoder(family_tokenizer_dir("qwen3"))
    row = {"messages": [{"role": "user", "content": "U1_0 q1"},
                        {"role": "assistant", "content": "A1_0 a1", "reasoning_content": "R1_0 first trace"},
                        {"role": "user", "content": "U1_1 q2"},
                        {"role": "assistant", "content": "A1_1 a2", "reasoning_content": "R1_1 second trace"}]}
    samples, _, _ = encode_with_plans(encoder, row)
    assert len(samples) == 2  # Qwen3 drops turn 1's trace once a new user query follows: split
    tok = encoder.tokenizer
    first, second = [(tok.decode(ids), tok.decode(ids[t.astype(bool)])) for _, ids, t in samples]
    assert "R1_0 first trace" in first[1] and "A1_0 a1" in first[1]
    assert "R1_1 second trace" in second[1]
    assert "R1_0" not in second[0]  # not even as untrained history: inference never shows it
    assert "A1_0 a1<|im_end|>" in second[0] and "A1_0" not in second[1]  # turn 1 is context there, untrained


@pytest.mark.parametrize("field", ["thinking", "reasoning"])
def test_reasoning_under_transformers_other_names_is_trained(field, family_tokenizer_dir):
    """``thinking`` (gpt-oss's field, and its datasets') was dropped: Qwen3 trained an empty <think> block instead."""
    encoder = _encoder(family_tokenizer_dir("qwen3"))
    messages = [{"role": "user", "content": "U1_0 q1"}, {"role": "assistant", "content": "A1_0 a1", field: "R1_0 trace"}]
    (_, ids, trained), = encode_with_plans(encoder, {"messages": messages})[0]
    assert encoder.tokenizer.decode(ids[trained.astype(bool)]) == "<think>\nR1_0 trace\n</think>\n\nA1_0 a1<|im_end|>"
    assert ids.tolist() == encoder.tokenizer.hf.apply_chat_template(messages, tokenize=True, return_dict=False)


def test_reasoning_history_keep_trains_one_sample_with_every_trace(family_tokenizer_dir):
    encoder = _encoder(family_tokenizer_dir("qwen3"), reasoning_history="keep")
    row = {"messages": [{"role": "user", "content": "U1_0 q1"},
                        {"role": "assistant", "content": "A1_0 a1", "reasoning_content": "R1_0 first"},
                        {"role": "user", "content": "U1_1 q2"},
                        {"role": "assistant", "content": "A1_1 a2", "reasoning_content": "R1_1 second"}]}
    (sample, ids, trained), = encode_with_plans(encoder, row)[0]
    tok = encoder.tokenizer
    assert tok.decode(ids) == ("<|im_start|>user\nU1_0 q1<|im_end|>\n<|im_start|>assistant\n<think>\nR1_0 first\n</think>\n\n"
                               "A1_0 a1<|im_end|>\n<|im_start|>user\nU1_1 q2<|im_end|>\n<|im_start|>assistant\n<think>\n"
                               "R1_1 second\n</think>\n\nA1_1 a2<|im_end|>\n")
    assert tok.decode(ids[trained.astype(bool)]) == ("<think>\nR1_0 first\n</think>\n\nA1_0 a1<|im_end|>"
                                                     "<think>\nR1_1 second\n</think>\n\nA1_1 a2<|im_end|>")


@pytest.mark.parametrize("template", ["qwen2_5_training.jinja", "qwen3_training.jinja", "gemma3_training.jinja",
                                      "phi3_5_training.jinja", "deepseek_r1_distill_training.jinja"])
def test_generation_markers_give_transformers_assistant_masks(template, family_tokenizer_dir):
    family = {"qwen2_5": "qwen2_5", "qwen3_tr": "qwen3", "gemma3": "gemma3", "phi3_5": "phi3_5",
              "deepseek": "r1_distill"}[next(k for k in ("qwen2_5", "qwen3_tr", "gemma3", "phi3_5", "deepseek")
                                             if template.startswith(k))]
    path = chat_corpus.TEMPLATES / template
    encoder = _encoder(family_tokenizer_dir(family), chat_template=str(path))
    assert encoder.chat.has_generation_markers
    hf, checked = encoder.tokenizer.hf, 0
    for i, row in enumerate(CORPUS[:80]):
        try:
            samples, messages, tools = encode_with_plans(encoder, row, f"row {i}")
        except RowError:
            continue
        for sample, ids, trained in samples:
            last = sample.turns[-1][0]
            if len(samples) > 1:
                continue  # several samples: each trains only its own turns, unlike a whole-conversation mask
            out = _apply(hf, messages[:last + 1], tools, encoder.chat.kwargs, chat_template=path.read_text(),
                         return_assistant_tokens_mask=True)
            expected = np.array(out["assistant_masks"], np.uint8)
            expected[0] = 0
            assert ids.tolist() == out["input_ids"] and np.array_equal(trained, expected), f"row {i}"
            checked += 1
    assert checked >= 10


def test_template_that_drops_its_own_prompt_is_refused_not_shifted(family_tokenizer_dir):
    """DeepSeek-R1-Distill's original template prompts with "<think>\\n" but renders the turn without it."""
    encoder = _encoder(family_tokenizer_dir("r1_distill"), chat_template=str(chat_corpus.TEMPLATES / "deepseek_r1_distill.jinja"))
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    with pytest.raises(RowError, match=r"row 7: assistant turn \(message 1\): the template's generation prompt is not a "
                                       r"prefix") as err:
        encode_with_plans(encoder, row, "row 7")
    assert err.value.reason == REASON_NOT_PREFIX
    row["messages"][1]["reasoning_content"] = "r"
    with pytest.raises(RowError, match="reasoning_content, which this chat template drops"):
        encode_with_plans(encoder, row, "row 7")


def test_llama_date_header_is_pinned_and_overridable(family_tokenizer_dir):
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    for family in ("llama3_1", "llama3_2"):
        encoder = _encoder(family_tokenizer_dir(family))
        pins = {"date_string": DEFAULT_DATE_STRING}  # Llama 3.2 falls back to strftime_now: pinned too
        pins.update({"strftime_now": DEFAULT_NOW} if "strftime_now" in encoder.chat.source else {})
        assert encoder.chat.identity()["chat_template_kwargs"] == pins
        ((_, ids, _),), _, _ = encode_with_plans(encoder, row)
        assert f"Today Date: {DEFAULT_DATE_STRING}\n" in encoder.tokenizer.decode(ids)
    encoder = _encoder(family_tokenizer_dir("llama3_2"), chat_template_kwargs={"date_string": "01 Jan 2025"})
    ((_, ids, _),), _, _ = encode_with_plans(encoder, row)
    assert "Today Date: 01 Jan 2025\n" in encoder.tokenizer.decode(ids)


NOW_TEMPLATE = ("{{- 'Current date: ' + strftime_now('%Y-%m-%d') + '\\n' }}{% for m in messages %}<|im_start|>{{ m.role }}\n"
                "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("markers", [False, True])
def test_strftime_now_is_pinned_and_overridable(markers, tmp_path, family_tokenizer_dir):
    """A template that calls strftime_now (gpt-oss's "Current date") gets a pinned day, like Llama's date_string, so
    the same data gives the same tokens on another day; --chat-template-kwargs '{"strftime_now": ISO}' sets it."""
    source = NOW_TEMPLATE.replace("{{ m.content }}", "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
                                  "{% endgeneration %}{% else %}{{ m.content }}{% endif %}") if markers else NOW_TEMPLATE
    path = tmp_path / "now.jinja"
    path.write_text(source)
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    encoder = _encoder(family_tokenizer_dir("qwen2_5"), chat_template=str(path))
    assert encoder.chat.identity()["chat_template_kwargs"] == {"strftime_now": DEFAULT_NOW}
    ((ids, _),) = encoder.encode_chat_row(row, "row 0")
    assert encoder.tokenizer.decode(ids).startswith(f"Current date: {DEFAULT_NOW}\n")
    encoder = _encoder(family_tokenizer_dir("qwen2_5"), chat_template=str(path),
                       chat_template_kwargs={"strftime_now": "2025-01-31"})
    ((ids, _),) = encoder.encode_chat_row(row, "row 0")
    assert encoder.tokenizer.decode(ids).startswith("Current date: 2025-01-31\n")
    with pytest.raises(PreprocessError, match=r"strftime_now must be an ISO date .* got 'today'"):
        _encoder(family_tokenizer_dir("qwen2_5"), chat_template=str(path), chat_template_kwargs={"strftime_now": "today"})


def test_bad_rows_name_row_message_and_field(family_tokenizer_dir):
    qwen = _encoder(family_tokenizer_dir("qwen2_5"))
    call = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}
    cases = [
        (qwen, {"messages": [{"role": "user", "content": "q"}, call]},
         r"row 3: field 'messages' message 1 tool call 0: arguments are not valid JSON", REASON_ARGUMENTS),
        (qwen, {"messages": [{"role": "user", "content": "q"}, {"role": "wizard", "content": "a"}]},
         r"row 3: field 'messages' message 1 has unknown 'role' 'wizard'", REASON_ROLE),
        (qwen, {"tools": {"a": 1}, "messages": CORPUS[0]["messages"]},
         r"row 3: field 'tools' must be a list of tool schemas \(objects naming a function: \"function\": "
         r"\{\"name\": ...\} or \"name\"\), got \{\"a\": 1\}", REASON_FIELD),
        (qwen, {"tools": [CORPUS[7]["tools"][0], "get_weather"], "messages": CORPUS[0]["messages"]},
         r"row 3: field 'tools' item 1 is not a tool schema", REASON_FIELD),
        # a type without a named function was rendered into the prompt as a tool
        (qwen, {"tools": [{"type": "function"}], "messages": CORPUS[0]["messages"]},
         r"row 3: field 'tools' item 0 is not a tool schema \(an object naming a function", REASON_FIELD),
        (qwen, {"tools": [{"type": "function", "function": "get_weather"}], "messages": CORPUS[0]["messages"]},
         r"row 3: field 'tools' item 0 is not a tool schema", REASON_FIELD),
        (_encoder(family_tokenizer_dir("gemma3")), CORPUS[7],
         r"row 3: the row has tool schemas, which this chat template does not render \(refused, not dropped\)", REASON_TOOLS),
    ]
    for encoder, row, message, reason in cases:
        with pytest.raises(RowError, match=message) as err:
            encode_with_plans(encoder, row, "row 3")
        assert err.value.reason == reason


def test_row_formats_sharegpt_tools_openai_and_alpaca_history(family_tokenizer_dir):
    """LLaMA-Factory ShareGPT (tools column, function_call/observation) = the same OpenAI conversation."""
    tools = [chat_corpus._schema(5, 0)]
    sharegpt = {"conversations": [{"from": "human", "value": "U5_0 weather?"},
                                  {"from": "function_call", "value": '{"name": "fn5_0", "arguments": {"q": "V5_0"}}'},
                                  {"from": "observation", "value": "T5_0 sunny"},
                                  {"from": "gpt", "value": "A5_1 It is sunny."}],
                "tools": __import__("json").dumps(tools)}
    openai = {"messages": [{"role": "user", "content": "U5_0 weather?"},
                           {"role": "assistant", "content": None, "tool_calls": [
                               {"type": "function", "function": {"name": "fn5_0", "arguments": '{"q": "V5_0"}'}}]},
                           {"role": "tool", "content": "T5_0 sunny"},
                           {"role": "assistant", "content": "A5_1 It is sunny."}], "tools": tools}
    tok_dir = family_tokenizer_dir("qwen2_5")
    a = encode_with_plans(_encoder(tok_dir, map_keys=None), sharegpt)[0]
    b = encode_with_plans(_encoder(tok_dir), openai)[0]
    assert len(a) == len(b) == 1 and np.array_equal(a[0][1], b[0][1]) and np.array_equal(a[0][2], b[0][2])
    tok = _encoder(tok_dir).tokenizer
    text, trained = tok.decode(a[0][1]), tok.decode(a[0][1][a[0][2].astype(bool)])
    assert '"name": "fn5_0"' in text and "D5 looks things up" in text  # the schema reaches the system prompt
    assert trained == ('<tool_call>\n{"name": "fn5_0", "arguments": {"q": "V5_0"}}\n</tool_call><|im_end|>'
                       'A5_1 It is sunny.<|im_end|>')
    alpaca = {"instruction": "U6_1 now", "input": "", "output": "A6_1 done", "system": "S6 be brief",
              "history": [["U6_0 hi", "A6_0 hello"]]}
    ((_, ids, trained),), _, _ = encode_with_plans(_encoder(tok_dir, handler=ALPACA, map_keys=None), alpaca)
    assert tok.decode(ids).startswith("<|im_start|>system\nS6 be brief<|im_end|>\n<|im_start|>user\nU6_0 hi")
    assert tok.decode(ids[trained.astype(bool)]) == "A6_0 hello<|im_end|>A6_1 done<|im_end|>"


def test_template_probe_records_what_it_renders():
    source = (chat_corpus.TEMPLATES / "gemma3.jinja").read_text()
    caps = ChatTemplate(source, {"bos_token": "<bos>"}, {}).capabilities
    assert caps == {"tools": False, "tool_calls": None, "tool_results": False, "reasoning": "think_tags",
                    "call_ids": False}
    caps = ChatTemplate((chat_corpus.TEMPLATES / "qwen3.jinja").read_text(), {}, {}).capabilities
    assert caps == {"tools": True, "tool_calls": "either", "tool_results": True, "reasoning": "field",
                    "call_ids": False}
    caps = ChatTemplate((chat_corpus.TEMPLATES / "qwen2_5.jinja").read_text(), {}, {}).capabilities
    assert caps["tool_calls"] == "object"  # `| tojson` only: a string would be written as an escaped JSON string



# Mistral v3's and Hermes' tool templates raise on a call id that is not 9 characters / a tool result without a name
STRICT_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}{% for m in messages %}"
    "{% if m.role == 'tool' and (m.name is not defined or m.tool_call_id | length != 9) %}"
    "{{ raise_exception('Tool response dicts require a name and a tool_call_id of 9 characters') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{% if m.tool_calls is defined %}{% for c in m.tool_calls %}"
    "{% if c.id is not defined or c.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric "
    "strings with length 9!') }}{% endif %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_templates_that_require_call_ids_and_tool_names_render_tool_rows(tmp_path, family_tokenizer_dir):
    """A template that raises on a tool call without its id or a result without its name (Mistral v3, Hermes) still
    renders tool calls: rows that give them are the template's render with the call trained, not refused as
    'tools the template cannot render'. Rows without them (LLaMA-Factory's ShareGPT function_call rows have no ids)
    were refused with the template's own message: each call now gets an id drawn from it and each result the id
    and name of the call it answers, noted and counted."""
    caps = ChatTemplate(STRICT_TOOLS_TEMPLATE, {}, {}).capabilities
    assert caps == {"tools": True, "tool_calls": "object", "tool_results": True, "reasoning": "think_tags",
                    "call_ids": True}
    path = tmp_path / "strict.jinja"
    path.write_text(STRICT_TOOLS_TEMPLATE)
    tools = [chat_corpus._schema(5, 0)]
    call = {"id": "call00001", "type": "function", "function": {"name": "fn5_0", "arguments": '{"q": "V5_0"}'}}
    row = {"tools": tools, "messages": [
        {"role": "user", "content": "U5_0 weather?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call00001", "name": "fn5_0", "content": "T5_0 sunny"},
        {"role": "assistant", "content": "A5_1 It is sunny."}]}
    encoder = _encoder(family_tokenizer_dir("qwen2_5"), chat_template=str(path))
    ((plan, ids, trained),), messages, _ = encode_with_plans(encoder, row)
    hf = encoder.tokenizer.hf
    expected = _apply(hf, messages, tools, {"chat_template": STRICT_TOOLS_TEMPLATE})["input_ids"]
    assert list(ids) == list(expected)
    assert hf.decode(ids[trained.astype(bool)]) == ('<tool_call>{"name": "fn5_0", "arguments": {"q": "V5_0"}}'
                                                    '</tool_call><|im_end|>A5_1 It is sunny.<|im_end|>')
    assert not plan.notes
    # without the result's name: the call's own; without the ids: one drawn from the call, 9 letters and digits
    del row["messages"][2]["name"], row["messages"][2]["tool_call_id"], row["messages"][1]["tool_calls"][0]["id"]
    ((plan, ids, trained),), messages, _ = encode_with_plans(encoder, row)
    made_up = messages[1]["tool_calls"][0]["id"]
    assert re.fullmatch("[A-Za-z0-9]{9}", made_up) and made_up != "call00001"
    assert messages[2]["tool_call_id"] == made_up and messages[2]["name"] == "fn5_0"
    assert list(ids) == list(_apply(hf, messages, tools, {"chat_template": STRICT_TOOLS_TEMPLATE})["input_ids"])
    assert plan.notes == [(NOTE_CALL_IDS, 1)]
    assert encode_with_plans(encoder, row)[1][1]["tool_calls"][0]["id"] == made_up  # the same on every run
    # LLaMA-Factory's ShareGPT: parallel calls, one id each, answered in order
    sharegpt = _encoder(family_tokenizer_dir("qwen2_5"), chat_template=str(path), map_keys=None)
    rows, messages, _ = encode_with_plans(sharegpt, dict(WHY_ROW, conversations=[
        *WHY_ROW["conversations"][:2], {"from": "observation", "value": "T9_0 sunny"},
        {"from": "observation", "value": "T9_0 rainy"}, WHY_ROW["conversations"][-1]]))
    calls = [c["id"] for c in messages[1]["tool_calls"]]
    assert len(rows) == 1 and len(set(calls)) == 2
    assert [(m["tool_call_id"], m["name"]) for m in messages[2:4]] == [(calls[0], "fn9_0"), (calls[1], "fn9_0")]


def test_compiled_renderer_answers_attribute_lookups_as_the_sandbox_does():
    """template_renderer's shortcut lookups give what transformers' sandboxed render gives: dict keys named like
    dict methods, missing keys, loop counters, and unsafe attributes still refused."""
    from jinja2.exceptions import SecurityError
    from transformers.utils.chat_template_utils import render_jinja_template

    from mindspeed_pack.data import template_renderer

    source = ("{% for m in messages %}{{ loop.index0 }}/{{ loop.length }}{{ loop.first }}{{ loop.last }}:{{ m.role }}"
              "|{{ m.items is defined }}|{{ m.get('content') }}|{{ m.missing is defined }}|{{ m.missing }}"
              "|{{ m['keys'] if 'keys' in m else '-' }}|{{ m.copy is defined }}|{{ m.tool_calls[0].function.name "
              "if m.tool_calls else '' }}|{{ (m.__class__ is defined) }}|{{ m.__len__ is defined }}\n{% endfor %}"
              "{{ bos_token }}{{ add_generation_prompt }}{{ tools | length if tools else 0 }}")
    messages = [{"role": "user", "content": "u", "items": "ITEMS", "keys": "KEYS"},
                {"role": "assistant", "content": "a", "copy": "COPY",
                 "tool_calls": [{"type": "function", "function": {"name": "fn", "arguments": {}}}]}]
    tools = [{"type": "function", "function": {"name": "t"}}]
    template = template_renderer.compile_template(source)
    steps = template_renderer.transformers_steps()
    if steps is None:  # (transformers 5.17, say) render_prefixes then calls transformers' own render: nothing to match
        pytest.skip("this transformers has no separate render steps; the compiled-renderer shortcut is not used")
    plain, alias, _ = steps
    shared = template_renderer.shared_variables(template, {"bos_token": "<s>"})
    for gen in (False, True):
        ours = template_renderer.render(template, {**shared, "tools": tools, "messages": alias(plain(messages)),
                                                   "add_generation_prompt": gen})
        theirs = render_jinja_template([messages], tools=tools, chat_template=source, add_generation_prompt=gen,
                                       bos_token="<s>")[0][0]
        assert ours == theirs
    assert "0/2TrueFalse:user|True|u|False||KEYS|True||False|False" in ours  # dict methods win, as in the sandbox
    unsafe = template_renderer.compile_template("{{ messages.__class__.__subclasses__() }}")
    with pytest.raises(SecurityError):
        template_renderer.render(unsafe, {**shared, "tools": None, "messages": [], "add_generation_prompt": False})

WHY_ROW = {  # the issue's row: LLaMA-Factory ShareGPT with a tools column, a call (parallel) and its results
    "conversations": [{"from": "human", "value": "U9_0 weather in Paris and Rome?"},
                      {"from": "function_call", "value": '[{"name": "fn9_0", "arguments": {"q": "Paris"}}, '
                                                         '{"name": "fn9_0", "arguments": "{\\"q\\": \\"Rome\\"}"}]'},
                      {"from": "observation", "value": "T9_0 sunny, rainy"},
                      {"from": "gpt", "value": "A9_1 Sunny in Paris, rainy in Rome."}],
    "tools": [chat_corpus._schema(9, 0)],
}


@pytest.mark.parametrize("prompt_type", ["qwen2_5", "qwen"])
def test_tools_column_renders_like_official_qwen2_5_with_json_templates(prompt_type, family_tokenizer_dir):
    """--prompt-type hf and the JSON qwen templates render the schemas and calls exactly as Qwen2.5's template."""
    from mindspeed_pack.data.handlers import SampleEncoder
    from mindspeed_pack.data.templates import get_template

    tok_dir = family_tokenizer_dir("qwen2_5")
    hf_encoder = _encoder(tok_dir, map_keys=None)
    ((_, official, official_trained),), _, _ = encode_with_plans(hf_encoder, WHY_ROW)
    tok = hf_encoder.tokenizer
    row = dict(WHY_ROW)
    if prompt_type == "qwen":  # qwen's default system prompt differs from Qwen2.5's: give Qwen2.5's explicitly
        row["system"] = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    keys, _ = resolve_map_keys(SHAREGPT, None)
    (ids, trained), _, _ = SampleEncoder(SHAREGPT, tok, get_template(prompt_type), keys, None, False).encode_row(row, "row 1")
    text = tok.decode(official)
    assert "<tools>\n" + __import__("json").dumps(chat_corpus._schema(9, 0)) + "\n</tools>" in text
    # the JSON path ends the sample on <|im_end|>; the official render adds the newline after it (untrained)
    assert tok.decode(ids) + "\n" == text
    assert np.array_equal(ids, official[:-1]) and np.array_equal(trained, official_trained[:-1])


@pytest.mark.parametrize("prompt_type", ["hf", "qwen2_5"])
def test_bare_tool_schemas_render_in_openais_form(prompt_type, family_tokenizer_dir):
    """LLaMA-Factory's tools column holds bare {"name", "description", "parameters"} schemas, which were written bare;
    an inference server gives the template OpenAI's {"type": "function", "function": ...}, as LLaMA-Factory writes
    them: the same row with either form now gives the same sample."""
    from mindspeed_pack.data.handlers import SampleEncoder
    from mindspeed_pack.data.templates import get_template

    tok_dir = family_tokenizer_dir("qwen2_5")
    bare = dict(WHY_ROW, tools=json.dumps([chat_corpus._schema(9, 0)["function"]]))
    if prompt_type == "hf":
        encoder = _encoder(tok_dir, map_keys=None)
        encode = (lambda row: encode_with_plans(encoder, row)[0][0][1])
    else:
        keys, _ = resolve_map_keys(SHAREGPT, None)
        encoder = SampleEncoder(SHAREGPT, _encoder(tok_dir).tokenizer, get_template("qwen2_5"), keys, None, False)
        encode = (lambda row: encoder.encode_row(row, "row 1")[0][0])
    assert np.array_equal(encode(bare), encode(WHY_ROW))


def test_glm4_turns_train_the_token_that_stops_them_as_glms_own_fine_tuning_does(family_tokenizer_dir):
    """GLM-4's template writes no end-of-turn token: its turns trained none, so the model never learned where to stop.
    GLM's fine-tuning script trains the token that begins the next message (<|user|>, <|observation|>: stop tokens
    of its generation config) and appends <|user|> after the last message; so does the hf path now."""
    encoder = _encoder(family_tokenizer_dir("glm4"))
    call = {"type": "function", "function": {"name": "fn3", "arguments": {"q": "V3"}}}
    row = {"messages": [{"role": "user", "content": "U0"}, {"role": "assistant", "content": "A1"},
                        {"role": "user", "content": "U2"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "content": "T4"}, {"role": "assistant", "content": "A5"}]}
    ((_, ids, trained),), messages, _ = encode_with_plans(encoder, row)
    tok = encoder.tokenizer
    official = encoder.tokenizer.hf.apply_chat_template(messages, tokenize=False)
    assert tok.decode(ids) == official + "<|user|>"
    assert encoder.chat.turn_stop == "<|user|>" and encoder.chat.identity()["turn_stop"] == "<|user|>"
    runs = np.split(np.arange(len(ids)), np.flatnonzero(np.diff(trained.astype(np.int8))) + 1)
    assert [tok.decode(ids[r]) for r in runs if trained[r[0]]] == [
        "\n<think></think>\nA1<|user|>",
        "\n<think></think>\n<tool_call>fn3\n<arg_key>q</arg_key>\n<arg_value>V3</arg_value>\n</tool_call><|observation|>",
        "\n<think></think>\nA5<|user|>"]
    for family in ("qwen2_5", "llama3_1", "gemma3", "phi3_5"):  # templates that end their turns themselves
        assert _encoder(family_tokenizer_dir(family)).chat.turn_stop is None, family


def test_append_eod_refusal_does_not_claim_every_template_ends_turns(tmp_path, run_preprocess):
    """The refusal said every template ends its turns with an end-of-turn token, trained; GLM-4's has none."""
    code, _, err = run_preprocess(input=tmp_path / "x.jsonl", output_prefix=tmp_path / "p", prompt_type="hf",
                                  handler_name=SHAREGPT, seq_length=64, append_eod=True)
    assert code != 0 and "--append-eod does not apply to --prompt-type hf" in err
    assert "GLM-4" in err and "ends every turn" not in err and "<|user|>" in err


def test_json_template_without_tool_support_refuses_tools(toy_tokenizer_dir):
    from mindspeed_pack.data.handlers import SampleEncoder
    from mindspeed_pack.data.templates import get_template
    from mindspeed_pack.data.tokenizer import load_tokenizer

    keys, _ = resolve_map_keys(SHAREGPT, None)
    encoder = SampleEncoder(SHAREGPT, load_tokenizer(TokenizerSpec("PretrainedFromHF", str(toy_tokenizer_dir))),
                            get_template("chatml"), keys, None, False)
    with pytest.raises(RowError, match=r"row 4: the row has tool schemas, which template 'chatml' does not render "
                                       r"\(refused, not dropped\)"):
        encoder.encode_row(WHY_ROW, "row 4")


def test_inspect_pack_names_gpt_oss_reasoning_and_tool_calls():
    """gpt-oss's analysis channel and its calls were shown as plain answers."""
    from mindspeed_pack.tools.inspect_pack import span_kinds

    assert span_kinds("<|channel|>analysis<|message|>r<|end|><|start|>assistant<|channel|>final<|message|>a") == \
        ["reasoning"]
    assert span_kinds(' to=functions.f<|channel|>commentary json<|message|>{"x": 1}<|call|>') == ["tool call"]


def test_prompt_type_hf_end_to_end_preprocess_train_inspect(tmp_path, family_tokenizer_dir, run_preprocess, capsys):
    """preprocess_data.py --prompt-type hf (Qwen3, tools, reasoning) -> packs -> posttrain a few steps -> inspect_pack."""
    import json

    from mindspeed_pack.data import toy
    from mindspeed_pack.tools import inspect_pack
    from tests.train_utils import run_posttrain

    data = toy.write_dataset(tmp_path / "chat.jsonl", CORPUS[:39])
    prefix = str(tmp_path / "sft")
    code, out, err = run_preprocess(input=data, output_prefix=prefix, tokenizer_name_or_path=family_tokenizer_dir("qwen3"),
                                    handler_name=SHAREGPT, prompt_type="hf", map_keys=json.dumps(chat_corpus.MAP_KEYS),
                                    chat_template_kwargs='{"enable_thinking": true}', seq_length=1024, pack=True,
                                    neat_pack=True)
    assert code == 0, err
    meta = json.loads(open(f"{prefix}_packed_meta.json").read())
    template = meta["cache_key"]["template"]
    assert template["name"] == "hf" and template["chat_template_kwargs"] == {"enable_thinking": True}
    assert meta["statistics"]["samples_written"] > meta["statistics"]["samples_read"] - 3  # Qwen3 splits rewritten turns
    run_posttrain(["--data-path", prefix, "--seq-length", "1024", "--padded-vocab-size", "1152", "--neat-pack",
                   "--prompt-type", "hf", "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "2",
                   "--lr", "1e-4", "--min-lr", "1e-5", "--lr-warmup-iters", "0"])
    capsys.readouterr()
    shown = []
    for index in range(3):
        assert inspect_pack.main([prefix, "--index", str(index)]) == 0
        shown.append(capsys.readouterr().out)
    shown = "".join(shown)
    assert "trained span 0: positions" in shown and "reasoning" in shown and "tool call" in shown
    assert "[[<think>" in shown and "<|im_end|>]]" in shown


@pytest.mark.parametrize("name,official,family", [("qwen2_5", "qwen2_5.jinja", "qwen2_5"), ("llama3", "llama3.jinja", "llama3_1")])
def test_json_templates_equal_their_official_counterparts(name, official, family, family_tokenizer_dir):
    """qwen2_5 (tools included) and llama3 (content trimmed) render the corpus exactly as the official templates."""

    tok_dir = family_tokenizer_dir(family)
    official_encoder = _encoder(tok_dir, map_keys=None, chat_template=str(chat_corpus.TEMPLATES / official))
    compared = 0
    # skipped: tools on llama3 (JSON: no format_tools), parallel calls on Llama
    for i, (ids, trained), (o_ids, o_trained) in _corpus_pairs(official_encoder, name, (RowError,)):
        assert np.array_equal(ids, o_ids[:len(ids)]) and len(o_ids) - len(ids) <= 1, f"row {i}"
        assert np.array_equal(trained, o_trained[:len(ids)]), f"row {i}"
        compared += 1
    assert compared >= 40


def _corpus_pairs(official_encoder, name: str, skipped: tuple):
    """(row, the named template's (ids, trained), the official template's) for the corpus rows (ShareGPT form) both
    render as one sample; rows raising ``skipped`` are left out."""
    from mindspeed_pack.data.handlers import SampleEncoder
    from mindspeed_pack.data.templates import get_template

    keys, _ = resolve_map_keys(SHAREGPT, None)
    encoder = SampleEncoder(SHAREGPT, official_encoder.tokenizer, get_template(name), keys, None, False)
    for i, row in enumerate(CORPUS[:130]):
        row = chat_corpus.as_sharegpt(row)
        try:
            if row is None or len(expected := official_encoder.encode_chat_row(row, f"row {i}")) != 1:
                continue
            sample, _, _ = encoder.encode_row(row, f"row {i}")
        except skipped:
            continue
        if sample is not None:
            yield i, sample, expected[0]


def test_qwen3_enable_thinking_false_leaves_the_prefilled_think_block_untrained(family_tokenizer_dir):
    row = {"messages": [{"role": "user", "content": "U1_0 q"}, {"role": "assistant", "content": "A1_0 a"}]}
    trained_text = {}
    for thinking in (True, False):
        encoder = _encoder(family_tokenizer_dir("qwen3"), chat_template_kwargs={"enable_thinking": thinking})
        ((_, ids, trained),), _, _ = encode_with_plans(encoder, row)
        trained_text[thinking] = encoder.tokenizer.decode(ids[trained.astype(bool)])
    assert trained_text[True] == "<think>\n\n</think>\n\nA1_0 a<|im_end|>"  # the model writes the empty block itself
    assert trained_text[False] == "A1_0 a<|im_end|>"  # the generation prompt writes it: context, not trained


@pytest.mark.parametrize("family", ["qwen3", "glm4", "phi3_5"])
def test_reasoning_history_keep_trains_every_turn_once_in_one_sample(family, family_tokenizer_dir):
    """Templates that rewrite history (reasoning dropped, EOS only at the end): keep gives one sample per row."""
    encoder = _encoder(family_tokenizer_dir(family), reasoning_history="keep")
    tok, checked = encoder.tokenizer, 0
    for i, row in enumerate(CORPUS[:60]):
        try:
            samples, messages, _ = encode_with_plans(encoder, row, f"row {i}")
        except RowError:
            continue  # tools on Phi-3.5
        if not samples:
            continue
        (sample, ids, trained), = samples
        text, trained_text = tok.decode(ids), tok.decode(ids[trained.astype(bool)])
        assistant = [m for m in messages if m["role"] == "assistant"]
        assert len(sample.turns) == len(assistant), f"row {i}"
        for tag in TAG.finditer(text):
            whose = tag.group(1)
            assert (whose in "AR") == (tag.group(0) in trained_text), f"row {i}: {tag.group(0)}"
        for m in assistant:
            assert (m.get("reasoning_content") or "").strip() in text and text.count(m["content"].strip() or "\0") <= 1
        checked += 1
    assert checked >= 30


REJECTED_TAILS = ["pear moon", "你好", "  rock\n"]


def _pair_rows():
    """Preference rows from the corpus: every conversation ending with a plain assistant answer, its history
    as the prompt, that answer as chosen and another one as rejected."""
    rows = []
    for i, row in enumerate(CORPUS):
        *prompt, last = row["messages"]
        if last["role"] == "assistant" and isinstance(last.get("content"), str) and set(last) == {"role", "content"}:
            rows.append((i, {**{k: v for k, v in row.items() if k != "messages"}, "messages": prompt,
                             "chosen": last["content"], "rejected": f"{last['content']} no, {REJECTED_TAILS[i % 3]}"}))
    return rows


@pytest.mark.parametrize("family", ["qwen2_5", "llama3_1"])
def test_preference_pairs_are_the_official_template_and_train_only_the_answer(family, family_tokenizer_dir):
    """--prompt-type hf pairs: chosen and rejected are apply_chat_template(prompt + [answer]) token for token,
    the prompt's tokens are the same in both, and exactly the answer incl. its end-of-turn token is trained."""
    from mindspeed_pack.data.handlers import SHAREGPT_PAIRWISE

    encoder = _encoder(family_tokenizer_dir(family), handler=SHAREGPT_PAIRWISE, seq_length=4096)
    hf, kwargs = encoder.tokenizer.hf, encoder.chat.kwargs
    eot_id = encoder.tokenizer.token_to_id(chat_corpus.FAMILIES[family][3])
    written = 0
    for i, row in _pair_rows():
        try:
            samples = encoder.encode_chat_row(row, f"row {i}")
        except RowError as exc:
            assert exc.reason in ALLOWED_REFUSALS.get(family, set()), exc
            continue
        prompt, tools = encoder._chat_messages(row, f"row {i}", answer=False)
        prompt, _ = encoder.chat.adapt(prompt, tools)
        context = _apply(hf, prompt, tools, kwargs, add_generation_prompt=True)["input_ids"]
        assert len(samples) == 2, f"row {i}"
        for (ids, trained), answer in zip(samples, (row["chosen"], row["rejected"])):
            full = _apply(hf, prompt + [{"role": "assistant", "content": answer}], tools, kwargs)["input_ids"]
            assert ids.tolist() == full, f"row {i}"
            assert ids[:len(context)].tolist() == context, f"row {i}"
            end = max(np.flatnonzero(ids == eot_id)) + 1  # the answer's end-of-turn token, trained; no separator
            expected = np.zeros(len(ids), np.uint8)
            expected[len(context):end] = 1
            assert trained.tolist() == expected.tolist(), f"row {i}"
        written += 1
    assert written >= 30


def test_preference_pairs_with_prompt_type_hf_preprocess_and_train_dpo(tmp_path, family_tokenizer_dir, run_preprocess):
    """SharegptStylePairwiseHandler --prompt-type hf -> packed pairs -> posttrain --stage dpo (first loss log 2);
    a bad pair row stops the run naming file, line and field."""
    import json
    import math

    from mindspeed_pack.data import toy
    from tests.train_utils import run_posttrain

    rows = [row for _, row in _pair_rows() if len(json.dumps(row)) < 300][:12]
    data = toy.write_dataset(tmp_path / "pairs.jsonl", rows)
    prefix = str(tmp_path / "dpo")
    flags = dict(tokenizer_name_or_path=family_tokenizer_dir("qwen2_5"), handler_name="SharegptStylePairwiseHandler",
                 prompt_type="hf", map_keys=json.dumps(chat_corpus.MAP_KEYS), seq_length=256, pack=True, neat_pack=True)
    code, out, err = run_preprocess(input=data, output_prefix=prefix, **flags)
    assert code == 0, err
    stats = json.loads(open(f"{prefix}_packed_meta.json").read())["statistics"]
    assert stats["pairs"] == len(rows) and stats["samples_written"] == 2 * len(rows), stats
    metrics = str(tmp_path / "dpo.jsonl")
    _, records = run_posttrain(["--stage", "dpo", "--dpo-beta", "0.5", "--data-path", prefix, "--seq-length", "256",
                                "--padded-vocab-size", "1152", "--neat-pack", "--micro-batch-size", "1",
                                "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-4", "--min-lr", "1e-5",
                                "--lr-warmup-iters", "0"], metrics=metrics)
    losses = [r["lm loss"] for r in records if r["split"] == "train"]
    assert len(losses) == 2 and math.isclose(losses[0], math.log(2), rel_tol=1e-5)

    rows[5] = {**rows[5], "messages": rows[5]["messages"] + [{"role": "moderator", "content": "x"}]}
    data = toy.write_dataset(tmp_path / "bad.jsonl", rows)
    code, out, err = run_preprocess(input=data, output_prefix=str(tmp_path / "bad"), **flags)
    assert code == 2 and "bad.jsonl" in err and "line 6" in err and "'moderator'" in err, err


def _full_offsets_answers(offsets, s, e):
    hit = np.flatnonzero((offsets[:, 1] > s) & (offsets[:, 0] < e))
    return hit.tolist(), (int(offsets[hit[0], 0]), int(offsets[hit[-1], 1])) if len(hit) else None


def test_token_boundaries_asked_per_span_equal_full_offsets(family_tokenizer_dir):
    """The hf path asks the encoding for a span's tokens (EncodedText) instead of converting every token's
    offsets: for every span of texts with CJK/emoji (several byte tokens per character), special and added
    tokens, the overlapping tokens, the span's token bounds and the token starts equal the full offsets'; a
    normaliser that drops characters falls back to the full offsets with the same answers."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    from mindspeed_pack.data.tokenizer import EncodedText, load_tokenizer

    tok = load_tokenizer(TokenizerSpec("PretrainedFromHF", str(family_tokenizer_dir("qwen2_5"))))
    texts = ["<|im_start|>user\n你好，世界 🙂<|im_end|>\n", "a 日本語 b<think>é</think>\n\n猫と犬。", "中국어 x"]
    plain = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    plain.normalizer, plain.pre_tokenizer = normalizers.Replace("-", ""), pre_tokenizers.Whitespace()
    cases = [(t, e) for t, e in zip(texts, tok._encode_with_offsets(texts))]
    enc = plain.encode("a -b- a--b")
    cases.append(("a -b- a--b", EncodedText(np.array(enc.ids, np.int32), enc)))
    shared = 0
    for text, encoded in cases:
        full = np.array(encoded._encoding.offsets, np.int64).reshape(-1, 2)
        shared += int(np.sum((full[1:] == full[:-1]).all(axis=1)))
        for s in range(len(text)):
            assert encoded.starts_token(s) == bool(np.any(full[:, 0] == s)), (text, s)
            for e in range(s + 1, len(text) + 1):
                index, head, tail = encoded.overlapping(s, e)
                hit, bounds = _full_offsets_answers(full, s, e)
                assert np.arange(len(full))[index].tolist() == hit, (text, s, e)
                got = None if head is None else (encoded.token_start(head), encoded.token_end(tail))
                assert got == bounds, (text, s, e)
        # byte-level: every character is in a token, so the full offsets were never needed; "-" is in none
        assert (encoded._offsets is not None) == ("-" in text)
        assert np.array_equal(encoded.offsets, full) and not encoded.starts_token(len(text))
    assert shared > 5  # the corpus has characters split into several byte tokens


BYTE_EDGE_TEXTS = ["<|im_start|>user\n你好，世界 🙂<|im_end|>\n", "a 日本語 b<think>é</think>\n\n猫と犬。", "中국어 x",
                   "👍🏽👨‍👩‍👧 ok", "say <|eot_id|> and <|im_end|>", "  \n\n\t \r\n  ", "x\u00a0y\u3000z", "", "\u0301e"]


def _edited_tokenizer(source_dir, out_dir, edit):
    """A copy of a fixture tokenizer whose tokenizer.json ``edit(spec)`` changed."""
    import json
    import shutil

    from mindspeed_pack.data.tokenizer import HFTokenizer

    shutil.copytree(source_dir, out_dir)
    spec = json.loads((out_dir / "tokenizer.json").read_text(encoding="utf-8"))
    edit(spec)
    (out_dir / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    return HFTokenizer(str(out_dir))


def _normalised(normalizer):
    """An edit: ``normalizer`` and Qwen's pre-tokenizer layout (a Split, then ByteLevel without its regex)."""
    def edit(spec):
        spec["normalizer"] = normalizer
        spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\s+|\\p{L}+|[^\\s\\p{L}]+"}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
    return edit


def _merge_across_characters(spec):
    """An edit: one BPE token holding the last byte of 你 and the first of 好 (a token inside two characters)."""
    model = spec["model"]
    model["vocab"]["łå"] = 5000  # past every id in use
    model["merges"].append(["ł", "å"] if model["merges"] and isinstance(model["merges"][0], list) else "ł å")


@pytest.mark.parametrize("family", ["qwen2_5", "llama3_1"])
def test_byte_level_boundaries_equal_the_offsets_path(family, family_tokenizer_dir):
    """Byte-level BPE tokenizers skip offsets (ids' byte lengths give the token starts): on edge texts every
    span's tokens, bounds and token starts equal the offsets path's, and on the whole chat corpus the samples,
    trained tokens and refusals (a span boundary inside a character's bytes included) are the same."""
    from mindspeed_pack.data.byte_boundaries import ByteEncodedText

    encoder = _encoder(family_tokenizer_dir(family))
    tok = encoder.tokenizer
    assert tok.byte_level_lengths() is not None and not tok.byte_level_lengths().needs_nfc
    for text, fast in zip(BYTE_EDGE_TEXTS, tok.encode_batch_offsets(BYTE_EDGE_TEXTS)):
        full = tok._encode_with_offsets([text])[0].offsets
        assert isinstance(fast, ByteEncodedText) and np.array_equal(fast.offsets, full), text
        for s in range(len(text) + 1):
            assert fast.starts_token(s) == bool(np.any(full[:, 0] == s)), (text, s)
            for e in range(s, len(text) + 1):
                index, head, tail = fast.overlapping(s, e)
                hit, bounds = _full_offsets_answers(full, s, e)
                assert np.arange(len(full))[index].tolist() == hit, (text, s, e)
                assert (None if head is None else (fast.token_start(head), fast.token_end(tail))) == bounds, (text, s, e)

    def finished(encode, row, where):
        texts = []
        plan, skip = encoder.plan_chat_row(row, where, texts)
        if plan is None:
            return skip
        try:
            out = encoder.finish_chat(plan, encode(texts))
        except RowError as exc:
            return exc.reason, str(exc)
        return [(s[0].tolist(), s[1].tolist(), truncated) if s else (s, skip, truncated) for s, skip, truncated in out]

    compared = trained = 0
    rows = [*CORPUS, {"messages": [{"role": "user", "content": "你好"}, {"role": "assistant", "content": "猫と犬"}]}]
    for i, row in enumerate(rows):
        try:
            expected = finished(tok._encode_with_offsets, row, f"row {i}")
        except RowError:
            continue  # refused before encoding: the same either way
        got = finished(tok.encode_batch_offsets, row, f"row {i}")
        assert got == expected, f"row {i}"
        compared += 1
        trained += isinstance(got, list) and any(isinstance(s[1], list) and sum(s[1]) for s in got)
    assert compared >= 200 and trained >= 150, (compared, trained)


def test_byte_level_boundaries_fall_back_where_the_text_may_change(family_tokenizer_dir, tmp_path):
    """A normaliser that changes text (Lowercase) keeps the offsets path for every text; under NFC only a text
    that is not NFC takes it; a wrong byte length is caught by the length check and takes it too."""
    from mindspeed_pack.data.byte_boundaries import ByteEncodedText
    from mindspeed_pack.data.tokenizer import EncodedText

    source = family_tokenizer_dir("qwen2_5")
    lower = _edited_tokenizer(source, tmp_path / "lower", _normalised({"type": "Lowercase"}))
    assert lower.byte_level_lengths() is None
    assert all(isinstance(e, EncodedText) for e in lower.encode_batch_offsets(["Ab 你好", "x"]))

    nfc = _edited_tokenizer(source, tmp_path / "nfc", _normalised({"type": "NFC"}))
    assert nfc.byte_level_lengths() is not None and nfc.byte_level_lengths().needs_nfc
    texts = ["caf\u00e9 你好 🙂", "cafe\u0301 x", "plain words  \n"]
    got, full = nfc.encode_batch_offsets(texts), nfc._encode_with_offsets(texts)
    assert [type(e) for e in got] == [ByteEncodedText, EncodedText, ByteEncodedText]
    for g, f in zip(got, full):
        assert np.array_equal(g.ids, f.ids) and np.array_equal(g.offsets, f.offsets)

    tok = _encoder(source).tokenizer
    tok.byte_level_lengths().lengths[tok.encode("a b")[-1]] += 1  # a wrong table entry (" b" read as 3 bytes)
    got = tok.encode_batch_offsets(["a b", "ab"])
    assert [type(e) for e in got] == [EncodedText, ByteEncodedText]
    assert got[0].ids.tolist() == tok.encode("a b")


def test_span_boundary_inside_a_characters_bytes_is_inside_a_token(family_tokenizer_dir, tmp_path):
    """With a token that holds bytes of two CJK characters, spans and turns at every position get the same trained
    tokens, or the same "inside a token" refusal, from byte lengths as from offsets."""
    from types import SimpleNamespace

    from mindspeed_pack.data.byte_boundaries import ByteEncodedText

    encoder = _encoder(family_tokenizer_dir("qwen2_5"))
    tok = _edited_tokenizer(family_tokenizer_dir("qwen2_5"), tmp_path / "merged", _merge_across_characters)
    text = "你好 ok猫好"
    fast, full = tok.encode_batch_offsets([text]), tok._encode_with_offsets([text])
    assert isinstance(fast[0], ByteEncodedText) and "łå" in tok.hf.convert_ids_to_tokens(fast[0].ids.tolist())
    refused = 0
    for s in range(len(text)):
        for e in range(s + 1, len(text) + 1):
            plan = ("row x", [(SimpleNamespace(text=text, trained=[(s, e)], turns=[(1, s, e)]), 0)])
            answers = []
            for encoded in (fast, full):
                try:
                    answers.append([x[0][1].tolist() if x[0] else x[1] for x in encoder.finish_chat(plan, encoded)])
                except RowError as exc:
                    answers.append(exc.reason)
            assert answers[0] == answers[1], (s, e)
            refused += answers[0] == REASON_TOKEN_BOUNDARY
    assert refused >= len(text)  # every span starting or ending at 好 (after 你)


def test_json_qwen2_5_writes_openai_tool_calls_as_the_official_template(family_tokenizer_dir):
    """OpenAI rows on --prompt-type qwen2_5: tool calls (parallel ones, string arguments, text beside the calls) and
    consecutive tool results are written as Qwen2.5's own template renders them, never trained as empty answers or
    skipped; reasoning, which no JSON template writes, is refused naming the row, message and field."""
    from mindspeed_pack.data.handlers import SampleEncoder
    from mindspeed_pack.data.templates import get_template

    hf_encoder = _encoder(family_tokenizer_dir("qwen2_5"))
    keys, _ = resolve_map_keys(SHAREGPT, chat_corpus.MAP_KEYS)
    json_encoder = SampleEncoder(SHAREGPT, hf_encoder.tokenizer, get_template("qwen2_5"), keys, None, False)
    rows = [(i, row) for i, row in enumerate(CORPUS) if i % 13 in (7, 8, 9)]
    texted = json.loads(json.dumps(rows[0][1]))
    texted["messages"][1]["content"] = "A7_0 let me look that up"  # text before the call
    rows.append((999, texted))
    for i, row in rows:
        ((official, official_trained),) = hf_encoder.encode_chat_row(row, f"row {i}")
        (ids, trained), skip, _ = json_encoder.encode_row(row, f"row {i}")
        assert skip is None, f"row {i}"
        # the JSON path ends the sample on <|im_end|>; the official render adds the newline after it (untrained)
        assert ids.tolist() == official[:-1].tolist() and trained.tolist() == official_trained[:-1].tolist(), f"row {i}"
    assert "A7_0 let me look that up\n<tool_call>" in hf_encoder.tokenizer.decode(ids[trained.astype(bool)])
    reasoning = CORPUS[12]
    with pytest.raises(RowError, match=r"row 12: message 1 has 'reasoning_content', which template 'qwen2_5' does not "
                                       r"write as given \(refused, not dropped\); use --prompt-type hf") as err:
        json_encoder.encode_row(reasoning, "row 12")
    assert err.value.reason == REASON_REASONING
    chatml = SampleEncoder(SHAREGPT, hf_encoder.tokenizer, get_template("chatml"), keys, None, False)
    with pytest.raises(RowError, match=r"row 5: message 1 has text beside its tool_calls, which template 'chatml'"):
        chatml.encode_row({"messages": texted["messages"]}, "row 5")


@pytest.mark.parametrize("prompt_type", ["qwen2_5", "qwen3"])
def test_json_templates_take_openai_tool_rows_with_the_docs_map_keys(prompt_type, family_tokenizer_dir):
    """The docs' --map-keys for OpenAI rows names only messages/role/content: the OpenAI role names (assistant,
    tool) still carry tool calls and tool results on a JSON template, as under --prompt-type hf, and give the
    same tokens as the rows with every role named."""
    from mindspeed_pack.data.handlers import SampleEncoder
    from mindspeed_pack.data.templates import get_template

    tokenizer = _encoder(family_tokenizer_dir("qwen2_5")).tokenizer
    short, _ = resolve_map_keys(SHAREGPT, {"messages": "messages", "role": "role", "content": "content"})
    named, _ = resolve_map_keys(SHAREGPT, chat_corpus.MAP_KEYS)
    rows = [(i, row) for i, row in enumerate(CORPUS[:80]) if any(m.get("tool_calls") for m in row["messages"])
            and not any(m.get("reasoning_content") for m in row["messages"])]
    assert rows
    for i, row in rows:
        got = SampleEncoder(SHAREGPT, tokenizer, get_template(prompt_type), short, None, False).encode_row(row, f"row {i}")
        want = SampleEncoder(SHAREGPT, tokenizer, get_template(prompt_type), named, None, False).encode_row(row, f"row {i}")
        assert got[1] is None and np.array_equal(got[0][0], want[0][0]) and np.array_equal(got[0][1], want[0][1])


@pytest.mark.parametrize("prompt_type", ["qwen2_5", "hf"])
def test_a_tool_result_given_as_an_object_is_its_json_text(prompt_type, family_tokenizer_dir):
    """Tool results are often stored as the object the tool returned ({"temperature": 21}); the row was refused
    ("must be a string"). It is written as its JSON text, as the tool's output reaches the model."""
    from mindspeed_pack.data.handlers import SampleEncoder
    from mindspeed_pack.data.templates import get_template

    tok_dir = family_tokenizer_dir("qwen2_5")
    tokenizer = _encoder(tok_dir).tokenizer
    keys, _ = resolve_map_keys(SHAREGPT, chat_corpus.MAP_KEYS)
    result = {"city": "Zürich", "temperature": 21, "sky": ["clear", "windy"]}
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Zürich"}}}

    def row(content):
        return {"messages": [{"role": "user", "content": "Weather in Zürich?"},
                             {"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "content": content},
                             {"role": "assistant", "content": "21 degrees, clear."}]}

    if prompt_type == "hf":  # the model's own chat template
        encoder = _encoder(tok_dir)
        encode = (lambda row: [(ids, trained) for _, ids, trained in encode_with_plans(encoder, row)[0]][0])
    else:
        encoder = SampleEncoder(SHAREGPT, tokenizer, get_template(prompt_type), keys, None, False)
        encode = (lambda row: encoder.encode_row(row, "row 0")[0])
    got, want = encode(row(result)), encode(row(json.dumps(result, ensure_ascii=False)))
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert '"city": "Zürich", "temperature": 21' in tokenizer.decode(got[0])
    with pytest.raises(RowError, match="'content' must be a string"):  # an object is a tool's result only
        encode({"messages": [{"role": "user", "content": result}, {"role": "assistant", "content": "x"}]})


@pytest.mark.parametrize("prompt_type,family", [("qwen2_5", "qwen2_5"), ("qwen3", "qwen3_2507"), ("qwen3", "qwen3")])
def test_json_qwen_templates_write_tool_rows_as_the_official_template(prompt_type, family, family_tokenizer_dir):
    """Rows with tool schemas, with and without a system message, and rows without tools: the JSON template writes
    the official template's tokens. Qwen3 without a system message opens the tools prompt with
    ``<|im_start|>system\n# Tools``. Qwen3's hybrid template also gives the last answer an empty
    ``<think></think>`` block (the JSON ``qwen3`` is its non-thinking form, Qwen3-Instruct-2507's template):
    there, the text before the first answer (system, tools, first query) is compared."""
    from mindspeed_pack.data.handlers import SampleEncoder
    from mindspeed_pack.data.templates import get_template

    hf_encoder = _encoder(family_tokenizer_dir(family))
    keys, _ = resolve_map_keys(SHAREGPT, chat_corpus.MAP_KEYS)
    json_encoder = SampleEncoder(SHAREGPT, hf_encoder.tokenizer, get_template(prompt_type), keys, None, False)
    rows = [(i, row) for i, row in enumerate(CORPUS[:80]) if i % 13 in (0, 1, 4, 5, 6, 7, 8, 9)
            and not any(m.get("reasoning_content") for m in row["messages"])]
    seen = set()
    for i, row in rows:
        official = hf_encoder.encode_chat_row(row, f"row {i}")[0][0]
        (ids, _), skip, _ = json_encoder.encode_row(row, f"row {i}")
        assert skip is None, f"row {i}"
        if family == "qwen3":
            text = hf_encoder.tokenizer.decode(official)
            head = text[:text.index("<|im_start|>assistant\n")]
            assert hf_encoder.tokenizer.decode(ids).startswith(head), f"row {i}"
        else:  # the JSON path ends the sample on <|im_end|>; the official render adds the newline after it
            assert ids.tolist() == official[:-1].tolist(), f"row {i}"
        seen.add(("tools" in row, row["messages"][0]["role"] == "system"))
    assert seen == {(True, True), (True, False), (False, True), (False, False)}


@pytest.mark.parametrize("prompt_type", ["llama3", "hf"])
def test_pairs_identical_after_the_template_are_dropped(prompt_type, tmp_path, family_tokenizer_dir, run_preprocess):
    """Llama 3's template trims answers: "hello  " and "hello" are the same tokens, so the pair teaches nothing and
    is dropped, counted and warned like a pair of equal strings (JSON template and the official one alike)."""
    from mindspeed_pack.data import toy

    rows = [{"instruction": "U1 greet", "chosen": "hello", "rejected": "hello  "},
            {"instruction": "U2 greet", "chosen": "hello", "rejected": "goodbye"}]
    data = toy.write_dataset(tmp_path / "pairs.jsonl", rows)
    code, _, err = run_preprocess(input=data, output_prefix=str(tmp_path / "p"), prompt_type=prompt_type,
                                  tokenizer_name_or_path=family_tokenizer_dir("llama3_1"),
                                  handler_name="AlpacaStylePairwiseHandler", seq_length=256, pack=True, neat_pack=True)
    assert code == 0, err
    stats = json.loads((tmp_path / "p_packed_meta.json").read_text())["statistics"]
    assert stats["pairs"] == 1 and stats["skipped"] == {"identical chosen and rejected": 1}, stats
    assert "1 rows with identical chosen and rejected answers skipped" in err


@pytest.mark.parametrize("prompt_type", ["hf", "qwen2_5"])
def test_parquet_tool_rows_give_the_jsonl_documents(prompt_type, tmp_path, family_tokenizer_dir, run_preprocess):
    """The same tool rows written with pyarrow to Parquet (struct columns hold every row's keys, null where a row had
    none) and to JSON lines give byte-identical packs: no row gains another row's keys as nulls."""
    from mindspeed_pack.data import toy

    rows = [CORPUS[i] for i in range(len(CORPUS)) if i % 13 in (7, 8)][:30]
    rows.append({"messages": [{"role": "user", "content": "U1 weather in Paris?"},
                              {"role": "assistant", "content": "",
                               "tool_calls": [{"type": "function", "function": {"name": "fn_w",
                                                                                "arguments": {"city": "Paris"}}}]},
                              {"role": "tool", "content": "T1 sunny"}, {"role": "assistant", "content": "A1 sunny"}],
                 "tools": [{"type": "function", "function": {"name": "fn_w", "description": "D1 weather", "parameters": {
                     "type": "object", "properties": {"city": {"type": "string"}, "tz": {"type": "string"}}}}}]})
    written = {}
    for ext in ("jsonl", "parquet"):
        data = toy.write_dataset(tmp_path / f"rows.{ext}", rows)
        code, _, err = run_preprocess(input=data, output_prefix=str(tmp_path / ext), prompt_type=prompt_type,
                                      tokenizer_name_or_path=family_tokenizer_dir("qwen2_5"), handler_name=SHAREGPT,
                                      map_keys=json.dumps(chat_corpus.MAP_KEYS), seq_length=1024, pack=True,
                                      neat_pack=True)
        assert code == 0, err
        written[ext] = {p.name[len(ext):]: p.read_bytes() for p in tmp_path.glob(f"{ext}_packed_*_document.bin")}
    assert len(written["jsonl"]) == 3 and written["parquet"] == written["jsonl"]


def _ordered_tool_rows(as_text: bool) -> list:
    """Two tool rows whose schema properties and call arguments are written in opposite key orders
    (``as_text``: the tool schemas and arguments as JSON text, as OpenAI and LLaMA-Factory data store them)."""
    def row(n, keys):
        schema = [{"type": "function", "function": {"name": "fn_w", "description": f"D{n} weather", "parameters": {
            "type": "object", "properties": {k: {"type": "string", "description": f"D{n} {k}"} for k in keys}}}}]
        args = {k: f"V{n}_{k}" for k in keys}
        call = {"type": "function", "function": {"name": "fn_w", "arguments": json.dumps(args) if as_text else args}}
        return {"messages": [{"role": "user", "content": f"U{n} weather?"},
                             {"role": "assistant", "content": "", "tool_calls": [call]},
                             {"role": "tool", "content": f"T{n} sunny"}, {"role": "assistant", "content": f"A{n} sunny"}],
                "tools": json.dumps(schema) if as_text else schema}
    return [row(1, ("city", "unit")), row(2, ("unit", "city"))]


def _preprocess_documents(tmp_path, name, rows, prompt_type, family_tokenizer_dir, run_preprocess, read_indexed):
    from mindspeed_pack.data import toy

    data = toy.write_dataset(tmp_path / name, rows)
    prefix = tmp_path / name.replace(".", "_")
    code, _, err = run_preprocess(input=data, output_prefix=str(prefix), prompt_type=prompt_type,
                                  tokenizer_name_or_path=family_tokenizer_dir("qwen2_5"), handler_name=SHAREGPT,
                                  map_keys=json.dumps(chat_corpus.MAP_KEYS), seq_length=1024)
    assert code == 0, err
    return [d.tolist() for d in read_indexed(f"{prefix}_packed_input_ids_document")], err


@pytest.mark.parametrize("prompt_type", ["hf", "qwen2_5"])
def test_parquet_json_text_tool_columns_keep_each_rows_key_order(prompt_type, tmp_path, family_tokenizer_dir,
                                                                 run_preprocess, read_indexed):
    """Tool schemas and call arguments stored as JSON text in Parquet give the input_ids of the same rows in JSON
    lines, each row's keys in its own order (the second row's "unit" before "city"), and no key-order warning."""
    rows = _ordered_tool_rows(as_text=True)
    jsonl, _ = _preprocess_documents(tmp_path, "rows.jsonl", rows, prompt_type, family_tokenizer_dir,
                                     run_preprocess, read_indexed)
    parquet, err = _preprocess_documents(tmp_path, "rows.parquet", rows, prompt_type, family_tokenizer_dir,
                                         run_preprocess, read_indexed)
    assert len(jsonl) == 2 and parquet == jsonl
    tok = _encoder(family_tokenizer_dir("qwen2_5")).tokenizer
    second = tok.decode(parquet[1])
    assert second.index('"unit": {') < second.index('"city": {') and second.index('"unit": "V2') < second.index('"city": "V2')
    assert "Arrow structs" not in err


@pytest.mark.parametrize("prompt_type", ["hf", "qwen2_5"])
def test_parquet_struct_tool_columns_take_the_columns_key_order_and_warn(prompt_type, tmp_path, family_tokenizer_dir,
                                                                        run_preprocess, read_indexed):
    """Tool schemas and arguments stored as Arrow structs keep one key order for the whole column (the first row's
    here), which the file cannot undo: the second row is tokenized as if written "city" before "unit", as the README
    says, and the run warns once, naming the file, the column, the struct paths and JSON text as the remedy."""
    rows = _ordered_tool_rows(as_text=False)
    as_column = json.loads(json.dumps(rows))  # the second row with the first row's key order, as Arrow reads it back
    for holder, key in ((as_column[1]["tools"][0]["function"]["parameters"], "properties"),
                        (as_column[1]["messages"][1]["tool_calls"][0]["function"], "arguments")):
        holder[key] = {k: holder[key][k] for k in ("city", "unit")}
    jsonl, _ = _preprocess_documents(tmp_path, "rows.jsonl", rows, prompt_type, family_tokenizer_dir,
                                     run_preprocess, read_indexed)
    reordered, _ = _preprocess_documents(tmp_path, "reordered.jsonl", as_column, prompt_type, family_tokenizer_dir,
                                         run_preprocess, read_indexed)
    parquet, err = _preprocess_documents(tmp_path, "rows.parquet", rows, prompt_type, family_tokenizer_dir,
                                         run_preprocess, read_indexed)
    assert parquet == reordered and parquet[0] == jsonl[0] and parquet[1] != jsonl[1]
    warnings = [line for line in err.splitlines() if "Arrow structs" in line]
    assert len(warnings) == 1, err
    assert ("rows.parquet: column 'tools' (tools[], tools[].function, tools[].function.parameters and 3 more) and "
            "column 'messages' (messages[].tool_calls[].function.arguments) hold objects stored as Arrow structs"
            in warnings[0])
    assert "JSON text" in warnings[0]
    assert "Arrow structs" not in _preprocess_documents(tmp_path, "rows2.jsonl", rows, prompt_type, family_tokenizer_dir,
                                                        run_preprocess, read_indexed)[1]


def _call(n):
    return {"role": "assistant", "content": "", "reasoning_content": f"R{n}",
            "tool_calls": [{"type": "function", "function": {"name": f"fn{n}", "arguments": {"q": f"V{n}"}}}]}


MULTI_STEP = {"messages": [{"role": "user", "content": "U0"}, _call(1), {"role": "tool", "content": "T2"}, _call(3),
                           {"role": "tool", "content": "T4"}, {"role": "assistant", "content": "A5", "reasoning_content": "R5"},
                           {"role": "user", "content": "U6"}, {"role": "assistant", "content": "A7", "reasoning_content": "R7"}]}
KEEP_TEXTS = {  # every turn as the template renders a final turn, joined by what it puts between turns
    "qwen3": ("<|im_start|>user\nU0<|im_end|>\n"
              + "".join(f"<|im_start|>assistant\n<think>\nR{n}\n</think>\n\n<tool_call>\n{{\"name\": \"fn{n}\", \"arguments\": "
                        f"{{\"q\": \"V{n}\"}}}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nT{n + 1}\n"
                        "</tool_response><|im_end|>\n" for n in (1, 3))
              + "<|im_start|>assistant\n<think>\nR5\n</think>\n\nA5<|im_end|>\n<|im_start|>user\nU6<|im_end|>\n"
                "<|im_start|>assistant\n<think>\nR7\n</think>\n\nA7<|im_end|>\n"),
    "glm4": ("[gMASK]<sop><|user|>\nU0"
             + "".join(f"<|assistant|>\n<think>R{n}</think>\n<tool_call>fn{n}\n<arg_key>q</arg_key>\n<arg_value>V{n}"
                       f"</arg_value>\n</tool_call><|observation|>\n<tool_response>\nT{n + 1}\n</tool_response>" for n in (1, 3))
             + "<|assistant|>\n<think>R5</think>\nA5<|user|>\nU6<|assistant|>\n<think>R7</think>\nA7<|user|>"),
    "phi3_5": "".join(f"<|user|>\nU{n}<|end|>\n<|assistant|>\nA{n + 1}<|end|>\n<|endoftext|>" for n in (0, 2, 4)),
}


@pytest.mark.parametrize("family", list(KEEP_TEXTS))
def test_reasoning_history_keep_rebuilds_a_history_rewritten_in_several_turns_at_once(family, family_tokenizer_dir):
    """Multi-step tool use, then a new query: Qwen3 and GLM-4 rewrite three earlier turns in one prompt, Phi-3.5 drops
    the EOS of every earlier turn. keep's sample is exactly each turn as rendered last, joined by what the template
    puts between turns (no cut-off fragment, no repeated history), every turn trained once."""
    encoder = _encoder(family_tokenizer_dir(family), reasoning_history="keep")
    tok = encoder.tokenizer
    row = MULTI_STEP if family != "phi3_5" else {"messages": [
        {"role": role, "content": f"{role[0].upper()}{n}"} for n, role in enumerate(["user", "assistant"] * 3)]}
    ((ids, trained),) = encoder.encode_chat_row(row, "row 0")
    expected = KEEP_TEXTS[family]
    assert tok.decode(ids) == expected and ids.tolist() == tok.encode(expected)
    assistant = [m for m in row["messages"] if m["role"] == "assistant"]
    runs = np.flatnonzero(np.diff(np.concatenate([[0], trained.astype(np.int8), [0]])) == 1)
    assert len(runs) == len(assistant)
    trained_text = tok.decode(ids[trained.astype(bool)])
    for m in assistant:
        assert trained_text.count(m["reasoning_content"] if family != "phi3_5" else m["content"]) == 1


def _wordpiece_tokenizer(out_dir):
    """A WordPiece tokenizer (BERT's normaliser and pre-tokenizer: whitespace is dropped, not a token) with Qwen's
    markers and Qwen2.5's chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ("[PAD] [UNK] you are qwen , created by alibaba cloud . a helpful assistant system user q lead ##ing "
             "spaces tab ##s").split()
    backend = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]")
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")],
                   special_tokens=True)
    tok.eos_token = "<|im_end|>"
    tok.chat_template = (chat_corpus.TEMPLATES / "qwen2_5.jinja").read_text(encoding="utf-8")
    tok.save_pretrained(str(out_dir))
    return out_dir


def test_tokenizer_that_drops_whitespace_trains_the_answer_it_can_tell(tmp_path):
    """WordPiece drops the spaces of "  leading spaces": no token starts at the answer's first character, yet the
    prompt's tokens are exactly the sample's first ones. The turn is trained (compared as token sequences), exactly
    tok(F)[len(tok(P)) : len(tok(F.rstrip()))]; no false "turn boundary inside a token" refusal."""
    encoder = _encoder(_wordpiece_tokenizer(tmp_path / "wordpiece"))
    hf = encoder.tokenizer.hf
    for answer in ("  leading spaces", "\tleading tabs", "leading spaces  "):
        messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer}]
        ((ids, trained),) = encoder.encode_chat_row({"messages": messages}, "row 1")
        prompt = hf.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
        full = hf.apply_chat_template(messages, tokenize=False)
        expected = np.zeros(len(ids), np.uint8)
        expected[len(hf.encode(prompt, add_special_tokens=False)):len(hf.encode(full.rstrip(), add_special_tokens=False))] = 1
        assert ids.tolist() == hf.encode(full, add_special_tokens=False) and trained.tolist() == expected.tolist()
        assert hf.decode(ids[trained.astype(bool)]) == f"{answer.split()[0]} {answer.split()[1]} <|im_end|>"


def test_over_long_conversation_is_truncated_per_sample_not_refused(family_tokenizer_dir):
    """--prompt-type hf follows the project's rule for an over-long sample: cut at --seq-length and counted; the
    turns before the cut keep their training, and a sample left with nothing trained is dropped and counted. Each
    sample of a row on its own (Qwen3 splits one here): nothing stops the run, no turn that fits is lost."""
    long_answer = "A2_0 " + " ".join(["red blue cat"] * 40)
    row = {"messages": [{"role": "user", "content": "U0 q"}, {"role": "assistant", "content": "A0 short"},
                        {"role": "user", "content": "U1 q"}, {"role": "assistant", "content": "A1 short",
                                                             "reasoning_content": "R1 thought"},
                        {"role": "user", "content": "U2 q"}, {"role": "assistant", "content": long_answer}]}
    for family, seq_length in (("qwen2_5", 70), ("qwen3", 70), ("qwen3", 20)):
        full = _encoder(family_tokenizer_dir(family)).encode_chat_row(row, "row 0")
        chunk = _encoder(family_tokenizer_dir(family), seq_length=seq_length).encode_rows([("row 0", row)])
        kept = [(ids[:seq_length], trained[:seq_length]) for ids, trained in full]
        for _, trained in kept:
            trained[0] = 0
        cut = [len(ids) > seq_length for ids, _ in full]
        written = [trained.any() for _, trained in kept]
        kept = [(ids, trained) for ids, trained in kept if trained.any()]
        # each sample counted once: written (truncated or not), or dropped as emptied by the cut
        assert chunk.rows == 1 and chunk.truncated == sum(c and w for c, w in zip(cut, written)), family
        assert dict(chunk.skipped) == ({SKIP_CUT: len(full) - len(kept)} if len(full) > len(kept) else {}), family
        assert chunk.lengths.tolist() == [len(i) for i, _ in kept]
        assert chunk.input_ids.tolist() == [t for ids, _ in kept for t in ids.tolist()], family
        assert chunk.trained.tolist() == [t for _, trained in kept for t in trained.tolist()], family
    assert len(full) == 3 and len(kept) == 1  # Qwen3 at 20 tokens: only the first sample keeps a trained token


def test_llama_tool_call_turn_without_its_text_is_written_warned_and_counted(tmp_path, family_tokenizer_dir,
                                                                              run_preprocess):
    """Llama 3.1's template writes only the call of a turn that also has text (as apply_chat_template does): the
    sample is that render, and the run warns and counts the turn (statistics.notes) instead of saying nothing."""
    from mindspeed_pack.data import toy
    from mindspeed_pack.data.chat_template import NOTE_TEXT_DROPPED

    texted = json.loads(json.dumps(CORPUS[7]))
    texted["messages"][1]["content"] = "A7_0 let me look that up"
    data = toy.write_dataset(tmp_path / "rows.jsonl", [CORPUS[0], texted])
    code, _, err = run_preprocess(input=data, output_prefix=str(tmp_path / "p"), prompt_type="hf",
                                  tokenizer_name_or_path=family_tokenizer_dir("llama3_1"), handler_name=SHAREGPT,
                                  map_keys=json.dumps(chat_corpus.MAP_KEYS), seq_length=2048)
    assert code == 0, err
    stats = json.loads((tmp_path / "p_packed_meta.json").read_text())["statistics"]
    assert stats["notes"] == {NOTE_TEXT_DROPPED: 1} and stats["samples_written"] == 2
    assert stats["first_notes"][NOTE_TEXT_DROPPED] == f"{data}: line 2: message 1"
    assert f"warning: 1 {NOTE_TEXT_DROPPED} (written as the template renders them" in err
    encoder = _encoder(family_tokenizer_dir("llama3_1"))
    ((ids, _),) = encoder.encode_chat_row(texted, "row 2")
    assert ids.tolist() == _apply(encoder.tokenizer.hf, texted["messages"], texted["tools"],
                                  encoder.chat.kwargs)["input_ids"]
    assert "let me look" not in encoder.tokenizer.decode(ids)


def test_a_single_tool_schema_object_is_a_list_of_one(family_tokenizer_dir):
    """A tools column holding one schema object (not a list) is read as that one schema, as before."""
    encoder = _encoder(family_tokenizer_dir("qwen2_5"))
    row = CORPUS[7]
    single = {**row, "tools": row["tools"][0]}
    ((one, _),) = encoder.encode_chat_row({**row, "tools": row["tools"][:1]}, "row 7")
    ((got, _),) = encoder.encode_chat_row(single, "row 7")
    assert np.array_equal(one, got)


def _as_text_parts(row: dict) -> dict:
    """The row with every string content as OpenAI's list of text parts, split in two parts where it can be."""
    row = json.loads(json.dumps(row))
    for m in row["messages"]:
        text = m.get("content")
        if isinstance(text, str):
            m["content"] = [{"type": "text", "text": text[:3]}, {"type": "text", "text": text[3:]}]
    return row


def test_list_of_text_parts_is_the_content_they_join(family_tokenizer_dir):
    """OpenAI's content as a list of text parts reads as their texts concatenated, on --prompt-type hf and on a JSON
    template alike; a part that is not text (an image) is refused naming the message and the part."""
    from mindspeed_pack.data.chat_messages import REASON_PART
    from mindspeed_pack.data.handlers import SampleEncoder
    from mindspeed_pack.data.templates import get_template

    hf_encoder = _encoder(family_tokenizer_dir("qwen2_5"))
    keys, _ = resolve_map_keys(SHAREGPT, chat_corpus.MAP_KEYS)
    json_encoder = SampleEncoder(SHAREGPT, hf_encoder.tokenizer, get_template("qwen2_5"), keys, None, False)
    for i in (0, 4, 7, 8):
        row, parts = CORPUS[i], _as_text_parts(CORPUS[i])
        want, got = hf_encoder.encode_chat_row(row, f"row {i}"), hf_encoder.encode_chat_row(parts, f"row {i}")
        assert len(want) == len(got) and all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
                                             for a, b in zip(want, got)), f"row {i}"
        (want, _), _, _ = json_encoder.encode_row(row, f"row {i}")
        (got, _), _, _ = json_encoder.encode_row(parts, f"row {i}")
        assert np.array_equal(want, got), f"row {i}"
    image = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                                      {"type": "image_url", "image_url": {"url": "x.png"}}]},
                          {"role": "assistant", "content": "a cat"}]}
    with pytest.raises(RowError, match=r"row 4: field 'messages' message 0 field 'content' part 1 is not a text part "
                                       r".*image_url") as err:
        hf_encoder.encode_chat_row(image, "row 4")
    assert err.value.reason == REASON_PART
    with pytest.raises(RowError, match=r"row 4: message 0 field 'content' part 1 is not a text part .*image_url"):
        json_encoder.encode_row(image, "row 4")


ORDER_ROWS = {  # unusable by the order of their turns, under any template
    "roles out of order": [
        [{"role": "assistant", "content": "A0 I start"}, {"role": "user", "content": "U1 q"},
         {"role": "assistant", "content": "A1 a"}],  # an assistant turn first (the template raised UndefinedError)
        [{"role": "user", "content": "U0 q"}, {"role": "user", "content": "U1 q"}, {"role": "assistant", "content": "A1"}],
        [{"role": "user", "content": "U0 q"}, {"role": "assistant", "content": "A0"},
         {"role": "assistant", "content": "A1"}],
        [{"role": "user", "content": "U0 q"}, {"role": "tool", "content": "T0"}, {"role": "assistant", "content": "A0"}],
    ],
    "system message after the first message": [
        [{"role": "user", "content": "U0 q"}, {"role": "assistant", "content": "A0"},
         {"role": "system", "content": "S1 now be brief"}, {"role": "user", "content": "U1 q"},
         {"role": "assistant", "content": "A1"}],
    ],
    "conversation does not end with an answer": [
        [{"role": "user", "content": "U0 q"}, {"role": "assistant", "content": "A0"}, {"role": "user", "content": "U1"}],
    ],
}


@pytest.mark.parametrize("family", ["qwen2_5", "qwen3"])
def test_turns_out_of_order_are_skipped_as_on_the_json_templates(family, family_tokenizer_dir):
    """README: rows with roles out of order, a system message after the first or no final answer are always skipped
    and counted. --prompt-type hf applies the JSON templates' order rules (and gives their reasons), even where the
    template would render such a row; consecutive tool results (parallel calls) stay one turn."""
    from mindspeed_pack.data.handlers import SampleEncoder
    from mindspeed_pack.data.templates import get_template

    hf_encoder = _encoder(family_tokenizer_dir(family))
    keys, _ = resolve_map_keys(SHAREGPT, chat_corpus.MAP_KEYS)
    json_encoder = SampleEncoder(SHAREGPT, hf_encoder.tokenizer, get_template("qwen2_5"), keys, None, False)
    for reason, rows in ORDER_ROWS.items():
        for messages in rows:
            chunk = hf_encoder.encode_rows([("row 0", {"messages": messages})])
            assert dict(chunk.skipped) == {reason: 1} and not len(chunk.lengths), (reason, messages)
            assert json_encoder.encode_row({"messages": messages}, "row 0")[1] == reason, (reason, messages)
    parallel = CORPUS[8]  # two tool results in a row
    assert [m["role"] for m in parallel["messages"]].count("tool") == 2
    assert hf_encoder.encode_chat_row(parallel, "row 8")
    # the first skipped row names the message out of order, not only the line
    tool_after_user, two_answers = ORDER_ROWS["roles out of order"][3], ORDER_ROWS["roles out of order"][2]
    chunk = hf_encoder.encode_rows([("f.jsonl: line 1", {"messages": [{"role": "system", "content": "S"}, *tool_after_user]}),
                                    ("f.jsonl: line 2", {"messages": two_answers})])
    assert dict(chunk.skipped) == {"roles out of order": 2} and list(chunk.skipped) == ["roles out of order"]
    assert type(list(chunk.skipped)[0]) is str
    assert chunk.first_skipped == {"roles out of order": "f.jsonl: line 1: message 2 is a tool result where an assistant "
                                   "answer should be (turns alternate user/tool results and assistant, from a user turn)"}


def test_parallel_tool_results_on_a_template_that_cannot_join_them_are_skipped_for_that(family_tokenizer_dir):
    """Two tool results in a row (the results of parallel calls) on a template without observation_separator
    (chatml, llama3, ...) were skipped as "roles out of order", which sent users looking for a fault in their data:
    the reason now says the template cannot join them, and which templates can."""
    from mindspeed_pack.data.handlers import SKIP_RESULTS_NOT_JOINED, SampleEncoder
    from mindspeed_pack.data.templates import get_template

    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
    row = {"messages": [{"role": "user", "content": "U0 Paris and Rome?"},
                        {"role": "assistant", "content": None, "tool_calls": [call, call]},
                        {"role": "tool", "content": "T0 sunny"}, {"role": "tool", "content": "T1 rainy"},
                        {"role": "assistant", "content": "A1 sunny, rainy"}]}
    tokenizer = _encoder(family_tokenizer_dir("qwen2_5")).tokenizer
    keys, _ = resolve_map_keys(SHAREGPT, chat_corpus.MAP_KEYS)
    for name in ("chatml", "llama3"):
        chunk = SampleEncoder(SHAREGPT, tokenizer, get_template(name), keys, None, False).encode_rows(
            [("f.jsonl: line 1", row)])
        assert dict(chunk.skipped) == {SKIP_RESULTS_NOT_JOINED: 1}, chunk.skipped
        assert f"template {name!r} does not join" in chunk.first_skipped[SKIP_RESULTS_NOT_JOINED]
    assert SampleEncoder(SHAREGPT, tokenizer, get_template("qwen"), keys, None, False).encode_row(row, "row 0")[1] is None


STRING_ARGUMENTS = {"messages": [
    {"role": "user", "content": "U0 weather?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city":"\\u5317\\u4eac"}'}}]},
    {"role": "tool", "content": "T0 ok"}, {"role": "assistant", "content": "A1 done"}]}


@pytest.mark.parametrize("family", ["qwen3", "qwen3_2507"])
def test_string_arguments_stay_verbatim_where_the_template_writes_strings(family, family_tokenizer_dir):
    """Qwen3's template writes a string argument verbatim (its `is string` branch), as apply_chat_template does: the
    sample is that render byte for byte (the string is not parsed and re-serialised)."""
    encoder = _encoder(family_tokenizer_dir(family))
    row = STRING_ARGUMENTS
    samples = encoder.encode_chat_row(row, "row 0")
    hf = encoder.tokenizer.hf
    last = samples[-1][0]
    assert last.tolist() == _apply(hf, row["messages"], None, encoder.chat.kwargs)["input_ids"]
    assert '"arguments": {"city":"\\u5317\\u4eac"}' in encoder.tokenizer.decode(last)


def test_json_qwen3_writes_string_arguments_verbatim_as_its_official_template(family_tokenizer_dir):
    """The JSON ``qwen3`` (Qwen3-Instruct-2507's template) wrote a string argument as the parsed object
    (``{"city": "北京"}``): it now writes it as given, the official render token for token."""
    from mindspeed_pack.data.handlers import SampleEncoder
    from mindspeed_pack.data.templates import get_template

    hf_encoder = _encoder(family_tokenizer_dir("qwen3_2507"))
    keys, _ = resolve_map_keys(SHAREGPT, chat_corpus.MAP_KEYS)
    official = hf_encoder.encode_chat_row(STRING_ARGUMENTS, "row 0")[-1][0]
    for name, written in (("qwen3", '{"city":"\\u5317\\u4eac"}'), ("qwen2_5", '{"city": "北京"}')):
        encoder = SampleEncoder(SHAREGPT, hf_encoder.tokenizer, get_template(name), keys, None, False)
        (ids, _), skip, _ = encoder.encode_row(STRING_ARGUMENTS, "row 0")
        assert skip is None and f'"arguments": {written}' in hf_encoder.tokenizer.decode(ids), name
    (ids, _), _, _ = SampleEncoder(SHAREGPT, hf_encoder.tokenizer, get_template("qwen3"), keys, None,
                                   False).encode_row(STRING_ARGUMENTS, "row 0")
    assert ids.tolist() == official[:-1].tolist()  # the JSON path ends on <|im_end|>, the official adds "\n"


def test_string_arguments_become_objects_where_the_template_writes_objects(family_tokenizer_dir):
    """Qwen2.5's template writes arguments with `| tojson` only: a string is given to it as the object it holds (the
    docs' rule), so the call is written as the template writes objects, never as an escaped JSON string."""
    encoder = _encoder(family_tokenizer_dir("qwen2_5"))
    ((ids, _),) = encoder.encode_chat_row(STRING_ARGUMENTS, "row 0")
    assert '"arguments": {"city": "北京"}' in encoder.tokenizer.decode(ids)


@pytest.mark.parametrize("family", ["qwen2_5", "qwen3_2507", "gemma3", "qwen3"])
def test_reasoning_folded_into_the_content_is_warned_and_counted(family, tmp_path, family_tokenizer_dir,
                                                                 run_preprocess):
    """A template without a reasoning field (Qwen2.5, Qwen3-2507, Gemma 3, ...) gets an assistant turn's
    reasoning_content inside its content as <think>...</think>, trained: apply_chat_template would leave it out, so the
    run says so (statistics.notes, one warning line naming what to do otherwise). Qwen3 renders the field: no note."""
    from mindspeed_pack.data import toy
    from mindspeed_pack.data.chat_template import NOTE_REASONING_FOLDED

    data = toy.write_dataset(tmp_path / "rows.jsonl", [CORPUS[0], CORPUS[1], CORPUS[2]])  # 0, 1 and 2 traces
    code, _, err = run_preprocess(input=data, output_prefix=str(tmp_path / "p"), prompt_type="hf",
                                  tokenizer_name_or_path=family_tokenizer_dir(family), handler_name=SHAREGPT,
                                  map_keys=json.dumps(chat_corpus.MAP_KEYS), seq_length=2048)
    assert code == 0, err
    stats = json.loads((tmp_path / "p_packed_meta.json").read_text())["statistics"]
    if family == "qwen3":
        assert stats["notes"] == {} and "warning" not in err, err
        return
    assert stats["notes"] == {NOTE_REASONING_FOLDED: 3}, stats
    assert stats["first_notes"][NOTE_REASONING_FOLDED] == f"{data}: line 2: message 2"
    warning = [line for line in err.splitlines() if NOTE_REASONING_FOLDED in line]
    assert len(warning) == 1 and warning[0].startswith(f"warning: 3 {NOTE_REASONING_FOLDED} (the template reads no "
                                                       "reasoning field") and "drop reasoning_content" in warning[0]


def test_summary_counts_rows_and_samples_apart_each_sample_once(tmp_path, family_tokenizer_dir, run_preprocess):
    """Qwen3 splits a conversation into several samples: the summary reads rows and writes samples, and says which
    is which; a sample is counted once, as written (truncated or not) or dropped under one reason, a sample emptied
    by the --seq-length cut as that, not as "no trainable token"; rates are per row and per written sample."""
    from mindspeed_pack.data import toy

    long_question = "U1 " + " ".join(["red blue cat"] * 40)
    split = {"messages": [{"role": "user", "content": "U0 q"},
                          {"role": "assistant", "content": "A0 short", "reasoning_content": "R0 thought"},
                          {"role": "user", "content": long_question}, {"role": "assistant", "content": "A1 a"}]}
    rows = [CORPUS[0], split, {"messages": [{"role": "user", "content": "U0 q"}, {"role": "user", "content": "U1"},
                                            {"role": "assistant", "content": "A1"}]}]
    data = toy.write_dataset(tmp_path / "rows.jsonl", rows)
    code, out, err = run_preprocess(input=data, output_prefix=str(tmp_path / "p"), prompt_type="hf",
                                    tokenizer_name_or_path=family_tokenizer_dir("qwen3"), handler_name=SHAREGPT,
                                    map_keys=json.dumps(chat_corpus.MAP_KEYS), seq_length=40)
    assert code == 0, err
    stats = json.loads((tmp_path / "p_packed_meta.json").read_text())["statistics"]
    # row 1: one sample, cut (its answer trained up to the cut); row 2: two samples, the second cut to nothing trained;
    # row 3: skipped (two user turns)
    assert (stats["rows_read"], stats["samples_read"], stats["samples_written"]) == (3, 3, 2), stats
    assert stats["rows_skipped"] == {"roles out of order": 1} and stats["samples_dropped"] == {SKIP_CUT: 1}, stats
    assert stats["skipped"] == {"roles out of order": 1, SKIP_CUT: 1} and stats["truncated"] == 1, stats
    assert stats["first_skipped"][SKIP_CUT] == f"{data}: line 2"
    assert (f"rows read 3, skipped 1 (1 roles out of order); samples written 2, truncated 1 (cut at --seq-length), "
            f"dropped 1 (1 {SKIP_CUT})") in out
    assert re.search(r"\d+ rows/s, \d+ samples/s", out)


@pytest.mark.parametrize("family", ["qwen2_5", "qwen3"])
def test_a_call_without_arguments_renders_empty_arguments(family, family_tokenizer_dir):
    """A tool call without arguments (absent, null or a blank string) is the call with {} (docs/chat_templates.md:
    apply_chat_template raises on it), on --prompt-type hf and on the JSON template alike."""
    from mindspeed_pack.data.handlers import SampleEncoder
    from mindspeed_pack.data.templates import get_template

    encoder = _encoder(family_tokenizer_dir(family))
    keys, _ = resolve_map_keys(SHAREGPT, chat_corpus.MAP_KEYS)
    json_encoder = SampleEncoder(SHAREGPT, encoder.tokenizer, get_template("qwen2_5"), keys, None, False)
    texts = set()
    for arguments in ({}, None, "", "  ", "{}"):
        function = {"name": "now"} if arguments is None else {"name": "now", "arguments": arguments}
        row = {"messages": [{"role": "user", "content": "U0 time?"},
                            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": function}]},
                            {"role": "tool", "content": "T0 noon"}, {"role": "assistant", "content": "A1 noon"}]}
        ids = encoder.encode_chat_row(row, "row 0")[-1][0]
        texts.add(encoder.tokenizer.decode(ids).replace('"arguments": "{}"', '"arguments": {}'))
        assert '"arguments": {}' in encoder.tokenizer.decode(json_encoder.encode_row(row, "row 0")[0][0])
    assert len(texts) == 1 and '"name": "now", "arguments": {}' in texts.pop()


def test_json_qwen3_with_enable_thinking_writes_a_reasoning_field_between_its_thought_words(family_tokenizer_dir):
    """--prompt-type qwen3 --enable-thinking refused every row whose reasoning is a reasoning_content field (the
    OpenAI-style reasoning datasets' form), though it writes the same thought given inside the content. Now: true
    writes it inline, as Qwen3's own template renders the field for a final answer; false removes it with every
    thought; without the flag the refusal names --enable-thinking."""
    from mindspeed_pack.data.handlers import SampleEncoder
    from mindspeed_pack.data.templates import get_template, with_thinking

    tok = _encoder(family_tokenizer_dir("qwen3")).tokenizer
    keys, _ = resolve_map_keys(SHAREGPT, chat_corpus.MAP_KEYS)

    def encode(row, thinking):
        encoder = SampleEncoder(SHAREGPT, tok, with_thinking(get_template("qwen3"), thinking), keys, None, False)
        (ids, trained), skip, _ = encoder.encode_row(row, "row 1")
        assert skip is None
        return ids.tolist(), trained.tolist()

    user = {"role": "user", "content": "U1_0 q"}
    field = {"messages": [user, {"role": "assistant", "content": "A1_0 a", "reasoning_content": "\nR1_0 r\n"}]}
    inline = {"messages": [user, {"role": "assistant", "content": "<think>\nR1_0 r\n</think>\n\nA1_0 a"}]}
    plain = {"messages": [user, {"role": "assistant", "content": "A1_0 a"}]}
    assert encode(field, True) == encode(inline, True)
    official = tok.hf.apply_chat_template(field["messages"], tokenize=False)
    assert tok.decode(encode(field, True)[0]) + "\n" == official  # Qwen3's template: the same text, then "\n"
    assert encode(field, False) == encode(plain, False)
    with pytest.raises(RowError, match="pass --enable-thinking true to write it between the template's thought words"):
        encode(field, None)
    both = {"messages": [user, {**inline["messages"][1], "reasoning_content": "R1_0 r"}]}
    with pytest.raises(RowError, match="give the reasoning once"):
        encode(both, True)


def test_json_qwen3_with_enable_thinking_writes_calls_right_after_a_thought_alone(family_tokenizer_dir):
    """A tool call whose answer is only its reasoning (a reasoning_content field or an inline thought) was written
    "</think>\\n\\n\\n<tool_call>": the separator meant for answer text went after the thought too, and the model was
    trained on a newline Qwen3's own template (and LLaMA-Factory's) never writes there."""
    from mindspeed_pack.data.handlers import SampleEncoder
    from mindspeed_pack.data.templates import get_template, with_thinking

    tok = _encoder(family_tokenizer_dir("qwen3")).tokenizer
    keys, _ = resolve_map_keys(SHAREGPT, chat_corpus.MAP_KEYS)
    encoder = SampleEncoder(SHAREGPT, tok, with_thinking(get_template("qwen3"), True), keys, None, False)
    call = {"type": "function", "function": {"name": "fn", "arguments": {"q": "V"}}}
    tools = [{"type": "function", "function": {"name": "fn", "description": "d",
                                               "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
    user = {"role": "user", "content": "U0"}
    for answer in ({"content": "", "reasoning_content": "R1"}, {"content": "<think>\nR1\n</think>\n\n"},
                   {"content": "Let me look.", "reasoning_content": "R1"}):
        messages = [user, {"role": "assistant", "tool_calls": [call], **answer}]
        (ids, _), skip, _ = encoder.encode_row({"messages": messages, "tools": tools}, "row 0")
        assert skip is None
        official = tok.hf.apply_chat_template(messages, tools=tools, tokenize=False)
        assert tok.decode(ids) + "\n" == official, answer


def test_json_qwen3_reasoning_on_a_function_call_message_is_not_told_to_pass_the_flag_it_has(family_tokenizer_dir):
    """A ShareGPT function_call message with a reasoning_content field under --enable-thinking true was refused with
    "pass --enable-thinking true", the flag the run had: only assistant answers' reasoning is written inline."""
    from mindspeed_pack.data.handlers import SampleEncoder
    from mindspeed_pack.data.templates import get_template, with_thinking

    tok = _encoder(family_tokenizer_dir("qwen3")).tokenizer
    keys, _ = resolve_map_keys(SHAREGPT, None)
    encoder = SampleEncoder(SHAREGPT, tok, with_thinking(get_template("qwen3"), True), keys, None, False)
    call = json.dumps({"name": "fn", "arguments": {"q": "V"}})
    row = {"conversations": [{"from": "human", "value": "U0"},
                             {"from": "function_call", "value": call, "reasoning_content": "R1"},
                             {"from": "observation", "value": "T2"}, {"from": "gpt", "value": "A3"}]}
    with pytest.raises(RowError, match="row 0: message 1 has 'reasoning_content'") as err:
        encoder.encode_row(row, "row 0")
    assert "pass --enable-thinking true" not in str(err.value)
    assert "give the call as an assistant message with tool_calls beside its reasoning_content" in str(err.value)


# Mixtral-8x7B-Instruct-v0.1's chat_template (its tokenizer_config.json on the Hugging Face hub; Mistral-7B-Instruct
# has the same): the reference that --prompt-type mixtral must equal token for token
MIXTRAL_CHAT_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""


@pytest.fixture(scope="module")
def mixtral_tokenizer_dir(tmp_path_factory, toy_tokenizer_dir):
    """The toy tokenizer with Mixtral's <s>, </s>, [INST], [/INST] and its official chat template."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(toy_tokenizer_dir))
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in ("<s>", "</s>", "[INST]", "[/INST]")],
                   special_tokens=True)
    tok.bos_token, tok.eos_token = "<s>", "</s>"
    tok.chat_template = MIXTRAL_CHAT_TEMPLATE
    out = tmp_path_factory.mktemp("mixtral_tokenizer")
    tok.save_pretrained(str(out))
    return out


MIXTRAL_ROWS = [
    [("user", "U0 what is red"), ("assistant", "A0 a colour")],
    [("system", "S1 be terse"), ("user", "U1 name a cat"), ("assistant", "A1 tom")],
    [("user", "U2_0 hi there"), ("assistant", "A2_0 hello"), ("user", "U2_1 and then"), ("assistant", "A2_1 bye"),
     ("user", "U2_2 last"), ("assistant", "A2_2 done now")],
    [("system", "S3 sys"), ("user", " U3_0 spaced "), ("assistant", "A3_0\nline "), ("user", "U3_1"),
     ("assistant", " A3_1")],
]


@pytest.mark.parametrize("turns", MIXTRAL_ROWS, ids=["single", "system", "multi", "system_multi_whitespace"])
def test_json_mixtral_is_the_official_mixtral_template_token_for_token(turns, mixtral_tokenizer_dir):
    """--prompt-type mixtral (MindSpeed-LLM's Mixtral scripts) gives the ids of Mixtral-8x7B-Instruct's own template;
    each answer and its </s> are trained, nothing else."""
    from transformers import AutoTokenizer

    from mindspeed_pack.data.handlers import SampleEncoder
    from mindspeed_pack.data.templates import get_template

    messages = [{"role": r, "content": c} for r, c in turns]
    row = chat_corpus.as_sharegpt({"messages": messages})
    official = _encoder(mixtral_tokenizer_dir, map_keys=None)
    (o_ids, o_trained), = official.encode_chat_row(row, "row 0")
    keys, _ = resolve_map_keys(SHAREGPT, None)
    encoder = SampleEncoder(SHAREGPT, official.tokenizer, get_template("mixtral"), keys, None, False)
    (ids, trained), _, _ = encoder.encode_row(row, "row 0")

    hf = AutoTokenizer.from_pretrained(str(mixtral_tokenizer_dir))
    expected = hf.apply_chat_template(messages, tokenize=False)
    assert list(ids) == hf(expected, add_special_tokens=False)["input_ids"]  # the official render, token for token
    assert np.array_equal(ids, o_ids) and np.array_equal(trained, o_trained)
    answers = [c for r, c in turns if r == "assistant"]
    trained_runs = "".join(hf.decode(ids[i:i + 1]) if trained[i] else "|" for i in range(len(ids)))
    assert [run for run in trained_runs.split("|") if run] == [f" {a}</s>" for a in answers]


def test_json_mixtral_renders_the_corpus_as_the_official_template(mixtral_tokenizer_dir):
    """The generated corpus (whitespace edges, literal special-token text, long rows) on both paths."""

    official = _encoder(mixtral_tokenizer_dir, map_keys=None)
    compared = 0
    # skipped: tools, roles the official template refuses
    for i, (ids, trained), (o_ids, o_trained) in _corpus_pairs(official, "mixtral", (RowError, PreprocessError)):
        assert np.array_equal(ids, o_ids) and np.array_equal(trained, o_trained), f"row {i}"
        compared += 1
    assert compared >= 40

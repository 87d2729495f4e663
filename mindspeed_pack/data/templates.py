"""Chat templates as data (``configs/finetune/templates.json``), rendered turn by turn.

A template is a set of *slot lists*. A slot is a string, where ``{{content}}`` stands for
the message text, or ``{"token": "eos_token" | "bos_token"}``, a tokenizer special token.
A conversation of turns (prompt, answer) renders as::

    prefix  system  user(q1)  assistant(a1)  separator  user(q2)  assistant(a2) ...
    '--------- prompt 1 ---'  '- answer 1 -'  '------ prompt 2 ---'  '-answer 2-'

Every answer is trained; everything else (prefix, system, user turns, separators,
observations) is a prompt and gets label -100. ``function`` messages (tool calls) are
answers; ``observation`` messages (tool results) are prompts.

``qwen`` renders exactly what Qwen2.5's ``apply_chat_template`` renders for the same
messages and system prompt, except that the newline after the *last* ``<|im_end|>`` is not
emitted: the newline after an answer belongs to the separator in front of the next user
turn (untrained), so a sample ends on its EOS ``<|im_end|>`` (trained). A 2-turn sample::

    <|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n<|im_start|>user\\nq1<|im_end|>\\n
    <|im_start|>assistant\\n[a1<|im_end|>]\\n<|im_start|>user\\nq2<|im_end|>\\n<|im_start|>assistant\\n[a2<|im_end|>]

(``[...]`` trained). Tools, where a template has ``format_tools``: a row's tool schemas go into
the system prompt (``{{content}}`` = the system text, ``{{tools}}`` = each schema as one JSON line
after a newline; a row without system text uses ``format_tools_without_system`` where given, as
Qwen3 opens its system prompt with the tools block). An assistant message that calls tools (a
ShareGPT ``function_call`` message, or OpenAI ``tool_calls``, read as :class:`ToolCalls`) is a
``function`` answer: its text, then each call written with ``format_tool_call`` (``{{name}}``,
``{{arguments}}`` as JSON, or a string verbatim under ``tool_arguments: as_given``), joined by ``tool_call_separator``; consecutive tool results are one
observation turn, joined by ``observation_separator``. That is what Qwen2.5's official template renders. A template without
``format_tools`` refuses rows with tools, one without ``format_tool_call`` writes the calls as
LLaMA-Factory's JSON and refuses text beside them, and no JSON template writes reasoning: such rows
are refused (:class:`RowError`), never silently dropped.
``qwen`` keeps MindSpeed-LLM's default system prompt "You are a helpful
assistant."; ``qwen2_5`` uses the one Qwen2.5's own template inserts.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Union

from mindspeed_pack.data.chat_messages import function_call_content
from mindspeed_pack.data.errors import PreprocessError, RowError


def _default_templates_path() -> Path:
    """configs/finetune/templates.json of the checkout; an installed package has no configs/: its build copies
    the file beside this module."""
    installed = Path(__file__).resolve().parent / "templates.json"
    checkout = Path(__file__).resolve().parents[2] / "configs" / "finetune" / "templates.json"
    return installed if installed.is_file() else checkout


DEFAULT_TEMPLATES_PATH = _default_templates_path()

Slot = Union[str, dict]
USER, ASSISTANT, OBSERVATION, FUNCTION = "user", "assistant", "observation", "function"
PROMPT_ROLES = (USER, OBSERVATION)
ANSWER_ROLES = (ASSISTANT, FUNCTION)
_SPECIAL_SLOTS = ("eos_token", "bos_token")
_TOOL_FIELDS = ("format_tools", "format_tools_without_system", "format_tool_call", "tool_call_separator",
                "observation_separator", "tool_arguments")
_TOOL_ARGUMENTS = ("object", "as_given")
REASON_TOOLS = "tools the template cannot render"
_FIELDS = ("format_prefix", "format_system", "format_user", "format_assistant", "format_observation",
           "format_function", "format_separator")


@dataclass(frozen=True)
class ToolCalls:
    """The content of an assistant message that calls tools: its text and its calls
    (``{"type": "function", "function": {"name", "arguments"}}``, as ``chat_messages.normalize_tool_calls`` gives)."""

    text: str
    calls: tuple

    def stripped(self) -> "ToolCalls":
        return ToolCalls(self.text.strip(), self.calls)


@dataclass(frozen=True)
class Template:
    name: str
    format_user: tuple
    format_assistant: tuple
    format_system: tuple = ("{{content}}",)
    format_prefix: tuple = ()
    format_observation: tuple = ()  # empty: same as format_user
    format_function: tuple = ()  # empty: same as format_assistant
    format_separator: tuple = ()
    default_system: str = ""
    stop_words: tuple = ()
    replace_eos: bool = False
    system_in_first_user: bool = False  # llama2: the system block sits inside the first [INST]
    format_tools: str = ""  # the system prompt when a row has tools ({{content}}, {{tools}}); "": tools refused
    format_tools_without_system: str = ""  # that of a row with tools and no system text ({{tools}}); "": format_tools
    format_tool_call: str = ""  # one call of a function message ({{name}}, {{arguments}}); "": the content as is
    tool_call_separator: str = "\n"  # between a function message's text and its calls, and between calls
    observation_separator: str = ""  # joins consecutive tool results into one turn; "": they are out of order
    tool_arguments: str = "object"  # "object": arguments written as JSON of the object; "as_given": a string verbatim
    trim_content: bool = False  # strip whitespace around every message's text (Llama 3's "| trim")
    thought_words: tuple = ()  # a reasoning template's (open, close) around an answer's thought: --enable-thinking
    enable_thinking: Optional[bool] = None  # --enable-thinking (with_thinking); None: answers as written
    definition: dict = field(default_factory=dict, compare=False)

    @property
    def eos_replacement(self) -> Optional[str]:
        """The token the template ends answers with instead of the tokenizer's EOS, if any."""
        return self.stop_words[0] if self.replace_eos and self.stop_words else None


def load_template_definitions(path=None) -> dict:
    path = Path(path) if path else DEFAULT_TEMPLATES_PATH
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError as exc:
        raise PreprocessError(f"template file {str(path)!r} not found") from exc
    except json.JSONDecodeError as exc:
        raise PreprocessError(f"{path}: line {exc.lineno} column {exc.colno}: invalid JSON ({exc.msg})") from exc
    return {k: v for k, v in data.items() if not k.startswith("_")}


def template_names(path=None) -> list[str]:
    return sorted(load_template_definitions(path))


def _resolve(name: str, defs: dict, seen=()) -> dict:
    """A definition with its ``base`` chain merged in (child keys win)."""
    if name in seen:
        raise PreprocessError(f"template {name!r}: circular 'base' chain {' -> '.join(seen + (name,))}")
    spec = defs[name]
    base = spec.get("base")
    merged = dict(_resolve(base, defs, seen + (name,))) if base else {}
    merged.update({k: v for k, v in spec.items() if k not in ("base", "_doc")})
    return merged


def _slots(name: str, key: str, value) -> tuple:
    value = [value] if isinstance(value, (str, dict)) else value
    if not isinstance(value, list):
        raise PreprocessError(f"template {name!r}: {key} must be a list of slots, got {type(value).__name__}")
    for slot in value:
        ok = isinstance(slot, str) or (isinstance(slot, dict) and slot.get("token") in _SPECIAL_SLOTS and len(slot) == 1)
        if not ok:
            raise PreprocessError(f"template {name!r}: bad slot {slot!r} in {key}; use a string or "
                                  '{"token": "eos_token"} / {"token": "bos_token"}')
    return tuple(value)


def get_template(name: str, path=None) -> Template:
    """The template ``name``; PreprocessError lists the known ones when it does not exist."""
    defs = load_template_definitions(path)
    if name not in defs:
        raise PreprocessError(f"unknown --prompt-type {name!r}; known templates: {', '.join(sorted(defs))}. For "
                              "another model family: --prompt-type hf renders with the tokenizer's own chat template "
                              "(or --chat-template FILE.jinja), or add an entry to a copy of templates.json and pass "
                              "it with --prompt-type-path")
    spec = _resolve(name, defs)
    unknown = set(spec) - set(_FIELDS) - {"default_system", "stop_words", "replace_eos", "system_in_first_user",
                                          "trim_content", "thought_words", *_TOOL_FIELDS}
    if unknown:
        raise PreprocessError(f"template {name!r}: unknown keys {sorted(unknown)}")
    for required in ("format_user", "format_assistant"):
        if required not in spec:
            raise PreprocessError(f"template {name!r} has no {required}")
    kwargs = {k: _slots(name, k, spec[k]) for k in _FIELDS if k in spec}
    if spec.get("tool_arguments", "object") not in _TOOL_ARGUMENTS:
        raise PreprocessError(f"template {name!r}: tool_arguments must be one of {list(_TOOL_ARGUMENTS)}, got "
                              f"{spec['tool_arguments']!r}")
    thought = spec.get("thought_words", [])
    if thought and not (isinstance(thought, list) and len(thought) == 2 and all(isinstance(w, str) and w.strip()
                                                                                 for w in thought)):
        raise PreprocessError(f"template {name!r}: thought_words must be two strings [open, close], got {thought!r}")
    return Template(
        name=name,
        default_system=spec.get("default_system", ""),
        stop_words=tuple(spec.get("stop_words", ())),
        replace_eos=bool(spec.get("replace_eos", False)),
        system_in_first_user=bool(spec.get("system_in_first_user", False)),
        trim_content=bool(spec.get("trim_content", False)),
        thought_words=tuple(thought),
        **{k: str(spec[k]) for k in _TOOL_FIELDS if k in spec},
        definition=spec,
        **kwargs,
    )


_ROLE_MARKER = re.compile(r"<\|[^<>|\s]+\|>")


def marker_tokens(template: Template) -> list[str]:
    """Strings the template needs as single tokens: its stop words and ``<|...|>`` role markers.

    Preprocessing adds those a tokenizer lacks as special tokens (LLaMA-Factory and
    MindSpeed-LLM do the same), so ``<|im_end|>`` is one id, never split into pieces.
    """
    found = list(template.stop_words)
    for key in _FIELDS:
        for slot in getattr(template, key):
            if isinstance(slot, str):
                found += _ROLE_MARKER.findall(slot)
    return list(dict.fromkeys(found))


def _fill(slots: tuple, content: str) -> list[Slot]:
    return [s.replace("{{content}}", content) if isinstance(s, str) else s for s in slots]


def tools_system(template: Template, system: str, tools: list) -> str:
    """The system prompt of a row with tool schemas (RowError when the template renders no tools)."""
    if not template.format_tools:
        raise RowError(f"the row has tool schemas, which template {template.name!r} does not render (refused, not "
                       "dropped); use --prompt-type hf or a template with format_tools", REASON_TOOLS)
    listing = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    form = template.format_tools_without_system if not system and template.format_tools_without_system else \
        template.format_tools
    return re.sub(r"\{\{(content|tools)\}\}", lambda m: system if m.group(1) == "content" else listing, form)


def _arguments_object(call: dict):
    args = call["function"]["arguments"]
    return json.loads(args) if isinstance(args, str) else args  # strings were checked to parse when read


def _written_arguments(template: Template, call: dict) -> str:
    """A call's ``{{arguments}}``: JSON of the object, or (``tool_arguments: as_given``, Qwen3's ``is string``
    branch) a string argument verbatim, as the official template writes it."""
    args = call["function"]["arguments"]
    if template.tool_arguments == "as_given" and isinstance(args, str):
        return args
    return json.dumps(_arguments_object(call), ensure_ascii=False)


def format_function(template: Template, content) -> str:
    """A function message's text: a ShareGPT ``function_call`` value (JSON text) or :class:`ToolCalls`, its calls in
    the template's format. Without ``format_tool_call``: the JSON text unchanged, and OpenAI calls as that JSON."""
    if isinstance(content, ToolCalls):
        text, calls = content.text, content.calls
    elif not template.format_tool_call:
        return content
    else:
        text, calls = "", function_call_content(content, "function_call message")
    if not template.format_tool_call:
        assert not text, "text beside tool calls is refused when the row is read"
        calls = [{"name": c["function"]["name"], "arguments": _arguments_object(c)} for c in calls]
        return json.dumps(calls[0] if len(calls) == 1 else calls, ensure_ascii=False)
    written = [template.format_tool_call.replace("{{name}}", call["function"]["name"])
               .replace("{{arguments}}", _written_arguments(template, call)) for call in calls]
    if text and template.thought_words and not _without_thought(template, text).strip():
        # a thought alone before the calls: they follow it directly, as Qwen3's template and LLaMA-Factory write them
        # (the separator parts answer text from the calls; it gave "</think>\n\n\n<tool_call>")
        return text + template.tool_call_separator.join(written)
    return template.tool_call_separator.join(([text] if text else []) + written)


def merge_observations(template: Template, messages: list) -> list:
    """Consecutive tool results as one observation turn joined by ``observation_separator`` (Qwen writes the
    results of parallel calls in one user turn); unchanged for a template without one."""
    if not template.observation_separator:
        return messages
    out = []
    for role, content in messages:
        if role == OBSERVATION and out and out[-1][0] == OBSERVATION:
            out[-1] = (OBSERVATION, out[-1][1] + template.observation_separator + content)
        else:
            out.append((role, content))
    return out


def with_thinking(template: Template, enable_thinking: Optional[bool]) -> Template:
    """``template`` under ``--enable-thinking`` (MindSpeed-LLM's reasoning templates; None: unchanged).

    An answer's thought is its text between the template's two thought words (Qwen3: ``<think>\\n`` and
    ``\\n</think>\\n\\n``). ``true``: thoughts are kept, and an answer without one gets an empty thought, trained
    (the model learns to open and close it). ``false``: thoughts are removed from every answer, and the empty
    thought closes every prompt instead, untrained (what the model is shown at inference with thinking off).
    """
    if enable_thinking is None:
        return template
    if not template.thought_words:
        raise PreprocessError(f"--enable-thinking: template {template.name!r} has no thought words (a reasoning "
                              "template's, like qwen3's); drop the flag, or use --prompt-type hf with the model's "
                              "own chat template (--enable-thinking then sets its enable_thinking variable)")
    return replace(template, enable_thinking=bool(enable_thinking))


def inline_thought(template: Template, reasoning: str, content):
    """An answer with a separate reasoning field (``reasoning_content``) as a reasoning template writes its thought:
    between the thought words, before the answer (Qwen3's own template renders the field so). ``content``: text or
    :class:`ToolCalls`."""
    open_word, close_word = template.thought_words
    thought = open_word + reasoning.strip("\n") + close_word
    if isinstance(content, ToolCalls):
        return ToolCalls(thought + content.text.lstrip("\n"), content.calls)
    return thought + content.lstrip("\n")


def has_thought(template: Template, content) -> bool:
    """Whether the answer holds a thought: a thought word without its newlines, as MindSpeed-LLM and LLaMA-Factory
    look for it (``<think>r</think>a`` has one, and gets no second, empty one)."""
    text = content.text if isinstance(content, ToolCalls) else content
    return any(word.strip() in text for word in template.thought_words)


def _without_thought(template: Template, content):
    """The answer with its thought removed (as MindSpeed-LLM's ``remove_thought``: the span between the thought
    words, then the newlines it leaves at the start); the words are matched without their newlines, so a thought
    spelled ``<think>r</think>`` goes too, as :func:`has_thought` finds it."""
    open_word, close_word = (re.escape(w.strip()) for w in template.thought_words)
    strip = (lambda text: re.sub(f"{open_word}(.*?){close_word}", "", text, flags=re.DOTALL).lstrip("\n"))
    if isinstance(content, ToolCalls):
        return ToolCalls(strip(content.text), content.calls)
    return strip(content)


def _thinking(template: Template, messages: list) -> tuple[list, list]:
    """(messages, where the empty thought goes per answer: "answer", "prompt" or None) under --enable-thinking."""
    if template.enable_thinking is None:
        return messages, [None] * len(messages)
    if not template.enable_thinking:
        messages = [(role, _without_thought(template, content) if role in ANSWER_ROLES else content)
                    for role, content in messages]
    where = "answer" if template.enable_thinking else "prompt"
    return messages, [where if role in ANSWER_ROLES and not has_thought(template, content) else None
                      for role, content in messages]


def render_turns(template: Template, messages: list[tuple[str, str]], system: Optional[str],
                 tools: Optional[list] = None) -> list[tuple[list, list]]:
    """Slot lists ``(prompt, answer)`` per turn, for messages alternating prompt/answer roles.

    ``messages``: ``[(role, content), ...]`` with roles user/observation at even positions
    and assistant/function at odd positions (callers check this). ``system``: None or ""
    means the template's default. ``tools``: the row's tool schemas, if any.
    """
    system = system or template.default_system
    if template.trim_content:
        system, messages = system.strip(), [(role, content.strip() if isinstance(content, str) else content.stripped())
                                            for role, content in messages]
    if tools:
        system = tools_system(template, system, tools)
    messages, empty_thought = _thinking(template, messages)
    thought = "".join(template.thought_words)
    turns = []
    for i in range(0, len(messages) - 1, 2):
        (q_role, query), (a_role, answer) = messages[i], messages[i + 1]
        prompt: list[Slot] = []
        if i == 0:
            prompt += list(template.format_prefix)
            if system and not template.system_in_first_user:
                prompt += _fill(template.format_system, system)
        else:
            prompt += list(template.format_separator)
        user_slots = template.format_observation if (q_role == OBSERVATION and template.format_observation) else template.format_user
        if i == 0 and system and template.system_in_first_user:
            system_text = "".join(s for s in _fill(template.format_system, system) if isinstance(s, str))
            query = system_text + query
        prompt += _fill(user_slots, query)
        answer_slots = template.format_function if (a_role == FUNCTION and template.format_function) else template.format_assistant
        if a_role == FUNCTION:
            answer = format_function(template, answer)
        answer_slots = _fill(answer_slots, answer)
        if empty_thought[i + 1] == "prompt":
            prompt.append(thought)
        elif empty_thought[i + 1] == "answer":
            answer_slots.insert(0, thought)
        turns.append((prompt, answer_slots))
    return turns


def special_token_text(template: Template, slot: dict, eos_token: Optional[str], bos_token: Optional[str]) -> Optional[str]:
    """The text of a special slot (None: the tokenizer has no such token, the slot is skipped)."""
    if slot["token"] == "eos_token":
        return template.eos_replacement or eos_token
    return bos_token


def render_text(template: Template, messages, system=None, *, eos_token: str = "<eos>", bos_token: Optional[str] = None) -> str:
    """The whole conversation as one string (trained or not), for inspection and tests."""
    out = []
    for prompt, answer in render_turns(template, messages, system):
        for slot in prompt + answer:
            out.append(slot if isinstance(slot, str) else (special_token_text(template, slot, eos_token, bos_token) or ""))
    return "".join(out)

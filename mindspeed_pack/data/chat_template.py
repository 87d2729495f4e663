"""``--prompt-type hf``: a model's own Jinja chat template, and the trained spans it implies.

The text of a sample is exactly what transformers' ``apply_chat_template(messages,
tokenize=False)`` renders (same renderer, the tokenizer's special tokens, the pinned
``--chat-template-kwargs``); its ids are that text through the project's exact tokenizer
path. Nothing about the spans is hand-written; they come from *prefix renders*::

    P_k = render(messages[:k], add_generation_prompt=True)    what inference shows before turn k
    F_k = render(messages[:k+1])                               the same conversation with turn k
    trained text of assistant turn k = F_k[len(P_k) : len(F_k.rstrip())]

so the end-of-turn token (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, ...) is trained
and the whitespace separator after it (Qwen's and Gemma's ``\\n``) is not: the model stops at
the end-of-turn token and never generates what follows. A template that writes no end-of-turn
token (GLM-4: a turn ends where the next message's ``<|user|>`` or ``<|observation|>`` begins,
its stop tokens) trains that next token instead, and after a sample's last turn the one a user
message would begin with, appended: GLM's own fine-tuning script does the same, so the model
learns where to stop. Where the template has
``{% generation %}`` markers, the trained text is the marked text instead (the mask equals
transformers' ``assistant_masks``).

A template may rewrite history (Qwen3 drops the reasoning of turns before the last user query,
Phi-3.5 ends only the last turn with EOS). A sample is therefore the render ``F_m`` of the
conversation up to its last trained turn ``m``, and holds the trained turns ``k`` whose ``P_k``
and trained text are prefixes of ``F_m``: the fewest such samples, found greedily, train every
assistant turn exactly once, each in exactly the context inference shows
(``reasoning_history="split"``). ``"keep"`` instead trains one sample in which every turn is
rendered as the template renders a final turn (earlier reasoning kept): one sample, but its
history differs from what the template shows at inference. It assumes the template's rewrite
of an earlier turn deletes text (as Qwen3, GLM-4 and Phi-3.5 do), from any number of turns at once,
and refuses a row whose history it cannot read so.

A turn whose ``P_k`` is not a prefix of ``F_k`` (the template renders the turn differently from
what follows its own generation prompt, e.g. DeepSeek-R1's ``<think>\\n`` prompt against a
render that drops the reasoning) cannot be trained without shifting its mask: such rows are
refused with a :class:`RowError` naming the turn, never trained on a guess. So are rows the
template cannot render (probed once: tool schemas, calls, results, reasoning) or whose render
drops a call or a reasoning trace (a tool-call turn whose *text* the template leaves out, as
Llama 3.1 does, is written as rendered and counted in ``SamplePlan.notes``); the handler also refuses a turn that starts or ends inside a
token of the sample (checked on the tokenizer's offsets, or as token sequences where a tokenizer
drops characters and its offsets cannot tell).
"""
from __future__ import annotations

import datetime
import functools
import hashlib
import json
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from mindspeed_pack.data import template_renderer
from mindspeed_pack.data.errors import PreprocessError, RowError
from mindspeed_pack.data.templates import REASON_TOOLS

# The date the official Llama-3.x templates fall back to; pinned so the header never depends on the day
DEFAULT_DATE_STRING = "26 Jul 2024"
# What a template's strftime_now() (transformers' "now", gpt-oss's "Current date") reads: the same day, pinned
DEFAULT_NOW = "2024-07-26"
REASONING_HISTORY = ("split", "keep")
_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")

# reasons counted under --skip-bad-rows
REASON_NOT_PREFIX = "template renders a turn differently after its generation prompt"
REASON_REASONING = "reasoning the template drops"
REASON_RENDER = "template raised an error"
REASON_DROPPED = "template drops a tool call or reasoning"
REASON_TOKEN_BOUNDARY = "turn boundary inside a token"
REASON_KEEP = "history --reasoning-history keep cannot rebuild"
# written, but warned and counted (statistics.notes), each with what was done and how to choose otherwise
NOTE_TEXT_DROPPED = "tool-call turns whose text the template drops"
NOTE_REASONING_FOLDED = "assistant turns whose reasoning_content is trained inside the content as <think>...</think>"
NOTE_CALL_IDS = "tool-call turns given call ids the rows lack"
NOTE_HINTS = {
    NOTE_CALL_IDS: "the template requires an id on every call and the call's id and name on its result (Mistral v3, "
                   "Hermes); each call without one got 9 letters and digits drawn from the call itself (the same on "
                   "every run) and each result the id and name of the call it answers, in order; give the rows "
                   "their own ids (OpenAI tool_calls[].id, tool_call_id) to train those",
    NOTE_TEXT_DROPPED: "written as the template renders them, as apply_chat_template does",
    NOTE_REASONING_FOLDED: "the template reads no reasoning field, so apply_chat_template would leave the reasoning "
                           "out; drop reasoning_content from the rows to train the answers without it, or give a "
                           "--chat-template that renders reasoning_content",
}


def load_chat_template(tokenizer_hf, path: Optional[str]) -> tuple[str, str]:
    """(template source, where it came from): ``--chat-template FILE`` or the tokenizer's own."""
    if path:
        try:
            return Path(path).read_text(encoding="utf-8"), str(path)
        except OSError as exc:
            raise PreprocessError(f"--chat-template {path!r}: cannot read it ({exc.strerror or exc})") from exc
    source = getattr(tokenizer_hf, "chat_template", None)
    if isinstance(source, dict):  # several named templates: the default one
        source = source.get("default")
    if not source:
        raise PreprocessError("--prompt-type hf: the tokenizer has no chat_template; pass --chat-template FILE.jinja")
    return source, "tokenizer"


def parse_template_kwargs(text: Optional[str]) -> dict:
    if not text:
        return {}
    if isinstance(text, dict):
        return dict(text)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PreprocessError(f"--chat-template-kwargs is not valid JSON ({exc.msg} at column {exc.colno}): {text}") from None
    if not isinstance(value, dict):
        raise PreprocessError(f"--chat-template-kwargs must be a JSON object, got {text}")
    return value


def pinned_kwargs(source: str, kwargs: dict) -> dict:
    """``kwargs`` plus the pins the template needs to be reproducible: Llama-3.x ``date_string``, and the moment
    ``strftime_now`` reads (an ISO date or date-time under the key ``strftime_now``; gpt-oss's "Current date")."""
    kwargs = dict(kwargs)
    if "date_string" in source and "date_string" not in kwargs:
        kwargs["date_string"] = DEFAULT_DATE_STRING
    if "strftime_now" in source and "strftime_now" not in kwargs:
        kwargs["strftime_now"] = DEFAULT_NOW
    if "strftime_now" in kwargs:
        _pinned_now(kwargs["strftime_now"])  # checked here, where the flag is read
    return kwargs


def _check_enable_thinking(source: str, kwargs: dict, origin: str) -> None:
    """``enable_thinking`` given to a template that never reads it (Qwen3-2507, Llama) would change nothing, silently;
    a JSON template without thought words refuses ``--enable-thinking`` the same way."""
    if "enable_thinking" in kwargs and "enable_thinking" not in source:
        template = "the tokenizer's chat template" if origin == "tokenizer" else f"chat template {origin}"
        raise PreprocessError(f"--enable-thinking (enable_thinking in --chat-template-kwargs): {template} reads no "
                              "enable_thinking variable, so it would change nothing; drop it, or pass a "
                              "--chat-template that reads it (Qwen3's hybrid template)")


def _pinned_now(value) -> datetime.datetime:
    try:
        return datetime.datetime.fromisoformat(value)
    except (TypeError, ValueError):
        raise PreprocessError(f"--chat-template-kwargs: strftime_now must be an ISO date (e.g. \"{DEFAULT_NOW}\") or "
                              f"date-time, the moment the template's strftime_now() reads; got {value!r}") from None


def _strftime_at(moment: datetime.datetime, format: str) -> str:
    return moment.strftime(format)


@dataclass
class SamplePlan:
    """One sample of a conversation: its text and, per trained turn, where it sits in the text."""

    text: str
    turns: list = field(default_factory=list)  # (message index, start char, trained end char) per trained turn
    trained: list = field(default_factory=list)  # trained char spans [start, end)
    notes: list = field(default_factory=list)  # (NOTE_*, message index) of trained turns written with a note


def _lcp(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ChatTemplate:
    """A Jinja chat template bound to a tokenizer's special tokens and pinned kwargs."""

    def __init__(self, source: str, special_tokens: dict, kwargs: dict, reasoning_history: str = "split",
                 origin: str = "tokenizer", atoms=()):
        """``atoms``: the tokenizer's added tokens, which its encoding never splits (``keep`` aligns texts on them)."""
        if reasoning_history not in REASONING_HISTORY:
            raise PreprocessError(f"--reasoning-history must be one of {', '.join(REASONING_HISTORY)}, got {reasoning_history!r}")
        self.source, self.origin, self.reasoning_history = source, origin, reasoning_history
        self.kwargs = pinned_kwargs(source, kwargs)
        _check_enable_thinking(source, self.kwargs, origin)
        # kwargs win, as in apply_chat_template; the pinned moment replaces the environment's strftime_now (a global,
        # which a render's variables shadow): transformers turns callables in kwargs into placeholders, so it is
        # given to the compiled template directly (render_prefixes)
        self._render_kwargs = {**special_tokens, **{k: v for k, v in self.kwargs.items() if k != "strftime_now"}}
        now = self.kwargs.get("strftime_now")
        self._pinned_globals = {} if now is None else {"strftime_now": functools.partial(_strftime_at, _pinned_now(now))}
        self.has_generation_markers = bool(_GENERATION_MARKER.search(source))
        atoms = sorted((a for a in atoms if a), key=len, reverse=True)
        self._atoms = re.compile("|".join(map(re.escape, atoms))) if atoms else None
        self._atom_length = max(map(len, atoms), default=0)
        self._plain_kwargs = None
        self._compiled = None  # (compiled template, variables every render shares), built on first use
        self.sha256 = hashlib.sha256(source.encode("utf-8")).hexdigest()
        try:
            self.render([[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]], None, False)
        except Exception as exc:
            raise PreprocessError(f"chat template ({origin}) does not render a plain user/assistant exchange: "
                                  f"{type(exc).__name__}: {exc}") from exc
        self.capabilities = self._probe()
        self.turn_stop = None if self.has_generation_markers else self._turn_stop()

    def identity(self) -> dict:
        """What the sidecar and the cache key record about the template."""
        return {"name": "hf", "origin": self.origin, "chat_template_sha256": self.sha256,
                "chat_template_kwargs": self.kwargs, "reasoning_history": self.reasoning_history,
                "generation_markers": self.has_generation_markers, "capabilities": self.capabilities,
                "turn_stop": self.turn_stop}

    # ------------------------------------------------------------------ rendering
    def render(self, conversations: list, tools, add_generation_prompt: bool) -> tuple[list[str], list]:
        """Texts (and generation spans when the template marks them) of several conversations."""
        from transformers.utils.chat_template_utils import render_jinja_template

        # a transformers that plain-copies kwargs (which holds transformers_steps) would turn the pinned
        # strftime_now into a string: its samples come from render_prefixes, this renders only the probes there
        pinned = self._pinned_globals if template_renderer.transformers_steps() is None else {}
        return render_jinja_template(conversations=conversations, tools=tools, chat_template=self.source,
                                     add_generation_prompt=add_generation_prompt,
                                     return_assistant_tokens_mask=self.has_generation_markers, **self._render_kwargs,
                                     **pinned)

    def render_prefixes(self, messages: list, tools, stops: list) -> tuple[list, list, list]:
        """Generation-prompt renders of ``messages[:k]`` and full renders (with their generation spans)
        of ``messages[:k+1]`` for every ``k`` in ``stops``, as ``render`` gives them.

        transformers' renderer turns every conversation into plain template data and aliases the
        reasoning fields before the compiled template runs; for the prefixes of one conversation
        that work is the same, so it is done once here and the compiled template called per prefix
        through :mod:`template_renderer` (the tests compare every sample with ``apply_chat_template``).
        """
        steps = template_renderer.transformers_steps()
        if steps is None:
            prompts = self.render([messages[:k] for k in stops], tools, True)[0]
            return (prompts, *self.render([messages[:k + 1] for k in stops], tools, False))
        plain, alias, with_indices = steps
        if self._compiled is None:
            template = template_renderer.compile_template(self.source)
            self._plain_kwargs = {**plain(self._render_kwargs), **self._pinned_globals}
            self._compiled = (template, template_renderer.shared_variables(template, self._plain_kwargs))
        template, shared = self._compiled
        chat, tools = alias(plain(messages)), plain(tools)
        variables = {**shared, "tools": tools}
        prompts, fulls, marks = [], [], []
        for k in stops:
            prompts.append(template_renderer.render(template, {**variables, "messages": chat[:k],
                                                               "add_generation_prompt": True}))
            if self.has_generation_markers:
                text, spans = with_indices(template, chat[:k + 1], tools, None, False, **self._plain_kwargs)
                marks.append(spans)
            else:
                text = template_renderer.render(template, {**variables, "messages": chat[:k + 1],
                                                           "add_generation_prompt": False})
            fulls.append(text)
        return prompts, fulls, marks

    def _renders(self, conversation, tools) -> Optional[str]:
        try:
            return self.render([conversation], tools, False)[0][0]
        except Exception:  # a template that cannot take this shape raises anything
            return None

    def _probe(self) -> dict:
        """What the template renders at all: tool schemas, tool calls, tool results, reasoning (a
        ``reasoning_content`` field, or a ``<think>`` block inside the content).

        Tool-call arguments: ``"object"`` when the template renders them only from an object (Qwen2.5 and Llama
        ``| tojson`` them: a string would be written as an escaped JSON string), ``"string"`` when only from a
        string, ``"either"`` when it writes a string verbatim and an object too (Qwen3's ``is string`` branch):
        the arguments then stay as the row gives them, so the sample is what ``apply_chat_template`` renders.

        The probe call carries an ``id`` and its result the ``tool_call_id`` and ``name`` that strict templates
        require (Mistral v3 raises on a call id that is not 9 alphanumeric characters, Hermes on a tool result
        without ``name``): without them such a template read as rendering no tool calls and refused every tool row."""
        schema = {"type": "function", "function": {"name": "probe_schema_fn", "description": "d",
                                                   "parameters": {"type": "object", "properties": {}}}}
        user = {"role": "user", "content": "q"}

        def call(arguments):
            return {"role": "assistant", "tool_calls": [{"id": "probecall", "type": "function",
                                                         "function": {"name": "probe_call_fn", "arguments": arguments}}]}
        result = {"role": "tool", "content": "probe_result_text", "tool_call_id": "probecall", "name": "probe_call_fn"}
        caps = {"tools": False, "tool_calls": None, "tool_results": False, "reasoning": None, "call_ids": False}
        text = self._renders([user, {"role": "assistant", "content": "a"}], [schema])
        caps["tools"] = bool(text and "probe_schema_fn" in text)
        # the string is spaced unlike any JSON serialisation, so only a verbatim write of it contains it
        verbatim = '{"probe_arg":"probe_value" }'
        forms = []
        for form, arguments, written in (("object", {"probe_arg": "probe_value"}, "probe_value"),
                                         ("string", verbatim, verbatim)):
            text = self._renders([user, call(arguments), result, {"role": "assistant", "content": "a"}], None)
            if text and "probe_call_fn" in text and written in text:
                forms.append(form)
                caps["tool_results"] = caps["tool_results"] or "probe_result_text" in text
        caps["tool_calls"] = "either" if len(forms) == 2 else forms[0] if forms else None
        if forms:  # renders the calls only with their ids (and the results' names): rows without them get some
            bare_call = call({"probe_arg": "probe_value"} if forms[0] == "object" else verbatim)
            del bare_call["tool_calls"][0]["id"]
            bare_result = {"role": "tool", "content": "probe_result_text"}
            text = self._renders([user, bare_call, bare_result, {"role": "assistant", "content": "a"}], None)
            caps["call_ids"] = not (text and "probe_call_fn" in text)
        text = self._renders([user, {"role": "assistant", "content": "a", "reasoning_content": "probe_reasoning"}], None)
        if text and "probe_reasoning" in text:
            caps["reasoning"] = "field"
        else:
            text = self._renders([user, {"role": "assistant", "content": fold_reasoning("probe_reasoning", "a")}], None)
            caps["reasoning"] = "think_tags" if text and "probe_reasoning" in text else None
        return caps

    def _turn_stop(self) -> Optional[str]:
        """The token that ends an assistant turn where the template writes none after it (GLM-4): the unsplittable
        token a following user message begins with (``<|user|>``); None where the template ends its turns itself."""
        exchange = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "probe_answer"}]
        text = self._renders(exchange, None)
        if not text or not text.rstrip().endswith("probe_answer") or self._atoms is None:
            return None
        followed = self._renders(exchange + [{"role": "user", "content": "q2"}], None)
        at = len(text.rstrip())
        if not followed or not followed.startswith(text.rstrip()):
            return None
        stop = self._atoms.match(followed, at)
        return stop.group(0) if stop else None

    def _train_turn_stops(self, sample: SamplePlan) -> None:
        """Templates without an end-of-turn token (:meth:`_turn_stop`): each turn trains the unsplittable token that
        begins the next message, the last one the stop token, appended after it."""
        turns = []
        for n, (k, start, end) in enumerate(sample.turns):
            stop = self._atoms.match(sample.text, end)
            if stop:
                end = stop.end()
            elif n == len(sample.turns) - 1 and not sample.text[end:].strip():
                sample.text = sample.text[:end] + self.turn_stop
                end = len(sample.text)
            turns.append((k, start, end))
        sample.turns = turns
        sample.trained = self._trained_spans(turns, None)

    # ------------------------------------------------------------------ messages -> samples
    def adapt(self, messages: list[dict], tools) -> tuple[list[dict], dict]:
        """Messages in the form this template reads (or RowError naming what it cannot render), and per
        assistant message the texts its render must contain (reasoning, called functions): :meth:`plan`
        refuses a turn whose render drops any of them."""
        caps = self.capabilities
        if tools and not caps["tools"]:
            raise RowError("the row has tool schemas, which this chat template does not render (refused, not dropped)",
                           REASON_TOOLS)
        out, expected = [], {}
        answered, results = [], 0  # (id, name) of the last calls, and how many results answered them so far
        for n, m in enumerate(messages):
            m = dict(m)
            if m["role"] == "assistant":
                expected[n] = [c["function"]["name"] for c in m.get("tool_calls") or []]
                if m.get("reasoning_content"):
                    expected[n].append(m["reasoning_content"].strip())
            if m.get("tool_calls"):
                if caps["tool_calls"] is None:
                    raise RowError(f"message {n} has tool_calls, which this chat template does not render", REASON_TOOLS)
                m["tool_calls"] = [_arguments_as(c, caps["tool_calls"]) for c in m["tool_calls"]]
                if caps.get("call_ids"):
                    for k, c in enumerate(m["tool_calls"]):
                        if not c.get("id"):
                            c["id"] = made_up_call_id(c, n, k)
                    answered, results = [(c["id"], c["function"]["name"]) for c in m["tool_calls"]], 0
            if m["role"] == "tool" and not caps["tool_results"]:
                raise RowError(f"message {n} is a tool result, which this chat template does not render", REASON_TOOLS)
            if m["role"] == "tool" and caps.get("call_ids") and answered:
                # the k-th result answers the k-th call (the last call, when there are more results than calls)
                call, name = answered[min(results, len(answered) - 1)]
                results += 1
                if not m.get("tool_call_id"):
                    m["tool_call_id"] = call
                if not m.get("name"):
                    m["name"] = name
            reasoning = m.pop("reasoning_content", None)
            if reasoning:
                if caps["reasoning"] == "field":
                    m["reasoning_content"] = reasoning
                elif caps["reasoning"] == "think_tags":
                    m["content"] = fold_reasoning(reasoning, m.get("content") or "")
                else:
                    raise RowError(f"message {n} has reasoning_content, which this chat template drops", REASON_REASONING)
            out.append({k: v for k, v in m.items() if v is not None})  # as apply_chat_template does
        return out, expected

    def samples(self, messages: list[dict], tools, trained: Optional[list] = None) -> list[SamplePlan]:
        """The samples of a conversation as rows give it: :meth:`adapt`, then :meth:`plan`; a trained turn whose
        reasoning goes inside its content (a template without a reasoning field) is noted on its sample."""
        adapted, expected = self.adapt(messages, tools)
        samples = self.plan(adapted, tools, expected, trained)
        if self.capabilities["call_ids"]:
            for sample in samples:
                sample.notes += [(NOTE_CALL_IDS, k) for k, _, _ in sample.turns
                                 if any(not c.get("id") for c in messages[k].get("tool_calls") or [])]
        if self.capabilities["reasoning"] == "think_tags":
            for sample in samples:
                sample.notes += [(NOTE_REASONING_FOLDED, k) for k, _, _ in sample.turns
                                 if messages[k].get("reasoning_content")]
        return samples

    def plan(self, messages: list[dict], tools, expected: Optional[dict] = None,
             trained: Optional[list] = None) -> list[SamplePlan]:
        """The samples of one conversation (already :meth:`adapt`-ed); [] when it has no assistant turn.

        ``trained``: the indices of the assistant messages to train (default: all of them); a
        preference pair trains only its final answer, the earlier turns being context."""
        turns = [k for k, m in enumerate(messages) if m["role"] == "assistant" and (trained is None or k in trained)]
        if not turns:
            return []
        try:
            prompts, fulls, marks = self.render_prefixes(messages, tools, turns)
        except Exception as exc:
            raise RowError(f"the chat template raised {type(exc).__name__}: {exc}", REASON_RENDER) from exc
        ends = []
        for t, k in enumerate(turns):
            p, f = prompts[t], fulls[t]
            if not f.startswith(p):
                at = _lcp(p, f)
                raise RowError(f"assistant turn (message {k}): the template's generation prompt is not a prefix of its "
                               f"render of the turn (they differ at character {at}: prompt {p[at:at + 30]!r}, "
                               f"render {f[at:at + 30]!r}); training it would shift the mask", REASON_NOT_PREFIX)
            ends.append(len(f.rstrip()) if len(f.rstrip()) > len(p) else len(p))
            missing = [x for x in (expected or {}).get(k, []) if x not in f[len(p):]]
            if missing:
                raise RowError(f"assistant turn (message {k}): the chat template drops {missing[0][:60]!r} from it "
                               "(refused, not trained without it)", REASON_DROPPED)
        dropped = {k for t, k in enumerate(turns) if _text_dropped(messages[k], fulls[t][len(prompts[t]):])}
        if self.reasoning_history == "keep":
            samples = [self._keep(turns, prompts, fulls, ends)]
            samples[0].notes = [(NOTE_TEXT_DROPPED, k) for k in sorted(dropped)]
            return self._with_turn_stops(samples)
        samples, i = [], 0
        while i < len(turns):
            j = i
            while j + 1 < len(turns) and all(fulls[j + 1].startswith(prompts[t]) and
                                             fulls[j + 1].startswith(fulls[t][:ends[t]]) for t in range(i, j + 1)):
                j += 1
            sample = SamplePlan(fulls[j])
            for t in range(i, j + 1):
                sample.turns.append((turns[t], len(prompts[t]), ends[t]))
            sample.trained = self._trained_spans(sample.turns, marks[j] if marks else None)
            sample.notes = [(NOTE_TEXT_DROPPED, turns[t]) for t in range(i, j + 1) if turns[t] in dropped]
            samples.append(sample)
            i = j + 1
        return self._with_turn_stops(samples)

    def _with_turn_stops(self, samples: list) -> list:
        if self.turn_stop:
            for sample in samples:
                self._train_turn_stops(sample)
        return samples

    def _trained_spans(self, turns, marked) -> list:
        if not self.has_generation_markers:
            return [(start, end) for _, start, end in turns if end > start]
        # the marked spans of the turns this sample trains (a span belongs to the turn it overlaps)
        return [(s, e) for s, e in (marked or []) if any(s < end and e > start for _, start, end in turns)]

    def _keep(self, turns, prompts, fulls, ends) -> SamplePlan:
        """One sample: each turn as rendered last, joined by what the template puts between turns.

        The sample is built of pieces: the first turn's render ``fulls[0]``, then per turn what precedes it
        and the turn as rendered last. ``prompts[t]`` shows the earlier pieces as history, where the template
        may have deleted text from any number of them at once (Qwen3 the ``<think>`` blocks of every turn
        before a new query, GLM-4 the traces inside them, Phi-3.5 each final EOS). Each piece is found there
        in order, with at most one block deleted and never its head; what follows the last one is what the
        template puts before turn ``t``. A prompt that cannot be read so is refused, never guessed."""
        pieces = [fulls[0]]
        sample = SamplePlan(fulls[0], [(turns[0], len(prompts[0]), ends[0])])
        for t in range(1, len(turns)):
            prompt, at = prompts[t], 0
            for piece in pieces:
                at = self._after_history_form(piece, prompt, at)
                if at is None:
                    raise RowError(f"assistant turn (message {turns[t]}): the template rewrites the history before it "
                                   "in more than deleting text, so --reasoning-history keep cannot tell what comes "
                                   "between the turns; use --reasoning-history split", REASON_KEEP)
            between, turn = prompt[at:], fulls[t][len(prompt):]
            base = len(sample.text) + len(between) - len(prompt)
            sample.text += between + turn
            sample.turns.append((turns[t], base + len(prompt), base + ends[t]))
            pieces.append(between + turn)
        sample.trained = [(start, end) for _, start, end in sample.turns if end > start]
        return sample

    def _after_history_form(self, piece: str, text: str, at: int) -> Optional[int]:
        """Where ``piece``, with at most one block deleted (not its head), ends in ``text`` from ``at``; None when it
        is not there. The kept head is the longest common prefix and the kept tail the longest rest of the piece
        that follows it, neither cut inside a token that never splits (``<|endoftext|>`` against ``<|user|>``
        share ``<|``, which is no common text)."""
        a = _lcp(piece, text[at:at + len(piece)])
        while True:  # back off to a boundary of the atoms in both texts
            in_piece, in_text = self._atom_start(piece, a), self._atom_start(text, at + a, at)
            if in_piece is None and in_text is None:
                break
            a = in_piece if in_text is None else in_text - at if in_piece is None else min(in_piece, in_text - at)
        if a == len(piece):
            return at + a
        if a == 0:
            return None
        resume = at + a
        b = a + 1
        while b < len(piece) and resume < len(text):
            b = piece.find(text[resume], b)
            if b < 0:
                break
            if self._atom_start(piece, b) is None and text.startswith(piece[b:], resume):
                return resume + len(piece) - b
            b += 1
        return resume  # the whole rest of the piece deleted (Phi-3.5's final EOS)

    def _atom_start(self, text: str, pos: int, floor: int = 0) -> Optional[int]:
        """The start of the atom (a token that never splits) that ``pos`` falls strictly inside, if any."""
        if self._atoms is None or pos <= floor:
            return None
        lo = max(floor, pos - self._atom_length + 1)
        for m in self._atoms.finditer(text, lo, pos + self._atom_length):
            if m.start() < pos < m.end():
                return m.start()
            if m.start() >= pos:
                break
        return None


def _text_dropped(message: dict, render: str) -> bool:
    """Whether a tool-call turn's text is missing from its render: Llama 3.1/3.2 write only the call, as
    ``apply_chat_template`` does. Written so (it is what inference shows), warned and counted."""
    text = (message.get("content") or "").strip()
    return bool(message.get("tool_calls") and text and text not in render)


def fold_reasoning(reasoning: str, content: str) -> str:
    """Reasoning inside the content, as templates without a reasoning field read it back (Qwen3, R1, GLM)."""
    return f"<think>\n{reasoning}\n</think>\n\n{content}"


def made_up_call_id(call: dict, message: int, index: int) -> str:
    """9 letters and digits (Mistral v3's form) drawn from the call and its place: the same on every run, and as
    varied as the calls (a model trained on one fixed id would learn to write it)."""
    text = json.dumps([message, index, call.get("function", call)], sort_keys=True, ensure_ascii=False)
    number = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")
    alphabet = string.ascii_letters + string.digits
    return "".join(alphabet[(number // len(alphabet) ** i) % len(alphabet)] for i in range(9))


def _arguments_as(call: dict, form: str) -> dict:
    """A tool call with its arguments as an object or a JSON string, whichever the template renders (as the row
    gives them where it renders both)."""
    call = json.loads(json.dumps(call))
    fn = call.get("function", call)
    args = fn.get("arguments")
    if form == "string" and not isinstance(args, str):
        fn["arguments"] = json.dumps(args, ensure_ascii=False)
    elif form == "object" and isinstance(args, str):
        fn["arguments"] = json.loads(args)  # checked parseable when the row was read
    return call

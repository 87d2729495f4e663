"""Turn one input row into one tokenized sample: token ids + a trained mask.

Handlers (names as in MindSpeed-LLM's ``--handler-name``):

* ``AlpacaStyleInstructionHandler``: ``instruction`` and ``input``, the non-empty ones joined by ``"\\n"``
  (LLaMA-Factory's rule: an empty instruction leaves the input alone), are the prompt, ``output`` the answer;
  optional ``system`` and ``history`` (a list of ``[prompt, answer]`` pairs placed before the row's own turn).
* ``SharegptStyleInstructionHandler``: a list of messages ``{"from", "value"}`` with roles
  human/gpt/observation/function_call and an optional leading system message (or a
  ``system`` column). OpenAI-style ``{"role", "content"}`` with user/assistant works with
  ``--map-keys '{"role_tag": "role", "content_tag": "content", "user_tag": "user",
  "assistant_tag": "assistant"}'`` (or the short keys ``role/content/user/assistant/tool``); an assistant
  message's ``tool_calls`` are a function answer, consecutive ``tool`` results one observation turn where
  the template joins them (``templates.py``), and reasoning (``reasoning_content``) is refused: no JSON
  template writes it.
* ``GeneralPretrainHandler``: the ``text`` column, tokenized whole, BOS first when the
  tokenizer adds one (Llama's ``add_bos_token``, as Megatron-LM's and MindSpeed-LLM's
  preprocessing write it; ``--add-bos``/``--no-add-bos`` override), EOS appended with
  ``--append-eod``; every token is "trained". A text with no token is skipped and counted.

Both instruction handlers read an optional ``tools`` column. Under ``--prompt-type hf`` a row
becomes OpenAI-style messages (``chat_messages.py``: tool calls, tool results, reasoning) rendered
by the model's own chat template (``chat_template.py``), possibly as several samples; rows it
cannot render are refused with a ``RowError``, and rows whose turns are out of order are skipped by the same rules as
the JSON templates' (:func:`chat_order_skip`). The budget rules below are the JSON templates'; an
``hf`` sample longer than ``seq_length`` is cut at its end (each sample of a row on its own), the
turn that crosses the cut trained up to it, and counted as truncated like the JSON templates' samples.

Instruction samples are truncated to ``seq_length`` turn by turn: each turn gets the budget
the previous turns left; when a turn does not fit, its answer keeps all of its tokens if
they take less than half the budget, else its prompt does, else the two split the budget in
proportion to their lengths; later turns are dropped. The first token of a sample is never
trained (so no label can cross a pack boundary), and a sample left with no trained token is
skipped: "nothing trained before the --seq-length cut" when the cut emptied it, else "no trainable token"; a
sample counts as truncated only when it is written. Rows that are structurally fine but unusable (roles out of order, a system message
after the first, no answer) are skipped and counted by reason; rows of the wrong *shape*
(missing field, wrong type, unknown role) raise :class:`RowError` naming file, row and field
(the row policy of ``errors.py``: stop, or skip and count under ``--skip-bad-rows``).
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from mindspeed_pack.data import chat_template as hf_chat
from mindspeed_pack.data.chat_messages import (
    REASONING_FIELDS,
    content_text,
    normalize_tool_calls,
    parse_tools,
    sharegpt_messages,
)
from mindspeed_pack.data.errors import BAD_JSON, BAD_MISSING_FIELD, BAD_ROLE, BAD_TYPE, PreprocessError, RowError
from mindspeed_pack.data.readers import not_an_object
from mindspeed_pack.data.templates import (
    ANSWER_ROLES,
    ASSISTANT,
    FUNCTION,
    OBSERVATION,
    PROMPT_ROLES,
    REASON_TOOLS,
    USER,
    Template,
    ToolCalls,
    has_thought,
    inline_thought,
    merge_observations,
    render_turns,
    special_token_text,
)
from mindspeed_pack.data.tokenizer import TextTokenizer

ALPACA = "AlpacaStyleInstructionHandler"
SHAREGPT = "SharegptStyleInstructionHandler"
PRETRAIN = "GeneralPretrainHandler"
# preference pairs (mindspeed_pack/data/pairwise.py): the same rows with ``chosen``/``rejected`` answers
ALPACA_PAIRWISE = "AlpacaStylePairwiseHandler"
SHAREGPT_PAIRWISE = "SharegptStylePairwiseHandler"
PAIRWISE_BASE = {ALPACA_PAIRWISE: ALPACA, SHAREGPT_PAIRWISE: SHAREGPT}
# process reward rows (mindspeed_pack/data/process_reward.py): a solution's text with a step tag after each step
PROCESS_REWARD = "AlpacaStyleProcessRewardHandler"
# KTO (mindspeed_pack/data/kto.py): the same rows with a desirable/undesirable ``label``
ALPACA_KTO = "AlpacaStyleKTOHandler"
SHAREGPT_KTO = "SharegptStyleKTOHandler"
KTO_BASE = {ALPACA_KTO: ALPACA, SHAREGPT_KTO: SHAREGPT}
HANDLERS = (ALPACA, SHAREGPT, PRETRAIN, ALPACA_PAIRWISE, SHAREGPT_PAIRWISE, PROCESS_REWARD, ALPACA_KTO, SHAREGPT_KTO)

DEFAULT_MAP_KEYS = {
    ALPACA: {"prompt": "instruction", "query": "input", "response": "output", "system": "system", "history": "history",
             "tools": "tools"},
    SHAREGPT: {"messages": "conversations", "system": "system", "tools": "tools", "role_tag": "from", "content_tag": "value",
               "user_tag": "human", "assistant_tag": "gpt", "system_tag": "system", "observation_tag": "observation",
               "function_tag": "function_call"},
    PRETRAIN: {"text": "text"},
    PROCESS_REWARD: {"input": "input", "value": "value"},
}
REQUIRED_COLUMNS = {ALPACA: ("prompt", "response"), SHAREGPT: ("messages",), PRETRAIN: ("text",),
                    PROCESS_REWARD: ("input", "value")}
# which map-keys name columns (the others name fields inside a message or role values)
COLUMN_KEYS = {ALPACA: ("prompt", "query", "response", "system", "history", "tools"), SHAREGPT: ("messages", "system", "tools"),
               PRETRAIN: ("text",), PROCESS_REWARD: ("input", "value")}
for _pairwise, _base in PAIRWISE_BASE.items():  # the base handler's keys, its answer column replaced by the pair's
    DEFAULT_MAP_KEYS[_pairwise] = {**{k: v for k, v in DEFAULT_MAP_KEYS[_base].items() if k != "response"},
                                   "chosen": "chosen", "rejected": "rejected", "margin": "margin"}
    # ShareGPT pairs may end their conversation with the chosen answer instead (ms-swift's rows: messages and
    # rejected_response), so only the rejected answer's column is required beside the conversation
    REQUIRED_COLUMNS[_pairwise] = tuple(k for k in REQUIRED_COLUMNS[_base] if k != "response") + (
        ("chosen", "rejected") if _base == ALPACA else ("rejected",))
    COLUMN_KEYS[_pairwise] = tuple(k for k in COLUMN_KEYS[_base] if k != "response") + ("chosen", "rejected",
                                                                                        "margin")
for _kto, _base in KTO_BASE.items():  # the base handler's keys plus the row's label
    DEFAULT_MAP_KEYS[_kto] = {**DEFAULT_MAP_KEYS[_base], "label": "label"}
    REQUIRED_COLUMNS[_kto] = REQUIRED_COLUMNS[_base] + ("label",)
    COLUMN_KEYS[_kto] = COLUMN_KEYS[_base] + ("label",)
# TRL's and the hub's conversational rows (OpenAI messages): a pair's prompt as its own ``prompt`` list, or inside
# chosen/rejected given as whole conversations (the implicit prompt); a KTO row's ``prompt`` list and ``completion``
for _handler, _keys in ((SHAREGPT_PAIRWISE, ("prompt",)), (SHAREGPT_KTO, ("prompt", "completion"))):
    DEFAULT_MAP_KEYS[_handler].update({k: k for k in _keys})
    COLUMN_KEYS[_handler] += _keys
# a required conversation column a file may lack when it has these columns, which then carry the conversation
CONVERSATION_ELSEWHERE = {SHAREGPT_PAIRWISE: {"messages": ("chosen",)},
                          SHAREGPT_KTO: {"messages": ("prompt", "completion")}}
# MindSpeed-LLM's OpenAIInstructionHandler: ShareGPT rows under OpenAI's names (its defaults), read as such
OPENAI = "OpenAIInstructionHandler"
OPENAI_MAP_KEYS = {"messages": "messages", "role_tag": "role", "content_tag": "content", "user_tag": "user",
                   "assistant_tag": "assistant", "observation_tag": "tool", "system_tag": "system"}
HANDLER_NAMES = HANDLERS + (OPENAI,)  # what --handler-name takes


def canonical_handler(name: str, map_keys) -> tuple:
    """(handler, map_keys) with MindSpeed-LLM's ``OpenAIInstructionHandler`` read as
    ``SharegptStyleInstructionHandler`` under OpenAI's key names (``map_keys``' own entries win; its ``tags``
    ignored, as MindSpeed-LLM ignores them there); any other handler unchanged. ``map_keys``: a dict or JSON text."""
    if name != OPENAI:
        return name, map_keys
    try:
        given = json.loads(map_keys) if isinstance(map_keys, str) else dict(map_keys or {})
    except json.JSONDecodeError as exc:
        raise PreprocessError(f"--map-keys is not valid JSON ({exc.msg} at column {exc.colno}): {map_keys}") from None
    if not isinstance(given, dict):
        raise PreprocessError(f"--map-keys must be a JSON object, got {map_keys!r}")
    if given.pop("tags", None) is not None:
        logging.getLogger(__name__).warning("--handler-name %s takes OpenAI's role names; the 'tags' of --map-keys "
                                            "are ignored (as MindSpeed-LLM ignores them there)", OPENAI)
    return SHAREGPT, {**OPENAI_MAP_KEYS, **given}


_OPENAI_ALIASES = {"role": "role_tag", "content": "content_tag", "user": "user_tag", "assistant": "assistant_tag",
                   "tool": "observation_tag"}

SKIP_NO_TRAINABLE = "no trainable token"
SKIP_CUT = "nothing trained before the --seq-length cut"
# reasons counted per sample (a row may give several under --prompt-type hf); every other reason counts rows
SAMPLE_SKIPS = (SKIP_NO_TRAINABLE, SKIP_CUT)
SKIP_EMPTY = "empty text or conversation"
SKIP_ROLE_ORDER = "roles out of order"
SKIP_SYSTEM_NOT_FIRST = "system message after the first message"
SKIP_NO_ANSWER = "conversation does not end with an answer"
SKIP_RESULTS_NOT_JOINED = "consecutive tool results the template does not join"


class SkipReason(str):
    """A skip reason (counted as the plain string) with the row's detail, which the first skipped row's note shows."""

    def __new__(cls, reason: str, detail: str):
        self = super().__new__(cls, reason)
        self.detail = detail
        return self


_TURN_NAMES = {USER: "a user message", OBSERVATION: "a tool result", ASSISTANT: "an assistant answer",
               FUNCTION: "a tool call"}


def turn_order_skip(roles: list, messages: Optional[list] = None) -> Optional[str]:
    """Why a conversation is unusable by the order of its turns (roles user/observation/assistant/function, the
    system message left out, consecutive tool results already one turn), or None: prompt and answer turns must
    alternate from a prompt (else "roles out of order") and end with an answer (else "does not end with an answer").
    ``messages``: each turn's message index, so the reason names the message out of order."""
    for i, role in enumerate(roles):
        if role not in (PROMPT_ROLES if i % 2 == 0 else ANSWER_ROLES):
            at = f"message {messages[i]}" if messages else f"turn {i}"
            want = "a user message or tool result" if i % 2 == 0 else "an assistant answer"
            return SkipReason(SKIP_ROLE_ORDER, f"{at} is {_TURN_NAMES.get(role, repr(role))} where {want} should be "
                                               "(turns alternate user/tool results and assistant, from a user turn)")
    return SKIP_NO_ANSWER if len(roles) % 2 else None


_CHAT_TURN_ROLES = {"user": USER, "tool": OBSERVATION, "assistant": ASSISTANT}


def chat_order_skip(messages: list[dict]) -> Optional[str]:
    """:func:`turn_order_skip` for OpenAI-style messages (``--prompt-type hf``), the JSON templates' rules: a system
    message only first, and consecutive tool results one turn (the results of parallel calls, as templates join
    them)."""
    roles, at = [], []
    for n, message in enumerate(messages):
        if message["role"] == "system":
            if n:
                return SKIP_SYSTEM_NOT_FIRST
            continue
        role = _CHAT_TURN_ROLES[message["role"]]
        if not (role == OBSERVATION and roles and roles[-1] == OBSERVATION):
            roles.append(role)
            at.append(n)
    return turn_order_skip(roles, at)


def _empty_answer(message: dict) -> bool:
    """An assistant message with no text, no tool call and no reasoning."""
    content = message.get("content")
    return (message.get("role") == "assistant" and not message.get("tool_calls")
            and not any(message.get(f) for f in REASONING_FIELDS)
            and (content is None or (isinstance(content, str) and not content.strip())))


def resolve_map_keys(handler: str, map_keys: Optional[dict]) -> tuple[dict, set]:
    """Defaults overridden by ``--map-keys``; returns (mapping, keys the user named explicitly)."""
    if handler not in DEFAULT_MAP_KEYS:
        raise PreprocessError(f"unknown --handler-name {handler!r}; choose one of {', '.join(HANDLERS)}")
    mapping = dict(DEFAULT_MAP_KEYS[handler])
    explicit = set()
    base = PAIRWISE_BASE.get(handler, KTO_BASE.get(handler))
    map_keys = dict(map_keys or {})
    if SHAREGPT in (handler, base) and "tags" in map_keys:  # MindSpeed-LLM's form: role/content names under "tags"
        tags = map_keys.pop("tags")
        if not isinstance(tags, dict):
            raise PreprocessError(f"--map-keys: 'tags' must be an object of role/content names, got {tags!r}")
        for key in tags:
            if key not in mapping or not key.endswith("_tag"):
                raise PreprocessError(f"--map-keys: unknown key {key!r} in 'tags' for {handler}; known keys: "
                                      f"{', '.join(k for k in mapping if k.endswith('_tag'))}")
        twice = sorted(set(tags) & {_OPENAI_ALIASES.get(key, key) for key in map_keys})  # flat: role or role_tag
        if twice:
            raise PreprocessError(f"--map-keys: {', '.join(twice)} given both in 'tags' and beside it: give each once")
        map_keys = {**tags, **map_keys}
    for key, value in map_keys.items():
        key = _OPENAI_ALIASES.get(key, key) if SHAREGPT in (handler, base) else key
        if key not in mapping:
            raise PreprocessError(f"--map-keys: unknown key {key!r} for {handler}; known keys: {', '.join(mapping)}")
        if not isinstance(value, str):
            raise PreprocessError(f"--map-keys: value of {key!r} must be a string, got {value!r}")
        mapping[key] = value
        if value == "":  # MindSpeed-LLM's "no such column" (its pairwise scripts pass "query": "")
            if key in REQUIRED_COLUMNS.get(handler, ()):
                raise PreprocessError(f"--map-keys: {key!r} is empty, but {handler} reads that column")
            continue
        explicit.add(key)
    return mapping, explicit


@dataclass
class EncodedChunk:
    """Samples of one input chunk, flattened: ``input_ids``/``trained`` concatenated, one length per sample."""

    input_ids: np.ndarray  # int32
    trained: np.ndarray  # uint8, 1 where the label is the token itself
    lengths: np.ndarray  # int32
    pair_margins: Optional[np.ndarray] = None  # preference pairs: one reward margin per pair (float64)
    rows: int = 0
    truncated: int = 0
    skipped: Counter = field(default_factory=Counter)
    first_skipped: dict = field(default_factory=dict)  # reason -> where (and why) its first row was
    notes: Counter = field(default_factory=Counter)  # written, but with something the template left out: warned
    first_notes: dict = field(default_factory=dict)

    def skip(self, reason: str, example: str) -> None:
        detail = getattr(reason, "detail", None)
        reason = str(reason)
        self.skipped[reason] += 1
        self.first_skipped.setdefault(reason, f"{example}: {detail}" if detail else example)

    def note(self, what: str, example: str) -> None:
        self.notes[what] += 1
        self.first_notes.setdefault(what, example)


class SampleEncoder:
    """Row -> (ids, trained mask). Built once per worker process."""

    def __init__(self, handler: str, tokenizer: TextTokenizer, template: Optional[Template], map_keys: dict,
                 seq_length: Optional[int], append_eod: bool, skip_bad_rows: bool = False, add_bos: bool = False,
                 chat: Optional[hf_chat.ChatTemplate] = None):
        self.handler, self.tokenizer, self.template, self.chat = handler, tokenizer, template, chat
        self.keys, self.seq_length, self.append_eod = map_keys, seq_length, append_eod
        self.skip_bad_rows = skip_bad_rows
        self.bos_prefix = [tokenizer.bos_id] if add_bos else []  # pretraining documents only
        self.eos_id = tokenizer.eos_id
        if template is not None:
            eos_text = special_token_text(template, {"token": "eos_token"}, tokenizer.eos_token, tokenizer.bos_token)
            eos_id = tokenizer.token_to_id(eos_text) if eos_text is not None else None
            if eos_id is None:
                raise PreprocessError(f"template {template.name!r} ends answers with {eos_text!r}, "
                                      f"which is not a single token of tokenizer {tokenizer.name}")
            self.eos_id = eos_id
            self._special_ids = {"eos_token": [eos_id],
                                 "bos_token": [tokenizer.bos_id] if tokenizer.bos_id is not None else []}
            # OpenAI's role names are read too (as under --prompt-type hf: chat_messages.sharegpt_messages), so
            # OpenAI messages need only --map-keys role/content; the tags --map-keys names win
            self._role_of = {map_keys["user_tag"]: USER, map_keys["assistant_tag"]: ASSISTANT,
                             map_keys["observation_tag"]: OBSERVATION, map_keys["function_tag"]: FUNCTION} \
                if handler == SHAREGPT else {}
            for tag, role in (("user", USER), ("assistant", ASSISTANT), ("tool", OBSERVATION)) if self._role_of else ():
                self._role_of.setdefault(tag, role)

    # ---------------------------------------------------------------- field access
    def _field(self, row: dict, key: str, where: str, *, required: bool, kind=str):
        column = self.keys[key]
        if column not in row or row[column] is None:
            if required and column in row:  # present but null (a Parquet/Arrow null, a JSON null)
                raise RowError(f"{where}: field {column!r} (--map-keys {key}) is null", BAD_MISSING_FIELD)
            if required:
                raise RowError(f"{where}: missing field {column!r} (--map-keys {key}); "
                               f"the row has: {', '.join(map(str, row)) or 'no fields'}", BAD_MISSING_FIELD)
            return kind()
        value = row[column]
        if kind is list and isinstance(value, str) and value.lstrip().startswith("["):
            try:  # nested lists stored as JSON text (CSV)
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise RowError(f"{where}: field {column!r} is not valid JSON ({exc.msg})", BAD_JSON) from None
        if kind is list and isinstance(value, tuple):
            value = list(value)
        if kind is list and hasattr(value, "tolist"):
            value = value.tolist()
        if not isinstance(value, kind):
            raise RowError(f"{where}: field {column!r} (--map-keys {key}) must be "
                           f"{'a string' if kind is str else 'a list'}, got {type(value).__name__}", BAD_TYPE)
        return value

    # ---------------------------------------------------------------- row -> messages
    def _alpaca_messages(self, row, where):
        response = self._field(row, "response", where, required=True)
        messages, system = self._alpaca_prompt(row, where)
        return messages + [(ASSISTANT, response)], system

    def _alpaca_prompt(self, row, where):
        """The row's history and its own prompt, without the answer (pairs add two answers)."""
        prompt = self._field(row, "prompt", where, required=True)
        query = self._field(row, "query", where, required=False)
        system = self._field(row, "system", where, required=False)
        messages = []
        for n, pair in enumerate(self._field(row, "history", where, required=False, kind=list)):
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
                raise RowError(f"{where}: field {self.keys['history']!r} item {n} must be a "
                               f"[prompt, answer] pair of strings, got {pair!r}", BAD_TYPE)
            messages += [(USER, pair[0]), (ASSISTANT, pair[1])]
        # the non-empty parts, newline-joined as LLaMA-Factory and MindSpeed-LLM join them (an empty instruction
        # leaves the input alone, with no newline before it)
        messages.append((USER, "\n".join(part for part in (prompt, query) if part)))
        return messages, system

    def _sharegpt_messages(self, row, where):
        """(role, content) messages for a JSON template. An assistant message with OpenAI ``tool_calls`` is a function
        answer (:class:`ToolCalls`); what the template cannot write (reasoning, text beside calls where it has no
        call format) is refused, never dropped."""
        raw = self._field(row, "messages", where, required=True, kind=list)
        system = self._field(row, "system", where, required=False)
        role_tag, content_tag = self.keys["role_tag"], self.keys["content_tag"]
        messages = []
        for n, message in enumerate(raw):
            calls = message.get("tool_calls") if isinstance(message, dict) else None
            if (not isinstance(message, dict) or role_tag not in message
                    or (message.get(content_tag) is None and not calls)):
                got = list(message) if isinstance(message, dict) else type(message).__name__
                raise RowError(f"{where}: field {self.keys['messages']!r} message {n} must have "
                               f"{role_tag!r} and {content_tag!r} (--map-keys role_tag/content_tag), got {got}",
                               BAD_MISSING_FIELD)
            tag = message[role_tag]
            try:
                content = content_text(message.get(content_tag), f"message {n}", content_tag, BAD_TYPE,
                                       tool_result=self._role_of.get(tag) == OBSERVATION)
            except RowError as exc:
                raise exc.at(where) from None
            content, message = self._inline_reasoning(message, content, n, where, self._role_of.get(tag))
            self._refuse_unwritable(message, content, n, where, calls and self._role_of.get(tag) == ASSISTANT)
            if tag in (self.keys["system_tag"], "system") and tag not in self._role_of:
                if n > 0:  # a known role in the wrong place: the row is unusable (a skip reason), not malformed
                    return SKIP_SYSTEM_NOT_FIRST, system
                system = content
                continue
            if tag not in self._role_of:
                known = ", ".join(repr(t) for t in self._role_of)
                raise RowError(f"{where}: message {n} has unknown {role_tag!r} {tag!r}; known: {known} "
                               f"and {self.keys['system_tag']!r} as the first message "
                               "(set them with --map-keys user_tag/assistant_tag/...)", BAD_ROLE)
            if calls:
                try:
                    calls = normalize_tool_calls(calls, f"message {n}")
                except RowError as exc:
                    raise exc.at(where) from None
                messages.append((FUNCTION, ToolCalls(content or "", tuple(calls))))
            else:
                messages.append((self._role_of[tag], content))
        return messages, system

    def _inline_reasoning(self, message: dict, content, n: int, where: str, role) -> tuple:
        """(content, message) with an answer's reasoning field written inline, between the thought words, where the
        template has them and ``--enable-thinking`` is given (false then removes it with every thought); else as
        given (:meth:`_refuse_unwritable` refuses the field)."""
        field_name = next((f for f in REASONING_FIELDS if message.get(f)), None)
        template = self.template
        if field_name is None or role != ASSISTANT or not template.thought_words or template.enable_thinking is None:
            return content, message
        reasoning = message[field_name]
        if not isinstance(reasoning, str):
            raise RowError(f"{where}: message {n} field {field_name!r} must be a string, got "
                           f"{type(reasoning).__name__}", BAD_TYPE)
        if content and has_thought(template, content):
            raise RowError(f"{where}: message {n} has {field_name!r} and a thought inside its content too; give the "
                           "reasoning once", BAD_TYPE)
        return inline_thought(template, reasoning, content or ""), {
            k: v for k, v in message.items() if k not in REASONING_FIELDS}

    def _refuse_unwritable(self, message: dict, text: Optional[str], n: int, where: str, calls_allowed: bool) -> None:
        """RowError for what a message holds that this JSON template would drop."""
        name = self.template.name
        reasoning = next((f for f in REASONING_FIELDS if message.get(f)), None)
        if reasoning:
            how = ("pass --enable-thinking true to write it between the template's thought words (false removes "
                   "every thought)" if self.template.thought_words else
                   "use --prompt-type hf with a chat template that renders reasoning")
            if self.template.thought_words and self.template.enable_thinking is not None:  # the flag is given
                how = (f"--enable-thinking writes the reasoning of {self.keys['assistant_tag']!r}/'assistant' "
                       "messages only (a ShareGPT function_call message's is not: give the call as an assistant "
                       "message with tool_calls beside its reasoning_content)")
            raise RowError(f"{where}: message {n} has {reasoning!r}, which template {name!r} does not write as given "
                           f"(refused, not dropped); {how}", hf_chat.REASON_REASONING)
        if message.get("tool_calls") and not calls_allowed:
            raise RowError(f"{where}: message {n} has 'tool_calls' but is not an assistant message "
                           f"({self.keys['assistant_tag']!r} or 'assistant')", BAD_TYPE)
        if calls_allowed and text and not self.template.format_tool_call:
            raise RowError(f"{where}: message {n} has text beside its tool_calls, which template {name!r} does not "
                           "write (refused, not dropped); use --prompt-type hf", REASON_TOOLS)

    def _chat_messages(self, row, where, answer: bool = True):
        """(OpenAI-style messages, tools) of a row, for ``--prompt-type hf``; ``answer=False``: an Alpaca row
        without its answer column (a preference pair brings two answers of its own)."""
        try:
            if self.handler == ALPACA:
                pairs, system = (self._alpaca_messages if answer else self._alpaca_prompt)(row, where)
                messages = [{"role": "system", "content": system}] if system else []
                messages += [{"role": role, "content": content} for role, content in pairs]
            else:
                raw = self._field(row, "messages", where, required=True, kind=list)
                system = self._field(row, "system", where, required=False)
                messages = sharegpt_messages(raw, system, self.keys, self.keys["messages"])
            return messages, parse_tools(row.get(self.keys["tools"]), self.keys["tools"])
        except RowError as exc:
            raise exc.at(where) from None

    def plan_chat_row(self, row: dict, where: str, texts: list):
        """(samples, None) or (None, skip reason); each sample's text is appended to ``texts``."""
        if isinstance(row, RowError):  # a reader that could not parse the row hands its error on
            raise row
        if not isinstance(row, dict):
            raise PreprocessError(f"{where}: expected an object with named fields, got {type(row).__name__}")
        messages, tools = self._chat_messages(row, where)
        if all(m["role"] == "system" for m in messages):
            return None, SKIP_EMPTY
        skip = chat_order_skip(messages)  # the JSON templates' rules (plan_messages), whatever the template accepts
        if skip is not None:
            return None, skip
        if all(_empty_answer(m) for m in messages if m["role"] == "assistant"):
            return None, SKIP_EMPTY  # only empty answers: nothing to learn but stopping at once
        samples = self.chat_samples(messages, tools, where)
        if not samples:
            return None, SKIP_NO_ANSWER
        plan = []
        for sample in samples:
            plan.append((sample, len(texts)))
            texts.append(sample.text)
        return (where, plan), None

    def chat_samples(self, messages: list, tools, where: str, trained: Optional[list] = None) -> list:
        """The chat template's sample plans of a conversation (RowError naming ``where`` when it cannot be rendered)."""
        try:
            return self.chat.samples(messages, tools, trained)
        except RowError as exc:
            raise exc.at(where) from None

    def finish_chat(self, plan, encoded: list) -> list:
        """[(ids, trained, truncated) or (None, skip reason, False)] per sample of a row (RowError on bad turns)."""
        where, samples = plan
        out = []
        for sample, text_index in samples:
            text = encoded[text_index]
            ids = text.ids
            trained = np.zeros(len(ids), np.uint8)
            for s, e in sample.trained:
                hit, head, tail = text.overlapping(s, e)
                if not self.chat.has_generation_markers and (
                        head is None or text.token_start(head) != s or text.token_end(tail) != e):
                    hit = self._span_by_tokens(sample.text, ids, s, e)
                    if hit is None:
                        raise RowError(f"{where}: a trained span (characters {s}-{e}) starts or ends inside a token, "
                                       "so its prompt is not a token prefix of the sample", hf_chat.REASON_TOKEN_BOUNDARY)
                trained[hit] = 1
            for message, start, end in sample.turns:
                if end > start and not text.starts_token(start) and self._token_prefix(sample.text, ids, start) is None:
                    raise RowError(f"{where}: assistant turn (message {message}) starts inside a token (character "
                                   f"{start}): its generation prompt is not a token prefix of the sample",
                                   hf_chat.REASON_TOKEN_BOUNDARY)
            trained[0] = 0  # no label crosses into a sample from the one before it
            truncated = self.seq_length is not None and len(ids) > self.seq_length
            skip = SKIP_NO_TRAINABLE if not trained.any() else None
            if truncated:  # the project's rule, per sample: cut at --seq-length and count it
                ids, trained = ids[:self.seq_length], trained[:self.seq_length]
                skip = skip or (None if trained.any() else SKIP_CUT)
            out.append(((ids, trained), None, truncated) if skip is None else (None, skip, truncated))
        return out

    def _token_prefix(self, text: str, ids: np.ndarray, pos: int) -> Optional[int]:
        """How many tokens ``text[:pos]`` encodes to, when they are the first tokens of the sample (else None).

        The check that a turn starts or ends between tokens, where the offsets cannot tell: a tokenizer that
        drops whitespace (WordPiece) gives an answer ``"  leading spaces"`` no token starting at its first
        character, yet the prompt's tokens are exactly the sample's first ones."""
        prefix = self.tokenizer.encode(text[:pos])
        return len(prefix) if np.array_equal(ids[:len(prefix)], prefix) else None

    def _span_by_tokens(self, text: str, ids: np.ndarray, s: int, e: int) -> Optional[slice]:
        """The tokens of the span ``[s, e)`` compared as token sequences (:meth:`_token_prefix`), or None."""
        lo, hi = self._token_prefix(text, ids, s), self._token_prefix(text, ids, e)
        return None if lo is None or hi is None or hi < lo else slice(lo, hi)

    def _bad_row(self, exc: RowError, chunk: "EncodedChunk") -> None:
        """A malformed row met while encoding a chunk: the row policy of ``errors.py`` (stop, or
        under ``--skip-bad-rows`` skip it and count it under its reason)."""
        if not self.skip_bad_rows:
            raise exc
        chunk.skip(exc.reason, str(exc))

    def _encode_chat(self, rows, chunk: "EncodedChunk") -> list:
        texts, plans = [], []
        for where, row in rows:
            chunk.rows += 1
            try:
                plans.append((*self.plan_chat_row(row, where, texts), where))
            except RowError as exc:
                self._bad_row(exc, chunk)
        encoded = self.tokenizer.encode_batch_offsets(texts)
        samples = []
        for plan, skip, where in plans:
            if plan is None:
                chunk.skip(skip, where)
                continue
            try:
                finished = self.finish_chat(plan, encoded)
            except RowError as exc:
                self._bad_row(exc, chunk)
                continue
            for (plan_sample, _), (sample, skip, truncated) in zip(plan[1], finished):
                if sample is None:
                    chunk.skip(skip, where)
                    continue
                samples.append(sample)
                chunk.truncated += int(truncated)  # written cut; one dropped is counted under its skip reason
                for what, message in plan_sample.notes:
                    chunk.note(what, f"{where}: message {message}")
        return samples

    # ---------------------------------------------------------------- messages -> ids
    # A row becomes a *plan*: per turn, (prompt parts, answer parts), where a part is either an
    # int (index of a text run in the chunk's batch of texts) or a tuple of special-token ids.
    # The whole chunk's texts are then encoded in one ``encode_batch`` call (the backend's fast
    # path) and the plans resolved into ids.
    def _slot_parts(self, slots, texts: list) -> list:
        parts, run = [], []
        for slot in slots + [None]:
            if isinstance(slot, str):
                run.append(slot)
                continue
            if run:
                parts.append(len(texts))
                texts.append("".join(run))
                run = []
            if slot is not None:
                parts.append(tuple(self._special_ids[slot["token"]]))
        return parts

    def plan_messages(self, messages, system, texts: list, tools=None):
        """(plan, None) or (None, skip reason); text runs are appended to ``texts``."""
        if not messages:
            return None, SKIP_EMPTY
        messages = merge_observations(self.template, messages)
        roles = [role for role, _ in messages]
        joined = next((i for i in range(1, len(roles)) if roles[i - 1] == roles[i] == OBSERVATION), None)
        if joined is not None:  # not "roles out of order": the template has no way to write them
            return None, SkipReason(SKIP_RESULTS_NOT_JOINED, f"turns {joined - 1} and {joined} are tool results in a "
                                    f"row (the results of parallel calls), which template {self.template.name!r} does "
                                    "not join into one turn (it has no observation_separator): use a template that "
                                    "does (qwen, qwen2_5, qwen3 join them) or --prompt-type hf")
        skip = turn_order_skip(roles)
        if skip is not None:
            return None, skip
        if all(isinstance(content, str) and not content.strip() for role, content in messages if role in ANSWER_ROLES):
            return None, SKIP_EMPTY  # only empty answers: nothing to learn but stopping at once
        return [(self._slot_parts(p, texts), self._slot_parts(a, texts))
                for p, a in render_turns(self.template, messages, system, tools)], None

    def plan_row(self, row: dict, where: str, texts: list):
        if isinstance(row, RowError):  # the reader could not parse it
            raise row
        if not isinstance(row, dict):
            raise not_an_object(where, row)
        if self.handler == PRETRAIN:
            text = self._field(row, "text", where, required=True)
            texts.append(text)
            return [len(texts) - 1], None
        messages, system = (self._alpaca_messages if self.handler == ALPACA else self._sharegpt_messages)(row, where)
        if isinstance(messages, str):  # found unusable while reading it: the skip reason
            return None, messages
        try:
            return self.plan_messages(messages, system, texts, parse_tools(row.get(self.keys["tools"]), self.keys["tools"]))
        except RowError as exc:
            raise exc.at(where) from None

    def finish(self, plan, encoded: list) -> tuple[Optional[tuple[list, list]], Optional[str], bool]:
        """(ids, trained) as lists, or None with a skip reason; plus whether the sample was truncated."""
        def resolve(parts):
            if len(parts) == 1 and isinstance(parts[0], int):
                return encoded[parts[0]]
            ids = []
            for part in parts:
                ids += encoded[part] if isinstance(part, int) else part
            return ids

        if self.handler == PRETRAIN:
            ids = list(resolve(plan))
            if not ids:  # a blank line: no document (never one that is only BOS/EOS)
                return None, SKIP_EMPTY, False
            ids = self.bos_prefix + ids
            if self.append_eod:
                ids.append(self.eos_id)
            return (ids, [1] * len(ids)), None, False
        turns = [(resolve(p), resolve(a)) for p, a in plan]
        if self.append_eod and (not turns[-1][1] or turns[-1][1][-1] != self.eos_id):
            turns[-1] = (turns[-1][0], turns[-1][1] + [self.eos_id])
        answered = sum(len(answer) for _, answer in turns) - int(bool(turns and not turns[0][0] and turns[0][1]))
        turns, truncated = truncate_turns(turns, self.seq_length)
        flat, mask = [], []
        for prompt, answer in turns:
            flat += prompt
            flat += answer
            mask += [0] * len(prompt)
            mask += [1] * len(answer)
        if mask:
            mask[0] = 0  # no label crosses into a sample from the one before it
        if 1 not in mask:  # nothing to train: emptied by the cut, or never had anything (the first token aside)
            return None, SKIP_CUT if truncated and answered else SKIP_NO_TRAINABLE, truncated
        return (flat, mask), None, truncated

    def finish_row(self, plan, encoded: list) -> tuple[list, Optional[str], bool]:
        """A row's samples (one here; a preference pair gives two), or [] with a skip reason; truncated?"""
        sample, skip, truncated = self.finish(plan, encoded)
        return ([] if sample is None else [sample]), skip, truncated

    @staticmethod
    def _arrays(sample):
        return None if sample is None else (np.array(sample[0], dtype=np.int32), np.array(sample[1], dtype=np.uint8))

    def _encode_texts(self, texts: list) -> list:
        """A pretraining document is encoded as Megatron-LM encodes it; a template's runs as pieces of one sample."""
        return self.tokenizer.encode_batch(texts) if self.handler == PRETRAIN else self.tokenizer.encode_runs(texts)

    def _encode_one(self, plan, skip, texts):
        if plan is None:
            return None, skip, False
        sample, skip, truncated = self.finish(plan, self._encode_texts(texts))
        return self._arrays(sample), skip, truncated

    def encode_messages(self, messages, system):
        """One conversation (tests, inspection); chunks go through :meth:`encode_rows`."""
        texts: list = []
        return self._encode_one(*self.plan_messages(messages, system, texts), texts)

    def encode_row(self, row: dict, where: str):
        if self.chat is not None:
            raise TypeError("encode_row: a chat-template row may give several samples; use encode_chat_row")
        texts: list = []
        return self._encode_one(*self.plan_row(row, where, texts), texts)

    def encode_chat_row(self, row: dict, where: str) -> list:
        """The samples ``(ids, trained)`` of one row under ``--prompt-type hf`` (tests, inspection)."""
        chunk = EncodedChunk(np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(0, np.int32))
        return self._encode_chat([(where, row)], chunk)

    def encode_rows(self, rows) -> EncodedChunk:
        """Encode ``(where, row)`` pairs into one flat chunk, all texts in one batch.

        A malformed row's :class:`RowError` stops the run, or under ``--skip-bad-rows`` is
        skipped and counted under its reason like the unusable rows.
        """
        chunk = EncodedChunk(np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(0, np.int32))
        if self.chat is not None:
            samples = self._encode_chat(rows, chunk)
            if samples:
                chunk.input_ids = np.concatenate([ids for ids, _ in samples])
                chunk.trained = np.concatenate([t for _, t in samples])
                chunk.lengths = np.array([len(ids) for ids, _ in samples], dtype=np.int32)
            return chunk
        texts: list = []
        plans = []
        for where, row in rows:
            chunk.rows += 1
            try:
                plans.append((*self.plan_row(row, where, texts), where))
            except RowError as exc:
                if not self.skip_bad_rows:
                    raise
                chunk.skip(exc.reason, str(exc))
        encoded = self._encode_texts(texts)
        ids, trained, lengths = [], [], []
        for plan, skip, where in plans:
            samples, truncated = [], False
            if plan is not None:
                samples, skip, truncated = self.finish_row(plan, encoded)
            chunk.truncated += int(truncated and bool(samples))  # written cut; one dropped counts under its reason
            if not samples:
                chunk.skip(skip, where)
                continue
            for sample in samples:
                ids += sample[0]
                trained += sample[1]
                lengths.append(len(sample[0]))
        if lengths:
            chunk.input_ids = np.array(ids, dtype=np.int32)
            chunk.trained = np.array(trained, dtype=np.uint8)
            chunk.lengths = np.array(lengths, dtype=np.int32)
        return chunk


def split_budget(prompt_len: int, answer_len: int, room: int) -> tuple[int, int]:
    """Tokens kept of a turn's (prompt, answer) when they do not both fit in ``room``."""
    if 2 * answer_len < room:
        keep_answer = answer_len
    elif 2 * prompt_len < room:
        keep_answer = room - prompt_len
    else:
        keep_answer = int(room * answer_len / (prompt_len + answer_len))
    keep_answer = min(keep_answer, answer_len)
    return min(prompt_len, room - keep_answer), keep_answer


def truncate_turns(turns: list[tuple[list, list]], budget: Optional[int]) -> tuple[list, bool]:
    """Cut turns to ``budget`` tokens in total (see the module docstring); returns (turns, truncated?)."""
    if budget is None:
        return turns, False
    kept, used = [], 0
    for n, (prompt, answer) in enumerate(turns):
        room = budget - used
        if room <= 0:
            return kept, True
        if len(prompt) + len(answer) > room:
            keep_prompt, keep_answer = split_budget(len(prompt), len(answer), room)
            kept.append((prompt[:keep_prompt], answer[:keep_answer]))
            return kept, True
        kept.append((prompt, answer))
        used += len(prompt) + len(answer)
    return kept, False

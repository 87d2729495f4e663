"""Rows -> OpenAI-style messages (``role``, ``content``, ``tool_calls``, ``reasoning_content``), for chat templates.

One reading of the row formats users bring, whatever template renders them afterwards:

* ShareGPT (LLaMA-Factory): ``from``/``value`` with human/gpt/system, ``function_call`` (a
  ``{"name", "arguments"}`` object, or a list of them for parallel calls, as JSON text) and
  ``observation`` (a tool result); an optional ``tools`` column (JSON text or a list of schemas).
* OpenAI ``messages`` (through ``--map-keys``, or its short keys): roles user/assistant/system/tool,
  ``tool_calls`` (``{"type": "function", "function": {"name", "arguments"}}``, arguments a JSON
  string or an object; several = parallel calls), ``reasoning_content`` (or ``thinking``, gpt-oss's name, or
  ``reasoning``: transformers reads all three), ``tool_call_id``, ``name``.
* Alpaca: the handler's own reading (``system``, ``history`` pairs, ``instruction`` + ``input``,
  ``output``), plus the ``tools`` column.

Malformed input (unparseable arguments, an unknown role, a call without a name) raises
:class:`RowError` naming the message and field; the caller adds the file and row.
"""
from __future__ import annotations

import json
from typing import Optional

from mindspeed_pack.data.errors import RowError

REASON_ARGUMENTS = "unparseable tool arguments"
REASON_ROLE = "unknown role"
REASON_FIELD = "malformed message"
REASON_PART = "content part that is not text"
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' names, in its order of precedence
_PASSED_FIELDS = ("tool_call_id", "name")


def _is_tool_schema(value) -> bool:
    """An object that reads as a tool schema, a named function: OpenAI's ``{"type": "function", "function":
    {"name": ...}}`` or a bare ``{"name", "description", "parameters"}`` (LLaMA-Factory); ``{"type": "function"}``
    alone, or a function given as a string, names none (a template would render it as a tool)."""
    if not isinstance(value, dict):
        return False
    function = value.get("function", value)
    return isinstance(function, dict) and isinstance(function.get("name"), str) and bool(function["name"])


def parse_tools(value, column: str) -> Optional[list]:
    """The ``tools`` column: None/empty, a list of tool schemas, or that list as JSON text. A single schema (an
    object with "type"/"function" or "name") is read as a list of one; anything else is refused, naming the field."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise RowError(f"field {column!r} is not valid JSON ({exc.msg} at column {exc.colno})", REASON_FIELD) from None
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, tuple):
        value = list(value)
    if _is_tool_schema(value):
        value = [value]
    if not isinstance(value, list):
        raise RowError(f"field {column!r} must be a list of tool schemas (objects naming a function: "
                       f"\"function\": {{\"name\": ...}} or \"name\"), got {json.dumps(value, default=str)[:80]}",
                       REASON_FIELD)
    for n, tool in enumerate(value):
        if not _is_tool_schema(tool):
            raise RowError(f"field {column!r} item {n} is not a tool schema (an object naming a function: "
                           f"\"function\": {{\"name\": ...}} or \"name\"): {json.dumps(tool, default=str)[:80]}",
                           REASON_FIELD)
    return [_openai_schema(tool) for tool in value] or None


def _openai_schema(tool: dict) -> dict:
    """A bare ``{"name", "description", "parameters"}`` schema (LLaMA-Factory's tools column) in OpenAI's form, as an
    inference server gives it to the template and LLaMA-Factory writes it; an OpenAI schema as it is."""
    return tool if isinstance(tool.get("function"), dict) else {"type": "function", "function": tool}


def content_text(content, where: str, content_tag: str, type_reason: str = REASON_FIELD, tool_result: bool = False):
    """A message's content as text: a string, None, or OpenAI's list of parts when every part is a text part
    (``{"type": "text", "text": ...}``), their texts concatenated with no separator (what a text-only chat template
    reads of them). Another part (an image, audio) or another type is refused, naming the part. ``tool_result``
    (a tool message): any other JSON value (the object a tool returned) is its JSON text, as the tool's output
    reaches the model."""
    if content is None or isinstance(content, str):
        return content
    if hasattr(content, "tolist"):  # a Parquet/Arrow list
        content = content.tolist()
    if tool_result and not _text_parts(content):
        return json.dumps(content, ensure_ascii=False, default=_json_value)
    if not isinstance(content, (list, tuple)):
        raise RowError(f"{where} field {content_tag!r} must be a string (or a list of text parts), got "
                       f"{type(content).__name__}", type_reason)
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            shown = json.dumps(part, default=str)[:80] if isinstance(part, dict) else repr(part)[:80]
            raise RowError(f"{where} field {content_tag!r} part {i} is not a text part ({{\"type\": \"text\", "
                           f"\"text\": ...}}): {shown}; only text is trained here, so remove the part or the row",
                           REASON_PART)
        texts.append(part["text"])
    return "".join(texts)


def _text_parts(content) -> bool:
    return isinstance(content, (list, tuple)) and all(
        isinstance(part, dict) and part.get("type") == "text" for part in content)


def _json_value(value):
    """A Parquet/Arrow value json cannot write (a numpy array or scalar in a struct) as a plain one."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not a JSON value")


def _arguments(args, where: str):
    """Arguments as given (object or JSON string); a string must parse to a JSON object. None, absent or a blank
    string: ``{}`` (``apply_chat_template`` raises on a call without arguments; docs/chat_templates.md)."""
    if isinstance(args, str) and not args.strip():
        return {}
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError as exc:
            raise RowError(f"{where}: arguments are not valid JSON ({exc.msg} at column {exc.colno}): {args[:80]!r}",
                           REASON_ARGUMENTS) from None
        if not isinstance(parsed, dict):
            raise RowError(f"{where}: arguments must be a JSON object, got {args[:80]!r}", REASON_ARGUMENTS)
        return args
    if args is None:
        return {}
    if not isinstance(args, dict):
        raise RowError(f"{where}: arguments must be an object or a JSON string, got {type(args).__name__}", REASON_ARGUMENTS)
    return args


def normalize_tool_calls(calls, where: str) -> list[dict]:
    """OpenAI ``tool_calls`` (or bare ``{"name", "arguments"}`` objects) -> ``{"type", "function", ["id"]}``."""
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list) or not calls:
        raise RowError(f"{where}: tool_calls must be a non-empty list, got {calls!r}"[:200], REASON_FIELD)
    out = []
    for i, call in enumerate(calls):
        at = f"{where} tool call {i}"
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RowError(f"{at}: needs a function name, got {call!r}"[:200], REASON_FIELD)
        norm = {"type": "function", "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments"), at)}}
        if isinstance(call.get("id"), str):
            norm["id"] = call["id"]
        out.append(norm)
    return out


def function_call_content(content: str, where: str) -> list[dict]:
    """A ShareGPT ``function_call`` message's value: one call or a list of calls, as JSON text."""
    try:
        value = json.loads(content)
    except (json.JSONDecodeError, TypeError) as exc:
        raise RowError(f"{where}: a function_call must be JSON {{\"name\", \"arguments\"}} (or a list of them): "
                       f"{exc}", REASON_ARGUMENTS) from None
    return normalize_tool_calls(value, where)


def sharegpt_messages(raw: list, system: Optional[str], keys: dict, column: str) -> list[dict]:
    """ShareGPT/OpenAI message dicts -> messages; roles named by ``keys`` (--map-keys), OpenAI names accepted too."""
    role_tag, content_tag = keys["role_tag"], keys["content_tag"]
    roles = {"user": "user", "assistant": "assistant", "tool": "tool", "system": "system"}
    roles.update({keys["user_tag"]: "user", keys["assistant_tag"]: "assistant", keys["observation_tag"]: "tool",
                  keys["function_tag"]: "function", keys["system_tag"]: "system"})
    messages = [{"role": "system", "content": system}] if system else []
    for n, message in enumerate(raw):
        where = f"field {column!r} message {n}"
        if not isinstance(message, dict) or role_tag not in message:
            got = list(message) if isinstance(message, dict) else type(message).__name__
            raise RowError(f"{where} must have {role_tag!r} (--map-keys role_tag), got {got}", REASON_FIELD)
        tag = message[role_tag]
        if tag not in roles:
            raise RowError(f"{where} has unknown {role_tag!r} {tag!r}; known: {', '.join(map(repr, roles))} "
                           "(set them with --map-keys user_tag/assistant_tag/...)", REASON_ROLE)
        role = roles[tag]
        calls = message.get("tool_calls")
        content = content_text(message.get(content_tag), where, content_tag, tool_result=role == "tool")
        if content is None and not (role == "assistant" and calls):
            raise RowError(f"{where} has no {content_tag!r} (--map-keys content_tag)", REASON_FIELD)
        if role == "system" and n == 0:  # a leading system message wins over the system column
            messages = [{"role": "system", "content": content}]
            continue
        if role == "function":  # LLaMA-Factory: the call(s) as JSON text
            messages.append({"role": "assistant", "content": None,
                             "tool_calls": function_call_content(content, where)})
            continue
        out = {"role": role, "content": content}
        if calls:
            if role != "assistant":
                raise RowError(f"{where}: tool_calls on a {tag!r} message (only assistant messages call tools)", REASON_FIELD)
            out["tool_calls"] = normalize_tool_calls(calls, where)
        for name in REASONING_FIELDS:
            value = message.get(name)
            if value is not None:
                if not isinstance(value, str):
                    raise RowError(f"{where} field {name!r} must be a string", REASON_FIELD)
                out.setdefault("reasoning_content", value)  # the first one present, as apply_chat_template reads it
        for name in _PASSED_FIELDS:
            if isinstance(message.get(name), str):
                out[name] = message[name]
        messages.append(out)
    return messages

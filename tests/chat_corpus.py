"""A deterministic corpus of OpenAI-style conversations with the edge cases chat templates get wrong,
and a tokenizer holding the special tokens of every vendored template (tests only).

Every content string carries a tag saying whose it is (``U3_1`` user, ``A3_1`` assistant,
``R3_1`` reasoning, ``T3_1`` tool result, ``S3`` system, ``D3`` a tool schema's description,
``fn3_1`` a called function, ``V3_1`` an argument value), so a test can tell from the decoded
trained text alone whether anything but assistant output was trained.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"

# family -> (template file, bos, eos, the token(s) every trained turn ends with: the template's end-of-turn token, or
# where it writes none (GLM-4) the token that begins the next message, appended after a sample's last turn)
FAMILIES = {
    "qwen2_5": ("qwen2_5.jinja", None, "<|im_end|>", "<|im_end|>"),
    "qwen3": ("qwen3.jinja", None, "<|im_end|>", "<|im_end|>"),
    "qwen3_2507": ("qwen3_instruct_2507.jinja", None, "<|im_end|>", "<|im_end|>"),
    "llama3_1": ("llama3_1.jinja", "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>"),
    "llama3_2": ("llama3_2.jinja", "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>"),
    "r1_distill": ("deepseek_r1_distill_training.jinja", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                   "<｜end▁of▁sentence｜>"),
    "gemma3": ("gemma3.jinja", "<bos>", "<eos>", "<end_of_turn>"),
    "phi3_5": ("phi3_5.jinja", "<s>", "<|endoftext|>", "<|endoftext|>"),
    "glm4": ("glm4moe.jinja", None, "<|endoftext|>", ("<|user|>", "<|observation|>")),
}
# the stop token appended after a sample's last turn where the template writes no end-of-turn token
APPENDED_STOP = {"glm4": "<|user|>"}

SPECIAL = ("<|im_start|> <|im_end|> <|endoftext|> <|begin_of_text|> <|start_header_id|> <|end_header_id|> <|eot_id|> "
           "<|eom_id|> <|python_tag|> <｜begin▁of▁sentence｜> <｜end▁of▁sentence｜> <｜User｜> <｜Assistant｜> "
           "<｜tool▁calls▁begin｜> <｜tool▁call▁begin｜> <｜tool▁sep｜> <｜tool▁call▁end｜> <｜tool▁calls▁end｜> "
           "<｜tool▁outputs▁begin｜> <｜tool▁output▁begin｜> <｜tool▁output▁end｜> <｜tool▁outputs▁end｜> <bos> <eos> "
           "<start_of_turn> <end_of_turn> <s> <|system|> <|user|> <|assistant|> <|end|> [gMASK] <sop> <|observation|>").split()
ADDED = "<think> </think> <tool_call> </tool_call> <tool_response> </tool_response>".split()  # Qwen: added, not special

MAP_KEYS = {"messages": "messages", "role": "role", "content": "content", "user": "user", "assistant": "assistant",
            "tool": "tool"}

WORDS = "red blue cat dog sun moon tree rock apple pear one two".split()
CJK = ["你好，世界", "今天天气很好。", "日本語のテキスト", "중국어 텍스트", "猫と犬"]
WHITESPACE = ["  {t} leading", "{t} trailing  \n", "\n\n{t}\n\n", "{t}\twith\ttabs", "{t}  two  spaces ", "\n{t}"]
LITERALS = ["<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|im_start|>user"]


def build_tokenizer(base_dir: Path, out: Path, family: str) -> Path:
    """The toy tokenizer with every template's tokens, this family's BOS/EOS and its chat template."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    path, bos, eos, _ = FAMILIES[family]
    tok = AutoTokenizer.from_pretrained(str(base_dir))
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL], special_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    tok.eos_token = eos
    tok.bos_token = bos
    tok.chat_template = (TEMPLATES / path).read_text(encoding="utf-8")
    tok.save_pretrained(str(out))
    return out


def _text(rng, tag):
    return f"{tag} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))


def _schema(i, n):
    return {"type": "function", "function": {"name": f"fn{i}_{n}", "description": f"D{i} looks things up",
                                             "parameters": {"type": "object",
                                                            "properties": {"q": {"type": "string"}}}}}


def _call(i, n, as_string):
    args = {"q": f"V{i}_{n}", "n": n}
    return {"id": f"call{i}_{n}", "type": "function",
            "function": {"name": f"fn{i}_{n}", "arguments": json.dumps(args) if as_string else args}}


def conversation(i: int) -> dict:
    """Conversation ``i`` (kind ``i % 13``), deterministic."""
    rng = random.Random(i)
    kind = i % 13
    msgs, tools = [], None
    if kind in (0, 5, 10) or rng.random() < 0.3:
        msgs.append({"role": "system", "content": _text(rng, f"S{i}")})
    turns = 1 if kind in (0, 1, 11) else rng.randint(2, 3)

    def exchange(n, reasoning=False, content=None):
        msgs.append({"role": "user", "content": _text(rng, f"U{i}_{n}")})
        a = {"role": "assistant", "content": content if content is not None else _text(rng, f"A{i}_{n}")}
        if reasoning:
            a["reasoning_content"] = _text(rng, f"R{i}_{n}")
        msgs.append(a)

    if kind in (0, 1):  # single turn, with / without system
        exchange(0, reasoning=kind == 1 and rng.random() < 0.5)
    elif kind == 2:  # reasoning in every turn
        for n in range(turns):
            exchange(n, reasoning=True)
    elif kind == 3:  # reasoning in some turns
        for n in range(turns):
            exchange(n, reasoning=n % 2 == 0)
    elif kind == 4:  # whitespace edges
        for n in range(turns):
            msgs.append({"role": "user", "content": rng.choice(WHITESPACE).format(t=f"U{i}_{n}")})
            msgs.append({"role": "assistant", "content": rng.choice(WHITESPACE).format(t=f"A{i}_{n}")})
    elif kind == 5:  # literal special-token strings inside content
        for n in range(turns):
            msgs.append({"role": "user", "content": f"U{i}_{n} what is {rng.choice(LITERALS)} for?"})
            msgs.append({"role": "assistant", "content": f"A{i}_{n} it is {rng.choice(LITERALS)} text"})
    elif kind == 6:  # an empty assistant answer before a normal one
        exchange(0, content="")
        exchange(1)
    elif kind in (7, 8, 9, 12):  # tools: one call / parallel calls + several results / string args / with reasoning
        tools = [_schema(i, n) for n in range(2)]
        msgs.append({"role": "user", "content": _text(rng, f"U{i}_0")})
        calls = [_call(i, n, as_string=kind == 9) for n in range(2 if kind == 8 else 1)]
        call_turn = {"role": "assistant", "content": "", "tool_calls": calls}
        if kind == 12:
            call_turn["reasoning_content"] = _text(rng, f"R{i}_0")
        msgs.append(call_turn)
        for n, c in enumerate(calls):
            msgs.append({"role": "tool", "tool_call_id": c["id"], "content": _text(rng, f"T{i}_{n}")})
        final = {"role": "assistant", "content": _text(rng, f"A{i}_1")}
        if kind == 12:
            final["reasoning_content"] = _text(rng, f"R{i}_1")
        msgs.append(final)
    elif kind == 10:  # CJK, reasoning in every turn
        for n in range(turns):
            msgs.append({"role": "user", "content": f"U{i}_{n} {rng.choice(CJK)}"})
            msgs.append({"role": "assistant", "content": f"A{i}_{n} {rng.choice(CJK)}",
                         "reasoning_content": f"R{i}_{n} {rng.choice(CJK)}"})
    elif kind == 11:  # system and a question only: nothing to train
        msgs = [{"role": "system", "content": _text(rng, f"S{i}")}, {"role": "user", "content": _text(rng, f"U{i}_0")}]
    row = {"messages": msgs}
    if tools:
        row["tools"] = tools
    return row


def corpus(n: int = 260) -> list[dict]:
    return [conversation(i) for i in range(n)]


def as_sharegpt(row: dict):
    """The corpus row in LLaMA-Factory ShareGPT form, or None when it has reasoning (JSON templates have none)."""
    out, system = [], None
    roles = {"user": "human", "assistant": "gpt", "tool": "observation"}
    for m in row["messages"]:
        if m.get("reasoning_content"):
            return None
        if m["role"] == "system":
            system = m["content"]
        elif m.get("tool_calls"):
            calls = [c["function"] for c in m["tool_calls"]]
            out.append({"from": "function_call", "value": json.dumps(calls if len(calls) > 1 else calls[0])})
        else:
            out.append({"from": roles[m["role"]], "value": m["content"]})
    return {"conversations": out, "system": system, **({"tools": row["tools"]} if "tools" in row else {})}

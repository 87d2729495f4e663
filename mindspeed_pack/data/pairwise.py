"""Preference pairs: one row -> a chosen and a rejected sample that share the prompt.

Handlers (MindSpeed-LLM's names; LLaMA-Factory's ranking format):

* ``AlpacaStylePairwiseHandler``: ``instruction`` (+ ``input``), optional ``system`` and
  ``history``, and the two answers ``chosen`` / ``rejected``.
* ``SharegptStylePairwiseHandler``: ``conversations`` ending with the user's turn, and
  ``chosen`` / ``rejected``, each a message ``{"from": "gpt", "value": ...}``, a list of one (TRL's
  conversational pairs with an explicit prompt, below) or a string; or (ms-swift's
  rows) the conversation ending with the chosen answer, no ``chosen`` column, and the rejected answer
  (``--map-keys '{"rejected": "rejected_response"}'``). Without the conversation column, TRL's and the hub's rows
  (OpenAI messages, no ``--map-keys`` needed): TRL's explicit ``prompt`` (a list of messages), or ``chosen`` and
  ``rejected`` each the whole conversation (TRL's implicit prompt; UltraFeedback-binarized rows), the messages both
  start with being the prompt and one assistant message after it each side's answer.

Both samples go through the same template as supervised data; only the final answer is trained (the
answers of a ``history`` are context, as in LLaMA-Factory). Under ``--prompt-type hf`` the
prompt plus each answer is rendered by the model's own chat template and the trained span
derived from the renders as for supervised data (``chat_template.py``), for the final answer only
(earlier turns of the prompt are context): ``render(prompt + [answer])[len(render(prompt,
add_generation_prompt=True)):]`` up to and including the end-of-turn token. The prompt's tokens
are checked identical in both samples (a RowError otherwise). The pair is the unit of
packing (``preprocess_data.py --pack --neat-pack``): the packer places pair lengths, so
chosen and rejected are always neighbours in one pack, segment ``2k-1`` the chosen and
``2k`` the rejected answer of the pack's ``k``-th pair::

    attention_mask  1 1 1 1 1  2 2 2 2  3 3 3  4 4 4 4  0 0     (chosen 1, rejected 2, chosen 3, ...)

A pair is never truncated (a one-sided cut would bias the preference): a pair longer than
``--seq-length`` (its padded lengths under ``--pad-to-multiple-of``) is dropped and counted,
and so is a pair whose answers are the same tokens once the template is applied (it cannot teach a
preference; warned): ``"hello  "`` against ``"hello"`` under Llama 3's trimming template.
A row without ``chosen`` or ``rejected`` is a :class:`RowError`. An optional ``margin`` column (a number per
row; 0 where a row has none) is the pair's reward margin, TRL's RewardTrainer's: kept per pair, in pack
order, for ``--stage orm`` (``P_packed_pair_margins``).
"""
from __future__ import annotations

import json
from typing import Optional

import numpy as np

from mindspeed_pack.data.chat_messages import REASONING_FIELDS
from mindspeed_pack.data.chat_template import REASON_REASONING, REASON_TOKEN_BOUNDARY
from mindspeed_pack.data.errors import BAD_MISSING_FIELD, RowError
from mindspeed_pack.data.handlers import ALPACA, ASSISTANT, PAIRWISE_BASE, SKIP_EMPTY, SampleEncoder, chat_order_skip
from mindspeed_pack.data.readers import not_an_object
from mindspeed_pack.data.templates import REASON_TOOLS

SKIP_TOO_LONG = "pair longer than --seq-length"
SKIP_IDENTICAL = "identical chosen and rejected"
MISSING_ANSWER = "missing chosen/rejected"
BAD_MARGIN = "margin not a number"
BAD_CONVERSATIONS = "chosen/rejected conversations not one prompt and two answers"


def is_pairwise(handler: str) -> bool:
    return handler in PAIRWISE_BASE


def pair_plan(lengths: np.ndarray, seq_length: int):
    """Pack the pairs of a TokenStore (samples 2i, 2i+1 = chosen, rejected of pair i).

    The packer sees one length per pair; its plan is expanded back to samples, chosen before
    rejected, so a pack's segment ids are 1..2k with pairs (2j-1, 2j).
    """
    from mindspeed_pack.packing.binpack import PackPlan, pack_lengths

    lengths = np.asarray(lengths, dtype=np.int64)
    plan = pack_lengths(lengths[0::2] + lengths[1::2], seq_length)
    pairs = np.asarray(plan.item_order, dtype=np.int64)
    samples = np.stack([2 * pairs, 2 * pairs + 1], axis=1).reshape(-1)
    return PackPlan(samples, 2 * np.asarray(plan.bin_offsets, dtype=np.int64), plan.capacity)


def in_mapped_tags(messages: list, keys: dict) -> list:
    """OpenAI messages (``role``/``content``, as TRL's and the hub's rows always are) under the handler's
    ``--map-keys`` role/content names, so the conversation reads as the explicit form's; others unchanged."""
    role_tag, content_tag = keys["role_tag"], keys["content_tag"]
    out = []
    for message in messages:
        if isinstance(message, dict) and role_tag not in message and "role" in message:
            message = {role_tag if k == "role" else content_tag if k == "content" else k: v
                       for k, v in message.items()}
        out.append(message)
    return out


def final_answer_only(plan: list) -> list:
    """A conversation's turns as one: everything before the final answer is its prompt, so the answers of the
    history are context, as under ``--prompt-type hf`` (and in LLaMA-Factory): only the pair's answers differ."""
    prompt = [part for p, a in plan[:-1] for part in p + a] + plan[-1][0]
    return [(prompt, plan[-1][1])]


class PairwiseEncoder(SampleEncoder):
    """Row -> (chosen, rejected) samples; ``seq_length`` bounds the pair, never cuts it."""

    def __init__(self, handler: str, tokenizer, template, map_keys: dict, seq_length: Optional[int],
                 append_eod: bool, pad_to_multiple_of: int = 1, skip_bad_rows: bool = False, chat=None):
        super().__init__(PAIRWISE_BASE[handler], tokenizer, template, map_keys, None, append_eod, skip_bad_rows,
                         chat=chat)
        self.pair_handler, self.budget, self.multiple = handler, seq_length, pad_to_multiple_of
        self.margins: list = []  # of the pairs kept so far in the chunk being encoded

    def encode_rows(self, rows):
        """A chunk's samples, chosen and rejected of each pair in turn, with the kept pairs' margins."""
        self.margins = []
        chunk = super().encode_rows(rows)
        chunk.pair_margins = np.asarray(self.margins, dtype=np.float64)
        return chunk

    def _margin(self, row: dict, where: str) -> float:
        """The row's reward margin (``--map-keys margin``), 0 without one."""
        column = self.keys["margin"]
        value = row.get(column)
        if value is None or value == "":
            return 0.0
        try:
            margin = float(value) if not isinstance(value, bool) else None
        except (TypeError, ValueError):
            margin = None
        if margin is None or not np.isfinite(margin):
            raise RowError(f"{where}: field {column!r} (--map-keys margin) must be a number, the pair's reward margin, "
                           f"got {value!r}", BAD_MARGIN)
        return margin

    def _fits(self, samples) -> bool:
        """Whether the pair, each sample padded to ``--pad-to-multiple-of``, fits ``--seq-length``."""
        padded = sum(-(-len(ids) // self.multiple) * self.multiple for ids, _ in samples)
        return self.budget is None or padded <= self.budget

    def _answer(self, row: dict, key: str, where: str) -> str:
        """The ``chosen``/``rejected`` answer's text: a string, or a ShareGPT/OpenAI message holding it."""
        column, content_tag = self.keys[key], self.keys.get("content_tag", "value")
        value = row.get(column)
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict):
            value = value[0]  # TRL's conversational pairs with an explicit prompt: the answer is one message
        if isinstance(value, dict):  # a message: its text, and nothing it would lose
            for name, reason in (("tool_calls", REASON_TOOLS), *((f, REASON_REASONING) for f in REASONING_FIELDS)):
                if value.get(name):
                    raise RowError(f"{where}: field {column!r} (--map-keys {key}) has {name!r}, which a preference "
                                   "answer cannot carry (refused, not dropped): give the answer as text", reason)
            role_tag = self.keys.get("role_tag", "from")
            role = value.get(role_tag, value.get("role"))
            assistant = {self.keys.get("assistant_tag", "gpt"), "gpt", "assistant"}
            if role is not None and role not in assistant:  # a user's message trained as the model's answer
                raise RowError(f"{where}: field {column!r} (--map-keys {key}) is a message from {role!r}; an answer "
                               f"is the assistant's ({' or '.join(repr(r) for r in sorted(assistant))})",
                               MISSING_ANSWER)
            text = value.get(content_tag, value.get("content"))
            if not isinstance(text, str):
                got = "no text" if text is None else f"a {type(text).__name__}"
                raise RowError(f"{where}: field {column!r} (--map-keys {key}) is a message with {got} in "
                               f"{content_tag!r} (--map-keys content_tag); the message has: "
                               f"{', '.join(map(str, value)) or 'no fields'}", MISSING_ANSWER)
            return text
        if not isinstance(value, str):
            got = "missing" if column not in row else "null" if value is None else f"a {type(value).__name__}"
            if isinstance(value, list):  # TRL's implicit-prompt pairs: the whole conversation per answer
                got += (f" of {len(value)} (a conversation per answer, as TRL's implicit-prompt pairs: give the "
                        "prompt's turns in the conversation column and each answer as text, one assistant message or "
                        "a list of one)")
            ending = (" (or end the conversation with the chosen answer, as ms-swift's rows do)"
                      if key == "chosen" and self.handler != ALPACA else "")
            raise RowError(f"{where}: field {column!r} (--map-keys {key}) must be the {key} answer (a string or a "
                           f"message with {content_tag!r}){ending}, got {got}; "
                           f"the row has: {', '.join(map(str, row)) or 'no fields'}", MISSING_ANSWER)
        return value

    def _role(self, message) -> str:
        return message.get(self.keys.get("role_tag", "from"), message.get("role")) if isinstance(message, dict) \
            else type(message).__name__

    def _assistant(self, message) -> bool:
        return self._role(message) in {self.keys.get("assistant_tag", "gpt"), "gpt", "assistant"}

    def _is_conversation(self, value) -> bool:
        """A whole conversation given as an answer (TRL's implicit prompt): messages other than one answer."""
        return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value) and (
            len(value) > 1 or not self._assistant(value[0]))

    def _implicit_prompt(self, row: dict, where: str) -> tuple:
        """(prompt, chosen message, rejected message) of a pair whose answers are whole conversations (TRL's implicit
        prompt, as ``trl.extract_prompt`` reads it): the messages both share from the start are the prompt, and each
        must go on with one final assistant message. Identical conversations: their last message is both answers."""
        names = self.keys["chosen"], self.keys["rejected"]
        sides = [row.get(name) for name in names]
        for name, side in zip(names, sides):
            if not (isinstance(side, list) and side and all(isinstance(m, dict) for m in side)):
                raise RowError(f"{where}: field {name!r} must be a conversation (a list of messages) like the other "
                               f"answer (TRL's implicit prompt: each answer the whole conversation, sharing the "
                               f"prompt's messages), got {json.dumps(side, default=str)[:80]}", BAD_CONVERSATIONS)
        chosen, rejected = sides
        shared = next((n for n, (c, r) in enumerate(zip(chosen, rejected)) if c != r), min(map(len, sides)))
        if chosen == rejected:
            shared -= 1
        tails = chosen[shared:], rejected[shared:]
        if not all(len(tail) == 1 and self._assistant(tail[0]) for tail in tails):
            roles = [", ".join(map(str, map(self._role, m))) or "none" for m in (chosen[:shared], *tails)]
            prompt = f"{shared} messages ({roles[0]})" if shared else "empty: they differ from their first message"
            raise RowError(f"{where}: fields {names[0]!r} and {names[1]!r} are whole conversations (TRL's implicit "
                           f"prompt), whose prompt, the messages both start with, is {prompt}; after it {names[0]!r} "
                           f"has {len(tails[0])} ({roles[1]}) and {names[1]!r} {len(tails[1])} ({roles[2]}): each must "
                           "go on with one final assistant message, its answer (conversations that differ before it, "
                           "or answers of several turns, are not one preference pair)", BAD_CONVERSATIONS)
        return chosen[:shared], tails[0][0], tails[1][0]

    def _explicit_pair(self, row: dict, where: str) -> dict:
        """A ShareGPT pair row in its explicit form (the conversation column holding the prompt): TRL's and the
        hub's rows are read as it. Answers given as whole conversations (TRL's implicit prompt; UltraFeedback's
        rows, whose ``prompt`` text and ``messages`` copy of the chosen conversation are then ignored when they
        agree) are split by :meth:`_implicit_prompt`; TRL's explicit ``prompt`` (a list of messages) stands for a
        missing conversation column. Their OpenAI role/content names are read under the handler's."""
        if self.handler == ALPACA:
            return row
        conversation, names = self.keys["messages"], (self.keys["chosen"], self.keys["rejected"])
        if any(self._is_conversation(row.get(name)) for name in names):
            prompt, chosen, rejected = self._implicit_prompt(row, where)
            for column in (conversation, self.keys["prompt"]):
                given = row.get(column)
                if isinstance(given, list) and given not in (prompt, prompt + [chosen]):
                    raise RowError(f"{where}: field {column!r} holds {len(given)} messages beside {names[0]!r} and "
                                   f"{names[1]!r} given as whole conversations, whose shared prompt ({len(prompt)} "
                                   "messages) differs from them: give the prompt once, in that column with each answer "
                                   "one assistant message, or inside both answers (TRL's implicit prompt)",
                                   BAD_CONVERSATIONS)
            return {**row, conversation: in_mapped_tags(prompt, self.keys), names[0]: chosen, names[1]: rejected}
        prompt = row.get(self.keys["prompt"])
        if conversation not in row and isinstance(prompt, list):  # TRL's explicit prompt, a list of messages
            return {**row, conversation: in_mapped_tags(prompt, self.keys)}
        if conversation not in row and names[0] in row:  # (ms-swift's rows end the conversation with the answer)
            fields = ", ".join(map(str, row)) or "no fields"
            raise RowError(f"{where}: missing field {conversation!r} (--map-keys messages), the prompt's messages; "
                           f"or give TRL's {self.keys['prompt']!r} (--map-keys prompt) as a list of messages, or "
                           f"{names[0]!r} and {names[1]!r} as whole conversations sharing the prompt (TRL's implicit "
                           f"prompt); TRL's standard rows (all text) are --handler-name AlpacaStylePairwiseHandler "
                           f"--map-keys '{{\"prompt\": \"prompt\"}}'; the row has: {fields}", BAD_MISSING_FIELD)
        return row

    def _chosen_ending_the_conversation(self, row: dict, where: str) -> dict:
        """A ShareGPT row without a chosen column whose conversation ends with an assistant message (ms-swift's
        pairs: ``messages`` ending with the chosen answer, ``rejected_response``): that message is the chosen
        answer and the conversation before it the prompt."""
        conversation, chosen = self.keys.get("messages"), self.keys["chosen"]
        messages = row.get(conversation) if self.handler != ALPACA else None
        if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
            return row
        last = messages[-1]
        role = last.get(self.keys.get("role_tag", "from"), last.get("role"))
        if role not in {self.keys.get("assistant_tag", "gpt"), "gpt", "assistant"}:
            return row
        if chosen in row:  # both forms: which answer is the chosen one?
            raise RowError(f"{where}: field {conversation!r} ends with an assistant message and the row has a "
                           f"{chosen!r} answer too: give the chosen answer once (end the conversation with the "
                           "user's turn, or drop the column)", MISSING_ANSWER)
        return {**row, conversation: messages[:-1], chosen: last}

    def plan_row(self, row, where: str, texts: list):
        """((chosen plan, rejected plan), None) or (None, skip reason)."""
        if isinstance(row, RowError):  # the reader could not parse it
            raise row
        if not isinstance(row, dict):
            raise not_an_object(where, row)
        row = self._chosen_ending_the_conversation(self._explicit_pair(row, where), where)
        chosen, rejected = self._answer(row, "chosen", where), self._answer(row, "rejected", where)
        margin = self._margin(row, where)
        prompt, system = (self._alpaca_prompt if self.handler == ALPACA else self._sharegpt_messages)(row, where)
        if isinstance(prompt, str):  # found unusable while reading it: the skip reason
            return None, prompt
        if chosen == rejected:
            return None, SKIP_IDENTICAL
        plans = []
        for answer in (chosen, rejected):
            plan, skip = self.plan_messages(prompt + [(ASSISTANT, answer)], system, texts)
            if plan is None:
                return None, skip
            plans.append(final_answer_only(plan))
        return (*plans, margin), None

    def plan_chat_row(self, row, where: str, texts: list):
        """``--prompt-type hf``: ((where, [(chosen plan, text index), (rejected plan, text index)]), None)
        or (None, skip reason); each answer's render is appended to ``texts``."""
        if isinstance(row, RowError):  # the reader could not parse it
            raise row
        if not isinstance(row, dict):
            raise not_an_object(where, row)
        row = self._chosen_ending_the_conversation(self._explicit_pair(row, where), where)
        chosen, rejected = self._answer(row, "chosen", where), self._answer(row, "rejected", where)
        margin = self._margin(row, where)
        prompt, tools = self._chat_messages(row, where, answer=False)
        if all(m["role"] == "system" for m in prompt):
            return None, SKIP_EMPTY
        skip = chat_order_skip(prompt + [{"role": "assistant", "content": chosen}])  # answers the prompt's last turn
        if skip is not None:
            return None, skip
        if chosen == rejected:
            return None, SKIP_IDENTICAL
        plan = []
        for answer in (chosen, rejected):
            messages = prompt + [{"role": "assistant", "content": answer}]
            sample, = self.chat_samples(messages, tools, where, trained=[len(messages) - 1])
            plan.append((sample, len(texts)))
            texts.append(sample.text)
        return (where, plan, margin), None

    def finish_chat(self, plan, encoded: list) -> list:
        """[chosen, rejected] as supervised samples, or one (None, skip reason, False) for the pair: a pair is
        never truncated, and its prompt must be the same tokens before both answers."""
        out = super().finish_chat(plan[:2], encoded)
        for sample, skip, _ in out:
            if sample is None:
                return [(None, skip, False)]
        (chosen, chosen_mask), (rejected, rejected_mask) = (sample for sample, _, _ in out)
        if np.array_equal(chosen, rejected):  # the template made the answers the same (Llama 3 trims them)
            return [(None, SKIP_IDENTICAL, False)]
        start = int(np.argmax(chosen_mask))
        if start != int(np.argmax(rejected_mask)) or not np.array_equal(chosen[:start], rejected[:start]):
            raise RowError(f"{plan[0]}: the prompt is not the same tokens before the chosen and the rejected answer "
                           "(the answers merge with the prompt's last token)", REASON_TOKEN_BOUNDARY)
        if not self._fits([s for s, _, _ in out]):
            return [(None, SKIP_TOO_LONG, False)]
        self.margins.append(plan[2])
        return out

    def finish_row(self, plan, encoded: list):
        """([chosen, rejected], None, False), or ([], skip reason, False): a pair is never truncated."""
        *sides, margin = plan
        samples = []
        for side in sides:
            sample, skip, _ = self.finish(side, encoded)
            if sample is None:
                return [], skip, False
            samples.append(sample)
        if samples[0][0] == samples[1][0]:  # the same tokens once the template is applied (Llama 3 trims answers)
            return [], SKIP_IDENTICAL, False
        if not self._fits(samples):
            return [], SKIP_TOO_LONG, False
        self.margins.append(margin)
        return samples, None, False

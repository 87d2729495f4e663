"""KTO rows: one prompt, one completion and a desirable/undesirable label; packed as "KTO couples".

Handlers (the instruction handlers' rows plus a ``label`` column, ``--map-keys '{"label": "kto_tag"}'`` for
LLaMA-Factory's name): ``AlpacaStyleKTOHandler`` (``instruction`` + ``input`` -> ``output``) and
``SharegptStyleKTOHandler`` (``conversations`` ending with the answer; OpenAI ``messages`` through the
ShareGPT handler's ``--map-keys``; TRL's conversational rows, ``prompt`` a list of messages and ``completion`` a list
of one assistant message, without any). A label is ``true`` (desirable) or ``false`` (undesirable): a JSON/Parquet
boolean, 0/1, or the text ``true``/``false`` (CSV); anything else, or none, is a :class:`RowError` naming the
file, row and field. As for preference pairs, only the final answer is trained (earlier turns are context),
and a sample is never truncated.

KTO's reference point is a KL estimate from *mismatched* prompt/completion pairs (TRL's ``KTOTrainer``: the
completions of a batch shifted by one, ``[y_n, y_1, ..., y_{n-1}]``, so sample ``i``'s KL partner is its
prompt with sample ``i-1``'s completion, the first taking the last's). Here the shift runs over the whole
dataset in input order, at preprocessing (:class:`KLCouples`), token by token as TRL concatenates them::

    sample i        prompt_i  completion_i          (trained: completion_i; labelled desirable or not)
    KL partner i    prompt_i  completion_{i-1}      (its log-probs give the KL estimate; no loss of its own)

A sample and its partner are one unit of packing (:func:`~mindspeed_pack.data.pairwise.pair_plan`), so
they are never split across packs, micro-batches or ranks: segment ``2k-1`` of a pack is its ``k``-th
sample, ``2k`` that sample's partner, and every global batch holds the partners of exactly its samples.
A couple longer than ``--seq-length`` (padded lengths) is dropped and counted. The labels are written per
segment (1 desirable, 0 undesirable, -1 a KL partner) to ``P_packed_kto_labels``, one document per pack.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from mindspeed_pack.data.errors import BAD_MISSING_FIELD, BAD_TYPE, PreprocessError, RowError
from mindspeed_pack.data.handlers import ALPACA, KTO_BASE, SKIP_EMPTY, EncodedChunk, SampleEncoder, chat_order_skip
from mindspeed_pack.data.pairwise import final_answer_only, in_mapped_tags
from mindspeed_pack.data.readers import not_an_object

SKIP_TOO_LONG = "KTO sample with its KL partner longer than --seq-length"
PARTNER = -1  # the label of a KL partner's segment
_TRUE, _FALSE = ("true", "1"), ("false", "0")


def is_kto(handler: str) -> bool:
    return handler in KTO_BASE


@dataclass
class KTOChunk(EncodedChunk):
    """An encoded chunk and, per sample, its label (1 desirable, 0 undesirable) and row."""

    desirable: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    rows_of: list = field(default_factory=list)


class KTOEncoder(SampleEncoder):
    """Row -> one sample (its final answer trained) and its label; ``--seq-length`` is checked on the couple."""

    def __init__(self, handler: str, tokenizer, template, map_keys: dict, append_eod: bool,
                 skip_bad_rows: bool = False, chat=None):
        super().__init__(KTO_BASE[handler], tokenizer, template, map_keys, None, append_eod, skip_bad_rows, chat=chat)
        self._labels: list = []  # per finished sample of the chunk being encoded: (label, row)

    def label(self, row: dict, where: str) -> int:
        """1 (desirable) or 0 (undesirable) from the row's label column."""
        column = self.keys["label"]
        value = row.get(column)
        if value is None:
            raise RowError(f"{where}: missing field {column!r} (--map-keys label): a KTO row needs its label, true "
                           f"(desirable) or false (undesirable); the row has: {', '.join(map(str, row)) or 'no fields'}",
                           BAD_MISSING_FIELD)
        if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # numpy scalars (parquet)
            value = value.item()
        if isinstance(value, bool):
            return int(value)
        if isinstance(value, int) and value in (0, 1):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return int(value.strip().lower() in _TRUE)
        raise RowError(f"{where}: field {column!r} (--map-keys label) must be true (desirable) or false "
                       f"(undesirable), got {value!r}", BAD_TYPE)

    def _checked(self, row, where) -> int:
        if isinstance(row, RowError):  # the reader could not parse it
            raise row
        if not isinstance(row, dict):
            raise not_an_object(where, row)
        return self.label(row, where)

    def _conversation(self, row: dict, where: str) -> dict:
        """A ShareGPT KTO row without its conversation column read from TRL's conversational KTO columns: ``prompt``
        (a list of messages) followed by ``completion`` (a list of one assistant message), OpenAI's role/content
        names read under the handler's. A row with the conversation column is read as it always was."""
        if self.handler == ALPACA:
            return row
        conversation, prompt_column, completion_column = (self.keys[k] for k in ("messages", "prompt", "completion"))
        if conversation in row or not {prompt_column, completion_column} & set(row):
            return row
        prompt, completion = row.get(prompt_column), row.get(completion_column)
        if isinstance(completion, dict):
            completion = [completion]
        for key, value, what in (("prompt", prompt, "a list of messages, the prompt"),
                                 ("completion", completion, "a list of one assistant message, the answer")):
            if not (isinstance(value, list) and value and all(isinstance(m, dict) for m in value)):
                raise RowError(f"{where}: field {self.keys[key]!r} (--map-keys {key}) "
                               f"must be {what} (TRL's conversational KTO rows), got "
                               f"{json.dumps(value, default=str)[:80]}; for TRL's standard rows (prompt and completion "
                               "as text) use --handler-name AlpacaStyleKTOHandler --map-keys "
                               "'{\"prompt\": \"prompt\", \"response\": \"completion\"}'", BAD_TYPE)
        role = completion[0].get(self.keys["role_tag"], completion[0].get("role"))
        if len(completion) != 1 or role not in {self.keys["assistant_tag"], "assistant"}:
            roles = ", ".join(str(m.get(self.keys["role_tag"], m.get("role"))) for m in completion)
            raise RowError(f"{where}: field {completion_column!r} (--map-keys completion) has {len(completion)} "
                           f"messages ({roles}); a KTO completion is one assistant message, the answer the label "
                           "judges (earlier turns belong in the prompt)", BAD_TYPE)
        return {**row, conversation: in_mapped_tags(prompt + completion, self.keys)}

    # JSON templates: the base plan, the final answer trained
    def plan_row(self, row, where: str, texts: list):
        desirable = self._checked(row, where)
        plan, skip = super().plan_row(self._conversation(row, where), where, texts)
        return (None, skip) if plan is None else ((desirable, where, final_answer_only(plan)), None)

    def finish_row(self, plan, encoded: list):
        desirable, where, turns = plan
        samples, skip, truncated = super().finish_row(turns, encoded)
        if samples:
            self._labels.append((desirable, where))
        return samples, skip, truncated

    # --prompt-type hf: the conversation rendered by the model's template, its last message trained
    def plan_chat_row(self, row, where: str, texts: list):
        desirable = self._checked(row, where)
        messages, tools = self._chat_messages(self._conversation(row, where), where)
        if all(m["role"] == "system" for m in messages):
            return None, SKIP_EMPTY
        skip = chat_order_skip(messages)  # the JSON templates' rules: roles in order, an answer last
        if skip is not None:
            return None, skip
        sample, = self.chat_samples(messages, tools, where, trained=[len(messages) - 1])
        texts.append(sample.text)
        return (where, [(sample, len(texts) - 1)], desirable), None

    def finish_chat(self, plan, encoded: list) -> list:
        where, samples, desirable = plan
        out = super().finish_chat((where, samples), encoded)
        if out[0][0] is not None:
            self._labels.append((desirable, where))
        return out

    def encode_rows(self, rows) -> KTOChunk:
        self._labels = []
        chunk = super().encode_rows(rows)
        if len(self._labels) != len(chunk.lengths):
            raise PreprocessError(f"internal error: {len(chunk.lengths)} KTO samples but {len(self._labels)} labels")
        return KTOChunk(**vars(chunk), desirable=np.array([d for d, _ in self._labels], np.uint8),
                        rows_of=[w for _, w in self._labels])


@dataclass
class Couples:
    """Couples ready for the token store: samples ``2i`` (sample) and ``2i+1`` (its KL partner), flat."""

    input_ids: np.ndarray
    trained: np.ndarray
    lengths: np.ndarray


class KLCouples:
    """Encoded KTO samples (in input order, chunk by chunk) -> (sample, KL partner) couples.

    Sample ``i``'s partner is its prompt followed by sample ``i-1``'s completion (the first sample's: the last
    one's, known at :meth:`finish`, so the first couple is stored last). The prompt is everything before the
    first trained token; the completion the rest, with its trained mask.
    """

    def __init__(self, seq_length: int, pad_to_multiple_of: int = 1):
        self.budget, self.multiple = seq_length, pad_to_multiple_of
        self.first = None  # (ids, trained, label, row) of the first sample
        self.previous = None  # (ids, trained) of the last sample's completion
        self.seen = 0
        self.labels: list = []  # per stored sample: its label, PARTNER for a KL partner
        self.skipped, self.first_skipped = 0, None

    @staticmethod
    def _completion(ids: np.ndarray, trained: np.ndarray) -> int:
        return int(np.argmax(trained))  # a sample has a trained token (else it was skipped)

    def _couple(self, ids, trained, label: int, row: str, answer) -> list:
        start = self._completion(ids, trained)
        partner = (np.concatenate([ids[:start], answer[0]]), np.concatenate([np.zeros(start, np.uint8), answer[1]]))
        padded = sum(-(-len(x) // self.multiple) * self.multiple for x in (ids, partner[0]))
        if padded > self.budget:
            self.skipped += 1
            self.first_skipped = self.first_skipped or f"{row} ({padded} tokens with its KL partner)"
            return []
        self.labels += [label, PARTNER]
        return [(ids, trained), partner]

    @staticmethod
    def _flat(couples: list) -> Couples:
        if not couples:
            return Couples(np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(0, np.int32))
        return Couples(np.concatenate([i for i, _ in couples]).astype(np.int32),
                       np.concatenate([t for _, t in couples]).astype(np.uint8),
                       np.array([len(i) for i, _ in couples], np.int32))

    def add(self, chunk: KTOChunk) -> Couples:
        """The couples of ``chunk``'s samples that can be formed now."""
        out = []
        offsets = np.concatenate([[0], np.cumsum(chunk.lengths)])
        for n, (label, row) in enumerate(zip(chunk.desirable, chunk.rows_of)):
            ids = np.asarray(chunk.input_ids[offsets[n]:offsets[n + 1]])
            trained = np.asarray(chunk.trained[offsets[n]:offsets[n + 1]])
            if self.first is None:
                self.first = (ids, trained, int(label), row)
            else:
                out += self._couple(ids, trained, int(label), row, self.previous)
            start = self._completion(ids, trained)
            self.previous = (ids[start:], trained[start:])
            self.seen += 1
        return self._flat(out)

    def finish(self, where: str) -> Couples:
        """The first sample's couple (its partner takes the last completion)."""
        if self.seen == 1:
            raise PreprocessError(f"{where}: one usable KTO row: its KL partner needs another row's completion "
                                  "(KTO estimates its reference point from mismatched prompt/completion pairs); "
                                  "give at least two rows")
        if self.first is None:
            return self._flat([])
        ids, trained, label, row = self.first
        return self._flat(self._couple(ids, trained, label, row, self.previous))

    def sample_labels(self) -> np.ndarray:
        """Per stored sample (couples in store order): 1 desirable, 0 undesirable, -1 a KL partner."""
        return np.array(self.labels, np.int32)

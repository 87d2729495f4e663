"""Preference pairs: one row -> a chosen and a rejected sample that share the prompt.

Handlers (MindSpeed-LLM's names; LLaMA-Factory's ranking format):

* ``AlpacaStylePairwiseHandler``: ``instruction`` (+ ``input``), optional ``system`` and
  ``history``, and the two answers ``chosen`` / ``rejected``.
* ``SharegptStylePairwiseHandler``: ``conversations`` ending with the user's turn, and
  ``chosen`` / ``rejected``, each a message ``{"from": "gpt", "value": ...}`` or a string.

Both samples go through the same template as supervised data. The pair is the unit of
packing (``preprocess_data.py --pack --neat-pack``): the packer places pair lengths, so
chosen and rejected are always neighbours in one pack, segment ``2k-1`` the chosen and
``2k`` the rejected answer of the pack's ``k``-th pair::

    attention_mask  1 1 1 1 1  2 2 2 2  3 3 3  4 4 4 4  0 0     (chosen 1, rejected 2, chosen 3, ...)

A pair is never truncated (a one-sided cut would bias the preference): a pair longer than
``--seq-length`` (its padded lengths under ``--pad-to-multiple-of``) is dropped and counted,
and so is a pair whose answers are identical (it cannot teach a preference; warned).
A row without ``chosen`` or ``rejected`` is a :class:`RowError`.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from mindspeed_pack.data.errors import RowError
from mindspeed_pack.data.handlers import ALPACA, ASSISTANT, PAIRWISE_BASE, SampleEncoder
from mindspeed_pack.data.readers import not_an_object

SKIP_TOO_LONG = "pair longer than --seq-length"
SKIP_IDENTICAL = "identical chosen and rejected"
MISSING_ANSWER = "missing chosen/rejected"


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


class PairwiseEncoder(SampleEncoder):
    """Row -> (chosen, rejected) samples; ``seq_length`` bounds the pair, never cuts it."""

    def __init__(self, handler: str, tokenizer, template, map_keys: dict, seq_length: Optional[int],
                 append_eod: bool, pad_to_multiple_of: int = 1, skip_bad_rows: bool = False):
        super().__init__(PAIRWISE_BASE[handler], tokenizer, template, map_keys, None, append_eod, skip_bad_rows)
        self.pair_handler, self.budget, self.multiple = handler, seq_length, pad_to_multiple_of

    def _answer(self, row: dict, key: str, where: str) -> str:
        column = self.keys[key]
        value = row.get(column)
        if isinstance(value, dict):  # a ShareGPT message
            value = value.get(self.keys.get("content_tag", "value"), value.get("content"))
        if not isinstance(value, str):
            got = "missing" if value is None else f"a {type(value).__name__}"
            raise RowError(f"{where}: field {column!r} (--map-keys {key}) must be the {key} answer (a string or a "
                           f"message with {self.keys.get('content_tag', 'value')!r}), got {got}; "
                           f"the row has: {', '.join(map(str, row)) or 'no fields'}", MISSING_ANSWER)
        return value

    def plan_row(self, row, where: str, texts: list):
        """((chosen plan, rejected plan), None) or (None, skip reason)."""
        if isinstance(row, RowError):  # the reader could not parse it
            raise row
        if not isinstance(row, dict):
            raise not_an_object(where, row)
        chosen, rejected = self._answer(row, "chosen", where), self._answer(row, "rejected", where)
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
            plans.append(plan)
        return tuple(plans), None

    def finish_row(self, plan, encoded: list):
        """([chosen, rejected], None, False), or ([], skip reason, False): a pair is never truncated."""
        samples = []
        for side in plan:
            sample, skip, _ = self.finish(side, encoded)
            if sample is None:
                return [], skip, False
            samples.append(sample)
        padded = sum(-(-len(s[0]) // self.multiple) * self.multiple for s in samples)
        if self.budget is not None and padded > self.budget:
            return [], SKIP_TOO_LONG, False
        return samples, None, False

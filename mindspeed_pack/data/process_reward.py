"""Process reward data: one row -> one sample whose step tags carry the steps' labels.

``AlpacaStyleProcessRewardHandler`` (MindSpeed-LLM's name; Math-Shepherd's shape): ``input`` is the
question and a step-by-step solution with a step tag (``--placeholder-token``, default ``ки``) after
each step; ``value`` lists the steps' labels, each one of ``--reward-tokens`` (default ``+ -``: the
step is right, wrong)::

    {"input": "Tom has 3 apples ... Step 1: 3 + 2 = 5 ки\nStep 2: 5 x 2 = 12 ки", "value": ["+", "-"]}

The text is tokenised whole, with no template and no special tokens (as MindSpeed-LLM does); the tag
and every reward token must each be one token of the tokenizer. A sample is stored as its ids, with
the label's token id at each tag (unshifted: position ``t`` of a tag is where the model's logits are
read, restricted to the reward tokens) and -100 elsewhere::

    input_ids   q0 q1 s0 s1 ки  s2 ки        labels   -  -  -  -  +  -  -        (ids of "+" and "-")

A row whose text holds no tag, not as many tags as labels, a label that is not a reward token, or a
tag before any text is a :class:`RowError` naming the row (``--skip-bad-rows``: skipped and counted);
a sample longer than ``--seq-length`` is dropped and counted (never cut: its later steps would lose
their tags). In the token store a tag's trained code is ``STEP_CODE + k`` for the ``k``-th reward
token; the pack writer turns it into that token's id (:func:`mindspeed_pack.datasets.pack_writer.label_values`).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from mindspeed_pack.data.errors import BAD_MISSING_FIELD, BAD_TYPE, PreprocessError, RowError
from mindspeed_pack.data.handlers import SampleEncoder
from mindspeed_pack.data.readers import not_an_object

STEP_CODE = 2  # trained codes 0 (untrained) and 1 (the token itself) are every handler's; 2 + k: reward token k
DEFAULT_PLACEHOLDER = "ки"  # Math-Shepherd's step tag
DEFAULT_REWARD_TOKENS = ("+", "-")
SKIP_TOO_LONG = "process reward sample longer than --seq-length"
BAD_STEPS = "step tags and labels disagree"


def single_token_id(tokenizer, token: str, flag: str) -> int:
    """The id of ``token``, which the tokenizer must encode as exactly one token (MindSpeed-LLM's rule)."""
    ids = tokenizer.encode(token)
    if len(ids) != 1:
        raise PreprocessError(f"{flag} {token!r} is {len(ids)} tokens {ids} for tokenizer {tokenizer.name}, not one: "
                              "add it to the tokenizer as a token of its own, or choose a token it has")
    return int(ids[0])


class ProcessRewardEncoder(SampleEncoder):
    """Row -> (ids, trained codes) with each step tag coded by its label (see the module docstring)."""

    def __init__(self, handler: str, tokenizer, map_keys: dict, seq_length: Optional[int], placeholder: str,
                 reward_tokens, skip_bad_rows: bool = False):
        super().__init__(handler, tokenizer, None, map_keys, seq_length, False, skip_bad_rows)
        reward_tokens = tuple(reward_tokens)
        if len(reward_tokens) < 2 or len(set(reward_tokens)) != len(reward_tokens):
            raise PreprocessError(f"--reward-tokens {' '.join(reward_tokens)}: give two or more distinct labels "
                                  "(e.g. + -: right, wrong)")
        if placeholder in reward_tokens:
            raise PreprocessError(f"--placeholder-token {placeholder!r} is also one of --reward-tokens")
        self.placeholder, self.reward_tokens = placeholder, reward_tokens
        self.tag_id = single_token_id(tokenizer, placeholder, "--placeholder-token")
        self.reward_token_ids = tuple(single_token_id(tokenizer, t, "--reward-tokens") for t in reward_tokens)

    def layout(self) -> dict:
        """What the sidecar records of the step tags (``--stage prm`` reads it)."""
        return {"placeholder_token": self.placeholder, "placeholder_id": self.tag_id,
                "reward_tokens": list(self.reward_tokens), "reward_token_ids": list(self.reward_token_ids)}

    def plan_row(self, row, where: str, texts: list):
        if isinstance(row, RowError):  # the reader could not parse it
            raise row
        if not isinstance(row, dict):
            raise not_an_object(where, row)
        text = self._field(row, "input", where, required=True)
        labels = self._field(row, "value", where, required=True, kind=list)
        steps = text.count(self.placeholder)
        if steps == 0:
            raise RowError(f"{where}: field {self.keys['input']!r} holds no step tag {self.placeholder!r} "
                           "(--placeholder-token): a process reward row ends every step with it", BAD_MISSING_FIELD)
        if steps != len(labels):
            raise RowError(f"{where}: field {self.keys['input']!r} has {steps} step tags {self.placeholder!r} but "
                           f"field {self.keys['value']!r} {len(labels)} labels: one label per step", BAD_STEPS)
        unknown = [label for label in labels if label not in self.reward_tokens]
        if unknown:
            raise RowError(f"{where}: field {self.keys['value']!r} holds {unknown[0]!r}; each label is one of "
                           f"--reward-tokens {' '.join(self.reward_tokens)}", BAD_TYPE)
        texts.append(text)
        return (len(texts) - 1, [self.reward_tokens.index(label) for label in labels], where), None

    def finish_row(self, plan, encoded: list):
        """([(ids, codes)], None, False), or ([], skip reason, False)."""
        index, classes, where = plan
        ids = list(encoded[index])
        tags = [i for i, t in enumerate(ids) if t == self.tag_id]
        problem = None
        if len(tags) != len(classes):
            problem = (f"{where}: the text holds {len(classes)} step tags {self.placeholder!r}, but its tokens hold "
                       f"{len(tags)} tag ids {self.tag_id}: the tokenizer merged a tag with the text beside it; add "
                       "the tag to the tokenizer as a special token, or put a space or newline around it")
        elif tags[0] == 0:
            problem = f"{where}: the text starts with a step tag {self.placeholder!r}: the first step has no text"
        if problem:
            if not self.skip_bad_rows:
                raise RowError(problem, BAD_STEPS)
            return [], BAD_STEPS, False
        if self.seq_length is not None and len(ids) > self.seq_length:
            return [], SKIP_TOO_LONG, False
        codes = np.zeros(len(ids), np.uint8)
        codes[tags] = STEP_CODE + np.asarray(classes, np.uint8)
        return [(ids, codes.tolist())], None, False

"""Rollouts given as text, tokenised through preprocessing's template path (``--prompt-type``, ``hf`` too).

Exact ids (``prompt_ids``/``response_ids``) are the recommended rollout format: re-tokenising
text need not give back the ids the engine sampled (a BPE merge across the prompt/response
boundary, a stop token the engine left out), and then the log-probs and the step are those of
other tokens. Text is accepted for rollouts that only exist as text (logged chats, another
tokenizer's engine); a row without ``prompt_ids`` may hold instead::

    prompt, response          strings (optional system, query): one user turn and its answer
    messages, response        OpenAI messages (role/content; system first) and the final answer

rendered exactly as ``preprocess_data.py`` renders an Alpaca or ShareGPT (OpenAI keys) row with
the same ``--prompt-type`` and ``--tokenizer-name-or-path``, never truncated. The answer turn,
up to the template's end-of-turn token, is ``response_ids``; everything before it is
``prompt_ids``. The row keeps its text and gains both id lists and ``tokenized_from`` (template,
tokenizer) so ``--stage score`` writes what was trained on; the log says how many rows were tokenised.
"""
from __future__ import annotations

import logging
from typing import Optional

import numpy as np

from mindspeed_pack.data.errors import PreprocessError, RowError
from mindspeed_pack.datasets.packed_dataset import DataError

log = logging.getLogger(__name__)

TEXT_FIELDS = ("prompt", "messages")  # a row with one of these and no prompt_ids is a text rollout
_OPENAI_KEYS = {"messages": "messages", "role": "role", "content": "content", "user": "user",
                "assistant": "assistant", "system_tag": "system", "tool": "tool"}


def is_text_rollout(row) -> bool:
    return isinstance(row, dict) and row.get("prompt_ids") is None and any(row.get(f) is not None for f in TEXT_FIELDS)


class RolloutTokenizer:
    """Text rollout rows -> rows with exact ``prompt_ids``/``response_ids``, under one template."""

    def __init__(self, tokenizer_path: str, prompt_type: str):
        from mindspeed_pack.data.handlers import ALPACA, SHAREGPT, resolve_map_keys
        from mindspeed_pack.data.tokenizer import TokenizerSpec, load_tokenizer
        from mindspeed_pack.datasets.preprocess import EncoderConfig

        spec = TokenizerSpec("PretrainedFromHF", tokenizer_path)
        tokenizer = load_tokenizer(spec)
        self.record = {"prompt_type": prompt_type, "tokenizer": tokenizer_path}
        self.encoders = {}
        for handler, keys in ((ALPACA, {"prompt": "prompt", "response": "response"}), (SHAREGPT, _OPENAI_KEYS)):
            config = EncoderConfig(handler=handler, tokenizer=spec, prompt_type=prompt_type, templates_path=None,
                                   map_keys=resolve_map_keys(handler, keys)[0], seq_length=None, append_eod=False)
            self.encoders[handler] = config.build(tokenizer)
        self.count = 0

    @classmethod
    def from_args(cls, args, where: str) -> "RolloutTokenizer":
        """The tokenizer of ``--tokenizer-name-or-path`` and ``--prompt-type``; ``where`` names the text row."""
        if not args.tokenizer_name_or_path or not args.prompt_type:
            raise DataError(f"{where}: a text rollout (no 'prompt_ids') is tokenised with --tokenizer-name-or-path "
                            "and --prompt-type (a template name, or hf for the tokenizer's chat template); give both, "
                            "or give exact 'prompt_ids'/'response_ids' (recommended)")
        try:
            return cls(args.tokenizer_name_or_path, args.prompt_type)
        except PreprocessError as exc:
            raise DataError(f"--prompt-type {args.prompt_type} / --tokenizer-name-or-path "
                            f"{args.tokenizer_name_or_path}: {exc}") from None

    def tokenize(self, row: dict, where: str) -> dict:
        """``row`` with ``prompt_ids``, ``response_ids`` and ``tokenized_from`` added (a new dict)."""
        from mindspeed_pack.data.handlers import ALPACA, SHAREGPT

        response = row.get("response")
        if not isinstance(response, str) or not response:
            raise DataError(f"{where}: field 'response' must be a non-empty string (the sampled answer) in a text "
                            f"rollout, got {type(response).__name__ if response is not None else 'nothing'}")
        if row.get("messages") is not None:
            messages = row["messages"]
            if not isinstance(messages, list):
                raise DataError(f"{where}: field 'messages' must be a list of OpenAI messages, got "
                                f"{type(messages).__name__}")
            handler, source = SHAREGPT, {"messages": [*messages, {"role": "assistant", "content": response}]}
        else:
            handler, source = ALPACA, row
        encoder = self.encoders[handler]
        try:
            if encoder.chat is not None:  # --prompt-type hf: the last sample holds the final answer
                samples = encoder.encode_chat_row(source, where)
                sample, skip = (samples[-1], None) if samples else (None, "no answer to train")
            else:
                sample, skip, _ = encoder.encode_row(source, where)
        except (RowError, PreprocessError) as exc:
            raise DataError(str(exc)) from None
        if sample is None:
            raise DataError(f"{where}: the text rollout gives no sample under --prompt-type "
                            f"{self.record['prompt_type']} ({skip})")
        ids, trained = np.asarray(sample[0]), np.asarray(sample[1]).astype(bool)
        last = int(np.flatnonzero(trained)[-1])  # the answer: the last run of trained tokens
        first = last
        while first > 0 and trained[first - 1]:
            first -= 1
        self.count += 1
        return {**row, "prompt_ids": ids[:first].tolist(), "response_ids": ids[first:last + 1].tolist(),
                "tokenized_from": self.record}


def tokenize_text_rows(rows, args, name: str):
    """``(where, row)`` pairs with every text rollout tokenised (the tokenizer built at the first one)."""
    tokenizer: Optional[RolloutTokenizer] = None
    for where, row in rows:
        if is_text_rollout(row):
            tokenizer = tokenizer or RolloutTokenizer.from_args(args, where)
            row = tokenizer.tokenize(row, where)
        yield where, row
    if tokenizer is not None:
        log.info("%s: %d text rollouts tokenised with --prompt-type %s and tokenizer %s (exact ids are "
                 "recommended: see docs/rl.md)", name, tokenizer.count, tokenizer.record["prompt_type"],
                 tokenizer.record["tokenizer"])

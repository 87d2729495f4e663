"""Which head the run's model is built with: a language model's output layer, or an outcome reward model's
scalar score head (``args.reward_head``, :mod:`mindspeed_pack.model.score_head`).

``--stage orm`` trains a reward model: from a language model's weights (a fresh, seeded head) or from a
reward model's. ``--stage score`` scores with what ``--load`` holds: a reward model writes each rollout's
reward. Every other stage builds a language model (a reward model's checkpoint is then refused at load,
naming the stage). What ``--load`` holds is known before the model is built: a Hugging Face config.json's
architecture (``*ForSequenceClassification``, read by :mod:`.hf_flags`) or a Megatron checkpoint's recorded
arguments (:func:`.checkpoint_flags.read_record`), with the pad token the reward is pooled by
(``reward_pad_token_id``). Neither is a flag: the stage and the loaded model decide them.
"""
from __future__ import annotations

import logging
from typing import Optional

from mindspeed_pack.config import checkpoint_flags
from mindspeed_pack.config.errors import ArgumentError
from mindspeed_pack.convert import megatron_layout as layout

log = logging.getLogger(__name__)

REWARD_STAGE = "orm"  # trains the score head
SCORING_STAGE = "score"  # runs whichever model --load holds


def loaded_reward_model(args) -> tuple[bool, Optional[int]]:
    """(whether ``--load`` holds a reward model, the pad token its reward is pooled by)."""
    if not args.load:
        return False, None
    if args.load_format == "hf":  # hf_flags filled these from config.json
        return bool(getattr(args, "reward_head", False)), getattr(args, "reward_pad_token_id", None)
    try:
        found = checkpoint_flags.read_record(args)
    except ArgumentError:  # unreadable here: --load reports it with the file and what to do
        found = None
    recorded = layout.args_of(found[1]) if found else {}
    return bool(recorded.get("reward_head")), recorded.get("reward_pad_token_id")


def apply(args) -> None:
    """Set ``args.reward_head`` and ``args.reward_pad_token_id`` for the stage and the loaded model."""
    reward, pad = loaded_reward_model(args)
    if args.stage == REWARD_STAGE:  # under LoRA the head trains in full beside the adapters (lora.TRAINED_IN_FULL)
        args.reward_head = True
        args.reward_pad_token_id = pad if reward else None  # a fresh head: the stage takes the data's pad token
    elif args.stage == SCORING_STAGE:
        args.reward_head, args.reward_pad_token_id = reward, pad
        if reward:
            log.info("--load %s is an outcome reward model: --stage score writes each rollout's reward", args.load)
    else:
        args.reward_head, args.reward_pad_token_id = False, None

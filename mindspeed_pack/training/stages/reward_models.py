"""Reward models on packed data: outcome (``--stage orm``) and process (``--stage prm``) reward models.

**Outcome reward model.** The model's output layer is a scalar score head (``args.reward_head``,
:mod:`mindspeed_pack.model.score_head`); it reads preference pairs packed as for DPO (segments ``2k-1``
chosen, ``2k`` rejected, :func:`~.sequences.pair_segments`). A sample's reward is the head at its last
token that is not the pad token (:func:`mindspeed_pack.packing.segments.reward_positions`: its last
token, as ms-swift's Megatron reward trainer reads it from ``cu_seqlens``, and what transformers'
``*ForSequenceClassification`` pools, ``pad_token_id`` being that pad token). Per pair (TRL's RewardTrainer)::

    -log sigmoid(r_c - r_r - m) + c (r_c + r_r)^2    (m: the pair's margin column, 0 without; c = --center-rewards-coefficient)

summed over the global batch's pairs and divided by their number, whatever the packing or the DP/PP/CP
layout (under CP the rewards are summed over the group, as DPO's log-probs, and the pairs counted once).
Logged: ``rewards/chosen``, ``rewards/rejected`` (means), ``rewards/accuracies`` (r_c > r_r) and
``rewards/margins`` (r_c - r_r). The pad token comes with the model: a reward model's own, else the
data's (its sidecar's ``pad_id``); checkpoints record it and ``--save-hf`` writes it as ``pad_token_id``.

**Process reward model.** A language model (its LM head kept) on process reward samples
(:mod:`mindspeed_pack.data.process_reward`: a label at each step tag, unshifted). At each tag the
logits of the reward tokens (``+``, ``-``; from the sidecar) are a K-way softmax, trained with cross
entropy against the step's label (MindSpeed-LLM's PRM loss with ``--reward-tokens``), averaged over the
global batch's steps; ``accuracy`` is the steps whose largest reward-token logit is their label's.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps

from mindspeed_pack.datasets.packed_dataset import DataError
from mindspeed_pack.packing import context_parallel as cp_view
from mindspeed_pack.packing.segments import IGNORE_INDEX, PackedBatch, reward_positions
from mindspeed_pack.training.stages import data_layouts
from mindspeed_pack.training.stages.sequences import counts_here, pair_segments, whole_sequence_sums

log = logging.getLogger(__name__)

ORM_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


def bradley_terry_losses(chosen: torch.Tensor, rejected: torch.Tensor, center: float = 0.0,
                         margin=None) -> torch.Tensor:
    """Per-pair loss of a reward model: ``-log sigmoid(r_c - r_r - margin) + center (r_c + r_r)^2``."""
    losses = -F.logsigmoid(chosen - rejected - (0.0 if margin is None else margin))
    if center:
        losses = losses + center * (chosen + rejected) ** 2
    return losses


def _local_share(values: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """Per-token values of a micro-batch [1, T] as this rank holds its tokens (its share over the micro-batch's
    CP group: megatron's, or the one the dynamic plan chose)."""
    values = values.reshape(1, -1).to(batch.loss_mask.device)
    if batch.local_cp_size is not None:
        cp, rank = batch.local_cp_size, batch.cp_rank
    else:
        cp, rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    return cp_view.rank_share(values, batch, cp, rank) if cp > 1 else values


def _sidecar_layouts(trainer) -> list:
    return [(docs, (docs.meta or {}).get("layout") or {}) for docs in trainer.source.docs]


class OutcomeRewardStage:
    """``--stage orm``: a scalar head trained on preference pairs (see the module docstring)."""

    name = "orm"
    metric_names = ORM_METRICS
    normaliser = "preference pairs in the global batch"

    def __init__(self, args):
        self.args = args

    def batch_source(self, args):
        from mindspeed_pack.datasets.online_packing import batch_source

        return batch_source(args)  # whole units: one a document (packed at load time) or packs of them

    def setup(self, trainer) -> None:
        args = self.args
        pads = set()
        for docs, layout in _sidecar_layouts(trainer):
            data_layouts.check(self.name, docs.prefix, docs.meta)
            pads.add(layout.get("pad_id"))
        if args.reward_pad_token_id is None:  # a fresh head: the data's pad token, what the tokenizer pads with
            if len(pads) > 1:
                raise DataError(f"--stage orm: the data prefixes pad with different tokens {sorted(map(str, pads))}: "
                                "preprocess them with one tokenizer")
            pad = pads.pop() if pads else None
            args.reward_pad_token_id = None if pad is None else int(pad)
        log.info("orm: each sample's reward is read at its last token that is not the pad token %s (transformers' "
                 "pooling; the exported model's pad_token_id)", args.reward_pad_token_id)

    def prepare(self, trainer, batches, micro_batches, split, tokens_per_micro_batch):
        """Each micro-batch's reward tokens (this rank's share) and its pairs' margins (from the data, else 0).
        A dynamic context parallel row's sequences end with their CP pads (``pad_mask``): read before them."""
        pad = self.args.reward_pad_token_id
        for batch, mb in zip(batches, micro_batches):
            segments = mb["segment_ids"]
            if "pad_mask" in mb:
                segments = segments.masked_fill(mb["pad_mask"], 0)
            batch.reward_mask = _local_share(reward_positions(mb["input_ids"], segments, pad), batch)
            margins = mb.get("pair_margins")
            if margins is not None:
                pairs = sum(int(row.max()) // 2 for row in mb["segment_ids"])
                if len(margins) != pairs:
                    raise DataError(f"--stage orm: a micro-batch holds {pairs} pairs but {len(margins)} margins: the "
                                    "margins file belongs to other packs; re-run preprocess_data.py")
                margins = margins.to(batch.loss_mask.device, torch.float32)
            batch.pair_margins = margins
        return batches

    def count(self, batch: PackedBatch) -> torch.Tensor:
        """The pairs of ``batch``, counted once per CP group (on its first rank), as DPO counts them."""
        once = counts_here(batch)
        return torch.full((), len(pair_segments(batch)[0]) if once else 0, dtype=torch.int,
                          device=batch.loss_mask.device)

    def sequence_rewards(self, batch: PackedBatch, output_tensor: torch.Tensor) -> torch.Tensor:
        """[segments]: each sample's reward (the head at its reward token), over the whole CP group."""
        rewards = output_tensor.float().reshape(batch.reward_mask.shape)
        return whole_sequence_sums(rewards * batch.reward_mask, batch)

    def loss_func(self, batch: PackedBatch, output_tensor: torch.Tensor):
        rewards = self.sequence_rewards(batch, output_tensor)
        chosen, rejected = pair_segments(batch)
        rc, rr = rewards[chosen], rewards[rejected]
        losses = bradley_terry_losses(rc, rr, self.args.center_rewards_coefficient, batch.pair_margins)
        n = self.count(batch)
        once = float(counts_here(batch))  # reported once per CP group
        nf = n.to(torch.float32)
        with torch.no_grad():
            reports = {name: torch.stack([value.sum() * once, nf]) for name, value in (
                ("lm loss", losses), ("rewards/chosen", rc), ("rewards/rejected", rr),
                ("rewards/accuracies", (rc > rr).float()), ("rewards/margins", rc - rr))}
        return losses.sum(), n, reports


def vocab_columns(logits: torch.Tensor, token_ids) -> torch.Tensor:
    """``logits[..., token_ids]`` of vocab-parallel logits ``[..., V/TP]``, whole on every TP rank: the rank
    holding a column gives it, the others zero times one of theirs, summed over the group. Every rank's loss
    then depends on its logits (with a zero gradient where it holds no column), so every rank's backward runs
    the model's tensor-parallel collectives."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as tp_sum

    width = logits.shape[-1]
    tp = ps.get_tensor_model_parallel_world_size()
    start = ps.get_tensor_model_parallel_rank() * width if tp > 1 else 0
    columns = [logits[..., min(max(i - start, 0), width - 1)] * float(start <= i < start + width) for i in token_ids]
    out = torch.stack(columns, dim=-1)
    return tp_sum(out) if tp > 1 else out


def step_logits(batch: PackedBatch, logits: torch.Tensor, reward_token_ids) -> torch.Tensor:
    """[1, T, K]: the reward tokens' logits at every position of ``batch`` (read at its step tags)."""
    return vocab_columns(logits.float(), reward_token_ids).reshape(*batch.step_mask.shape, len(reward_token_ids))


class ProcessRewardStage:
    """``--stage prm``: a K-way classification of the reward tokens' logits at each step tag."""

    name = "prm"
    metric_names = ("accuracy",)
    normaliser = "step tags in the global batch"
    needs_logits = True  # the reward tokens' logits at the tags (vocab-parallel)

    def __init__(self, args):
        self.args = args
        self.reward_token_ids = None

    def batch_source(self, args):
        from mindspeed_pack.datasets.online_packing import batch_source

        if args.sequence_packing_scheduler == "default_dynamic_cp":
            raise DataError("--stage prm with --sequence-packing-scheduler default_dynamic_cp: the step labels are "
                            "laid out for the run's fixed context-parallel split; use none or dp_balanced")
        return batch_source(args)

    def setup(self, trainer) -> None:
        found = {}
        for docs, layout in _sidecar_layouts(trainer):
            data_layouts.check("prm", docs.prefix, docs.meta)
            steps = layout["step_tags"]
            found[docs.prefix] = tuple(steps["reward_token_ids"])
        if len(set(found.values())) > 1:
            raise DataError(f"--stage prm: the data prefixes label steps with different reward tokens {found}: "
                            "preprocess them with the same --reward-tokens and tokenizer")
        self.reward_token_ids = next(iter(found.values()))
        log.info("prm: each step tag classified among the logits of reward tokens %s", list(self.reward_token_ids))

    def prepare(self, trainer, batches, micro_batches, split, tokens_per_micro_batch):
        """Each micro-batch's steps: the label class at each tag (unshifted, as stored), this rank's share."""
        for batch, mb in zip(batches, micro_batches):
            labels = mb["labels"].reshape(1, -1)
            classes = torch.full_like(labels, -1)
            for k, token in enumerate(self.reward_token_ids):
                classes[labels == token] = k
            steps = labels != IGNORE_INDEX
            if bool((steps & (classes < 0)).any()):
                raise DataError(f"--stage prm: a label that is not a reward token {list(self.reward_token_ids)} "
                                "(the data is not process reward data)")
            batch.step_mask = _local_share(steps.float(), batch)
            batch.step_class = _local_share(classes.clamp(min=0).float(), batch).long()
        return batches

    def count(self, batch: PackedBatch) -> torch.Tensor:
        return batch.step_mask.sum().to(torch.int)

    def loss_func(self, batch: PackedBatch, output_tensor: torch.Tensor):
        logits = step_logits(batch, output_tensor, self.reward_token_ids)
        mask = batch.step_mask
        logp = torch.log_softmax(logits, dim=-1).gather(-1, batch.step_class.unsqueeze(-1)).squeeze(-1)
        loss = -(logp * mask).sum()
        count = self.count(batch)
        with torch.no_grad():
            correct = ((logits.argmax(-1) == batch.step_class).float() * mask).sum()
            n = count.to(torch.float32)
            reports = {"lm loss": torch.stack([loss.detach(), n]), "accuracy": torch.stack([correct, n])}
        return loss, count, reports

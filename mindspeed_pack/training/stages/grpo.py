"""Policy-gradient step on packed rollouts (``posttrain.py --stage grpo``): PPO-clip with given advantages.

Rollouts (:mod:`mindspeed_pack.datasets.rollouts`) are packed one per segment; the model's per-token
loss at the position that predicts response token ``j`` is ``-log pi(r_j)``, and the row holds
that token's old log-prob, reference log-prob and advantage at the same position. Per token::

    ratio = exp(logp - old)                     (old = logp.detach() when the file has none: ratio 1)
    pg    = max(-A ratio, -A clip(ratio, 1 - eps_low, 1 + eps_high))
    kl    = logp - ref (k1)  or  exp(ref - logp) - (ref - logp) - 1 (k3)     (--kl-coef > 0)
    loss  = pg + kl_coef kl - entropy_coef H            (H: the policy's entropy at that position)

Aggregated over the *global step* (each micro-batch returns (sum, count); megatron divides by
the step's total count, whatever the packing or DP/PP/CP layout, dynamic CP groups included):

* ``token-mean``: sum over trained tokens / trained tokens;
* ``seq-mean-token-mean``: sum over samples of the sample's token mean / samples with a trained token
  (a sample's mean needs one; TRL's ``grpo`` would count a fully masked sample as a zero);
* ``dr-grpo``: sum over samples of the sample's token sum / ``--seq-length`` / all samples (a fully masked
  rollout counts, as in Dr. GRPO): TRL's
  ``loss_type="dr_grpo"`` (a constant length normaliser, there ``max_completion_length``). Not
  verl's ``seq-mean-token-sum-norm``, which divides the summed token sums by the constant only
  (not by the samples), so its loss grows with the batch: that name is refused, not reinterpreted.
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state as ps

from mindspeed_pack.datasets.packed_dataset import DataError
from mindspeed_pack.packing import context_parallel as cp_view
from mindspeed_pack.packing.segments import PackedBatch
from mindspeed_pack.training.stages.sequences import counts_here, whole_sequence_sums

LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "dr-grpo")
GRPO_METRICS = ("pg loss", "clip fraction", "approx kl", "ratio mean", "ratio max", "response length")


def policy_losses(logp, old, adv, ref, clip_low: float, clip_high: float, kl_coef: float, kl_estimator: str):
    """(per-token loss, clipped [bool], ratio, pg loss, kl to the reference or None), all [1, T]."""
    ratio = torch.exp(logp - old)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    pg = torch.maximum(pg1, pg2)
    loss, kl = pg, None
    if kl_coef:
        diff = ref - logp
        kl = -diff if kl_estimator == "k1" else torch.exp(diff) - diff - 1
        loss = pg + kl_coef * kl
    return loss, pg2 > pg1, ratio, pg, kl


def vocab_parallel_logp_entropy(logits: torch.Tensor, target: torch.Tensor):
    """(log-prob of ``target``, entropy) per position from vocab-parallel logits ``[..., V/TP]``,
    the sums over the vocabulary all-reduced over the TP group (the backward stays per shard)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as tp_sum

    logits = logits.float()
    logp = -vocab_parallel_cross_entropy(logits.clone(), target)  # it works in place on the logits it is given
    top = logits.detach().max(-1, keepdim=True).values
    if ps.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    shifted = logits - top
    exp = torch.exp(shifted)
    total = tp_sum(exp.sum(-1, keepdim=True))
    entropy = torch.log(total) - tp_sum((exp * shifted).sum(-1, keepdim=True)) / total
    return logp, entropy.squeeze(-1)


def trained_samples(batch: PackedBatch) -> torch.Tensor:
    """[segments] bool: the samples of ``batch`` with a trained token (on any CP rank)."""
    return (batch.segment_labels > 0) & (whole_sequence_sums(batch.loss_mask, batch) > 0)


def aggregate(per_token: torch.Tensor, batch: PackedBatch, mode: str, norm: float) -> torch.Tensor:
    """Sum of ``per_token`` [1, T] over ``batch``'s trained tokens under ``--loss-agg mode`` (the
    trainer divides it by the step's total :func:`normaliser_count`).

    Under context parallelism each rank holds a zigzag share of every sample: token sums are
    this rank's share (the DP x CP reduction adds them up); a sample's mean needs its whole sum
    and count (reduced over the micro-batch's CP group: megatron's, or under dynamic CP the row's own),
    so every rank of that group holds the same per-sample terms, whose backward carries that rank's share of
    the gradient (they are counted on the group's first rank only: :func:`counts_here`)."""
    mask = batch.loss_mask
    if mode == "token-mean":
        return (per_token * mask).sum()
    sums, counts = whole_sequence_sums(per_token * mask, batch), whole_sequence_sums(mask, batch)
    samples = (batch.segment_labels > 0) & (counts > 0)
    per_sample = sums / counts.clamp(min=1) if mode == "seq-mean-token-mean" else sums / norm
    return per_sample[samples].sum()


def normaliser_count(batch: PackedBatch, mode: str) -> torch.Tensor:
    """``batch``'s share of the step's normaliser under ``--loss-agg mode``: its trained tokens (this rank's share);
    under ``seq-mean-token-mean`` its samples with a trained token (a sample's mean needs one); under ``dr-grpo``
    every sample, trained token or not, as Dr. GRPO and TRL divide by all rollouts (samples: each once, on its CP
    group's first rank)."""
    if mode == "token-mean":
        return batch.loss_mask.sum().to(torch.int)
    once = counts_here(batch)
    counted = (batch.segment_labels > 0) if mode == "dr-grpo" else trained_samples(batch)
    return (counted.sum() * int(once)).to(torch.int)


class GRPOStage:
    name = "grpo"
    max_metrics = ("ratio max",)  # reduced by MAX over micro-batches and ranks (the trainer)

    def __init__(self, args):
        if args.loss_agg not in LOSS_AGGS:
            raise DataError(f"--loss-agg {args.loss_agg!r}: one of {', '.join(LOSS_AGGS)}")
        if len(args.clip_ratio) > 2 or not 0 < args.clip_ratio[0] < 1 or not 0 < args.clip_ratio[-1]:
            raise DataError(f"--clip-ratio {' '.join(map(str, args.clip_ratio))}: give eps, or eps_low eps_high "
                            "(0 < eps_low < 1, eps_high > 0)")
        self.args = args
        low, high = (list(args.clip_ratio) + list(args.clip_ratio))[:2]
        self.clip_low, self.clip_high = float(low), float(high)
        # the entropy needs the full logits (the trainer then hands loss_func them instead of the per-token loss)
        self.needs_logits = bool(args.entropy_coef) or bool(getattr(args, "log_entropy", False))
        self.metric_names = GRPO_METRICS + (("ref kl",) if args.kl_coef else ()) + \
            (("entropy",) if self.needs_logits else ())
        self.normaliser = {"token-mean": "trained response tokens"}.get(args.loss_agg, "samples") + \
            " in the global batch"

    def batch_source(self, args):
        from mindspeed_pack.datasets.rollouts import RolloutBatchSource

        return RolloutBatchSource(need_advantages=True)

    def setup(self, trainer) -> None:
        source = trainer.source
        if self.args.kl_coef and any(r.ref_logprobs is None for r in source.rollouts):
            where = next(r.where for r in source.rollouts if r.ref_logprobs is None)
            raise DataError(f"{where}: --kl-coef {self.args.kl_coef} needs 'ref_logprobs' in every rollout (score "
                            "them with posttrain.py --stage score --score-field ref_logprobs)")
        # a row's ratio must not depend on its pack-mates: old log-probs in every rollout or in none
        given = [r for r in source.rollouts if r.old_logprobs is not None]
        if given and len(given) < len(source.rollouts):
            where = next(r.where for r in source.rollouts if r.old_logprobs is None)
            raise DataError(f"{where}: field 'old_logprobs' is missing, but {given[0].where} has it: give it in every "
                            "rollout (posttrain.py --stage score --score-field old_logprobs writes it for all) or in "
                            "none (the ratio is then 1: an on-policy step)")

    def count(self, batch: PackedBatch) -> torch.Tensor:
        return normaliser_count(batch, self.args.loss_agg)

    def prepare(self, trainer, batches, micro_batches, split, tokens_per_micro_batch):
        """Each micro-batch's per-token fields, as this rank holds its tokens: its share of the row under the
        row's CP split (megatron's group, or under dynamic CP the row's own; on one rank the whole row)."""
        for batch, mb in zip(batches, micro_batches):
            if batch.local_cp_size is not None:
                cp, cp_rank = batch.local_cp_size, batch.cp_rank
            else:
                cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
            for field in ("old_logprobs", "ref_logprobs", "advantages"):
                value = mb.get(field)
                if value is not None:
                    value = value.reshape(1, -1).to(batch.loss_mask.device)
                    if cp > 1:
                        value = cp_view.rank_share(value, batch, cp, cp_rank)
                setattr(batch, field, value)
        return batches

    def loss_func(self, batch: PackedBatch, output_tensor: torch.Tensor):
        args = self.args
        mask = batch.loss_mask
        entropy = None
        if self.needs_logits:
            logp, entropy = vocab_parallel_logp_entropy(output_tensor, batch.target.reshape(output_tensor.shape[:-1]))
            logp, entropy = logp.reshape(mask.shape), entropy.reshape(mask.shape)
        else:
            logp = -output_tensor.float().reshape(mask.shape)
        old = logp.detach() if batch.old_logprobs is None else batch.old_logprobs.to(logp.dtype)
        ref = None if batch.ref_logprobs is None else batch.ref_logprobs.to(logp.dtype)
        adv = batch.advantages.to(logp.dtype)
        per_token, clipped, ratio, pg, kl = policy_losses(logp, old, adv, ref, self.clip_low, self.clip_high,
                                                          args.kl_coef, args.kl_estimator)
        if args.entropy_coef:
            per_token = per_token - args.entropy_coef * entropy
        loss, count = aggregate(per_token, batch, args.loss_agg, float(args.seq_length)), self.count(batch)
        with torch.no_grad():
            tokens = mask.sum()
            once = float(counts_here(batch))  # a CP group's samples are counted once
            samples = trained_samples(batch).sum().float() * once
            # token-mean: this rank's share; per-sample modes: the CP group's whole terms, on its first rank
            shown = loss.detach() * (once if args.loss_agg != "token-mean" else 1.0)
            log_ratio = old - logp
            reports = {
                "lm loss": torch.stack([shown, count.float()]),
                "pg loss": torch.stack([(pg * mask).sum(), tokens]),
                "clip fraction": torch.stack([(clipped.float() * mask).sum(), tokens]),
                "approx kl": torch.stack([((torch.exp(log_ratio) - log_ratio - 1) * mask).sum(), tokens]),
                "ratio mean": torch.stack([(ratio * mask).sum(), tokens]),
                "ratio max": torch.stack([ratio.masked_fill(mask == 0, -torch.inf).max(), (tokens > 0).float()]),
                "response length": torch.stack([tokens, samples]),
            }
            if kl is not None:
                reports["ref kl"] = torch.stack([(kl * mask).sum(), tokens])
            if entropy is not None:
                reports["entropy"] = torch.stack([(entropy * mask).sum(), tokens])
        return loss, count, reports

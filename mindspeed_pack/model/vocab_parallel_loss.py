"""megatron-core's unfused vocab-parallel cross-entropy, without its boolean-mask assignments.

When a micro-batch's logits fit their budget the model takes the unfused loss
(:func:`~.vocab_cross_entropy.loss_chunk`): the output layer once, then the cross-entropy of its
logits. megatron-core's ``vocab_parallel_cross_entropy`` clears the targets outside this rank's
vocabulary shard with ``target[mask] = 0`` and ``predicted[mask] = 0.0``: boolean-mask assignments, a
``nonzero`` each on a GPU (the host waits, twice per micro-batch). Here they are ``where``; the rest is
megatron-core's arithmetic in its order (max-shifted fp32 logits, reduced over the tensor-parallel group,
exp and softmax in place, ``softmax - onehot`` times the loss's gradient), so losses and gradients are
bit for bit megatron-core's (``tests/test_fused_loss.py``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, op, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, group):
        logits = logits.float()  # fp32 logits are shifted in place, as megatron-core does
        top = logits.max(dim=-1)[0]
        _all_reduce(top, dist.ReduceOp.MAX, group)
        logits -= top.unsqueeze(dim=-1)
        local = target - vocab_start
        owned = (local >= 0) & (local < logits.shape[-1])
        local = torch.where(owned, local, torch.zeros_like(local))
        picked = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1)
        picked = torch.where(owned, picked, torch.zeros_like(picked))
        _all_reduce(picked, dist.ReduceOp.SUM, group)
        torch.exp(logits, out=logits)
        sum_exp = logits.sum(dim=-1)
        _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
        loss = torch.log(sum_exp) - picked
        logits.div_(sum_exp.unsqueeze(dim=-1))  # the softmax, kept for the backward
        ctx.save_for_backward(logits, local, owned)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, owned = ctx.saved_tensors
        grad = softmax  # in place, as megatron-core does
        grad.scatter_add_(-1, local.unsqueeze(-1), -owned.to(grad.dtype).unsqueeze(-1))  # minus the target's one-hot
        grad.mul_(grad_loss.unsqueeze(dim=-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_start: int = 0,
                                 group=None) -> torch.Tensor:
    """Per-token ``-log softmax(logits)[target]`` over the vocabulary sharded across ``group``: ``logits``
    [..., V_local] this rank's rows ``[vocab_start, vocab_start + V_local)``, ``target`` [...] global ids.
    Returns fp32 [...]."""
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, group)

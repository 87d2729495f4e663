"""The output layer and the cross-entropy in one, chunked over tokens: no full fp32 logits ever exist.

megatron-core's path materialises the logits of the whole micro-batch (``4096 x 151936`` fp32 is
2.5 GB for a Qwen2.5 pack) and runs its softmax as separate passes over all of them. Here the
tokens are taken ``chunk`` at a time: the chunk's logits are computed, reduced to each token's
``logsumexp`` and target logit, and dropped; the backward recomputes them chunk by chunk (one
more matmul of the output layer) and applies ``softmax - onehot``. Per token it is the same
arithmetic as megatron's ``vocab_parallel_cross_entropy`` (logits in fp32 after the matmul,
max-shifted, summed over the tensor-parallel vocabulary shards), so the loss and gradients are
those of the unfused path; nothing waits on the device.

The one sum across chunks, the output layer's weight gradient, is kept in fp32 for a bf16/fp16 weight and
rounded to the weight's dtype once at the end; only each chunk's matmul result is rounded on its way in.
Summed in bf16, its error against fp64 grew with the number of chunks (7.7x the unfused path's at 2048
chunks; now 1.0-1.3x from 1 to 2048 chunks, issue 40). The cost is one fp32 buffer of the weight's shape,
4 x rows x hidden bytes (545 MB for Qwen2.5-0.5B's 151936 x 896, 2.2 GB for 7B's 152064 x 3584, over
TP), and the chunk's product in the weight's dtype while it is added. The input gradient and the
per-token losses are computed row by row: no sum across chunks.

**The weighted sum, its gradients formed in the forward** (:func:`linear_cross_entropy_sum`): a loss that is
``sum_i w_i * loss_i`` with token weights known before the forward (SFT's loss mask, or its per-sample
weights) has the gradient ``w_i * (softmax_i - onehot_i)`` times one scalar, the gradient the sum receives.
So the forward applies it to each chunk's logits while they exist (the same arithmetic as the backward,
``w_i`` in place of the incoming per-token gradient), keeps the input gradient and the weight gradient
(summed in fp32, rounded once), and the backward only multiplies them by that scalar: no recomputed logits,
one output-layer matmul less per step. The fp32 sum now exists during the forward instead of the backward;
from one to the other the loss holds the input gradient (tokens x hidden) and the weight gradient in the
weight's dtype. The input gradient is this vocabulary shard's share, summed over TP by the caller's
mapping, as the per-token form's. Losses whose per-token gradients are known only after the forward
(DPO, KTO, GRPO: sequence sums through a nonlinearity) keep the per-token form. An fp16 weight keeps it too:
the stored gradients would be rounded to fp16 before the loss scale reaches them.

Vocabulary rows at or past ``vocab_limit`` (padding to a multiple of ``--make-vocab-size-divisible-by``
x TP) take no part in the softmax: a model loaded from Hugging Face keeps transformers' numbers.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from mindspeed_pack.model.compiled import fused

# fp32 logits of one chunk of the fused loss stay below this many elements (512 MiB)
CHUNK_ELEMENTS = 1 << 27
# a micro-batch whose fp32 logits fit this many elements per rank (4 GiB) takes the unfused loss. Measured on an
# H200 (bench/bench_gpu_train.py --suite, docs/gpu.md): at Qwen2.5 shapes and 4096-token packs (2.3 GiB of
# logits) the unfused loss trained 19% faster at 0.5B and 41% at 1.5B, at the same peak memory within 1.5 GiB
UNFUSED_ELEMENTS = 1 << 30


def chunk_tokens(vocab_local: int, requested: Optional[int] = None) -> int:
    """Tokens per chunk: ``requested``, else as many as keep one chunk's fp32 logits under 512 MiB."""
    if requested:
        return int(requested)
    return max(1, CHUNK_ELEMENTS // max(1, vocab_local))


def loss_chunk(tokens: int, vocab_local: int, requested: Optional[int] = None) -> int:
    """Tokens per chunk of the fused loss for a micro-batch of ``tokens`` on this rank; 0 = megatron-core's
    unfused loss (the output layer's logits whole, then its vocab-parallel cross-entropy).

    ``requested`` (``--cross-entropy-chunk-size``) is kept. By default the path is chosen by cost: the fused
    loss makes its passes chunk by chunk (and, for a per-token loss, computes the output layer's matmul again in
    the backward) and pays only when the logits would take too much memory, so the unfused loss runs while the
    micro-batch's fp32 logits fit 4 GiB per rank (:data:`UNFUSED_ELEMENTS`), the chunked loss beyond it."""
    if requested is not None:
        return int(requested)
    return 0 if tokens * vocab_local <= UNFUSED_ELEMENTS else chunk_tokens(vocab_local)


def _reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, invalid_from: int) -> torch.Tensor:
    """fp32 logits of a chunk, this shard's padded vocabulary rows at -inf (never the max: real rows exist)."""
    logits = torch.matmul(hidden, weight.t()).float()
    if invalid_from < logits.shape[-1]:
        logits[:, invalid_from:] = float("-inf")
    return logits


@fused
def _shifted_stats(logits: torch.Tensor, top: torch.Tensor, local_target: torch.Tensor, owned: torch.Tensor):
    """(target logit - max, sum of exp(logit - max)) per token: one pass over the chunk's logits."""
    shifted = logits - top[:, None]
    picked = shifted.gather(1, local_target[:, None])[:, 0]
    return torch.where(owned, picked, torch.zeros_like(picked)), shifted.exp().sum(dim=-1)


@fused
def _logits_grad(logits: torch.Tensor, lse: torch.Tensor, local_target: torch.Tensor, owned: torch.Tensor,
                 grad_loss: torch.Tensor, dtype_like: torch.Tensor) -> torch.Tensor:
    """``(softmax - onehot(target)) * grad`` in the weight's dtype: one pass over the chunk's logits."""
    probs = (logits - lse[:, None]).exp()
    onehot = torch.zeros_like(probs).scatter_(1, local_target[:, None], owned.to(probs.dtype)[:, None])
    return ((probs - onehot) * grad_loss[:, None]).to(dtype_like.dtype)


def _chunk_loss(logits: torch.Tensor, local_target: torch.Tensor, owned: torch.Tensor, group) -> tuple:
    """(per-token loss, logsumexp) of a chunk's logits over the vocabulary of every shard of ``group``."""
    top = _reduce(logits.max(dim=-1).values, dist.ReduceOp.MAX, group)
    picked, sum_exp = _shifted_stats(logits, top, local_target, owned)
    picked = _reduce(picked, dist.ReduceOp.SUM, group)
    log_sum = torch.log(_reduce(sum_exp, dist.ReduceOp.SUM, group))
    return log_sum - picked, log_sum + top


def _add_weight_grad(grad_weight: Optional[torch.Tensor], g: torch.Tensor, h: torch.Tensor) -> None:
    """``grad_weight += g.T @ h`` (nothing for a frozen weight): in fp32 the product is summed in place; for a
    bf16/fp16 weight the product is rounded to its dtype once (fp32 inside the matmul), the running sum never."""
    if grad_weight is None:
        return
    if grad_weight.dtype == g.dtype:
        grad_weight.addmm_(g.t(), h)
    else:
        grad_weight.add_(torch.matmul(g.t(), h))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, vocab_start, invalid_from, chunk, group):
        t = hidden.shape[0]
        vocab_local = weight.shape[0]
        lse = torch.empty(t, dtype=torch.float32, device=hidden.device)
        loss = torch.empty(t, dtype=torch.float32, device=hidden.device)
        local_target = target - vocab_start
        owned = (local_target >= 0) & (local_target < vocab_local)
        local_target = torch.where(owned, local_target, torch.zeros_like(local_target))
        for start in range(0, t, chunk):
            end = min(t, start + chunk)
            logits = _chunk_logits(hidden[start:end], weight, invalid_from)
            loss[start:end], lse[start:end] = _chunk_loss(logits, local_target[start:end], owned[start:end], group)
        ctx.save_for_backward(hidden, weight, local_target, owned, lse)
        ctx.chunk, ctx.invalid_from = chunk, invalid_from
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, local_target, owned, lse = ctx.saved_tensors
        chunk = ctx.chunk
        grad_hidden = torch.empty_like(hidden)
        # a frozen output layer (LoRA) needs no weight gradient: one matmul per chunk less
        grad_weight = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32)) \
            if ctx.needs_input_grad[1] else None
        grad_loss = grad_loss.float()
        for start in range(0, hidden.shape[0], chunk):
            end = min(hidden.shape[0], start + chunk)
            h = hidden[start:end]
            # softmax over the whole (all-shard) vocabulary, minus the target's one-hot, times the loss's gradient
            g = _logits_grad(_chunk_logits(h, weight, ctx.invalid_from), lse[start:end], local_target[start:end],
                             owned[start:end], grad_loss[start:end], weight)
            grad_hidden[start:end] = torch.matmul(g, weight)
            _add_weight_grad(grad_weight, g, h)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


class _LinearCrossEntropySum(torch.autograd.Function):
    """``sum_i w_i * loss_i`` (and the detached per-token losses); the gradients are formed in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, target, token_weight, vocab_start, invalid_from, chunk, group, weight_grad):
        t = hidden.shape[0]
        vocab_local = weight.shape[0]
        loss = torch.empty(t, dtype=torch.float32, device=hidden.device)
        local_target = target - vocab_start
        owned = (local_target >= 0) & (local_target < vocab_local)
        local_target = torch.where(owned, local_target, torch.zeros_like(local_target))
        token_weight = token_weight.float()
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32)) \
            if weight_grad else None
        for start in range(0, t, chunk):
            end = min(t, start + chunk)
            h = hidden[start:end]
            logits = _chunk_logits(h, weight, invalid_from)
            loss[start:end], lse = _chunk_loss(logits, local_target[start:end], owned[start:end], group)
            # what the backward of the per-token form computes, with the token's weight as its incoming gradient
            g = _logits_grad(logits, lse, local_target[start:end], owned[start:end],
                             token_weight[start:end], weight)
            del logits
            grad_hidden[start:end] = torch.matmul(g, weight)
            _add_weight_grad(grad_weight, g, h)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.mark_non_differentiable(loss)
        return (loss * token_weight).sum(), loss

    @staticmethod
    def backward(ctx, grad_sum, _grad_losses):
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_sum.float()
        grad_hidden = (grad_hidden * scale).to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * scale).to(grad_weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def _invalid_from(weight: torch.Tensor, vocab_start: int, vocab_limit: Optional[int]) -> int:
    vocab_local = weight.shape[0]
    return vocab_local if vocab_limit is None else min(vocab_local, max(0, vocab_limit - vocab_start))


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, vocab_start: int = 0,
                         vocab_limit: Optional[int] = None, chunk: Optional[int] = None, group=None) -> torch.Tensor:
    """Per-token ``-log softmax(hidden @ weight.T)[target]`` over the vocabulary sharded across ``group``.

    ``hidden`` [t, h] (identical on every rank of ``group``), ``weight`` [V_local, h] this rank's rows
    ``[vocab_start, vocab_start + V_local)``, ``target`` [t] global ids. Rows ``>= vocab_limit`` are padding.
    Returns fp32 [t].
    """
    return _LinearCrossEntropy.apply(hidden, weight, target.long(), vocab_start,
                                     _invalid_from(weight, vocab_start, vocab_limit),
                                     chunk_tokens(weight.shape[0], chunk), group)


def forms_gradients_in_forward(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear_cross_entropy_sum` forms the gradients in its forward: a gradient will be taken
    (grad mode on, an input that requires it) and the weight is not fp16 (see the module docstring)."""
    return (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
            and weight.dtype != torch.float16)


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                             token_weight: torch.Tensor, *, vocab_start: int = 0, vocab_limit: Optional[int] = None,
                             chunk: Optional[int] = None, group=None) -> tuple:
    """``(sum_i token_weight_i * loss_i, loss)``: the weighted sum of :func:`linear_cross_entropy`'s per-token
    losses (fp32 scalar, differentiable) and the losses themselves (fp32 [t], no gradient).

    ``token_weight`` [t] is fixed (no gradient flows to it). Where a gradient will be taken the forward forms
    it and the backward scales it by the sum's incoming gradient: no recomputed logits. Elsewhere (evaluation,
    an fp16 weight) it is the per-token path summed."""
    if not forms_gradients_in_forward(hidden, weight):
        loss = linear_cross_entropy(hidden, weight, target, vocab_start=vocab_start, vocab_limit=vocab_limit,
                                    chunk=chunk, group=group)
        return (loss * token_weight.float()).sum(), loss.detach()
    return _LinearCrossEntropySum.apply(hidden, weight, target.long(), token_weight.detach(), vocab_start,
                                        _invalid_from(weight, vocab_start, vocab_limit),
                                        chunk_tokens(weight.shape[0], chunk), group, weight.requires_grad)

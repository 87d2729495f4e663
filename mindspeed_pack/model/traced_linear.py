"""megatron-core's linear function in a form dynamo traces whole: a layer compiled whole runs its linears here.

megatron-core's ``LinearWithGradAccumulationAndAsyncCommunication`` cannot sit in a compiled graph: its
backward starts asynchronous collectives (the input gradient's all-reduce over tensor parallelism, the
sequence-parallel all-gather and reduce-scatter) and waits on their handles, and its fused weight-gradient
accumulation sets attributes of the weight. This is the same linear with the same communication, written
with PyTorch's functional collectives (:mod:`.traced_mappings`; dynamo and inductor trace, order and overlap
them) and the accumulation as a custom operation (:func:`~.wgrad_fusion.accumulate_traced`)::

    forward   total = all_gather(x) under SP, else x          y = total @ W.T + b
    backward  dx = dy @ W, all-reduced over TP (or reduce-scattered under SP)
              dW: added into W.main_grad (fused accumulation; autograd gets an uninitialised gradient,
              as from megatron-core, so the DDP hook runs) or returned; db = dy summed over tokens

As megatron-core does, the sequence-parallel input is kept sharded and gathered again in the backward.
"""
from __future__ import annotations

from typing import Optional

import torch

from mindspeed_pack.model import wgrad_fusion
from mindspeed_pack.model.traced_mappings import all_gather, all_reduce, reduce_scatter


class _TracedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, main_grad, group, allreduce_dgrad: bool, sequence_parallel: bool):
        ctx.save_for_backward(input, weight)
        # not a saved tensor: every main_grad is a view of one buffer, which each layer's backward modifies
        # (autograd's version check would refuse it); megatron-core keeps it on ctx too
        ctx.main_grad = main_grad
        ctx.group, ctx.allreduce_dgrad, ctx.sequence_parallel = group, allreduce_dgrad, sequence_parallel
        ctx.use_bias = bias is not None
        total = all_gather(input, group) if sequence_parallel else input
        output = torch.matmul(total, weight.t())
        return output + bias if bias is not None else output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        if ctx.allreduce_dgrad:
            grad_input = all_reduce(grad_input, ctx.group)
        elif ctx.sequence_parallel:
            grad_input = reduce_scatter(grad_input, ctx.group)
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            total = all_gather(input, ctx.group) if ctx.sequence_parallel else input
            if ctx.main_grad is not None:
                wgrad_fusion.accumulate_traced(total, grad_output, ctx.main_grad)
                grad_weight = torch.empty_like(weight)  # never read: the weight is marked accumulated
            else:
                grad_weight = grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(
                    total.reshape(-1, total.shape[-1]))
        if ctx.use_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0)
        return grad_input, grad_weight, grad_bias, None, None, None, None


def traced_linear(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], *,
                  gradient_accumulation_fusion: bool, allreduce_dgrad: bool, sequence_parallel: bool,
                  tp_group) -> torch.Tensor:
    """megatron-core's ``linear_with_grad_accumulation_and_async_allreduce`` (or its frozen-weight variant, for a
    weight that needs no gradient), traceable; the weight gradient goes into ``weight.main_grad`` under
    ``gradient_accumulation_fusion``."""
    fused = gradient_accumulation_fusion and weight.requires_grad and hasattr(weight, "main_grad")
    return _TracedLinear.apply(input, weight, bias, weight.main_grad if fused else None, tp_group,
                               bool(allreduce_dgrad), bool(sequence_parallel))

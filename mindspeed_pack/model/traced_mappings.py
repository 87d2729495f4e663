"""megatron-core's tensor- and sequence-parallel mappings, with functional collectives inside compiled code.

megatron-core's mappings (``megatron.core.tensor_parallel.mappings``) allocate a buffer and fill it with an
in-place collective (``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce``). dynamo rewrites
those into functional collectives, but torch 2.11's (the GPU image's) loses the result of one inside an
autograd function's backward: a sequence-parallel reduce-scatter's backward all-gather then hands the weight
gradient an uninitialised buffer (found on a CPU; torch 2.13 is right). Inside compiled code each mapping here
runs its own autograd function written with PyTorch's functional collectives, which return their result;
outside it, megatron-core's own, unchanged. :func:`install` points megatron-core's linears at these.
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import layers, mappings


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_reduce(x, "sum", group))


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenated over ``group`` along the first dimension."""
    return funcol.wait_tensor(funcol.all_gather_tensor(x.contiguous(), 0, group))


def reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """Summed over ``group``, this rank's share of the first dimension."""
    return funcol.wait_tensor(funcol.reduce_scatter_tensor(x.contiguous(), "sum", 0, group))


def _own_chunk(x: torch.Tensor, group) -> torch.Tensor:
    size = x.shape[0] // group.size()
    return x.narrow(0, group.rank() * size, size).contiguous()


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad: bool):
        ctx.group, ctx.tensor_parallel_output_grad = group, tensor_parallel_output_grad
        return all_gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tensor_parallel_output_grad:
            return reduce_scatter(grad, ctx.group), None, None
        return _own_chunk(grad, ctx.group), None, None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group), None


def _traced(group) -> bool:
    """Run the functional version: inside compiled code, over more than one rank."""
    return torch.compiler.is_compiling() and group.size() > 1


def _group(group):
    return group if group is not None else ps.get_tensor_model_parallel_group()


def copy_to_tensor_model_parallel_region(input_, group=None):
    group = _group(group)
    if _traced(group):
        return _CopyToTensorParallel.apply(input_, group)
    return mappings.copy_to_tensor_model_parallel_region(input_, group=group)


def reduce_from_tensor_model_parallel_region(input_, group=None):
    group = _group(group)
    if _traced(group):
        return _ReduceFromTensorParallel.apply(input_, group)
    return mappings.reduce_from_tensor_model_parallel_region(input_, group=group)


def gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=None, **kwargs):
    group = _group(group)
    if _traced(group) and not kwargs.get("output_split_sizes"):
        return _GatherFromSequenceParallel.apply(input_, group, tensor_parallel_output_grad)
    return mappings.gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad, group=group, **kwargs)


def reduce_scatter_to_sequence_parallel_region(input_, group=None, **kwargs):
    group = _group(group)
    if _traced(group) and not kwargs.get("input_split_sizes"):
        return _ReduceScatterToSequenceParallel.apply(input_, group)
    return mappings.reduce_scatter_to_sequence_parallel_region(input_, group=group, **kwargs)


def install() -> None:
    """megatron-core's linears communicate through these (megatron-core's own outside compiled code;
    idempotent): the row-parallel linear's output all-reduce or reduce-scatter runs inside a layer."""
    for mapping in (copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
                    gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region):
        setattr(layers, mapping.__name__, mapping)

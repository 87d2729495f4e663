"""Gathers of token rows whose backward is a gather too: no atomics, no sort, deterministic.

Packed attention moves token rows between the flat THD layout and the layouts its kernels
want (length buckets, CP key prefixes). Each source row is taken at most once, and the
missing places of the target layout read an appended zero row, so the backward of the
gather is the gather of the inverse map (autograd's default, ``index_add``/``index_put``
with accumulation, is atomic or sort-based on a GPU and cost as much as all the matmuls).

Plans are host (numpy) index arrays built once per micro-batch and moved to the device once.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mindspeed_pack.model.thd import to_device


@dataclass
class RowPlan:
    """``index[i]``: the source row of target row ``i`` (``sources`` = the zero row); ``inverse[j]``: the
    target row holding source row ``j`` (``len(index)`` = none: its gradient is zero)."""

    index: torch.Tensor
    inverse: torch.Tensor
    sources: int


def row_plan(index: np.ndarray, sources: int, device) -> RowPlan:
    """The plan of target rows ``index`` (values in ``[0, sources]``; ``sources`` = a zero row)."""
    index = np.asarray(index, dtype=np.int64).reshape(-1)
    real = index < sources
    if len(np.unique(index[real])) != int(real.sum()):
        raise ValueError("row_plan: a source row is gathered twice (its gradient would need accumulation)")
    inverse = np.full(sources + 1, len(index), dtype=np.int64)
    inverse[index[real]] = np.nonzero(real)[0]
    return RowPlan(to_device(index, device), to_device(inverse, device), sources)


class _RowGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        grad = torch.cat([grad, grad.new_zeros((1, *grad.shape[1:]))])
        return grad.index_select(0, inverse), None, None


def gather_rows(x: torch.Tensor, plan: RowPlan) -> torch.Tensor:
    """``x[plan.index]`` along dim 0, with a zero row appended as source ``plan.sources``."""
    if x.shape[0] != plan.sources:
        raise ValueError(f"gather_rows: {x.shape[0]} rows, the plan expects {plan.sources}")
    x = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])
    return _RowGather.apply(x, plan.index, plan.inverse)

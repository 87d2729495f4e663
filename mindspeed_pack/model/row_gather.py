"""Gathers of token rows whose backward is a gather too: no atomics, no sort, deterministic.

Packed attention moves token rows between the flat THD layout and the layouts its kernels
want (length buckets, CP key prefixes). Each source row is taken at most once, so the backward
of the gather is the gather of the inverse map (autograd's default, ``index_add``/``index_put``
with accumulation, is atomic or sort-based on a GPU and cost as much as all the matmuls). The
places of the target layout that hold no source row are zero: they read row 0 and are then
zero-filled (only those rows), as are the gradients of source rows no target holds; no copy
of the whole input is made to append a zero row (under CP that was ~7 full copies of q, k
and v per layer).

Plans are host (numpy) index arrays built once per micro-batch and moved to the device once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from mindspeed_pack.model.thd import to_device


@dataclass
class RowPlan:
    """``index[i]``: the source row of target row ``i``; ``inverse[j]``: the target row holding source row ``j``.
    ``empty_targets``: target rows holding no source (zero); ``unused_sources``: source rows no target holds
    (zero gradient); None when there are none. ``sources``: the number of source rows."""

    index: torch.Tensor
    inverse: torch.Tensor
    sources: int
    empty_targets: Optional[torch.Tensor] = None
    unused_sources: Optional[torch.Tensor] = None


def row_plan(index: np.ndarray, sources: int, device) -> RowPlan:
    """The plan of target rows ``index`` (values in ``[0, sources]``; ``sources`` = an empty, zero row)."""
    index = np.asarray(index, dtype=np.int64).reshape(-1)
    real = index < sources
    if len(np.unique(index[real])) != int(real.sum()):
        raise ValueError("row_plan: a source row is gathered twice (its gradient would need accumulation)")
    inverse = np.full(sources, -1, dtype=np.int64)
    inverse[index[real]] = np.nonzero(real)[0]
    unused = inverse < 0

    def indices(rows: np.ndarray) -> Optional[torch.Tensor]:
        return to_device(rows, device) if len(rows) else None

    return RowPlan(to_device(np.where(real, index, 0), device), to_device(np.where(unused, 0, inverse), device),
                   sources, indices(np.flatnonzero(~real)), indices(np.flatnonzero(unused)))


def _select(x: torch.Tensor, index: torch.Tensor, zero: Optional[torch.Tensor]) -> torch.Tensor:
    out = x.index_select(0, index)
    if zero is not None:
        out.index_fill_(0, zero, 0)
    return out


class _RowGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan):
        ctx.plan = plan
        return _select(x, plan.index, plan.empty_targets)

    @staticmethod
    def backward(ctx, grad):
        plan = ctx.plan
        return _select(grad, plan.inverse, plan.unused_sources), None


def gather_rows(x: torch.Tensor, plan: RowPlan) -> torch.Tensor:
    """``x[plan.index]`` along dim 0, zero where the plan has no source row."""
    if x.shape[0] != plan.sources:
        raise ValueError(f"gather_rows: {x.shape[0]} rows, the plan expects {plan.sources}")
    if plan.sources == 0 or plan.index.numel() == 0:  # nothing to gather from, or into
        return x.new_zeros((plan.index.numel(), *x.shape[1:]))
    return _RowGather.apply(x, plan)

"""A step's numbers reduced over the job, so every rank logs and decides the same thing.

Losses and a stage's reports are ``[sum, count]`` pairs on the ranks that computed them (the last
pipeline stage, each CP rank with its share of the tokens); :func:`global_means` turns them into
the whole global batch's means on every rank. Counts (tokens, samples, rows) are summed over data
parallelism by :func:`dp_sum`; :func:`any_rank` is the agreement to stop. :func:`step_totals` sums a
step's counts over DP x CP on the device, before the forward, for a loss that needs them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from mindspeed_pack.runtime.platform import cuda_usable


def _device():
    return torch.cuda.current_device() if cuda_usable() else "cpu"


def global_means(sums: dict, maxima=()) -> dict:
    """Each ``[sum, count]`` of ``sums`` reduced over the whole job, as a mean (every rank knows it; NaN where
    the count is 0); the names in ``maxima`` are ``[max, 1]`` pairs reduced by MAX."""
    return {k: s / c if c > 0 else float("nan") for k, (s, c) in global_totals(sums, maxima).items()}


def global_totals(sums: dict, maxima=()) -> dict:
    """Each ``[sum, count]`` of ``sums`` reduced over the whole job, as a ``(sum, count)`` pair of floats (every
    rank knows it); the names in ``maxima`` are ``[max, 1]`` pairs reduced by MAX."""
    if not sums:
        return {}
    out = {}
    for names, op in (([k for k in sums if k not in maxima], dist.ReduceOp.SUM),
                      ([k for k in sums if k in maxima], dist.ReduceOp.MAX)):
        if not names:
            continue
        t = torch.stack([sums[k] for k in names]).to(_device())
        # each CP rank holds its share of the tokens' losses
        dist.all_reduce(t, op=op, group=ps.get_data_parallel_group(with_context_parallel=True))
        # the last pipeline stage holds the loss: share it with the whole pipeline
        dist.all_reduce(t, op=op, group=ps.get_pipeline_model_parallel_group())
        t = t.cpu()
        out.update({k: (float(v[0]), float(v[1])) for k, v in zip(names, t)})
    return {k: out[k] for k in sums}


def step_totals(counts: torch.Tensor) -> torch.Tensor:
    """This rank's share of a global step's counts (a tensor on the device: its CP share of the tokens, its
    micro-batches) summed over the DP x CP group; on the device throughout, so the step does not wait for it.
    Every rank of the group must call it (a collective)."""
    dist.all_reduce(counts, group=ps.get_data_parallel_group(with_context_parallel=True))
    return counts


def dp_sum(stats: dict, with_context_parallel: bool = False) -> dict:
    """``stats`` summed over the data-parallel group: the whole job's step, not one rank's (over the data x
    context parallel ranks where each counts its own share: dynamic context parallelism)."""
    keys = sorted(stats)
    t = torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64, device=_device())
    dist.all_reduce(t, group=ps.get_data_parallel_group(with_context_parallel=with_context_parallel))
    return {k: float(v) for k, v in zip(keys, t.cpu().tolist())}


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any (every rank must agree, or some would hang)."""
    t = torch.tensor([int(flag)], device=_device())
    dist.all_reduce(t)
    return bool(t.item())

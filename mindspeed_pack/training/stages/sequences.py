"""Per-sequence log-prob sums of a packed micro-batch, for every stage that needs them.

A pack's segments are its sequences (:func:`mindspeed_pack.packing.segments.sequence_sums`).
The model's output is the per-token cross entropy of the shifted targets (``-log p``), so a
sequence's log-prob is minus its trained tokens' sum. Under context parallelism each rank
holds a zigzag share of every sequence: the sums are all-reduced over the CP group; the
backward is the identity, since each rank's tokens contribute to the sum once.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from mindspeed_pack.datasets.packed_dataset import DataError
from mindspeed_pack.model.thd import to_device
from mindspeed_pack.packing.segments import PackedBatch, sequence_sums


class _SumOverContextParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = x.clone()
        dist.all_reduce(out, group=ps.get_context_parallel_group())
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad


def whole_sequence_sums(values: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """``values`` [1, T] summed per segment of ``batch`` over the whole CP group (differentiable:
    each rank's backward carries its own tokens' share)."""
    sums = sequence_sums(values, batch)
    if ps.get_context_parallel_world_size() > 1:
        sums = _SumOverContextParallel.apply(sums)
    return sums


def sequence_logps(batch: PackedBatch, output_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob sum, trained tokens) of every segment of ``batch``, over the whole CP group."""
    mask = batch.loss_mask
    logp = -output_tensor.float().reshape(mask.shape) * mask
    return whole_sequence_sums(logp, batch), whole_sequence_sums(mask, batch)


def pair_segments(batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (into the batch's segments) of every pair's chosen and rejected sequence, on the batch's device.

    Found from the segment labels the host kept (:attr:`PackedBatch.host_segment_labels`): a device
    ``nonzero`` and the checks' reads would stall the step once per micro-batch."""
    labels = batch.host_segment_labels
    if labels is None:  # a batch built elsewhere (tests, tools): read back once
        labels = batch.segment_labels.cpu().numpy()
    chosen = np.flatnonzero((labels > 0) & (labels % 2 == 1))
    rejected = chosen + 1
    if len(chosen) and (int(rejected.max()) >= len(labels) or bool((labels[rejected] != labels[chosen] + 1).any())):
        raise DataError("a preference pair is not whole in its micro-batch (segment 2k-1 without 2k): the data was "
                        "not written by preprocess_data.py with a pairwise handler")
    device = batch.loss_mask.device
    return to_device(chosen, device), to_device(rejected, device)

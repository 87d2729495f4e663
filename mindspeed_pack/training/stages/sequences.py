"""Per-sequence log-prob sums of a packed micro-batch, for every stage that needs them.

A pack's segments are its sequences (:func:`mindspeed_pack.packing.segments.sequence_sums`).
The model's output is the per-token cross entropy of the shifted targets (``-log p``), so a
sequence's log-prob is minus its trained tokens' sum. Under context parallelism each rank
holds a zigzag share of every sequence: the sums are all-reduced over the micro-batch's CP group
(:func:`sequence_group`: megatron's, or under dynamic context parallelism the group the plan chose for
this micro-batch, none when it runs on one rank); the backward is the identity, since each rank's tokens
contribute to the sum once. What every rank of that group holds whole (a pair's loss, its count) is
counted once, on the group's first rank (:func:`counts_here`).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from mindspeed_pack.datasets.packed_dataset import DataError
from mindspeed_pack.model.thd import to_device
from mindspeed_pack.packing.segments import PackedBatch, sequence_sums
from mindspeed_pack.runtime.process_groups import dynamic_cp_group


def sequence_group(batch: PackedBatch):
    """The ranks that hold the rest of ``batch``'s sequences: the CP group the dynamic plan chose for this
    micro-batch (None on one rank), else megatron's CP group (None without context parallelism)."""
    if batch.local_cp_size is not None:
        return dynamic_cp_group(batch.local_cp_size)
    return ps.get_context_parallel_group() if ps.get_context_parallel_world_size() > 1 else None


def counts_here(batch: PackedBatch) -> bool:
    """True on the one rank of :func:`sequence_group` that counts ``batch``'s whole-sequence quantities."""
    return (batch.cp_rank if batch.local_cp_size is not None else ps.get_context_parallel_rank()) == 0


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def whole_sequence_sums(values: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """``values`` [1, T] summed per segment of ``batch`` over its whole CP group (:func:`sequence_group`;
    differentiable: each rank's backward carries its own tokens' share)."""
    sums = sequence_sums(values, batch)
    group = sequence_group(batch)
    return sums if group is None else _SumOverGroup.apply(sums, group)


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


def document_units(micro_batch: dict) -> list:
    """``[(document, its segments in the micro-batch)]`` in segment order: rows of packs (one document a row,
    all its segments), or a row of whole units packed at load time (``dp_balanced``, ``default_dynamic_cp``:
    ``document_segments``)."""
    if "document_segments" in micro_batch:
        return list(zip(micro_batch["documents"], micro_batch["document_segments"]))
    return [(doc, int(seg.max())) for doc, seg in zip(micro_batch["documents"], micro_batch["segment_ids"])]


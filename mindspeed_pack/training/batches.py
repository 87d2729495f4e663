"""Where a step's micro-batches come from and how each becomes a :class:`PackedBatch`.

The seam between the data (a :class:`BatchSource` per script or stage) and the model: a micro-batch
dict (``input_ids``, ``labels``, ``segment_ids`` [b, s]) is laid out on the host once
(:func:`host_packed_batch`: THD rows, ``cu_seqlens``, shifted labels, loss mask), copied to the
device, and handed to the model with its THD parameters (:func:`packed_seq_params`). The trainer
and every stage that runs the model (reference scoring, rollout scoring) go through these.
"""
from __future__ import annotations

from typing import Iterator, Protocol

import torch
from megatron.core import parallel_state as ps

from mindspeed_pack.model import thd
from mindspeed_pack.packing.segments import PackedBatch, build_packed_batch
from mindspeed_pack.runtime.platform import cuda_usable
from mindspeed_pack.runtime.process_groups import dynamic_cp_group


class BatchSource(Protocol):
    """Where a script's data comes from."""

    def setup(self, args, num_samples: dict) -> None:
        """Build the splits' datasets for ``num_samples`` {'train': n, 'valid': n}."""

    def micro_batches(self, split: str, consumed_samples: int) -> Iterator[dict]:
        """This rank's micro-batches ({'input_ids','labels','segment_ids'} [b, s]) from a position."""

    def has_split(self, split: str) -> bool:
        ...

    # optional: step_shape(split, consumed) -> (micro-batches, tokens per micro-batch, stats) for
    # sources whose step shape varies (online packing); default args.num_micro_batches x seq_length


def host_packed_batch(mb: dict, args) -> PackedBatch:
    """A micro-batch's :class:`PackedBatch`, on the host (layout work happens there, once per micro-batch)."""
    batch = build_packed_batch(
        mb["input_ids"], mb["labels"], mb["segment_ids"],
        reset_position_ids=args.reset_position_ids, per_sample_loss=args.per_sample_loss,
        sample_ids=mb.get("sample_ids"), position_groups=mb.get("position_groups"),
    )
    if "loss_mask" in mb:  # e.g. --eod-mask-loss: extra untrained targets from the data side
        batch.loss_mask = batch.loss_mask * mb["loss_mask"].reshape(batch.loss_mask.shape).float()
    if "pad_mask" in mb:  # online rows' context-parallel pads end their samples: routed nowhere, as pad_segments'
        batch.routing_segments = batch.routing_segments.masked_fill(mb["pad_mask"].reshape(1, -1), 0)
    return batch


def model_device():
    return torch.cuda.current_device() if cuda_usable() else "cpu"


def to_packed_batch(mb: dict, args) -> PackedBatch:
    return host_packed_batch(mb, args).to(model_device())


def packed_seq_params(batch: PackedBatch) -> thd.ThdParams:
    """THD parameters of a micro-batch (:mod:`mindspeed_pack.model.thd`), for this rank's CP share: of
    megatron's CP group, or under dynamic context parallelism of the micro-batch's own group."""
    if batch.local_cp_size is not None:
        return thd.packed_seq_params(batch, batch.local_cp_size, batch.cp_rank, dynamic_cp_group(batch.local_cp_size),
                                     dynamic=True)
    return thd.packed_seq_params(batch, ps.get_context_parallel_world_size(), ps.get_context_parallel_rank())

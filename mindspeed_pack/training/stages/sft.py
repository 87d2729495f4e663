"""Supervised fine-tuning: the per-token mean over the global batch (or ``--per-sample-loss``)."""
from __future__ import annotations

import torch

from mindspeed_pack.packing.segments import PackedBatch


def normaliser_count(batch: PackedBatch, per_sample: bool) -> torch.Tensor:
    """``batch``'s share of the step's normaliser: its samples (counted on CP rank 0) or trained tokens."""
    if per_sample:
        # a fill on the device, not a copy from the host (which would wait for the device)
        return torch.full((), batch.num_samples, dtype=torch.int, device=batch.loss_mask.device)
    return batch.loss_mask.sum().to(torch.int)


def token_weights(batch: PackedBatch, per_sample: bool) -> torch.Tensor:
    """Each token loss's weight in the summed loss: 1/0 (trained or not) or, per sample, 1 / its trained tokens."""
    return batch.loss_weights if per_sample else batch.loss_mask


def loss_func(batch: PackedBatch, per_sample: bool, output_tensor: torch.Tensor):
    """Summed loss and its normaliser; megatron divides by the global batch's total. ``output_tensor``: the
    per-token losses, or their weighted sum already (a scalar: the model was given :func:`token_weights`)."""
    if output_tensor.dim() == 0:
        loss = output_tensor.float()
    else:
        losses = output_tensor.float().reshape(batch.loss_mask.shape)
        loss = (losses * token_weights(batch, per_sample)).sum()
    count = normaliser_count(batch, per_sample)
    report = torch.stack([loss.detach(), count.to(loss.dtype)])
    return loss, count, {"lm loss": report}


class SFTStage:
    name = "sft"
    metric_names: tuple = ()

    def __init__(self, args):
        self.per_sample = args.per_sample_loss
        self.normaliser = "samples" if self.per_sample else "trained tokens"

    def batch_source(self, args):
        from mindspeed_pack.datasets.online_packing import batch_source

        return batch_source(args)

    def setup(self, trainer) -> None:
        from mindspeed_pack.training.stages import data_layouts

        for docs in getattr(trainer.source, "docs", None) or []:  # preference or KTO data is refused
            data_layouts.check(self.name, docs.prefix, docs.meta)

    def prepare(self, trainer, batches, micro_batches, split, tokens_per_micro_batch):
        return batches

    def loss_weights(self, batch: PackedBatch) -> torch.Tensor:
        return token_weights(batch, self.per_sample)

    def count(self, batch: PackedBatch) -> torch.Tensor:
        return normaliser_count(batch, self.per_sample)

    def loss_func(self, batch: PackedBatch, output_tensor: torch.Tensor):
        return loss_func(batch, self.per_sample, output_tensor)

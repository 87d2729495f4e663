"""The batch contract of packed training: segment ids in, everything a step needs out.

A pack is one row of ``seq_length`` tokens holding several samples back to back, then
padding. Preprocessing stores three aligned arrays per pack (labels are *not* shifted)::

    position        0   1   2   3   4   5   6   7   8   9
    input_ids       a0  a1  a2  a3  b0  b1  b2  P   P   P      (P = pad)
    labels          -   -   a2  a3  -   b1  b2  -   -   -      (- = -100: prompt, pad,
    segment_ids     1   1   1   1   2   2   2   0   0   0       first token of a sample)

:func:`build_packed_batch` turns a micro-batch of such rows into the step's inputs::

    target          -   a2  a3  -   b1  b2  -   -   -   -      (labels shifted *within*
    loss_mask       0   1   1   0   1   1   0   0   0   0       a segment: a3 never
    position_ids    0   1   2   3   0   1   2   0   1   2       predicts b0)
    cu_seqlens      [0, 4, 7, 10]                               (padding = one segment)

Rows of a micro-batch are flattened into one THD sequence ``[1, b*s]`` and their
``cu_seqlens`` concatenated, so micro-batch size > 1 needs nothing special downstream.
The first token of each sample has label -100 in storage, so even data packed without
segment ids (``attention_mask`` all ones) cannot train a sample's last token to predict
the next sample's first one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

IGNORE_INDEX = -100


@dataclass
class PackedBatch:
    """Inputs of one micro-batch in THD layout (batch dimension 1, ``b*s`` tokens)."""

    tokens: torch.Tensor  # [1, T] int64
    target: torch.Tensor  # [1, T] int64, IGNORE_INDEX replaced by 0 (see loss_mask)
    loss_mask: torch.Tensor  # [1, T] float32, 1 where the target is trained
    position_ids: torch.Tensor  # [1, T] int64
    cu_seqlens: torch.Tensor  # [num_segments + 1] int32, leading 0, last == T
    max_seqlen: int
    num_samples: int  # segments that are samples (padding segments excluded)
    num_pad_tokens: int  # tokens whose segment id is 0
    loss_weights: Optional[torch.Tensor] = None  # [1, T] per-token weights (per-sample mean)
    # context parallelism (see :mod:`.context_parallel`): segments padded to a multiple of 2 x CP;
    # then ``cu_seqlens`` holds the real lengths' offsets and this the physical ones (TE's THD convention)
    cu_seqlens_padded: Optional[torch.Tensor] = None
    # [1, T] int64: the sample each token belongs to, 1..num_samples over the micro-batch, 0 for
    # padding (what a mixture-of-experts router groups its statistics by, :mod:`mindspeed_pack.model.moe`)
    routing_segments: Optional[torch.Tensor] = None
    # per-sequence quantities (log-prob sums of preference pairs, rollouts): which segment of
    # ``cu_seqlens`` every token belongs to, and each segment's stored id (0 = padding)
    segment_index: Optional[torch.Tensor] = None  # [1, T] int64
    segment_labels: Optional[torch.Tensor] = None  # [num_segments] int64
    host_segment_labels: Optional[np.ndarray] = None  # the same, on the host (index plans built from it)
    # the offsets attention runs on (``cu_seqlens_padded`` under CP), on the host: set where the batch is built
    # (and padded for CP), so that nothing in the step reads them back from the device (:mod:`mindspeed_pack.model.thd`)
    host_cu_seqlens: Optional[np.ndarray] = None
    # dynamic context parallelism (:mod:`.dynamic_cp`): the micro-batch runs on its own CP group of this many
    # ranks, this rank being ``cp_rank`` of it (None: the run's --context-parallel-size, megatron's CP group)
    local_cp_size: Optional[int] = None
    cp_rank: int = 0
    # above the largest ``routing_segments`` value (its groups, pads included, + 1), known on the host
    routing_groups: Optional[int] = None

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()

    def to(self, device) -> "PackedBatch":
        """This batch on ``device``; from the host, asynchronously (pinned memory) on a GPU."""
        fields = dict(vars(self))
        asynchronous = torch.device(device).type == "cuda"

        def move(v):
            if not isinstance(v, torch.Tensor):
                return v
            if asynchronous and v.device.type == "cpu":
                return v.pin_memory().to(device, non_blocking=True)
            return v.to(device)

        return PackedBatch(**{k: move(v) for k, v in fields.items()})


def attention_offsets(batch: PackedBatch) -> np.ndarray:
    """The segment offsets attention runs on (``cu_seqlens_padded`` under CP), as host integers."""
    cu = batch.cu_seqlens_padded if batch.cu_seqlens_padded is not None else batch.cu_seqlens
    return cu.detach().cpu().numpy().astype(np.int64)


def sequence_sums(values: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """``values`` [1, T] summed per segment of ``batch`` -> [num_segments] (differentiable).

    The one place per-sequence quantities come from: a token counts for the segment it
    sits in, whatever the packing or this rank's share of a context-parallel split."""
    out = values.new_zeros(len(batch.segment_labels))
    return out.index_add(0, batch.segment_index.reshape(-1), values.reshape(-1))


def reward_positions(input_ids: torch.Tensor, segment_ids: torch.Tensor, pad_id: Optional[int] = None) -> torch.Tensor:
    """Float ``[b, s]``: 1 at the token each sample's reward is read at, 0 elsewhere (an outcome reward model).

    That token is the sample's last one whose id is not ``pad_id`` (its last token when ``pad_id`` is None):
    transformers' ``*ForSequenceClassification`` pooling of the sample alone, with ``pad_token_id`` = ``pad_id``
    (its first token when every token is ``pad_id``, as there). Samples are the segments of ``segment_ids``
    (rows ``[b, s]``, 0 = padding, which has none)::

        input_ids     a0 a1 a2 P  b0 b1 P  P        (P = pad_id: a sample padded to a multiple, then the pack's)
        segment_ids   1  1  1  1  2  2  0  0
        reward        0  0  1  0  0  1  0  0
    """
    b, s = input_ids.shape
    starts = segment_boundaries(segment_ids).reshape(-1)
    segment = torch.cumsum(starts.long(), 0) - 1
    n = int(starts.sum())
    position = torch.arange(b * s, device=input_ids.device)
    real = segment_ids.reshape(-1) != 0
    kept = real if pad_id is None else real & (input_ids.reshape(-1) != pad_id)
    last = torch.full((n,), -1, dtype=torch.long, device=input_ids.device).scatter_reduce(
        0, segment[kept], position[kept], "amax")
    first = torch.full((n,), b * s, dtype=torch.long, device=input_ids.device).scatter_reduce(
        0, segment[real], position[real], "amin")
    chosen = torch.where(last >= 0, last, first)[first < b * s]  # padding segments have no real token
    out = torch.zeros(b * s, device=input_ids.device)
    out[chosen] = 1.0
    return out.view(b, s)


def segment_ids_from_eod(tokens: torch.Tensor, eod_id: int) -> torch.Tensor:
    """Segment ids 1..k for rows of concatenated documents, each ending at its EOD token.

    The EOD belongs to the document it closes; a new segment starts right after it.
    """
    is_eod = (tokens == eod_id).long()
    # a token starts a new document if the previous token was an EOD
    prev_eod = torch.zeros_like(is_eod)
    prev_eod[..., 1:] = is_eod[..., :-1]
    return torch.cumsum(prev_eod, dim=-1) + 1


def segment_ids_at_eos(input_ids: torch.Tensor, labels: torch.Tensor, eos_id: int, pad_id: int) -> torch.Tensor:
    """Sample ids 1..k of plain ``--pack`` rows (attention_mask all ones), 0 for padding.

    A sample ends with its EOS, where MindSpeed-LLM resets positions. The row's tail of
    untrained pad tokens is padding (pad may equal EOS: then it is the run of untrained EOS
    after the last sample, not a row of length-1 samples)::

        input_ids   a0 a1 E  b0 b1 b2 E  P  P        (E = EOS, P = pad)
        sample ids  1  1  1  2  2  2  2  0  0
    """
    seg = segment_ids_from_eod(input_ids, eos_id)
    is_pad = (input_ids == pad_id) & (labels == IGNORE_INDEX)
    tail = torch.flip(torch.cumprod(torch.flip(is_pad.long(), dims=[-1]), dim=-1), dims=[-1]).bool()
    return seg.masked_fill(tail, 0)


def shift_labels_within_segments(labels: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
    """Target of position i = labels[i+1] if i+1 is in the same, non-padding segment."""
    target = torch.full_like(labels, IGNORE_INDEX)
    same = (segment_ids[..., 1:] == segment_ids[..., :-1]) & (segment_ids[..., :-1] != 0)
    target[..., :-1] = torch.where(same, labels[..., 1:], torch.full_like(labels[..., 1:], IGNORE_INDEX))
    return target


def segment_boundaries(segment_ids: torch.Tensor) -> torch.Tensor:
    """Bool [b, s]: True where a segment starts (row starts and every id change)."""
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    return starts


def build_packed_batch(
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    segment_ids: Optional[torch.Tensor],
    *,
    reset_position_ids: bool = True,
    per_sample_loss: bool = False,
    sample_ids: Optional[torch.Tensor] = None,
    position_groups: Optional[torch.Tensor] = None,
) -> PackedBatch:
    """Derive target, loss mask, positions and cu_seqlens from stored pack rows.

    ``input_ids``, ``labels``: [b, s] with aligned labels (-100 = not trained).
    ``segment_ids``: [b, s], 1..k per sample and 0 for padding; None means "no isolation":
    each row is a single causal sequence (plain ``--pack`` data, or unpacked rows).
    ``reset_position_ids``: positions restart at 0 in each segment (else run 0..s-1).
    ``per_sample_loss``: add per-token weights so the loss is a mean over samples of each
    sample's token mean, instead of the packing-invariant per-token mean.
    ``sample_ids``: [b, s] samples of rows that are not isolated (plain packs, found at EOS),
    for the per-sample mean and the sample count; without them a row counts as one sample.
    ``position_groups``: [b, s] ids of rows that are not isolated whose positions still restart at each new id
    under ``reset_position_ids`` (Megatron-LM's ``--reset-position-ids`` without ``--reset-attention-mask``:
    positions restart after every EOD, attention spans the row).
    """
    if input_ids.dim() == 1:
        input_ids, labels = input_ids[None], labels[None]
        segment_ids = None if segment_ids is None else segment_ids[None]
    if input_ids.shape != labels.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)} differ in shape")
    b, s = input_ids.shape
    isolated = segment_ids is not None
    if not isolated:
        segment_ids = torch.ones_like(input_ids)
    elif segment_ids.shape != input_ids.shape:
        raise ValueError(f"segment_ids {tuple(segment_ids.shape)} and input_ids {tuple(input_ids.shape)} differ in shape")
    segment_ids = segment_ids.long()

    target = shift_labels_within_segments(labels.long(), segment_ids)
    loss_mask = (target != IGNORE_INDEX).float()

    starts = segment_boundaries(segment_ids)
    flat_starts = starts.reshape(-1)
    total = b * s
    idx = torch.arange(total, device=input_ids.device)
    start_pos = torch.nonzero(flat_starts, as_tuple=False).squeeze(1)
    cu_seqlens = torch.cat([start_pos, torch.tensor([total], device=input_ids.device)]).to(torch.int32)
    seqlens = cu_seqlens[1:] - cu_seqlens[:-1]
    segment_index = (torch.cumsum(flat_starts.long(), 0) - 1).view(1, total)

    if reset_position_ids and (isolated or position_groups is not None):
        restarts = flat_starts if isolated else segment_boundaries(position_groups.long().reshape(b, s)).reshape(-1)
        seg_start = torch.cummax(torch.where(restarts, idx, torch.zeros_like(idx)), dim=0).values
        position_ids = (idx - seg_start).view(1, total)
    else:
        position_ids = torch.arange(s, device=input_ids.device).repeat(b).view(1, total)

    # samples: the isolated segments, else the given sample ids, else one per row
    groups = segment_ids if isolated or sample_ids is None else sample_ids.long().reshape(b, s)
    group_starts = starts if groups is segment_ids else segment_boundaries(groups)
    flat_group_starts = group_starts.reshape(-1)
    group_first_ids = groups.reshape(-1)[flat_group_starts]
    num_samples = int((group_first_ids != 0).sum()) if groups is not segment_ids or isolated else b
    num_pad = int((groups == 0).sum()) if isolated or sample_ids is not None else 0

    sample_index = torch.cumsum(flat_group_starts.long(), 0)  # 1.. per group of the micro-batch
    routing_segments = torch.where(groups.reshape(-1) != 0, sample_index, torch.zeros_like(sample_index))

    loss_weights = None
    if per_sample_loss:
        seg_index = torch.cumsum(flat_group_starts.long(), 0) - 1  # which sample each token is in
        counts = torch.zeros(int(flat_group_starts.sum()), device=input_ids.device).index_add_(
            0, seg_index, loss_mask.reshape(-1))
        weights = loss_mask.reshape(-1) / counts.clamp(min=1)[seg_index]
        loss_weights = weights.view(1, total)

    segment_labels = segment_ids.reshape(-1)[flat_starts]
    return PackedBatch(
        tokens=input_ids.reshape(1, total).long(),
        target=target.clamp(min=0).reshape(1, total),
        loss_mask=loss_mask.reshape(1, total),
        position_ids=position_ids.long(),
        cu_seqlens=cu_seqlens,
        max_seqlen=int(seqlens.max()),
        num_samples=num_samples,
        num_pad_tokens=num_pad,
        loss_weights=loss_weights,
        routing_segments=routing_segments.view(1, total),
        routing_groups=int(sample_index[-1]) + 1 if total else 1,
        segment_index=segment_index,
        segment_labels=segment_labels,
        host_segment_labels=segment_labels.cpu().numpy(),
        host_cu_seqlens=cu_seqlens.cpu().numpy().astype(np.int64),
    )

"""The context-parallel (CP) view of a packed batch: per-sample padding and the zigzag split.

Under ``--context-parallel-size N`` every sample of the flattened THD micro-batch is cut into
``2N`` equal chunks and CP rank ``r`` keeps chunks ``r`` and ``2N-1-r`` (Megatron's
per-document load balancing: causal attention work grows along a sample, so pairing an early
chunk with a late one gives every rank the same work). For that, each segment (sample, or
the pack's padding) is first padded at its end to a multiple of ``2N`` (``x TP`` under
sequence parallelism, so each rank's share also splits over TP)::

    global   a0 a1 a2 a3 a4 .  .  .  |  b0 .  .  .  |  P  P  P  P   (. = CP pad, P = pack padding)
    cu_seqlens         [0, 5, 6, 10]      real lengths (TE: cu_seqlens_q)
    cu_seqlens_padded  [0, 8, 12, 16]     physical offsets (TE: cu_seqlens_q_padded)

    CP2, chunk = padded length / 4:
    rank 0   a0 a1 .  .  |  b0 .  |  P  P   (chunks 0 and 3 of every segment)
    rank 1   a2 a3 a4 .  |  .  .  |  P  P   (chunks 1 and 2)

Labels are shifted (within segments) *before* the split, so the split needs no
communication for targets; CP pads carry no label (never trained) and position id 0.
Positions of real tokens stay global within their sample; megatron-core's THD RoPE reads the
same zigzag layout from ``cu_seqlens_padded`` and the CP rank. A pad-only chunk on some rank
(a 1-token sample at CP2) is fine: its queries attend to keys of their own sample, so no row
of the attention is ever empty (no NaN).

Every function here is pure tensor arithmetic on one rank: all CP ranks of a DP rank build
the same global batch and each takes its part.
"""
from __future__ import annotations

from dataclasses import replace
from typing import List, Optional, Tuple

import numpy as np
import torch

from mindspeed_pack.packing.segments import PackedBatch


def padding_multiple(cp_size: int, tp_size: int = 1, sequence_parallel: bool = False) -> int:
    """Every segment's length is padded to this: ``2 x CP`` (``x TP`` under sequence parallelism)."""
    return 2 * cp_size * (tp_size if sequence_parallel else 1)


def round_up(n, multiple: int):
    return -(-n // multiple) * multiple


def pad_segments(batch: PackedBatch, multiple: int, total: Optional[int] = None) -> PackedBatch:
    """``batch`` with each segment padded at its end to a multiple of ``multiple``.

    The result carries ``cu_seqlens`` = cumulative *real* lengths and ``cu_seqlens_padded`` =
    cumulative padded lengths (Transformer Engine's THD convention). ``total`` (a multiple of
    ``multiple``, at least the padded size) appends one padding segment so that every
    micro-batch of a step has the same length (pipeline stages exchange fixed shapes).
    """
    if batch.cu_seqlens_padded is not None:
        raise ValueError("pad_segments: the batch is already padded for context parallelism")
    cu = batch.cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    padded = round_up(lengths, multiple)
    new_total = int(padded.sum())
    if total is not None:
        if total % multiple or total < new_total:
            raise ValueError(f"pad_segments: total {total} must be a multiple of {multiple} and >= {new_total}")
        if total > new_total:
            lengths = torch.cat([lengths, lengths.new_tensor([total - new_total])])
            padded = torch.cat([padded, padded.new_tensor([total - new_total])])
            new_total = total
    device = cu.device
    t = batch.tokens.shape[1]
    dest = _destinations(cu, torch.cat([cu.new_zeros(1), torch.cumsum(padded, 0)]))[:t]

    def spread(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if x is None:
            return None
        out = x.new_zeros((1, new_total))
        out[0, dest] = x[0]
        return out

    zero = torch.zeros(1, dtype=torch.int32, device=device)
    labels = batch.segment_labels
    if labels is not None and len(padded) > len(labels):  # the appended padding segment
        labels = torch.cat([labels, labels.new_zeros(len(padded) - len(labels))])
    return replace(
        batch,
        tokens=spread(batch.tokens), target=spread(batch.target), loss_mask=spread(batch.loss_mask),
        position_ids=spread(batch.position_ids), loss_weights=spread(batch.loss_weights),
        routing_segments=spread(batch.routing_segments),  # added padding: 0, routed nowhere
        segment_index=None if batch.segment_index is None else torch.repeat_interleave(
            torch.arange(len(padded), device=device), padded).view(1, new_total),
        segment_labels=labels, host_segment_labels=None if labels is None else labels.cpu().numpy(),
        cu_seqlens=torch.cat([zero, torch.cumsum(lengths, 0).to(torch.int32)]),
        cu_seqlens_padded=torch.cat([zero, torch.cumsum(padded, 0).to(torch.int32)]),
        max_seqlen=int(padded.max()),
        num_pad_tokens=batch.num_pad_tokens + new_total - t,
        host_cu_seqlens=np.concatenate([[0], np.cumsum(padded.cpu().numpy())]).astype(np.int64),
    )


def _destinations(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor) -> torch.Tensor:
    """Where each stored token goes once every segment is padded: its segment's padded start +
    its offset in the segment (real lengths ``cu_seqlens``, padded ``cu_seqlens_padded``)."""
    cu, cu_padded = cu_seqlens.long(), cu_seqlens_padded.long()
    seg_of = torch.repeat_interleave(torch.arange(len(cu) - 1, device=cu.device), cu[1:] - cu[:-1])
    return cu_padded[:-1][seg_of] + torch.arange(int(cu[-1]), device=cu.device) - cu[:-1][seg_of]


def rank_share(x: torch.Tensor, view: PackedBatch, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This CP rank's part of per-token values ``x`` [k, T] laid out as the batch ``view`` was
    cut from (a stage's per-token inputs: advantages, old log-probs), placed as ``view``'s tokens."""
    dest = _destinations(view.cu_seqlens, view.cu_seqlens_padded)[:x.shape[1]]
    full = x.new_zeros((x.shape[0], int(view.cu_seqlens_padded[-1])))
    full[:, dest] = x
    return full[:, zigzag_index(view.cu_seqlens_padded, cp_size, cp_rank)]


def whole_from_shares(shares: List[torch.Tensor], view: PackedBatch, length: int) -> torch.Tensor:
    """The inverse of :func:`rank_share`: per-token values [k, T_local] of every CP rank (by rank)
    back in the layout of the batch ``view`` was cut from, its first ``length`` tokens."""
    full = shares[0].new_zeros((shares[0].shape[0], int(view.cu_seqlens_padded[-1])))
    for rank, share in enumerate(shares):
        full[:, zigzag_index(view.cu_seqlens_padded, len(shares), rank)] = share
    return full[:, _destinations(view.cu_seqlens, view.cu_seqlens_padded)[:length]]


def segment_positions(cu: np.ndarray, cp_size: int = 1, cp_rank: int = 0) -> np.ndarray:
    """Each local token's position within its segment: ``0..n-1`` per segment, or, under CP, this rank's
    zigzag chunks ``r`` and ``2N-1-r`` of every (padded) segment, as megatron-core's THD RoPE reads them."""
    lengths = np.diff(cu)
    if cp_size == 1:
        starts = np.repeat(cu[:-1], lengths)
        return np.arange(int(cu[-1]), dtype=np.int64) - starts
    chunk = lengths // (2 * cp_size)
    first = np.repeat(cp_rank * chunk, chunk)
    second = np.repeat((2 * cp_size - 1 - cp_rank) * chunk, chunk)
    local_starts = np.repeat(np.cumsum(chunk) - chunk, chunk)
    offset = np.arange(int(chunk.sum()), dtype=np.int64) - local_starts
    # per segment: its first chunk then its second, in local order
    seg = np.repeat(np.arange(len(chunk)), chunk)
    order = np.argsort(np.concatenate([2 * seg, 2 * seg + 1]), kind="stable")
    return np.concatenate([first + offset, second + offset])[order]


def local_rows(cu: np.ndarray, cp_size: int, cp_rank: int) -> np.ndarray:
    """Global rows (offsets in the padded layout ``cu``) of the tokens CP rank ``cp_rank`` holds, in its local order."""
    local_lengths = np.diff(cu) // cp_size
    return np.repeat(cu[:-1], local_lengths) + segment_positions(cu, cp_size, cp_rank)


def zigzag_index(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global token indices that CP rank ``cp_rank`` holds, in its local order (:func:`local_rows`).

    For every segment (padded length a multiple of ``2 x cp_size``): chunk ``cp_rank`` then
    chunk ``2 x cp_size - 1 - cp_rank``. Local offsets of the segments are
    ``cu_seqlens_padded / cp_size``.
    """
    cu = cu_seqlens_padded.detach().cpu().numpy().astype(np.int64)
    lengths = np.diff(cu)
    if (lengths % (2 * cp_size)).any():
        raise ValueError(f"segment lengths {lengths.tolist()} are not all multiples of 2 x CP ({2 * cp_size})")
    return torch.from_numpy(local_rows(cu, cp_size, cp_rank)).to(cu_seqlens_padded.device)


def split_for_rank(batch: PackedBatch, cp_size: int, cp_rank: int) -> PackedBatch:
    """This CP rank's tokens of a padded batch (``cu_seqlens*`` stay global, as TE and RoPE expect)."""
    if batch.cu_seqlens_padded is None:
        raise ValueError("split_for_rank needs a batch from pad_segments")
    index = zigzag_index(batch.cu_seqlens_padded, cp_size, cp_rank)

    def take(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if x is None else x[:, index]

    return replace(
        batch,
        tokens=take(batch.tokens), target=take(batch.target), loss_mask=take(batch.loss_mask),
        position_ids=take(batch.position_ids), loss_weights=take(batch.loss_weights),
        routing_segments=take(batch.routing_segments), segment_index=take(batch.segment_index),
        # per-sample loss normaliser: counted once, on CP rank 0, so a DP x CP sum counts each sample once
        num_samples=batch.num_samples if cp_rank == 0 else 0,
    )


def context_parallel_view(batch: PackedBatch, cp_size: int, cp_rank: int, multiple: int,
                          total: Optional[int] = None) -> PackedBatch:
    """Pad every segment (:func:`pad_segments`) and keep this rank's zigzag share."""
    return split_for_rank(pad_segments(batch, multiple, total), cp_size, cp_rank)


def group_view(batch: PackedBatch, cp_size: int, cp_rank: int, multiple: int, total: int) -> PackedBatch:
    """Dynamic context parallelism: this rank's share of a micro-batch that runs on its own group of
    ``cp_size`` ranks (on one rank: the whole batch, unpadded), marked with the group for the attention."""
    view = batch if cp_size == 1 else context_parallel_view(batch, cp_size, cp_rank, multiple, total)
    return replace(view, local_cp_size=cp_size, cp_rank=cp_rank)


def padded_size(batch: PackedBatch, multiple: int) -> int:
    """Tokens of ``batch`` once every segment is padded to ``multiple``."""
    return int(round_up(torch.diff(batch.cu_seqlens.long()), multiple).sum())


def step_views(batches: List[PackedBatch], cp_size: int, cp_rank: int, multiple: int,
               same_length: bool, max_per_rank: Optional[int] = None) -> Tuple[List[PackedBatch], int]:
    """This rank's view of every micro-batch of a step, and the global tokens per micro-batch.

    ``same_length`` (pipeline stages exchange activations of one fixed shape): every
    micro-batch is padded to the step's longest; all stages derive it from the same data.
    ``max_per_rank`` (``--max-seqlen-per-dp-cp-rank`` of online packing): no CP rank may hold
    more tokens of a micro-batch (Megatron-LM asserts it; memory is sized by it).
    """
    longest = max(padded_size(b, multiple) for b in batches)
    if max_per_rank is not None and longest > max_per_rank * cp_size:
        raise ValueError(f"a micro-batch padded for context parallelism holds {longest} tokens, {longest // cp_size} "
                         f"per CP rank, over --max-seqlen-per-dp-cp-rank {max_per_rank} (CP {cp_size}): its rows "
                         f"were not planned at their CP-padded lengths")
    total = longest if same_length else None
    return [context_parallel_view(b, cp_size, cp_rank, multiple, total) for b in batches], longest


def attention_pairs(cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Causal query-key pairs each CP rank computes under the zigzag split, ``[cp_size]`` (int64).

    A query at position ``p`` of its segment sees ``p + 1`` keys; the bench compares the
    ranks' totals (max / mean) against a contiguous split.
    """
    index = [zigzag_index(cu_seqlens_padded, cp_size, r) for r in range(cp_size)]
    cu = cu_seqlens_padded.long()
    seg_start = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])
    return torch.stack([(i - seg_start[i] + 1).sum() for i in index])

"""The packed (THD) attention contract of one micro-batch, known on the host before the forward.

megatron-core hands ``PackedSeqParams`` down the stack unchanged; :class:`ThdParams` is that
dataclass plus what the host already knows when it builds the batch, so nothing in the
forward or backward has to ask the device for it (a ``.tolist()`` or ``.item()`` on a GPU
tensor stalls the CPU until the GPU queue drains, and once per layer that idles the GPU)::

    segments (padding is one)   a a a a | b b b | P P P
    cu_seqlens (device, int32)  [0, 4, 7, 10]         what the kernels read
    host_cu_seqlens (numpy)     [0, 4, 7, 10]         what index plans are built from
    rope_positions (device)     0 1 2 3 0 1 2 0 1 2   each token's position in its segment

Under context parallelism ``host_cu_seqlens`` are the padded *global* offsets and
``rope_positions`` this rank's zigzag share of them (see
:mod:`mindspeed_pack.packing.context_parallel`). Under dynamic context parallelism a micro-batch names
its own group (megatron-core's ``local_cp_size`` and ``cp_group``; :func:`context_parallel_group`).
Index plans that attention backends derive from the layout (:func:`cached`) are built once per micro-batch, on the host, moved to the
device once and reused by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from mindspeed_pack.packing.context_parallel import segment_positions
from mindspeed_pack.packing.segments import attention_offsets


@dataclass
class ThdParams(PackedSeqParams):
    """``PackedSeqParams`` with the host's copy of the segment layout and per-token RoPE positions."""

    host_cu_seqlens: Optional[np.ndarray] = None  # int64 offsets attention runs on (padded ones under CP)
    rope_positions: Optional[torch.Tensor] = None  # [t] int64, on the model's device
    cp_size: int = 1
    cp_rank: int = 0


def context_parallel_group(params: Optional[PackedSeqParams], layer_group):
    """The CP group a micro-batch's attention communicates over: its own under dynamic context parallelism
    (``local_cp_size`` set; None when it runs on one rank), else the layer's (``--context-parallel-size``)."""
    if params is None or getattr(params, "local_cp_size", None) is None:
        return layer_group
    return params.cp_group if params.local_cp_size > 1 else None


def host_cu_seqlens(params: PackedSeqParams) -> np.ndarray:
    """The offsets attention runs on, as host integers (read from the device once if the caller built
    a plain ``PackedSeqParams``: tests and tools may; the trainer never does)."""
    host = getattr(params, "host_cu_seqlens", None)
    if host is None:
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        host = cu.detach().cpu().numpy().astype(np.int64)
        params.host_cu_seqlens = host  # read once per micro-batch, not per layer
    return host


def cached(params: PackedSeqParams, key: Any, build: Callable[[], Any]) -> Any:
    """``build()`` once per micro-batch (the params object lives exactly that long), then reused by every layer."""
    store = getattr(params, "_per_micro_batch", None)
    if store is None:  # plain attribute access: dynamo traces it in every torch the project runs on
        store = params._per_micro_batch = {}
    if key not in store:
        store[key] = build()
    return store[key]


def to_device(array: np.ndarray, device) -> torch.Tensor:
    """A host index array on ``device`` without a synchronising copy (pinned, non-blocking on CUDA)."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def packed_seq_params(batch, cp_size: int = 1, cp_rank: int = 0, cp_group=None, dynamic: bool = False) -> ThdParams:
    """THD parameters of a :class:`~mindspeed_pack.packing.segments.PackedBatch`; under CP ``cu_seqlens`` are
    the real lengths and ``*_padded`` the physical ones (Transformer Engine's convention). ``dynamic``: the
    micro-batch runs on its own CP group ``cp_group`` of ``cp_size`` ranks (None for one rank)."""
    host = batch.host_cu_seqlens if batch.host_cu_seqlens is not None else attention_offsets(batch)
    positions = segment_positions(host, cp_size, cp_rank)
    return ThdParams(
        qkv_format="thd",
        cu_seqlens_q=batch.cu_seqlens, cu_seqlens_kv=batch.cu_seqlens,
        cu_seqlens_q_padded=batch.cu_seqlens_padded, cu_seqlens_kv_padded=batch.cu_seqlens_padded,
        max_seqlen_q=batch.max_seqlen, max_seqlen_kv=batch.max_seqlen,
        host_cu_seqlens=host, rope_positions=to_device(positions, batch.tokens.device),
        cp_size=cp_size, cp_rank=cp_rank,
        local_cp_size=cp_size if dynamic else None, cp_group=cp_group if dynamic else None,
    )

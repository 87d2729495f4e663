"""Run megatron-core on a machine without CUDA (gloo backend), for tests and demos.

megatron-core assumes CUDA throughout: it allocates with ``device='cuda'`` or
``torch.cuda.current_device()``, syncs streams, forks the CUDA RNG for tensor-parallel
initialisation and asserts ``param.grad.type() == 'torch.cuda.FloatTensor'`` when clipping.
:func:`enable` redirects exactly those touch points to the CPU, once per process:

- ``torch.cuda`` device, stream, event, sync, memory and RNG helpers become CPU
  equivalents or no-ops (the CPU generator stands in for the CUDA one);
- torch's tensor factories (``torch.empty``, ``Tensor.new_zeros``, ...) and ``Tensor.to`` take a
  CUDA ``device`` argument as the CPU, and ``Tensor.cuda`` returns the tensor itself. Those
  functions are wrapped, not every torch call: a torch-function mode would do the same at a
  Python call per torch operation, everywhere (it made a CPU training step about 1.5x slower and
  put that cost in the host-time bench's eager figures, which a GPU does not pay);
- ``Tensor.type()`` reports ``torch.cuda.*`` names so megatron's dtype checks pass;
- ``torch.distributed.all_gather`` of pieces of different sizes (gloo gathers equal ones
  only) goes through padded pieces: megatron's alltoall MoE dispatcher gathers each
  tensor-parallel rank's routed tokens this way under TP x EP.

Everything CPU-specific lives here; nothing else in the project checks for it.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os

import torch

log = logging.getLogger(__name__)

_ENABLED = False


def cuda_usable() -> bool:
    return torch.cuda.is_available() and os.environ.get("MINDSPEED_PACK_FORCE_CPU", "0") != "1"


def is_enabled() -> bool:
    return _ENABLED


def _is_cuda_device(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


# every torch function and Tensor method megatron-core and the project call with a ``device`` argument
_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "range", "rand", "randn",
              "randint", "randperm", "linspace", "logspace", "eye", "empty_like", "zeros_like", "ones_like",
              "full_like", "rand_like", "randn_like", "randint_like", "empty_strided", "scalar_tensor",
              "tril_indices", "triu_indices")
_NEW_METHODS = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor", "new_empty_strided")


def _on_cpu(fn):
    """``fn`` with a CUDA ``device`` keyword argument read as the CPU."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    return call


def _redirect_devices() -> None:
    # torch's ``with torch.device(...)`` context (transformers builds models under ``torch.device("meta")``)
    # recognises factories by identity, from a set it builds once: built now, it holds torch's own functions,
    # which the wrappers call
    from torch.utils._device import _device_constructors

    _device_constructors()
    for name in _FACTORIES:
        setattr(torch, name, _on_cpu(getattr(torch, name)))
    for name in _NEW_METHODS:
        setattr(torch.Tensor, name, _on_cpu(getattr(torch.Tensor, name)))
    to_on_cpu = _on_cpu(torch.Tensor.to)

    @functools.wraps(to_on_cpu)
    def to(self, *args, **kwargs):  # ``to`` also takes the device first, positionally
        if args and _is_cuda_device(args[0]):
            args = ("cpu",) + args[1:]
        return to_on_cpu(self, *args, **kwargs)

    torch.Tensor.to = to
    torch.Tensor.cuda = lambda self, *args, **kwargs: self

    import torch.distributed as dist

    original_all_to_all = dist.all_to_all_single

    @functools.wraps(original_all_to_all)
    def all_to_all_single(*args, **kwargs):
        # megatron's MoE alltoall dispatcher passes split sizes as tensors (copied to host arrays only on a
        # GPU); the collective takes lists of ints
        for key in ("output_split_sizes", "input_split_sizes"):
            if kwargs.get(key) is not None and not isinstance(kwargs[key], list):
                kwargs[key] = [int(n) for n in kwargs[key]]
        return original_all_to_all(*args, **kwargs)

    dist.all_to_all_single = all_to_all_single


class _NullStream:
    def __init__(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NullEvent()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _NullEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def wait(self, *args, **kwargs):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def enable() -> None:
    """Install the CPU redirections (idempotent). Call before building any model."""
    global _ENABLED
    if _ENABLED:
        return
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.device_count = lambda: 1
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda *a, **k: None
    cuda.current_stream = lambda *a, **k: _NullStream()
    cuda.default_stream = lambda *a, **k: _NullStream()
    cuda.Stream = _NullStream
    cuda.Event = _NullEvent
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.memory_reserved = lambda *a, **k: 0
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # torch.manual_seed itself calls cuda.manual_seed_all: seed the CPU generator directly
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state

    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    original_type = torch.Tensor.type

    def _type(self, dtype=None, *args, **kwargs):
        if dtype is None and not args and not kwargs and self.device.type == "cpu":
            name = _CUDA_TYPE_NAMES.get(self.dtype)
            if name is not None:
                return name
        return original_type(self, dtype, *args, **kwargs)

    torch.Tensor.type = _type

    # the "CUDA" RNG *is* the CPU one here, so megatron's fork() always sees the CPU state move
    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(
        lambda record: "CPU RNG state changed within GPU RNG context" not in record.getMessage())

    _redirect_devices()
    _gather_uneven_pieces()
    _ENABLED = True
    log.info("CUDA not available: megatron-core runs on the CPU (gloo backend)")


def _gather_uneven_pieces() -> None:
    """``dist.all_gather`` into pieces of different first dimensions: gather them padded to the
    largest, then copy each piece's rows out (gloo refuses unequal sizes; NCCL takes them)."""
    import torch.distributed as dist

    original_all_gather = dist.all_gather

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if async_op or len({tuple(t.shape) for t in tensor_list}) <= 1:
            return original_all_gather(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in tensor_list)
        padded = [t.new_empty((rows, *t.shape[1:])) for t in tensor_list]
        mine = tensor.new_zeros((rows, *tensor.shape[1:]))
        mine[: tensor.shape[0]] = tensor
        original_all_gather(padded, mine, group=group)
        for out, piece in zip(tensor_list, padded):
            out.copy_(piece[: out.shape[0]])
        return None

    dist.all_gather = all_gather


def default_backend() -> str:
    return "nccl" if cuda_usable() else "gloo"


def node_and_host() -> tuple:
    """(node, host) of this process, for lines that say where a rank runs: torchrun's node rank and the host name."""
    import socket

    return os.environ.get("GROUP_RANK", "?"), socket.gethostname()

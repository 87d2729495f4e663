"""Count the calls that make the host wait for the device, for tests and benchmarks.

On a GPU the CPU queues kernels ahead of the device; any call that reads a device value back
(``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``, ``torch.tensor`` of a list holding tensors: one
read per tensor), whose output size depends on values
(``nonzero``, boolean-mask indexing, ``masked_select``, ``repeat_interleave`` without an output
size, ``unique``), or that copies from pageable host memory without ``non_blocking`` (counted
with ``device_only``, where the copy can be seen) makes the CPU stop until the queue drains, and the GPU idles while the CPU
catches up. On a CPU nothing blocks, but the code makes the same calls, so counting them on the
CPU tells what a GPU step would wait for::

    with HostSyncCounter() as syncs:
        trainer.train_step()
    print(syncs.total, syncs.by_name)

``where=True`` also records the line that made each call (:attr:`HostSyncCounter.by_place`).
"""
from __future__ import annotations

import inspect
import os
import sys
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Tensor methods that read a value back to the host
READS = {
    torch.Tensor.item: "item", torch.Tensor.tolist: "tolist", torch.Tensor.__bool__: "bool",
    torch.Tensor.__int__: "int", torch.Tensor.__float__: "float", torch.Tensor.__index__: "index",
    torch.Tensor.numpy: "numpy", torch.Tensor.cpu: "cpu",
}
# aten ops whose output shape or result needs the values first
_VALUE_SHAPED = {"nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive", "_unique", "bincount",
                 "_local_scalar_dense", "equal", "is_nonzero", "allclose"}


# (torch's own functions: on a CPU runtime/platform.py wraps them, and a mode sees the wrapped call)
_LIST_READERS = tuple(inspect.unwrap(f) for f in (torch.tensor, torch.as_tensor))


def _tensors_in(data) -> list:
    """The tensors inside a (nested) list or tuple given to ``torch.tensor``: each is read back."""
    if isinstance(data, torch.Tensor):
        return [data]
    if isinstance(data, (list, tuple)):
        return [t for item in data for t in _tensors_in(item)]
    return []


_INTERNAL = (os.path.dirname(torch.__file__), os.path.abspath(__file__), "runtime/platform.py")


def _caller() -> str:
    """``path:line`` of the innermost frame outside torch, this module and the CPU shim's function mode."""
    frame = sys._getframe(2)
    while frame is not None and any(part in frame.f_code.co_filename for part in _INTERNAL):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    for root in ("site-packages/", "mindspeed_pack/"):
        if root in path:
            path = (root if root == "mindspeed_pack/" else "") + path.split(root, 1)[1]
            break
    return f"{path}:{frame.f_lineno}"


def _aten_name(func) -> str:
    return func._overloadpacket.__name__ if hasattr(func, "_overloadpacket") else str(func)


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (indices or ()))


def _blocking_upload(name: str, args, kwargs) -> bool:
    """A host-to-device copy without ``non_blocking``: torch waits for the device's stream after it."""
    if name == "_to_copy" and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu":
        device = kwargs.get("device")
        return device is not None and torch.device(device).type != "cpu" and not kwargs.get("non_blocking")
    if name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor):
        return args[0].device.type != "cpu" and args[1].device.type == "cpu" and \
            not (args[2] if len(args) > 2 else kwargs.get("non_blocking"))
    return False


class _Reads(TorchFunctionMode):
    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _LIST_READERS and args and isinstance(args[0], (list, tuple)) \
                and not self.counter.inside:
            read = [t for t in _tensors_in(args[0]) if self.counter.counts([t])]
            if read:
                self.counter.note("tensor(list of tensors)", len(read))
                self.counter.inside += 1
                try:
                    return func(*args, **(kwargs or {}))
                finally:
                    self.counter.inside -= 1
        name = READS.get(func)
        if name is None or self.counter.inside or not self.counter.counts(args):
            return func(*args, **(kwargs or {}))
        self.counter.note(name)
        self.counter.inside += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.counter.inside -= 1


class _Ops(TorchDispatchMode):
    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.counter.inside and self.counter.counts(args, kwargs):  # a read counted above dispatches its own
            name = _aten_name(func)
            if name in _VALUE_SHAPED:
                self.counter.note(name)
            elif name in ("index", "index_put", "index_put_", "_index_put_impl_") and _has_bool_index(args):
                self.counter.note(f"{name} (boolean mask)")
            elif self.counter.device_only and _blocking_upload(name, args, kwargs):
                self.counter.note("copy from the host (blocking)")
            elif name == "repeat_interleave" and kwargs.get("output_size") is None and \
                    isinstance(args[0], torch.Tensor) and not isinstance(args[1] if len(args) > 1 else None, int):
                self.counter.note("repeat_interleave (no output_size)")
        return func(*args, **kwargs)


class HostSyncCounter:
    """Context manager counting host-device synchronisation points (:attr:`total`, :attr:`by_name`).

    ``device_only``: count only calls on tensors off the CPU (on a GPU: exactly the calls that wait for it;
    host-side work on CPU tensors is free). By default every call counts, which on a CPU is the proxy."""

    def __init__(self, device_only: bool = False, where: bool = False):
        self.by_name: Counter = Counter()
        self.by_place: Counter = Counter()  # (name, "path:line") of the caller, with ``where``
        self.inside = 0
        self.device_only = device_only
        self.where = where
        self._modes = []

    def note(self, name: str, n: int = 1) -> None:
        self.by_name[name] += n
        if self.where:
            self.by_place[(name, _caller())] += n

    def counts(self, args, kwargs=None) -> bool:
        if not self.device_only:
            return True
        device = (kwargs or {}).get("device")
        return any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args) or \
            (device is not None and torch.device(device).type != "cpu")

    def paused(self):
        """A context in which nothing is counted (host-side work inside a counted region)."""
        counter = self

        class _Paused:
            def __enter__(self):
                counter.inside += 1

            def __exit__(self, *exc):
                counter.inside -= 1
                return False

        return _Paused()

    @property
    def total(self) -> int:
        return sum(self.by_name.values())

    def __enter__(self) -> "HostSyncCounter":
        self._modes = [_Ops(self), _Reads(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        return False


if __name__ == "__main__":  # `python -m mindspeed_pack.tools.host_syncs --help` printed nothing and exited 0
    sys.exit("mindspeed_pack.tools.host_syncs is a library, not a command: use HostSyncCounter in a test or "
             "benchmark (tests/test_host_syncs.py, bench/bench_gpu_train.py); the commands are "
             "mindspeed_pack.tools.inspect_pack, compare_runs and run_summary")

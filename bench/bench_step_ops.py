"""ATen ops a training step dispatches per layer and per micro-batch on the flash path, counted on a CPU (issue 42).

On a GPU each ATen op is at least one kernel launch and some microseconds of Python and dispatcher: where the
kernels are short (Qwen2.5-0.5B at one 4096-token pack per forward) the step is bound by them. The flash kernel is
a stub here (one opaque op forward, its gradients backward: ``varlen_attn`` is one kernel each way on a GPU); the
rest of the step is the product's own code. Counted inside the forward and backward of the micro-batches (the
trainer's device step), then the optimizer step and logging apart::

    python bench/bench_step_ops.py              # per layer and micro-batch, per extra micro-batch, the step's end
    python bench/bench_step_ops.py --backend local
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.data_utils import write_packed_instruction_dataset  # noqa: E402
from tests.model_utils import TINY_FLAGS  # noqa: E402


class _Ops(TorchDispatchMode):
    """Counts every ATen op dispatched while active (by name) unless paused."""

    def __init__(self):
        super().__init__()
        self.counts, self.paused = Counter(), False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class _StubKernel(torch.autograd.Function):
    """One op forward (the output's shape), gradients backward: the flash kernel's place in the count."""

    @staticmethod
    def forward(ctx, q, k, v):
        return q.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def _use_stub_flash() -> None:
    from mindspeed_pack.model import flash_attention, spec

    spec.flash_unavailable_reason = lambda *a, **k: None
    flash_attention.varlen_attn = lambda q, k, v, *a, **kw: _StubKernel.apply(q, k, v)


def step_ops(data: str, layers: int, micro_batches: int, backend: str, extra=()) -> tuple:
    """(ops of the micro-batches' forward and backward, ops of the rest of the step) of a step after a first."""
    import posttrain
    from mindspeed_pack.config.arguments import parse_args
    from mindspeed_pack.training.stages import get_stage
    from mindspeed_pack.training.trainer import Trainer

    flags = [*TINY_FLAGS, "--data-path", data, "--neat-pack", "--seq-length", "128", "--micro-batch-size", "1",
             "--global-batch-size", str(micro_batches), "--train-iters", "2", "--lr", "1e-3", "--num-layers",
             str(layers), "--attention-backend", backend, *extra]
    args = parse_args(flags, extra_args_provider=posttrain.posttrain_args)
    stage = get_stage(args)
    trainer = Trainer(args, stage.batch_source(args), stage)
    trainer.setup()
    try:
        trainer.train_step()
        mode, device = _Ops(), Counter()
        host_step, device_step = trainer._host_step, trainer._device_step

        def host(*a, **kw):  # reading and laying out the data: host work on a GPU too
            mode.paused = True
            try:
                return host_step(*a, **kw)
            finally:
                mode.paused = False

        def on_device(*a, **kw):
            before = Counter(mode.counts)
            out = device_step(*a, **kw)
            device.update(mode.counts - before)
            return out

        trainer._host_step, trainer._device_step = host, on_device
        with mode:
            trainer.train_step()
        return device, mode.counts - device
    finally:
        trainer.cleanup()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="flash", choices=["flash", "local"])
    p.add_argument("--top", type=int, default=12, help="the most frequent ops per layer and micro-batch")
    opts = p.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if opts.backend == "flash":
        _use_stub_flash()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as root:
        data = write_packed_instruction_dataset(os.path.join(root, "copy"), num_packs=32, meta=True)
        counts = {(layers, mbs): step_ops(data, layers, mbs, opts.backend)
                  for layers, mbs in ((2, 2), (4, 2), (4, 4))}
    (d22, r22), (d42, _), (d44, r44) = counts[(2, 2)], counts[(4, 2)], counts[(4, 4)]
    per_layer = Counter({k: v for k, v in (d42 - d22).items()})
    per_layer_mb = sum(per_layer.values()) / (2 * 2)  # 2 more layers, in each of 2 micro-batches
    per_extra_mb = (sum(d44.values()) - sum(d42.values())) / 2 - 4 * per_layer_mb
    print(f"backend {opts.backend}{' (stub kernel)' if opts.backend == 'flash' else ''}; tiny model, 128-token "
          f"packs; a step after a first")
    print(f"ATen ops per layer per micro-batch (forward + backward): {per_layer_mb:.1f}")
    print(f"ATen ops per micro-batch outside the layers (embedding, loss, schedule): {per_extra_mb:.1f}")
    print(f"ATen ops of the step's end (optimizer step, grad norm, logging): {sum(r22.values())} at 2 layers, "
          f"{sum(r44.values())} at 4 layers and 4 micro-batches")
    print("most frequent per layer and micro-batch: " + ", ".join(
        f"{name} {n / 4:g}" for name, n in per_layer.most_common(opts.top)))


if __name__ == "__main__":
    main()

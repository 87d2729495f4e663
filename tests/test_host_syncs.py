"""Nothing in a training step's forward and backward waits on the device (issues 35 and 42).

Counted on the CPU with :class:`~mindspeed_pack.tools.host_syncs.HostSyncCounter` (the calls a GPU
would block on: ``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``, ``nonzero``, boolean-mask
indexing, ``torch.tensor`` of device scalars, ...), outside the host-side batch building. Per layer: 0;
per extra micro-batch: at most 1; the optimizer step: a constant number, not one per parameter tensor.
The device part of a dense step holds exactly two (megatron-core's ``num_tokens > 0`` in
``finalize_model_grads`` and the one read of the step's summed metrics), with the local and the flash
attention (its kernel's reference on a CPU), for SFT and DPO, at CP2, TP2 with sequence parallelism and PP2;
the optimizer step reads the gradient norm once (megatron-core's fallback without Apex/TE reads one norm per
parameter tensor). MoE steps: megatron-core's token dispatcher and local experts read the tokens per
expert back in every MoE layer (their own design); nothing of ours does. Reads of tensors that stay on the
host on a GPU too (megatron-core's RNG tracker comparing the CPU RNG state) are left out. With megatron-core's own THD RoPE
(a ``.tolist()`` and ``.item()`` per segment and layer) the count grows, so the test sees what it guards against.
"""
from collections import Counter
from contextlib import nullcontext

import pytest
import torch

from mindspeed_pack.config.arguments import parse_args
from mindspeed_pack.model import flash_attention, spec
from mindspeed_pack.tools.host_syncs import HostSyncCounter
from tests.data_utils import write_packed_instruction_dataset
from tests.dist_harness import run_distributed
from tests.model_utils import TINY_FLAGS
from tests.pair_utils import random_pairs, write_pair_dataset
from tests.test_flash_attention import reference_varlen

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-layer-freq", "2",
       "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.01"]
MEGATRON_MOE = "megatron/core/transformer/moe/"  # its dispatcher and experts: reads of their own
# reads of tensors that live on the host on a GPU too (megatron-core's RNG tracker compares the CPU RNG
# state when it leaves a fork: sequence parallelism's embedding dropout and block), which a CPU run counts
HOST_ONLY = ("megatron/core/tensor_parallel/random.py",)
_COUNTING = []  # the counter of the step being counted (the reference flash kernel pauses it)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("syncs")
    return {"sft": write_packed_instruction_dataset(str(root / "copy"), num_packs=32, meta=True),
            "pairs": write_pair_dataset(str(root / "pairs"), random_pairs(60, seed=11))}


class _VarlenKernel(torch.autograd.Function):
    """The reference varlen kernel as one opaque op, forward and backward, as ``varlen_attn`` is on a GPU (its
    own host reads of ``cu_seqlens`` are the reference's, not the step's)."""

    @staticmethod
    def forward(ctx, q, k, v, call):
        with _COUNTING[0].paused() if _COUNTING else nullcontext(), torch.enable_grad():
            inputs = [x.detach().requires_grad_() for x in (q, k, v)]
            out = reference_varlen(*inputs, *call[0], **call[1])
        ctx.graph = (inputs, out)
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        inputs, out = ctx.graph
        with _COUNTING[0].paused() if _COUNTING else nullcontext():
            return (*torch.autograd.grad(out, inputs, grad), None)


def _flash_on_cpu(monkeypatch):
    monkeypatch.setattr(spec, "flash_unavailable_reason", lambda *a, **k: None)
    monkeypatch.setattr(flash_attention, "varlen_attn", lambda q, k, v, *a, **kw: _VarlenKernel.apply(q, k, v, (a, kw)))


def _step_syncs(flags, megatron_rope=False):
    """(device part's counts, the rest of the step's counts, the device part's counts by calling line) of a
    training step after a first one (which builds what is built once)."""
    import posttrain
    from mindspeed_pack.training.stages import get_stage
    from mindspeed_pack.training.trainer import Trainer

    args = parse_args(flags, extra_args_provider=posttrain.posttrain_args)
    stage = get_stage(args)
    trainer = Trainer(args, stage.batch_source(args), stage)
    trainer.setup()
    try:
        if megatron_rope:
            trainer.model[0].module.rope_in_attention = False
        trainer.train_step()
        counter, device, places = HostSyncCounter(where=True), Counter(), Counter()
        host_step, device_step = trainer._host_step, trainer._device_step

        def host(*args, **kwargs):  # reading the data and laying it out happens on the host
            with counter.paused():
                return host_step(*args, **kwargs)

        def on_device(*args, **kwargs):
            before, before_places = Counter(counter.by_name), Counter(counter.by_place)
            out = device_step(*args, **kwargs)
            device.update(counter.by_name - before)
            places.update(counter.by_place - before_places)
            return out

        trainer._host_step, trainer._device_step = host, on_device
        _COUNTING.append(counter)
        try:
            with counter:
                trainer.train_step()
        finally:
            _COUNTING.pop()
        host_only = Counter({name: n for (name, place), n in places.items() if place.startswith(HOST_ONLY)})
        return dict(device - host_only), dict(counter.by_name - device), places
    finally:
        trainer.cleanup()


def _flags(data, layers, micro_batches, *extra):
    return [*TINY_FLAGS, "--data-path", data, "--neat-pack", "--seq-length", "128", "--micro-batch-size", "1",
            "--global-batch-size", str(micro_batches), "--train-iters", "2", "--lr", "1e-3",
            "--num-layers", str(layers), *extra]


def _grows_by_at_most_one_per_micro_batch(small, large, what):
    """``small`` at 2 layers x 2 micro-batches, ``large`` at 4 x 4: per layer 0 and per extra micro-batch at
    most 1 give a growth of at most 2 (1 per layer and micro-batch would give 12)."""
    growth = sum(large.values()) - sum(small.values())
    assert 0 <= growth <= 2, (what, small, large)


@pytest.mark.parametrize("backend", ["local", "flash"])
def test_host_syncs_do_not_grow_with_layers_or_micro_batches(data, backend, monkeypatch):
    if backend == "flash":
        _flash_on_cpu(monkeypatch)
    counts = {(layers, mbs): _step_syncs(_flags(data["sft"], layers, mbs, "--attention-backend", backend))
              for layers, mbs in ((2, 2), (4, 2), (4, 4))}
    device = {k: v[0] for k, v in counts.items()}
    rest = {k: v[1] for k, v in counts.items()}
    assert device[(2, 2)] == device[(4, 2)] == {"bool": 1, "cpu": 1}, device  # 0 per layer
    _grows_by_at_most_one_per_micro_batch(device[(4, 2)], device[(4, 4)], backend)
    # the optimizer step and the logging: the same whatever the layers (parameter tensors) and micro-batches
    assert rest[(2, 2)] == rest[(4, 2)] == rest[(4, 4)], rest
    assert sum(rest[(2, 2)].values()) <= 4 and "tensor(list of tensors)" not in rest[(2, 2)], rest


def test_dpo_and_moe_steps_read_nothing_of_ours_per_layer_or_micro_batch(data):
    dpo = [_step_syncs(_flags(data["pairs"], layers, mbs, "--stage", "dpo", "--dpo-beta", "0.5"))
           for layers, mbs in ((2, 2), (4, 4))]
    assert dpo[0][0] == {"bool": 1, "cpu": 1}, dpo[0][0]
    _grows_by_at_most_one_per_micro_batch(dpo[0][0], dpo[1][0], "dpo")
    assert dpo[0][1] == dpo[1][1], (dpo[0][1], dpo[1][1])
    moe = [_step_syncs(_flags(data["sft"], layers, mbs, *MOE)) for layers, mbs in ((2, 2), (4, 4))]
    ours = [Counter({k: n for k, n in places.items() if not k[1].startswith(MEGATRON_MOE)}) for _, _, places in moe]
    theirs = [sum(n for k, n in places.items() if k[1].startswith(MEGATRON_MOE)) for _, _, places in moe]
    # megatron-core's own: a fixed number per MoE layer and micro-batch (1 MoE layer x 2, then 2 x 4)
    assert theirs[0] > 0 and theirs[1] == 4 * theirs[0], theirs
    assert sum(ours[0].values()) == 2 and sum(ours[1].values()) - sum(ours[0].values()) <= 2, ours
    assert moe[0][1] == moe[1][1], (moe[0][1], moe[1][1])


def _layout_syncs(configs):

    out = []
    for name, flags in configs:
        device, rest, _ = _step_syncs(flags)
        from mindspeed_pack.runtime.process_groups import release_model_parallel
        release_model_parallel()  # the next layout builds its own groups
        out.append((name, device, rest))
    return out


@pytest.mark.slow
def test_parallel_layouts_read_nothing_per_layer_or_micro_batch(data):
    layouts = {"CP2": ["--context-parallel-size", "2"],
               "TP2+SP": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
               "PP2": ["--pipeline-model-parallel-size", "2"]}
    configs = [(f"{name} {layers}x{mbs}", _flags(data["sft"], layers, mbs, *flags))
               for name, flags in layouts.items() for layers, mbs in ((2, 2), (4, 4))]
    for rank, results in enumerate(run_distributed(_layout_syncs, 2, configs, timeout=600)):
        by_name = {name: (device, rest) for name, device, rest in results}
        for layout in layouts:
            (small, small_rest), (large, large_rest) = by_name[f"{layout} 2x2"], by_name[f"{layout} 4x4"]
            assert sum(small.values()) <= 2, (rank, layout, small)
            _grows_by_at_most_one_per_micro_batch(small, large, (rank, layout))
            assert small_rest == large_rest, (rank, layout, small_rest, large_rest)


def test_megatron_thd_rope_would_sync_in_every_layer(data):
    """Negative control: megatron-core's THD RoPE reads cu_seqlens back in every layer and micro-batch."""
    small, _, _ = _step_syncs(_flags(data["sft"], 2, 2), megatron_rope=True)
    large, _, _ = _step_syncs(_flags(data["sft"], 4, 4), megatron_rope=True)
    assert sum(large.values()) > sum(small.values()) > 2


def test_gradient_norm_of_large_cpu_gradients_is_exact():
    """The logged (and clipping) gradient norm of a 1M-element fp32 gradient on a CPU equals the fp64 norm: the
    CPU's fp32 norm kernel, adding the squares in sequence, was 9e-6 relative off, so the same gradients logged
    different norms at TP1 and TP2 (one 2M-element tensor there, two halves here)."""
    from mindspeed_pack.training.multi_tensor import foreach_l2_norm

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(1_000_000, generator=g), torch.randn(64, generator=g) * 1e-3]
    exact = sum(float(t.double().square().sum()) for t in grads) ** 0.5
    norm, _ = foreach_l2_norm(0, None, [grads], False)
    assert norm.dtype == torch.float32 and norm.shape == (1,)
    assert abs(float(norm) - exact) / exact <= 1e-7, (float(norm), exact)


def test_gradient_norm_is_read_once_and_equals_megatron_cores():
    """megatron-core's fallback l2 norm (no TE, no Apex) reads every gradient's norm back; the foreach
    kernels read the total once, with the same value, and clip the same."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    from mindspeed_pack.runtime import platform
    from mindspeed_pack.training.multi_tensor import foreach_l2_norm, foreach_scale
    from tests.model_utils import init_single_process

    platform.enable()
    init_single_process()  # get_grad_norm_fp32 all-reduces: the test also runs alone (-k), not only after the others
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=g) * s for n, s in ((1000, 1.0), (37, 100.0), (3 * 4096, 1e-3), (1, 5.0))]
    norms = {}
    for name, impl in (("megatron", utils.local_multi_tensor_l2_norm), ("foreach", foreach_l2_norm)):
        original = clip_grads.l2_norm_impl
        clip_grads.l2_norm_impl = impl
        try:
            with HostSyncCounter() as counter:
                norms[name] = clip_grads.get_grad_norm_fp32(grads)
        finally:
            clip_grads.l2_norm_impl = original
        norms[name + " reads"] = counter.total
    assert norms["megatron reads"] >= len(grads) and norms["foreach reads"] == 1, norms
    assert norms["foreach"] == pytest.approx(norms["megatron"], rel=1e-6)
    a, b = [t.clone() for t in grads], [t.clone() for t in grads]
    utils.local_multi_tensor_scale(0, None, [a, a], 0.37)
    foreach_scale(0, None, [b, b], 0.37)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    copies = [[torch.empty(t.shape, dtype=torch.bfloat16) for t in grads] for _ in range(2)]
    utils.local_multi_tensor_scale(0, None, [grads, copies[0]], 1.0)  # fp32 main -> bf16 model weights
    foreach_scale(0, None, [grads, copies[1]], 1.0)
    assert all(torch.equal(x, y) for x, y in zip(*copies))

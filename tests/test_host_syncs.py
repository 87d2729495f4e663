"""Nothing in a training step's forward and backward waits on the device (issue 35, item 2).

Counted on the CPU with :class:`~mindspeed_pack.tools.host_syncs.HostSyncCounter` (the calls a GPU
would block on: ``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``, ``nonzero``, boolean-mask
indexing, ...), outside the host-side batch building. The device part of a step holds exactly two:
megatron-core's ``num_tokens > 0`` in ``finalize_model_grads`` and the one read of the step's summed
metrics, whatever the number of layers and micro-batches; the whole step's count does not grow either.
With megatron-core's own THD RoPE (a ``.tolist()`` and ``.item()`` per segment and layer) the count grows,
so the test sees what it guards against.
"""
from collections import Counter

import pytest

from mindspeed_pack.config.arguments import parse_args
from mindspeed_pack.datasets.packed_dataset import PackedBatchSource
from mindspeed_pack.tools.host_syncs import HostSyncCounter
from tests.data_utils import write_packed_instruction_dataset
from tests.model_utils import TINY_FLAGS
from tests.train_utils import sft_trainer


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_packed_instruction_dataset(str(tmp_path_factory.mktemp("syncs") / "copy"), num_packs=16, meta=True)


def _step_syncs(data, layers, micro_batches, megatron_rope=False):
    flags = [*TINY_FLAGS, "--data-path", data, "--neat-pack", "--seq-length", "128", "--micro-batch-size", "1",
             "--global-batch-size", str(micro_batches), "--train-iters", "2", "--lr", "1e-3",
             "--num-layers", str(layers)]
    trainer = sft_trainer(parse_args(flags), PackedBatchSource())
    trainer.setup()
    try:
        if megatron_rope:
            trainer.model[0].module.rope_in_attention = False
        trainer.train_step()  # the first step builds what is built once
        counter, device = HostSyncCounter(), Counter()
        host_step, device_step = trainer._host_step, trainer._device_step

        def host(*args, **kwargs):  # reading the data and laying it out happens on the host
            with counter.paused():
                return host_step(*args, **kwargs)

        def on_device(*args, **kwargs):
            before = Counter(counter.by_name)
            out = device_step(*args, **kwargs)
            device.update(counter.by_name - before)
            return out

        trainer._host_step, trainer._device_step = host, on_device
        with counter:
            trainer.train_step()
        return dict(device), dict(counter.by_name)
    finally:
        trainer.cleanup()


def test_host_syncs_do_not_grow_with_layers_or_micro_batches(data):
    device_small, step_small = _step_syncs(data, layers=2, micro_batches=2)
    device_large, step_large = _step_syncs(data, layers=4, micro_batches=4)
    assert device_small == device_large == {"bool": 1, "cpu": 1}, (device_small, device_large)
    assert step_small == step_large, (step_small, step_large)
    assert sum(step_small.values()) <= 12, step_small  # the optimizer step's checks and the step's logging


def test_megatron_thd_rope_would_sync_in_every_layer(data):
    """Negative control: megatron-core's THD RoPE reads cu_seqlens back in every layer and micro-batch."""
    small, _ = _step_syncs(data, layers=2, micro_batches=2, megatron_rope=True)
    large, _ = _step_syncs(data, layers=4, micro_batches=4, megatron_rope=True)
    assert sum(large.values()) > sum(small.values()) > 2

"""The CPU runtime (``runtime/platform.py``): megatron-core's CUDA device arguments land on the CPU, and nothing
else changes (torch's own device contexts, which transformers builds its models under, keep working)."""
import threading

import pytest
import torch

from mindspeed_pack.runtime import platform


@pytest.fixture(scope="module", autouse=True)
def cpu_runtime():
    if platform.cuda_usable():
        pytest.skip("the CPU runtime is installed only where CUDA is not used")
    platform.enable()


def test_cuda_device_arguments_give_cpu_tensors():
    t = torch.ones(3)
    made = [torch.empty(2, device="cuda"), torch.zeros(2, dtype=torch.int, device=torch.cuda.current_device()),
            torch.tensor([1.0], device="cuda:0"), torch.arange(4, device=torch.device("cuda", 0)),
            torch.full((2,), 7.0, device=0), torch.empty_like(t, device="cuda"), t.new_zeros(3, device=0),
            t.to("cuda"), t.to(device="cuda", dtype=torch.float64), t.to(0, non_blocking=True), t.cuda()]
    assert all(m.device.type == "cpu" for m in made)
    assert made[-1] is t and made[-2].dtype == torch.float32 and made[-3].dtype == torch.float64
    assert torch.equal(made[3], torch.arange(4)) and torch.equal(made[4], torch.full((2,), 7.0))


def test_torch_device_context_still_places_factories():
    """transformers builds a model under ``torch.device("meta")`` and then loads its weights: factories the
    runtime wraps must still land on the context's device (a wrapped ``torch.arange`` left a rotary table
    uninitialised once: garbage logits from ``from_pretrained``)."""
    with torch.device("meta"):
        made = [torch.arange(4), torch.zeros(2), torch.empty(3), torch.tensor([1.0]), torch.ones(2).to(torch.float64)]
    assert all(m.device.type == "meta" for m in made)


def test_other_threads_are_redirected_too():
    """Checkpoint writers and loaders run in threads (a torch-function mode would hold in one thread only)."""
    out = []
    worker = threading.Thread(target=lambda: out.append(torch.zeros(2, device="cuda").device.type))
    worker.start()
    worker.join()
    assert out == ["cpu"]

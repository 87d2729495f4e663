"""``torch.compile`` failures in the fused elementwise regions (``model/compiled.py``) are loud, never a silently
eager (slower) run: a compile failure, in the forward or in the lazily compiled backward, is retried once and
then stops at the region's first call with an error naming ``--torch-compile-kernels off``; an error running a
compiled region (out of memory) is raised as it is and leaves the region compiled. The compiler is a stub here
(the CPU has no Triton): ``torch.compile`` returns what each test needs, tensors claim to be on CUDA."""
import pytest
import torch

from mindspeed_pack.model import compiled


class OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA (the regions compile on CUDA only)."""

    @property
    def is_cuda(self):
        return True


def _region():
    def scaled_sum(x, y):
        return x * y + 1.0

    return compiled.fused(scaled_sum)


def _inputs():
    x = torch.randn(5, requires_grad=True)
    return x.as_subclass(OnCuda), torch.randn(5)


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("triton: compilation of the backward kernel failed")


@pytest.fixture
def compiler(monkeypatch):
    """``torch.compile`` replaced by ``compiler.behaviours`` (one per compilation, the last repeats); counts."""
    state = {"behaviours": [], "compiles": 0, "calls": 0}

    def compile_stub(fn, dynamic=None):
        behaviour = state["behaviours"][min(state["compiles"], len(state["behaviours"]) - 1)]
        state["compiles"] += 1

        def run(*args):
            state["calls"] += 1
            return behaviour(fn, args, state["calls"])

        return run

    monkeypatch.setattr(torch, "compile", compile_stub)
    monkeypatch.setitem(compiled._ENABLED, "value", True)
    return state


def works(fn, args, _):
    return fn(*args)


def fails(fn, args, _):
    raise RuntimeError("triton: PTX assembly failed")


def fails_in_backward(fn, args, _):
    return _FailingBackward.apply(fn(*args))


def test_a_region_that_does_not_compile_stops_the_run_naming_the_flag(compiler):
    compiler["behaviours"] = [fails]
    region = _region()
    with pytest.raises(RuntimeError, match=r"scaled_sum failed 2 times.*--torch-compile-kernels off"):
        region(*_inputs())
    assert compiler["compiles"] == 2  # retried once


def test_a_backward_that_does_not_compile_fails_at_the_first_call_not_mid_step(compiler):
    compiler["behaviours"] = [fails_in_backward]
    region = _region()
    with pytest.raises(RuntimeError, match=r"backward kernel failed.*--torch-compile-kernels off"):
        region(*_inputs())


def test_a_failure_compiling_once_is_retried(compiler, caplog):
    compiler["behaviours"] = [fails, works]
    region = _region()
    x, y = _inputs()
    out = region(x, y)
    assert torch.equal(out, x * y + 1.0) and compiler["compiles"] == 2
    assert "attempt 1 of 2" in caplog.text
    region(x, y)
    assert compiler["compiles"] == 2  # compiled once and for all


def test_out_of_memory_running_a_compiled_region_is_raised_and_it_stays_compiled(compiler):
    def out_of_memory_on_third_call(fn, args, calls):
        if calls == 3:  # call 1: the check; call 2: the first real call
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return fn(*args)

    compiler["behaviours"] = [out_of_memory_on_third_call]
    region = _region()
    x, y = _inputs()
    region(x, y)
    with pytest.raises(torch.OutOfMemoryError):
        region(x, y)
    region(x, y)
    assert compiler["calls"] == 4 and compiler["compiles"] == 1  # not switched to eager

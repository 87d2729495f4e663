"""``gather_rows`` (``model/row_gather.py``): the packed and CP attentions' row gathers are exact and copy no
more than their output. Target rows without a source are zero and source rows no target holds get a zero
gradient, without first copying the whole input to append a zero row (under CP that was ~7 full copies of q,
k and v per layer): forward and backward are one ``index_select`` each, plus a fill of the empty rows only."""
import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mindspeed_pack.model.row_gather import gather_rows, row_plan


def _plan(sources, targets, empty, seed=0):
    """``targets`` rows: ``empty`` of them hold no source (index ``sources``); the others distinct sources."""
    rng = np.random.default_rng(seed)
    index = np.full(targets, sources)
    filled = rng.choice(targets, targets - empty, replace=False)
    index[filled] = rng.choice(sources, len(filled), replace=False)
    return index


def _reference(x, index):
    return torch.cat([x, x.new_zeros((1, *x.shape[1:]))])[torch.as_tensor(index)]


@pytest.mark.parametrize("sources,targets,empty", [(10, 14, 4), (10, 10, 0), (12, 8, 3), (6, 6, 6)])
def test_gather_rows_equals_indexing_with_a_zero_row(sources, targets, empty):
    index = _plan(sources, targets, empty)
    x = torch.randn(sources, 3, 2, dtype=torch.float64, requires_grad=True)
    got = gather_rows(x, row_plan(index, sources, "cpu"))
    ref = _reference(x, index)
    assert torch.equal(got, ref)
    weight = torch.randn_like(ref)
    g_got, = torch.autograd.grad((got * weight).sum(), x)
    g_ref, = torch.autograd.grad((ref * weight).sum(), x)
    assert torch.equal(g_got, g_ref)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_gather_rows_makes_no_copy_of_its_input():
    index = _plan(1000, 1200, 300)
    x = torch.randn(1000, 4, 8, requires_grad=True)
    plan = row_plan(index, 1000, "cpu")
    with _Ops() as ops:
        out = gather_rows(x, plan)
        out.backward(torch.ones_like(out))
    copies = [n for n in ops.names if n in ("cat", "copy_", "clone", "constant_pad_nd", "new_zeros", "zeros")]
    assert not copies, ops.names
    assert ops.names.count("index_select") == 2, ops.names  # forward and backward

"""The CPU packed attention equals dense attention under a block-diagonal causal mask."""
import pytest
import torch
import torch.nn.functional as F

from mindspeed_pack.model.packed_attention import segment_causal_attention
from mindspeed_pack.model.segment_buckets import bucket_width


def dense_reference(q, k, v, cu):
    t, h, _ = q.shape
    g = k.shape[1]
    seg = torch.zeros(t, dtype=torch.long)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        seg[a:b] = i
    mask = (seg[:, None] == seg[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    k = k.repeat_interleave(h // g, dim=1)
    v = v.repeat_interleave(h // g, dim=1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
    return o.transpose(0, 1)


@pytest.mark.parametrize("lengths", [[7, 1, 33, 130, 2, 19], [64], [16, 16, 16], [300, 5]])
@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (6, 1)])
def test_matches_block_diagonal_mask(lengths, heads, groups):
    torch.manual_seed(0)
    t = sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(t, heads, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(t, groups, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(t, groups, 8, dtype=torch.float64, requires_grad=True)
    out = segment_causal_attention(q, k, v, cu)
    ref = dense_reference(q, k, v, cu)
    assert torch.allclose(out, ref, atol=1e-10)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, atol=1e-10)


def test_bucket_width_wastes_at_most_an_eighth():
    for n in range(1, 5000):
        w = bucket_width(n)
        assert w >= n and (w - n <= 15 if n <= 128 else w <= n * 1.125 + 1)

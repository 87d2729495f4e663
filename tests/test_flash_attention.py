"""The ``flash`` backend (PyTorch's varlen FlashAttention, no Transformer Engine) is exact.

On a CPU the kernel does not run, so what the project adds around it is checked with a reference
varlen kernel of the same contract (per sequence, causal aligned to the bottom right when a sequence
has more keys than queries, as FlashAttention does): the THD call, grouped-query attention with and
without the kernel's ``enable_gqa`` flag, and the context-parallel plan (each rank's zigzag chunks
against their key prefixes) equal the local segment-causal attention, forward and backward.
With CUDA, the real kernel: packed equals each sample alone, and a model's packed logits equal
transformers' per sample (bf16).
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mindspeed_pack.model import flash_attention
from mindspeed_pack.model.flash_attention import cp_flash_attention, cp_flash_plan
from mindspeed_pack.model.packed_attention import segment_causal_attention
from mindspeed_pack.packing.context_parallel import local_rows, round_up

LENGTHS = [7, 1, 33, 130, 2, 19]


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    assert window_size == (-1, 0)  # causal
    assert enable_gqa or q.shape[1] == k.shape[1]
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    assert max_q == max(b - a for a, b in zip(cu_q, cu_q[1:])) and max_k == max(b - a for a, b in zip(cu_k, cu_k[1:]))
    out = []
    for i in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
        lq, lk = len(qs), len(ks)
        mask = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)  # bottom-right causal
        o = F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), attn_mask=mask,
                                           scale=scale, enable_gqa=enable_gqa)
        out.append(o.transpose(0, 1))
    return torch.cat(out)


@pytest.fixture
def reference_kernel(monkeypatch):
    monkeypatch.setattr(flash_attention, "varlen_attn", reference_varlen)


def _qkv(t, heads, groups, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t, n, 8, dtype=torch.float64, generator=g, requires_grad=True) for n in (heads, groups, groups)]


def _close(got, ref, inputs):
    assert torch.allclose(got, ref, atol=1e-10)
    for a, b in zip(torch.autograd.grad(got.square().sum(), inputs), torch.autograd.grad(ref.square().sum(), inputs)):
        assert torch.allclose(a, b, atol=1e-10)


@pytest.mark.parametrize("kernel_gqa", [True, False])
@pytest.mark.parametrize("heads,groups", [(4, 4), (6, 2)])
def test_flash_call_equals_segment_causal_attention(reference_kernel, monkeypatch, kernel_gqa, heads, groups):
    monkeypatch.setattr(flash_attention, "VARLEN_GQA", kernel_gqa)  # torch 2.11's varlen_attn has no GQA flag
    cu = torch.tensor(np.concatenate([[0], np.cumsum(LENGTHS)]), dtype=torch.int32)
    q, k, v = _qkv(int(cu[-1]), heads, groups)
    got = flash_attention._kernel(q, k, v, cu, cu, max(LENGTHS), max(LENGTHS), None)
    _close(got, segment_causal_attention(q, k, v, cu), (q, k, v))


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_flash_plan_equals_segment_causal_attention(reference_kernel, cp):
    """Every rank's zigzag share, attended against the gathered keys through the plan, equals the same rows
    of unsplit segment-causal attention (lengths padded to 2 x CP, as training pads them)."""
    padded = [round_up(n, 2 * cp) for n in LENGTHS]
    cu = np.concatenate([[0], np.cumsum(padded)]).astype(np.int64)
    total = int(cu[-1])
    q, k, v = _qkv(total, 6, 2, seed=1)
    ref = segment_causal_attention(q, k, v, torch.tensor(cu, dtype=torch.int32))
    rows = [torch.from_numpy(local_rows(cu, cp, r)) for r in range(cp)]
    gathered = torch.cat(rows)  # rank-major, as the all-gather returns them
    got = torch.empty_like(ref)
    shares = []
    for rank in range(cp):
        plan = cp_flash_plan(cu, cp, rank, total // cp, "cpu")
        shares.append(cp_flash_attention(q[rows[rank]], k[gathered], v[gathered], plan, None))
    got = got.index_put((torch.cat(rows),), torch.cat(shares))
    _close(got, ref, (q, k, v))


cuda = pytest.mark.skipif(not (torch.cuda.is_available() and flash_attention.HAVE_VARLEN),
                          reason="needs CUDA and torch.nn.attention.varlen")


@cuda
def test_flash_kernel_packed_equals_each_sample_alone():
    cu = torch.tensor(np.concatenate([[0], np.cumsum(LENGTHS)]), dtype=torch.int32, device="cuda")
    q, k, v = (x.detach().to("cuda", torch.bfloat16).requires_grad_() for x in _qkv(int(cu[-1]), 6, 2))
    packed = flash_attention._kernel(q, k, v, cu, cu, max(LENGTHS), max(LENGTHS), None)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        one = torch.tensor([0, b - a], dtype=torch.int32, device="cuda")
        alone = flash_attention._kernel(q[a:b], k[a:b], v[a:b], one, one, b - a, b - a, None)
        assert torch.allclose(packed[a:b].float(), alone.float(), atol=2e-3)
    ref = segment_causal_attention(q.float(), k.float(), v.float(), cu)
    assert float((packed.float() - ref).abs().max()) <= 2e-2

"""CPU kernels for PyTorch's varlen FlashAttention custom ops (``torch_attn::_varlen_attn`` and its backward), so
the ``flash`` backend runs on a CPU through the real op: the op's schema, autograd and fake (tracing) rules are
torch's; only the kernels are these references (causal attention per segment, fp32 math, explicit gradients).

:func:`use_cpu_flash` registers them (or kernels that cost nothing, for timing the rest of a step) and lets the
backend resolve without CUDA.
"""
from __future__ import annotations

import torch

_REGISTERED = []


def _segments(cu):
    cu = cu.tolist()
    return list(zip(cu, cu[1:]))


def _math(t):
    """[t, h, d] -> [h, t, d], in fp32 at least (fp64 stays fp64)."""
    return t.transpose(0, 1).to(torch.promote_types(t.dtype, torch.float32))


def _attention(q, k, v, scale, heads, groups):
    """One segment: [h, lq, d] queries against [h, lk, d] keys/values (groups expanded), bottom-right causal."""
    k, v = (t.repeat_interleave(heads // groups, 0) for t in (k, v))
    lq, lk = q.shape[1], k.shape[1]
    keep = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
    p = torch.softmax((q @ k.transpose(1, 2) * scale).masked_fill(~keep, float("-inf")), -1)
    return p, k, v


def _forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None, window_size=None,
             enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    assert is_causal, "the references are causal only (the flash backend's window_size=(-1, 0))"
    heads, groups, dim = query.shape[1], key.shape[1], query.shape[2]
    scale = dim ** -0.5 if scale is None else scale
    out = torch.empty_like(query)
    for (a, b), (c, e) in zip(_segments(cu_seq_q), _segments(cu_seq_k)):
        q, k, v = (_math(t) for t in (query[a:b], key[c:e], value[c:e]))
        p, _, v = _attention(q, k, v, scale, heads, groups)
        out[a:b] = (p @ v).transpose(0, 1).to(out.dtype)
    lse = torch.zeros(heads, query.shape[0], dtype=torch.float32)  # unused by the reference backward
    return out, lse, torch.zeros(2, dtype=torch.uint64)


def _backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, rng_state,
              scale=None, window_size=None):
    heads, groups, dim = query.shape[1], key.shape[1], query.shape[2]
    scale = dim ** -0.5 if scale is None else scale
    dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    for (a, b), (c, e) in zip(_segments(cu_seq_q), _segments(cu_seq_k)):
        q, k, v, do = (_math(t) for t in (query[a:b], key[c:e], value[c:e], grad_out[a:b]))
        p, k_h, v_h = _attention(q, k, v, scale, heads, groups)
        dp = do @ v_h.transpose(1, 2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))  # softmax backward
        per_head_k = (ds.transpose(1, 2) @ q * scale).view(groups, heads // groups, e - c, dim).sum(1)
        per_head_v = (p.transpose(1, 2) @ do).view(groups, heads // groups, e - c, dim).sum(1)
        dq[a:b] = (ds @ k_h * scale).transpose(0, 1).to(dq.dtype)
        dk[c:e] = per_head_k.transpose(0, 1).to(dk.dtype)
        dv[c:e] = per_head_v.transpose(0, 1).to(dv.dtype)
    return dq, dk, dv


def _free_forward(query, key, value, *args, **kwargs):
    """The output's shape and nothing else: a kernel that costs nothing, for timing the rest of the step."""
    return query.clone(), torch.zeros(query.shape[1], query.shape[0]), torch.zeros(2, dtype=torch.uint64)


def _free_backward(grad_out, query, key, value, *args, **kwargs):
    return grad_out.clone(), torch.zeros_like(key), torch.zeros_like(value)


KERNELS = {"reference": (_forward, _backward), "free": (_free_forward, _free_backward)}


def register_cpu_kernels(kernels: str = "reference") -> None:
    """CPU kernels for the ops (``reference``: exact attention; ``free``: shapes only, for timing)."""
    if _REGISTERED != [kernels]:
        forward, backward = KERNELS[kernels]
        torch.library.register_kernel("torch_attn::_varlen_attn", "cpu", forward)
        torch.library.register_kernel("torch_attn::_varlen_attn_backward", "cpu", backward)
        _REGISTERED[:] = [kernels]


def use_cpu_flash(kernels: str = "reference") -> None:
    """Register the CPU kernels and let ``--attention-backend flash`` resolve on a CPU, for the rest of the process
    (a rank of a test job; in the test process itself patch ``spec.flash_unavailable_reason`` with monkeypatch)."""
    from mindspeed_pack.model import spec

    register_cpu_kernels(kernels)
    spec.flash_unavailable_reason = lambda *a, **k: None

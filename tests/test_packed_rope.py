"""RoPE by position inside attention equals megatron-core's THD RoPE, without its per-layer host reads.

The local and flash backends rotate q and k by each token's position in its segment, gathered once
per micro-batch (:mod:`mindspeed_pack.model.packed_rope`); megatron-core's unfused THD RoPE splits
the tokens per segment from ``cu_seqlens.tolist()`` in every layer. Same loss and gradients (fp32,
rel <= 1e-6) for plain RoPE, llama3 scaling (megatron-core's constants and others), partial rotary
dimensions and q/k norms. Context parallelism is covered by tests/test_context_parallel_training.py
(CP2 equals CP1, each rank rotating its zigzag share).
"""
import pytest
import torch

from mindspeed_pack.model.gpt import build_gpt_model
from mindspeed_pack.packing.segments import IGNORE_INDEX, build_packed_batch
from mindspeed_pack.training.batches import packed_seq_params
from tests.model_utils import init_single_process, tiny_args

S = 80
LLAMA3 = dict(use_rope_scaling=True, rope_scaling_factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
CASES = {
    "plain": {},
    "llama3 (megatron-core's constants)": dict(LLAMA3, original_max_position_embeddings=8192),
    "llama3 (short original context)": dict(LLAMA3, original_max_position_embeddings=16),
    "partial rotary": dict(rotary_percent=0.5),
    "qk norms, head_dim 24": dict(qk_layernorm=True, kv_channels=24, add_qkv_bias=False),
}


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (1, S), generator=g)
    seg = torch.tensor([1] * 30 + [2] * 3 + [3] * 40 + [0] * 7)[None]
    labels = torch.where(seg > 0, ids, torch.full_like(ids, IGNORE_INDEX))
    return build_packed_batch(ids, labels, seg)


def _run(model, batch, rope_in_attention):
    model.rope_in_attention = rope_in_attention
    model.zero_grad()
    out = model(batch.tokens, batch.position_ids, None, labels=batch.target, packed_seq_params=packed_seq_params(batch))
    (out * batch.loss_mask).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("case", list(CASES))
def test_rope_by_position_equals_megatron_thd_rope(case):
    init_single_process()
    torch.manual_seed(0)
    model = build_gpt_model(tiny_args(seq_length=S, **CASES[case]))
    assert model.rope_in_attention  # the local backend rotates in attention by default
    batch = _batch()
    ref_loss, ref_grads = _run(model, batch, False)  # megatron-core's THD RoPE (cu_seqlens split per layer)
    loss, grads = _run(model, batch, True)
    assert _rel(loss, ref_loss) <= 1e-6
    worst = max(_rel(grads[n], ref_grads[n]) for n in grads)
    assert worst <= 1e-6, worst


def test_rope_positions_restart_in_every_segment():
    """The positions RoPE reads: 0.. in every segment (padding is one), whatever position_ids say."""
    batch = _batch()
    params = packed_seq_params(batch)
    expected = list(range(30)) + list(range(3)) + list(range(40)) + list(range(7))
    assert params.rope_positions.tolist() == expected
    assert params.host_cu_seqlens.tolist() == [0, 30, 33, 73, 80]

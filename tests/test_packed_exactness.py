"""Packed training is exact: a pack's loss and gradients equal the samples run alone.

The models run in fp64, so packed and unpacked gradients agree to ~1e-15 and anything that lets one
token of another sample into a sample's context (a leak in the attention, positions not restarted
per segment) fails by many orders of magnitude, not by a hair over an fp32 tolerance. The
per-token loss itself is computed in fp32 (the logits are cast to fp32, as megatron-core does), so
losses agree to fp32 rounding.
"""
import pytest
import torch

from mindspeed_pack.model.gpt import build_gpt_model
from mindspeed_pack.packing.segments import IGNORE_INDEX, build_packed_batch
from mindspeed_pack.training.batches import packed_seq_params
from mindspeed_pack.training.stages.sft import loss_func
from tests.model_utils import init_single_process, tiny_args

S = 96
LOSS_TOLERANCE = 1e-6  # relative: fp32 per-token losses summed in another order
GRAD_TOLERANCE = 1e-10  # relative, per parameter: fp64 weights, activations and gradients


def _fp64_model(**args):
    init_single_process()
    torch.manual_seed(0)
    return build_gpt_model(tiny_args(seq_length=S, **args)).double()


@pytest.fixture(scope="module")
def model():
    return _fp64_model()


@pytest.fixture(scope="module")
def learned_positions_model():
    """Learned absolute position embeddings read ``position_ids`` directly (RoPE takes each token's position in its
    segment from ``cu_seqlens``): the model on which positions not restarted per segment would show."""
    return _fp64_model(position_embedding_type="learned_absolute")


def _samples(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, 256, (n,), generator=g)
        labels = ids.clone()
        labels[: n // 3] = IGNORE_INDEX  # a prompt
        labels[0] = IGNORE_INDEX
        out.append((ids, labels))
    return out


def _pack(samples, length=S):
    ids = torch.zeros(length, dtype=torch.long)
    labels = torch.full((length,), IGNORE_INDEX)
    seg = torch.zeros(length, dtype=torch.long)
    pos = 0
    for k, (i, l) in enumerate(samples, start=1):
        ids[pos:pos + len(i)], labels[pos:pos + len(i)], seg[pos:pos + len(i)] = i, l, k
        pos += len(i)
    return ids[None], labels[None], seg[None]


def _loss_sum(model, ids, labels, seg, per_sample=False):
    b = build_packed_batch(ids, labels, seg, per_sample_loss=per_sample)
    out = model(b.tokens, b.position_ids, None, labels=b.target, packed_seq_params=packed_seq_params(b))
    loss, count, _ = loss_func(b, per_sample, out)
    return loss, count


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _loss_and_grads(model, *batches, per_sample=False):
    """(summed loss, normaliser, gradients of loss / normaliser) over ``batches`` run one after the other."""
    model.zero_grad()
    total, count = 0.0, 0
    for batch in batches:
        loss, n = _loss_sum(model, *batch, per_sample=per_sample)
        total, count = total + loss, count + n
    (total / count).backward()
    return total, count, _grads(model)


def _assert_equal(a, b):
    (loss_a, n_a, grads_a), (loss_b, n_b, grads_b) = a, b
    assert int(n_a) == int(n_b)
    loss = abs(loss_a.item() - loss_b.item()) / abs(loss_b.item())
    grads = max(_rel(x, y) for x, y in zip(grads_a, grads_b))
    assert loss <= LOSS_TOLERANCE and grads <= GRAD_TOLERANCE, \
        f"relative differences: loss {loss:.3g} (tolerance {LOSS_TOLERANCE}), gradients {grads:.3g} ({GRAD_TOLERANCE})"


@pytest.mark.parametrize("positions", ["rope", "learned_absolute"])
@pytest.mark.parametrize("lengths", [[10, 25, 7, 30], [50, 40], [1, 2, 90]])
def test_packed_loss_and_grads_equal_unpacked(model, learned_positions_model, lengths, positions):
    model = model if positions == "rope" else learned_positions_model
    samples = _samples(lengths)
    packed = _loss_and_grads(model, _pack(samples))
    unpacked = _loss_and_grads(model, *((ids[None], labels[None], torch.ones_like(ids)[None]) for ids, labels in samples))
    _assert_equal(packed, unpacked)


def test_all_ones_mask_leaks_attention(model):
    """Negative control: the same pack without segment ids gives a different loss."""
    samples = _samples([10, 25, 7, 30])
    ids, labels, seg = _pack(samples)
    with torch.no_grad():
        isolated = _loss_sum(model, ids, labels, seg)
        leaky = _loss_sum(model, ids, labels, None)
    assert isolated[1] == leaky[1]  # the same targets are trained ...
    assert abs(isolated[0].item() - leaky[0].item()) / isolated[0].item() > 1e-4  # ... on other contexts


def test_per_sample_loss_is_mean_of_sample_means(model):
    samples = _samples([10, 25, 7, 30])
    loss, n, grads = _loss_and_grads(model, _pack(samples), per_sample=True)
    model.zero_grad()
    means = []
    for ids, labels in samples:
        l, c = _loss_sum(model, ids[None], labels[None], torch.ones_like(ids)[None])
        means.append(l / c)
    mean = torch.stack(means).mean()
    mean.backward()
    assert int(n) == 4
    _assert_equal((loss / n, 1, grads), (mean, 1, _grads(model)))


def test_micro_batch_rows_are_isolated_from_each_other(model):
    """Two packs in one micro-batch (flattened THD) equal the packs run separately."""
    a, b = _pack(_samples([20, 30], seed=1)), _pack(_samples([60, 10], seed=2))
    _assert_equal(_loss_and_grads(model, tuple(torch.cat([x, y]) for x, y in zip(a, b))), _loss_and_grads(model, a, b))

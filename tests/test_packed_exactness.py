"""Packed training is exact: a pack's loss and gradients equal the samples run alone."""
import pytest
import torch

from mindspeed_pack.model.gpt import build_gpt_model
from mindspeed_pack.packing.segments import IGNORE_INDEX, build_packed_batch
from mindspeed_pack.training.batches import packed_seq_params
from mindspeed_pack.training.stages.sft import loss_func
from tests.model_utils import init_single_process, tiny_args

S = 96


@pytest.fixture(scope="module")
def model():
    init_single_process()
    torch.manual_seed(0)
    return build_gpt_model(tiny_args(seq_length=S))


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


@pytest.mark.parametrize("lengths", [[10, 25, 7, 30], [50, 40], [1, 2, 90]])
def test_packed_loss_and_grads_equal_unpacked(model, lengths):
    samples = _samples(lengths)
    model.zero_grad()
    loss, n = _loss_sum(model, *_pack(samples))
    packed = loss / n
    packed.backward()
    g_packed = _grads(model)

    model.zero_grad()
    total, count = 0.0, 0
    for ids, labels in samples:
        l, c = _loss_sum(model, ids[None], labels[None], torch.ones_like(ids)[None])
        total, count = total + l, count + c
    unpacked = total / count
    unpacked.backward()
    g_unpacked = _grads(model)

    assert abs(packed.item() - unpacked.item()) / unpacked.item() <= 1e-5
    assert max(_rel(a, b) for a, b in zip(g_packed, g_unpacked)) <= 1e-5


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
    with torch.no_grad():
        loss, n = _loss_sum(model, *_pack(samples), per_sample=True)
        means = []
        for ids, labels in samples:
            l, c = _loss_sum(model, ids[None], labels[None], torch.ones_like(ids)[None])
            means.append(l / c)
    assert int(n) == 4
    assert abs((loss / n).item() - torch.stack(means).mean().item()) <= 1e-5 * loss.item()


def test_micro_batch_rows_are_isolated_from_each_other(model):
    """Two packs in one micro-batch (flattened THD) equal the packs run separately."""
    a, b = _pack(_samples([20, 30], seed=1)), _pack(_samples([60, 10], seed=2))
    with torch.no_grad():
        both = _loss_sum(model, *(torch.cat([x, y]) for x, y in zip(a, b)))
        sep = [_loss_sum(model, *a), _loss_sum(model, *b)]
    assert abs(both[0].item() - (sep[0][0] + sep[1][0]).item()) <= 1e-5 * both[0].item()

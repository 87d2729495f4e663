"""DPO on packed pairs is exact: the packed loss, per-sequence log-probs and gradients equal
a per-pair unpadded computation with transformers, whatever the packing."""
import math
import types

import pytest
import torch
import torch.nn.functional as F

from mindspeed_pack.packing.segments import build_packed_batch
from mindspeed_pack.training.batches import packed_seq_params
from mindspeed_pack.training.stages.dpo import DPOStage, pair_segments, preference_losses
from mindspeed_pack.training.stages.sequences import sequence_logps
from tests.model_utils import assert_same_gradients, converted_model_pair, write_converted_tiny_qwen2
from tests.pair_utils import pack_rows, random_pairs, sequence

S = 128
BETA = 0.3


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return write_converted_tiny_qwen2(tmp_path_factory.mktemp("dpo_qwen2"))


@pytest.fixture(scope="module")
def models(converted):
    """(megatron GPTModel with the converted weights, the transformers model they came from)."""
    return converted_model_pair(converted, S)


def _stage(loss_type="sigmoid", ftx=0.0, smoothing=0.0):
    return DPOStage(types.SimpleNamespace(dpo_beta=BETA, dpo_loss_type=loss_type, dpo_label_smoothing=smoothing,
                                          dpo_ftx=ftx, ref_load=None, ref_logps=False))


def _packed_loss(model, stage, pairs, groups, ref, reports=None):
    """(loss sum, pairs, per-sequence log-probs [pairs, 2]) of ``pairs`` packed as ``groups`` in one micro-batch;
    the logged means go into ``reports`` when given."""
    ids, labels, seg = (torch.from_numpy(x) for x in pack_rows(pairs, groups, S))
    batch = build_packed_batch(ids, labels, seg)
    out = model(batch.tokens, batch.position_ids, None, labels=batch.target, packed_seq_params=packed_seq_params(batch))
    order = [j for g in groups for j in g]
    batch.ref_logps = ref[order]
    loss, count, shown = stage.loss_func(batch, out)
    for name, (total, n) in (shown.items() if reports is not None else ()):
        reports[name] = float(total / n)
    logps, _ = sequence_logps(batch, out)
    chosen, rejected = pair_segments(batch)
    mine = torch.stack([logps[chosen], logps[rejected]], 1)
    back = torch.empty_like(mine)
    back[order] = mine
    return loss, int(count), back


def _hf_logp(hf, prompt, answer):
    ids, labels = (torch.from_numpy(x) for x in sequence(prompt, answer))
    logits = hf(ids[None]).logits[0, :-1].float()
    target = labels[1:]
    mask = target != -100
    return F.log_softmax(logits, -1)[mask].gather(1, target[mask][:, None]).sum()


@pytest.mark.parametrize("loss_type,ftx,smoothing", [("sigmoid", 0.0, 0.0), ("sigmoid", 0.5, 0.1), ("ipo", 0.0, 0.0),
                                                     ("hinge", 0.0, 0.0)])
def test_packed_dpo_equals_per_pair_transformers(models, loss_type, ftx, smoothing):
    mg, hf = models
    pairs = random_pairs(5, seed=1)
    ref = torch.randn(5, 2, dtype=torch.float64) * 3 - 60
    stage = _stage(loss_type, ftx, smoothing)
    mg.zero_grad()
    reports = {}
    loss, n, logps = _packed_loss(mg, stage, pairs, [[0, 1], [2, 3, 4]], ref, reports)
    (loss / n).backward()

    hf.zero_grad()
    hf_logps = torch.stack([torch.stack([_hf_logp(hf, p, c), _hf_logp(hf, p, r)]) for p, c, r in pairs])
    # logged as TRL logs them whatever the loss: rewards are beta x (policy - reference) log-prob *sums*
    sums = hf_logps.detach().double()
    rewards = BETA * (sums - ref)
    for name, value in (("rewards/chosen", rewards[:, 0]), ("rewards/rejected", rewards[:, 1]),
                        ("rewards/margins", rewards[:, 0] - rewards[:, 1]), ("logps/chosen", sums[:, 0]),
                        ("logps/rejected", sums[:, 1]), ("rewards/accuracies", (rewards[:, 0] > rewards[:, 1]).double())):
        assert reports[name] == pytest.approx(float(value.mean()), rel=1e-5, abs=1e-5), name
    pc, pr = hf_logps[:, 0], hf_logps[:, 1]
    rc, rr = ref[:, 0].float(), ref[:, 1].float()
    if loss_type == "ipo":
        nc = torch.tensor([float(len(c)) for _, c, _ in pairs])
        nr = torch.tensor([float(len(r)) for _, _, r in pairs])
        pc, pr, rc, rr = pc / nc, pr / nr, rc / nc, rr / nr
    losses = preference_losses(pc, pr, rc, rr, BETA, loss_type, smoothing)
    if ftx:
        losses = losses + ftx * (-hf_logps[:, 0] / torch.tensor([float(len(c)) for _, c, _ in pairs]))
    expected = losses.mean()
    expected.backward()

    assert n == 5
    assert float((logps - hf_logps.detach()).abs().max() / hf_logps.abs().max()) <= 1e-5
    assert abs(float(loss / n) - float(expected)) <= 1e-5 * abs(float(expected))
    assert_same_gradients(mg, hf)


def test_packing_the_same_pairs_differently_gives_the_same_loss(models):
    mg, _ = models
    pairs = random_pairs(6, seed=2)
    ref = torch.randn(6, 2, dtype=torch.float64) - 50
    stage = _stage()
    results = []
    for groups in ([[0, 1, 2], [3, 4, 5]], [[5, 0], [1, 4], [2, 3]], [[j] for j in range(6)]):
        mg.zero_grad()
        loss, n, _ = _packed_loss(mg, stage, pairs, groups, ref)
        (loss / n).backward()
        results.append((float(loss / n), torch.cat([p.grad.reshape(-1) for p in mg.parameters()])))
    for loss, grad in results[1:]:
        assert abs(loss - results[0][0]) <= 1e-6 * abs(results[0][0])
        assert float((grad - results[0][1]).abs().max() / results[0][1].abs().max()) <= 1e-5


def test_reference_equal_to_policy_gives_log2(models):
    mg, _ = models
    pairs = random_pairs(4, seed=3)
    groups = [[0, 1], [2, 3]]
    with torch.no_grad():
        _, _, policy = _packed_loss(mg, _stage(), pairs, groups, torch.zeros(4, 2, dtype=torch.float64))
        loss, n, _ = _packed_loss(mg, _stage(), pairs, groups, policy.double())
    assert float(loss / n) == pytest.approx(math.log(2), rel=1e-7)


@pytest.mark.parametrize("loss_type,smoothing,message", [
    ("hinge", 0.1, "--dpo-label-smoothing 0.1 with --dpo-loss-type hinge: label smoothing .* sigmoid loss only"),
    ("ipo", 0.2, "--dpo-label-smoothing 0.2 with --dpo-loss-type ipo"),
    ("sigmoid", 0.5, r"--dpo-label-smoothing 0.5: .* must be in \[0, 0.5\)"),
    ("sigmoid", -0.1, "--dpo-label-smoothing -0.1: "),
])
def test_label_smoothing_is_refused_where_it_is_not_defined(loss_type, smoothing, message):
    """Conservative DPO's smoothing exists for the sigmoid loss only: under hinge and ipo it was ignored."""
    from mindspeed_pack.datasets.packed_dataset import DataError

    with pytest.raises(DataError, match=message):
        _stage(loss_type, smoothing=smoothing)


def test_a_split_pair_is_refused():
    ids, labels, seg = (torch.from_numpy(x) for x in pack_rows(random_pairs(2, seed=4), [[0, 1]], S))
    seg[seg == 4] = 0  # the second pair lost its rejected sequence
    with pytest.raises(ValueError, match="not whole"):
        pair_segments(build_packed_batch(ids, labels, seg))

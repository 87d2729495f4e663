"""The stages on packed pairs are exact: DPO's, SimPO's and ORPO's packed loss, per-sequence log-probs
and gradients equal a per-pair unpadded computation with transformers (the expected losses written
here from TRL's formulas), whatever the packing and the split into micro-batches."""
import argparse
import math

import pytest
import torch
import torch.nn.functional as F

from mindspeed_pack.datasets.packed_dataset import DataError
from mindspeed_pack.packing.segments import build_packed_batch
from mindspeed_pack.training.batches import packed_seq_params
from mindspeed_pack.training.stages import get_stage, stage_args
from mindspeed_pack.training.stages.dpo import DPOStage
from mindspeed_pack.training.stages.orpo import log_odds_ratio
from mindspeed_pack.training.stages.sequences import pair_segments, sequence_logps
from tests.model_utils import assert_same_gradients, converted_model_pair, write_converted_tiny_qwen2
from tests.pair_utils import pack_rows, random_pairs, sequence

S = 128
BETA = 0.3
SIMPO_BETA, GAMMA_BETA_RATIO = 2.0, 0.4
ORPO_BETA = 0.25


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return write_converted_tiny_qwen2(tmp_path_factory.mktemp("dpo_qwen2"))


@pytest.fixture(scope="module")
def models(converted):
    """(megatron GPTModel with the converted weights, the transformers model they came from)."""
    return converted_model_pair(converted, S)


def _args(stage, *flags):
    """The stage flags as posttrain.py parses them (``--stage`` and the flags of mindspeed_pack.training.stages)."""
    p = stage_args(argparse.ArgumentParser())
    p.add_argument("--stage")
    return p.parse_args(["--stage", stage, "--dpo-beta", str(BETA), "--simpo-beta", str(SIMPO_BETA),
                         "--gamma-beta-ratio", str(GAMMA_BETA_RATIO), "--orpo-beta", str(ORPO_BETA), *flags])


def _stage(loss_type="sigmoid", ftx=0.0, smoothing=0.0, stage="dpo"):
    prefix = "simpo" if stage == "simpo" else "dpo"
    return get_stage(_args(stage, f"--{prefix}-loss-type", loss_type, f"--{prefix}-label-smoothing", str(smoothing),
                           *(["--pref-ftx", str(ftx)] if ftx else [])))


def _packed_loss(model, stage, pairs, layout, ref=None, reports=None):
    """(loss sum, pairs, per-sequence log-probs [pairs, 2]) of ``pairs`` packed as ``layout``: micro-batches
    of rows, each row a list of pairs (``[[0, 1], [2, 3, 4]]`` one micro-batch of two rows). DPO gets the
    reference log-probs ``ref``; the other stages prepare the step as the trainer does. The logged means
    over the whole step go into ``reports`` when given."""
    batches = []
    for rows in layout:
        ids, labels, seg = (torch.from_numpy(x) for x in pack_rows(pairs, rows, S))
        batch = build_packed_batch(ids, labels, seg)
        if isinstance(stage, DPOStage):
            batch.ref_logps = ref[[j for row in rows for j in row]]
        batches.append(batch)
    if not isinstance(stage, DPOStage):
        stage.prepare(None, batches, None, "train", S)
    loss, count, totals, mine = 0, 0, {}, []
    for batch in batches:
        out = model(batch.tokens, batch.position_ids, None, labels=batch.target,
                    packed_seq_params=packed_seq_params(batch))
        part, n, shown = stage.loss_func(batch, out)
        loss, count = loss + part, count + int(n)
        for name, pair in shown.items():
            totals[name] = totals.get(name, 0) + pair
        logps, _ = sequence_logps(batch, out)
        chosen, rejected = pair_segments(batch)
        mine.append(torch.stack([logps[chosen], logps[rejected]], 1))
    if reports is not None:
        reports.update({name: float(total / n) for name, (total, n) in totals.items()})
    order = [j for rows in layout for row in rows for j in row]
    back = torch.empty(len(order), 2)
    back[order] = torch.cat(mine)
    return loss, count, back


def _hf_sequence(hf, prompt, answer):
    """(logits, targets) of prompt + answer under transformers, shifted: position t predicts token t + 1."""
    ids, labels = (torch.from_numpy(x) for x in sequence(prompt, answer))
    return hf(ids[None]).logits[0, :-1].float(), labels[1:]


def _hf_logp(hf, prompt, answer):
    logits, target = _hf_sequence(hf, prompt, answer)
    mask = target != -100
    return F.log_softmax(logits, -1)[mask].gather(1, target[mask][:, None]).sum()


def _margin_losses(z, beta, loss_type, smoothing):
    """TRL's sigmoid (with label smoothing), hinge and IPO losses of a margin ``z``."""
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * z) * (1 - smoothing) - F.logsigmoid(-beta * z) * smoothing
    if loss_type == "hinge":
        return torch.relu(1 - beta * z)
    return (z - 1 / (2 * beta)) ** 2


def _expected(stage, hf, pairs, sums, ref, loss_type, ftx, smoothing):
    """(step loss, {logged name: value}) of ``pairs`` from transformers' per-sequence log-prob ``sums``
    [pairs, 2], through TRL's formulas (DPOTrainer, CPOTrainer's simpo, ORPOTrainer)."""
    lengths = torch.tensor([[float(len(c)), float(len(r))] for _, c, r in pairs])
    means = sums / lengths
    sft = ftx * -means[:, 0]
    if stage == "dpo":  # log-prob sums (ipo: per-token means, in the loss and in what is logged: TRL divides
        # concatenated_forward's logps by the trained tokens for ipo, so its rewards and logps/* are means too)
        scale = lengths if loss_type == "ipo" else 1.0
        diff = (sums - ref.float()) / scale
        loss = (_margin_losses(diff[:, 0] - diff[:, 1], BETA, loss_type, smoothing) + sft).mean()
        rewards, logps, other = BETA * diff, sums / scale, {}
    elif stage == "simpo":  # TRL: logits = mean_c - mean_r - simpo_gamma / beta (MindSpeed-LLM: its hinge and ipo too)
        z = means[:, 0] - means[:, 1] - GAMMA_BETA_RATIO
        loss = (_margin_losses(z, SIMPO_BETA, loss_type, smoothing) + sft).mean()
        rewards, logps, other = SIMPO_BETA * means, means, {}
    else:  # ORPO: nn.CrossEntropyLoss over every chosen answer token of the batch, minus beta x mean log sigmoid
        chosen = [_hf_sequence(hf, p, c) for p, c, _ in pairs]
        nll = F.cross_entropy(torch.cat([x for x, _ in chosen]), torch.cat([t for _, t in chosen]), ignore_index=-100)
        lc, lr = means[:, 0], means[:, 1]
        log_odds = (lc - lr) - (torch.log1p(-torch.exp(lc)) - torch.log1p(-torch.exp(lr)))
        ratio = F.logsigmoid(log_odds)
        loss = nll - (ORPO_BETA * ratio).mean()
        rewards, logps = ORPO_BETA * means, means
        other = {"nll_loss": nll, "log_odds_ratio": ratio.mean(), "log_odds_chosen": log_odds.mean()}
    rewards = rewards.detach()
    logged = {"rewards/chosen": rewards[:, 0].mean(), "rewards/rejected": rewards[:, 1].mean(),
              "rewards/margins": (rewards[:, 0] - rewards[:, 1]).mean(),
              "rewards/accuracies": (rewards[:, 0] > rewards[:, 1]).float().mean(),
              "logps/chosen": logps[:, 0].mean(), "logps/rejected": logps[:, 1].mean(), **other, "lm loss": loss}
    return loss, {name: float(value) for name, value in logged.items()}


CASES = [("dpo", "sigmoid", 0.0, 0.0), ("dpo", "sigmoid", 0.5, 0.1), ("dpo", "ipo", 0.0, 0.0), ("dpo", "hinge", 0.0, 0.0),
         ("simpo", "sigmoid", 0.0, 0.0), ("simpo", "sigmoid", 0.5, 0.1), ("simpo", "ipo", 0.0, 0.0),
         ("simpo", "hinge", 0.0, 0.0), ("orpo", "sigmoid", 0.0, 0.0)]


@pytest.mark.parametrize("stage,loss_type,ftx,smoothing", CASES)
def test_packed_loss_equals_per_pair_transformers(models, stage, loss_type, ftx, smoothing):
    """Step-1 loss, gradients and every logged metric of 5 pairs packed in two rows equal transformers'
    per-sequence log-probs put through TRL's formulas (fp32, rel 1e-5)."""
    mg, hf = models
    pairs = random_pairs(5, seed=1)
    ref = torch.randn(5, 2, dtype=torch.float64) * 3 - 60
    mine = _stage(loss_type, ftx, smoothing, stage)
    mg.zero_grad()
    reports = {}
    loss, n, logps = _packed_loss(mg, mine, pairs, [[[0, 1], [2, 3, 4]]], ref, reports)
    (loss / n).backward()

    hf.zero_grad()
    hf_logps = torch.stack([torch.stack([_hf_logp(hf, p, c), _hf_logp(hf, p, r)]) for p, c, r in pairs])
    expected, logged = _expected(stage, hf, pairs, hf_logps, ref, loss_type, ftx, smoothing)
    expected.backward()

    assert n == 5
    assert set(reports) == {"lm loss", *mine.metric_names}
    for name, value in logged.items():
        assert reports[name] == pytest.approx(value, rel=1e-5, abs=1e-5), name
    assert float((logps - hf_logps.detach()).abs().max() / hf_logps.abs().max()) <= 1e-5
    assert abs(float(loss / n) - float(expected)) <= 1e-5 * abs(float(expected))
    assert_same_gradients(mg, hf, rel=1e-5)


@pytest.mark.parametrize("stage", ["dpo", "simpo", "orpo"])
def test_packing_the_same_pairs_differently_gives_the_same_loss(models, stage):
    """Rows of several pairs, other rows, one pair per micro-batch: the same loss and gradients (ORPO's
    NLL term is a per-token mean over the whole step's chosen answers, whatever the micro-batches)."""
    mg, _ = models
    pairs = random_pairs(6, seed=2)
    ref = torch.randn(6, 2, dtype=torch.float64) - 50
    mine = _stage(stage=stage)
    results = []
    for layout in ([[[0, 1, 2], [3, 4, 5]]], [[[5, 0], [1, 4]], [[2, 3]]], [[[j]] for j in range(6)]):
        mg.zero_grad()
        loss, n, _ = _packed_loss(mg, mine, pairs, layout, ref)
        (loss / n).backward()
        results.append((float(loss / n), torch.cat([p.grad.reshape(-1) for p in mg.parameters()])))
    for loss, grad in results[1:]:
        assert abs(loss - results[0][0]) <= 1e-6 * abs(results[0][0])
        assert float((grad - results[0][1]).abs().max() / results[0][1].abs().max()) <= 1e-5


def test_reference_equal_to_policy_gives_log2(models):
    mg, _ = models
    pairs = random_pairs(4, seed=3)
    groups = [[[0, 1], [2, 3]]]
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
    with pytest.raises(DataError, match=message):
        _stage(loss_type, smoothing=smoothing)
    with pytest.raises(DataError, match=message.replace("dpo", "simpo")):  # SimPO's flags, the same rule
        _stage(loss_type, smoothing=smoothing, stage="simpo")


@pytest.mark.parametrize("stage,flags,message", [
    ("simpo", ["--ref-load", "ckpt/ref"], "--stage simpo is reference-free .*: drop --ref-load"),
    ("simpo", ["--ref-logps"], "--stage simpo is reference-free .*: drop --ref-logps"),
    ("orpo", ["--ref-load", "ckpt/ref"], "--stage orpo is reference-free .*: drop --ref-load"),
    ("orpo", ["--pref-ftx", "0.2"], "--pref-ftx 0.2 with --stage orpo: ORPO's loss holds its own NLL term"),
    ("orpo", ["--dpo-ftx", "0.2"], "--pref-ftx 0.2 with --stage orpo"),
])
def test_reference_free_stages_refuse_what_they_would_ignore(stage, flags, message):
    with pytest.raises(DataError, match=message):
        get_stage(_args(stage, *flags))


def test_dpo_ftx_is_pref_ftx():
    """MindSpeed-LLM's --pref-ftx and the older --dpo-ftx are one flag: DPO's and SimPO's SFT weight."""
    assert _args("dpo", "--dpo-ftx", "0.3").pref_ftx == _args("simpo", "--pref-ftx", "0.3").pref_ftx == 0.3


def test_orpo_log_odds_stay_finite_for_a_certain_answer():
    """A chosen answer whose every token has probability 1 in fp32 (mean log-prob 0): log(1 - p) would be
    -inf and the gradient NaN; the log-odds are large and finite, and so is the gradient."""
    chosen = torch.zeros(2, requires_grad=True)
    rejected = torch.tensor([-1.0, -0.5], requires_grad=True)
    loss = -F.logsigmoid(log_odds_ratio(chosen, rejected)).sum()
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(chosen.grad).all() and torch.isfinite(rejected.grad).all()
    # away from 0 it is TRL's log1p(-exp(l)) form
    lc, lr = torch.tensor([-0.3, -4.0]), torch.tensor([-2.0, -0.01])
    trl = (lc - lr) - (torch.log1p(-torch.exp(lc)) - torch.log1p(-torch.exp(lr)))
    assert torch.allclose(log_odds_ratio(lc, lr), trl, rtol=1e-6)


def test_a_split_pair_is_refused():
    ids, labels, seg = (torch.from_numpy(x) for x in pack_rows(random_pairs(2, seed=4), [[0, 1]], S))
    seg[seg == 4] = 0  # the second pair lost its rejected sequence
    with pytest.raises(ValueError, match="not whole"):
        pair_segments(build_packed_batch(ids, labels, seg))


@pytest.mark.parametrize("stage,dropout,warned", [("dpo", "0.1", True), ("kto", "0.1", True), ("dpo", "0", False),
                                                  ("simpo", "0.1", False)])
def test_a_reference_stage_under_dropout_warns(caplog, stage, dropout, warned):
    """A Megatron --load keeps Megatron-LM's dropout 0.1: DPO's first loss is then not log 2 (README said it was)."""
    import logging

    from mindspeed_pack.config.arguments import parse_args
    from tests.model_utils import TINY_FLAGS

    with caplog.at_level(logging.WARNING, logger="mindspeed_pack.config.arguments"):
        parse_args([*TINY_FLAGS, "--data-path", "x", "--seq-length", "64", "--global-batch-size", "2", "--train-iters",
                    "1", "--stage", stage, "--attention-dropout", dropout], extra_args_provider=stage_args)
    assert any("with dropout on" in r.getMessage() for r in caplog.records) == warned

"""Reward models on packed data are exact: the outcome reward model's per-sample rewards, Bradley-Terry loss
and gradients equal transformers' ``Qwen2ForSequenceClassification`` run on each sample alone, and the process
reward model's step predictions, loss and gradients equal ``Qwen2ForCausalLM``'s logits at the step tags of
each sample alone, whatever the packing."""
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mindspeed_pack.packing.segments import build_packed_batch, reward_positions
from mindspeed_pack.training.batches import packed_seq_params
from mindspeed_pack.training.stages.reward_models import (OutcomeRewardStage, ProcessRewardStage, bradley_terry_losses,
                                                          step_logits)
from tests.model_utils import assert_same_gradients, converted_model_pair, write_converted_tiny_qwen2
from tests.pair_utils import hf_reward, packed_orm, random_pairs
from tests.step_utils import MINUS, PLUS, TAG, pack_step_rows, random_step_samples

S = 128
PAD = 0  # the pad token the reward is pooled by (transformers' pad_token_id)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return write_converted_tiny_qwen2(tmp_path_factory.mktemp("reward_qwen2"))


@pytest.fixture(scope="module")
def reward_models(converted):
    """(megatron reward model: the converted weights and a drawn score head, transformers' sequence classifier
    with the same weights)."""
    import os

    import transformers

    from mindspeed_pack.checkpoint.save_load import load_weights
    from mindspeed_pack.model.gpt import build_gpt_model
    from tests.model_utils import init_single_process, tiny_args

    init_single_process()
    args = tiny_args(seq_length=S, tensor_model_parallel_size=1, pipeline_model_parallel_size=1, reward_head=True,
                     finetune=True)
    mg = build_gpt_model(args)
    load_weights(args, converted, mg)  # a language model's weights: the head stays as drawn
    with torch.no_grad():
        mg.score.weight.copy_(0.3 * torch.randn(mg.score.weight.shape, generator=torch.Generator().manual_seed(5)))
    hf_dir = os.path.join(os.path.dirname(converted), "hf")
    config = transformers.AutoConfig.from_pretrained(hf_dir, num_labels=1, pad_token_id=PAD)
    hf = transformers.Qwen2ForSequenceClassification.from_pretrained(hf_dir, config=config, dtype=torch.float32,
                                                                     attn_implementation="eager")
    with torch.no_grad():
        hf.score.weight.copy_(mg.score.weight)
    return mg, hf


def _orm_stage(center=0.0):
    return OutcomeRewardStage(types.SimpleNamespace(center_rewards_coefficient=center, reward_pad_token_id=PAD))


def _pairs_with_pads():
    """Random pairs; one answer ends with pad tokens and one holds a pad inside: the reward is read at the last
    token that is not a pad (transformers' pooling), not at the segment's last token."""
    pairs = random_pairs(5, seed=1)
    p, c, r = pairs[1]
    pairs[1] = (p, np.concatenate([c, [PAD, PAD]]), r)
    p, c, r = pairs[3]
    r = r.copy()
    r[1] = PAD
    pairs[3] = (p, c, r)
    return pairs


@pytest.mark.parametrize("center,with_margins", [(0.0, False), (0.05, True)])
def test_packed_orm_equals_per_sample_transformers(reward_models, center, with_margins):
    """TRL's RewardTrainer loss: -log sigmoid(r_c - r_r - margin) + center (r_c + r_r)^2, averaged over pairs."""
    mg, hf = reward_models
    pairs = _pairs_with_pads()
    margins = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5]) if with_margins else None
    stage = _orm_stage(center)
    mg.zero_grad()
    reports = {}
    loss, n, rewards = packed_orm(mg, stage, pairs, [[0, 1], [2, 3, 4]], S, reports, margins)
    (loss / n).backward()

    hf.zero_grad()
    theirs = torch.stack([torch.stack([hf_reward(hf, p, c), hf_reward(hf, p, r)]) for p, c, r in pairs])
    expected = bradley_terry_losses(theirs[:, 0], theirs[:, 1], center, margins).mean()
    if with_margins:  # spelled out: the margin is subtracted from the reward difference
        assert abs(float(expected) - float((-F.logsigmoid(theirs[:, 0] - theirs[:, 1] - margins)
                                            + center * (theirs[:, 0] + theirs[:, 1]) ** 2).mean())) <= 1e-7
    expected.backward()

    assert n == 5
    assert float((rewards - theirs.detach()).abs().max() / theirs.abs().max()) <= 1e-5
    assert abs(float(loss / n) - float(expected)) <= 1e-5 * abs(float(expected))
    t = theirs.detach().double()
    for name, value in (("lm loss", expected.detach()), ("rewards/chosen", t[:, 0]), ("rewards/rejected", t[:, 1]),
                        ("rewards/margins", t[:, 0] - t[:, 1]), ("rewards/accuracies", (t[:, 0] > t[:, 1]).double())):
        assert reports[name] == pytest.approx(float(value.mean()), rel=1e-5, abs=1e-6), name
    # transformers' embedding never trains the pad_token_id row (nn.Embedding's padding_idx); the pads inside
    # these samples train it here: that row is left out
    g_mg = {k: p.grad[PAD + 1:] if "embed" in k else p.grad for k, p in mg.named_parameters()}
    g_hf = {k: p.grad[PAD + 1:] if "embed" in k else p.grad for k, p in hf.named_parameters()}
    for mine, their in (("score.weight", "score.weight"), ("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
                        ("decoder.final_layernorm.weight", "model.norm.weight")):
        assert float((g_mg[mine] - g_hf[their]).abs().max() / g_hf[their].abs().max()) <= 1e-4, mine
    norm = lambda grads: torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))  # noqa: E731
    assert abs(float(norm(g_mg) / norm(g_hf)) - 1) <= 1e-4


def test_packing_the_same_pairs_differently_gives_the_same_orm_loss(reward_models):
    mg, _ = reward_models
    pairs = random_pairs(6, seed=2)
    with torch.no_grad():
        results = [packed_orm(mg, _orm_stage(), pairs, groups, S)
                   for groups in ([[0, 1, 2], [3, 4, 5]], [[5, 0], [1, 4], [2, 3]], [[j] for j in range(6)])]
    for loss, n, rewards in results[1:]:
        assert abs(float(loss / n) - float(results[0][0] / results[0][1])) <= 1e-6
        assert float((rewards - results[0][2]).abs().max()) <= 1e-5


def test_reward_is_read_at_the_last_token_that_is_not_the_pad():
    ids = torch.tensor([[5, 6, 7, 0, 8, 0, 0, 0, 9, 9]])
    seg = torch.tensor([[1, 1, 1, 1, 2, 2, 3, 3, 0, 0]])
    assert reward_positions(ids, seg, 0).tolist() == [[0, 0, 1, 0, 1, 0, 1, 0, 0, 0]]  # an all-pad sample: its first
    assert reward_positions(ids, seg, None).tolist() == [[0, 0, 0, 1, 0, 1, 0, 1, 0, 0]]
    # rows of a micro-batch: a sample never runs on into the next row
    rows = torch.tensor([[5, 6], [7, 8]]), torch.tensor([[1, 1], [1, 1]])
    assert reward_positions(*rows, 0).tolist() == [[0, 1], [0, 1]]


# ----------------------------------------------------------------------------------------- process reward model
@pytest.fixture(scope="module")
def lm_models(converted):
    return converted_model_pair(converted, S)


def _prm_stage():
    stage = ProcessRewardStage(types.SimpleNamespace())
    stage.reward_token_ids = (PLUS, MINUS)
    return stage


def test_packed_prm_equals_per_sample_transformers(lm_models):
    mg, hf = lm_models
    samples = random_step_samples(6, seed=3)
    groups = [[0, 1, 2], [3, 4, 5]]
    stage = _prm_stage()
    ids, labels, seg = (torch.from_numpy(x) for x in pack_step_rows(samples, groups, S))
    batch = build_packed_batch(ids, labels, seg)
    stage.prepare(None, [batch], [{"labels": labels}], "train", S)
    mg.zero_grad()
    out = mg(batch.tokens, batch.position_ids, None, labels=None, packed_seq_params=packed_seq_params(batch))
    loss, count, reports = stage.loss_func(batch, out)
    (loss / count).backward()
    tags = batch.step_mask[0].bool()
    mine = step_logits(batch, out, stage.reward_token_ids)[0][tags].detach()

    hf.zero_grad()
    theirs, classes = [], []
    for j in [j for g in groups for j in g]:
        sample_ids, sample_labels = (torch.from_numpy(x) for x in samples[j])
        logits = hf(sample_ids[None]).logits[0]
        at = sample_labels != -100
        assert bool((sample_ids[at] == TAG).all())
        theirs.append(logits[at][:, [PLUS, MINUS]])
        classes.append((sample_labels[at] == MINUS).long())
    theirs, classes = torch.cat(theirs), torch.cat(classes)
    expected = F.cross_entropy(theirs, classes)
    expected.backward()

    assert int(count) == len(classes) > 10
    assert float((mine - theirs.detach()).abs().max() / theirs.abs().max()) <= 1e-5
    assert torch.equal(mine.argmax(-1), theirs.detach().argmax(-1))
    assert abs(float(loss / count) - float(expected)) <= 1e-5 * abs(float(expected))
    accuracy = float((theirs.argmax(-1) == classes).double().mean())
    assert float(reports["accuracy"][0] / reports["accuracy"][1]) == pytest.approx(accuracy, abs=1e-6)
    assert_same_gradients(mg, hf)


def test_a_prm_label_that_is_not_a_reward_token_is_refused():
    from mindspeed_pack.datasets.packed_dataset import DataError

    samples = random_step_samples(2, seed=4)
    ids, labels, seg = (torch.from_numpy(x) for x in pack_step_rows(samples, [[0, 1]], S))
    labels[0, int(torch.nonzero(labels[0] != -100)[0])] = 77
    with pytest.raises(DataError, match="not a reward token"):
        _prm_stage().prepare(None, [build_packed_batch(ids, labels, seg)], [{"labels": labels}], "train", S)

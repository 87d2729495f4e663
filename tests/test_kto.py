"""KTO on packed couples is exact: the step's loss, its logged numbers and its gradients equal TRL's
KTOTrainer formulas on transformers log-probs of each sequence alone, whatever the packing."""
import types

import pytest
import torch
import torch.nn.functional as F

from mindspeed_pack.datasets.packed_dataset import DataError, PackedDocuments, micro_batch
from mindspeed_pack.training.batches import host_packed_batch, packed_seq_params
from mindspeed_pack.training.stages.kto import KTOLabels, KTOStage
from mindspeed_pack.training.stages.reference import Reference
from tests.model_utils import assert_same_gradients, converted_model_pair, write_converted_tiny_qwen2
from tests.pair_utils import kto_couples, random_kto_rows, sequence, write_kto_dataset

S = 128
BETA, WD, WU = 0.3, 0.8, 1.3
LAYOUT = types.SimpleNamespace(seq_length=S, isolate_segments=True, reset_position_ids=True, per_sample_loss=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two different tiny Qwen2s: {name: (megatron GPTModel, the transformers model it was converted from)}."""
    root = tmp_path_factory.mktemp("kto_qwen2")
    return {name: converted_model_pair(write_converted_tiny_qwen2(root / name, seed=seed), S)
            for name, seed in (("a", 0), ("b", 1))}


def _stage(**flags):
    return KTOStage(types.SimpleNamespace(**{"kto_beta": BETA, "kto_desirable_weight": WD, "kto_undesirable_weight": WU,
                                             "ref_load": None, "ref_logps": False, **flags}))


def _packed_step(policy, reference, prefix, micro_batches, stage=None):
    """One step of ``stage`` over the packs of ``prefix``, ``micro_batches`` (pack indices per micro-batch), as
    the trainer runs it: prepare, then each micro-batch's loss backward divided by the step's count.
    Returns (loss, {report: mean})."""
    docs = PackedDocuments(prefix)
    stage = stage or _stage()
    stage.labels, stage.reference = {prefix: KTOLabels(docs)}, Reference([reference])
    trainer = types.SimpleNamespace(model=[policy], source=types.SimpleNamespace(
        splits={"train": types.SimpleNamespace(docs=docs)}))
    raw = []
    for packs in micro_batches:
        mb = micro_batch([docs.get(d) for d in packs], LAYOUT, isolate=True)
        mb["documents"] = packs
        raw.append(mb)
    tokens = S * len(micro_batches[0])
    batches = stage.prepare(trainer, [host_packed_batch(mb, LAYOUT) for mb in raw], raw, "train", tokens)
    count = sum(int(stage.count(b)) for b in batches)
    policy.zero_grad()
    loss, sums = 0.0, {}
    for b in batches:
        out = policy(b.tokens, b.position_ids, None, labels=b.target, packed_seq_params=packed_seq_params(b))
        total, _, reports = stage.loss_func(b, out)
        (total / count).backward()
        loss += float(total) / count
        for name, value in reports.items():
            sums[name] = sums.get(name, 0) + value.detach().double()
    return loss, {name: float(s / n) if n else float("nan") for name, (s, n) in sums.items()}


def _hf_logp(hf, prompt, answer):
    ids, labels = (torch.from_numpy(x) for x in sequence(prompt, answer))
    logits = hf(ids[None]).logits[0, :-1].float()
    target = labels[1:]
    mask = target != -100
    return F.log_softmax(logits, -1)[mask].gather(1, target[mask][:, None]).sum()


def _trl_step(policy, reference, rows, labels):
    """TRL KTOTrainer's loss (get_batch_loss_metrics / kto_loss, loss_type "kto") of the batch ``rows`` on
    transformers models, backward on ``policy``; returns (loss, metrics, raw KL before the clamp)."""
    couples = kto_couples(rows)
    policy.zero_grad()
    completion = torch.stack([_hf_logp(policy, p, c) for p, c, _ in couples])
    policy_kl = torch.stack([_hf_logp(policy, p, k) for p, _, k in couples])
    with torch.no_grad():
        ref_completion = torch.stack([_hf_logp(reference, p, c) for p, c, _ in couples])
        ref_kl = torch.stack([_hf_logp(reference, p, k) for p, _, k in couples])
    chosen = [i for i, label in enumerate(labels) if label is True]
    rejected = [i for i, label in enumerate(labels) if label is False]
    raw = (policy_kl - ref_kl).mean().detach()
    kl = raw.clamp(min=0)
    chosen_logratios = completion[chosen] - ref_completion[chosen]
    rejected_logratios = completion[rejected] - ref_completion[rejected]
    chosen_losses = 1 - F.sigmoid(BETA * (chosen_logratios - kl))
    rejected_losses = 1 - F.sigmoid(BETA * (kl - rejected_logratios))
    loss = torch.cat((WD * chosen_losses, WU * rejected_losses), 0).nanmean()
    loss.backward()
    metrics = {"kl": float(kl), "rewards/chosen": float(BETA * chosen_logratios.detach().mean()),
               "rewards/rejected": float(BETA * rejected_logratios.detach().mean()),
               "logps/chosen": float(completion[chosen].detach().mean()),
               "logps/rejected": float(completion[rejected].detach().mean())}
    return float(loss), metrics, float(raw)


# (policy, reference): one way round the raw KL estimate is positive, the other way it is clamped to 0
@pytest.mark.parametrize("policy,ref,kl_positive", [("a", "b", True), ("b", "a", False)])
def test_packed_kto_equals_trl_on_transformers_packed_two_ways(models, tmp_path, policy, ref, kl_positive):
    rows, labels = random_kto_rows(6, seed=1)
    assert 0 < sum(labels) < 6
    # the same global batch: 2 micro-batches of one pack of 3 couples, or 3 micro-batches of 2 packs of 1
    two = write_kto_dataset(str(tmp_path / "two"), rows, labels, S, groups=[[0, 1, 2], [3, 4, 5]])
    six = write_kto_dataset(str(tmp_path / "six"), rows, labels, S, groups=[[5], [0], [1], [4], [2], [3]])
    (mg, hf), (ref_mg, ref_hf) = models[policy], models[ref]
    expected, metrics, raw = _trl_step(hf, ref_hf, rows, labels)
    assert (raw > 0) == kl_positive and abs(raw) > 1e-2
    for prefix, micro_batches in ((two, [[0], [1]]), (six, [[0, 1], [2, 3], [4, 5]])):
        loss, reports = _packed_step(mg, ref_mg, prefix, micro_batches)
        assert abs(loss - expected) <= 1e-5 * abs(expected), (prefix, loss, expected)
        assert reports["lm loss"] == pytest.approx(expected, rel=1e-5)
        for name, value in metrics.items():
            assert reports[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
        assert_same_gradients(mg, hf, rel=1e-5)


def test_reference_equal_to_policy_gives_half_the_weights(models, tmp_path):
    """Step 1 with the starting policy as reference: every log-ratio and the KL are 0, each loss 1/2 its weight."""
    rows, labels = random_kto_rows(6, seed=2)
    prefix = write_kto_dataset(str(tmp_path / "k"), rows, labels, S, groups=[[0, 1, 2], [3, 4, 5]])
    mg, _ = models["a"]
    loss, reports = _packed_step(mg, mg, prefix, [[0], [1]])
    n_good = sum(labels)
    assert loss == pytest.approx((WD * n_good + WU * (6 - n_good)) / 2 / 6, rel=1e-7)
    assert reports["kl"] == 0.0 and reports["rewards/chosen"] == 0.0 and reports["rewards/rejected"] == 0.0


def test_bad_flags_and_foreign_labels_are_refused(models, tmp_path):
    with pytest.raises(DataError, match="--kto-beta 0.0"):
        _stage(kto_beta=0.0)
    with pytest.raises(DataError, match="--kto-undesirable-weight -1.0"):
        _stage(kto_undesirable_weight=-1.0)
    with pytest.raises(DataError, match="--ref-load and --ref-logps both given"):
        _stage(ref_load="x", ref_logps=True)
    rows, labels = random_kto_rows(4, seed=3)
    prefix = write_kto_dataset(str(tmp_path / "k"), rows, labels, S, groups=[[0, 1], [2, 3]])
    other = write_kto_dataset(str(tmp_path / "o"), rows, labels, S, groups=[[0], [1, 2, 3]])
    import shutil
    for ext in (".bin", ".idx"):  # labels of other packs (one couple, then three)
        shutil.copy(other + "_packed_kto_labels" + ext, prefix + "_packed_kto_labels" + ext)
    mg, _ = models["a"]
    with pytest.raises(DataError, match="pack 0 has 4 segments but labels"):
        _packed_step(mg, mg, prefix, [[0], [1]])

"""Packed rollouts are exact: per-token log-probs equal transformers' per-sample ones, and the
PPO-clip loss and its gradients equal a per-sample unpadded computation, whatever the packing."""
import json
import types

import pytest
import torch

from mindspeed_pack.datasets.rollouts import parse_rollout, rollout_row
from mindspeed_pack.packing.segments import build_packed_batch
from mindspeed_pack.training.batches import packed_seq_params
from mindspeed_pack.training.stages.grpo import GRPOStage
from mindspeed_pack.training.stages.reference import token_logps
from tests.model_utils import assert_same_gradients, converted_model_pair, write_converted_tiny_qwen2
from tests.rollout_utils import hf_logps_entropy, per_sample_grpo_loss, random_rollouts, write_jsonl
from tests.train_utils import run_posttrain

S = 128
CLIP_LOW, CLIP_HIGH, KL = 0.1, 0.3, 0.05


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return write_converted_tiny_qwen2(tmp_path_factory.mktemp("grpo_qwen2"))


@pytest.fixture(scope="module")
def models(converted):
    """(megatron GPTModel with the converted weights, the transformers model they came from)."""
    return converted_model_pair(converted, S)


def _hf_logps(hf, row, entropy=False):
    logp, ent = hf_logps_entropy(hf, row)
    return (logp, ent) if entropy else logp


@pytest.fixture(scope="module")
def rows(models):
    """Rollouts whose old and reference log-probs are the model's own, perturbed so that clipping happens."""
    _, hf = models
    out = random_rollouts(6, seed=2)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for row in out:
            logp = _hf_logps(hf, row).double()
            row["old_logprobs"] = (logp + 0.3 * torch.randn(len(logp), generator=g, dtype=torch.float64)).tolist()
            row["ref_logprobs"] = (logp + 0.2 * torch.randn(len(logp), generator=g, dtype=torch.float64)).tolist()
    return out


def _stage(mode, entropy_coef=0.0, log_entropy=False):
    return GRPOStage(types.SimpleNamespace(loss_agg=mode, clip_ratio=[CLIP_LOW, CLIP_HIGH], kl_coef=KL,
                                           kl_estimator="k3", seq_length=S, entropy_coef=entropy_coef,
                                           log_entropy=log_entropy))


def _packed(model, rows, groups, stage=None, reports=None):
    """(per-token log-probs of every row's response in input order, loss sum, count) with ``rows`` packed as ``groups``;
    the stage's metric sums are added into ``reports`` when given."""
    rollouts = [parse_rollout(row, f"row {i}", 256) for i, row in enumerate(rows)]
    logps, loss, count = [None] * len(rows), 0.0, 0
    for group in groups:
        mb = rollout_row([rollouts[i] for i in group], S, every_response_token=stage is None)  # scoring: every token
        batch = build_packed_batch(mb["input_ids"], mb["labels"], mb["segment_ids"])
        logits = stage is not None and stage.needs_logits
        out = model(batch.tokens, batch.position_ids, None, labels=None if logits else batch.target,
                    packed_seq_params=packed_seq_params(batch))
        scores = None if logits else token_logps(batch, out)[0]
        for i, start in zip(group, mb["response_starts"]):
            logps[i] = None if scores is None else scores[start:start + len(rows[i]["response_ids"])]
        if stage is not None:
            batch, = stage.prepare(None, [batch], [mb], "train", S)
            s, n, shown = stage.loss_func(batch, out)
            loss, count = loss + s, count + int(n)
            for name, value in (shown.items() if reports is not None else ()):
                reports[name] = reports.get(name, 0) + value.detach().double()
    return logps, loss, count


def _expected_loss(hf, rows, mode, entropy_coef=0.0):
    return per_sample_grpo_loss(hf, rows, mode, clip_low=CLIP_LOW, clip_high=CLIP_HIGH, kl_coef=KL,
                                entropy_coef=entropy_coef, seq_length=S)


def test_old_logprobs_in_some_rollouts_only_are_refused(tmp_path):
    """A row's ratio must not depend on its pack-mates (a row without old log-probs used to drop them for
    every rollout of its micro-batch): the file gives them in every rollout or in none."""
    from mindspeed_pack.datasets.packed_dataset import DataError
    from mindspeed_pack.datasets.rollouts import load_rollouts

    rows = random_rollouts(3, seed=1)
    rows[0]["old_logprobs"] = [-20.0] * len(rows[0]["response_ids"])
    rollouts, _ = load_rollouts(write_jsonl(tmp_path / "r.jsonl", rows), 256, 64)
    trainer = types.SimpleNamespace(source=types.SimpleNamespace(rollouts=rollouts))
    stage = _stage("token-mean")
    stage.args.kl_coef = 0.0  # no reference log-probs needed
    with pytest.raises(DataError, match=r"r\.jsonl: line 2: field 'old_logprobs' is missing, but .*r\.jsonl: line 1 "
                                        "has it: give it in every rollout"):
        stage.setup(trainer)
    for row in rows:  # in none, or in all: accepted
        row.pop("old_logprobs", None)
    for rollouts_of in (rows, [{**row, "old_logprobs": [0.0] * len(row["response_ids"])} for row in rows]):
        trainer.source.rollouts, _ = load_rollouts(write_jsonl(tmp_path / "r.jsonl", rollouts_of), 256, 64)
        stage.setup(trainer)


def test_packed_logprobs_equal_transformers_per_sample(models, rows):
    mg, hf = models
    with torch.no_grad():
        logps, _, _ = _packed(mg, rows, [[0, 1, 2], [3, 4, 5]])
        for row, mine in zip(rows, logps):
            theirs = _hf_logps(hf, row)
            assert float((mine - theirs).abs().max() / theirs.abs().max()) <= 1e-5


@pytest.mark.parametrize("mode,entropy_coef", [("token-mean", 0.0), ("seq-mean-token-mean", 0.0),
                                               ("dr-grpo", 0.0), ("token-mean", 0.05)])
def test_grpo_loss_and_gradients_equal_per_sample(models, rows, mode, entropy_coef):
    mg, hf = models
    stage = _stage(mode, entropy_coef)
    mg.zero_grad()
    _, loss, n = _packed(mg, rows, [[0, 3, 5], [1, 2, 4]], stage)
    (loss / n).backward()
    hf.zero_grad()
    expected = _expected_loss(hf, rows, mode, entropy_coef)
    expected.backward()
    assert abs(float(loss / n) - float(expected)) <= 1e-5 * abs(float(expected))
    assert_same_gradients(mg, hf)


def test_dr_grpo_divides_by_every_rollout_times_the_constant_length(models, rows):
    """Dr. GRPO (and TRL's ``dr_grpo``): token sums over all rollouts / (rollouts x the constant length), a rollout
    without a trained token counted too (it used to be left out of the divisor: x4/3 with one of four masked)."""
    mg, hf = models
    masked = [{**row, "response_mask": [0] * len(row["response_mask"])} if i == 0 else row
              for i, row in enumerate(rows)]
    stage = _stage("dr-grpo")
    mg.zero_grad()
    _, loss, n = _packed(mg, masked, [[0, 3, 5], [1, 2, 4]], stage)
    (loss / n).backward()
    hf.zero_grad()
    expected = _expected_loss(hf, masked, "dr-grpo")
    expected.backward()
    assert int(n) == len(masked)
    assert abs(float(loss / n) - float(expected)) <= 1e-5 * abs(float(expected))
    assert_same_gradients(mg, hf)


def test_log_entropy_reports_the_entropy_without_a_bonus(models, rows):
    mg, hf = models
    reports = {}
    with torch.no_grad():
        _, loss, n = _packed(mg, rows, [[0, 3, 5], [1, 2, 4]], _stage("token-mean", log_entropy=True), reports)
        expected = _expected_loss(hf, rows, "token-mean", entropy_coef=0.0)
        entropy_sum = count = 0.0
        for row in rows:
            _, entropy = _hf_logps(hf, row, entropy=True)
            mask = torch.tensor(row["response_mask"], dtype=torch.float32)
            entropy_sum, count = entropy_sum + float((entropy * mask).sum()), count + float(mask.sum())
    assert abs(float(loss / n) - float(expected)) <= 1e-5 * abs(float(expected))  # the loss has no bonus
    mine = float(reports["entropy"][0] / reports["entropy"][1])
    assert abs(mine - entropy_sum / count) <= 1e-5 * entropy_sum / count


def test_packing_the_same_rollouts_differently_gives_the_same_loss(models, rows):
    mg, _ = models
    stage = _stage("seq-mean-token-mean")
    results = []
    for groups in ([[0, 1, 2, 3, 4, 5]], [[5, 4], [3], [2, 1, 0]], [[i] for i in range(6)]):
        mg.zero_grad()
        _, loss, n = _packed(mg, rows, groups, stage)
        (loss / n).backward()
        results.append((float(loss / n), torch.cat([p.grad.reshape(-1) for p in mg.parameters()])))
    for loss, grad in results[1:]:
        assert abs(loss - results[0][0]) <= 1e-6 * abs(results[0][0])
        assert float((grad - results[0][1]).abs().max() / results[0][1].abs().max()) <= 1e-5


def test_scored_rollouts_give_ratio_one_and_dp2_equals_one_process(converted, models, tmp_path):
    """CLI at DP2: --stage score writes the model's own log-probs and entropies (== transformers'); --stage grpo
    then starts at ratio 1 with no clipping, and its loss and gradient norm equal one process's."""
    mg, hf = models
    rows = random_rollouts(8, seed=5)
    src = write_jsonl(tmp_path / "rollouts.jsonl", rows)
    scored = str(tmp_path / "scored.jsonl")
    common = ["--seq-length", str(S), "--micro-batch-size", "1", "--load", converted, "--finetune",
              "--max-seqlen-per-dp-cp-rank", "64", "--lr", "1e-4", "--clip-grad", "1.0"]
    run_posttrain(["--stage", "score", "--rollout-path", src, "--score-output", scored, "--global-batch-size", "4",
                   "--score-entropy", *common], nproc=2)
    with open(scored) as f:
        out = [json.loads(line) for line in f]
    assert [r["response_ids"] for r in out] == [r["response_ids"] for r in rows]
    with torch.no_grad():
        for row in out:
            for field, theirs in zip(("old_logprobs", "entropy"), _hf_logps(hf, row, entropy=True)):
                mine, theirs = torch.tensor(row[field], dtype=torch.float64), theirs.double()
                assert float((mine - theirs).abs().max() / theirs.abs().max()) <= 1e-5, field
    _, records = run_posttrain(["--stage", "grpo", "--rollout-path", scored, "--global-batch-size", "8",
                                "--loss-agg", "seq-mean-token-mean", "--train-iters", "1", *common],
                               nproc=2, metrics=str(tmp_path / "m.jsonl"))
    step, = [r for r in records if r["split"] == "train"]
    assert step["ratio mean"] == step["ratio max"] == 1.0 and step["clip fraction"] == 0.0 and step["approx kl"] == 0.0
    assert step["response length"] == pytest.approx(sum(sum(r["response_mask"]) for r in rows) / 8)
    # one process, each rollout alone: the same loss and gradient
    for row in out:
        row["ref_logprobs"] = row["old_logprobs"]
    mg.zero_grad()
    _, loss, n = _packed(mg, out, [[i] for i in range(8)], _stage("seq-mean-token-mean"))
    (loss / n).backward()
    norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in mg.parameters())))
    assert step["lm loss"] == pytest.approx(float(loss / n), rel=1e-5)
    assert step["grad norm"] == pytest.approx(norm, rel=1e-5)


def test_a_step_without_a_trained_token_is_named_not_called_non_finite(converted, tmp_path, capsys):
    """Rollouts whose every response token is masked (tool output only) make 0/0: the run said 'non-finite loss
    nan', as for a diverged run; it names the cause (in this process: the exit code is run_cli's, not a
    process teardown's)."""
    import posttrain
    from mindspeed_pack.training.cli import run_cli
    from tests.model_utils import TINY_FLAGS, init_single_process

    rows = random_rollouts(4, seed=7)
    for row in rows:
        row["response_mask"] = [0] * len(row["response_ids"])
    src = write_jsonl(tmp_path / "masked.jsonl", rows)
    argv = [*TINY_FLAGS, "--stage", "grpo", "--rollout-path", src, "--seq-length", str(S), "--micro-batch-size",
            "1", "--global-batch-size", "4", "--load", converted, "--finetune", "--max-seqlen-per-dp-cp-rank", "64",
            "--lr", "1e-4", "--train-iters", "1"]
    init_single_process()
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run_cli("posttrain.py", lambda: posttrain.main(argv))
    err = capsys.readouterr().err
    assert e.value.code == 1, err[-2000:]
    assert "error: no trained token in the global batch (every label masked" in err
    assert "at iteration 1; use --nan-policy skip" in err and "non-finite loss" not in err

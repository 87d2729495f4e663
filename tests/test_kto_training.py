"""posttrain.py --stage kto end to end: TP2 x PP2 and CP2 x DP2 equal TP1 step by step, the precomputed
reference (--stage dpo_reference on KTO couples) gives the in-job reference's losses, resume is exact.
(Step 1 against TRL's formulas, and against the starting policy as reference: tests/test_kto.py.)"""
import os

import pytest

from tests.pair_utils import random_kto_rows, write_kto_dataset
from tests.train_utils import run_posttrain

STEPS = 4
BASE = ["--stage", "kto", "--kto-beta", "0.5", "--seq-length", "128", "--neat-pack", "--micro-batch-size", "1",
        "--global-batch-size", "4", "--lr", "5e-3", "--min-lr", "5e-3", "--lr-warmup-iters", "0",
        "--train-iters", str(STEPS), "--seed", "7"]
KTO_KEYS = ("lm loss", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from mindspeed_pack.convert import hf_to_megatron
    from tests.model_utils import write_converted_tiny_qwen2

    root = tmp_path_factory.mktemp("kto_training")
    mg = write_converted_tiny_qwen2(root / "qwen", seed=1)
    write_converted_tiny_qwen2(root / "ref", seed=0)  # the reference: another model, the KL estimate positive
    mg_tp2pp2 = str(root / "qwen" / "mg_tp2pp2")
    hf_to_megatron(str(root / "qwen" / "hf"), mg_tp2pp2, 2, 2, padded_vocab_size=256)
    data = write_kto_dataset(str(root / "kto"), *random_kto_rows(60, seed=11, desirable=0.8))
    return {"root": root, "mg": mg, "mg_tp2pp2": mg_tp2pp2, "ref": str(root / "ref" / "hf"), "data": data}


def _run(setup, name, extra, nproc=1):
    metrics = str(setup["root"] / f"{name}.jsonl")
    proc, records = run_posttrain([*BASE, "--data-path", setup["data"], *extra], nproc=nproc, metrics=metrics)
    # a step without an undesirable (or desirable) sample leaves those reports out: it wrote bare NaN, not JSON
    assert "NaN" not in open(metrics).read()
    return proc, [r for r in records if r["split"] == "train"]


def _close(a, b, rel, atol):
    if a is None or b is None:  # a step without a desirable (or undesirable) sample has no such report
        return a is None and b is None
    return abs(a - b) <= atol + rel * max(abs(a), abs(b))


def _same_steps(a, b, keys=KTO_KEYS + ("grad norm",), rel=1e-5):
    """Equal step by step; rewards and KL are differences of log-probs ~50 in size (fp32: atol 1e-4)."""
    assert [r["iteration"] for r in a] == [r["iteration"] for r in b]
    for ra, rb in zip(a, b):
        for k in keys:
            atol = 1e-4 if k.startswith("rewards/") or k == "kl" else 1e-6
            assert _close(ra.get(k), rb.get(k), rel, atol), (ra["iteration"], k, ra.get(k), rb.get(k))


@pytest.fixture(scope="module")
def baseline(setup):
    """TP1, the reference another model (--ref-load HF_DIR, so the KL estimate is positive), a checkpoint at step 2."""
    proc, steps = _run(setup, "tp1", ["--load", setup["mg"], "--finetune", "--ref-load", setup["ref"],
                                      "--save", str(setup["root"] / "ckpt"), "--save-interval", "2"])
    assert f"kto: reference model loaded from {setup['ref']}" in proc.stderr
    assert "kl:" in proc.stdout and "rewards/chosen:" in proc.stdout  # the console line
    return steps


def test_the_kl_reference_point_is_positive_and_the_loss_falls(baseline):
    """Mostly not clamped to 0: the layouts below compare a KL estimate reduced over micro-batches and ranks."""
    assert len(baseline) == STEPS and sum(r["kl"] > 0.5 for r in baseline) >= 2
    assert baseline[-1]["lm loss"] < baseline[0]["lm loss"]


def test_tp2_pp2_matches_tp1(setup, baseline):
    _, steps = _run(setup, "tp2pp2", ["--load", setup["mg_tp2pp2"], "--finetune", "--tensor-model-parallel-size",
                                      "2", "--pipeline-model-parallel-size", "2", "--ref-load", setup["ref"]], nproc=4)
    _same_steps(baseline, steps)


def test_cp2_dp2_matches_tp1(setup, baseline):
    """Each CP rank holds a share of every sequence, each DP rank half the packs: the KL is the whole batch's."""
    _, steps = _run(setup, "cp2dp2", ["--load", setup["mg"], "--finetune", "--context-parallel-size", "2",
                                      "--ref-load", setup["ref"]], nproc=4)
    _same_steps(baseline, steps)


def test_precomputed_reference_and_resume_are_exact(setup, baseline):
    from mindspeed_pack.convert.megatron_layout import write_tracker
    from mindspeed_pack.training.stages.reference import SUFFIX

    # the couples' reference log-probs (sample, KL partner), scored at DP2 by --stage dpo_reference
    proc, _ = run_posttrain(["--stage", "dpo_reference", "--seq-length", "128", "--neat-pack", "--micro-batch-size",
                             "1", "--global-batch-size", "6", "--data-path", setup["data"], "--load", setup["ref"]],
                            nproc=2)
    assert os.path.isfile(setup["data"] + SUFFIX) and "reference log-probs of 60 KTO couples" in proc.stdout
    # resume at step 2 (mid-epoch) with the reference precomputed: steps 3 and 4 are the baseline's
    write_tracker(str(setup["root"] / "ckpt"), 2)  # the baseline saved iterations 2 and 4
    proc, resumed = _run(setup, "resumed", ["--load", str(setup["root"] / "ckpt"), "--ref-logps"])
    assert "kto: precomputed reference log-probs" in proc.stderr
    _same_steps(baseline[2:], resumed, rel=1e-6)
    # a resume whose reference would be the checkpoint's weights is refused (the starting policy is gone)
    proc, _ = run_posttrain([*BASE, "--data-path", setup["data"], "--load", str(setup["root"] / "ckpt")], check=False)
    assert proc.returncode == 2 and "--stage kto resumes at iteration 2" in proc.stderr

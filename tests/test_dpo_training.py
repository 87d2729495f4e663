"""posttrain.py --stage dpo, simpo and orpo end to end: every parallel layout equals TP1 for each stage,
DPO's two reference modes agree, resume is exact, a learnable preference is learned (multi-process runs).
One job per layout trains the three stages one after the other (``run_posttrain_runs``): a layout's
start and process groups are paid once."""
import json
import math
import os
import shutil

import pytest

from tests.pair_utils import random_pairs, write_pair_dataset
from tests.train_utils import run_posttrain, run_posttrain_runs

STEPS = 4  # DPO's; SimPO and ORPO run 3
COMMON = ["--seq-length", "128", "--neat-pack", "--micro-batch-size", "1", "--global-batch-size", "4",
          "--lr", "5e-3", "--min-lr", "5e-3", "--lr-warmup-iters", "0", "--seed", "7"]
# SimPO and ORPO at a smaller lr: Adam's first steps move every weight by about lr whatever its gradient, so
# fp32 rounding differences between layouts grow with it
STAGE_FLAGS = {
    "dpo": ["--stage", "dpo", "--dpo-beta", "0.5", "--train-iters", str(STEPS)],
    "simpo": ["--stage", "simpo", "--simpo-beta", "2.0", "--gamma-beta-ratio", "0.5", "--pref-ftx", "0.2",
              "--train-iters", "3", "--lr", "1e-3", "--min-lr", "1e-3"],
    "orpo": ["--stage", "orpo", "--orpo-beta", "0.5", "--train-iters", "3", "--lr", "1e-3", "--min-lr", "1e-3"],
}
BASE = [*COMMON, *STAGE_FLAGS["dpo"]]
DPO_KEYS = ("lm loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
KEYS = {"dpo": DPO_KEYS, "simpo": DPO_KEYS, "orpo": DPO_KEYS + ("nll_loss", "log_odds_ratio", "log_odds_chosen")}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from mindspeed_pack.convert import hf_to_megatron
    from tests.model_utils import write_converted_tiny_qwen2

    root = tmp_path_factory.mktemp("dpo_training")
    mg = write_converted_tiny_qwen2(root / "qwen")
    mg_tp2pp2 = str(root / "qwen" / "mg_tp2pp2")
    hf_to_megatron(str(root / "qwen" / "hf"), mg_tp2pp2, 2, 2, padded_vocab_size=256)
    data = write_pair_dataset(str(root / "pairs"), random_pairs(60, seed=11))
    return {"root": root, "mg": mg, "mg_tp2pp2": mg_tp2pp2, "data": data}


def _run(setup, name, extra, nproc=1):
    metrics = str(setup["root"] / f"{name}.jsonl")
    proc, records = run_posttrain([*BASE, "--data-path", setup["data"], *extra], nproc=nproc, metrics=metrics)
    return proc, [r for r in records if r["split"] == "train"]


def _runs(setup, name, runs, nproc=1):
    """One job training ``runs`` ([(stage, its extra flags)]) in turn; (the job's process, each run's train steps)."""
    argvs = [([*COMMON, *STAGE_FLAGS[stage], "--data-path", setup["data"], *extra],
              str(setup["root"] / f"{name}_{i}_{stage}.jsonl")) for i, (stage, extra) in enumerate(runs)]
    proc, records = run_posttrain_runs(argvs, nproc=nproc)
    return proc, [[r for r in run if r["split"] == "train"] for run in records]


def _close(a, b, rel=1e-5, atol=1e-6):
    return abs(a - b) <= atol + rel * max(abs(a), abs(b))


def _same_steps(a, b, keys=DPO_KEYS + ("grad norm",), rel=1e-5, stage="dpo"):
    """Equal step by step; rewards are beta x differences of log-probs ~50 in size (fp32: atol 1e-4)."""
    assert [r["iteration"] for r in a] == [r["iteration"] for r in b]
    for ra, rb in zip(a, b):
        for k in keys:
            atol = 1e-4 if k.startswith("rewards/") else 1e-6
            assert _close(ra[k], rb[k], rel, atol), (stage, ra["iteration"], k, ra[k], rb[k])


@pytest.fixture(scope="module")
def baseline(setup):
    """TP1 runs of each stage from the converted model (one job), each saving a checkpoint at step 2;
    DPO's reference is a frozen copy of it. {stage: train steps}."""
    start = ["--load", setup["mg"], "--finetune", "--save-interval", "2"]
    proc, steps = _runs(setup, "tp1", [(stage, [*start, "--save", str(setup["root"] / f"ckpt_{stage}")])
                                       for stage in STAGE_FLAGS])
    assert "reference model = a frozen copy of the starting policy" in proc.stderr
    assert proc.stderr.count("reference model =") == 1  # SimPO and ORPO build none, and say so
    assert "simpo: reference-free (no reference model built or loaded)" in proc.stderr
    assert "orpo: reference-free (no reference model built or loaded)" in proc.stderr
    assert "rewards/margins:" in proc.stdout and "logps/chosen:" in proc.stdout  # the console line
    assert "log_odds_ratio:" in proc.stdout and "nll_loss:" in proc.stdout  # ORPO's
    return dict(zip(STAGE_FLAGS, steps))


def test_step_one_is_log2_with_zero_margin(baseline):
    first = baseline["dpo"][0]
    assert first["rewards/margins"] == 0.0 and first["rewards/chosen"] == 0.0
    assert first["lm loss"] == pytest.approx(math.log(2), rel=1e-7)
    assert len(baseline["dpo"]) == STEPS and baseline["dpo"][-1]["lm loss"] < math.log(2)
    assert [len(baseline[s]) for s in ("simpo", "orpo")] == [3, 3]


def _same_layout(baseline, steps):
    for stage, mine in zip(STAGE_FLAGS, steps):
        _same_steps(baseline[stage], mine, KEYS[stage] + ("grad norm",), stage=stage)


def test_tp2_pp2_matches_tp1(setup, baseline):
    """DPO's reference here is the HF directory the checkpoints came from (--ref-load HF_DIR), each rank reading
    its TP/PP slice: the same reference as the baseline's frozen copy. SimPO and ORPO in the same job."""
    hf = str(setup["root"] / "qwen" / "hf")
    layout = ["--load", setup["mg_tp2pp2"], "--finetune", "--tensor-model-parallel-size", "2",
              "--pipeline-model-parallel-size", "2"]
    proc, steps = _runs(setup, "tp2pp2", [("dpo", [*layout, "--ref-load", hf]), ("simpo", layout), ("orpo", layout)],
                        nproc=4)
    assert f"reference model loaded from {hf}" in proc.stderr
    _same_layout(baseline, steps)


def test_cp2_dp2_matches_tp1(setup, baseline):
    layout = ["--load", setup["mg"], "--finetune", "--context-parallel-size", "2"]
    _, steps = _runs(setup, "cp2dp2", [(stage, layout) for stage in STAGE_FLAGS], nproc=4)
    _same_layout(baseline, steps)


def test_precomputed_reference_gives_the_same_losses_and_resume_is_exact(setup, baseline):
    """DPO with --ref-logps equals the in-job reference; every stage resumed at step 2 (mid-epoch) repeats the
    uninterrupted run's later steps (DPO with the reference precomputed). The runs after the scoring: one job."""
    from mindspeed_pack.convert.megatron_layout import write_tracker
    from mindspeed_pack.training.stages.reference import SUFFIX

    # scored at DP2, 3 micro-batches a step (the last step wraps round the packs)
    proc, _ = run_posttrain(["--stage", "dpo_reference", "--seq-length", "128", "--neat-pack", "--micro-batch-size", "1",
                             "--global-batch-size", "6", "--data-path", setup["data"],
                             "--load", setup["mg"], "--finetune", "--save", str(setup["root"] / "unused")], nproc=2)
    assert os.path.isfile(setup["data"] + SUFFIX) and "reference log-probs of 60 pairs" in proc.stdout
    assert not (setup["root"] / "unused").exists()  # a scoring pass saves nothing: --save is neither made nor claimed
    ckpt = {stage: str(setup["root"] / f"ckpt_{stage}") for stage in STAGE_FLAGS}
    for path in ckpt.values():
        write_tracker(path, 2)  # the baselines saved iterations 2 and their last
    _, (steps, dpo, simpo, orpo) = _runs(setup, "resumed", [
        ("dpo", ["--load", setup["mg"], "--finetune", "--ref-logps"]), ("dpo", ["--load", ckpt["dpo"], "--ref-logps"]),
        ("simpo", ["--load", ckpt["simpo"]]), ("orpo", ["--load", ckpt["orpo"]])])
    _same_steps(baseline["dpo"], steps, rel=1e-6)
    for stage, resumed in (("dpo", dpo), ("simpo", simpo), ("orpo", orpo)):
        _same_steps(baseline[stage][2:], resumed, KEYS[stage] + ("grad norm",), rel=1e-6, stage=stage)
    # a resume without a reference of the starting weights is refused (the checkpoint moved on)
    proc, _ = run_posttrain([*BASE, "--data-path", setup["data"], "--load", ckpt["dpo"]], check=False)
    assert proc.returncode == 2 and "--ref-load" in proc.stderr


def test_a_run_started_from_a_hf_directory_resumes_with_it_as_ref_load(setup, baseline):
    """--load HF_DIR (the README's path), a checkpoint at step 2, then a resume whose reference is that
    directory (--ref-load HF_DIR, read slice by slice as --load reads it): steps 3 and 4 are the
    uninterrupted run's, which are the converted checkpoint's."""
    from mindspeed_pack.convert.megatron_layout import write_tracker

    hf, ckpt = str(setup["root"] / "qwen" / "hf"), str(setup["root"] / "ckpt_from_hf")
    _, full = _run(setup, "from_hf", ["--load", hf, "--save", ckpt, "--save-interval", "2"])
    _same_steps(baseline["dpo"], full, rel=1e-6)
    write_tracker(ckpt, 2)
    proc, resumed = _run(setup, "from_hf_resumed", ["--load", ckpt, "--ref-load", hf])
    assert f"reference model loaded from {hf}" in proc.stderr
    _same_steps(full[2:], resumed, rel=1e-6)
    # the same command again (as after a crash): it resumes from --save, the reference read again from --load
    write_tracker(ckpt, 2)
    proc, again = _run(setup, "from_hf_again", ["--load", hf, "--save", ckpt, "--save-interval", "2"])
    assert f"resumed from {ckpt} at iteration 2" in proc.stderr, proc.stderr[-3000:]
    assert f"reference model = the starting policy, read again from --load {hf}" in proc.stderr
    _same_steps(full[2:], again, rel=1e-6)


def test_reference_from_other_data_or_tokenizer_is_refused(setup, tmp_path):
    from mindspeed_pack.datasets.packed_dataset import DataError, PackedDocuments
    from mindspeed_pack.training.stages.reference import SUFFIX, ReferenceTable

    other = write_pair_dataset(str(tmp_path / "other"), random_pairs(60, seed=12))
    retokenized = write_pair_dataset(str(tmp_path / "retok"), random_pairs(60, seed=11), tokenizer="another")
    ref = tmp_path / "scored.pt"
    _write_fake_reference(ref, PackedDocuments(setup["data"]))
    for prefix in (other, retokenized):
        shutil.copy(ref, prefix + SUFFIX)
        with pytest.raises(DataError) as err:
            ReferenceTable.load_for(PackedDocuments(prefix))
        mine = json.load(open(prefix + "_packed_meta.json"))["statistics"]["data_fingerprint"]
        theirs = json.load(open(setup["data"] + "_packed_meta.json"))["statistics"]["data_fingerprint"]
        assert f"data fingerprint {mine}" in str(err.value) and f"data fingerprint {theirs}" in str(err.value)
    assert "tokenizer" in str(err.value)


def _write_fake_reference(path, docs):
    import torch

    from mindspeed_pack.training.stages.reference import FORMAT, data_identity

    torch.save({"format": FORMAT, "identity": data_identity(docs), "reference": "x",
                "pair_offsets": torch.zeros(len(docs) + 1, dtype=torch.long), "logps": torch.zeros(0, 2)}, path)


def test_a_learnable_preference_is_learned(setup):
    """Rejected answers repeat one token: each stage's reward accuracy passes 0.9 and its margin grows."""
    longer = ["--train-iters", "24", "--global-batch-size", "8", "--micro-batch-size", "2", "--lr", "2e-3",
              "--min-lr", "2e-3"]
    _, runs = _runs(setup, "learn", [(stage, longer) for stage in STAGE_FLAGS])
    for stage, steps in zip(STAGE_FLAGS, runs):
        late = steps[-6:]
        assert sum(r["rewards/accuracies"] for r in late) / len(late) > 0.9, stage
        assert sum(r["rewards/margins"] for r in late) / len(late) > 2 * max(1e-3, abs(steps[1]["rewards/margins"])), \
            stage


def test_validation_of_a_preference_stage_logs_its_rewards(tmp_path):
    """A DPO validation printed 'lm loss PPL' (exp of a DPO loss) and none of the stage's metrics: it now logs the
    rewards, margins and accuracies as its training lines do (console, metrics file), and no perplexity."""
    import posttrain
    from tests.model_utils import TINY_FLAGS, write_converted_tiny_qwen2

    mg = write_converted_tiny_qwen2(tmp_path / "qwen")
    data = write_pair_dataset(str(tmp_path / "pairs"), random_pairs(24, seed=3))
    metrics = str(tmp_path / "m.jsonl")
    flags = [f for i, f in enumerate(TINY_FLAGS) if "dropout" not in f and not (i and "dropout" in TINY_FLAGS[i - 1])]
    posttrain.main([*flags, *COMMON, *STAGE_FLAGS["dpo"], "--train-iters", "2", "--data-path", data, "--load", mg,
                    "--finetune", "--split", "75,25,0", "--eval-iters", "1", "--eval-interval", "1",
                    "--attention-dropout", "0", "--hidden-dropout", "0", "--metrics-file", metrics])
    valid = [json.loads(line) for line in open(metrics) if '"valid"' in line]
    assert [r["iteration"] for r in valid] == [1, 2, 2]
    for r in valid:
        assert 0.0 <= r["rewards/accuracies"] <= 1.0 and math.isfinite(r["rewards/margins"])
        assert r["rewards/margins"] == pytest.approx(r["rewards/chosen"] - r["rewards/rejected"], abs=1e-5)


def test_mindspeed_llms_ref_model_and_refer_model_iter_pick_the_reference(setup, baseline, tmp_path):
    """MindSpeed-LLM's --ref-model is --ref-load; its --refer-model-iter N reads iteration N of the reference's
    Megatron checkpoint (--ref-load's, else --load's) instead of the tracked one. The policy at iteration 2 against
    the reference at iteration 2 starts at exactly log 2 (both ways); against the tracked iteration 4 it does not.
    An iteration the checkpoint lacks, a Hugging Face reference and --ref-logps are refused by name."""
    from mindspeed_pack.convert.megatron_layout import write_tracker

    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(setup["root"] / "ckpt_dpo", ckpt)  # the baseline saved iterations 2 and 4
    write_tracker(ckpt, 4)
    policy = [*COMMON, *STAGE_FLAGS["dpo"], "--data-path", setup["data"], "--load", ckpt, "--ckpt-step", "2",
              "--finetune", "--train-iters", "1"]
    proc, records = run_posttrain_runs([
        ([*policy, "--ref-model", ckpt, "--refer-model-iter", "2"], str(tmp_path / "ref_model_iter.jsonl")),
        ([*policy, "--refer-model-iter", "2"], str(tmp_path / "load_iter.jsonl")),
        ([*policy, "--ref-model", ckpt], str(tmp_path / "ref_model.jsonl"))])
    (same,), (same_from_load,), (tracked,) = ([r for r in run if r["split"] == "train"] for run in records)
    assert same["lm loss"] == pytest.approx(math.log(2), rel=1e-7) and same["rewards/margins"] == 0.0
    assert same_from_load["lm loss"] == pytest.approx(math.log(2), rel=1e-7)
    assert abs(tracked["lm loss"] - math.log(2)) > 1e-3 and tracked["rewards/margins"] != 0.0
    assert f"reference model = iteration 2 of --ref-load {ckpt}" in proc.stderr
    assert f"reference model = iteration 2 of --load {ckpt}" in proc.stderr
    assert f"reference model loaded from {ckpt}" in proc.stderr
    for flags, message in (
            (["--ref-model", ckpt, "--refer-model-iter", "3"], "--refer-model-iter 3: "),
            (["--ref-model", str(setup["root"] / "qwen" / "hf"), "--refer-model-iter", "2"],
             "is a Hugging Face directory (one set of weights): drop --refer-model-iter"),
            (["--ref-logps", "--refer-model-iter", "2"], "--refer-model-iter 2 with --ref-logps")):
        proc, _ = run_posttrain([*policy, *flags], check=False)
        assert proc.returncode != 0 and message in proc.stderr, (flags, proc.stderr[-2000:])
    assert "iter_0000002, iter_0000004" in run_posttrain([*policy, "--refer-model-iter", "3"], check=False)[0].stderr

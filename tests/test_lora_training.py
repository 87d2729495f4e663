"""LoRA end to end (posttrain.py, pretrain_gpt.py; multi-process): TP2 x PP2 and CP2 x TP2 + SP (with the
distributed optimizer) train exactly as TP1 and their saved adapter shards export the same PEFT adapters;
DPO's reference is the base with the adapters off (step 1 is log 2) and a resume is exact; pretraining
and GRPO train the adapters only. The single-process guarantees (PEFT's math, frozen base, exports,
errors) are in ``test_lora.py``."""
import math
import os

import pytest
import torch
from safetensors.torch import load_file

from mindspeed_pack.convert import adapters
from mindspeed_pack.convert import megatron_layout as layout
from mindspeed_pack.convert.convert import main as convert_main
from mindspeed_pack.model.lora import is_adapter_name
from tests.train_utils import run_posttrain, write_copy_task

pytest.importorskip("peft")

LORA = ["--lora-r", "4", "--lora-alpha", "8"]
BASE = ["--seq-length", "128", "--neat-pack", "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "2e-2",
        "--min-lr", "2e-2", "--lr-warmup-iters", "0", "--train-iters", "3", "--seed", "7", *LORA]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tests.model_utils import write_converted_tiny_qwen2

    root = tmp_path_factory.mktemp("lora_training")
    write_converted_tiny_qwen2(root / "qwen")
    return {"root": root, "hf": str(root / "qwen" / "hf"), "data": write_copy_task(str(root / "data" / "copy"))}


def _run(setup, name, extra, nproc=1, base=BASE, check=True):
    metrics = str(setup["root"] / f"{name}.jsonl")
    proc, records = run_posttrain([*base, "--load", setup["hf"], *extra], nproc=nproc, metrics=metrics, check=check)
    return proc, [r for r in records if r["split"] == "train"]


def _peft(setup, save, name):
    out = str(setup["root"] / f"{name}_peft")
    assert convert_main(["--load-model-type", "hf", "--load-dir", setup["hf"], "--lora-load", save,
                         "--save-model-type", "hf", "--save-dir", out]) == 0
    return load_file(os.path.join(out, adapters.ADAPTER_WEIGHTS))


def _same_steps(a, b, rel=1e-5):
    assert [r["iteration"] for r in a] == [r["iteration"] for r in b] == list(range(1, len(a) + 1))
    for ra, rb in zip(a, b):
        for key in ("lm loss", "grad norm"):
            assert abs(ra[key] - rb[key]) <= rel * abs(rb[key]), (ra["iteration"], key, ra[key], rb[key])


@pytest.fixture(scope="module")
def tp1(setup):
    save = str(setup["root"] / "tp1")
    proc, steps = _run(setup, "tp1", ["--data-path", setup["data"], "--save", save])
    assert "adapter parameters train" in proc.stderr and len(steps) == 3
    assert steps[-1]["lm loss"] < steps[0]["lm loss"]
    return {"steps": steps, "save": save, "peft": _peft(setup, save, "tp1")}


@pytest.mark.parametrize("name,flags", [
    ("tp2pp2", ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    ("cp2tp2sp", ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                  "--use-distributed-optimizer"]),
])
def test_layouts_train_as_tp1_and_their_shards_export_the_same_adapters(setup, tp1, name, flags):
    save = str(setup["root"] / name)
    _, steps = _run(setup, name, ["--data-path", setup["data"], "--save", save, *flags], nproc=4)
    _same_steps(steps, tp1["steps"])
    exported = _peft(setup, save, name)
    assert set(exported) == set(tp1["peft"]) and len(exported) == 28
    for key, tensor in tp1["peft"].items():  # in norm: Adam turns rounding in near-zero gradients into a few
        assert float((exported[key] - tensor).norm()) <= 1e-5 * float(tensor.norm()), key  # larger elements


def test_merged_export_of_a_hf_base_equals_the_peft_export(setup, tp1):
    import peft
    import transformers

    merged = str(setup["root"] / "tp1_merged")
    assert convert_main(["--load-model-type", "hf", "--load-dir", setup["hf"], "--lora-load", tp1["save"],
                         "--save-model-type", "hf", "--save-dir", merged, "--lora-merge"]) == 0
    ids = torch.randint(3, 200, (2, 40), generator=torch.Generator().manual_seed(1))
    load = transformers.Qwen2ForCausalLM.from_pretrained
    with torch.no_grad():
        a = load(merged, dtype=torch.float32)(ids).logits
        b = peft.PeftModel.from_pretrained(load(setup["hf"], dtype=torch.float32),
                                           str(setup["root"] / "tp1_peft"))(ids).logits
    assert float((a - b).abs().max()) <= 1e-5


# --------------------------------------------------------------------------- DPO
def test_dpo_reference_is_the_base_with_adapters_off_and_resume_is_exact(setup):
    from tests.pair_utils import random_pairs, write_pair_dataset

    data = write_pair_dataset(str(setup["root"] / "pairs"), random_pairs(40, seed=11))
    save = str(setup["root"] / "dpo")
    dpo = ["--stage", "dpo", "--dpo-beta", "0.5", "--data-path", data, "--train-iters", "4"]
    proc, steps = _run(setup, "dpo", [*dpo, "--save", save, "--save-interval", "2"])
    assert "LoRA adapters switched off (no second model in memory)" in proc.stderr
    assert steps[0]["lm loss"] == pytest.approx(math.log(2), rel=1e-7) and steps[0]["rewards/margins"] == 0.0
    assert steps[-1]["lm loss"] < math.log(2)
    layout.write_tracker(save, 2)  # iterations 2 and 4 were saved: resume from 2
    _, resumed = _run(setup, "dpo_resumed", [*dpo, "--lora-load", save])
    assert [r["iteration"] for r in resumed] == [3, 4]
    for a, b in zip(resumed, steps[2:]):
        assert a["lm loss"] == b["lm loss"] and a["grad norm"] == b["grad norm"] and \
            a["rewards/margins"] == b["rewards/margins"]
    # the first command again (as after a crash): it resumes the adapters from its own --save
    proc, again = _run(setup, "dpo_again", [*dpo, "--save", save, "--save-interval", "2"])
    assert f"resumed from {save} at iteration 2" in proc.stderr, proc.stderr[-3000:]
    assert [(r["iteration"], r["lm loss"], r["grad norm"]) for r in again] == \
        [(r["iteration"], r["lm loss"], r["grad norm"]) for r in steps[2:]]


# --------------------------------------------------------------------------- the other stages
def _adapters_only(save, iteration):
    record = layout.load_file(layout.checkpoint_file(save, iteration, 0, 0, 1))
    assert record["model"] and all(is_adapter_name(k) for k in record["model"])
    trained = [v for k, v in record["model"].items() if ".lora_B." in k]
    assert trained and all(float(v.abs().max()) > 0 for v in trained)  # B left zero: trained
    return record


def test_pretraining_and_grpo_train_adapters_only(setup):
    from tests.data_utils import random_documents, write_pretrain_documents
    from tests.rollout_utils import random_rollouts, write_jsonl

    docs = write_pretrain_documents(str(setup["root"] / "docs_text_document"), random_documents(40, 2, seed=1))
    save = str(setup["root"] / "pretrain")
    proc, _ = run_posttrain(["--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "2",
                             "--train-iters", "2", "--lr", "1e-2", "--eod-id", "2", "--data-path", docs, "--load",
                             setup["hf"], "--save", save, *LORA], script="pretrain_gpt.py")
    _adapters_only(save, 2)
    rollouts = write_jsonl(setup["root"] / "rollouts.jsonl", random_rollouts(8, seed=3))
    save = str(setup["root"] / "grpo")
    run_posttrain(["--stage", "grpo", "--rollout-path", rollouts, "--seq-length", "64", "--micro-batch-size", "1",
                   "--global-batch-size", "8", "--max-seqlen-per-dp-cp-rank", "64", "--train-iters", "1", "--lr",
                   "1e-2", "--load", setup["hf"], "--save", save, *LORA])
    record = _adapters_only(save, 1)
    assert record["lora"]["base"]["fingerprint"] == adapters.fingerprint(setup["hf"])

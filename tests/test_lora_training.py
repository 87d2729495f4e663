"""LoRA end to end (posttrain.py, pretrain_gpt.py; multi-process): TP2 x PP2 and CP2 x TP2 + SP (with the
distributed optimizer) train exactly as TP1 and their saved adapter shards export the same PEFT adapters;
TP2 x PP2 adapter checkpoints resharded to TP1 and to TP1 x PP2 continue as the TP2 x PP2 run does, and a
PEFT export loads at TP2; DPO's reference is the base with the adapters off (step 1 is log 2) and a resume
is exact; pretraining and GRPO train the adapters only. The single-process guarantees (PEFT's math, frozen
base, exports, errors) are in ``test_lora.py``."""
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from mindspeed_pack.convert import adapters
from mindspeed_pack.convert import megatron_layout as layout
from mindspeed_pack.convert.convert import hf_merge_lora
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


def _same_steps(a, b, rel=1e-5, first=1):
    assert [r["iteration"] for r in a] == [r["iteration"] for r in b] == list(range(first, first + len(a)))
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


LAYOUTS = {
    "tp2pp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
    "cp2tp2sp": ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                 "--use-distributed-optimizer"],
}


@pytest.fixture(scope="module")
def layouts(setup):
    """The 4-rank runs of :data:`LAYOUTS`, each run once (on first use) and saved at every iteration."""
    runs = {}

    def run(name):
        if name not in runs:
            save = str(setup["root"] / name)
            _, steps = _run(setup, name, ["--data-path", setup["data"], "--save", save, "--save-interval", "1",
                                          *LAYOUTS[name]], nproc=4)
            runs[name] = {"steps": steps, "save": save}
        return runs[name]
    return run


@pytest.mark.parametrize("name", sorted(LAYOUTS, reverse=True))
def test_layouts_train_as_tp1_and_their_shards_export_the_same_adapters(setup, tp1, layouts, name):
    save, steps = layouts(name)["save"], layouts(name)["steps"]
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


def test_merging_into_a_sharded_base_lets_each_shard_go_once_read(setup, tp1, monkeypatch):
    """--lora-merge onto a HF base kept every base shard open to the end (and every page read from it), as hf->mg
    did: a shard is let go once its tensors are read (at most the three a layer spans here are open at any read, of
    five), and the merged model is the same."""
    import transformers

    from tests.model_utils import count_open_shards

    sharded = str(setup["root"] / "base_many_shards")
    transformers.Qwen2ForCausalLM.from_pretrained(setup["hf"]).save_pretrained(sharded, max_shard_size="100KB")
    most = count_open_shards(monkeypatch)
    merged = {}
    for name, base in (("one", setup["hf"]), ("many", sharded)):
        out = str(setup["root"] / f"merged_from_{name}")
        # the merge itself: the CLI checks the base by its files' fingerprint, which a re-sharded copy changes
        hf_merge_lora(base, tp1["save"], out)
        merged[name] = {}
        for f in sorted(os.listdir(out)):
            if f.endswith(".safetensors"):
                merged[name].update(load_file(os.path.join(out, f)))
    shards = sum(f.endswith(".safetensors") for f in os.listdir(sharded))
    assert most and max(most) <= 3 < shards, (most, shards)  # a layer spans up to three 100KB shards
    assert sorted(merged["one"]) == sorted(merged["many"])
    assert all(torch.equal(merged["one"][k], merged["many"][k]) for k in merged["one"])


# --------------------------------------------------------------------------- another layout
def _at_iteration(setup, save, iteration, name):
    """A copy of checkpoint directory ``save`` whose tracker names ``iteration``."""
    copy = str(setup["root"] / name)
    shutil.copytree(save, copy)
    layout.write_tracker(copy, iteration)
    return copy


def _reshard(load, save, tp, pp):
    return convert_main(["--load-model-type", "mg", "--save-model-type", "mg", "--load-dir", load, "--save-dir", save,
                         "--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size", str(pp)])


def _same_tensors(a, b, where):
    """The same structure, with bit-identical tensors."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (where, list(a), list(b))
        for k in a:
            _same_tensors(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same_tensors(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def test_tp2pp2_adapters_resharded_to_tp1_and_pp2_continue_as_the_tp2pp2_run(setup, layouts):
    """convert_ckpt.py mg->mg of a LoRA run's checkpoint (issue 40: it answered "resharding them is not
    supported", and --lora-load at another layout sent users to that command; the command it prints now does
    the job): TP2 x PP2's iteration 1, resharded to TP1 and to TP1 x PP2, continues with the TP2 x PP2 run's losses and grad norms at steps 2-3
    (rel <= 1e-5: the layouts sum the row-parallel products in another order, so bits differ, as TP2 x PP2
    differs from TP1; without the Adam moments step 3's loss is off by rel 2.7e-4). Back to TP2 x PP2, every rank
    file is bit-identical to the saved one but for the RNG states, which no other layout can use."""
    source = layouts("tp2pp2")
    at1 = _at_iteration(setup, source["save"], 1, "tp2pp2_at1")
    proc, _ = _run(setup, "tp1_refused", ["--data-path", setup["data"], "--lora-load", at1], check=False)
    command = proc.stderr.split("reshard it first: python convert_ckpt.py ", 1)[1].split(";", 1)[0].split()
    out = str(setup["root"] / "reshard_tp1")
    assert proc.returncode != 0 and convert_main([out if a == "NEW_DIR" else a for a in command]) == 0  # no circle
    for name, pp, nproc in (("tp1", 1, 1), ("tp1pp2", 2, 2)):
        out = str(setup["root"] / f"reshard_{name}")
        if pp > 1:
            assert _reshard(at1, out, 1, pp) == 0
        proc, steps = _run(setup, f"continued_{name}", ["--data-path", setup["data"], "--lora-load", out,
                                                         "--pipeline-model-parallel-size", str(pp)], nproc=nproc)
        assert "RNG states belong to that layout's ranks and were not carried" in proc.stderr
        _same_steps(steps, source["steps"][1:], first=2)
    back = str(setup["root"] / "reshard_back")
    assert _reshard(str(setup["root"] / "reshard_tp1"), back, 2, 2) == 0
    for rank_dir in ("mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"):
        saved, again = (layout.load_file(os.path.join(d, "iter_0000001", rank_dir, "model_optim_rng.pt"))
                        for d in (at1, back))
        assert "rng_state" in saved and "rng_state" not in again and again["resharded_from"] == "TP1 PP1 EP1"
        for key in ("model", "optimizer", "opt_param_scheduler", "iteration", "consumed_samples", "lora", "args"):
            _same_tensors(saved[key], again[key], f"{rank_dir}: {key}")


def test_reshard_of_a_distributed_optimizer_checkpoint_is_refused_by_name(setup, layouts, capsys):
    """megatron's distributed optimizer keeps the moments in flat buffers of the saved layout's buckets."""
    out = str(setup["root"] / "reshard_distopt")
    capsys.readouterr()
    assert _reshard(layouts("cp2tp2sp")["save"], out, 1, 1) == 2
    err = capsys.readouterr().err
    assert "distributed optimizer (--use-distributed-optimizer)" in err and "distrib_optim.pt" in err
    assert "--lora-load PEFT_DIR" in err and not os.path.exists(out)


def test_a_peft_export_loads_at_tp2_with_its_runs_loss_and_its_lora_flags(setup, tp1):
    """--lora-load PEFT_DIR at TP2 with no LoRA flag (they come from adapter_config.json): the first loss and
    grad norm of the TP1 run's exported adapters are those of that run's checkpoint loaded as weights at TP1
    (--finetune; rel <= 1e-5 between the layouts)."""
    one = ["--data-path", setup["data"], "--train-iters", "1"]
    _, ref = _run(setup, "tp1_finetune", [*one, "--lora-load", tp1["save"], "--finetune"])
    no_lora = BASE[:-len(LORA)]
    proc, steps = _run(setup, "peft_tp2", [*one, "--lora-load", str(setup["root"] / "tp1_peft"),
                                           "--tensor-model-parallel-size", "2"], nproc=2, base=no_lora)
    assert "LoRA flags from its adapter_config.json: --lora-alpha 8.0 --lora-dropout 0.0 --lora-r 4" in proc.stderr
    _same_steps(steps, ref)
    assert ref[0]["lm loss"] < tp1["steps"][0]["lm loss"] - 0.1  # the adapters are trained ones, not zero


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

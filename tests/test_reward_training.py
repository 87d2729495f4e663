"""posttrain.py --stage orm / --stage prm end to end: an outcome reward model learns a rule, its --save-hf export
is a transformers sequence classifier that scores every sample alone as the project scored it packed, trains on
when loaded, and scores rollouts for GRPO (--stage score); process reward rows are preprocessed in MindSpeed-LLM's
shape and trained; bad input stops with one error and writes nothing."""
import json
import os
import re
from dataclasses import replace

import numpy as np
import pytest
import torch

from tests.pair_utils import hf_reward, packed_orm, random_pairs, write_pair_dataset
from tests.train_utils import run_posttrain, write_copy_task

S = 128
ORM = ["--stage", "orm", "--seq-length", str(S), "--neat-pack", "--micro-batch-size", "2", "--global-batch-size", "8",
       "--lr", "2e-3", "--min-lr", "2e-3", "--lr-warmup-iters", "0", "--seed", "7"]
STEPS = 12
PAD = 0  # the packs' pad id (tests/pair_utils.py): the pad token the exported model pools by


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tests.model_utils import write_converted_tiny_qwen2

    root = tmp_path_factory.mktemp("reward_training")
    mg = write_converted_tiny_qwen2(root / "qwen")
    pairs = random_pairs(60, seed=11)
    return {"root": root, "mg": mg, "pairs": pairs, "data": write_pair_dataset(str(root / "pairs"), pairs)}


@pytest.fixture(scope="module")
def trained(setup):
    """A reward model trained from the converted language model: its Megatron checkpoint and --save-hf export."""
    root = setup["root"]
    ckpt, export = str(root / "orm_ckpt"), str(root / "orm_hf")
    proc, records = run_posttrain([*ORM, "--train-iters", str(STEPS), "--data-path", setup["data"], "--load",
                                   setup["mg"], "--finetune", "--save", ckpt, "--save-hf", export],
                                  metrics=str(root / "orm.jsonl"))
    assert "rewards/accuracies:" in proc.stdout and "Qwen2ForSequenceClassification" in proc.stderr
    return {"ckpt": ckpt, "export": export, "steps": [r for r in records if r["split"] == "train"]}


def _sequence_classifier(path):
    import transformers

    return transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32,
                                                                           attn_implementation="eager")


def _megatron_reward_model(ckpt):
    """The trained Megatron checkpoint in this process (TP1), built with the score head."""
    from mindspeed_pack.checkpoint.save_load import load_weights
    from mindspeed_pack.model.gpt import build_gpt_model
    from tests.model_utils import init_single_process, tiny_args

    init_single_process()
    args = tiny_args(seq_length=S, tensor_model_parallel_size=1, pipeline_model_parallel_size=1, reward_head=True)
    model = build_gpt_model(args)
    load_weights(args, ckpt, model)
    return model.eval()


def test_orm_learns_a_rule_and_its_export_scores_every_sample_alone_as_packed(setup, trained):
    """Rejected answers repeat one token: accuracy passes 0.9. The export is a Qwen2ForSequenceClassification
    (num_labels 1, pad_token_id the data's pad) whose reward of each sample alone, and Bradley-Terry loss, are the
    project's packed ones (rel <= 1e-5)."""
    from types import SimpleNamespace

    from mindspeed_pack.training.stages.reward_models import OutcomeRewardStage, bradley_terry_losses

    steps = trained["steps"]
    assert len(steps) == STEPS and steps[0]["rewards/accuracies"] < 0.8
    late = steps[-4:]
    assert sum(r["rewards/accuracies"] for r in late) / len(late) > 0.9
    assert late[-1]["rewards/margins"] > 1.0 and late[-1]["lm loss"] < steps[0]["lm loss"] / 3

    hf = _sequence_classifier(trained["export"])
    assert type(hf).__name__ == "Qwen2ForSequenceClassification"
    assert hf.config.num_labels == 1 and hf.config.pad_token_id == PAD
    pairs = setup["pairs"][:9]
    mg = _megatron_reward_model(trained["ckpt"])
    stage = OutcomeRewardStage(SimpleNamespace(center_rewards_coefficient=0.0, reward_pad_token_id=PAD))
    with torch.no_grad():
        loss, n, mine = packed_orm(mg, stage, pairs, [[0, 1, 2, 3], [4, 5, 6, 7, 8]], S)
        theirs = torch.stack([torch.stack([hf_reward(hf, p, c), hf_reward(hf, p, r)]) for p, c, r in pairs])
    assert float((mine - theirs).abs().max() / theirs.abs().max()) <= 1e-5
    expected = bradley_terry_losses(theirs[:, 0], theirs[:, 1]).mean()
    assert abs(float(loss / n) - float(expected)) <= 1e-5 * abs(float(expected))


def test_score_writes_each_rollouts_reward_for_grpo(setup, trained):
    """--stage score with the exported reward model (loaded as a HF directory, at DP2): each row gets 'reward',
    transformers' score of the rollout alone, rows in input order, 'group' kept (what --stage grpo reads)."""
    from tests.rollout_utils import write_jsonl

    rows = [{"prompt_ids": p.tolist(), "response_ids": a.tolist(), "group": k}
            for k, (p, c, r) in enumerate(setup["pairs"][:6]) for a in (c, r)]
    rows[1]["response_ids"] += [PAD]  # ends with the pad token: read where transformers reads it
    scored = str(setup["root"] / "scored.jsonl")
    run_posttrain(["--stage", "score", "--load", trained["export"], "--rollout-path",
                   write_jsonl(setup["root"] / "rollouts.jsonl", rows), "--score-output", scored, "--seq-length",
                   str(S), "--max-seqlen-per-dp-cp-rank", "64", "--micro-batch-size", "1", "--global-batch-size", "4"],
                  nproc=2)
    with open(scored) as f:
        out = [json.loads(line) for line in f]
    assert [(r["prompt_ids"], r["response_ids"], r["group"]) for r in out] == \
        [(r["prompt_ids"], r["response_ids"], r["group"]) for r in rows]
    hf = _sequence_classifier(trained["export"])
    with torch.no_grad():
        theirs = torch.stack([hf(torch.tensor([r["prompt_ids"] + r["response_ids"]])).logits[0, 0] for r in rows])
    mine = torch.tensor([r["reward"] for r in out])
    assert float((mine - theirs).abs().max() / theirs.abs().max()) <= 1e-5


def test_a_reward_model_trains_on_from_its_export(setup, trained):
    """--load of the exported directory (Qwen2ForSequenceClassification) trains the reward model on: step 1's loss
    is the export's Bradley-Terry loss on the first global batch's pairs (--no-shuffle: packs 0..7)."""
    from mindspeed_pack.datasets.packed_documents import PackedDocuments
    from mindspeed_pack.training.stages.reward_models import bradley_terry_losses

    _, records = run_posttrain([*ORM, "--train-iters", "1", "--no-shuffle", "--data-path", setup["data"],
                                "--load", trained["export"]], metrics=str(setup["root"] / "on.jsonl"))
    hf = _sequence_classifier(trained["export"])
    docs = PackedDocuments(setup["data"])
    rewards = []
    with torch.no_grad():
        for d in range(8):
            pack = docs.get(d)
            ids, seg = np.asarray(pack["input_ids"]), np.asarray(pack["attention_mask"])
            for k in range(1, int(seg.max()) + 1):
                rewards.append(hf(torch.from_numpy(ids[seg == k].astype(np.int64))[None]).logits[0, 0])
    rewards = torch.stack(rewards).reshape(-1, 2)
    expected = float(bradley_terry_losses(rewards[:, 0], rewards[:, 1]).mean())
    assert records[0]["lm loss"] == pytest.approx(expected, rel=1e-5)


def test_an_export_of_a_family_without_a_sequence_classifier_is_refused(trained, tmp_path, monkeypatch):
    """convert_ckpt.py mg->hf and --save-hf (checked before training): one error naming the family, nothing
    written."""
    from mindspeed_pack.checkpoint.errors import CheckpointError
    from mindspeed_pack.checkpoint.hf_checkpoint import check_exportable
    from mindspeed_pack.convert import convert
    from mindspeed_pack.convert.model_specs import MODEL_SPECS

    monkeypatch.setitem(MODEL_SPECS, "qwen2", replace(MODEL_SPECS["qwen2"], hf_reward_architecture=None))
    out = tmp_path / "hf"
    code = convert.main(["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", trained["ckpt"],
                         "--save-dir", str(out)])
    assert code == 2 and not out.exists() and os.listdir(tmp_path) == []
    from types import SimpleNamespace

    from tests.model_utils import TINY

    args = SimpleNamespace(**{**TINY, "reward_head": True, "reward_pad_token_id": PAD, "model_type_hf": "qwen2",
                              "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                              "make_vocab_size_divisible_by": 128, "vocab_size": 256, "save_hf": str(out)})
    with pytest.raises(CheckpointError, match="the qwen2 family has no sequence-classification class"):
        check_exportable(args)


def test_a_reward_model_is_refused_where_a_language_model_is_needed(trained):
    """Its checkpoint into a language model (--stage sft, dpo, ...): one error naming the stage; a language model's
    checkpoint into a reward model starts its head fresh."""
    from mindspeed_pack.checkpoint.errors import CheckpointError
    from mindspeed_pack.checkpoint.save_load import load_weights
    from mindspeed_pack.model.gpt import build_gpt_model
    from tests.model_utils import init_single_process, tiny_args

    init_single_process()
    args = tiny_args(seq_length=S, tensor_model_parallel_size=1, pipeline_model_parallel_size=1, stage="sft")
    with pytest.raises(CheckpointError, match=f"--load {trained['ckpt']} holds an outcome reward model .*--stage sft "
                                              "needs a language model"):
        load_weights(args, trained["ckpt"], build_gpt_model(args), "--load")


def test_convert_round_trips_a_reward_model(trained, tmp_path):
    """HF sequence classifier -> Megatron at TP2 x PP2 (the score head on the last stage, whole on each TP rank)
    -> HF: the same tensors and config."""
    from safetensors.torch import load_file

    from mindspeed_pack.convert import hf_to_megatron, megatron_to_hf

    hf_to_megatron(trained["export"], str(tmp_path / "mg"), 2, 2, padded_vocab_size=256)
    megatron_to_hf(str(tmp_path / "mg"), str(tmp_path / "back"))
    a = load_file(os.path.join(trained["export"], "model.safetensors"))
    b = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(a) == sorted(b) and "score.weight" in a and "lm_head.weight" not in a
    assert all(torch.equal(a[k], b[k]) for k in a)
    with open(tmp_path / "back" / "config.json") as f:
        config = json.load(f)
    assert config["architectures"] == ["Qwen2ForSequenceClassification"] and config["pad_token_id"] == PAD


def test_pair_margins_are_kept_per_pair_in_pack_order(tmp_path, run_preprocess, toy_tokenizer_dir):
    """A 'margin' column goes with its pair into the packs (P_packed_pair_margins, read with the packs); a row
    without one has 0; a margin that is not a number is one error naming the row, nothing written."""
    import transformers

    from mindspeed_pack.data.toy import WORDS
    from mindspeed_pack.datasets.packed_documents import PackedDocuments

    rows = [{"instruction": f"{WORDS[k // 8]} {WORDS[k % 8]}", "input": "", "chosen": f"{WORDS[k % 5]} yes",
             "rejected": f"{WORDS[k % 7]} no", **({"margin": k + 0.5} if k % 4 else {})} for k in range(40)]
    prefix = str(tmp_path / "pairs")
    code, _, err = run_preprocess(input=_write_rows(tmp_path / "pairs.jsonl", rows), output_prefix=prefix,
                                  handler_name="AlpacaStylePairwiseHandler", prompt_type="qwen", seq_length=S,
                                  pack=True, neat_pack=True)
    assert code == 0, err
    tokenizer = transformers.AutoTokenizer.from_pretrained(toy_tokenizer_dir)
    docs, seen = PackedDocuments(prefix), []
    for d in range(len(docs)):
        pack = docs.get(d)
        assert len(pack["pair_margins"]) == int(pack["attention_mask"].max()) // 2
        for j, margin in enumerate(pack["pair_margins"]):
            chosen = tokenizer.decode(pack["input_ids"][pack["attention_mask"] == 2 * j + 1])
            k = next(k for k in range(40) if f"{WORDS[k // 8]} {WORDS[k % 8]}" in chosen)
            assert margin == (k + 0.5 if k % 4 else 0.0), (k, margin)
            seen.append(k)
    assert sorted(seen) == list(range(40))

    rows[3]["margin"] = "big"
    out = tmp_path / "bad"
    out.mkdir()
    code, _, err = run_preprocess(input=_write_rows(out / "pairs.jsonl", rows), output_prefix=str(out / "pairs"),
                                  handler_name="AlpacaStylePairwiseHandler", prompt_type="qwen", seq_length=S,
                                  pack=True, neat_pack=True)
    assert code == 2 and "pairs.jsonl: line 4: field 'margin' (--map-keys margin) must be a number" in err
    assert os.listdir(out) == ["pairs.jsonl"]


# ----------------------------------------------------------------------------------------- reward model with LoRA
LORA = ["--lora-r", "8", "--lora-alpha", "16"]
LORA_SCALE = 16 / 8


@pytest.fixture(scope="module")
def lora_trained(setup):
    """A reward model trained with LoRA on the Hugging Face language model (adapters on every linear, the score head
    in full), saved at iterations 6 and 12, its --save-hf --lora-merge export a sequence classifier."""
    root = setup["root"]
    ckpt, merged = str(root / "orm_lora_ckpt"), str(root / "orm_lora_merged")
    proc, records = run_posttrain([*ORM, *LORA, "--train-iters", str(STEPS), "--data-path", setup["data"], "--load",
                                   str(root / "qwen" / "hf"), "--save", ckpt, "--save-interval", "6", "--save-hf",
                                   merged, "--lora-merge"], metrics=str(root / "orm_lora.jsonl"))
    assert "adapter parameters train" in proc.stderr and "Qwen2ForSequenceClassification" in proc.stderr
    return {"ckpt": ckpt, "merged": merged, "base": str(root / "qwen" / "hf"),
            "steps": [r for r in records if r["split"] == "train"]}


def _lora_record(ckpt, iteration):
    from mindspeed_pack.convert import megatron_layout as layout

    return layout.load_file(layout.checkpoint_file(ckpt, iteration, 0, 0, 1))


def _megatron_lora_reward_model(mg_base, ckpt):
    """The LoRA reward model as the project runs it (TP1, this process): the base's weights, then the checkpoint's
    adapters and score head."""
    from mindspeed_pack.checkpoint.save_load import load_adapter_weights, load_weights
    from mindspeed_pack.model.gpt import build_gpt_model
    from tests.model_utils import init_single_process, tiny_args

    init_single_process()
    args = tiny_args(seq_length=S, tensor_model_parallel_size=1, pipeline_model_parallel_size=1, reward_head=True,
                     lora_r=8, lora_alpha=16.0, lora_dropout=0.0, lora_target_modules=None)
    model = build_gpt_model(args)
    load_weights(args, mg_base, model)  # a language model: the head is left as drawn, then loaded below
    load_adapter_weights(ckpt, model, _lora_record(ckpt, STEPS)["model"])
    return model.eval()


def test_orm_with_lora_learns_with_a_frozen_base_and_a_trained_head(setup, lora_trained):
    """--stage orm with LoRA (refused before): the accuracy passes 0.9; the checkpoints hold the adapters and the score
    head only, and the head changes from iteration 6 to 12; the merged export's weights are the base's exactly where
    no adapter is, base + scale B A where one is (the base did not move), with the checkpoint's score head."""
    from safetensors.torch import load_file

    from mindspeed_pack.convert import adapters
    from mindspeed_pack.model.lora import is_adapter_name

    steps = lora_trained["steps"]
    assert len(steps) == STEPS and steps[0]["rewards/accuracies"] < 0.8
    assert sum(r["rewards/accuracies"] for r in steps[-4:]) / 4 > 0.9 and steps[-1]["lm loss"] < steps[0]["lm loss"] / 3
    half, last = _lora_record(lora_trained["ckpt"], 6)["model"], _lora_record(lora_trained["ckpt"], STEPS)["model"]
    assert sorted(k for k in last if not is_adapter_name(k)) == ["score.weight"] and len(last) == 29
    assert float((last["score.weight"] - half["score.weight"]).abs().max()) > 1e-3

    base, merged = load_file(os.path.join(lora_trained["base"], "model.safetensors")), \
        load_file(os.path.join(lora_trained["merged"], "model.safetensors"))
    assert sorted(merged) == sorted([k for k in base if k != "lm_head.weight"] + ["score.weight"])
    assert torch.equal(merged["score.weight"], last["score.weight"])
    deltas = {}
    for name, tensor in adapters.to_peft({k: v for k, v in last.items() if is_adapter_name(k)}).items():
        weight = name[len(adapters.PEFT_PREFIX):].split(".lora_")[0] + ".weight"
        deltas.setdefault(weight, {})[name.split(".lora_")[1][0]] = tensor
    assert len(deltas) == 14
    for name, tensor in base.items():
        if name in deltas:
            expected = tensor + LORA_SCALE * deltas[name]["B"] @ deltas[name]["A"]
            assert float((merged[name] - expected).abs().max()) <= 1e-6 * float(expected.abs().max()), name
            assert float((merged[name] - tensor).abs().max()) > 1e-4, name  # the adapters trained
        elif name != "lm_head.weight":
            assert torch.equal(merged[name], tensor), name


def test_orm_lora_export_scores_every_sample_alone_as_packed(setup, lora_trained):
    """The --save-hf --lora-merge export, loaded by AutoModelForSequenceClassification, scores each sample alone as
    the project's LoRA model scored it packed, and its Bradley-Terry loss is the project's (rel <= 1e-5)."""
    from types import SimpleNamespace

    from mindspeed_pack.training.stages.reward_models import OutcomeRewardStage, bradley_terry_losses

    hf = _sequence_classifier(lora_trained["merged"])
    assert type(hf).__name__ == "Qwen2ForSequenceClassification" and hf.config.pad_token_id == PAD
    pairs = setup["pairs"][:9]
    mg = _megatron_lora_reward_model(setup["mg"], lora_trained["ckpt"])
    stage = OutcomeRewardStage(SimpleNamespace(center_rewards_coefficient=0.0, reward_pad_token_id=PAD))
    with torch.no_grad():
        loss, n, mine = packed_orm(mg, stage, pairs, [[0, 1, 2, 3], [4, 5, 6, 7, 8]], S)
        theirs = torch.stack([torch.stack([hf_reward(hf, p, c), hf_reward(hf, p, r)]) for p, c, r in pairs])
    assert float((mine - theirs).abs().max() / theirs.abs().max()) <= 1e-5
    assert float((theirs[:, 0] - theirs[:, 1]).min()) > 0  # the rule is learnt on these pairs too
    expected = bradley_terry_losses(theirs[:, 0], theirs[:, 1]).mean()
    assert abs(float(loss / n) - float(expected)) <= 1e-5 * abs(float(expected))


@pytest.fixture(scope="module")
def lora_resumed(setup, lora_trained):
    """The LoRA reward model's run resumed from its iteration 6 (--lora-load) to 12, its --save-hf without
    --lora-merge: a PEFT adapter directory."""
    import shutil

    from mindspeed_pack.convert import megatron_layout as layout

    root = setup["root"]
    at6, peft_dir = str(root / "orm_lora_at6"), str(root / "orm_lora_peft")
    shutil.copytree(lora_trained["ckpt"], at6)
    layout.write_tracker(at6, 6)
    proc, records = run_posttrain([*ORM, *LORA, "--train-iters", str(STEPS), "--data-path", setup["data"], "--load",
                                   lora_trained["base"], "--lora-load", at6, "--save-hf", peft_dir],
                                  metrics=str(root / "orm_lora_resumed.jsonl"))
    return {"steps": [r for r in records if r["split"] == "train"], "peft": peft_dir, "log": proc.stderr}


def test_orm_lora_resume_is_exact_and_its_peft_export_loads_in_peft(setup, lora_trained, lora_resumed):
    """Resumed from iteration 6 (--lora-load), steps 7-12 are the run's bit for bit, and so are the adapters and the
    head; its --save-hf (no --lora-merge) is a PEFT sequence-classifier adapter (task SEQ_CLS, modules_to_save
    score) that peft loads on the base and that scores as the merged export (rel <= 1e-5); convert_ckpt.py's exports of
    the checkpoint on the base are the same files."""
    peft = pytest.importorskip("peft")
    import transformers
    from safetensors.torch import load_file

    from mindspeed_pack.convert import adapters
    from mindspeed_pack.convert.convert import main as convert_main

    root, peft_dir = setup["root"], lora_resumed["peft"]
    keys = ("iteration", "lm loss", "grad norm", "rewards/accuracies", "rewards/margins")
    assert [[r[k] for k in keys] for r in lora_resumed["steps"]] == \
        [[r[k] for k in keys] for r in lora_trained["steps"][6:]]
    assert "modules_to_save" in lora_resumed["log"] and "pad_token_id=0" in lora_resumed["log"]

    with open(os.path.join(peft_dir, adapters.ADAPTER_CONFIG)) as f:
        config = json.load(f)
    assert config["task_type"] == "SEQ_CLS" and config["modules_to_save"] == ["score"]
    exported = load_file(os.path.join(peft_dir, adapters.ADAPTER_WEIGHTS))
    last = _lora_record(lora_trained["ckpt"], STEPS)["model"]
    assert len(exported) == 29 and torch.equal(exported["base_model.model.score.weight"], last["score.weight"])
    assert all(torch.equal(exported[k], v) for k, v in adapters.to_peft(last).items())

    base = transformers.AutoModelForSequenceClassification.from_pretrained(
        lora_trained["base"], num_labels=1, pad_token_id=PAD, dtype=torch.float32, attn_implementation="eager")
    with_adapters = peft.PeftModel.from_pretrained(base, peft_dir).eval()
    merged = _sequence_classifier(lora_trained["merged"])
    ids = [torch.from_numpy(np.concatenate([p, c]))[None] for p, c, _ in setup["pairs"][:6]]
    with torch.no_grad():
        a = torch.stack([with_adapters(x).logits[0, 0] for x in ids])
        b = torch.stack([merged(x).logits[0, 0] for x in ids])
    assert float((a - b).abs().max() / b.abs().max()) <= 1e-5

    for merge, out in ((False, "orm_lora_converted_peft"), (True, "orm_lora_converted_merged")):
        assert convert_main(["--load-model-type", "hf", "--load-dir", lora_trained["base"], "--lora-load",
                             lora_trained["ckpt"], "--save-model-type", "hf", "--save-dir", str(root / out),
                             *(["--lora-merge"] if merge else [])]) == 0
    converted = load_file(str(root / "orm_lora_converted_peft" / adapters.ADAPTER_WEIGHTS))
    assert sorted(converted) == sorted(exported) and all(torch.equal(converted[k], exported[k]) for k in exported)
    converted = load_file(str(root / "orm_lora_converted_merged" / "model.safetensors"))
    run_export = load_file(os.path.join(lora_trained["merged"], "model.safetensors"))
    assert sorted(converted) == sorted(run_export) and all(torch.equal(converted[k], run_export[k]) for k in converted)
    with open(root / "orm_lora_converted_merged" / "config.json") as f:
        assert json.load(f)["architectures"] == ["Qwen2ForSequenceClassification"]


def test_orm_lora_trains_on_from_its_peft_export_and_a_language_model_refuses_it(setup, lora_trained, lora_resumed):
    """--lora-load of the PEFT export (the LoRA flags from adapter_config.json) starts a reward model from its
    adapters and head: step 1's loss is the merged export's Bradley-Terry loss on the first global batch's pairs
    (--no-shuffle: packs 0..7); --stage sft with it: one error naming the head and --stage orm."""
    from mindspeed_pack.datasets.packed_documents import PackedDocuments
    from mindspeed_pack.training.stages.reward_models import bradley_terry_losses

    loads = ["--load", lora_trained["base"], "--lora-load", lora_resumed["peft"]]
    proc, records = run_posttrain([*ORM, "--train-iters", "1", "--no-shuffle", "--data-path", setup["data"], *loads],
                                  metrics=str(setup["root"] / "orm_lora_on.jsonl"))
    assert "the reward model's score head from its modules_to_save" in proc.stderr
    hf = _sequence_classifier(lora_trained["merged"])
    docs, rewards = PackedDocuments(setup["data"]), []
    with torch.no_grad():
        for d in range(8):
            pack = docs.get(d)
            ids, seg = np.asarray(pack["input_ids"]), np.asarray(pack["attention_mask"])
            for k in range(1, int(seg.max()) + 1):
                rewards.append(hf(torch.from_numpy(ids[seg == k].astype(np.int64))[None]).logits[0, 0])
    rewards = torch.stack(rewards).reshape(-1, 2)
    assert records[0]["lm loss"] == pytest.approx(float(bradley_terry_losses(rewards[:, 0], rewards[:, 1]).mean()),
                                                  rel=1e-5)
    sft = ["--stage", "sft", "--seq-length", str(S), "--neat-pack", "--micro-batch-size", "2", "--global-batch-size",
           "4", "--train-iters", "1", "--data-path", write_copy_task(str(setup["root"] / "copy" / "copy")), *loads]
    proc, _ = run_posttrain(sft, check=False)
    assert proc.returncode != 0 and "holds a reward model's score head (score.weight, its modules_to_save) beside " \
        "the adapters: train it on with --stage orm" in proc.stderr, proc.stderr[-2000:]


def test_orm_lora_on_a_megatron_base_exports_a_reward_model(setup, tmp_path):
    """convert_ckpt.py --lora-load of a LoRA reward model trained on a Megatron base (a language model): with
    --lora-merge a Qwen2ForSequenceClassification, the base's weights with the adapters merged and the checkpoint's
    score head; without, a PEFT directory with the head in modules_to_save."""
    from safetensors.torch import load_file

    from mindspeed_pack.convert import adapters
    from mindspeed_pack.convert.convert import main as convert_main

    ckpt = str(tmp_path / "ckpt")
    run_posttrain([*ORM, *LORA, "--train-iters", "1", "--data-path", setup["data"], "--load", setup["mg"],
                   "--finetune", "--save", ckpt])
    last = _lora_record(ckpt, 1)["model"]
    for merge in (True, False):
        out = tmp_path / ("merged" if merge else "peft")
        assert convert_main(["--load-model-type", "mg", "--load-dir", setup["mg"], "--lora-load", ckpt,
                             "--save-model-type", "hf", "--save-dir", str(out),
                             *(["--lora-merge"] if merge else [])]) == 0
    merged, base = load_file(str(tmp_path / "merged" / "model.safetensors")), \
        load_file(str(setup["root"] / "qwen" / "hf" / "model.safetensors"))
    with open(tmp_path / "merged" / "config.json") as f:
        config = json.load(f)
    assert config["architectures"] == ["Qwen2ForSequenceClassification"] and config["pad_token_id"] == PAD
    assert "lm_head.weight" not in merged and torch.equal(merged["score.weight"], last["score.weight"])
    q = "model.layers.1.self_attn.q_proj.weight"
    ab = {x: last[f"decoder.layers.1.self_attention.linear_qkv.lora_{x}.q_proj"] for x in "AB"}
    assert torch.allclose(merged[q], base[q] + LORA_SCALE * ab["B"] @ ab["A"], rtol=0, atol=1e-6)
    assert torch.equal(merged["model.norm.weight"], base["model.norm.weight"])
    with open(tmp_path / "peft" / adapters.ADAPTER_CONFIG) as f:
        assert json.load(f)["modules_to_save"] == ["score"]
    peft = load_file(str(tmp_path / "peft" / adapters.ADAPTER_WEIGHTS))
    assert torch.equal(peft["base_model.model.score.weight"], last["score.weight"])


# ----------------------------------------------------------------------------------------- process reward model
STEP_WORDS = [f"w{i}" for i in range(40)]


def _prm_rows(n, seed=0):
    """Math-Shepherd-shaped rows: a question and steps, each ending with the step tag; a step is right ('+') when
    it holds the word 'good'."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        text, labels = " ".join(rng.choice(STEP_WORDS, 4)), []
        for _ in range(int(rng.integers(1, 4))):
            words = list(rng.choice(STEP_WORDS, int(rng.integers(2, 5))))
            if rng.integers(2):
                words[int(rng.integers(len(words)))] = "good"
                labels.append("+")
            else:
                labels.append("-")
            text += " " + " ".join(words) + " ки"
        rows.append({"input": text, "value": labels})
    return rows


@pytest.fixture(scope="module")
def prm_tokenizer(tmp_path_factory):
    from tests.model_utils import save_word_tokenizer

    return save_word_tokenizer(tmp_path_factory.mktemp("prm_tok"), ["<pad>", "</s>", "ки", "+", "-", "good",
                                                                      *STEP_WORDS])


def _write_rows(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return str(path)


def test_prm_rows_are_preprocessed_with_the_label_at_each_step_tag(tmp_path, run_preprocess, read_indexed,
                                                                    prm_tokenizer, capsys):
    rows = _prm_rows(30, seed=1)
    prefix = str(tmp_path / "prm")
    code, out, err = run_preprocess(input=_write_rows(tmp_path / "prm.jsonl", rows), output_prefix=prefix,
                                    handler_name="AlpacaStyleProcessRewardHandler", tokenizer_name_or_path=prm_tokenizer,
                                    seq_length=S, pack=True, neat_pack=True)
    assert code == 0, err
    with open(prefix + "_packed_meta.json") as f:
        meta = json.load(f)
    steps = meta["layout"]["step_tags"]
    assert steps == {"placeholder_token": "ки", "placeholder_id": 2, "reward_tokens": ["+", "-"],
                     "reward_token_ids": [3, 4]}
    ids = np.concatenate(read_indexed(prefix + "_packed_input_ids_document"))
    labels = np.concatenate(read_indexed(prefix + "_packed_labels_document"))
    tagged = labels != -100
    assert np.array_equal(tagged, ids == 2)  # a label at every tag and nowhere else
    assert sorted(labels[tagged].tolist()) == sorted([3 if v == "+" else 4 for r in rows for v in r["value"]])
    assert meta["statistics"]["trained_tokens"] == int(tagged.sum())
    # inspect_pack shows each step's label (the reward token at its tag), not the tag as a trained answer
    from mindspeed_pack.tools import inspect_pack

    capsys.readouterr()
    assert inspect_pack.main([prefix, "--index", "0"]) == 0
    shown = re.findall(r"step \d+: tag at position (\d+), label '([+-])'", capsys.readouterr().out)
    first = read_indexed(prefix + "_packed_labels_document")[0]
    want = [(int(p), "+" if first[p] == 3 else "-") for p in np.flatnonzero(first != -100)]
    assert want and [(int(p), label) for p, label in shown] == want


@pytest.mark.parametrize("row,message", [
    ({"input": "w1 w2 w3 w4", "value": ["+"]}, "holds no step tag 'ки'"),
    ({"input": "w1 w2 ки w3 ки", "value": ["+"]}, "has 2 step tags 'ки' but field 'value' 1 labels"),
    ({"input": "w1 w2 ки", "value": ["ok"]}, "holds 'ok'; each label is one of --reward-tokens"),
])
def test_a_bad_prm_row_is_one_error_and_nothing_is_written(tmp_path, run_preprocess, prm_tokenizer, row, message):
    rows = _prm_rows(5) + [row]
    prefix = tmp_path / "prm"
    code, _, err = run_preprocess(input=_write_rows(tmp_path / "rows.jsonl", rows), output_prefix=str(prefix),
                                  handler_name="AlpacaStyleProcessRewardHandler", tokenizer_name_or_path=prm_tokenizer,
                                  seq_length=S, pack=True, neat_pack=True)
    assert code == 2 and message in err and "rows.jsonl: line 6" in err and err.count("error:") == 1, err
    assert sorted(os.listdir(tmp_path)) == ["rows.jsonl"]


def test_prm_trains_on_raw_rows_in_one_command(tmp_path, prm_tokenizer):
    """posttrain.py --stage prm on the raw rows (preprocessed first with the handler and the step-tag flags, then
    trained with the sidecar's reward tokens and the labels at the tags): the step loss falls and the step
    accuracy is logged; stopped at step 8 and resumed, steps 9-16 repeat exactly; --stage prm refuses data without
    step tags."""
    flags = ["--stage", "prm", "--seq-length", str(S), "--neat-pack", "--micro-batch-size", "2",
             "--global-batch-size", "4", "--lr", "5e-3", "--min-lr", "5e-3", "--lr-warmup-iters", "0",
             "--train-iters", "16", "--seed", "3"]
    raw = ["--data-path", _write_rows(tmp_path / "prm.jsonl", _prm_rows(200, seed=2)), "--handler-name",
           "AlpacaStyleProcessRewardHandler", "--placeholder-token", "ки", "--reward-tokens", "+", "-",
           "--tokenizer-name-or-path", prm_tokenizer]
    proc, records = run_posttrain([*flags, *raw], metrics=str(tmp_path / "prm_metrics.jsonl"))
    steps = [r for r in records if r["split"] == "train"]
    assert "accuracy:" in proc.stdout and all(0 <= r["accuracy"] <= 1 for r in steps)
    first, last = np.mean([r["lm loss"] for r in steps[:4]]), np.mean([r["lm loss"] for r in steps[-4:]])
    assert last < first, (first, last)
    # stopped after step 8 and resumed (the same command, --save holding iteration 8): steps 9-16 repeat exactly
    ckpt = ["--save", str(tmp_path / "ckpt"), "--save-interval", "8"]
    run_posttrain([*flags, *raw, *ckpt, "--exit-interval", "8"], metrics=str(tmp_path / "first.jsonl"))
    _, resumed = run_posttrain([*flags, *raw, *ckpt, "--load", str(tmp_path / "ckpt")],
                               metrics=str(tmp_path / "resumed.jsonl"))
    resumed = [r for r in resumed if r["split"] == "train"]
    assert [r["iteration"] for r in resumed] == list(range(9, 17)), resumed
    for want, got in zip(steps[8:], resumed):
        for key in ("lm loss", "accuracy", "grad norm"):
            assert abs(got[key] - want[key]) <= 1e-6 * max(1.0, abs(want[key])), (key, want, got)
    pairs = write_pair_dataset(str(tmp_path / "pairs"), random_pairs(8, seed=1))
    proc, _ = run_posttrain([*flags, "--data-path", pairs], check=False)
    assert proc.returncode != 0 and "holds no step tags" in proc.stderr

"""LoRA on packed data in one process: PEFT's math exactly, a frozen base, small state, exports, errors.

The reference is transformers + PEFT (the same adapter weights, copied) run on every sample alone.
The multi-process layouts (TP/PP/CP/SP), DPO and the other stages are in ``test_lora_training.py``.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

import posttrain
from mindspeed_pack.checkpoint import hf_checkpoint
from mindspeed_pack.checkpoint.save_load import load_weights
from mindspeed_pack.config.arguments import parse_args
from mindspeed_pack.convert import adapters
from mindspeed_pack.convert.convert import main as convert_main
from mindspeed_pack.datasets.packed_dataset import PackedBatchSource
from mindspeed_pack.model.gpt import build_gpt_model
from mindspeed_pack.model.lora import is_adapter_name
from mindspeed_pack.packing.segments import IGNORE_INDEX, build_packed_batch
from mindspeed_pack.training.batches import packed_seq_params
from mindspeed_pack.training.stages.sft import loss_func
from tests.model_utils import TINY_FLAGS, init_single_process, tiny_args, write_converted_tiny_qwen2
from tests.train_utils import sft_trainer, write_copy_task

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
S = 96
RUN = ["--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "4", "--neat-pack", "--lr", "2e-2",
       "--min-lr", "2e-2", "--lr-warmup-iters", "0", "--train-iters", "3", "--lora-r", "4", "--lora-alpha", "8"]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A tiny random transformers Qwen2 (hf/), its conversion (mg/), another base (other_hf/), packed data."""
    root = tmp_path_factory.mktemp("lora")
    write_converted_tiny_qwen2(root / "qwen")
    write_converted_tiny_qwen2(root / "other", seed=1)
    data = write_copy_task(str(root / "data" / "copy"), num_packs=24, meta=True)
    return {"root": root, "hf": str(root / "qwen" / "hf"), "mg": str(root / "qwen" / "mg"),
            "other_hf": str(root / "other" / "hf"), "data": data}


def _hf(path, dtype=torch.float32):
    import transformers

    return transformers.Qwen2ForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")


# --------------------------------------------------------------------------- PEFT's math, packed
def _peft_model(hf_dir, targets, rslora):
    model = peft.get_peft_model(_hf(hf_dir), peft.LoraConfig(r=4, lora_alpha=6, target_modules=targets,
                                                             lora_dropout=0.0, use_rslora=rslora))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:  # B non-zero too: every path of the adapter carries a gradient
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model


def _samples(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, 256, (n,), generator=g)
        labels = ids.clone()
        labels[: max(1, n // 3)] = IGNORE_INDEX  # the prompt, and the first token
        out.append((ids, labels))
    return out


def _rows(samples, groups):
    """Packed rows [len(groups), S]: row i holds ``samples[j] for j in groups[i]``, then padding."""
    ids = torch.zeros(len(groups), S, dtype=torch.long)
    labels = torch.full((len(groups), S), IGNORE_INDEX)
    seg = torch.zeros(len(groups), S, dtype=torch.long)
    for row, members in enumerate(groups):
        pos = 0
        for k, j in enumerate(members, start=1):
            i, l = samples[j]
            ids[row, pos:pos + len(i)], labels[row, pos:pos + len(i)], seg[row, pos:pos + len(i)] = i, l, k
            pos += len(i)
    return ids, labels, seg


def _packed_step(model, rows):
    """Per-token mean loss of the packed rows and the adapters' gradients under PEFT's names."""
    model.zero_grad()
    b = build_packed_batch(*rows)
    out = model(b.tokens, b.position_ids, None, labels=b.target, packed_seq_params=packed_seq_params(b))
    total, count, _ = loss_func(b, False, out)
    loss = total / count
    loss.backward()
    grads = adapters.to_peft({n: p.grad for n, p in model.named_parameters() if is_adapter_name(n)})
    return loss.item(), grads


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("targets,rslora", [(ALL, False), (["q_proj", "v_proj", "up_proj", "o_proj"], True)],
                         ids=["all-linear", "some-projections-rslora"])
def test_packed_lora_loss_and_adapter_gradients_equal_peft_per_sample(qwen, targets, rslora):
    """A pack's loss and every adapter gradient equal transformers + PEFT on each sample alone (fp32, rel
    <= 1e-5); q/k/v and gate/up each keep their own A and B inside the fused linears; repacking changes
    nothing."""
    init_single_process()
    hf = _peft_model(qwen["hf"], targets, rslora)
    args = tiny_args(seq_length=S, tensor_model_parallel_size=1, pipeline_model_parallel_size=1, lora_r=4,
                     lora_alpha=6.0, lora_dropout=0.0, lora_target_modules=targets, lora_use_rslora=rslora)
    mg = build_gpt_model(args)
    load_weights(args, qwen["mg"], mg)  # the base
    trained = peft.get_peft_model_state_dict(hf)
    missing, unexpected = mg.load_state_dict(adapters.from_peft(trained), strict=False)
    assert not unexpected and not [k for k in missing if is_adapter_name(k)]

    samples = _samples([13, 30, 7, 22, 17])
    hf.zero_grad()
    total, count = 0.0, 0
    for ids, labels in samples:
        logits = hf(ids[None]).logits[0, :-1].float()
        total = total + F.cross_entropy(logits, labels[1:], ignore_index=IGNORE_INDEX, reduction="sum")
        count += int((labels[1:] != IGNORE_INDEX).sum())
    (total / count).backward()
    reference = {n.replace(".default", ""): p.grad for n, p in hf.named_parameters() if "lora_" in n}
    assert set(reference) == set(trained) and len(reference) == 2 * 2 * len(targets)  # layers x (A, B)

    loss, grads = _packed_step(mg, _rows(samples, [[0, 1, 2, 3, 4]]))
    assert abs(loss - (total / count).item()) / loss <= 1e-5
    assert set(grads) == set(reference)
    worst = max(_rel(grads[k], reference[k]) for k in reference)
    assert worst <= 1e-5, worst
    assert min(float(g.abs().max()) for g in reference.values()) > 0  # every adapter is exercised

    loss2, grads2 = _packed_step(mg, _rows(samples, [[4, 2], [1, 3, 0]]))  # other packs, two rows
    assert abs(loss2 - loss) / loss <= 1e-6
    assert max(_rel(grads2[k], grads[k]) for k in grads) <= 1e-5


def _dropped_inputs(linear, tokens: int, training: bool = True) -> dict:
    """The dropped input each projection's A saw in one forward of ``linear`` on ones, features 0..r-1: A_p and
    B_p are set to pass them through to the output unchanged (scale 1)."""
    r = linear.lora_r
    with torch.no_grad():
        for p in linear.lora_parts:
            linear.lora_A[p].copy_(torch.eye(*linear.lora_A[p].shape))
            linear.lora_B[p].copy_(torch.eye(*linear.lora_B[p].shape))
    x = torch.ones(tokens, 1, linear.lora_A[linear.lora_parts[0]].shape[1])
    linear.lora_enabled = False
    base = linear(x)[0]
    linear.lora_enabled = True
    linear.train(training)
    delta = (linear(x)[0] - base).reshape(tokens, linear.lora_groups, -1)  # [tokens, groups, per-group rows]
    out, at = {}, 0
    for p, width in linear.lora_layout:  # each projection's first rows (HF order) sit in group 0
        out[p] = delta[:, 0, at:at + r]
        at += width // linear.lora_groups
    return out


@pytest.mark.parametrize("linear", ["linear_qkv", "linear_fc1"])
def test_lora_dropout_draws_one_mask_per_projection_of_a_fused_linear(linear):
    """--lora-dropout on q/k/v (gate/up) fused in one linear: each projection's A sees its own mask, drawn
    independently at the keep rate 1 - p, as PEFT's separate modules do (one mask shared by the fused projections
    made their updates correlated); off in eval, and p = 0 is the plain forward."""
    init_single_process()
    torch.manual_seed(0)
    p, tokens = 0.25, 2048
    args = tiny_args(seq_length=S, tensor_model_parallel_size=1, pipeline_model_parallel_size=1, lora_r=4,
                     lora_alpha=4.0, lora_dropout=p, lora_target_modules=["all-linear"], lora_use_rslora=False)
    layer = build_gpt_model(args).decoder.layers[0]
    module = layer.self_attention.linear_qkv if linear == "linear_qkv" else layer.mlp.linear_fc1
    masks = _dropped_inputs(module, tokens)
    assert len(masks) == (3 if linear == "linear_qkv" else 2)
    for name, m in masks.items():
        kept = m != 0
        assert torch.allclose(m[kept], torch.full_like(m[kept], 1 / (1 - p))), name  # inverted dropout's scale
        assert abs(float(kept.float().mean()) - (1 - p)) < 0.03, name  # 8192 draws: 6 standard deviations
    names = list(masks)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            agree = float(((masks[a] != 0) == (masks[b] != 0)).float().mean())
            # independent masks agree with probability p^2 + (1 - p)^2 = 0.625; one shared mask agrees everywhere
            assert abs(agree - (p * p + (1 - p) ** 2)) < 0.04, (a, b, agree)

    x = torch.randn(8, 1, module.lora_A[names[0]].shape[1])
    evaluated = module.eval()(x)[0]  # no dropout in eval: every projection sees the input itself
    assert all(torch.allclose(m, torch.ones_like(m)) for m in _dropped_inputs(module, 8, training=False).values())
    module.lora_dropout = None  # p = 0 (what the build gives for --lora-dropout 0): training is the same forward
    assert torch.equal(module.train()(x)[0], evaluated)


# --------------------------------------------------------------------------- a trained run, in process
def _trainer(qwen, out, *extra):
    argv = [*TINY_FLAGS, *RUN, "--data-path", qwen["data"], "--load", qwen["mg"], "--save", out, *extra]
    return sft_trainer(parse_args(argv), PackedBatchSource())


@pytest.fixture(scope="module")
def trained(qwen):
    """Three LoRA steps on the Megatron base, in this process; the trainer stays for its logits."""
    init_single_process()
    out = str(qwen["root"] / "run")
    trainer = _trainer(qwen, out)
    trainer.setup()
    module = trainer.model[0].module
    base_before = {n: p.detach().clone() for n, p in module.named_parameters() if not is_adapter_name(n)}
    trainer.train()
    trainer.cleanup()
    return {"trainer": trainer, "module": module, "base_before": base_before, "save": out}


def _count(params):
    return len(params), sum(p.numel() for p in params)


def test_base_stays_bit_identical_and_only_adapters_have_gradients_and_optimizer_state(trained):
    module, trainer = trained["module"], trained["trainer"]
    named = dict(module.named_parameters())
    lora = [p for n, p in named.items() if is_adapter_name(n)]
    base = [p for n, p in named.items() if not is_adapter_name(n)]
    assert _count(lora) == (28, 8192)  # 2 layers x (q k v o gate up down) x (A, B), r=4
    for name, before in trained["base_before"].items():
        assert torch.equal(named[name].detach(), before), name
        assert not named[name].requires_grad and getattr(named[name], "main_grad", None) is None
    assert any(not torch.equal(p, torch.zeros_like(p)) for n, p in named.items() if ".lora_B." in n)  # trained
    in_optimizer = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in in_optimizer} == {id(p) for p in lora}
    states = trainer.optimizer.state_dict()["state"]
    assert len(states) == len(lora)
    in_buffers = [p for buf in trainer.model[0].buffers for p in buf.params]
    assert {id(p) for p in in_buffers} == {id(p) for p in lora}
    assert sum(buf.grad_data.numel() for buf in trainer.model[0].buffers) < sum(p.numel() for p in base) / 10


def test_save_holds_the_adapters_and_the_bases_fingerprint(qwen, trained):
    from mindspeed_pack.convert import megatron_layout as layout

    record = layout.load_file(layout.checkpoint_file(trained["save"], 3, 0, 0, 1))
    assert record["model"] and all(is_adapter_name(k) for k in record["model"])
    assert record["lora"]["r"] == 4 and record["lora"]["alpha"] == 8.0
    assert record["lora"]["base"]["path"] == os.path.abspath(qwen["mg"])
    assert record["lora"]["base"]["fingerprint"] == adapters.fingerprint(qwen["mg"])  # computed independently
    assert len(record["optimizer"]["state"]) == 28


def test_load_of_a_lora_runs_save_is_refused_by_name(qwen, trained, capsys):
    """``--load SAVE`` of a LoRA run (the README promises "refused by name"; it printed the usage and
    "missing required arguments: --num-layers, ...") says to pass the base as --load and SAVE as --lora-load."""
    with pytest.raises(SystemExit):
        parse_args(["--data-path", qwen["data"], "--seq-length", "128", "--neat-pack", "--train-iters", "1",
                    "--load", trained["save"]])
    err = capsys.readouterr().err
    assert f"--load {trained['save']} holds LoRA adapters (a LoRA run's --save), not a model: pass their base " \
           f"({os.path.abspath(qwen['mg'])}) as --load, {trained['save']} as --lora-load" in err, err
    assert "missing required arguments" not in err


def _logits(module, ids):
    module.eval()
    with torch.no_grad():
        return module(ids, torch.arange(ids.shape[1])[None], None)[..., :256].float()


def _peft_logits(base_dir, adapter_dir, ids, dtype=torch.float32):
    model = peft.PeftModel.from_pretrained(_hf(base_dir, dtype), adapter_dir).eval()
    with torch.no_grad():
        return model(ids).logits.float()


def _merged_logits(path, ids, dtype=torch.float32):
    with torch.no_grad():
        return _hf(path, dtype).eval()(ids).logits.float()


def test_peft_and_merged_exports_give_the_trained_models_logits(qwen, trained, tmp_path):
    """--save-hf (PEFT adapter dir; --lora-merge: a transformers model) and convert_ckpt.py --lora-load of the
    --save checkpoint (PEFT; merged into the Megatron base): max abs logit difference <= 1e-5 in fp32."""
    trainer, module = trained["trainer"], trained["module"]
    ids = torch.randint(3, 200, (1, 48), generator=torch.Generator().manual_seed(5))
    mine = _logits(module, ids)
    hf_checkpoint.save_hf(trainer.args, trainer.model, str(tmp_path / "peft"))
    trainer.args.lora_merge = True
    try:
        hf_checkpoint.save_hf(trainer.args, trainer.model, str(tmp_path / "merged"))
    finally:
        trainer.args.lora_merge = False
    assert sorted(os.listdir(tmp_path / "peft")) == [adapters.ADAPTER_CONFIG, adapters.ADAPTER_WEIGHTS]
    assert convert_main(["--load-model-type", "mg", "--load-dir", qwen["mg"], "--lora-load", trained["save"],
                         "--save-model-type", "hf", "--save-dir", str(tmp_path / "cli_peft")]) == 0
    assert convert_main(["--load-model-type", "mg", "--load-dir", qwen["mg"], "--lora-load", trained["save"],
                         "--save-model-type", "hf", "--save-dir", str(tmp_path / "cli_merged"), "--lora-merge"]) == 0
    base_hf = qwen["hf"]  # the Megatron base was converted from it: the same weights
    diffs = {
        "--save-hf peft": _peft_logits(base_hf, str(tmp_path / "peft"), ids),
        "--save-hf --lora-merge": _merged_logits(str(tmp_path / "merged"), ids),
        "convert_ckpt peft": _peft_logits(base_hf, str(tmp_path / "cli_peft"), ids),
        "convert_ckpt --lora-merge": _merged_logits(str(tmp_path / "cli_merged"), ids),
    }
    # the PEFT exports name the HF directory the Megatron base was converted from: they load by themselves
    for name in ("peft", "cli_peft"):
        with torch.no_grad():
            alone = peft.AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / name), dtype=torch.float32,
                                                                   attn_implementation="eager").eval()
            diffs[f"{name} (AutoPeftModel)"] = alone(ids).logits.float()
    diffs = {k: float((v - mine).abs().max()) for k, v in diffs.items()}
    assert max(diffs.values()) <= 1e-5, diffs
    assert float((_merged_logits(base_hf, ids) - mine).abs().max()) > 1e-2  # the adapters matter


@pytest.fixture(scope="module")
def trained_bf16(qwen):
    """Three bf16 LoRA steps, saved (the optimizer keeps an fp32 master copy of the adapters)."""
    init_single_process()
    out = str(qwen["root"] / "run_bf16")
    trainer = _trainer(qwen, out, "--bf16", "--save-hf", str(qwen["root"] / "run_bf16_peft"))
    trainer.setup()
    trainer.train()
    trainer.cleanup()
    return {"trainer": trainer, "save": out}


def test_bf16_exports_logit_difference_is_reported(qwen, trained_bf16, tmp_path, capsys):
    """bf16 training: the PEFT and merged exports (bf16 weights) against the trained model's bf16 logits."""
    trainer = trained_bf16["trainer"]
    hf_checkpoint.save_hf(trainer.args, trainer.model, str(tmp_path / "peft"))
    trainer.args.lora_merge = True
    try:
        hf_checkpoint.save_hf(trainer.args, trainer.model, str(tmp_path / "merged"))
    finally:
        trainer.args.lora_merge = False
    ids = torch.randint(3, 200, (1, 48), generator=torch.Generator().manual_seed(5))
    mine = _logits(trainer.model[0].module, ids)
    peft_diff = float((_peft_logits(qwen["hf"], str(tmp_path / "peft"), ids, torch.bfloat16) - mine).abs().max())
    merged_diff = float((_merged_logits(str(tmp_path / "merged"), ids, torch.bfloat16) - mine).abs().max())
    scale = float(mine.abs().max())
    with capsys.disabled():
        print(f"\nbf16 LoRA exports: max |logit diff| PEFT {peft_diff:.4f}, merged {merged_diff:.4f} "
              f"(logits up to {scale:.2f})")
    assert peft_diff <= 0.05 * scale and merged_diff <= 0.05 * scale


def test_bf16_adapter_checkpoint_reshards_with_its_fp32_master_copy(trained_bf16, tmp_path):
    """convert_ckpt.py mg->mg of a bf16 LoRA run's checkpoint: at TP2 each rank holds its slice of the fp32
    master copy beside its bf16 adapters (B of linear_qkv by rows, A of linear_proj by columns), and back at TP1
    every tensor of the model and optimizer state is bit-identical to the saved one."""
    from mindspeed_pack.convert import megatron_layout as layout

    def reshard(load, save, tp):
        assert convert_main(["--load-model-type", "mg", "--save-model-type", "mg", "--load-dir", load, "--save-dir",
                             save, "--target-tensor-parallel-size", str(tp)]) == 0
        return [layout.load_file(layout.checkpoint_file(save, 3, t, 0, 1)) for t in range(tp)]

    saved = layout.load_file(layout.checkpoint_file(trained_bf16["save"], 3, 0, 0, 1))
    tp2 = reshard(trained_bf16["save"], str(tmp_path / "tp2"), 2)
    names = list(saved["model"])
    for name, rows, cols in (("decoder.layers.1.self_attention.linear_qkv.lora_B.k_proj", 2, 1),
                             ("decoder.layers.1.self_attention.linear_proj.lora_A.o_proj", 1, 2)):
        i = names.index(name)
        master = saved["optimizer"]["fp32_from_fp16_params"][0][i]
        for t, rank in enumerate(tp2):
            assert rank["model"][name].dtype == torch.bfloat16, name
            j = list(rank["model"]).index(name)
            shard = rank["optimizer"]["fp32_from_fp16_params"][0][j]
            h, w = master.shape[0] // rows, master.shape[1] // cols
            expected = master[t * h:(t + 1) * h] if rows == 2 else master[:, t * w:(t + 1) * w]
            assert shard.dtype == torch.float32 and torch.equal(shard, expected), (name, t)
    (back,) = reshard(str(tmp_path / "tp2"), str(tmp_path / "back"), 1)
    for key in ("model", "optimizer", "opt_param_scheduler", "iteration", "consumed_samples", "lora"):
        assert _equal(saved[key], back[key]), key


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


# --------------------------------------------------------------------------- bad input
def _exit(argv, capsys):
    from mindspeed_pack.training.cli import run_cli

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run_cli("posttrain.py", lambda: posttrain.main(argv))
    return e.value.code, capsys.readouterr().err.strip().splitlines()[-1]


def test_adapters_of_another_base_are_refused(qwen, trained, tmp_path, capsys):
    """--lora-load on a base that is not the adapters' (training and export), and --lora-load of a full model."""
    argv = [*TINY_FLAGS, *RUN, "--data-path", qwen["data"], "--lora-load", trained["save"]]
    code, line = _exit([*argv, "--load", qwen["other_hf"]], capsys)
    assert code == 2 and line.startswith("posttrain.py: error: --lora-load")
    fp = adapters.fingerprint(qwen["other_hf"])[:16]
    assert f"trained on the base {os.path.abspath(qwen['mg'])}" in line and fp in line
    # (qwen/hf itself is accepted: qwen/mg, the adapters' base, is its fp32 conversion and records it)
    assert convert_main(["--load-model-type", "hf", "--load-dir", qwen["other_hf"], "--lora-load", trained["save"],
                         "--save-model-type", "hf", "--save-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "convert_ckpt: error: --lora-load" in err and "--load-dir" in err and not os.path.exists(tmp_path / "out")
    code, line = _exit([*TINY_FLAGS, *RUN, "--data-path", qwen["data"], "--load", qwen["hf"], "--lora-load",
                        qwen["mg"]], capsys)
    assert code == 2 and "holds no LoRA adapters" in line
    code, line = _exit([*TINY_FLAGS, *RUN, "--data-path", qwen["data"], "--load", trained["save"]], capsys)
    assert code == 2 and "holds LoRA adapters (a LoRA run's --save), not a base model" in line
    code, line = _exit([*TINY_FLAGS, *RUN, "--data-path", qwen["data"], "--load", qwen["hf"], "--lora-load",
                        trained["save"], "--lora-r", "8"], capsys)
    assert code == 2 and "--lora-r: checkpoint 4, flags 8" in line


def _peft_export(qwen, trained, out):
    assert convert_main(["--load-model-type", "mg", "--load-dir", qwen["mg"], "--lora-load", trained["save"],
                         "--save-model-type", "hf", "--save-dir", str(out)]) == 0
    return str(out)


def test_peft_dir_of_other_settings_or_another_base_is_refused_by_name(qwen, trained, tmp_path, capsys):
    """--lora-load PEFT_DIR: LoRA flags that differ from adapter_config.json, settings this trainer cannot
    express (DoRA), adapters missing on a layer, and a --load that is not the base the export records."""
    import json
    import shutil

    peft_dir = _peft_export(qwen, trained, tmp_path / "peft")
    argv = [*TINY_FLAGS, *RUN, "--data-path", qwen["data"], "--load", qwen["mg"], "--lora-load", peft_dir]
    code, line = _exit([*argv, "--lora-r", "8", "--lora-target-modules", "q_proj", "v_proj"], capsys)
    assert code == 2 and f"--lora-load {peft_dir}: the LoRA flags differ from the adapters' (--lora-r: " \
        "adapter_config.json 4, flags 8; --lora-target-modules: adapter_config.json down_proj gate_proj k_proj " \
        "o_proj q_proj up_proj v_proj, flags q_proj v_proj)" in line, line
    dora = str(tmp_path / "dora")
    shutil.copytree(peft_dir, dora)
    config = json.load(open(os.path.join(dora, adapters.ADAPTER_CONFIG)))
    json.dump({**config, "use_dora": True}, open(os.path.join(dora, adapters.ADAPTER_CONFIG), "w"))
    code, line = _exit([*argv[:-1], dora], capsys)
    assert code == 2 and "adapter_config.json: use_dora true (DoRA): this trainer's adapters are plain LoRA" in line
    json.dump({**config, "modules_to_save": ["lm_head"]}, open(os.path.join(dora, adapters.ADAPTER_CONFIG), "w"))
    code, line = _exit([*argv[:-1], dora], capsys)
    assert code == 2 and "adapter_config.json: modules_to_save [\"lm_head\"] (fully trained extra modules): this " \
        "trainer trains in full beside the adapters only a reward model's ['score']" in line, line
    json.dump({**config, "modules_to_save": ["classifier", "score"]}, open(os.path.join(dora, adapters.ADAPTER_CONFIG),
                                                                           "w"))
    code, line = _exit([*argv[:-1], dora], capsys)  # PEFT's sequence classifiers name both: the tensor must be there
    assert code == 2 and "adapter_model.safetensors: no tensors of modules_to_save ['score'] (named in " \
        "adapter_config.json)" in line, line
    from safetensors.torch import load_file, save_file

    gap = str(tmp_path / "gap")
    shutil.copytree(peft_dir, gap)
    weights = os.path.join(gap, adapters.ADAPTER_WEIGHTS)
    save_file({k: v for k, v in load_file(weights).items() if ".layers.1.mlp." not in k}, weights)
    code, line = _exit([*argv[:-1], gap], capsys)
    assert code == 2 and "layer 1 holds ['k_proj.lora_A', 'k_proj.lora_B', 'o_proj.lora_A', 'o_proj.lora_B', " \
        "'q_proj.lora_A', 'q_proj.lora_B', 'v_proj.lora_A', 'v_proj.lora_B'], the others lora_A and lora_B of " \
        "['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj']" in line, line
    code, line = _exit([*argv[:-4], "--load", qwen["other_hf"], "--lora-load", peft_dir], capsys)
    assert code == 2 and line.startswith(f"posttrain.py: error: --lora-load {peft_dir}: the adapters were trained "
                                         f"on the base {os.path.abspath(qwen['mg'])}"), line
    # another tool's PEFT directory names its base by base_model_name_or_path alone (no metadata): the HF directory
    # is accepted beside its conversion (same weights), and refused beside another model
    foreign = str(tmp_path / "foreign")
    shutil.copytree(peft_dir, foreign)
    weights = os.path.join(foreign, adapters.ADAPTER_WEIGHTS)
    save_file(load_file(weights), weights)
    json.dump({**config, "base_model_name_or_path": qwen["hf"]}, open(os.path.join(foreign, adapters.ADAPTER_CONFIG),
                                                                      "w"))
    code, line = _exit([*argv[:-4], "--load", qwen["other_hf"], "--lora-load", foreign], capsys)
    assert code == 2 and f"adapter_config.json names the base {qwen['hf']}, whose content differs" in line, line
    metrics = str(tmp_path / "foreign.jsonl")
    posttrain.main([*argv[:-1], foreign, "--train-iters", "1", "--metrics-file", metrics])
    assert [r["iteration"] for r in map(json.loads, open(metrics)) if r.get("split") == "train"] == [1]


def test_a_peft_dir_whose_config_rank_is_not_its_tensors_is_refused_by_name(qwen, trained, tmp_path, capsys):
    """adapter_config.json's r fills --lora-r: when its tensors hold another rank, say so (the load blamed the model
    flags, which the user never gave)."""
    import json

    peft_dir = _peft_export(qwen, trained, tmp_path / "peft")
    path = os.path.join(peft_dir, adapters.ADAPTER_CONFIG)
    json.dump({**json.load(open(path)), "r": 8}, open(path, "w"))
    code, line = _exit([*TINY_FLAGS, *RUN[:-4], "--data-path", qwen["data"], "--load", qwen["mg"], "--lora-load",
                        peft_dir], capsys)
    assert code == 2 and "adapter_model.safetensors: base_model.model.model.layers.0.mlp.down_proj.lora_A.weight " \
        "has rank 4, but adapter_config.json says r 8: the file and its config disagree" in line, line


def test_a_named_peft_adapters_parent_directory_names_its_subdirectory(qwen, trained, tmp_path, capsys):
    """PEFT saves an adapter not named 'default' in DIR/NAME: --lora-load DIR asked for LoRA flags, or (given them)
    found 'no checkpoint', instead of pointing at DIR/NAME."""
    parent = tmp_path / "named"
    _peft_export(qwen, trained, parent / "sft")
    argv = [*TINY_FLAGS, *RUN[:-4], "--data-path", qwen["data"], "--load", qwen["mg"], "--lora-load", str(parent)]
    for extra in ([], RUN[-4:]):
        code, line = _exit([*argv, *extra], capsys)
        assert code == 2 and f"--lora-load {parent}: no adapter_config.json there, but the PEFT adapters sft below " \
            f"it (PEFT saves an adapter not named 'default' in a subdirectory of its name): pass --lora-load " \
            f"{parent / 'sft'}" in line, line


def test_convert_of_a_peft_dir_as_lora_load_says_what_to_do(qwen, trained, tmp_path, capsys):
    """convert_ckpt.py --lora-load exports a LoRA run's checkpoint; a PEFT directory (e.g. --save-hf's) got 'no
    latest_checkpointed_iteration.txt; not a Megatron checkpoint directory'."""
    peft_dir = _peft_export(qwen, trained, tmp_path / "peft")
    capsys.readouterr()
    assert convert_main(["--load-model-type", "hf", "--load-dir", qwen["hf"], "--lora-load", peft_dir,
                         "--save-model-type", "hf", "--save-dir", str(tmp_path / "merged"), "--lora-merge"]) != 0
    assert f"--lora-load {peft_dir}: a PEFT adapter directory, not a LoRA run's checkpoint" in capsys.readouterr().err


def test_adapters_are_accepted_on_a_reshard_of_their_megatron_base(qwen, trained, tmp_path, capsys):
    """A Megatron base's fingerprint is its files', which a reshard changes (TP2's files are others): the reshard
    records the bases it came from, so the adapters trained on qwen/mg are accepted on its TP2 reshard (export) and
    on that one's reshard back to TP1 (training), and a reshard of another model is still refused."""
    import posttrain

    def reshard(load, save, tp):
        assert convert_main(["--load-model-type", "mg", "--save-model-type", "mg", "--load-dir", load, "--save-dir",
                             save, "--target-tensor-parallel-size", str(tp)]) == 0
        return save

    tp2 = reshard(qwen["mg"], str(tmp_path / "base_tp2"), 2)
    assert convert_main(["--load-model-type", "mg", "--load-dir", tp2, "--lora-load", trained["save"],
                         "--save-model-type", "hf", "--save-dir", str(tmp_path / "peft")]) == 0
    # PEFT loads adapters on a HF model: the export names the directory the Megatron base was converted from
    assert adapters.hf_origin(tp2) == os.path.abspath(qwen["hf"])
    config = json.loads((tmp_path / "peft" / adapters.ADAPTER_CONFIG).read_text())
    assert config["base_model_name_or_path"] == os.path.abspath(qwen["hf"])
    back = reshard(tp2, str(tmp_path / "base_back"), 1)
    assert adapters.same_weights_as(back) == [adapters.fingerprint(tp2), adapters.fingerprint(qwen["mg"]),
                                              adapters.fingerprint(qwen["hf"])]  # qwen/mg is hf's fp32 conversion
    argv = [*TINY_FLAGS, *RUN, "--train-iters", "4", "--data-path", qwen["data"], "--load", back, "--lora-load",
            trained["save"]]
    code, line = _exit(argv, capsys)  # past the base check: the schedule (now named by the flag it came from)
    assert code == 2 and f"--lora-load {trained['save']}: the learning-rate schedule differs" in line, line
    posttrain.main([*argv, "--lr-decay-iters", "3", "--metrics-file", str(tmp_path / "m.jsonl")])
    assert [json.loads(line)["iteration"] for line in open(tmp_path / "m.jsonl")
            if json.loads(line).get("split") == "train"] == [4]
    other = reshard(str(qwen["root"] / "other" / "mg"), str(tmp_path / "other_tp2"), 2)
    capsys.readouterr()
    assert convert_main(["--load-model-type", "mg", "--load-dir", other, "--lora-load", trained["save"],
                         "--save-model-type", "hf", "--save-dir", str(tmp_path / "refused")]) == 2
    assert "the adapters were trained on the base" in capsys.readouterr().err


def test_finetune_from_a_lora_runs_own_save_resumes_it(qwen, tmp_path, caplog):
    """--lora-load D --save D --finetune (a config file's 'finetune: true') on a LoRA run's own D was refused as
    'another run's (--lora-load D here, (not set) there)': its record now decides, as for --load D --save D."""
    import logging

    save = str(tmp_path / "run")
    argv = [*TINY_FLAGS, *RUN, "--train-iters", "1", "--data-path", qwen["data"], "--load", qwen["mg"], "--save", save]
    posttrain.main(argv)  # the LoRA run, recorded in D/run_config.yaml
    with caplog.at_level(logging.INFO):
        posttrain.main([*argv, "--lora-load", save, "--finetune"])
    assert "holds iteration 1 of this run" in caplog.text and "resuming from it" in caplog.text
    assert "nothing to train" in caplog.text  # the run had ended: its iteration, not a restart at 0


def test_the_same_command_from_a_peft_dir_resumes_its_own_save(qwen, trained, tmp_path, caplog):
    """--lora-load PEFT_DIR --save S run again (torchrun's restart, or by hand) started over from the PEFT adapters at
    iteration 0 and saved over S's iterations (measured: iterations 1-4 trained again, the same losses); a PEFT
    directory is weights, like --finetune: S holding this run's checkpoint is resumed."""
    import logging

    peft_dir = _peft_export(qwen, trained, tmp_path / "peft")
    save = str(tmp_path / "run")
    argv = [*TINY_FLAGS, *RUN[:-4], "--train-iters", "1", "--data-path", qwen["data"], "--load", qwen["mg"],
            "--lora-load", peft_dir, "--save", save]
    posttrain.main(argv)
    with caplog.at_level(logging.INFO):
        posttrain.main(argv)
    assert "holds iteration 1 of this run" in caplog.text and "resuming from it" in caplog.text, caplog.text
    assert "nothing to train" in caplog.text  # the run had ended: its iteration, not a restart at 0
    assert "loaded the PEFT adapters" not in caplog.text


def test_dry_run_memory_counts_adapters_not_the_frozen_base():
    """--dry-run's plan under LoRA: Qwen2.5-7B r=8 on all linears has 20.2M adapter parameters (the README's
    table), and only they get gradients and optimizer state."""
    from types import SimpleNamespace

    from mindspeed_pack.model import lora as lora_module
    from mindspeed_pack.training.run_plan import memory_estimate

    args = SimpleNamespace(
        num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28, num_query_groups=4,
        kv_channels=None, swiglu=True, add_qkv_bias=True, padded_vocab_size=152064, max_position_embeddings=4096,
        position_embedding_type="rope", untie_embeddings_and_output_weights=True, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, expert_model_parallel_size=1, context_parallel_size=1, data_parallel_size=1,
        use_distributed_optimizer=False, bf16=True, fp16=False, optimizer="adam", seq_length=4096,
        micro_batch_size=1, sequence_parallel=False, num_micro_batches=1, num_experts=None,
        lora_r=8, lora_alpha=16, lora_dropout=0.0, lora_target_modules=["all-linear"], lora_use_rslora=False)
    adapters = lora_module.adapter_parameters(lora_module.settings_from_args(args), args)
    assert adapters == 28 * 8 * (2 * 3584 + 2 * (3584 + 512) + 2 * 3584 + 3 * (3584 + 18944))
    with_lora = memory_estimate(args)
    full = memory_estimate(SimpleNamespace(**{**vars(args), "lora_r": None}))
    assert with_lora["trained per GPU"] == adapters and full["trained per GPU"] == full["parameters per GPU"]
    assert with_lora["optimizer"] == adapters * 12 / 1024 ** 3 and with_lora["optimizer"] < full["optimizer"] / 300


def test_readme_memory_table_is_the_dry_run_estimate_in_gib():
    """The README's Qwen2.5-7B memory table is what --dry-run estimates, in the unit --dry-run prints (GiB), with
    LoRA's replicated factors counted on every tensor-parallel rank."""
    import re
    from types import SimpleNamespace

    from mindspeed_pack.training.run_plan import memory_estimate, plan_lines

    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    rows = re.findall(r"^\| TP(\d) (full fine-tuning|LoRA r=(\d+), all linears) \| ([\d.]+)([BM]) \| ([\d.]+) GiB \| "
                      r"([\d.]+) GiB \| ([\d.]+) GiB \| ([\d.]+) GiB \|$", readme, flags=re.M)
    assert len(rows) == 6, rows
    qwen7b = dict(num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28, num_query_groups=4,
                  kv_channels=None, swiglu=True, add_qkv_bias=True, padded_vocab_size=152064,
                  max_position_embeddings=4096, position_embedding_type="rope",
                  untie_embeddings_and_output_weights=True, pipeline_model_parallel_size=1,
                  expert_model_parallel_size=1, context_parallel_size=1, data_parallel_size=1,
                  use_distributed_optimizer=False, bf16=True, fp16=False, optimizer="adam", seq_length=4096,
                  micro_batch_size=1, sequence_parallel=False, num_micro_batches=1, num_experts=None, lora_alpha=16,
                  lora_dropout=0.0, lora_target_modules=["all-linear"], lora_use_rslora=False)
    for tp, _, r, trainable, unit, weights, grads, optimizer, total in rows:
        m = memory_estimate(SimpleNamespace(**qwen7b, tensor_model_parallel_size=int(tp), lora_r=int(r) if r else None))
        assert abs(m["trained per GPU"] / (1e9 if unit == "B" else 1e6) - float(trainable)) < 0.051
        assert [round(m[k], 2) for k in ("weights", "gradients", "optimizer")] == [float(weights), float(grads),
                                                                                     float(optimizer)]
        assert round(m["weights"] + m["gradients"] + m["optimizer"], 1) == float(total)
    args = SimpleNamespace(**qwen7b, tensor_model_parallel_size=4, lora_r=None, data_path=None, train_iters=10,
                           global_batch_size=8, split="100,0,0", epochs_note=None, train_epochs=None,
                           data_summary="(none)")
    memory = next(line for line in plan_lines(args) if line.startswith("memory per GPU"))
    assert "weights 3.55 GiB" in memory and " GB" not in memory, memory


def test_mindspeed_llms_lora_export_flags_are_checked_against_the_adapters(qwen, trained, tmp_path, capsys):
    """MindSpeed-LLM's mcore2hf_lora script passes --lora-r/--lora-alpha/--lora-target-modules, --hf-cfg-dir and its
    family name: the settings must be the adapters' own (the record decides; a mismatch is refused, nothing
    written)."""
    base = ["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", qwen["mg"], "--lora-load",
            trained["save"], "--hf-cfg-dir", qwen["hf"], "--model-type-hf", "qwen25", "--lora-alpha", "8",
            "--lora-target-modules", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    assert convert_main([*base, "--lora-r", "4", "--save-dir", str(tmp_path / "same")]) == 0
    assert (tmp_path / "same" / adapters.ADAPTER_CONFIG).exists()
    capsys.readouterr()
    assert convert_main([*base, "--lora-r", "8", "--save-dir", str(tmp_path / "other")]) == 2
    assert "was trained with other LoRA settings: --lora-r 8 (record: 4)" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()
    # its lora2hf script: --load-dir is the adapters' checkpoint, --save-lora-to-hf writes them alone
    assert convert_main(["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", trained["save"],
                         "--save-lora-to-hf", "--lora-r", "4", "--model-type-hf", "qwen25",
                         "--save-dir", str(tmp_path / "alone")]) == 0
    from safetensors.torch import load_file

    alone = load_file(str(tmp_path / "alone" / adapters.ADAPTER_WEIGHTS))
    same = load_file(str(tmp_path / "same" / adapters.ADAPTER_WEIGHTS))
    assert sorted(alone) == sorted(same) and all(torch.equal(alone[k], same[k]) for k in same)


def test_adapters_trained_on_a_hf_directory_export_on_its_conversion(qwen, tmp_path):
    """MindSpeed-LLM's order: tune from the HF directory, then mcore2hf_lora on the hf2mcore checkpoint. The
    conversion now records the directory's fingerprint (same weights, fp32), so the adapters' base check accepts
    it (it said "trained on the base ... but --load-dir has fingerprint ...")."""
    init_single_process()
    save = str(tmp_path / "from_hf")
    argv = [*TINY_FLAGS, *RUN, "--train-iters", "1", "--data-path", qwen["data"], "--load", qwen["hf"],
            "--save", save, "--save-hf", str(tmp_path / "export")]
    trainer = sft_trainer(parse_args(argv), PackedBatchSource())
    trainer.setup()
    try:
        trainer.train()
    finally:
        trainer.cleanup()
    assert convert_main(["--load-model-type", "mg", "--load-dir", qwen["mg"], "--lora-load", save,
                         "--save-model-type", "hf", "--save-dir", str(tmp_path / "peft")]) == 0
    assert (tmp_path / "peft" / adapters.ADAPTER_CONFIG).exists()


def test_a_lora_runs_checkpoint_gives_its_lora_flags(qwen, trained):
    """--lora-load of a LoRA run's --save asked for --lora-r, --lora-alpha and --lora-target-modules, though the
    checkpoint records them (a PEFT directory's were read from adapter_config.json): taken from the record."""
    from mindspeed_pack.config.arguments import parse_args
    from mindspeed_pack.model import lora

    assert RUN[-4:] == ["--lora-r", "4", "--lora-alpha", "8"]
    base = [*TINY_FLAGS, *RUN[:-4], "--data-path", qwen["data"], "--load", qwen["mg"], "--lora-load", trained["save"]]
    args = parse_args(base, world_size=1)
    mine = trained["trainer"].args
    assert (args.lora_r, args.lora_alpha, args.lora_use_rslora) == (4, 8.0, False)
    assert lora.resolve_targets(args.lora_target_modules or [lora.ALL_LINEAR]) == lora.resolve_targets(
        mine.lora_target_modules or [lora.ALL_LINEAR])  # all linears: left at the default, as the run gave it
    assert args.flag_sources["lora_r"][1] == "checkpoint"
    # some given: the others still from the record (alpha fell back to its default, 32, then 'differed')
    args = parse_args([*base, "--lora-r", "4"], world_size=1)
    assert (args.lora_r, args.lora_alpha) == (4, 8.0)


def test_a_peft_adapter_of_the_embedding_is_refused_by_name():
    """PEFT adapts embed_tokens on request; the refusal said only 'not a LoRA adapter of a projection'."""
    from mindspeed_pack.convert.model_specs import ConversionError

    for key in ("base_model.model.model.embed_tokens.lora_embedding_A", "base_model.model.lm_head.lora_A.weight"):
        with pytest.raises(ConversionError, match="adapters \\(or trained copies\\) of the embedding or output layer "
                                                  "are not supported here"):
            adapters.canonical_name(key)


def _plain_peft_dir(path, **config):
    """A PEFT directory of q_proj adapters on two layers (r 2), adapter_config.json updated with ``config``."""
    from safetensors.torch import save_file

    os.makedirs(path)
    tensors = {f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{ab}.weight": torch.zeros(shape)
               for i in range(2) for ab, shape in (("A", (2, 64)), ("B", (64, 2)))}
    save_file(tensors, os.path.join(path, adapters.ADAPTER_WEIGHTS))
    json.dump({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "bias": "none",
               "init_lora_weights": True, **config}, open(os.path.join(path, adapters.ADAPTER_CONFIG), "w"))
    return str(path)


@pytest.mark.parametrize("config, message", [
    # PiSSA, OLoRA, CorDA, LoftQ and LoRA-GA subtract the adapters' start from the base weights: PEFT saves the
    # adapters of that residual base. Read as plain LoRA on the original base, a freshly initialised PiSSA adapter
    # (q/v, r 4, on the tiny Qwen2) moved the logits by 2.6 where PEFT's model equals the base (measured); it loaded
    ({"init_lora_weights": "pissa"}, "init_lora_weights 'pissa': PiSSA"),
    ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights 'pissa_niter_4': PiSSA"),
    ({"init_lora_weights": "olora"}, "init_lora_weights 'olora': OLoRA"),
    ({"init_lora_weights": "corda"}, "init_lora_weights 'corda': CorDA"),
    ({"init_lora_weights": "loftq"}, "init_lora_weights 'loftq': LoftQ"),
    ({"init_lora_weights": "lora_ga"}, "init_lora_weights 'lora_ga': LoRA-GA"),
    # PEFT's LoRA variants whose forward is not B A x: KaSA (a learned diagonal between A and B, on a truncated
    # base; its lora_diag tensors were blamed as 'not a LoRA adapter of a projection') and Arrow (routing among
    # several LoRAs; it loaded as one plain LoRA)
    ({"kasa_config": {"svd_rank": None}}, "kasa_config {\"svd_rank\": null} (KaSA"),
    ({"arrow_config": {"top_k": 3}}, "arrow_config {\"top_k\": 3} (Arrow"),
])
def test_peft_adapters_that_are_not_plain_lora_on_the_base_are_refused_by_name(tmp_path, config, message):
    from mindspeed_pack.convert.model_specs import ConversionError

    path = _plain_peft_dir(tmp_path / "peft", **config)
    with pytest.raises(ConversionError) as e:
        adapters.read_peft_settings(path)
    assert message in str(e.value), str(e.value)


@pytest.mark.parametrize("init", [True, False, "gaussian", "eva", "orthogonal", "mica"])
def test_peft_adapters_of_plain_lora_inits_on_the_base_load(tmp_path, init):
    """Inits that leave the base as it is (B A x on the same weights) still load."""
    assert adapters.read_peft_settings(_plain_peft_dir(tmp_path / "peft", init_lora_weights=init))["r"] == 2


@pytest.mark.parametrize("model_flags, targets, message", [
    ([f for f in TINY_FLAGS if f != "--swiglu"], ["linear_fc1"], "LoRA on linear_fc1 of a model without a gated MLP"),
    ([*TINY_FLAGS, "--num-experts", "4", "--moe-router-topk", "2"], ["linear_fc1", "linear_fc2"],
     "none of the targeted linears exists in this model's layers"),
])
def test_adapters_the_model_has_no_linear_for_are_refused_by_the_parser(model_flags, targets, message, capsys):
    """Targets building the model refuses (fc1 of a GELU MLP; only MLPs, every layer MoE) are refused with the flags,
    so --dry-run refuses them too: it planned such a run, which then stopped in the model build with a traceback."""
    with pytest.raises(SystemExit):
        parse_args([*model_flags, "--data-path", "d", "--seq-length", "128", "--micro-batch-size", "1",
                    "--train-iters", "1", "--lr", "1e-4", "--lora-target-modules", *targets, "--dry-run"], world_size=1)
    assert f"error: --lora-target-modules: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("given, same_as", [
    (["q_proj,v_proj"], ["q_proj", "v_proj"]),  # LLaMA-Factory's lora_target: q_proj,v_proj
    (["linear_qkv,linear_proj", "linear_fc1"], ["linear_qkv", "linear_proj", "linear_fc1"]),
    (["q_proj,", "v_proj"], ["q_proj", "v_proj"]),
    (["all"], ["all-linear"]),  # LLaMA-Factory's lora_target: all
])
def test_target_modules_in_the_forms_other_trainers_write_are_read(given, same_as):
    """--lora-target-modules q_proj,v_proj (LLaMA-Factory's comma list, a config file's one string) and 'all' were
    'unknown module' errors; they name the same adapters as the space-separated list and all-linear."""
    from mindspeed_pack.model import lora

    assert lora.resolve_targets(given) == lora.resolve_targets(same_as)
    args = parse_args([*TINY_FLAGS, "--data-path", "d", "--seq-length", "128", "--micro-batch-size", "1",
                       "--train-iters", "1", "--lr", "1e-4", "--load", "base", "--lora-r", "4",
                       "--lora-target-modules", *given], world_size=1)
    assert args.lora_target_modules == same_as  # what the LoRA line, the record and run_config.yaml show


@pytest.mark.parametrize("targets, idle", [(["q_proj", "gate_proj"], "gate_proj"),
                                           (["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
                                            "linear_fc1 linear_fc2")])
def test_named_mlp_targets_of_a_model_whose_every_mlp_is_moe_are_warned(targets, idle, caplog):
    """Every layer MoE: the experts get no adapter, so a named MLP target adapts nothing. The run trained the others
    and its LoRA line still said 'on q_proj gate_proj' (MindSpeed-LLM's Qwen3-30B-A3B script names linear_fc1 and
    linear_fc2): the parser says which names adapt nothing."""
    import logging

    argv = [*TINY_FLAGS, "--num-experts", "4", "--moe-router-topk", "2", "--data-path", "d", "--seq-length", "128",
            "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4", "--lora-target-modules", *targets,
            "--dry-run"]
    with caplog.at_level(logging.WARNING, logger="mindspeed_pack"):
        with pytest.raises(SystemExit):  # --dry-run has no base to plan LoRA on: the check ran before
            parse_args(argv, world_size=1)
    assert (f"--lora-target-modules {idle}: every layer of this model is MoE, and experts get no adapter: "
            f"{'they adapt' if ' ' in idle else 'it adapts'} nothing; the adapters train on ") in caplog.text, caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mindspeed_pack"), pytest.raises(SystemExit):
        parse_args([*argv[:argv.index("--lora-target-modules") + 1], "all-linear", "--dry-run"], world_size=1)
    assert "adapts nothing" not in caplog.text and "adapt nothing" not in caplog.text  # all-linear: as documented


@pytest.mark.parametrize("rslora,shown", [(False, "scale 2 (alpha / r)"), (True, "scale 4 (rsLoRA: alpha / sqrt(r))")])
def test_the_lora_log_line_states_the_scale_and_rslora(rslora, shown, caplog):
    """rsLoRA doubles the update at r=4 (alpha / sqrt(r) instead of alpha / r): the run's LoRA line says which."""
    import logging

    from mindspeed_pack.training.model_setup import _log_model

    args = tiny_args(lora_r=4, lora_alpha=8.0, lora_dropout=0.0, lora_target_modules=None, lora_use_rslora=rslora)
    with caplog.at_level(logging.INFO, logger="mindspeed_pack.training.model_setup"):
        _log_model(args, torch.nn.Linear(4, 4), "local")
    assert f"LoRA r=4 alpha=8 {shown} on all-linear" in caplog.text


def _write_base(d, tensors) -> str:
    """A HF-like base directory: config.json and one safetensors file of ``tensors``."""
    from safetensors.torch import save_file

    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"model_type": "qwen2"}, f)
    save_file(tensors, os.path.join(d, "model.safetensors"))
    return str(d)


def test_the_base_fingerprint_reads_a_sample_and_still_tells_bases_apart(tmp_path, monkeypatch):
    """The LoRA base record hashed every byte of the base (~0.5 s per GB: minutes for a 70B model, at every
    conversion and LoRA start); it reads the header and samples of every tensor now, and still tells apart what
    another base differs in: every element of a tensor (a fine-tune, a LoRA merge), a sampled weight, a dtype."""
    g = torch.Generator().manual_seed(0)
    tensors = {"big": torch.randn(1024, 1024, generator=g), "small": torch.randn(64, generator=g)}  # 4 MiB + 256 B
    base = _write_base(tmp_path / "base", tensors)
    read = []

    class CountingFile:
        def __init__(self, *a, **kw):
            self.f = open(*a, **kw)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def seek(self, *a):
            return self.f.seek(*a)

        def read(self, n=-1):
            data = self.f.read(n)
            read.append(len(data))
            return data

    monkeypatch.setattr(adapters, "open", CountingFile, raising=False)
    fp = adapters.fingerprint(base)
    assert sum(read) < 64 * 1024, sum(read)  # of 4.2 MB: the header, 8 chunks of 4 KiB and the small tensor
    assert adapters.is_sampled(fp) and adapters.fingerprint(_write_base(tmp_path / "copy", tensors)) == fp

    def changed(name, edit):
        edited = {k: v.clone() for k, v in tensors.items()}
        edit(edited)
        return adapters.fingerprint(_write_base(tmp_path / name, edited))

    assert changed("tuned", lambda t: t["big"].add_(1e-3)) != fp  # every element (same size, dtype, shape)
    assert changed("merged", lambda t: t["big"][:, :8].add_(1e-3)) != fp  # every row of the tensor touched
    assert changed("first", lambda t: t["big"][0, 0].add_(1.0)) != fp  # one weight, in a sampled chunk
    assert changed("last", lambda t: t["big"][-1, -1].add_(1.0)) != fp
    assert changed("small", lambda t: t["small"][30].add_(1.0)) != fp  # a small tensor is read whole
    assert changed("half", lambda t: t.update(big=t["big"].half())) != fp  # another dtype: the header


def test_a_megatron_rank_files_fingerprint_covers_every_byte_by_its_zip_crcs(tmp_path):
    """A Megatron base's files are torch.save zips: their central directory holds every entry's CRC-32, so one
    changed weight anywhere changes the fingerprint, without reading the tensors."""
    t = torch.randn(512, 512, generator=torch.Generator().manual_seed(1))
    path = str(tmp_path / "model_optim_rng.pt")
    torch.save({"model": {"w": t}}, path)
    before = adapters.file_digest(path)
    t[300, 200] += 1.0  # in the middle: no sample would see it
    torch.save({"model": {"w": t}}, path)
    assert adapters.file_digest(path) != before


def test_a_base_recorded_by_the_older_full_hash_is_still_checked(tmp_path, caplog):
    """Adapters saved before the sampled fingerprint record a sha256 of every byte: compared by that method (the
    same base accepted, another refused); a lineage of the other kind, which cannot be compared, is warned about
    and not refused."""
    from mindspeed_pack.convert.model_specs import ConversionError

    g = torch.Generator().manual_seed(2)
    base = _write_base(tmp_path / "base", {"w": torch.randn(256, 256, generator=g)})
    other = _write_base(tmp_path / "other", {"w": torch.randn(256, 256, generator=g)})
    old = {"base": {"path": base, "fingerprint": adapters.fingerprint(base, sampled=False)}}
    assert not adapters.is_sampled(old["base"]["fingerprint"]) and len(old["base"]["fingerprint"]) == 64
    adapters.check_base(old, base, adapters.fingerprint(base), "--lora-load A")  # accepted
    with pytest.raises(ConversionError, match="the adapters were trained on the base"):
        adapters.check_base(old, other, adapters.fingerprint(other), "--lora-load A")
    new = {"base": {"path": base, "fingerprint": adapters.fingerprint(base)}}
    with caplog.at_level("WARNING"):  # `other` as a conversion whose lineage an older version recorded
        adapters.check_base(new, other, adapters.fingerprint(other), "--lora-load A",
                            same_here=[adapters.fingerprint(base, sampled=False)])
    assert "cannot be checked" in caplog.text
    with pytest.raises(ConversionError):  # the same lineage of this kind: compared, refused
        adapters.check_base(new, other, adapters.fingerprint(other), "--lora-load A",
                            same_here=[adapters.fingerprint(other)])

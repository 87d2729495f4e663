"""Bad converter input fails with a message naming the problem, and writes nothing.

Every case asserts that the save directory was not created (or, if it existed, was left
as it was) and that no temporary directory is left next to it.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from mindspeed_pack.convert import ConversionError, hf_to_megatron, megatron_to_hf, megatron_to_megatron
from mindspeed_pack.convert import convert as convert_module
from mindspeed_pack.convert.convert import main
from mindspeed_pack.convert.megatron_layout import RELEASE, checkpoint_file, read_tracker


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Qwen2 model: 4 layers, 4 heads, 2 query groups, vocab 300."""
    import transformers

    config = transformers.Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("errors") / "qwen2_hf"
    transformers.Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def mg_dir(hf_dir, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("errors_mg") / "mg")
    hf_to_megatron(hf_dir, path, 2, 2)
    return path


@pytest.fixture
def out(tmp_path):
    """A save dir path in an otherwise empty parent; checks afterwards that nothing was written."""
    parent = tmp_path / "outputs"
    parent.mkdir()
    target = parent / "converted"
    yield str(target)
    assert not target.exists(), f"{target} was written"
    assert os.listdir(parent) == [], f"leftovers in {parent}: {os.listdir(parent)}"


def _copy_with_config(src: str, dst, **changes) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    config = json.load(open(path))
    config.update(changes)
    json.dump(config, open(path, "w"))
    return str(dst)


def test_directory_without_config(hf_dir, tmp_path, out):
    no_config = tmp_path / "no_config"
    shutil.copytree(hf_dir, no_config)
    os.remove(no_config / "config.json")
    with pytest.raises(ConversionError, match="config.json: missing"):
        hf_to_megatron(str(no_config), out, 1, 1)


def test_directory_without_weights(hf_dir, tmp_path, out):
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(os.path.join(hf_dir, "config.json"), no_weights)
    with pytest.raises(ConversionError, match=r"no \*\.safetensors or pytorch_model\*\.bin weights"):
        hf_to_megatron(str(no_weights), out, 1, 1)
    torch.save({}, no_weights / "weights.pt")
    with pytest.raises(ConversionError, match=r"found \['weights.pt'\].*safe_serialization=True"):
        hf_to_megatron(str(no_weights), out, 1, 1)


def test_unknown_architecture(hf_dir, tmp_path, out):
    gpt2 = _copy_with_config(hf_dir, tmp_path / "gpt2", model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ConversionError,
                       match="unknown architecture.*gpt2.*supported model types: llama, mistral, mixtral, qwen2, qwen3"):
        hf_to_megatron(gpt2, out, 1, 1)


def test_unsupported_features_are_refused(hf_dir, tmp_path, out):
    scaled = _copy_with_config(hf_dir, tmp_path / "scaled",
                               rope_scaling={"rope_type": "yarn", "factor": 4.0}, rope_parameters=None)
    with pytest.raises(ConversionError, match="rope_scaling.rope_type='yarn' is not supported for qwen2"):
        hf_to_megatron(scaled, out, 1, 1)


def test_tp_must_divide_heads_and_query_groups(hf_dir, out):
    with pytest.raises(ConversionError, match="tensor parallel size 3 does not divide num_attention_heads=4"):
        hf_to_megatron(hf_dir, out, 3, 1)
    with pytest.raises(ConversionError, match=r"tensor parallel size 4 does not divide the number of query groups"):
        hf_to_megatron(hf_dir, out, 4, 1)


def test_pp_must_fit_and_divide_layers(hf_dir, out):
    with pytest.raises(ConversionError, match="pipeline parallel size 8 is larger than the layer count 4"):
        hf_to_megatron(hf_dir, out, 1, 8)
    with pytest.raises(ConversionError, match="pipeline parallel size 3 does not divide the layer count 4"):
        hf_to_megatron(hf_dir, out, 1, 3)


def test_vocabulary_size_mismatches(hf_dir, tmp_path, out):
    with pytest.raises(ConversionError, match="--padded-vocab-size 200 is smaller than the model's vocabulary"):
        hf_to_megatron(hf_dir, out, 1, 1, padded_vocab_size=200)
    with pytest.raises(ConversionError, match="--padded-vocab-size 301 is not divisible by the tensor parallel size 2"):
        hf_to_megatron(hf_dir, out, 2, 1, padded_vocab_size=301)
    wrong = _copy_with_config(hf_dir, tmp_path / "wrong_vocab", vocab_size=320)
    with pytest.raises(ConversionError, match=r"model\.safetensors: tensor 'model\.embed_tokens\.weight' has shape "
                                              r"\[300, 32\], but config.json implies \[320, 32\]"):
        hf_to_megatron(wrong, out, 1, 1)


def test_weights_of_another_architecture_are_refused(hf_dir, tmp_path, out):
    """A Qwen3-like checkpoint (q_norm tensors) labelled qwen2 must not lose tensors silently."""
    from safetensors.torch import load_file, save_file

    extra = tmp_path / "extra"
    shutil.copytree(hf_dir, extra)
    tensors = load_file(extra / "model.safetensors")
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)
    save_file(tensors, extra / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match="not used by the conversion.*q_norm"):
        hf_to_megatron(str(extra), out, 1, 1)


def test_existing_non_empty_save_dir_is_left_alone(hf_dir, tmp_path):
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="exists and is not empty"):
        hf_to_megatron(hf_dir, str(existing), 1, 1)
    assert os.listdir(existing) == ["keep.txt"] and os.listdir(tmp_path) == ["existing"]


def test_empty_existing_save_dir_is_filled(hf_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    hf_to_megatron(hf_dir, str(empty), 1, 1)
    assert os.path.isfile(checkpoint_file(str(empty), RELEASE, 0, 0, 1))
    assert os.listdir(tmp_path) == ["empty"]


def test_failure_while_writing_leaves_no_output(hf_dir, out, monkeypatch):
    calls = []
    original = convert_module.layout.save_file_atomic

    def fail_on_second(obj, path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        original(obj, path)

    monkeypatch.setattr(convert_module.layout, "save_file_atomic", fail_on_second)
    with pytest.raises(OSError, match="simulated"):
        hf_to_megatron(hf_dir, out, 2, 1)
    assert len(calls) == 2


def test_a_terminated_conversion_leaves_no_partial_output(hf_dir, out):
    """SIGTERM (a scheduler's stop, ``timeout``) killed convert_ckpt.py outright and left its partial output in the
    hidden ``.NAME.tmp-HOST-PID`` beside --save-dir, as large as the model: it now unwinds and removes it. The
    conversion is stopped (fault ``exported@0:stop``) with the output complete but not yet renamed."""
    import signal
    import time

    from tests.preloaded import ScriptProcess

    env = {**os.environ, "MINDSPEED_PACK_FAULT": "exported@0:stop"}
    log = os.path.join(os.path.dirname(os.path.dirname(out)), "convert.log")
    proc = ScriptProcess("convert_ckpt.py", ["--load-dir", hf_dir, "--save-dir", out], env=env, stdout=log)
    try:
        deadline = time.monotonic() + 120
        while open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
            assert proc.poll() is None and time.monotonic() < deadline, open(log).read()
            time.sleep(0.05)
        assert os.listdir(os.path.dirname(out))  # the temporary directory, complete
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGCONT)
        assert proc.wait(60) == 128 + signal.SIGTERM, open(log).read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "stopped by signal 15: the partial output is removed" in open(log).read()


def test_a_signal_during_a_write_is_not_masked_by_torch(tmp_path, monkeypatch):
    """SIGTERM's SystemExit (or Ctrl-C) raised inside torch.save's write came out as torch's "unexpected pos" error,
    a traceback instead of the signal's exit: it is raised as it came, and the half-written file is gone."""
    from mindspeed_pack.convert import megatron_layout as layout

    class Interrupted:
        def __init__(self, path, mode):
            self._f = open(path, mode)
            self.name = path

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

        def write(self, data):
            if len(data) >= 4000 and not self.__dict__.get("signalled"):  # the tensor's bytes; torch then writes on
                self.signalled = True
                raise SystemExit(143)
            return self._f.write(data)

        def flush(self):
            self._f.flush()

        def fileno(self):
            return self._f.fileno()

    monkeypatch.setattr(layout, "open", Interrupted, raising=False)
    with pytest.raises(SystemExit):
        layout.save_file_atomic({"w": torch.zeros(1000)}, str(tmp_path / "rank" / "model_optim_rng.pt"))
    assert os.listdir(tmp_path / "rank") == []


def test_megatron_input_errors(hf_dir, mg_dir, tmp_path, out):
    with pytest.raises(ConversionError, match="no latest_checkpointed_iteration.txt"):
        megatron_to_hf(hf_dir, out)
    broken = tmp_path / "broken"
    shutil.copytree(mg_dir, broken)
    os.remove(checkpoint_file(str(broken), RELEASE, 1, 1, 2))
    with pytest.raises(ConversionError, match=r"mp_rank_01_001/model_optim_rng.pt: missing \(checkpoint has TP=2, PP=2\)"):
        megatron_to_hf(str(broken), out)
    with pytest.raises(ConversionError, match="tensor parallel size 3 does not divide num_attention_heads=4"):
        megatron_to_megatron(mg_dir, out, 3, 1)
    with pytest.raises(ConversionError, match="--tokenizer-dir .*: none of"):
        megatron_to_hf(mg_dir, out, tokenizer_dir=str(tmp_path))


def test_cli_reports_errors_with_exit_code(hf_dir, out, capsys):
    code = main(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", hf_dir, "--save-dir", out,
                 "--target-tensor-parallel-size", "3"])
    assert code == 2
    assert "does not divide num_attention_heads=4" in capsys.readouterr().err
    assert main(["--load-model-type", "hf", "--save-model-type", "hf", "--load-dir", hf_dir,
                 "--save-dir", out]) == 2


def test_cli_converts_both_ways(hf_dir, tmp_path):
    mg, back = str(tmp_path / "mg"), str(tmp_path / "hf")
    assert main(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", hf_dir, "--save-dir", mg,
                 "--target-pipeline-parallel-size", "2", "--params-dtype", "bf16"]) == 0
    assert main(["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", mg, "--save-dir", back,
                 "--params-dtype", "bf16"]) == 0
    from safetensors.torch import load_file

    a, b = load_file(os.path.join(hf_dir, "model.safetensors")), load_file(os.path.join(back, "model.safetensors"))
    assert all(torch.equal(t.to(torch.bfloat16), b[k]) for k, t in a.items())


def test_the_directions_default_to_mindspeed_llms_hf_to_mg(hf_dir, mg_dir, tmp_path, capsys):
    """MindSpeed-LLM's converter defaults --load-model-type hf --save-model-type mg: here both were required."""
    mg = str(tmp_path / "mg")
    assert main(["--load-dir", hf_dir, "--save-dir", mg]) == 0
    assert read_tracker(mg) == "release"
    assert main(["--load-dir", mg_dir, "--save-dir", str(tmp_path / "again")]) == 2
    assert "is a Megatron checkpoint (it has latest_checkpointed_iteration.txt): pass --load-model-type mg" \
        in capsys.readouterr().err


def test_another_familys_name_is_refused_where_it_would_change_the_model(hf_dir, mg_dir, out):
    """A Qwen2 (q/k/v biases) converted with --model-type-hf llama: mg->hf wrote a Llama without the biases after a
    warning (logits off by 4.8 on a user's model); hf->mg failed on fields 'not understood by the llama mapping',
    never saying that config.json holds a qwen2."""
    with pytest.raises(ConversionError, match=r"holds a qwen2 model: as a LlamaForCausalLM \(--model-type-hf llama\) "
                                              r"it would lose --add-qkv-bias True \(a LlamaForCausalLM has False\)"):
        megatron_to_hf(mg_dir, out, model_type_hf="llama")
    # the family name itself is no lost setting
    assert "--model-type-hf qwen2 (a" not in str(excinfo_of(lambda: megatron_to_hf(mg_dir, out, model_type_hf="llama")))
    with pytest.raises(ConversionError, match=r"config.json: holds a qwen2 model \(model_type 'qwen2'\), not llama "
                                              r"\(--model-type-hf\): pass --model-type-hf qwen2, or leave it out"):
        hf_to_megatron(hf_dir, out, 1, 1, model_type_hf="llama")


def test_mindspeed_llms_first_converter_flags_convert_both_ways(hf_dir, tmp_path):
    """Its convert_ckpt.py scripts (the mindspore examples) pass --use-mcore-models --model-type GPT (read as
    --model-type-hf GPT by prefix: 'invalid choice'), --add-qkv-bias, --tokenizer-model, --ai-framework, and Qwen2.5
    as --model-type-hf llama2; mcore2hf writes into the HF directory's mg2hf/."""
    from safetensors.torch import load_file

    hf, mg = str(tmp_path / "qwen_hf"), str(tmp_path / "mg")
    shutil.copytree(hf_dir, hf)
    v1 = ["--use-mcore-models", "--model-type", "GPT", "--add-qkv-bias", "--model-type-hf", "llama2",
          "--ai-framework", "mindspore"]
    assert main([*v1, "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", hf, "--save-dir", mg,
                 "--target-tensor-parallel-size", "2", "--tokenizer-model", os.path.join(hf, "config.json")]) == 0
    assert main([*v1, "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", mg, "--save-dir", hf]) == 0
    a, b = load_file(os.path.join(hf, "model.safetensors")), load_file(os.path.join(hf, "mg2hf", "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(t, b[k]) for k, t in a.items())


def excinfo_of(call) -> ConversionError:
    with pytest.raises(ConversionError) as e:
        call()
    return e.value


def test_a_family_whose_layout_keeps_every_setting_converts(tmp_path):
    """A Llama written as a Mistral keeps every setting and tensor: converted with a warning (the family name
    alone was counted as a lost setting, refusing every other family)."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    hf_to_megatron(str(tmp_path / "llama"), str(tmp_path / "mg"), 1, 1)
    megatron_to_hf(str(tmp_path / "mg"), str(tmp_path / "mistral"), model_type_hf="mistral")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "mistral")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama")
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    assert type(model).__name__ == "MistralForCausalLM"
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, ref(ids).logits, atol=1e-5)



def test_an_installed_package_has_every_script_whose_main_it_holds():
    """pip install gave preprocess_data.py's main as mindspeed-preprocess but convert_ckpt.py's as nothing: an
    installed package could not convert (the scripts themselves are not installed)."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    entry_points = set(re.findall(r'"mindspeed-[a-z-]+=([\w.]+:\w+)"', (repo / "setup.py").read_text()))
    for script in ("preprocess_data.py", "convert_ckpt.py"):
        module = re.search(r"^from (mindspeed_pack[\w.]*) import main$", (repo / script).read_text(), re.M).group(1)
        assert f"{module}:main" in entry_points, script
    # the training scripts were not installed at all: their code lives in the package, run by cli()
    for script in ("posttrain.py", "pretrain_gpt.py"):
        module = re.search(r"^from (mindspeed_pack[\w.]*) import cli, main", (repo / script).read_text(), re.M).group(1)
        assert f"{module}:cli" in entry_points, script


@pytest.mark.parametrize("module", ["mindspeed_pack.training.posttrain", "mindspeed_pack.training.pretrain",
                                    "mindspeed_pack.convert.convert"])
def test_every_console_script_module_runs_as_python_m(module, monkeypatch, capsys):
    """`python -m` (or `torchrun -m`) of a console script's module printed nothing and exited 0, as if it had run:
    the modules had no __main__ block once the scripts' code moved into the package."""
    import runpy
    import sys
    import warnings

    monkeypatch.setattr(sys, "argv", [module.rsplit(".", 1)[-1], "--help"])
    with warnings.catch_warnings():  # runpy warns that the module is already imported
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(SystemExit) as exit_:
            runpy.run_module(module, run_name="__main__")
    assert exit_.value.code in (0, None) and "usage:" in capsys.readouterr().out

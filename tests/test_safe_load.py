"""Checkpoints are data, not code: a crafted pickle runs nothing and is refused by name.

Every load (training ``--load``, ``convert_ckpt.py --load-model-type mg``, HF
``pytorch_model*.bin``) is a ``weights_only`` load; files this project writes need no
allow-list at all, older ones of this project still resume.
"""
import builtins
import fractions
import logging
import os
import pickle
import shutil

import pytest
import torch

import posttrain
from mindspeed_pack.checkpoint.save_load import CheckpointError
from mindspeed_pack.convert import megatron_layout as layout
from mindspeed_pack.convert.convert import hf_to_megatron
from mindspeed_pack.convert.convert import main as convert_main
from mindspeed_pack.training.cli import run_cli
from tests.data_utils import fingerprint, read_metrics, write_packed_instruction_dataset
from tests.train_utils import tiny_argv as argv


class _RunsCommand:
    """Unpickling this calls os.system: the classic crafted checkpoint."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class _Execs:
    """Unpickling this calls builtins.exec on Python source."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return builtins.exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",)


def write_crafted(path, marker, kind):
    """A file at ``path`` whose unpickling would create ``marker``: torch.save (zip) or a bare pickle.

    Returns the global the file asks for, as torch names it."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if kind == "torch-os.system":
        torch.save({"model": {}, "iteration": 1, "args": _RunsCommand(marker)}, path)
    else:
        with open(path, "wb") as f:
            pickle.dump({"model": {}, "args": _Execs(marker)}, f, protocol=2)
    return {"torch-os.system": "posix.system", "pickle-exec": "exec"}[kind]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(data prefix, a trainer checkpoint of iteration 1)."""
    d = tmp_path_factory.mktemp("safe_load")
    data = write_packed_instruction_dataset(str(d / "toy"), num_packs=8, seed=5)
    posttrain.main(argv(data, "--save", str(d / "ckpt")))
    return data, str(d / "ckpt")


@pytest.mark.parametrize("kind", ["torch-os.system", "pickle-exec"])
def test_crafted_training_checkpoint_runs_nothing_and_is_refused(saved, tmp_path, capsys, kind):
    ckpt = str(tmp_path / "ckpt")
    marker = tmp_path / "MARKER"
    path = layout.checkpoint_file(ckpt, 1, 0, 0, 1)
    needed = write_crafted(path, marker, kind)
    layout.write_tracker(ckpt, 1)
    before = fingerprint(ckpt)
    with pytest.raises(SystemExit) as e:
        run_cli("posttrain.py", lambda: posttrain.main(argv(saved[0], "--load", ckpt, "--save", ckpt,
                                                            "--train-iters", "2")))
    assert not marker.exists(), "the crafted checkpoint ran its command"
    assert e.value.code == 2
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if x.startswith("posttrain.py: error:")]
    assert line and path in line[0] and f"the global {needed}" in line[0], err
    assert "--allow-unsafe-checkpoint-load" in line[0]
    assert "Traceback" not in err
    assert fingerprint(ckpt) == before  # nothing written


@pytest.mark.parametrize("kind", ["torch-os.system", "pickle-exec"])
@pytest.mark.parametrize("save_type", ["hf", "mg"])
def test_crafted_megatron_checkpoint_for_the_converter(tmp_path, capsys, kind, save_type):
    src = str(tmp_path / "mg")
    marker = tmp_path / "MARKER"
    path = layout.checkpoint_file(src, layout.RELEASE, 0, 0, 1)
    needed = write_crafted(path, marker, kind)
    layout.write_tracker(src, layout.RELEASE)
    out = tmp_path / "out"
    code = convert_main(["--load-model-type", "mg", "--save-model-type", save_type, "--load-dir", src,
                         "--save-dir", str(out)])
    assert not marker.exists(), "the crafted checkpoint ran its command"
    assert code == 2
    err = capsys.readouterr().err
    assert "convert_ckpt: error:" in err and path in err and f"the global {needed}" in err, err
    assert "--allow-unsafe-checkpoint-load" in err
    assert "Traceback" not in err
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["mg"]  # nothing written


def test_crafted_pytorch_model_bin_is_refused(tmp_path, capsys):
    src = tmp_path / "hf"
    marker = tmp_path / "MARKER"
    os.makedirs(src)
    (src / "config.json").write_text('{"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}')
    needed = write_crafted(str(src / "pytorch_model.bin"), marker, "torch-os.system")
    code = convert_main(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(src),
                         "--save-dir", str(tmp_path / "out")])
    assert not marker.exists()
    assert code == 2
    err = capsys.readouterr().err
    assert "pytorch_model.bin" in err and needed in err
    assert not (tmp_path / "out").exists()


def test_hf_pytorch_model_bin_converts_like_safetensors(tmp_path):
    import transformers

    config = transformers.Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    model.save_pretrained(tmp_path / "st")
    os.makedirs(tmp_path / "bin")  # the pre-safetensors layout: config.json + pytorch_model.bin
    shutil.copy(tmp_path / "st" / "config.json", tmp_path / "bin")
    torch.save(model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    hf_to_megatron(str(tmp_path / "st"), str(tmp_path / "mg_st"), 1, 1)
    hf_to_megatron(str(tmp_path / "bin"), str(tmp_path / "mg_bin"), 1, 1)
    a = layout.load_file(layout.checkpoint_file(str(tmp_path / "mg_st"), layout.RELEASE, 0, 0, 1))["model"]
    b = layout.load_file(layout.checkpoint_file(str(tmp_path / "mg_bin"), layout.RELEASE, 0, 0, 1))["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_project_checkpoints_need_no_allow_list(saved, tmp_path):
    """Trainer files hold only tensors and plain containers: no global beyond torch's defaults."""
    allowed = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()  # megatron-core registers its list at import
    try:
        trainer_file = layout.checkpoint_file(saved[1], 1, 0, 0, 1)
        assert torch.serialization.get_unsafe_globals_in_checkpoint(trainer_file) == []
        record = torch.load(trainer_file, weights_only=True)
        assert {"model", "optimizer", "opt_param_scheduler", "rng_state", "args"} <= set(record)
    finally:
        torch.serialization.add_safe_globals(allowed)


def _rewrite(path, change):
    record = torch.load(path, weights_only=False)  # the test's own file
    change(record)
    torch.save(record, path)


def test_older_checkpoint_with_numpy_rng_state_still_resumes(saved, tmp_path):
    """Before this change the numpy RNG state was saved as an array; such checkpoints still resume."""
    import numpy as np

    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(saved[1], ckpt)
    path = layout.checkpoint_file(ckpt, 1, 0, 0, 1)

    def as_before(record):
        name, keys, pos, has_gauss, gauss = record["rng_state"][0]["np"]
        record["rng_state"][0]["np"] = (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss)

    _rewrite(path, as_before)
    metrics = str(tmp_path / "m.jsonl")
    posttrain.main(argv(saved[0], "--load", ckpt, "--train-iters", "2", "--override-opt_param-scheduler", "--metrics-file", metrics))
    assert sorted(read_metrics(metrics)) == [2]


def test_opt_in_loads_a_trusted_legacy_file_loudly(saved, tmp_path, caplog):
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(saved[1], ckpt)
    path = layout.checkpoint_file(ckpt, 1, 0, 0, 1)
    _rewrite(path, lambda record: record.update(legacy_note=fractions.Fraction(1, 3)))
    with pytest.raises(CheckpointError, match=r"model_optim_rng.pt: refused to load: the file asks for the global "
                                              r"fractions.Fraction.*--allow-unsafe-checkpoint-load"):
        posttrain.main(argv(saved[0], "--load", ckpt, "--train-iters", "2", "--override-opt_param-scheduler"))
    metrics = str(tmp_path / "m.jsonl")
    with caplog.at_level(logging.WARNING):
        posttrain.main(argv(saved[0], "--load", ckpt, "--train-iters", "2", "--override-opt_param-scheduler", "--metrics-file", metrics,
                            "--allow-unsafe-checkpoint-load"))
    assert sorted(read_metrics(metrics)) == [2]
    assert any("--allow-unsafe-checkpoint-load" in r.message and "arbitrary code" in r.message
               for r in caplog.records)


def test_a_refused_pickle_instruction_is_named_as_an_instruction(tmp_path):
    """A file the safe loader refuses for an instruction (no global to name) says so in plain words."""
    path = tmp_path / "model_optim_rng.pt"
    path.write_bytes(b"(i__builtin__\nobject\n.")  # protocol 0 INST: builds an object by calling its class
    with pytest.raises(layout.UnsafeCheckpointError) as refused:
        layout.load_file(str(path))
    message = str(refused.value)
    assert "refused to load: the file asks for a pickle instruction that only a code-running loader accepts " \
           "(Unsupported operand 105)" in message, message
    assert "the global an" not in message

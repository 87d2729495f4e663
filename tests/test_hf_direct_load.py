"""Training straight from a Hugging Face directory (``--load HF_DIR``) and back (``--save-hf``).

The guarantees: each rank reads only its own slice and gets exactly the shard the offline
converter would have written; a directly loaded run takes the same first step (loss,
gradients, weights) as the converted checkpoint's, at TP1 and TP2; ``--save-hf`` writes the
trained weights bit for bit as the converter writes the saved Megatron checkpoint, and
transformers loads them. Bad input (flags against config.json, a directory that is not a
HF model) is covered by ``tests/bad_inputs/train/hf_*.json``.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

import posttrain
from mindspeed_pack.checkpoint.hf_checkpoint import rank_state_dict
from mindspeed_pack.convert import hf_io, hf_to_megatron, megatron_to_hf, shard_state_dict
from mindspeed_pack.convert.model_specs import args_from_hf_config, get_spec
from mindspeed_pack.convert.weight_map import hf_to_mg_unit, units
from tests.dist_harness import run_distributed
from tests.model_utils import TINY_FLAGS, write_converted_tiny_qwen2
from tests.train_utils import RUN_FLAGS, run_posttrain, write_copy_task


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random transformers Qwen2 of the TINY shape (hf/), its offline conversions at TP1 (mg/)
    and TP2 (mg_tp2/), and packed data."""
    root = tmp_path_factory.mktemp("hf_direct")
    write_converted_tiny_qwen2(root)
    hf_to_megatron(str(root / "hf"), str(root / "mg_tp2"), 2, 1, padded_vocab_size=256)
    data = write_copy_task(str(root / "data" / "toy"), num_packs=16, meta=True)
    return {"root": root, "hf": str(root / "hf"), "mg": str(root / "mg"), "mg_tp2": str(root / "mg_tp2"),
            "data": data}


# --------------------------------------------------------------------------- one rank's slice
def _save_hf_model(path, arch: str, **config):
    import transformers

    cfg = getattr(transformers, f"{arch}Config")(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                 vocab_size=250, max_position_embeddings=128, **config)
    torch.manual_seed(0)
    model = getattr(transformers, f"{arch}ForCausalLM")(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 1.0)
    model.save_pretrained(path)
    return str(path)


class _CountingReader(hf_io.HFCheckpointReader):
    """Counts the elements read from the weight files."""

    read = 0

    def get(self, name):
        t = super().get(name)
        _CountingReader.read += t.numel()
        return t

    def get_range(self, name, dim, start, stop):
        t = super().get_range(name, dim, start, stop)
        _CountingReader.read += t.numel()
        return t


@pytest.mark.parametrize("arch,config,tp,pp,padded", [
    ("Qwen2", dict(num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False), 4, 1, 512),
    ("Qwen2", dict(num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False), 2, 2, None),
    ("Llama", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True), 2, 2, None),
], ids=["qwen2-tp4-padded-vocab", "qwen2-tp2pp2", "llama-tied-tp2pp2"])
def test_each_rank_reads_only_its_slice_and_gets_the_converters_shard(tmp_path, arch, config, tp, pp, padded):
    hf_dir = _save_hf_model(tmp_path / "hf", arch, **config)
    with hf_io.HFCheckpointReader(hf_dir) as reader:
        model = args_from_hf_config(reader.config, tp=tp, pp=pp, make_vocab_size_divisible_by=16,
                                    padded_vocab_size=padded)
        spec = get_spec(model.model_type_hf)
        full = {}
        for unit in units(model):  # the offline converter's full tensors
            full.update(hf_to_mg_unit(unit, reader.get, model, spec))
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            want = shard_state_dict(full, model, tp_rank, tp, pp_rank, pp)
            _CountingReader.read = 0
            got = rank_state_dict(lambda: _CountingReader(hf_dir), model, tp_rank, tp, pp_rank, pp)
            assert sorted(got) == sorted(want)
            for name in want:
                assert torch.equal(got[name], want[name]), (tp_rank, pp_rank, name)
            # every element read lands in this rank's shard once: nothing of another rank's part is read
            assert _CountingReader.read <= sum(t.numel() for t in want.values()), (tp_rank, pp_rank)


# --------------------------------------------------------------------------- first step
def _first_step(argv, metrics):
    """(loss, {param: grad}, {param: weight after the step}) of a one-step posttrain run."""
    trainer = posttrain.main([*argv, "--metrics-file", metrics])
    loss = None  # only the logging rank writes metrics
    if os.path.exists(metrics):
        with open(metrics) as f:
            loss = [r for r in map(json.loads, f) if r.get("split") == "train"][0]["lm loss"]
    params = dict(trainer.model[0].module.named_parameters())
    return (loss, {n: p.main_grad.detach().clone() for n, p in params.items()},
            {n: p.detach().clone() for n, p in params.items()})


def _direct_and_converted(hf, mg, data, out, tp):
    layout = ["--tensor-model-parallel-size", str(tp)]
    direct = _first_step([*RUN_FLAGS, *layout, "--data-path", data, "--load", hf], f"{out}/direct.jsonl")
    converted = _first_step([*TINY_FLAGS, *RUN_FLAGS, *layout, "--data-path", data, "--load", mg, "--finetune"],
                            f"{out}/converted.jsonl")
    return direct, converted


def _assert_same_step(direct, converted):
    assert direct[0] == converted[0]
    for i in (1, 2):
        assert sorted(direct[i]) == sorted(converted[i])
        for name in direct[i]:
            assert torch.equal(direct[i][name], converted[i][name]), name


def test_direct_load_takes_the_converted_checkpoints_first_step(tiny, tmp_path):
    direct, converted = _direct_and_converted(tiny["hf"], tiny["mg"], tiny["data"], str(tmp_path), 1)
    _assert_same_step(direct, converted)


def test_a_converted_checkpoint_needs_no_model_flags(tiny, tmp_path):
    """The README's ``--load ckpt --finetune`` as written: the model flags come from the checkpoint's record
    (as from config.json for a HF directory) and the first step is that of the run given all of them."""
    run = [*RUN_FLAGS, "--data-path", tiny["data"], "--load", tiny["mg"], "--finetune"]
    bare = _first_step(run, f"{tmp_path}/bare.jsonl")
    flagged = _first_step([*TINY_FLAGS, *run], f"{tmp_path}/flagged.jsonl")
    _assert_same_step(bare, flagged)


def _tp2_rank(hf, mg, data, out):
    return _direct_and_converted(hf, mg, data, f"{out}/rank{os.environ['RANK']}", 2)


def test_direct_load_at_tp2_takes_the_converted_checkpoints_first_step(tiny, tmp_path):
    for rank in (0, 1):
        os.makedirs(tmp_path / f"rank{rank}")
    results = run_distributed(_tp2_rank, 2, tiny["hf"], tiny["mg_tp2"], tiny["data"], str(tmp_path),
                              threads_per_process=1)
    for direct, converted in results:
        _assert_same_step(direct, converted)
    assert results[0][0][0] is not None  # rank 0 logged the loss
    # the two TP ranks hold different halves of the split weights
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert not torch.equal(results[0][0][2][qkv], results[1][0][2][qkv])


def test_pretrain_gpt_loads_hf_directly_like_the_converted_checkpoint(tiny, tmp_path):
    import pretrain_gpt
    from tests.data_utils import random_documents, write_pretrain_documents

    docs = write_pretrain_documents(str(tmp_path / "d_text_document"), random_documents(40, eod_id=2, seed=0))
    flags = [f for f in RUN_FLAGS if f != "--neat-pack"] + [
        "--data-path", docs, "--eod-id", "2", "--reset-attention-mask", "--reset-position-ids"]
    losses = []
    for name, load in (("direct", ["--load", tiny["hf"]]), ("converted", [*TINY_FLAGS, "--load", tiny["mg"],
                                                                           "--finetune"])):
        metrics = str(tmp_path / f"{name}.jsonl")
        pretrain_gpt.main([*flags, *load, "--metrics-file", metrics])
        with open(metrics) as f:
            losses.append([r["lm loss"] for r in map(json.loads, f) if r.get("split") == "train"])
    assert losses[0] == losses[1] and len(losses[0]) == 1


# --------------------------------------------------------------------------- --save-hf
def test_load_hf_train_and_save_hf_round_trips_at_pp2(tiny, tmp_path):
    """torchrun PP2: --load HF_DIR, two steps, --save (Megatron) and --save-hf; the HF output equals the
    converter's mg->hf of the saved checkpoint bit for bit, and transformers loads it."""
    import tokenizers
    import transformers

    # a tokenizer the model's 256 rows can embed (the export refuses a larger one)
    vocab = {w: i for i, w in enumerate(["<|endoftext|>", "<|im_end|>", *[f"w{i}" for i in range(40)]])}
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<|endoftext|>"))
    word_level.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    toy_tokenizer_dir = str(tmp_path / "tokenizer")
    transformers.PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="<|im_end|>",
                                         pad_token="<|endoftext|>").save_pretrained(toy_tokenizer_dir)
    out, mg = str(tmp_path / "hf_out"), str(tmp_path / "mg_out")
    flags = list(RUN_FLAGS)
    flags[flags.index("--train-iters") + 1] = "2"
    run_posttrain([*flags, "--pipeline-model-parallel-size", "2", "--data-path", tiny["data"], "--load", tiny["hf"],
                   "--save", mg, "--save-hf", out, "--tokenizer-name-or-path", str(toy_tokenizer_dir)],
                  nproc=2, script="posttrain.py")
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")], "staging files left behind"
    reference = str(tmp_path / "reference")
    megatron_to_hf(mg, reference)
    got, want = load_file(os.path.join(out, "model.safetensors")), load_file(os.path.join(reference, "model.safetensors"))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    source = load_file(os.path.join(tiny["hf"], "model.safetensors"))
    assert not torch.equal(got["model.layers.0.mlp.up_proj.weight"], source["model.layers.0.mlp.up_proj.weight"])

    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(reference).eval()
    tokens = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, ref_model(tokens).logits)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token == "<|im_end|>"


def _toy_tokenizer(path) -> str:
    from tests.model_utils import save_word_tokenizer

    return save_word_tokenizer(path, ["<|endoftext|>", "<|im_end|>", *[f"w{i}" for i in range(40)]])


def test_a_resumed_copy_of_a_run_from_hf_exports_into_its_own_save_with_the_tokenizer(tiny, tmp_path):
    """A run from a HF directory stopped at iteration 1 (--exit-interval), its --save copied elsewhere and resumed
    there with --load COPY --save COPY (docs/multinode.md's pattern): the fine-tuning default export goes to COPY/hf
    (it went into the first run's directory), with the tokenizer files (the checkpoint's record names them; the
    export had none), and records the iteration it holds."""
    import shutil

    from mindspeed_pack.checkpoint import hf_checkpoint

    flags = list(RUN_FLAGS)
    flags[flags.index("--train-iters") + 1] = "2"
    first, copy = str(tmp_path / "first"), str(tmp_path / "copy")
    posttrain.main([*flags, "--data-path", tiny["data"], "--load", tiny["hf"], "--save", first, "--exit-interval",
                    "1", "--tokenizer-name-or-path", _toy_tokenizer(tmp_path / "tokenizer")])
    assert not os.path.exists(os.path.join(first, "hf"))  # stopped early: not the trained model
    shutil.copytree(first, copy)
    trainer = posttrain.main([*TINY_FLAGS, *flags, "--data-path", tiny["data"], "--load", copy, "--save", copy])
    assert trainer.iteration == 2 and trainer.args.save_hf == os.path.join(copy, "hf")
    assert not os.path.exists(os.path.join(first, "hf"))
    assert hf_checkpoint.export_record(os.path.join(copy, "hf")) == {"iteration": 2, "save": copy}
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(os.path.join(copy, "hf")))


def test_the_original_command_resumes_a_save_that_resumed_itself(tiny, tmp_path):
    """After a resume with --load SAVE --save SAVE, SAVE/run_config.yaml records --load SAVE: the job's original
    command (--load HF_DIR --save SAVE) was then refused as another run (--load, --load-format, --finetune)."""
    flags = list(RUN_FLAGS)
    flags[flags.index("--train-iters") + 1] = "3"
    save = str(tmp_path / "save")
    original = [*flags, "--data-path", tiny["data"], "--load", tiny["hf"], "--save", save]
    posttrain.main([*original, "--exit-interval", "1"])
    posttrain.main([*TINY_FLAGS, *flags, "--data-path", tiny["data"], "--load", save, "--save", save,
                    "--exit-interval", "2"])
    trainer = posttrain.main(original)
    assert trainer.iteration == 3 and trainer.args.resumed_from == save


def test_save_hf_into_a_non_empty_directory_is_refused_before_training(tiny, tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    with pytest.raises(SystemExit):
        posttrain.main([*RUN_FLAGS, "--data-path", tiny["data"], "--load", tiny["hf"],
                        "--save-hf", str(tmp_path / "taken")])
    err = capsys.readouterr().err
    assert "--save-hf" in err and "exists and is not an empty directory" in err


def test_save_hf_of_a_model_the_converter_cannot_write_is_refused_before_training(tiny, tmp_path):
    from mindspeed_pack.checkpoint.save_load import CheckpointError

    with pytest.raises(CheckpointError, match=r"cannot be written as a Hugging Face Qwen2ForCausalLM: "
                                              r"--normalization LayerNorm \(a Qwen2ForCausalLM has RMSNorm\)"):
        posttrain.main([*TINY_FLAGS, *RUN_FLAGS, "--normalization", "LayerNorm", "--data-path", tiny["data"],
                        "--save-hf", str(tmp_path / "out"), "--metrics-file", str(tmp_path / "m.jsonl")])
    assert not os.path.exists(tmp_path / "m.jsonl") or not open(tmp_path / "m.jsonl").read().count('"train"')


@pytest.mark.parametrize("where", ["merge", "safetensors writer"])
def test_full_disk_at_save_hf_is_one_error_line_and_leaves_nothing(tiny, tmp_path, monkeypatch, where):
    """A full disk during the export: one error naming the directory and the space needed (the safetensors
    writer's own error was a raw SafetensorError traceback), no output and no staging files left."""
    import errno

    from safetensors import SafetensorError

    from mindspeed_pack.checkpoint.save_load import CheckpointError
    from mindspeed_pack.convert import convert, hf_io

    def disk_full(*args, **kwargs):
        if where == "merge":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
                              'left on device" })')

    if where == "merge":
        monkeypatch.setattr(convert, "megatron_to_hf", disk_full)
    else:
        monkeypatch.setattr(hf_io, "save_file", disk_full)
    (tmp_path / "exports").mkdir()
    with pytest.raises(CheckpointError, match=r"--save-hf .*/out: the disk is full: this needs about \d+\.\d\d GiB "
                                              r"and \d+\.\d\d GiB are free there;.*nothing was written there"):
        posttrain.main([*RUN_FLAGS, "--data-path", tiny["data"], "--load", tiny["hf"],
                        "--save-hf", str(tmp_path / "exports" / "out")])
    assert os.listdir(tmp_path / "exports") == []


def test_a_hf_model_keeps_its_own_dropout_unless_the_flags_are_given(tiny):
    """Megatron-LM's 0.1 dropout defaults are not the HF model's: omitted, dropout comes from config.json."""
    from mindspeed_pack.config.arguments import parse_args

    base = ["--seq-length", "128", "--train-iters", "1", "--data-path", tiny["data"], "--load", tiny["hf"]]
    args = parse_args(base, world_size=1)
    assert (args.attention_dropout, args.hidden_dropout) == (0.0, 0.0)
    args = parse_args([*base, "--attention-dropout", "0.2", "--hidden-dropout", "0.1"], world_size=1)
    assert (args.attention_dropout, args.hidden_dropout) == (0.2, 0.1)


def test_an_export_killed_before_its_rename_leaves_a_temporary_the_next_run_removes(tiny, tmp_path):
    """SIGKILL with the HF model complete in ``.out.tmp-HOST-PID`` (fault ``exported@0``): the rerun removes it (its
    owner is gone) and its export is the only thing left beside the output."""
    import signal

    exports = tmp_path / "exports"
    argv = [*RUN_FLAGS, "--data-path", tiny["data"], "--load", tiny["hf"], "--save-hf", str(exports / "out")]
    proc, _ = run_posttrain(argv, model_flags=[], check=False, env={"MINDSPEED_PACK_FAULT": "exported@0:kill"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    leftover = [n for n in os.listdir(exports) if n.startswith(".out.tmp-")]
    assert leftover and os.path.isfile(exports / leftover[0] / "model.safetensors"), os.listdir(exports)
    proc, _ = run_posttrain(argv, model_flags=[])
    assert os.listdir(exports) == ["out"]
    assert f"removed 1 leftover of killed runs from {exports}" in proc.stderr and leftover[0] in proc.stderr

"""Bad checkpoints and data get errors that say what and where, and nothing is overwritten."""
import os
import re
import shutil

import pytest

import posttrain
import pretrain_gpt
from mindspeed_pack.checkpoint import hf_checkpoint
from mindspeed_pack.checkpoint.save_load import CheckpointError
from mindspeed_pack.config.arguments import parse_args
from mindspeed_pack.convert import megatron_layout as layout
from mindspeed_pack.datasets.packed_dataset import DataError
from tests.data_utils import fingerprint, read_metrics, write_packed_instruction_dataset
from tests.model_utils import TINY_FLAGS
from tests.train_utils import tiny_argv as argv


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(data prefix, a checkpoint of iteration 1, one saved with --no-save-optim)."""
    d = tmp_path_factory.mktemp("ckpt_errors")
    data = write_packed_instruction_dataset(str(d / "toy"), num_packs=8, seed=5)
    posttrain.main(argv(data, "--save", str(d / "ckpt")))
    posttrain.main(argv(data, "--save", str(d / "no_optim"), "--no-save-optim"))
    return data, str(d / "ckpt"), str(d / "no_optim")


def copy(src, tmp_path):
    dst = str(tmp_path / "ckpt")
    shutil.copytree(src, dst)
    return dst


def test_load_dir_without_checkpoint(saved, tmp_path):
    data = saved[0]
    with pytest.raises(CheckpointError, match="no such directory"):
        posttrain.main(argv(data, "--load", str(tmp_path / "absent")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint found"):
        posttrain.main(argv(data, "--load", str(tmp_path / "empty")))
    ckpt = copy(saved[1], tmp_path)
    os.remove(os.path.join(ckpt, layout.TRACKER))
    with pytest.raises(CheckpointError, match=r"it holds iter_0000001: write the iteration to load"):
        posttrain.main(argv(data, "--load", ckpt))


def test_a_load_of_an_iteration_directory_names_its_checkpoint(saved, tmp_path, capsys):
    """--load CKPT/iter_0000001 (or one of its rank directories), a common slip, said only that it holds no
    checkpoint: it now names the checkpoint root to pass (and --ckpt-step where the tracker names another)."""
    ckpt = copy(saved[1], tmp_path)
    it_dir = os.path.join(ckpt, "iter_0000001")
    with pytest.raises(CheckpointError, match=re.escape(f"it is iteration 1 of the checkpoint {ckpt}: pass --load "
                                                        f"{ckpt}")):
        posttrain.main(argv(saved[0], "--load", it_dir))
    layout.write_tracker(ckpt, 7)
    with pytest.raises(SystemExit):
        parse_args(["--seq-length", "128", "--train-iters", "1", "--data-path", saved[0], "--load",
                    os.path.join(it_dir, "mp_rank_00")], world_size=1)
    assert f"it is iteration 1 of the checkpoint {ckpt}: pass --load {ckpt} --ckpt-step 1" in capsys.readouterr().err


def test_tracker_naming_a_missing_iteration(saved, tmp_path, capsys):
    """Without the model flags (they come from the checkpoint) the run stopped with 'missing required arguments:
    --num-layers, ...': it names the missing iteration, those held and how to load one, as the load does."""
    ckpt = copy(saved[1], tmp_path)
    layout.write_tracker(ckpt, 7)
    why = (f"names iteration 7 but {ckpt}/iter_0000007 does not exist; {ckpt} holds iter_0000001: write the "
           f"iteration to load into {ckpt}/{layout.TRACKER}, or pass --ckpt-step N")
    with pytest.raises(CheckpointError, match=re.escape(why)):
        posttrain.main(argv(saved[0], "--load", ckpt))
    with pytest.raises(SystemExit):
        parse_args(["--seq-length", "128", "--train-iters", "1", "--data-path", saved[0], "--load", ckpt], world_size=1)
    err = capsys.readouterr().err
    assert why in err and "missing required arguments" not in err
    os.makedirs(os.path.join(ckpt, "iter_0000007"))  # an incomplete copy
    with pytest.raises(SystemExit):
        parse_args(["--seq-length", "128", "--train-iters", "1", "--data-path", saved[0], "--load", ckpt], world_size=1)
    assert f"{ckpt}/iter_0000007 holds no mp_rank_00*/model_optim_rng.pt (an incomplete copy?); {ckpt} holds " \
           "iter_0000001, iter_0000007: write the iteration" in capsys.readouterr().err


def test_load_equal_to_save_on_a_first_launch_starts_from_scratch(saved, tmp_path):
    fresh = str(tmp_path / "run")
    os.makedirs(os.path.join(fresh, "iter_0000001.tmp", "mp_rank_00"))  # the first save had crashed
    posttrain.main(argv(saved[0], "--load", fresh, "--save", fresh, "--metrics-file", str(tmp_path / "m.jsonl")))
    assert sorted(read_metrics(str(tmp_path / "m.jsonl"))) == [1]
    assert layout.read_tracker(fresh) == 1
    assert sorted(os.listdir(fresh)) == ["iter_0000001", layout.TRACKER, "run_config.yaml"]  # + its resolved flags


def test_trainer_checkpoints_carry_what_the_converter_reads(saved):
    import torch

    from mindspeed_pack.convert.model_specs import args_from_dict

    path = layout.checkpoint_file(saved[1], 1, 0, 0, 1)
    args = args_from_dict(torch.load(path, weights_only=False)["args"], where=path)
    assert (args.hidden_size, args.padded_vocab_size, args.model_type_hf) == (64, 256, "qwen2")


def test_truncated_checkpoint_file_is_reported_and_kept(saved, tmp_path):
    ckpt = copy(saved[1], tmp_path)
    path = layout.checkpoint_file(ckpt, 1, 0, 0, 1)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    before = fingerprint(ckpt)
    with pytest.raises(CheckpointError, match=r"model_optim_rng.pt cannot be read .* truncated or corrupt"):
        posttrain.main(argv(saved[0], "--load", ckpt, "--save", ckpt, "--train-iters", "2"))
    assert fingerprint(ckpt) == before  # the failed run wrote nothing into it


def test_model_shape_mismatch_names_the_flag_or_the_tensor_and_shapes(saved, tmp_path, capsys):
    with pytest.raises(SystemExit):  # refused with the flags, before anything is built
        posttrain.main(argv(saved[0], "--load", saved[1], "--ffn-hidden-size", "96"))
    path = layout.checkpoint_file(saved[1], 1, 0, 0, 1)
    assert f"--ffn-hidden-size 96 but {path} records --ffn-hidden-size 128" in capsys.readouterr().err
    # a checkpoint whose args do not say (another tool's): the tensor that does not fit is named
    ckpt = copy(saved[1], tmp_path)
    _set_saved_args(ckpt, ffn_hidden_size=None)
    with pytest.raises(CheckpointError) as e:
        posttrain.main(argv(saved[0], "--load", ckpt, "--ffn-hidden-size", "96"))
    msg = str(e.value)
    assert "decoder.layers.0.mlp.linear_fc1.weight" in msg
    assert "(256, 64) in the checkpoint but (192, 64) in the model" in msg


def test_other_parallel_layout_points_to_the_converter(saved, tmp_path):
    ckpt = copy(saved[1], tmp_path)
    it_dir = layout.iteration_dir(ckpt, 1)
    os.rename(os.path.join(it_dir, "mp_rank_00"), os.path.join(it_dir, "mp_rank_00_000"))
    shutil.copytree(os.path.join(it_dir, "mp_rank_00_000"), os.path.join(it_dir, "mp_rank_00_001"))
    with pytest.raises(CheckpointError, match=r"saved at TP=1, PP=2 but this run uses TP=1, PP=1.*convert_ckpt.py "
                                              r"--load-model-type mg --save-model-type mg"):
        posttrain.main(argv(saved[0], "--load", ckpt))


def test_a_megatron_lm_distributed_checkpoint_is_named_with_its_conversion(saved, tmp_path, capsys):
    """Megatron-LM's default --ckpt-format torch_dist writes no mp_rank_* files: the load said 'no mp_rank_*
    directories; not a Megatron checkpoint' (without model flags: 'missing required arguments'), the converter
    raised a FileNotFoundError, and --ckpt-format torch_dist was argparse's bare 'invalid choice'."""
    from mindspeed_pack.convert.convert import main as convert_main

    ckpt = str(tmp_path / "torch_dist")
    it_dir = layout.iteration_dir(ckpt, 10)
    os.makedirs(it_dir)
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata", "common.pt"):
        open(os.path.join(it_dir, name), "wb").close()
    with open(os.path.join(it_dir, "metadata.json"), "w") as f:
        f.write('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    layout.write_tracker(ckpt, 10)
    named = (re.escape(f"{it_dir} is a Megatron-LM distributed checkpoint (--ckpt-format torch_dist), which is not "
                       "read here") + ".*" + re.escape(f"--load {ckpt} --ckpt-convert-format torch --ckpt-convert-save "
                                                       "NEW_DIR"))
    with pytest.raises(CheckpointError, match=named):
        posttrain.main(argv(saved[0], "--load", ckpt))
    with pytest.raises(SystemExit):
        parse_args(["--seq-length", "128", "--train-iters", "1", "--data-path", saved[0], "--load", ckpt], world_size=1)
    assert f"--load {ckpt}: {it_dir} is a Megatron-LM distributed checkpoint" in capsys.readouterr().err
    assert convert_main(["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", ckpt, "--save-dir",
                         str(tmp_path / "hf")]) == 2
    assert f"convert_ckpt: error: {it_dir} is a Megatron-LM distributed checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args([*TINY_FLAGS, "--seq-length", "128", "--train-iters", "1", "--data-path", saved[0],
                    "--ckpt-format", "torch_dist"], world_size=1)
    assert "--ckpt-format torch_dist: checkpoints are saved and loaded here in Megatron-LM's per-rank format only" \
        in capsys.readouterr().err


def test_checkpoint_without_optimizer_state(saved, tmp_path):
    with pytest.raises(CheckpointError, match="no optimizer state saved .*pass --no-save-optim .*--no-load-optim"):
        posttrain.main(argv(saved[0], "--load", saved[2], "--train-iters", "2"))
    posttrain.main(argv(saved[0], "--load", saved[2], "--train-iters", "2", "--no-load-optim"))


def test_interrupted_resave_falls_back_to_the_parked_copy(saved, tmp_path):
    """A crash between the two renames of a re-save leaves only iter_N.old: it still loads."""
    ckpt = copy(saved[1], tmp_path)
    os.rename(layout.iteration_dir(ckpt, 1), layout.iteration_dir(ckpt, 1) + ".old")
    metrics = str(tmp_path / "m.jsonl")
    posttrain.main(argv(saved[0], "--load", ckpt, "--train-iters", "2", "--override-opt_param-scheduler",
                        "--metrics-file", metrics))
    assert sorted(read_metrics(metrics)) == [2]


def test_data_prefix_without_files(tmp_path):
    missing = str(tmp_path / "nothing")
    with pytest.raises(DataError, match=r"nothing_packed_input_ids_document.bin"):
        posttrain.main(argv(missing))
    with pytest.raises(DataError, match=r"data prefix .*nothing_text_document.*missing .*nothing_text_document.bin"):
        pretrain_gpt.main([*TINY_FLAGS, "--seq-length", "32", "--train-iters", "1", "--eod-id", "2",
                           "--data-path", missing + "_text_document"])


def _set_saved_args(ckpt, **changes):
    import torch

    path = layout.checkpoint_file(ckpt, 1, 0, 0, 1)
    state = torch.load(path, weights_only=True)
    state["args"].update(changes)
    torch.save(state, path)


def test_family_settings_of_the_checkpoint_must_match_the_flags(saved, tmp_path, capsys):
    """A Mistral window shorter than --seq-length is refused; llama3 RoPE scaling the flags omit is the
    checkpoint's, and flags that contradict it are refused."""
    ckpt = copy(saved[1], tmp_path)
    _set_saved_args(ckpt, sliding_window=64)
    with pytest.raises(CheckpointError, match=r"sliding_window=64 \(config.json\) is below --seq-length 128"):
        posttrain.main(argv(saved[0], "--load", ckpt))
    _set_saved_args(ckpt, sliding_window=None, use_rope_scaling=True, rope_scaling_factor=32.0)
    with pytest.raises(SystemExit):
        posttrain.main(argv(saved[0], "--load", ckpt, "--rope-scaling-factor", "8"))
    assert (f"--rope-scaling-factor 8 but {layout.checkpoint_file(ckpt, 1, 0, 0, 1)} records --rope-scaling-factor "
            "32") in capsys.readouterr().err
    trainer = posttrain.main(argv(saved[0], "--load", ckpt, "--finetune"))  # the checkpoint's settings load
    assert (trainer.args.use_rope_scaling, trainer.args.rope_scaling_factor) == (True, 32.0)


def test_a_trained_checkpoint_converts_to_hf(saved, tmp_path):
    """Trained without --kv-channels (Megatron-LM's default head size): the converter still splits the heads."""
    import transformers

    from mindspeed_pack.convert import megatron_to_hf

    megatron_to_hf(saved[1], str(tmp_path / "hf"))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.head_dim == 16


def test_resume_in_another_precision_names_the_flags(saved, tmp_path):
    """An fp32 run's checkpoint resumed with --bf16 failed with a bare KeyError from the optimizer's load."""
    ckpt = copy(saved[1], tmp_path)
    with pytest.raises(CheckpointError, match=r"saved by a fp32 run, this run is bf16: resume with the precision "
                                              r"flag it was saved with \(neither --bf16 nor --fp16\), or pass "
                                              r"--no-load-optim"):
        posttrain.main(argv(saved[0], "--load", ckpt, "--bf16"))
    path = layout.checkpoint_file(ckpt, 1, 0, 0, 1)  # a checkpoint older than the precision record
    state = layout.load_file(path)
    del state["precision"]
    layout.save_file_atomic(state, path, 1)
    with pytest.raises(CheckpointError, match=r"its optimizer state does not fit this run's optimizer \(KeyError"):
        posttrain.main(argv(saved[0], "--load", ckpt, "--bf16"))
    trainer = posttrain.main(argv(saved[0], "--load", ckpt, "--bf16", "--no-load-optim", "--train-iters", "2"))
    assert trainer.iteration == 2  # resumed at the saved step 1, then trained one more


def test_resume_with_the_distributed_optimizer_switched_names_the_flag(saved, tmp_path):
    """--use-distributed-optimizer on (or off) across a resume failed with a bare KeyError from the optimizer's load
    ('optimizer' or 'state') and a hint at precision and LoRA flags; --no-load-optim still resumes."""
    ckpt = copy(saved[1], tmp_path)
    with pytest.raises(CheckpointError, match=r"its optimizer state was saved without --use-distributed-optimizer, "
                                              r"this run is with it .*resume without --use-distributed-optimizer"):
        posttrain.main(argv(saved[0], "--load", ckpt, "--use-distributed-optimizer", "--train-iters", "2"))
    trainer = posttrain.main(argv(saved[0], "--load", ckpt, "--use-distributed-optimizer", "--no-load-optim",
                                  "--train-iters", "2"))
    assert trainer.iteration == 2
    sharded = str(tmp_path / "sharded")
    posttrain.main(argv(saved[0], "--save", sharded, "--use-distributed-optimizer"))
    with pytest.raises(CheckpointError, match=r"saved with --use-distributed-optimizer, this run is without it"):
        posttrain.main(argv(saved[0], "--load", sharded, "--train-iters", "2"))


def test_the_same_command_again_after_its_export_writes_none_over_it(saved, tmp_path):
    """README: "the same command again resumes". A run that resumes at the iteration its export holds writes none
    over it; one that trains on (a longer --train-iters) replaces its own export with the last iteration's (it
    kept the old model before); another run's export, or a directory no run wrote, is refused before training."""
    save, export = str(tmp_path / "ckpt"), str(tmp_path / "export")
    run = argv(saved[0], "--save", save, "--load", save, "--save-hf", export, "--train-iters", "2")
    posttrain.main(run)
    first = fingerprint(export)
    assert hf_checkpoint.export_record(export) == {"iteration": 2, "save": save}
    trainer = posttrain.main(run)  # the same command again
    assert trainer.iteration == 2 and trainer.args.save_hf is None and fingerprint(export) == first
    other = str(tmp_path / "other")
    shutil.copytree(save, other)
    with pytest.raises(CheckpointError, match=f"--save-hf {export} holds the export of another run \\(--save {save}\\), "
                                              "and this run trains iterations 3..4: choose a new directory") as e:
        posttrain.main(argv(saved[0], "--save", other, "--load", other, "--save-hf", export, "--train-iters", "4",
                            "--override-opt_param-scheduler"))
    assert e.value.scope == "node"  # every rank reads the record alike: each node's local rank 0 prints it
    trainer = posttrain.main(argv(saved[0], "--save", save, "--load", save, "--save-hf", export, "--train-iters", "4",
                                  "--override-opt_param-scheduler"))
    assert trainer.iteration == 4 and hf_checkpoint.export_record(export) == {"iteration": 4, "save": save}
    assert fingerprint(export) != first
    os.remove(os.path.join(export, hf_checkpoint.EXPORT_RECORD))  # a directory no run of this project wrote
    with pytest.raises(CheckpointError, match="exists and is not an empty directory, and this run trains iterations "
                                              "5..6: choose a new directory"):
        posttrain.main(argv(saved[0], "--save", save, "--load", save, "--save-hf", export, "--train-iters", "6",
                            "--override-opt_param-scheduler"))


def test_a_load_of_a_run_started_from_hf_keeps_its_dropout(saved, tmp_path):
    """A run from a HF directory trains with the model's dropout (0 for Qwen); a later --load of its checkpoint took
    Megatron-LM's 0.1, so that resume was not the uninterrupted run. Its run_config.yaml records the value."""
    from tests.model_utils import write_converted_tiny_qwen2

    write_converted_tiny_qwen2(tmp_path / "q")
    flags = [f for i, f in enumerate(TINY_FLAGS) if "dropout" not in f
             and not (i and "dropout" in TINY_FLAGS[i - 1])]  # dropout left to the HF config
    run = [*flags, "--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "2", "--neat-pack",
           "--data-path", saved[0], "--save", str(tmp_path / "s"), "--save-hf", str(tmp_path / "hf_out")]
    posttrain.main([*run, "--load", str(tmp_path / "q" / "hf"), "--train-iters", "1"])
    args = parse_args([*flags, "--seq-length", "128", "--global-batch-size", "2", "--neat-pack", "--train-iters",
                       "2", "--data-path", saved[0], "--load", str(tmp_path / "s")])
    assert (args.attention_dropout, args.hidden_dropout) == (0.0, 0.0)
    args = parse_args([*flags, "--seq-length", "128", "--global-batch-size", "2", "--neat-pack", "--train-iters",
                       "2", "--data-path", saved[0], "--load", saved[1]])  # no HF start recorded: Megatron-LM's
    assert (args.attention_dropout, args.hidden_dropout) == (0.1, 0.1)
    # a second hop (that run resumed with --load SAVE records the dropout as its checkpoint's, not its HF model's:
    # the next --load of it took Megatron-LM's 0.1)
    posttrain.main([*run, "--load", str(tmp_path / "s"), "--train-iters", "2", "--override-opt_param-scheduler"])
    args = parse_args([*flags, "--seq-length", "128", "--global-batch-size", "2", "--neat-pack", "--train-iters",
                       "3", "--data-path", saved[0], "--load", str(tmp_path / "s")])
    assert (args.attention_dropout, args.hidden_dropout) == (0.0, 0.0)
    # a reshard of its checkpoint keeps the record (convert_ckpt.py wrote none: dropout 0.1 and a linear schedule
    # after the reshard, the run's own settings without it); --finetune from it: fine-tuning defaults of its own
    from mindspeed_pack.convert import megatron_to_megatron

    megatron_to_megatron(str(tmp_path / "s"), str(tmp_path / "pp2"), 1, 2)
    args = parse_args([*flags, "--seq-length", "128", "--global-batch-size", "2", "--neat-pack", "--train-iters",
                       "2", "--data-path", saved[0], "--load", str(tmp_path / "pp2"), "--finetune", "--lr", "1e-4",
                       "--pipeline-model-parallel-size", "2"], world_size=2)
    assert (args.attention_dropout, args.hidden_dropout, args.lr_decay_style, args.min_lr) == (0.0, 0.0, "cosine", 1e-5)


def test_scoring_reads_a_training_checkpoints_weights_alone(saved, tmp_path):
    """--stage score on a training checkpoint (not --finetune) was refused by the learning-rate schedule check,
    which a forward-only pass has no use for: it reads the weights, as --finetune."""
    import json

    from tests.rollout_utils import random_rollouts, write_jsonl

    rollouts = write_jsonl(tmp_path / "r.jsonl", random_rollouts(4, seed=1))
    out = tmp_path / "scored.jsonl"
    posttrain.main([*TINY_FLAGS, "--stage", "score", "--rollout-path", rollouts, "--score-output", str(out),
                    "--load", saved[1], "--seq-length", "128", "--micro-batch-size", "1", "--global-batch-size", "2",
                    "--max-seqlen-per-dp-cp-rank", "64", "--lr", "0.5"])  # a schedule unlike the checkpoint's
    assert len([json.loads(line) for line in open(out)]) == 4


def test_an_export_inside_a_copied_save_is_the_runs_and_a_replacement_keeps_the_old_until_done(saved, tmp_path,
                                                                                                 monkeypatch):
    """The export inside --save (SAVE/hf) travels with a copy of SAVE: the copy's run replaces it (it was refused as
    another run's export); a replacement that fails leaves the previous export whole (it was removed first); a
    directory no run exported is refused even where the run has nothing left to train (it was taken as the export)."""
    from mindspeed_pack.convert import convert

    def run(save, iters, *extra):
        return posttrain.main(argv(saved[0], "--save", save, "--load", save, "--save-hf", os.path.join(save, "hf"),
                                   "--train-iters", str(iters), "--override-opt_param-scheduler", *extra))

    first, copy_dir = str(tmp_path / "first"), str(tmp_path / "copy")
    run(first, 2)
    shutil.copytree(first, copy_dir)
    run(copy_dir, 3)
    assert hf_checkpoint.export_record(os.path.join(copy_dir, "hf")) == {"iteration": 3, "save": copy_dir}
    before = fingerprint(os.path.join(copy_dir, "hf"))

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(convert, "megatron_to_hf", disk_full)
    with pytest.raises(CheckpointError, match="the disk is full"):
        run(copy_dir, 4)
    assert fingerprint(os.path.join(copy_dir, "hf")) == before  # the previous export, whole
    assert sorted(n for n in os.listdir(copy_dir) if n.startswith(".")) == []
    monkeypatch.undo()
    junk = str(tmp_path / "junk")
    shutil.copytree(copy_dir, junk)
    shutil.rmtree(os.path.join(junk, "hf"))
    os.makedirs(os.path.join(junk, "hf"))
    open(os.path.join(junk, "hf", "notes.txt"), "w").close()
    with pytest.raises(CheckpointError, match=r"exists and is not an empty directory \(no model a run exported\), "
                                              r"and this run ends at iteration 4"):
        run(junk, 4)


def test_an_export_of_another_kind_is_replaced_even_where_the_run_has_ended(tmp_path, monkeypatch):
    """--lora-merge added to the command of a LoRA run that had ended: its PEFT export was kept as 'the export of
    its last iteration' and no merged model was written."""
    from types import SimpleNamespace

    from mindspeed_pack.training import trainer as trainer_module

    save, export = str(tmp_path / "save"), tmp_path / "save" / "hf"
    export.mkdir(parents=True)
    (export / "adapter_config.json").write_text("{}")
    (export / hf_checkpoint.EXPORT_RECORD).write_text('{"iteration": 4, "save": "%s"}' % save)
    args = SimpleNamespace(save_hf=str(export), save=save, train_iters=4)
    monkeypatch.setattr(hf_checkpoint, "exports_adapters", lambda a: True)  # the run's own kind: PEFT
    assert trainer_module._existing_export(args, 4) is False and args.save_hf is None  # done: none again
    args.save_hf = str(export)
    monkeypatch.setattr(hf_checkpoint, "exports_adapters", lambda a: False)  # --lora-merge: a model
    assert trainer_module._existing_export(args, 4) is True and args.save_hf == str(export)



def test_a_save_dir_another_job_saves_into_is_refused_naming_it(saved, tmp_path):
    """Two jobs given one --save both started (it held no checkpoint yet) and saved over each other's iterations
    and run_config.yaml: the second now stops at once, naming the first; once that job is gone the directory is
    free (the kernel drops its lock), and a run ending in this process gives it back for the next."""
    import subprocess
    import sys

    save = tmp_path / "shared"
    save.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(save / '.save.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.lockf(fd, fcntl.LOCK_EX)\n"
        "os.write(fd, b'4242 node7\\n')\n"
        "print('locked', flush=True)\n"
        "time.sleep(120)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(CheckpointError, match=rf"^--save {save} is in use by another job \(PID 4242 on node7 "
                                                  r"holds .*\.save\.lock\): two runs saving into one directory"):
            posttrain.main(argv(saved[0], "--save", str(save)))
    finally:
        holder.kill()
        holder.wait()
    assert os.listdir(save) == [".save.lock"]  # nothing written but the holder's lock
    posttrain.main(argv(saved[0], "--save", str(save)))
    posttrain.main(argv(saved[0], "--save", str(save), "--train-iters", "2"))  # the same process, the next run
    assert layout.read_tracker(str(save)) == 2
    assert not (save / ".save.lock").exists()  # a run that ends removes its lock


def test_a_save_dir_that_cannot_be_written_is_one_error_before_training(saved, tmp_path):
    """A --save that cannot be created (read-only mount, a file in the way) was a traceback of the resolved
    configuration's write, after the model was built and loaded; now one line naming it."""
    (tmp_path / "file").write_text("")
    save = tmp_path / "file" / "ckpt"
    with pytest.raises(CheckpointError, match=rf"^--save {save} cannot be written \(Not a directory: .*\): pass a "
                                              r"--save this job can write"):
        posttrain.main(argv(saved[0], "--save", str(save)))
    file = str(tmp_path / "file")  # the --save itself a file: makedirs said only "File exists"
    with pytest.raises(CheckpointError, match=rf"^--save {file} is a file, not a directory: pass a directory") as e:
        posttrain.main(argv(saved[0], "--save", file))
    # rank 0 found it and told every rank: rank 0 prints it, not each of them (runtime.error_scope)
    assert getattr(e.value, "scope", None) == "job"


def test_overwrite_output_dir_refuses_to_remove_the_checkpoint_it_loads(saved, tmp_path):
    """--load D --save D --overwrite-output-dir removed D's checkpoints, then loaded D, found none and trained from
    scratch (a warning): the checkpoint was lost and the model random. Refused before anything is removed."""
    ckpt = copy(saved[1], tmp_path)
    before = fingerprint(ckpt)
    with pytest.raises(CheckpointError, match=rf"^--overwrite-output-dir removes the checkpoints of --save {ckpt}, "
                                              rf"which --load {ckpt} loads \(iteration 1\): the run would start from "
                                              "scratch; pass another --save"):
        posttrain.main(argv(saved[0], "--load", ckpt, "--save", ckpt, "--overwrite-output-dir", "--train-iters", "2"))
    assert fingerprint(ckpt) == before

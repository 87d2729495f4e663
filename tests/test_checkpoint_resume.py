"""Resuming is exact, and a crash in the middle of a save loses nothing but that save.

The reference run trains 10 steps (dropout on, so the RNG state matters) saving at 5 and
10; a run stopped at 5 (``--exit-interval``) and resumed in a fresh process must log the
same steps 6-10. TP1 runs call ``posttrain.main`` in this process where a fresh one is not
the point (each Trainer.setup re-seeds every RNG, as a new process would).
"""
import os
import shutil

import pytest

import posttrain
from mindspeed_pack.convert import megatron_layout as layout
from tests.data_utils import read_metrics, rel_err, write_packed_instruction_dataset
from tests.dist_harness import free_port, run_distributed
from tests.model_utils import TINY_FLAGS
from tests.preloaded import run_script

ITERS = 10


def base_argv(data: str, metrics: str, *extra: str) -> list:
    return [*TINY_FLAGS, "--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "2", "--neat-pack",
            "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
            "--train-iters", str(ITERS), "--split", "90,10,0", "--eval-interval", "5", "--eval-iters", "1",
            "--data-path", data, "--metrics-file", metrics, *extra]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_packed_instruction_dataset(str(tmp_path_factory.mktemp("packed") / "toy"), num_packs=64)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data):
    """The uninterrupted run: (train records, valid records, checkpoint dir)."""
    d = tmp_path_factory.mktemp("reference")
    posttrain.main(base_argv(data, str(d / "m.jsonl"), "--save", str(d / "ckpt"), "--save-interval", "5"))
    return read_metrics(str(d / "m.jsonl")), read_metrics(str(d / "m.jsonl"), "valid"), str(d / "ckpt")


def assert_steps_match(got: dict, want: dict, steps, keys=("lm loss", "grad norm", "lr")) -> None:
    assert sorted(got) == list(steps), f"logged iterations {sorted(got)}"
    for it in steps:
        for key in keys:
            assert rel_err(got[it][key], want[it][key]) <= 1e-6, (it, key, got[it][key], want[it][key])
        assert got[it]["consumed samples"] == want[it]["consumed samples"]


@pytest.fixture(scope="module")
def stopped_at_5(tmp_path_factory, reference) -> str:
    """The reference's iteration-5 checkpoint alone, as a run stopped at 5 leaves it (resumes never
    --save into it). Stopping itself (--exit-interval) is exercised by the PP2 and kill tests."""
    ckpt = str(tmp_path_factory.mktemp("stopped") / "ckpt")
    shutil.copytree(os.path.join(reference[2], "iter_0000005"), os.path.join(ckpt, "iter_0000005"))
    layout.write_tracker(ckpt, 5)
    return ckpt


def fresh_process_env(**extra) -> dict:
    """This process may hold a gloo store on MASTER_PORT: give the child its own."""
    return dict(os.environ, MASTER_PORT=str(free_port()), **extra)


def test_resume_in_fresh_process_is_exact(tmp_path, data, reference, stopped_at_5):
    ref_train, ref_valid, _ = reference
    ckpt = stopped_at_5
    metrics = str(tmp_path / "resumed.jsonl")
    proc = run_script("posttrain.py", base_argv(data, metrics, "--load", ckpt), env=fresh_process_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from" in proc.stderr
    assert_steps_match(read_metrics(metrics), ref_train, range(6, ITERS + 1))
    valid = read_metrics(metrics, "valid")
    assert rel_err(valid[10]["lm loss"], ref_valid[10]["lm loss"]) <= 1e-6


def test_kill_during_save_keeps_previous_checkpoint(tmp_path, data, reference, stopped_at_5):
    """SIGKILL half-way through writing iteration 7: iteration 5 stays loadable and resumes exactly."""
    ref_train, _, _ = reference
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(stopped_at_5, ckpt)
    env = fresh_process_env(MINDSPEED_PACK_KILL_DURING_SAVE="7")
    proc = run_script("posttrain.py", base_argv(data, str(tmp_path / "killed.jsonl"), "--load", ckpt, "--save", ckpt,
                                                "--exit-interval", "7"), env=env, timeout=300)
    assert proc.returncode == -9, (proc.returncode, proc.stderr[-3000:])
    assert sorted(read_metrics(str(tmp_path / "killed.jsonl"))) == [6, 7]  # killed while saving 7
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "5"
    assert not os.path.exists(os.path.join(ckpt, "iter_0000007"))
    partial = os.path.join(ckpt, "iter_0000007.tmp", "mp_rank_00", "model_optim_rng.pt.tmp")
    assert 0 < os.path.getsize(partial) < os.path.getsize(os.path.join(ckpt, "iter_0000005", "mp_rank_00",
                                                                         "model_optim_rng.pt"))

    metrics = str(tmp_path / "resumed.jsonl")
    posttrain.main(base_argv(data, metrics, "--load", ckpt, "--save", ckpt, "--save-interval", "5"))
    assert_steps_match(read_metrics(metrics), ref_train, range(6, ITERS + 1))
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "10"
    # the crashed save's leftovers are gone
    assert sorted(os.listdir(ckpt)) == ["iter_0000005", "iter_0000010", "latest_checkpointed_iteration.txt",
                                        "run_config.yaml"]


def test_resume_of_a_checkpoint_whose_schedule_counts_iterations_is_exact(tmp_path, data, reference, stopped_at_5):
    """Checkpoints written before the schedule counted samples (Megatron-LM) hold iteration counts:
    they resume on the same learning rates."""
    import torch

    ref_train, _, _ = reference
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(stopped_at_5, ckpt)
    path = os.path.join(ckpt, "iter_0000005", "mp_rank_00", "model_optim_rng.pt")
    state = torch.load(path, map_location="cpu", weights_only=True)
    sched = state["opt_param_scheduler"]
    assert sched.pop("num_steps_unit") == "samples" and sched["num_steps"] == 5 * 4
    for key in ("num_steps", "lr_warmup_steps", "lr_decay_steps", "wd_incr_steps"):
        sched[key] //= 4  # as the iteration-counting schedule wrote them (GBS 4)
    torch.save(state, path)
    metrics = str(tmp_path / "m.jsonl")
    posttrain.main(base_argv(data, metrics, "--load", ckpt, "--exit-interval", "7"))
    assert_steps_match(read_metrics(metrics), ref_train, range(6, 8))


def test_ckpt_step_resumes_the_iteration_it_names(tmp_path, data, reference, capsys):
    """Megatron-LM's --ckpt-step N (load iteration N, not the tracked one) was 'unrecognized arguments': the
    reference's checkpoint tracks 10; --ckpt-step 5 resumes at 5 exactly, an absent step is named."""
    import re

    from mindspeed_pack.checkpoint.errors import CheckpointError
    from mindspeed_pack.config.arguments import parse_args

    ref_train, _, ckpt = reference
    assert layout.read_tracker(ckpt) == 10
    metrics = str(tmp_path / "m.jsonl")
    posttrain.main(base_argv(data, metrics, "--load", ckpt, "--ckpt-step", "5", "--exit-interval", "7"))
    assert_steps_match(read_metrics(metrics), ref_train, range(6, 8))
    absent = f"--ckpt-step 6: {ckpt}/iter_0000006 does not exist; {ckpt} holds iter_0000005, iter_0000010"
    with pytest.raises(CheckpointError, match=re.escape(absent)):  # the model flags given: the load names it
        posttrain.main(base_argv(data, metrics, "--load", ckpt, "--ckpt-step", "6"))
    with pytest.raises(SystemExit):  # none given: the flags are read from that iteration, named before
        parse_args(["--seq-length", "128", "--train-iters", "1", "--data-path", data, "--load", ckpt, "--ckpt-step",
                    "6"], world_size=1)
    assert absent in capsys.readouterr().err


def test_no_load_rng_and_no_load_optim_change_the_run(tmp_path, data, reference, stopped_at_5, caplog):
    """Negative controls: RNG and optimizer state really are what makes the resume exact (--no-load-optim, which
    MindSpeed-LLM's scripts always pass, says so: it resumed without a word)."""
    ref_train, _, _ = reference
    no_rng = str(tmp_path / "no_rng.jsonl")
    posttrain.main(base_argv(data, no_rng, "--load", stopped_at_5, "--no-load-rng", "--exit-interval", "6"))
    assert rel_err(read_metrics(no_rng)[6]["lm loss"], ref_train[6]["lm loss"]) > 1e-6  # other dropout masks

    no_optim = str(tmp_path / "no_optim.jsonl")
    with caplog.at_level("WARNING", logger="mindspeed_pack.checkpoint.save_load"):
        posttrain.main(base_argv(data, no_optim, "--load", stopped_at_5, "--no-load-optim", "--exit-interval", "7"))
    assert "--no-load-optim: resuming at iteration 5 with fresh Adam moments and the learning-rate schedule " \
           "started over" in caplog.text
    got = read_metrics(no_optim)
    assert rel_err(got[6]["lm loss"], ref_train[6]["lm loss"]) <= 1e-6  # same weights, data and masks ...
    assert rel_err(got[7]["lm loss"], ref_train[7]["lm loss"]) > 1e-6  # ... but a fresh Adam and schedule


def test_a_longer_run_says_which_schedule_it_follows(tmp_path, data, reference, stopped_at_5, caplog):
    """--train-iters raised on resume (the decay then differs from the checkpoint's): under
    --use-checkpoint-opt_param-scheduler the flags' decay was ignored without a word (megatron-core's "using checkpoint
    value" goes to a logger nothing shows); both flags now name the values they keep or replace."""
    ref_train, _, _ = reference
    from mindspeed_pack.checkpoint.identity import SCHEDULE_FIELDS

    decay = f"{SCHEDULE_FIELDS['lr_decay_steps']}: checkpoint 40, flags 48"
    argv = [a if a != str(ITERS) else "12" for a in base_argv(data, "", "--load", stopped_at_5, "--exit-interval", "6")]
    kept = str(tmp_path / "kept.jsonl")
    with caplog.at_level("INFO", logger="mindspeed_pack.checkpoint.identity"):
        posttrain.main([*argv, "--metrics-file", kept, "--use-checkpoint-opt_param-scheduler"])
    assert f"--use-checkpoint-opt_param-scheduler: keeping the checkpoint's schedule, not these flags' ({decay})" \
        in caplog.text
    assert read_metrics(kept)[6]["lr"] == ref_train[6]["lr"]  # the 10-iteration decay
    caplog.clear()
    followed = str(tmp_path / "followed.jsonl")
    with caplog.at_level("INFO", logger="mindspeed_pack.checkpoint.identity"):
        posttrain.main([*argv, "--metrics-file", followed, "--override-opt_param-scheduler"])
    assert f"--override-opt_param-scheduler: following the flags' schedule from sample 20 ({decay})" in caplog.text
    assert read_metrics(followed)[6]["lr"] > ref_train[6]["lr"]  # a longer decay


def test_a_resume_on_other_data_or_in_another_order_is_warned(tmp_path, data, stopped_at_5, caplog):
    """consumed_samples counts into the sample index of the data and flags the run resumes with: another --data-path
    (or --seed, --seq-length, --split, ...) went on silently at sample 20 of data the checkpoint never read from."""
    other = write_packed_instruction_dataset(str(tmp_path / "other"), num_packs=64, seed=1)
    metrics = str(tmp_path / "m.jsonl")
    with caplog.at_level("WARNING", logger="mindspeed_pack.checkpoint.save_load"):
        posttrain.main(base_argv(other, metrics, "--load", stopped_at_5, "--exit-interval", "6"))
    assert f"--load {stopped_at_5}: iteration 5 was trained on other data or in another sample order (--data-path " \
           f"{other} here, {data} there): this run goes on at sample 20 of its own sample index" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="mindspeed_pack.checkpoint.save_load"):
        posttrain.main(base_argv(data, metrics, "--load", stopped_at_5, "--exit-interval", "6", "--seed", "9"))
    assert "(--seed 9 here, 1234 there)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="mindspeed_pack.checkpoint.save_load"):  # the same data: no word
        posttrain.main(base_argv(data, metrics, "--load", stopped_at_5, "--exit-interval", "6",
                                 "--micro-batch-size", "1"))
    assert "other data" not in caplog.text


def _copy_prefix(prefix: str, to_dir: str) -> str:
    """Every file of ``prefix`` (indexed datasets and sidecars) copied into ``to_dir``, as a moved job has them."""
    import glob

    os.makedirs(to_dir, exist_ok=True)
    for path in glob.glob(prefix + "*"):
        shutil.copy(path, to_dir)
    return os.path.join(to_dir, os.path.basename(prefix))


def _order(**flags) -> dict:
    """The data order a checkpoint saved by a run of ``flags`` records."""
    import argparse

    from mindspeed_pack.checkpoint.save_load import _data_order

    return _data_order(argparse.Namespace(**flags))


def _resume_messages(caplog, order: dict, here: dict) -> str:
    """What a resume with the flags ``here`` logs about a checkpoint that recorded the data order ``order``."""
    import argparse

    from mindspeed_pack.checkpoint.save_load import _warn_other_data
    from tests.model_utils import init_single_process

    init_single_process()
    caplog.clear()
    with caplog.at_level("INFO", logger="mindspeed_pack.checkpoint.save_load"):
        _warn_other_data(argparse.Namespace(**here), "--load ckpt", {"iteration": 5, "data_order": order}, 20)
    return caplog.text


def _data(prefix: str, kind: str, seed: int) -> str:
    """Pretraining documents, or packs with the sidecar preprocess_data.py writes (its cache key names the raw
    inputs' digests): the content identity of ``kind``."""
    import json

    from tests.data_utils import random_documents, write_pretrain_documents

    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    if kind == "documents":
        return write_pretrain_documents(prefix, random_documents(50, 2, seed=seed, max_len=30))
    write_packed_instruction_dataset(prefix, num_packs=16, seed=seed)
    key = {"inputs": [{"path": f"/data/raw{seed}.jsonl", "size": 1000 + seed, "sha256": f"{seed:064d}"}],
           "tokenizer": {"vocab_size": 200, "files_sha256": "t"}, "arguments": {"pack": True}}
    with open(f"{prefix}_packed_meta.json", "w") as f:
        json.dump({"layout": {"kind": "packed", "neat_pack": True, "seq_length": 128}, "cache_key": key}, f)
    return prefix


@pytest.mark.parametrize("kind", ["packs", "documents"])
def test_the_same_data_moved_to_another_directory_resumes_without_the_other_data_warning(tmp_path, caplog, kind):
    """The data order compared the prefixes' paths: a job moved to another disk with its data copied was warned as
    trained on other data; the prefixes' contents (index files, sizes, the sidecar's record of the inputs) are
    compared now, the move said in an info line. Pretraining blends and --train-data-path alike."""
    a, b = _data(str(tmp_path / "one" / "a"), kind, 1), _data(str(tmp_path / "one" / "b"), kind, 2)
    a2, b2 = _copy_prefix(a, str(tmp_path / "two")), _copy_prefix(b, str(tmp_path / "two"))
    for key, saved, here in (("data_path", [a], [a2]), ("data_path", ["0.3", a, "0.7", b], ["0.3", a2, "0.7", b2]),
                             ("train_data_path", [a], [a2])):
        text = _resume_messages(caplog, _order(**{key: saved, "seed": 1}), {key: here, "seed": 1})
        assert "other data" not in text, text
        assert f"the data moved (--{key.replace('_', '-')} {' '.join(here)} here, {' '.join(saved)} there): the same " \
               "contents" in text
    # per-split paths are used whole: --split orders nothing there, and another one is no other data
    text = _resume_messages(caplog, _order(train_data_path=[a], seed=1, split="98,2,0"),
                            {"train_data_path": [a], "seed": 1, "split": "90,10,0"})
    assert "other data" not in text, text
    # another dataset moved in under the first one's name is other data
    text = _resume_messages(caplog, _order(data_path=["0.3", a, "0.7", b], seed=1),
                            {"data_path": ["0.3", a2, "0.7", a2], "seed": 1})
    assert f"trained on other data or in another sample order (--data-path 0.3 {a2} 0.7 {a2} here, 0.3 {a} 0.7 {b} " \
           "there)" in text


@pytest.mark.parametrize("kind", ["packs", "documents"])
def test_other_files_at_the_same_path_are_warned_as_other_data(tmp_path, caplog, kind):
    """Data preprocessed again into the same prefix (another corpus) was read at the checkpoint's consumed samples
    of another sample index with no word: the paths were equal."""
    a = _data(str(tmp_path / "a"), kind, 1)
    recorded = _order(data_path=[a], seed=1)
    _data(a, kind, 3)
    text = _resume_messages(caplog, recorded, {"data_path": [a], "seed": 1})
    assert f"iteration 5 was trained on other data or in another sample order (--data-path {a}: the files of {a} " \
           "changed since (other index contents))" in text
    assert "the same files moved elsewhere are no change" not in text
    assert "other data" not in _resume_messages(caplog, _order(data_path=[a], seed=1), {"data_path": [a], "seed": 1})


def test_what_records_no_content_compares_paths_as_before(tmp_path, caplog):
    """A checkpoint that recorded only paths (saved before the content identity), and packs whose sidecar records
    nothing of their content (fixed-length packs: their index tells only how many), are compared by path."""
    from mindspeed_pack.checkpoint.save_load import DATA_IDENTITY

    a = _data(str(tmp_path / "one" / "a_text_document"), "documents", 1)
    a2 = _copy_prefix(a, str(tmp_path / "two"))
    older = {k: v for k, v in _order(data_path=[a], seed=1).items() if k != DATA_IDENTITY}
    text = _resume_messages(caplog, older, {"data_path": [a2], "seed": 1})
    assert f"(--data-path {a2} here, {a} there)" in text and "the same files moved elsewhere are no change" in text
    bare = write_packed_instruction_dataset(str(tmp_path / "one" / "p"), num_packs=16)
    other = write_packed_instruction_dataset(str(tmp_path / "two" / "p"), num_packs=16, seed=1)  # the same index
    text = _resume_messages(caplog, _order(data_path=[bare], seed=1), {"data_path": [other], "seed": 1})
    assert f"(--data-path {other} here, {bare} there)" in text


def test_a_megatron_lm_rng_state_is_restored(tmp_path, data, reference, stopped_at_5):
    """Megatron-LM's checkpoints name the RNG states random_rng_state, np_rng_state, ...: a resume of one with
    --no-load-optim (no --no-load-rng) stopped with KeyError: 'random'. Restored, step 6 draws the same dropout."""
    import numpy as np
    import torch

    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(stopped_at_5, ckpt)
    path = layout.checkpoint_file(ckpt, 5, 0, 0, 1)
    record = torch.load(path, weights_only=True)
    names = {"random": "random_rng_state", "np": "np_rng_state", "torch": "torch_rng_state",
             "cuda": "cuda_rng_state", "tracker": "rng_tracker_states"}
    states = []
    for state in record["rng_state"]:
        version, internal, gauss = state["random"]
        name, keys, pos, has_gauss, np_gauss = state["np"]
        state = {**state, "random": (version, tuple(internal), gauss),
                 "np": (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, np_gauss)}
        states.append({names[k]: v for k, v in state.items()})
    torch.save({**record, "rng_state": states}, path)
    metrics = str(tmp_path / "m.jsonl")
    posttrain.main(base_argv(data, metrics, "--load", ckpt, "--no-load-optim", "--exit-interval", "6"))
    assert rel_err(read_metrics(metrics)[6]["lm loss"], reference[0][6]["lm loss"]) <= 1e-6


def test_another_dp_size_warns_about_dropout_only_where_there_is_dropout(tmp_path, data, stopped_at_5, caplog):
    """A DP2 checkpoint resumed on one rank takes rank 0's RNG state: only dropout masks can differ, so a run with no
    dropout (a Qwen or Llama fine-tune) was warned for nothing on every such resume."""
    import torch

    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(stopped_at_5, ckpt)
    path = layout.checkpoint_file(ckpt, 5, 0, 0, 1)
    record = torch.load(path, weights_only=True)
    torch.save({**record, "rng_state": record["rng_state"] * 2}, path)  # as two data-parallel ranks save it
    warned = "holds RNG states of 2 data(xcontext)-parallel ranks, this run has 1"
    with caplog.at_level("WARNING", logger="mindspeed_pack.checkpoint.save_load"):
        posttrain.main(base_argv(data, str(tmp_path / "a.jsonl"), "--load", ckpt, "--exit-interval", "6"))
    assert warned in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="mindspeed_pack.checkpoint.save_load"):
        posttrain.main(base_argv(data, str(tmp_path / "b.jsonl"), "--load", ckpt, "--exit-interval", "6",
                                 "--hidden-dropout", "0", "--attention-dropout", "0"))
    assert warned not in caplog.text


def test_a_megatron_lm_checkpoint_resumes_at_the_samples_it_consumed(tmp_path, data, stopped_at_5):
    """Megatron-LM records the samples read in its args (consumed_train_samples, which a batch-size ramp-up makes
    other than iteration x batch): the resume took iteration x --global-batch-size, skipping data never read."""
    import torch

    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(stopped_at_5, ckpt)
    path = layout.checkpoint_file(ckpt, 5, 0, 0, 1)
    record = torch.load(path, weights_only=True)
    del record["consumed_samples"]
    record["args"]["consumed_train_samples"] = 12  # 5 iterations, the first ones at a smaller batch
    torch.save(record, path)
    metrics = str(tmp_path / "m.jsonl")
    posttrain.main(base_argv(data, metrics, "--load", ckpt, "--exit-interval", "6"))
    assert read_metrics(metrics)[6]["consumed samples"] == 12 + 4
    # none recorded (MindSpeed-LLM's converter writes iteration 1 and its own arguments): read from sample 0, as
    # Megatron-LM's getattr(checkpoint_args, 'consumed_train_samples', 0); it skipped iteration x batch samples
    del record["args"]["consumed_train_samples"]
    torch.save(record, path)
    metrics = str(tmp_path / "m0.jsonl")
    posttrain.main(base_argv(data, metrics, "--load", ckpt, "--exit-interval", "6"))
    assert read_metrics(metrics)[6]["consumed samples"] == 4


def test_the_same_command_resumes_a_run_that_saves_no_optimizer_state(tmp_path, data, reference, stopped_at_5):
    """--no-save-optim checkpoints hold no optimizer state, so the same command (torchrun's restart) could never
    resume one (it asked for --no-load-optim, then refused that as another run): it resumes with fresh Adam
    moments and the learning-rate schedule at its saved step, as the uninterrupted run's, not started over."""
    import torch

    ref_train, _, _ = reference
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(stopped_at_5, ckpt)
    path = os.path.join(ckpt, "iter_0000005", "mp_rank_00", "model_optim_rng.pt")
    state = torch.load(path, map_location="cpu", weights_only=True)
    del state["optimizer"], state["opt_param_scheduler"]  # as --no-save-optim writes it
    torch.save(state, path)
    metrics = str(tmp_path / "m.jsonl")
    posttrain.main(base_argv(data, metrics, "--load", ckpt, "--save", ckpt, "--no-save-optim", "--exit-interval", "7"))
    got = read_metrics(metrics)
    assert sorted(got) == [6, 7] and rel_err(got[6]["lm loss"], ref_train[6]["lm loss"]) <= 1e-6
    assert [got[i]["lr"] for i in (6, 7)] == [ref_train[i]["lr"] for i in (6, 7)]  # the schedule went on
    assert rel_err(got[7]["lm loss"], ref_train[7]["lm loss"]) > 1e-6  # fresh moments


def test_finetune_loads_weights_and_resets_iteration(tmp_path, data, reference):
    _, _, ref_ckpt = reference
    metrics = str(tmp_path / "ft.jsonl")
    posttrain.main(base_argv(data, metrics, "--load", ref_ckpt, "--finetune", "--skip-train"))
    valid = read_metrics(metrics, "valid")
    assert list(valid) == [0]  # iteration reset
    # --skip-train validates the split's first samples: as the resumed checkpoint does at iteration 10
    posttrain.main(base_argv(data, str(tmp_path / "at10.jsonl"), "--load", ref_ckpt, "--skip-train"))
    at10 = read_metrics(str(tmp_path / "at10.jsonl"), "valid")
    assert rel_err(valid[0]["lm loss"], at10[10]["lm loss"]) <= 1e-6  # the weights of iteration 10


def test_finetune_from_its_own_save_resumes_this_run_and_refuses_another(tmp_path, data, reference, stopped_at_5):
    """The shipped configs set 'finetune: true', which the command line cannot unset: --load D --save D on a run's
    own D restarted at iteration 0 (loss of step 1 again) and saved over D's iterations with another run. D's
    record now decides: this run's progress is resumed, another run's (or an unrecorded one) refused."""
    from mindspeed_pack.checkpoint.errors import CheckpointError
    from mindspeed_pack.config import resolved_config
    from mindspeed_pack.runtime import error_scope

    ref_train, _, ref_ckpt = reference
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(stopped_at_5, ckpt)
    argv = ["--load", ckpt, "--save", ckpt, "--finetune", "--exit-interval", "7"]
    with pytest.raises(CheckpointError, match=rf"^--finetune --load {ckpt} --save {ckpt}: {ckpt} holds iteration 5 "
                       "of a run's with no readable record; --finetune restarts at iteration 0 and would save over"):
        posttrain.main(base_argv(data, str(tmp_path / "none.jsonl"), *argv))
    shutil.copy(os.path.join(ref_ckpt, resolved_config.FILE_NAME), ckpt)
    with pytest.raises(CheckpointError, match=r"holds iteration 5 of another run's \(.*--lr 0.002 here, 0.001 there") as e:
        posttrain.main(base_argv(data, str(tmp_path / "other.jsonl"), *argv, "--lr", "2e-3"))
    # every rank reads the record alike: each node's local rank 0 prints it, not every rank (runtime.error_scope)
    assert error_scope.scope_of(e.value) == "node"
    assert sorted(os.listdir(ckpt)) == sorted([resolved_config.FILE_NAME, "iter_0000005", layout.TRACKER])
    metrics = str(tmp_path / "m.jsonl")
    posttrain.main(base_argv(data, metrics, *argv))
    assert_steps_match(read_metrics(metrics), ref_train, [6, 7])


def test_signal_handler_saves_and_exits(tmp_path, data):
    import signal

    from mindspeed_pack.config.arguments import parse_args
    from mindspeed_pack.datasets.packed_dataset import PackedBatchSource, resolve_vocab_size
    from mindspeed_pack.training.stages.sft import SFTStage
    from mindspeed_pack.training.trainer import run

    ckpt = str(tmp_path / "ckpt")
    args = parse_args(base_argv(data, str(tmp_path / "m.jsonl"), "--save", ckpt, "--exit-signal-handler"))
    resolve_vocab_size(args)
    old = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        trainer = run(args, PackedBatchSource(), SFTStage(args), before_train=lambda t: os.kill(os.getpid(), signal.SIGTERM))
    finally:
        signal.signal(signal.SIGTERM, old[0])
        signal.signal(signal.SIGINT, old[1])
    assert trainer.iteration == 1  # the step in flight finishes, then save and exit
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "1"


# ------------------------------------------------------------- two processes: PP=2, DP=2
def _reference_and_stop(data: str, out: str, flags: list) -> None:
    posttrain.main(base_argv(data, os.path.join(out, "full.jsonl"), *flags))
    posttrain.main(base_argv(data, os.path.join(out, "first.jsonl"), *flags, "--save", os.path.join(out, "ckpt"),
                             "--exit-interval", "5"))


def _resume(data: str, out: str, flags: list) -> None:
    posttrain.main(base_argv(data, os.path.join(out, "resumed.jsonl"), *flags, "--load", os.path.join(out, "ckpt")))


@pytest.mark.slow
@pytest.mark.parametrize("flags,rank_dirs", [
    (["--pipeline-model-parallel-size", "2"], ["mp_rank_00_000", "mp_rank_00_001"]),
    ([], ["mp_rank_00"]),  # data parallel: each rank's dropout RNG differs and is restored per rank
], ids=["pp2", "dp2"])
def test_two_process_resume_is_exact(tmp_path, data, flags, rank_dirs):
    out = str(tmp_path)
    run_distributed(_reference_and_stop, 2, data, out, flags, timeout=300)
    assert sorted(os.listdir(os.path.join(out, "ckpt", "iter_0000005"))) == rank_dirs
    run_distributed(_resume, 2, data, out, flags, timeout=300)  # fresh processes
    full = read_metrics(os.path.join(out, "full.jsonl"))
    assert_steps_match(read_metrics(os.path.join(out, "resumed.jsonl")), full, range(6, ITERS + 1))
    assert rel_err(read_metrics(os.path.join(out, "resumed.jsonl"), "valid")[10]["lm loss"],
                   read_metrics(os.path.join(out, "full.jsonl"), "valid")[10]["lm loss"]) <= 1e-6


def test_exit_duration_stops_saved_and_the_same_command_resumes_exactly(tmp_path, data, reference):
    """Megatron-LM's --exit-duration-in-mins (it was an unknown flag): past the limit the run stops after the
    iteration under way, saved; the same command then resumes and logs the uninterrupted run's steps. The first
    launch of --load D --save D (D empty) trains the run without --load's first step (it skipped the
    layout-invariant initialisation, leaving megatron's, as if --load were to fill the weights)."""
    ref_train, _, _ = reference
    ckpt, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    argv = base_argv(data, metrics, "--load", ckpt, "--save", ckpt, "--save-interval", "5")
    trainer = posttrain.main([*argv, "--exit-duration-in-mins", "1e-9", "--exit-interval", "8"])
    assert trainer.iteration == 1 and open(os.path.join(ckpt, layout.TRACKER)).read() == "1"
    posttrain.main([*argv, "--exit-interval", "3"])  # not a flag that defines the run: the same run resumes
    assert_steps_match(read_metrics(metrics), ref_train, range(1, 4))


def test_iterations_later_than_a_tracker_set_back_are_named_at_load(tmp_path, data, reference, caplog):
    """The tracker set back by hand (10 -> 5, to redo the last steps), or a save killed before its tracker: the
    later iter_* stayed beside it without a word, and whoever took the highest iter_* (a script, a user) took the
    abandoned weights. The load (and the converter) names them; a run saving there says which it saves over when
    it reaches them (Megatron-LM's re-save) and which stay, with the command to remove them."""
    from mindspeed_pack.convert.convert import MegatronCheckpoint

    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(reference[2], ckpt)
    os.makedirs(os.path.join(ckpt, "iter_0000007", "mp_rank_00"))  # an iteration this run does not save
    layout.write_tracker(ckpt, 5)
    metrics = str(tmp_path / "m.jsonl")
    with caplog.at_level("WARNING"):
        posttrain.main(base_argv(data, metrics, "--load", ckpt, "--save", ckpt, "--save-interval", "5",
                                 "--exit-interval", "6"))
    said = [r.getMessage() for r in caplog.records if "later iter_" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert f"{ckpt}/latest_checkpointed_iteration.txt names iteration 5, but {ckpt} also holds the later " \
           "iter_0000007, iter_0000010" in said[0]
    assert "iteration 5 is loaded, as the tracker says" in said[0]
    assert "this run saves over iter_0000010 when it reaches it" in said[0]
    assert "iter_0000007 stays beside this run's checkpoints" in said[0]
    assert f"rm -r {ckpt}/iter_0000007" in said[0]
    assert layout.read_tracker(ckpt) == 6  # resumed at 5, as Megatron-LM does
    caplog.clear()
    with caplog.at_level("WARNING"):
        MegatronCheckpoint(ckpt)  # the converter reads the tracker too, and says what else is there
    assert "names iteration 6, but" in caplog.text and "iter_0000007, iter_0000010" in caplog.text

"""One command from a Hugging Face model and a raw data file to a trained Hugging Face model (issue 34).

``posttrain.py --load HF_DIR --data-path data.jsonl ...`` tokenises and packs with
preprocess_data.py's own code and cache (once, on rank 0), trains, and writes ``--save-hf``:
transformers loads the result, the two-step form (preprocess_data.py, then posttrain.py on the
prefix) trains the same losses bit for bit, a second run hits the cache and an edited file rebuilds
it, ``--train-epochs 2`` reads every pack (and so every sample) exactly twice, and under two ranks
preprocessing happens once and both ranks train on the same packs.
"""
import collections
import json
import logging
import os
import time

import numpy as np
import pytest
import torch

import posttrain
from mindspeed_pack.config.arguments import parse_args
from mindspeed_pack.data import toy
from mindspeed_pack.datasets.packed_dataset import PackedBatchSource, resolve_vocab_size
from mindspeed_pack.datasets.packed_documents import DataError, PackedDocuments, read_meta
from mindspeed_pack.training import raw_data, run_plan
from mindspeed_pack.training.stages.sft import SFTStage
from mindspeed_pack.training.trainer import run
from tests.data_utils import read_metrics
from tests.model_utils import TINY_FLAGS as TINY_MODEL
from tests.train_utils import run_posttrain, train_losses

SHAREGPT = ["--handler-name", "SharegptStyleInstructionHandler", "--prompt-type", "qwen"]
TRAIN = ["--seq-length", "128", "--neat-pack", "--micro-batch-size", "1", "--global-batch-size", "4",
         "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory, toy_tokenizer_dir):
    """A random transformers Qwen2 over the toy tokenizer (saved with it), and a raw ShareGPT file."""
    import transformers

    root = tmp_path_factory.mktemp("one_command")
    tokenizer = transformers.AutoTokenizer.from_pretrained(toy_tokenizer_dir)
    config = transformers.Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=False, rope_theta=1e6, max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(root / "hf")
    tokenizer.save_pretrained(root / "hf")
    rows = toy.generate_sharegpt(64, seed=3, turns=(1, 2), max_words=12)
    return {"root": root, "hf": str(root / "hf"), "rows": rows,
            "data": str(toy.write_dataset(root / "sharegpt.jsonl", rows))}


def one_command(assets, *extra):
    return ["--load", assets["hf"], "--data-path", assets["data"], *SHAREGPT, *TRAIN, *extra]


@pytest.fixture(scope="module")
def trained(assets):
    """The one command, with --save-hf: (process, metrics records, export directory)."""
    root = assets["root"]
    proc, records = run_posttrain(one_command(assets, "--train-epochs", "1", "--save-hf", str(root / "exported"),
                                              "--data-cache-path", str(root / "cache")),
                                  model_flags=(), metrics=str(root / "one.jsonl"))
    return proc, records, str(root / "exported")


def test_one_command_trains_a_model_transformers_loads_and_the_two_step_form_matches(assets, trained, tmp_path,
                                                                                      run_preprocess):
    import transformers

    proc, records, exported = trained
    assert "preprocessed now" in proc.stderr and "rows read 64" in proc.stdout
    losses = train_losses(records)
    assert losses and all(np.isfinite(losses))
    model = transformers.AutoModelForCausalLM.from_pretrained(exported)
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    ids = tokenizer("<|im_start|>user\nSay the first word.\nred cat<|im_end|>\n", return_tensors="pt").input_ids
    assert torch.isfinite(model(ids).logits).all()
    start = transformers.AutoModelForCausalLM.from_pretrained(assets["hf"])
    assert not torch.equal(model.model.embed_tokens.weight, start.model.embed_tokens.weight)  # it was trained
    # the two-step form: preprocess_data.py with the same flags, then posttrain.py on its prefix
    code, _, err = run_preprocess(input=assets["data"], output_prefix=tmp_path / "sft", tokenizer_name_or_path=assets["hf"],
                                  handler_name="SharegptStyleInstructionHandler", prompt_type="qwen", seq_length=128,
                                  pack=True, neat_pack=True)
    assert code == 0, err
    _, two_step = run_posttrain(["--load", assets["hf"], "--data-path", str(tmp_path / "sft"), *TRAIN,
                                 "--prompt-type", "qwen", "--train-epochs", "1"],
                                model_flags=(), metrics=str(tmp_path / "two.jsonl"))
    assert train_losses(two_step) == losses  # bit for bit


def test_a_packed_prefix_is_checked_against_the_preprocessing_flags_given(assets, tmp_path, run_preprocess):
    code, _, err = run_preprocess(input=assets["data"], output_prefix=tmp_path / "sft", tokenizer_name_or_path=assets["hf"],
                                  handler_name="SharegptStyleInstructionHandler", prompt_type="qwen", seq_length=128,
                                  pack=True, neat_pack=True)
    assert code == 0, err
    argv = ["--load", assets["hf"], "--data-path", str(tmp_path / "sft"), *TRAIN, "--train-iters", "1"]
    raw_data.prepare(parse_args(argv + SHAREGPT, extra_args_provider=posttrain.posttrain_args))  # as recorded
    args = parse_args(argv + ["--handler-name", "AlpacaStyleInstructionHandler"],
                      extra_args_provider=posttrain.posttrain_args)
    with pytest.raises(DataError, match=r"--handler-name AlpacaStyleInstructionHandler, but .*sft' was preprocessed "
                                        r"with --handler-name SharegptStyleInstructionHandler"):
        raw_data.prepare(args)


def _dry_run(argv, caplog, capsys):
    capsys.readouterr()
    start = time.perf_counter()
    with caplog.at_level(logging.INFO):
        caplog.clear()
        posttrain.main(argv + ["--dry-run"])
    seconds = time.perf_counter() - start
    return caplog.text + capsys.readouterr().out, seconds


def test_second_run_hits_the_cache_and_an_edited_file_rebuilds_it(assets, tmp_path, caplog, capsys):
    data = tmp_path / "sharegpt.jsonl"
    toy.write_dataset(data, assets["rows"])
    argv = ["--load", assets["hf"], "--data-path", str(data), *SHAREGPT, *TRAIN, "--train-epochs", "1"]
    first, t_build = _dry_run(argv, caplog, capsys)
    assert "preprocessed now" in first and "cache hit" not in first
    second, t_hit = _dry_run(argv, caplog, capsys)
    assert "cache hit" in second and "preprocessed now" not in second
    prefix = os.path.join(tmp_path, raw_data.CACHE_DIR, [n for n in os.listdir(tmp_path / raw_data.CACHE_DIR)
                                                         if n.endswith("_packed_meta.json")][0][:-len("_packed_meta.json")])
    before = read_meta(prefix)["cache_key"]["inputs"][0]["sha256"]
    rows = [dict(r) for r in assets["rows"]]
    rows[0]["conversations"][-1]["value"] += " again"
    toy.write_dataset(data, rows)
    third, t_edit = _dry_run(argv, caplog, capsys)
    assert "preprocessed now" in third and "cache hit" not in third
    assert read_meta(prefix)["cache_key"]["inputs"][0]["sha256"] != before  # same prefix, rebuilt
    with capsys.disabled():
        print(f"\n[cache] first run {t_build:.2f}s (preprocessed), second {t_hit:.2f}s (cache hit), "
              f"edited file {t_edit:.2f}s (rebuilt)")


class CountingSource(PackedBatchSource):
    """The packs every training micro-batch reads."""

    def __init__(self):
        self.seen = []

    def micro_batches(self, split, consumed_samples):
        for batch in super().micro_batches(split, consumed_samples):
            if split == "train":
                self.seen.extend(batch["documents"])
            yield batch


def _prepared(argv):
    args = parse_args(argv, extra_args_provider=posttrain.posttrain_args)
    raw_data.prepare(args)
    resolve_vocab_size(args)
    run_plan.resolve_epochs(args)
    return args


def test_train_epochs_2_trains_every_sample_exactly_twice(assets, trained, caplog):
    base = one_command(assets, "--train-epochs", "2", "--data-cache-path", str(assets["root"] / "cache"))
    packs = len(PackedDocuments(_prepared(base).data_path[0]))
    gbs = next(g for g in (4, 3, 2, 1) if packs % g == 0)  # epochs that fill whole global batches
    with caplog.at_level(logging.INFO):
        args = _prepared(base + ["--global-batch-size", str(gbs)])
    assert args.train_iters == 2 * packs // gbs and f"= {args.train_iters} iterations" in caplog.text
    source = CountingSource()
    run(args, source, SFTStage(args))
    assert collections.Counter(source.seen) == {pack: 2 for pack in range(packs)}
    # each pack holds its own samples (segments 1..k): every sample is read twice
    docs = PackedDocuments(args.data_path[0])
    samples = sum(int(docs.get(pack)["attention_mask"].max()) for pack in source.seen)
    assert samples == 2 * read_meta(args.data_path[0])["statistics"]["samples_written"] == 2 * len(assets["rows"])


def test_two_ranks_preprocess_once_and_train_on_the_same_packs(assets, trained, tmp_path):
    _, one_rank, _ = trained
    proc, records = run_posttrain(one_command(assets, "--train-epochs", "1", "--data-cache-path", str(tmp_path)),
                                  nproc=2, model_flags=(), metrics=str(tmp_path / "two_ranks.jsonl"))
    log = proc.stdout + proc.stderr
    assert log.count("rows read 64") == 1  # preprocess_data.py's summary: rank 0 alone preprocessed
    assert "rank 1: waiting for rank 0 to preprocess" in log
    prefixes = {rank: line.split("-> packs ")[1].split(":")[0] for line in log.splitlines()
                for rank in (0, 1) if f"data (rank {rank} of 2): " in line}
    assert set(prefixes) == {0, 1} and prefixes[0] == prefixes[1] and prefixes[0].startswith(str(tmp_path))
    # the global batches hold the same packs as the one-rank run: the same losses (up to reduction order)
    a, b = train_losses(records), train_losses(one_rank)
    assert len(a) == len(b) and max(abs(x - y) / abs(y) for x, y in zip(a, b)) <= 1e-5, (a, b)
    assert json.loads(open(tmp_path / "two_ranks.jsonl").readline())["split"] == "setup"


# ------------------------------------------------------------------ a crash of the one command loses nothing
RESUME_ITERS = 6


def resume_argv(assets, save, *extra):
    """The one command with --save S (a save every 2 steps): the run a crash interrupts."""
    return one_command(assets, "--train-iters", str(RESUME_ITERS), "--save", str(save), "--save-interval", "2",
                       "--data-cache-path", str(assets["root"] / "cache"), *extra)


def train_iterations(path):
    with open(path) as f:
        return [r["iteration"] for r in map(json.loads, f) if r.get("split") == "train"]


def assert_same_steps(got, want, tolerance=1e-6):
    assert sorted(got) == list(range(1, RESUME_ITERS + 1)), sorted(got)
    for it in got:
        for key in ("lm loss", "grad norm", "lr"):
            assert abs(got[it][key] - want[it][key]) <= tolerance * abs(want[it][key]), (it, key, got[it], want[it])


@pytest.fixture(scope="module")
def uninterrupted(assets, tmp_path_factory):
    """{ranks: (train records by iteration, final weights)} of the uninterrupted one command."""
    from mindspeed_pack.convert import megatron_layout as layout

    out = {}
    for nproc in (1, 2):
        d = tmp_path_factory.mktemp(f"uninterrupted{nproc}")
        run_posttrain(resume_argv(assets, d / "save"), nproc=nproc, model_flags=(), metrics=str(d / "m.jsonl"))
        weights = layout.load_file(layout.checkpoint_file(str(d / "save"), RESUME_ITERS, 0, 0, 1))["model"]
        out[nproc] = ({r["iteration"]: r for r in read_jsonl(d / "m.jsonl") if r.get("split") == "train"}, weights)
    return out


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.slow
def test_one_command_killed_under_torchrun_resumes_from_save(assets, uninterrupted, tmp_path):
    """rank 1 SIGKILLed after step 5 (S holds iteration 4): torchrun's restart resumes from S at iteration 4,
    says so, and the job ends with the uninterrupted job's steps, each logged once."""
    from tests.dist_harness import free_port, run_torchrun
    from tests.train_utils import ROOT

    save, metrics = tmp_path / "save", str(tmp_path / "m.jsonl")
    proc = run_torchrun([os.path.join(ROOT, "posttrain.py"), *resume_argv(assets, save, "--metrics-file", metrics)],
                        2, launcher_args=["--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                                          "--max-restarts", "1"],
                        env={"OMP_NUM_THREADS": "1", "MINDSPEED_PACK_FAULT": "step@5:kill:rank1"}, cwd=ROOT,
                        timeout=420)
    out = proc.stdout + proc.stderr
    assert "killing this process at step@5" in out, out[-4000:]
    resumed = [line for line in out.splitlines() if "resumed from" in line]
    assert len(resumed) == 1 and f"resumed from {save} at iteration 4 (torchrun restart 1)" in resumed[0], resumed
    assert train_iterations(metrics) == list(range(1, RESUME_ITERS + 1))
    assert_same_steps(read_metrics(metrics), uninterrupted[2][0])
    assert open(save / "latest_checkpointed_iteration.txt").read() == str(RESUME_ITERS)


def test_one_command_rerun_by_hand_after_a_kill_resumes_from_save(assets, uninterrupted, tmp_path):
    """Killed after step 5, then the same command again: it resumes from S at iteration 4 (steps 5 and 6
    only), ends with the uninterrupted run's steps and weights, and never moves S's tracker back."""
    from mindspeed_pack.convert import megatron_layout as layout

    save = tmp_path / "save"
    first, _ = run_posttrain(resume_argv(assets, save), model_flags=(), metrics=str(tmp_path / "a.jsonl"),
                             check=False, env={"MINDSPEED_PACK_FAULT": "step@5:kill"})
    assert first.returncode == -9 and layout.read_tracker(str(save)) == 4, first.stderr[-3000:]
    proc, _ = run_posttrain(resume_argv(assets, save), model_flags=(), metrics=str(tmp_path / "b.jsonl"))
    assert f"resumed from {save} at iteration 4" in proc.stderr, proc.stderr[-3000:]
    assert train_iterations(tmp_path / "b.jsonl") == [5, 6]
    merged = {**read_metrics(str(tmp_path / "a.jsonl")), **read_metrics(str(tmp_path / "b.jsonl"))}
    want, want_weights = uninterrupted[1]
    assert_same_steps(merged, want)
    weights = layout.load_file(layout.checkpoint_file(str(save), RESUME_ITERS, 0, 0, 1))["model"]
    assert weights.keys() == want_weights.keys() and all(torch.equal(weights[k], want_weights[k]) for k in weights)
    # the finished run again: nothing to train, nothing overwritten
    again, _ = run_posttrain(resume_argv(assets, save), model_flags=(), metrics=str(tmp_path / "c.jsonl"))
    assert f"resumed from {save} at iteration {RESUME_ITERS}" in again.stderr and "nothing to train" in again.stderr
    assert layout.read_tracker(str(save)) == RESUME_ITERS


def test_one_command_refuses_a_save_holding_another_runs_checkpoint(assets, tmp_path):
    """S holds a checkpoint of a run with another --lr: refused, naming the flag that differs and the way to
    start over; with that flag the run starts from the Hugging Face weights and replaces S's checkpoints."""
    from mindspeed_pack.convert import megatron_layout as layout

    save = tmp_path / "save"
    first, _ = run_posttrain(resume_argv(assets, save), model_flags=(), check=False,
                             env={"MINDSPEED_PACK_FAULT": "step@3:kill"})
    assert first.returncode == -9 and layout.read_tracker(str(save)) == 2, first.stderr[-3000:]
    proc, _ = run_posttrain(resume_argv(assets, save, "--lr", "2e-3"), model_flags=(), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    error = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(error) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"--save {save} holds iteration 2 of another run" in error[0] and "--lr 0.002 here, 0.001 there" in \
        error[0] and "--overwrite-output-dir" in error[0], error
    assert f"--load {save} to resume it with these (Megatron-LM's resume" in error[0]  # how to change a flag
    assert layout.read_tracker(str(save)) == 2
    proc, records = run_posttrain(resume_argv(assets, save, "--lr", "2e-3", "--overwrite-output-dir"),
                                  model_flags=(), metrics=str(tmp_path / "over.jsonl"))
    assert [r["iteration"] for r in records if r["split"] == "train"] == list(range(1, RESUME_ITERS + 1))
    assert "--overwrite-output-dir" in proc.stderr and layout.read_tracker(str(save)) == RESUME_ITERS
    # a torchrun restart of that job resumes what it saved, instead of starting over again
    proc, _ = run_posttrain(resume_argv(assets, save, "--lr", "2e-3", "--overwrite-output-dir"), model_flags=(),
                            env={"TORCHELASTIC_RESTART_COUNT": "1"})
    assert f"resumed from {save} at iteration {RESUME_ITERS} (torchrun restart 1)" in proc.stderr, proc.stderr[-3000:]
    assert layout.read_tracker(str(save)) == RESUME_ITERS


@pytest.mark.parametrize("extra,message", [
    (["--stage", "dpo"], "--stage dpo: '{data}' holds no preference pairs"),
    (["--stage", "simpo", "--ref-load", "REF"], "--stage simpo is reference-free"),
    (["--stage", "orpo", "--pref-ftx", "0.5"], "--pref-ftx 0.5 with --stage orpo"),
    # a beta of 0 trained nothing (grad norm 0), a negative one inverted the preference, nan failed at step 1
    (["--stage", "dpo", "--dpo-beta", "0"], "--dpo-beta 0.0 must be a finite number > 0"),
    (["--stage", "simpo", "--simpo-beta", "nan"], "--simpo-beta nan must be a finite number > 0"),
    (["--stage", "dpo", "--pref-ftx", "-1"], "--pref-ftx -1.0 must be a finite number >= 0"),
    # a reference given to a stage that uses none was ignored without a word
    (["--stage", "orm", "--ref-load", "REF"], "--ref-load with --stage orm: no reference model is used by this "
                                              "stage"),
    # the flags against what preprocessing recorded: the data setup's checks (a dry run passed them)
    (["--seq-length", "256"], "--seq-length 256 differs from the packs' length 128"),
])
def test_dry_run_refuses_what_the_stage_would_refuse_at_its_start(tmp_path, capsys, extra, message):
    """``--dry-run`` returned before the stage was made, so flags and data its start refuses passed it."""
    from tests.model_utils import TINY_FLAGS
    from tests.train_utils import write_copy_task

    data = write_copy_task(str(tmp_path / "sft"), num_packs=8)
    with pytest.raises(Exception, match=message.format(data=data).replace("(", r"\(")):
        posttrain.main([*TINY_FLAGS, "--data-path", data, "--seq-length", "128", "--global-batch-size", "2",
                        "--train-iters", "2", "--neat-pack", "--dry-run", *extra])


@pytest.mark.parametrize("kind", ["pairs", "kto"])
def test_sft_refuses_another_stages_data(tmp_path, kind):
    """Preference pairs or KTO couples given to --stage sft (the default) trained the rejected answers and the KL
    partners as answers, without a word: refused by the dry run and at the stage's start, naming the stages."""
    from tests.model_utils import TINY_FLAGS
    from tests.pair_utils import random_kto_rows, random_pairs, write_kto_dataset, write_pair_dataset

    if kind == "pairs":
        data, message = write_pair_dataset(str(tmp_path / "p"), random_pairs(8, seed=1)), "holds preference pairs"
    else:
        data, message = write_kto_dataset(str(tmp_path / "k"), *random_kto_rows(8, seed=1)), "holds KTO couples"
    flags = [*TINY_FLAGS, "--data-path", data, "--seq-length", "128", "--global-batch-size", "2", "--train-iters",
             "1", "--neat-pack"]
    for extra in (["--dry-run"], []):
        with pytest.raises(Exception, match=f"--stage sft: '{data}' {message}"):
            posttrain.main([*flags, *extra])


def test_another_stages_flags_are_said_not_dropped(tmp_path, caplog):
    """A DPO script moved to SimPO kept --dpo-beta 0.5 and trained with SimPO's default beta, without a word."""
    from tests.model_utils import TINY_FLAGS
    from tests.pair_utils import random_pairs, write_pair_dataset

    data = write_pair_dataset(str(tmp_path / "p"), random_pairs(8, seed=1))
    with caplog.at_level("WARNING"):
        posttrain.main([*TINY_FLAGS, "--data-path", data, "--seq-length", "128", "--global-batch-size", "2",
                        "--train-iters", "1", "--neat-pack", "--dry-run", "--stage", "simpo", "--dpo-beta", "0.5",
                        "--simpo-beta", "2.0"])
    assert "--stage simpo does not read --dpo-beta (--stage dpo): given, but without effect" in caplog.text
    assert "--simpo-beta" not in caplog.text


def test_raw_rows_for_a_stage_need_its_handler(assets):
    """A DPO run on raw rows without the pair handler failed on "column 'output' not found", naming no handler."""
    from mindspeed_pack.datasets.packed_dataset import DataError

    with pytest.raises(DataError, match="--stage dpo trains on preference pairs: raw --data-path files need "
                                        "--handler-name AlpacaStylePairwiseHandler or SharegptStylePairwiseHandler"):
        posttrain.main(["--load", assets["hf"], "--data-path", assets["data"], *TRAIN, "--train-iters", "1",
                        "--stage", "dpo", "--dry-run"])


def test_megatron_lms_text_flag_points_to_pretraining(assets):
    """posttrain.py --json-keys text (Megatron-LM's pretraining preprocessing flag) got argparse's bare
    'unrecognized arguments': it names the script that trains plain text."""
    from mindspeed_pack.datasets.packed_dataset import DataError

    with pytest.raises(DataError, match="^--json-keys text names pretraining documents' text field: train plain text "
                                        "with pretrain_gpt.py"):
        posttrain.main(["--load", assets["hf"], "--data-path", assets["data"], *TRAIN, "--train-iters", "1",
                        "--json-keys", "text", "--dry-run"])


def test_a_stage_value_out_of_range_is_one_error_line_before_raw_data_is_packed(assets, tmp_path, capsys):
    """The stage checks raise after the parser: posttrain.py printed a traceback (exit 1) instead of one error
    line (exit 2), and only after tokenising and packing the raw files."""
    from mindspeed_pack.training.cli import run_cli

    cache = tmp_path / "cache"
    argv = ["--load", assets["hf"], "--data-path", assets["data"], *TRAIN, "--train-iters", "1", "--stage", "dpo",
            "--handler-name", "SharegptStylePairwiseHandler", "--dpo-beta", "0", "--data-cache-path", str(cache)]
    with pytest.raises(SystemExit) as e:
        run_cli("posttrain.py", lambda: posttrain.main(argv))
    err = capsys.readouterr().err
    assert e.value.code == 2 and "posttrain.py: error: --dpo-beta 0.0 must be a finite number > 0" in err and "Traceback" not in err
    assert not cache.exists()


def test_the_same_json_mapping_spelled_two_ways_is_one_cache(assets):
    """--map-keys from a config file's mapping (passed on as json.dumps text) and the same JSON typed compactly on a
    command line named two caches: the same packs built twice."""
    prefixes = set()
    for spelling in ('{"messages": "conversations"}', '{"messages":"conversations"}'):
        args = parse_args([*one_command(assets), "--train-iters", "1", "--map-keys", spelling],
                          extra_args_provider=posttrain.posttrain_args)
        prefixes.add(raw_data.preprocess_namespace(args, [assets["data"]]).output_prefix)
    assert len(prefixes) == 1, prefixes


def test_an_omitted_map_keys_and_one_spelling_out_the_defaults_are_one_cache(assets):
    """--map-keys naming the handler's own defaults (as MindSpeed-LLM's scripts do) built the same packs again under
    another cache name than a run without the flag; another mapping still names its own cache."""
    def prefix(*flags):
        args = parse_args([*one_command(assets), "--train-iters", "1", *flags],
                          extra_args_provider=posttrain.posttrain_args)
        return raw_data.preprocess_namespace(args, [assets["data"]]).output_prefix

    omitted = prefix()
    assert prefix("--map-keys", '{"messages": "conversations", "role_tag": "from", "content_tag": "value"}') == omitted
    assert prefix("--map-keys", '{"messages": "conversations", "role": "from"}') == omitted  # the OpenAI-style alias
    assert prefix("--map-keys", '{"messages": "dialogue"}') != omitted


def test_map_keys_spelling_out_the_defaults_agrees_with_packs_preprocessed_without_it(tmp_path):
    """Training on packs preprocessed without --map-keys, given --map-keys naming the handler's defaults, was refused
    ("was preprocessed with --map-keys None"); another mapping still is."""
    prefix = str(tmp_path / "sg")
    with open(f"{prefix}_packed_meta.json", "w") as f:
        json.dump({"arguments": {"handler_name": "SharegptStyleInstructionHandler", "map_keys": None}}, f)

    def check(mapping):
        args = parse_args(["--data-path", prefix, *TINY_MODEL, "--seq-length", "64", "--train-iters", "1", "--handler-name",
                           "SharegptStyleInstructionHandler", "--map-keys", mapping],
                          extra_args_provider=posttrain.posttrain_args)
        raw_data.check_packed_flags(args)

    check('{"messages": "conversations", "role": "from"}')
    with pytest.raises(DataError, match="--map-keys"):
        check('{"messages": "dialogue"}')

"""``--config run.yaml``: the same flags from a file, one parser, one resolved configuration (issue 34).

A config file and the equivalent command line resolve to the same arguments and train the same
losses; the command line overrides the file; bad keys and values stop with one ``error:`` line
naming the file, line, key and flag; the resolved configuration written beside the run repeats it;
a Hugging Face ``--load`` under ``--stage sft`` gets the fine-tuning defaults, each one shown.
"""
import json
import os
import re
import shutil

import pytest
import torch
import yaml

import posttrain
import pretrain_gpt
from mindspeed_pack.config import resolved_config
from mindspeed_pack.config.arguments import parse_args
from tests.data_utils import write_packed_instruction_dataset
from tests.model_utils import TINY_FLAGS
from tests.train_utils import run_posttrain, train_losses

RUN = ["--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3",
       "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "1", "--neat-pack", "--no-shuffle"]


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    return write_packed_instruction_dataset(str(tmp_path_factory.mktemp("cfg") / "copy"), num_packs=16, meta=True)


def _yaml_of(argv):
    """The config file that says what ``argv`` says (both key spellings, lists, switches, strings)."""
    out, i = {}, 0
    while i < len(argv):
        key = argv[i][2:]
        values = []
        while i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            values.append(argv[i + 1])
            i += 1
        i += 1
        key = key.replace("-", "_") if len(out) % 2 else key  # every other key with underscores
        out[key] = True if not values else (values if key.replace("_", "-") == "data-path" else values[0])
    return yaml.safe_dump(out, sort_keys=False)


def _parse(argv, provider=posttrain.posttrain_args):
    return parse_args(argv, extra_args_provider=provider)


def _comparable(args):
    return {k: v for k, v in vars(args).items() if k not in ("config", "flag_sources")}


def test_config_file_and_command_line_resolve_to_the_same_arguments(tmp_path, packs):
    argv = [*TINY_FLAGS, *RUN, "--data-path", packs]
    config = tmp_path / "run.yaml"
    config.write_text(_yaml_of(argv))
    assert "seq-length" in config.read_text() and "micro_batch_size" in config.read_text()
    from_cli, from_file = _parse(argv), _parse(["--config", str(config)])
    assert _comparable(from_file) == _comparable(from_cli)
    assert from_file.flag_sources == from_cli.flag_sources  # the file's flags count as given
    assert from_file.config == str(config) and from_cli.config is None


def test_command_line_overrides_the_file(tmp_path, packs):
    config = tmp_path / "run.yaml"
    config.write_text(f"seq-length: 64\nlr: 2e-3\ndata-path: [{tmp_path}/other]\nneat-pack: true\n")
    args = _parse(["--config", str(config), *TINY_FLAGS, "--train-iters", "1", "--seq-length", "128",
                   "--data-path", packs])
    assert (args.seq_length, args.lr, args.data_path, args.neat_pack) == (128, 2e-3, [packs], True)


@pytest.mark.parametrize("text, message", [
    ("seq-lenght: 128\n", r"line 1: unknown key 'seq-lenght', .*did you mean seq-length \(--seq-length\)\?"),
    ("lr: 1e-3\nnum_layer: 2\n", r"line 2: unknown key 'num_layer', .*did you mean num-layers \(--num-layers\)\?"),
    ("seq-length: abc\n", r"line 1: seq-length \(--seq-length\): expected an integer, got 'abc'"),
    ("neat-pack: 3\n", r"line 1: neat-pack \(--neat-pack\): a switch takes true or false, got 3"),
    ("lr: [1, 2]\n", r"line 1: lr \(--lr\): expected one value \(a number\), got a list"),
    ("attention-backend: tee\n", r"attention-backend \(--attention-backend\): expected one of auto, te, flash, local"),
    ("seq-length: 128\nseq_length: 64\n", r"line 2: seq_length is given twice \(first on line 1\)"),
    ("- seq-length\n", r"line 1: the file must be a mapping of flag names to values"),
    ("lr: [1e-3\n", r"not valid YAML"),
    # an alias bomb inside a known key's value (9^9 strings once expanded): refused before anything is expanded
    ("data-path:\n- &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"- &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefg", "bcdefgh")), r"line 3: YAML aliases \(\*a\) are not allowed"),
    ("map-keys: &m {prompt: q}\nchat-template-kwargs: *m\n", r"line 2: YAML aliases \(\*m\) are not allowed"),
])
def test_a_bad_key_or_value_is_one_error_line_naming_file_line_and_flag(tmp_path, packs, capsys, text, message):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(SystemExit) as exit_:
        _parse(["--config", str(config), *TINY_FLAGS, *RUN, "--data-path", packs])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.count("\n") == 1 and "error: " in err and str(config) in err, err  # one line, no usage text
    assert re.search(message, err), err


def test_a_missing_config_file_is_one_error_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _parse(["--config", str(tmp_path / "nope.yaml")])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--config" in err and "nope.yaml: no such file" in err


def test_pretrain_and_preprocess_take_a_config_file_too(tmp_path, run_preprocess, toy_alpaca_jsonl, read_indexed,
                                                        capsys):
    config = tmp_path / "pretrain.yaml"
    config.write_text("seq-length: 64\ntrain-iters: 2\neod-id: 7\ndata-path: [0.3, a_text_document, 0.7, b]\n"
                      "reset-attention-mask: true\n")
    args = _parse(["--config", str(config), *TINY_FLAGS], provider=pretrain_gpt.pretrain_args)
    assert (args.seq_length, args.eod_id, args.data_path, args.reset_attention_mask) == \
        (64, 7, ["0.3", "a_text_document", "0.7", "b"], True)
    # preprocess_data.py: the file's outputs are the command line's, byte for byte
    flags = dict(prompt_type="qwen", seq_length=128, pack=True, neat_pack=True)
    code, _, err = run_preprocess(input=toy_alpaca_jsonl, output_prefix=tmp_path / "cli", **flags)
    assert code == 0, err
    (tmp_path / "data.yaml").write_text(yaml.safe_dump({"input": [str(toy_alpaca_jsonl)], "output-prefix":
                                                        str(tmp_path / "file"), "prompt_type": "qwen",
                                                        "seq-length": 128, "pack": True, "neat-pack": True}))
    code, _, err = run_preprocess(config=tmp_path / "data.yaml")
    assert code == 0, err
    for key in ("input_ids", "attention_mask", "labels"):
        cli, file = (read_indexed(tmp_path / f"{p}_packed_{key}_document") for p in ("cli", "file"))
        assert [x.tolist() for x in cli] == [x.tolist() for x in file]
    (tmp_path / "typo.yaml").write_text(f"input: {toy_alpaca_jsonl}\noutput-prefix: x\nhandler: a\n")
    from mindspeed_pack.datasets.preprocess import main

    with pytest.raises(SystemExit) as exit_:
        main(["--config", str(tmp_path / "typo.yaml")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "error: " in err, err
    assert re.search(r"typo.yaml: line 3: unknown key 'handler'.*--handler-name", err), err


def test_the_resolved_configuration_repeats_the_run(tmp_path, packs):
    """Written beside the checkpoints and the metrics; ``--config`` of it resolves to the same arguments."""
    argv = [*TINY_FLAGS, *RUN, "--data-path", packs, "--save", str(tmp_path / "ckpt"),
            "--metrics-file", str(tmp_path / "logs" / "run.jsonl"), "--group-query-attention"]
    args = _parse(argv)
    written = resolved_config.write(args, "posttrain.py")
    assert written == [str(tmp_path / "ckpt" / "run_config.yaml"), str(tmp_path / "logs" / "run.config.yaml")]
    text = open(written[0]).read()
    assert text == open(written[1]).read()
    # every flag, by origin: what was given, derived by validation, and Megatron-LM's defaults
    assert "\n# --- given" in text and "\nseq-length: 128\n" in text
    assert "\n# --- derived from the flags above by validation (on record" in text and "\nkv-channels: 16\n" in text
    assert "\n# --- defaults (on record" in text and "\nweight-decay: 0.01\n" in text
    again = _parse(["--config", written[0]])
    assert _comparable(again) == _comparable(args)


def test_training_again_from_the_resolved_configuration_repeats_a_non_default_handlers_run(tmp_path, packs):
    """A run on packs of a non-default handler (ShareGPT here), trained again from its run_config.yaml with a new
    --save: the same losses bit for bit (the file's defaults, read back as given, used to be checked against the
    sidecar: "--handler-name AlpacaStyleInstructionHandler, but ... was preprocessed with Sharegpt...")."""
    import shutil

    sharegpt = str(tmp_path / "sg")
    for suffix in ("_packed_input_ids_document", "_packed_attention_mask_document", "_packed_labels_document"):
        for ext in (".bin", ".idx"):
            shutil.copy(packs + suffix + ext, sharegpt + suffix + ext)
    meta = json.load(open(packs + "_packed_meta.json"))
    meta.setdefault("arguments", {})["handler_name"] = "SharegptStyleInstructionHandler"
    json.dump(meta, open(sharegpt + "_packed_meta.json", "w"))
    first = str(tmp_path / "first")
    _, losses = run_posttrain([*RUN, "--data-path", sharegpt, "--save", first], metrics=str(tmp_path / "a.jsonl"))
    _, again = run_posttrain(["--config", os.path.join(first, "run_config.yaml"), "--save", str(tmp_path / "again")],
                             metrics=str(tmp_path / "b.jsonl"), model_flags=[])
    assert [r["lm loss"] for r in again] == [r["lm loss"] for r in losses] and len(losses) == 3


def _tiny_hf(path):
    import transformers

    config = transformers.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                      max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def test_finetuning_defaults_from_a_hf_model_are_applied_shown_and_overridable(tmp_path, packs):
    hf = _tiny_hf(tmp_path / "hf")
    run = ["--seq-length", "128", "--train-iters", "2", "--neat-pack", "--data-path", packs, "--load", hf,
           "--lr", "2e-5", "--save", str(tmp_path / "ckpt")]
    args = _parse(run)
    assert (args.lr_warmup_fraction, args.lr_decay_style, args.min_lr) == (0.03, "cosine", 2e-6)
    assert args.save_hf == str(tmp_path / "ckpt" / "hf")
    assert args.bf16 == (torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    text = resolved_config.text(args, "posttrain.py")
    section = text.split("# --- fine-tuning defaults")[1].split("# ---")[0]
    for line in ("lr-warmup-fraction: 0.03", "lr-decay-style: cosine", "min-lr: 2.0e-06", f"save-hf: {args.save_hf}"):
        assert f"\n{line}\n" in section, section
    assert "\nnum-layers: 2\n" in text.split("# --- from the Hugging Face --load directory")[1].split("# ---")[0]
    assert _comparable(_parse(["--config", _written(tmp_path, text)])) == _comparable(args)
    # a flag given wins over its default; other stages get none of them
    given = _parse(run + ["--lr-warmup-iters", "1", "--lr-decay-style", "linear", "--min-lr", "0"])
    assert (given.lr_warmup_fraction, given.lr_warmup_iters, given.lr_decay_style, given.min_lr) == \
        (None, 1, "linear", 0.0)
    for stage in ("dpo", "simpo", "orpo"):
        other = _parse(run + ["--stage", stage])
        assert (other.lr_warmup_fraction, other.lr_decay_style, other.save_hf) == (None, "linear", None), stage


def test_a_flag_given_by_its_other_name_resolves_to_the_flag(tmp_path, packs):
    """``dpo-ftx`` (the older name of --pref-ftx) in a file: the same value; the resolved configuration
    writes MindSpeed-LLM's name, and repeats the run."""
    config = tmp_path / "run.yaml"
    config.write_text("stage: simpo\ndpo-ftx: 0.2\n")
    args = _parse(["--config", str(config), *TINY_FLAGS, *RUN, "--data-path", packs])
    assert args.pref_ftx == 0.2 and args.stage == "simpo"
    text = resolved_config.text(args, "posttrain.py")
    assert "\npref-ftx: 0.2\n" in text and "dpo-ftx" not in text
    assert _comparable(_parse(["--config", _written(tmp_path, text)])) == _comparable(args)


def test_a_resume_keeps_the_finetuning_defaults_its_run_started_with(tmp_path, packs):
    """The run from the HF model wrote them to SAVE/run_config.yaml; ``--load SAVE`` (a Megatron checkpoint)
    takes them again, so the schedule matches the checkpoint's; flags given still win."""
    hf, save = _tiny_hf(tmp_path / "hf"), tmp_path / "ckpt"
    common = ["--seq-length", "128", "--train-iters", "4", "--neat-pack", "--data-path", packs, "--lr", "2e-5",
              "--save", str(save)]
    first = _parse(common + ["--load", hf])
    resolved_config.write(first, "posttrain.py")
    resumed = _parse([*TINY_FLAGS, *common, "--load", str(save)])
    assert resumed.load_format == "mg"
    for dest in ("lr_warmup_fraction", "lr_decay_style", "min_lr", "save_hf", "bf16"):
        assert getattr(resumed, dest) == getattr(first, dest), dest
    assert resumed.flag_sources["min_lr"][1] == "finetune"
    assert _parse([*TINY_FLAGS, *common, "--load", str(save), "--min-lr", "0"]).min_lr == 0.0
    # the export goes to this run's --save (a copy of the checkpoint exports into the copy, not the original); an
    # export there already is written again or not once the iteration is known (trainer.run)
    copy = tmp_path / "copy"
    shutil.copytree(save, copy)
    moved = _parse([*TINY_FLAGS, *common[:-1], str(copy), "--load", str(copy)])
    assert moved.save_hf == str(copy / "hf") and moved.flag_sources["save_hf"][1] == "finetune"
    # the tokenizer its run took from the HF directory, while that holds one (a resume on raw files needed it)
    from tests.model_utils import save_word_tokenizer

    save_word_tokenizer(hf, ["<pad>", "</s>", "a", "b"])
    first = _parse(common + ["--load", hf])
    resolved_config.write(first, "posttrain.py")
    assert first.tokenizer_name_or_path == hf
    assert _parse([*TINY_FLAGS, *common, "--load", str(save)]).tokenizer_name_or_path == hf
    # --finetune from it is a new run: defaults of its own (its --lr's min-lr: the recorded 2e-6 against --lr 1e-6
    # failed megatron's max_lr >= min_lr with a bare AssertionError; its export into its own --save)
    new = _parse([*TINY_FLAGS, *common[:-1], str(tmp_path / "new"), "--load", str(save), "--finetune", "--lr", "1e-6"])
    assert (new.min_lr, new.save_hf, new.lr_decay_style) == (1e-7, str(tmp_path / "new" / "hf"), "cosine")


def _written(tmp_path, text):
    path = tmp_path / "resolved.yaml"
    path.write_text(text)
    return str(path)


def test_config_file_trains_the_losses_of_the_command_line(tmp_path, packs):
    """Two runs, one from flags and one from the file saying the same; the override's run differs."""
    argv = [*RUN, "--data-path", packs]
    cli_proc, cli = run_posttrain(argv, metrics=str(tmp_path / "cli.jsonl"))
    config = tmp_path / "run.yaml"
    config.write_text(_yaml_of([*TINY_FLAGS, *argv]))
    _, from_file = run_posttrain(["--config", str(config)], model_flags=(), metrics=str(tmp_path / "file.jsonl"))
    assert train_losses(cli) == train_losses(from_file) and len(train_losses(cli)) == 3
    # both runs wrote the same resolved configuration (apart from when they started and the metrics file)
    texts = [open(tmp_path / f"{name}.config.yaml").read().split("\n", 1)[1].replace(name + ".jsonl", "M")
             for name in ("cli", "file")]
    assert texts[0] == texts[1]
    assert "resolved configuration" in cli_proc.stderr
    records = [json.loads(line) for line in open(tmp_path / "cli.jsonl")]
    assert records[0]["split"] == "setup" and os.path.exists(tmp_path / "cli.config.yaml")


def test_a_command_line_alternative_overrides_the_files_flag(tmp_path):
    """A config with train-epochs and --train-iters on the command line: "both given" before, though the command
    line overrides the file (the example configs of every preference stage set train-epochs)."""
    from mindspeed_pack.config import yaml_file
    from mindspeed_pack.config.arguments import build_parser

    parser = build_parser()
    posttrain.posttrain_args(parser)
    config = tmp_path / "run.yaml"
    config.write_text("train-epochs: 2\nlr-warmup-fraction: 0.1\nlr: 0.5\n")
    args, _ = yaml_file.parse(parser, ["--config", str(config), "--train-iters", "3"])
    assert (args.train_epochs, args.train_iters, args.lr_warmup_fraction, args.lr) == (None, 3, 0.1, 0.5)
    args, _ = yaml_file.parse(parser, ["--config", str(config), "--lr-warmup-iters", "4"])
    assert (args.train_epochs, args.lr_warmup_fraction, args.lr_warmup_iters) == (2, None, 4)



def test_a_json_flag_from_the_file_is_the_same_value_as_on_the_command_line(tmp_path, packs):
    """A config file's mapping reaches the parser as json.dumps' text ('{"messages": "msgs"}'), the command line's as
    typed ('{"messages":"msgs"}'): nodes started one way and the other were refused at the rendezvous as started with
    different flags, and a resume of the run by the other form was refused as another run's --save."""
    argv = [*TINY_FLAGS, *RUN, "--data-path", packs, "--save", str(tmp_path / "save")]
    config = tmp_path / "run.yaml"
    config.write_text(_yaml_of(argv) + "map-keys: {messages: msgs, system: sys}\n")
    from_cli = _parse([*argv, "--map-keys", '{"system":"sys","messages":"msgs"}'])
    from_file = _parse(["--config", str(config)])
    assert from_file.map_keys != from_cli.map_keys  # the same JSON, other text
    assert resolved_config.flag_values(from_file) == resolved_config.flag_values(from_cli)
    resolved_config.write(from_cli, "posttrain.py")
    assert resolved_config.run_differences(from_file, str(tmp_path / "save")) == []

"""Every flag of every example script parses with the project's real command-line parsers.

A flag renamed in a parser, or misspelled in a script, fails here instead of on a cluster.

Protocol (every ``examples/**/*.sh`` follows it): run with ``PRINT_ARGS=1``, a script runs
nothing and prints, for each Python command it would run, a header line
``#@ <entry script> [world_size=N]`` followed by that command's arguments, one per line.
Each command is then checked with the parser of its entry script:

- ``posttrain.py`` / ``pretrain_gpt.py``: :func:`mindspeed_pack.config.arguments.parse_args`
  (with the script's own flags) at the script's world size, so TP/PP/batch-size divisibility and
  the other cross-flag rules are checked for real;
- ``preprocess_data.py``: ``build_parser`` + ``validate_args`` of ``mindspeed_pack.datasets.preprocess``;
- ``convert_ckpt.py``: ``build_parser`` of ``mindspeed_pack.convert.convert``.

Beyond what the parsers accept, every ``--flag`` must be spelled exactly as the parser defines
it: argparse would otherwise take ``--seq-len`` as an abbreviation of a renamed ``--seq-length-x``.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p for p in (REPO / "examples").rglob("*.sh"))
QWEN25 = REPO / "examples" / "qwen25"
QWEN3 = REPO / "examples" / "qwen3"
QWEN3_MOE = REPO / "examples" / "qwen3_moe"
LLAMA31 = REPO / "examples" / "llama31"
HEADER = "#@ "


@dataclass
class Command:
    entry: str
    argv: List[str]
    world_size: int = 1


class FlagError(AssertionError):
    """An example's arguments do not parse."""


def _clean_env(**extra: str) -> Dict[str, str]:
    """The scripts' defaults, not whatever the CI environment happens to export (NNODES, DATA_PATH, ...)."""
    # PYTHONPATH stays: it is where packages are found (megatron-core lies on it on the GPU machines), not a default
    env = {k: os.environ[k] for k in ("HOME", "LANG", "TMPDIR", "PYTHONPATH") if k in os.environ}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin")
    env.update(extra)
    return env


def extract_commands(script: Path, **env: str) -> List[Command]:
    """The Python commands ``script`` would run, from its ``PRINT_ARGS=1`` output."""
    text = script.read_text()
    if "PRINT_ARGS" not in text:  # never run a script that would start real work
        raise FlagError(f"{script}: does not support PRINT_ARGS=1 (see the protocol in {__file__})")
    proc = subprocess.run(["bash", str(script)], env=_clean_env(PRINT_ARGS="1", **env), cwd=script.parent,
                          capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise FlagError(f"{script}: PRINT_ARGS=1 exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    commands: List[Command] = []
    for lineno, line in enumerate(proc.stdout.splitlines(), 1):
        if line.startswith(HEADER):
            entry, *fields = line[len(HEADER):].split()
            meta = dict(f.split("=", 1) for f in fields)
            commands.append(Command(entry, [], int(meta.get("world_size", 1))))
        elif commands:
            commands[-1].argv.append(line)
        else:
            raise FlagError(f"{script}: PRINT_ARGS output line {lineno} comes before any '{HEADER}<entry>' header: "
                            f"{line!r}")
    if not commands:
        raise FlagError(f"{script}: PRINT_ARGS=1 printed no '{HEADER}<entry>' header")
    return commands


# ---------------------------------------------------------------------------- parsers
def _load_entry_module(entry: str):
    spec = importlib.util.spec_from_file_location(f"_example_entry_{Path(entry).stem}", REPO / entry)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # entry scripts only run main() under __main__
    return module


SCRIPT_FLAGS = {"posttrain.py": "posttrain_args", "pretrain_gpt.py": "pretrain_args"}  # each script's own flags


def _training_parser(entry: str) -> tuple[argparse.ArgumentParser, Optional[Callable]]:
    from mindspeed_pack.config.arguments import build_parser

    provider = getattr(_load_entry_module(entry), SCRIPT_FLAGS[entry]) if entry in SCRIPT_FLAGS else None
    if entry.startswith("examples/rl/"):  # in-process RL sessions: posttrain.py's flags and the script's own
        from mindspeed_pack.training.rl_session import session_arg_provider

        provider = session_arg_provider(_load_entry_module(entry).script_args)
    parser = build_parser()
    if provider is not None:
        provider(parser)
    return parser, provider


def _check_training(cmd: Command) -> argparse.Namespace:
    from mindspeed_pack.config.arguments import parse_args

    parser, provider = _training_parser(cmd.entry)
    _check_spelling(cmd, parser)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. "no CUDA device: --use-flash-attn ... skipped" on CPU machines
        try:
            return parse_args(cmd.argv, world_size=cmd.world_size, extra_args_provider=provider)
        except SystemExit:
            raise FlagError(f"{cmd.entry} (world size {cmd.world_size}) rejects the arguments:\n"
                            f"{err.getvalue()[-2000:]}") from None


def _check_preprocess(cmd: Command) -> argparse.Namespace:
    from mindspeed_pack.data.errors import PreprocessError
    from mindspeed_pack.datasets.preprocess import build_parser, validate_args

    parser = build_parser()
    _check_spelling(cmd, parser)
    args = _parse(parser, cmd)
    try:
        validate_args(args)
    except PreprocessError as exc:
        raise FlagError(f"{cmd.entry} rejects the arguments: {exc}") from None
    return args


def _check_convert(cmd: Command) -> argparse.Namespace:
    from mindspeed_pack.convert.convert import build_parser

    parser = build_parser()
    _check_spelling(cmd, parser)
    args = _parse(parser, cmd)
    if args.load_model_type == "hf" and args.save_model_type == "hf":
        raise FlagError(f"{cmd.entry}: hf -> hf converts nothing")
    return args


PARSERS: Dict[str, Callable[[Command], argparse.Namespace]] = {
    "posttrain.py": _check_training,
    "pretrain_gpt.py": _check_training,
    "preprocess_data.py": _check_preprocess,
    "convert_ckpt.py": _check_convert,
    "examples/rl/replay_rollouts.py": _check_training,
    "examples/rl/reward_loop.py": _check_training,
}


def _parse(parser: argparse.ArgumentParser, cmd: Command) -> argparse.Namespace:
    from mindspeed_pack.config import yaml_file

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return yaml_file.parse(parser, cmd.argv)[0]  # with a --config file's flags when given
        except SystemExit:
            raise FlagError(f"{cmd.entry} rejects the arguments:\n{err.getvalue()[-2000:]}") from None


def _check_spelling(cmd: Command, parser: argparse.ArgumentParser) -> None:
    """Every ``--flag`` is one the parser defines, letter for letter (no argparse abbreviations)."""
    known = set(parser._option_string_actions)
    unknown = [a for a in cmd.argv if a.startswith("--") and a.split("=", 1)[0] not in known]
    if unknown:
        raise FlagError(f"{cmd.entry}: unknown or abbreviated flags {unknown}")


def check_command(cmd: Command) -> argparse.Namespace:
    if cmd.entry not in PARSERS:
        raise FlagError(f"no parser known for entry script {cmd.entry!r}: add it to PARSERS in {__file__}")
    return PARSERS[cmd.entry](cmd)


def check_script(script: Path, **env: str) -> List[argparse.Namespace]:
    return [check_command(cmd) for cmd in extract_commands(script, **env)]


# ---------------------------------------------------------------------------- tests
def test_examples_exist():
    names = {p.name for p in EXAMPLES}
    assert {"tune_qwen25_7b_4k_full_pack.sh", "data_convert_qwen25_instruction_pack.sh",
            "ckpt_convert_qwen25_hf2mcore.sh", "ckpt_convert_qwen25_mcore2hf.sh"} <= names
    assert {"tune_qwen3_8b_4k_full_pack.sh", "data_convert_qwen3_instruction_pack.sh",
            "ckpt_convert_qwen3_hf2mcore.sh", "ckpt_convert_qwen3_mcore2hf.sh"} <= names
    assert {"tune_llama31_8b_4k_full_pack.sh", "data_convert_llama31_instruction_pack.sh",
            "ckpt_convert_llama31_hf2mcore.sh", "ckpt_convert_llama31_mcore2hf.sh"} <= names


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: str(p.relative_to(REPO / "examples")))
def test_example_flags_parse(script):
    assert check_script(script)


def _qwen25(name: str, **env: str) -> argparse.Namespace:
    (args,) = check_script(QWEN25 / name, **env)
    return args


def test_qwen25_training_is_the_published_recipe():
    a = _qwen25("tune_qwen25_7b_4k_full_pack.sh")
    assert (a.num_layers, a.hidden_size, a.ffn_hidden_size, a.num_attention_heads, a.num_query_groups) == \
        (28, 3584, 18944, 28, 4)
    assert a.add_qkv_bias and a.disable_bias_linear and a.swiglu and a.untie_embeddings_and_output_weights
    assert (a.normalization, a.norm_epsilon, a.rotary_base, a.padded_vocab_size, a.seq_length) == \
        ("RMSNorm", 1e-6, 1e6, 152064, 4096)
    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.data_parallel_size) == (4, 1, 2)
    assert (a.micro_batch_size, a.global_batch_size, a.num_micro_batches) == (1, 8, 4)
    # the warmup stays a fraction (of the decay samples, as Megatron-LM counts it): no whole iterations derived
    assert (a.lr, a.min_lr, a.lr_decay_style, a.lr_warmup_fraction, a.lr_warmup_iters) == \
        (7.75e-7, 7.75e-8, "cosine", 0.01, 0)
    assert (a.weight_decay, a.clip_grad, a.adam_beta1, a.adam_beta2, a.train_iters) == (0.1, 1.0, 0.9, 0.95, 2000)
    assert a.neat_pack and a.reset_position_ids and a.isolate_segments and a.is_instruction_dataset
    assert a.finetune and a.prompt_type == "qwen" and not a.no_shuffle
    # the precision and parallel flags survive validation on any machine (they run on the CPU too)
    assert a.bf16 and not a.fp16 and a.sequence_parallel and a.use_distributed_optimizer


def test_qwen25_scripts_agree_with_each_other():
    data = _qwen25("data_convert_qwen25_instruction_pack.sh")
    hf2mg = _qwen25("ckpt_convert_qwen25_hf2mcore.sh")
    tune = _qwen25("tune_qwen25_7b_4k_full_pack.sh")
    mg2hf = _qwen25("ckpt_convert_qwen25_mcore2hf.sh")
    # the packs the data script writes are the training samples
    assert data.pack and data.neat_pack and tune.neat_pack
    assert (data.output_prefix, data.seq_length, data.prompt_type) == \
        (tune.data_path[0], tune.seq_length, tune.prompt_type)
    # training loads the converted weights at the sharding they were written with
    assert (hf2mg.load_model_type, hf2mg.save_model_type, hf2mg.save_dir) == ("hf", "mg", tune.load)
    assert (hf2mg.target_tensor_parallel_size, hf2mg.target_pipeline_parallel_size) == \
        (tune.tensor_model_parallel_size, tune.pipeline_model_parallel_size)
    # and the trained weights go back to HF with the tokenizer everyone used
    assert (mg2hf.load_model_type, mg2hf.save_model_type, mg2hf.load_dir) == ("mg", "hf", tune.save)
    assert data.tokenizer_name_or_path == tune.tokenizer_name_or_path == mg2hf.tokenizer_dir == hf2mg.load_dir


def test_qwen25_reward_model_scripts_agree_with_their_data_and_the_sft_model():
    pairs, orm = _qwen25("data_convert_qwen25_pairwise_pack.sh"), _qwen25("tune_qwen25_7b_4k_orm_pack.sh")
    steps, prm = _qwen25("data_convert_qwen25_process_reward_pack.sh"), _qwen25("tune_qwen25_7b_4k_prm_pack.sh")
    sft = _qwen25("tune_qwen25_7b_4k_full_pack.sh")
    assert pairs.handler_name == "AlpacaStylePairwiseHandler" and pairs.pack and pairs.neat_pack and orm.neat_pack
    assert (pairs.output_prefix, pairs.seq_length, pairs.prompt_type) == (orm.data_path[0], orm.seq_length,
                                                                          orm.prompt_type)
    assert (orm.stage, orm.reward_head, prm.stage, prm.reward_head) == ("orm", True, "prm", False)
    assert steps.handler_name == "AlpacaStyleProcessRewardHandler" and steps.pack and steps.neat_pack
    assert (steps.placeholder_token, steps.reward_tokens, steps.prompt_type) == (" ки", ["+", "-"], None)
    assert (steps.output_prefix, steps.seq_length) == (prm.data_path[0], prm.seq_length)
    # both start from the SFT model at its sharding, with the tokenizer the data used
    for tune in (orm, prm):
        assert tune.finetune and tune.load == sft.save
        assert (tune.tensor_model_parallel_size, tune.pipeline_model_parallel_size) == \
            (sft.tensor_model_parallel_size, sft.pipeline_model_parallel_size)
    assert pairs.tokenizer_name_or_path == steps.tokenizer_name_or_path == orm.tokenizer_name_or_path == \
        prm.tokenizer_name_or_path == sft.tokenizer_name_or_path


# Qwen3-8B's config.json as published (transformers 4.51 layout)
QWEN3_8B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 40960,
    "max_window_layers": 36, "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


def test_qwen3_training_flags_are_the_models_config():
    """The tune script's model flags are what the converter derives from Qwen3-8B's config.json."""
    from mindspeed_pack.convert.model_specs import args_from_hf_config

    (tune,) = check_script(QWEN3 / "tune_qwen3_8b_4k_full_pack.sh")
    expected = args_from_hf_config(QWEN3_8B_CONFIG, tp=tune.tensor_model_parallel_size, padded_vocab_size=151936)
    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                 "kv_channels", "qk_layernorm", "add_qkv_bias", "disable_bias_linear", "swiglu", "normalization",
                 "norm_epsilon", "rotary_base", "untie_embeddings_and_output_weights", "padded_vocab_size",
                 "max_position_embeddings", "use_rope_scaling"):
        assert getattr(tune, name) == getattr(expected, name), name
    assert (tune.num_layers, tune.hidden_size, tune.ffn_hidden_size, tune.num_attention_heads,
            tune.num_query_groups, tune.kv_channels) == (36, 4096, 12288, 32, 8, 128)
    assert tune.qk_layernorm and not tune.add_qkv_bias and tune.seq_length == 4096 and tune.neat_pack


# Qwen3-30B-A3B's config.json as published (transformers 4.51 layout)
QWEN3_30B_A3B_CONFIG = {
    **{k: v for k, v in QWEN3_8B_CONFIG.items() if k not in ("max_window_layers",)},
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "max_window_layers": 48, "decoder_sparse_step": 1, "moe_intermediate_size": 768, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "output_router_logits": False, "router_aux_loss_coef": 0.001,
    "mlp_only_layers": [],
}


def test_qwen3_moe_training_flags_are_the_models_config():
    """The MoE tune script's model and expert flags are what the converter derives from Qwen3-30B-A3B's
    config.json, and the conversion script shards for the training's TP x PP x EP."""
    from mindspeed_pack.convert.model_specs import args_from_hf_config

    (tune,) = check_script(QWEN3_MOE / "tune_qwen3_30b_a3b_4k_full_pack.sh")
    (hf2mg,) = check_script(QWEN3_MOE / "ckpt_convert_qwen3_moe_hf2mcore.sh")
    expected = args_from_hf_config(QWEN3_30B_A3B_CONFIG, tp=tune.tensor_model_parallel_size,
                                   padded_vocab_size=151936)
    for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                 "qk_layernorm", "add_qkv_bias", "norm_epsilon", "rotary_base", "untie_embeddings_and_output_weights",
                 "padded_vocab_size", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
                 "moe_router_pre_softmax"):
        assert getattr(tune, name) == getattr(expected, name), name
    assert expected.moe_layer_freq == [1] * 48 and tune.moe_layer_freq == 1
    assert (tune.num_experts, tune.moe_router_topk, tune.sequence_parallel) == (128, 8, True)
    assert hf2mg.model_type_hf == "qwen3_moe" and (hf2mg.save_dir, hf2mg.target_tensor_parallel_size,
                                                   hf2mg.target_pipeline_parallel_size,
                                                   hf2mg.target_expert_parallel_size) == \
        (tune.load, tune.tensor_model_parallel_size, tune.pipeline_model_parallel_size,
         tune.expert_model_parallel_size)
    assert tune.expert_model_parallel_size == 2


# Llama-3.1-8B-Instruct's config.json as published (transformers 4.43 layout)
LLAMA31_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}
LLAMA31_FAMILY_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                       "kv_channels", "qk_layernorm", "add_qkv_bias", "disable_bias_linear", "swiglu", "normalization",
                       "norm_epsilon", "rotary_base", "use_rope_scaling", "rope_scaling_factor", "low_freq_factor",
                       "high_freq_factor", "original_max_position_embeddings", "untie_embeddings_and_output_weights",
                       "padded_vocab_size", "max_position_embeddings")


def test_llama31_training_flags_are_the_models_config_at_mindspeed_llms_layout():
    """The tune script's model flags are what the converter derives from Llama-3.1-8B-Instruct's config.json
    (llama3 RoPE scaling 8 / 1 / 4 / 8192, theta 500000, eps 1e-5, untied, vocabulary 128256), at the layout of
    MindSpeed-LLM's tune_llama31_8b_4k_full_pack_ptd.sh (TP 8, PP 1, MBS 1, GBS 8)."""
    from mindspeed_pack.convert.model_specs import args_from_hf_config

    (tune,) = check_script(LLAMA31 / "tune_llama31_8b_4k_full_pack.sh")
    expected = args_from_hf_config(LLAMA31_8B_CONFIG, tp=tune.tensor_model_parallel_size, padded_vocab_size=128256)
    for name in LLAMA31_FAMILY_ARGS:
        assert getattr(tune, name, None) == getattr(expected, name), name
    assert (tune.num_layers, tune.hidden_size, tune.ffn_hidden_size, tune.num_attention_heads, tune.num_query_groups,
            tune.rotary_base, tune.norm_epsilon, tune.padded_vocab_size) == \
        (32, 4096, 14336, 32, 8, 500000, 1e-5, 128256)
    assert (tune.rope_scaling_factor, tune.low_freq_factor, tune.high_freq_factor,
            tune.original_max_position_embeddings) == (8.0, 1.0, 4.0, 8192) and tune.use_rope_scaling
    assert tune.untie_embeddings_and_output_weights and not tune.add_qkv_bias and not tune.qk_layernorm
    assert (tune.tensor_model_parallel_size, tune.pipeline_model_parallel_size, tune.micro_batch_size,
            tune.global_batch_size, tune.seq_length) == (8, 1, 1, 8, 4096)
    assert tune.neat_pack and tune.prompt_type == "llama3" and tune.sequence_parallel and tune.bf16


def test_llama31_scripts_agree_with_each_other():
    (data,) = check_script(LLAMA31 / "data_convert_llama31_instruction_pack.sh")
    (hf2mg,) = check_script(LLAMA31 / "ckpt_convert_llama31_hf2mcore.sh")
    (tune,) = check_script(LLAMA31 / "tune_llama31_8b_4k_full_pack.sh")
    (mg2hf,) = check_script(LLAMA31 / "ckpt_convert_llama31_mcore2hf.sh")
    assert data.pack and data.neat_pack
    assert (data.output_prefix, data.seq_length, data.prompt_type) == (tune.data_path[0], tune.seq_length, "llama3")
    assert (hf2mg.model_type_hf, mg2hf.model_type_hf) == ("llama", "llama")
    assert (hf2mg.save_dir, hf2mg.target_tensor_parallel_size, hf2mg.target_pipeline_parallel_size) == \
        (tune.load, tune.tensor_model_parallel_size, tune.pipeline_model_parallel_size)
    assert mg2hf.load_dir == tune.save
    assert data.tokenizer_name_or_path == tune.tokenizer_name_or_path == mg2hf.tokenizer_dir == hf2mg.load_dir
    # another layout reaches the conversion and the training through the same variables
    (hf2mg,) = check_script(LLAMA31 / "ckpt_convert_llama31_hf2mcore.sh", TP="4", PP="2")
    (tune,) = check_script(LLAMA31 / "tune_llama31_8b_4k_full_pack.sh", TP="4", PP="2")
    assert (hf2mg.target_tensor_parallel_size, hf2mg.target_pipeline_parallel_size) == \
        (tune.tensor_model_parallel_size, tune.pipeline_model_parallel_size) == (4, 2)


# the Llama-3.1-8B shape scaled down (GQA 4:1 kept); everything else is the script's own
LLAMA31_SCALED = {"--num-layers": "2", "--hidden-size": "64", "--ffn-hidden-size": "224", "--num-attention-heads": "8",
                  "--num-query-groups": "2", "--padded-vocab-size": "256", "--seq-length": "128",
                  "--original-max-position-embeddings": "32", "--tensor-model-parallel-size": "1",
                  "--global-batch-size": "2", "--train-iters": "2"}


def test_llama31_tune_flags_scaled_down_train(tmp_path):
    """The tune script's own command (llama3 RoPE scaling, bf16, packed SFT schedule) runs two steps with the model
    shape scaled down, on one process, from scratch on a tiny packed dataset."""
    from tests.train_utils import run_posttrain, write_copy_task

    (cmd,) = extract_commands(LLAMA31 / "tune_llama31_8b_4k_full_pack.sh")
    argv, i = [], 0
    while i < len(cmd.argv):
        flag = cmd.argv[i]
        takes_value = i + 1 < len(cmd.argv) and not cmd.argv[i + 1].startswith("--")
        value = cmd.argv[i + 1] if takes_value else None
        i += 2 if takes_value else 1
        if flag in ("--load", "--save", "--finetune", "--data-path", "--tokenizer-name-or-path", "--tokenizer-type",
                    "--tensorboard-dir", "--metrics-file", "--save-interval"):
            continue  # no weights, data, tokenizer or log paths of the real job here
        argv += [flag] + ([LLAMA31_SCALED.get(flag, value)] if takes_value else [])
    assert set(LLAMA31_SCALED) <= set(argv)
    data = write_copy_task(str(tmp_path / "data"), num_packs=8)
    _, records = run_posttrain([*argv, "--data-path", data], model_flags=[], metrics=str(tmp_path / "m.jsonl"))
    losses = [r["lm loss"] for r in records if r["split"] == "train"]
    assert len(losses) == 2 and all(0 < x < 20 for x in losses), losses


def test_qwen3_scripts_agree_with_each_other():
    (data,) = check_script(QWEN3 / "data_convert_qwen3_instruction_pack.sh")
    (hf2mg,) = check_script(QWEN3 / "ckpt_convert_qwen3_hf2mcore.sh")
    (tune,) = check_script(QWEN3 / "tune_qwen3_8b_4k_full_pack.sh")
    (mg2hf,) = check_script(QWEN3 / "ckpt_convert_qwen3_mcore2hf.sh")
    assert (data.output_prefix, data.seq_length, data.prompt_type) == (tune.data_path[0], tune.seq_length, "qwen3")
    assert tune.prompt_type == "qwen3"
    assert (hf2mg.model_type_hf, mg2hf.model_type_hf) == ("qwen3", "qwen3")
    assert (hf2mg.save_dir, hf2mg.target_tensor_parallel_size, hf2mg.target_pipeline_parallel_size) == \
        (tune.load, tune.tensor_model_parallel_size, tune.pipeline_model_parallel_size)
    assert mg2hf.load_dir == tune.save
    assert data.tokenizer_name_or_path == tune.tokenizer_name_or_path == mg2hf.tokenizer_dir == hf2mg.load_dir


def test_qwen3_data_script_takes_mindspeed_llms_enable_thinking():
    """MindSpeed-LLM's Qwen3 data script passes --enable-thinking true; ours had no way to (its arguments are ignored)."""
    (default,) = check_script(QWEN3 / "data_convert_qwen3_instruction_pack.sh")
    (thinking,) = check_script(QWEN3 / "data_convert_qwen3_instruction_pack.sh", ENABLE_THINKING="true")
    assert default.enable_thinking is None and thinking.enable_thinking is True


def test_qwen25_32k_cp_scripts_agree_with_each_other():
    """The 32k wrappers run the 4k scripts with context parallelism; data and training still agree."""
    data = _qwen25("data_convert_qwen25_instruction_pack_32k_cp.sh")
    tune = _qwen25("tune_qwen25_7b_32k_full_pack_cp.sh")
    assert data.pack and data.neat_pack and tune.neat_pack and tune.sequence_parallel
    assert (data.output_prefix, data.seq_length, data.prompt_type) == \
        (tune.data_path[0], tune.seq_length, tune.prompt_type)
    assert tune.seq_length == 32768 and tune.data_path[0].endswith("alpaca_32k")
    cp, tp = tune.context_parallel_size, tune.tensor_model_parallel_size
    assert (tp, cp, tune.data_parallel_size, tune.global_batch_size) == (4, 2, 1, 1)
    # samples padded at preprocessing to what the zigzag split over CP (x TP under sequence parallelism) needs
    assert data.pad_to_multiple_of == 2 * cp * tp == 16
    # the same tokens per step as the 4k recipe, and its own checkpoint and log names
    base = _qwen25("tune_qwen25_7b_4k_full_pack.sh")
    assert tune.seq_length * tune.global_batch_size == base.seq_length * base.global_batch_size
    assert base.context_parallel_size == 1  # the 4k scripts' defaults: no CP, no preprocessing pad
    assert _qwen25("data_convert_qwen25_instruction_pack.sh").pad_to_multiple_of == 1
    assert (tune.load, tune.lr, tune.train_iters) == (base.load, base.lr, base.train_iters)
    assert tune.save != base.save and tune.tensorboard_dir != base.tensorboard_dir
    assert tune.metrics_file != base.metrics_file
    # another layout reaches both scripts through the same environment variables
    data = _qwen25("data_convert_qwen25_instruction_pack_32k_cp.sh", TP="2", CP="4")
    tune = _qwen25("tune_qwen25_7b_32k_full_pack_cp.sh", TP="2", CP="4")
    assert (tune.tensor_model_parallel_size, tune.context_parallel_size, tune.data_parallel_size) == (2, 4, 1)
    assert data.pad_to_multiple_of == 2 * 4 * 2


def test_qwen25_dynamic_cp_scripts_agree_with_each_other():
    """The dynamic CP recipe: one sample per document up to the longest sample a CP group of CP ranks holds."""
    data = _qwen25("data_convert_qwen25_instruction_dynamic_cp.sh")
    tune = _qwen25("tune_qwen25_7b_dynamic_cp.sh")
    assert not data.pack and not data.neat_pack and not tune.neat_pack
    assert tune.sequence_packing_scheduler == "default_dynamic_cp" and tune.overlong_samples == "refuse"
    assert (data.output_prefix, data.prompt_type) == (tune.data_path[0], tune.prompt_type)
    cp, per_rank = tune.context_parallel_size, tune.max_seqlen_per_dp_cp_rank
    assert data.seq_length == tune.seq_length == cp * per_rank == 65536
    assert (tune.tensor_model_parallel_size, cp, tune.data_parallel_size, per_rank) == (2, 4, 1, 16384)
    assert tune.sequence_parallel and tune.micro_batch_size == 1 and tune.global_batch_size == 32
    base = _qwen25("tune_qwen25_7b_4k_full_pack.sh")
    assert (tune.lr, tune.train_iters) == (base.lr, base.train_iters) and tune.save != base.save
    # another pool reaches both scripts through the same environment variables
    data = _qwen25("data_convert_qwen25_instruction_dynamic_cp.sh", SEQ_LEN="131072")
    tune = _qwen25("tune_qwen25_7b_dynamic_cp.sh", CP="8", TP="1")
    assert data.seq_length == tune.seq_length == 8 * 16384 and tune.context_parallel_size == 8


def test_qwen25_lora_recipe_adapts_the_hf_model_on_one_gpu_per_rank():
    """The LoRA recipe: the full recipe's model, data and template, on the HF directory with adapters."""
    lora = _qwen25("tune_qwen25_7b_4k_lora_pack.sh")
    full = _qwen25("tune_qwen25_7b_4k_full_pack.sh")
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_query_groups", "padded_vocab_size", "seq_length",
                "data_path", "prompt_type", "neat_pack", "reset_position_ids", "bf16"):
        assert getattr(lora, key) == getattr(full, key), key
    assert (lora.lora_r, lora.lora_alpha, lora.lora_dropout) == (16, 32.0, 0.0)
    assert lora.lora_target_modules == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    assert lora.load.endswith("qwen2.5-7b-instruct") and lora.save != lora.load and lora.save_hf
    assert (lora.tensor_model_parallel_size, lora.data_parallel_size, lora.lr) == (1, 8, 1e-4)
    assert not lora.lora_merge and lora.lora_load is None
    one = _qwen25("tune_qwen25_7b_4k_lora_pack.sh", GPUS_PER_NODE="1", LORA_LOAD="ckpt/a", LORA_MERGE="1")
    assert (one.data_parallel_size, one.num_micro_batches, one.lora_load, one.lora_merge) == (1, 8, "ckpt/a", True)


def test_qwen25_kto_recipe_packs_couples_and_trains_them_as_its_config():
    """The KTO script's data step writes the packs its training step reads (KTO handler, the same length and
    template), and configs/kto/ is the same job in one command (raw rows preprocessed first)."""
    data, tune = check_script(QWEN25 / "tune_qwen25_7b_4k_kto_pack.sh")
    assert data.handler_name == "AlpacaStyleKTOHandler" and data.pack and data.neat_pack and tune.neat_pack
    assert data.map_keys == {"label": "label"}
    assert (data.output_prefix, data.seq_length, data.prompt_type, data.tokenizer_name_or_path) == \
        (tune.data_path[0], tune.seq_length, tune.prompt_type, tune.tokenizer_name_or_path)
    assert (tune.stage, tune.kto_beta, tune.kto_desirable_weight, tune.kto_undesirable_weight) == ("kto", 0.1, 1.0, 1.0)
    assert tune.finetune and tune.ref_load is None and not tune.ref_logps
    assert (tune.tensor_model_parallel_size, tune.data_parallel_size, tune.global_batch_size) == (4, 2, 16)
    config = check_command(_config_command("kto/qwen25_7b_4k_kto_pack.yaml"))
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_query_groups", "padded_vocab_size", "seq_length",
                "stage", "kto_beta", "kto_desirable_weight", "kto_undesirable_weight", "micro_batch_size",
                "global_batch_size", "lr", "min_lr", "lr_warmup_fraction", "train_iters", "load", "save", "bf16",
                "tensor_model_parallel_size", "prompt_type", "neat_pack", "reset_position_ids"):
        assert getattr(config, key) == getattr(tune, key), key
    assert config.handler_name == data.handler_name and config.data_path[0].endswith(".jsonl")
    # LLaMA-Factory's column and a ShareGPT handler reach the data step
    data, _ = check_script(QWEN25 / "tune_qwen25_7b_4k_kto_pack.sh", LABEL_COLUMN="kto_tag",
                           HANDLER="SharegptStyleKTOHandler")
    assert data.map_keys == {"label": "kto_tag"} and data.handler_name == "SharegptStyleKTOHandler"


def test_qwen25_reference_free_preference_recipes():
    """SimPO from the instruct model, ORPO (the wrapper) from the base model: the same model, layout and raw
    pairs as each other, each its stage's flags, no reference; the pairs tokenised with the loaded model's tokenizer."""
    simpo = _qwen25("tune_qwen25_7b_4k_simpo_pack.sh")
    orpo = _qwen25("tune_qwen25_7b_4k_orpo_pack.sh")
    full = _qwen25("tune_qwen25_7b_4k_full_pack.sh")
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_query_groups", "padded_vocab_size", "seq_length",
                "tensor_model_parallel_size", "prompt_type", "neat_pack", "bf16", "sequence_parallel"):
        assert getattr(simpo, key) == getattr(orpo, key) == getattr(full, key), key
    assert (simpo.stage, simpo.simpo_beta, simpo.gamma_beta_ratio, simpo.simpo_loss_type, simpo.lr) == \
        ("simpo", 2.5, 0.55, "sigmoid", 1e-6)
    assert (orpo.stage, orpo.orpo_beta, orpo.lr, orpo.pref_ftx) == ("orpo", 0.1, 5e-6, 0.0)
    assert simpo.load.endswith("qwen2.5-7b-instruct") and orpo.load.endswith("qwen2.5-7b")
    for a in (simpo, orpo):
        assert a.handler_name == "AlpacaStylePairwiseHandler" and a.data_path == simpo.data_path
        assert a.tokenizer_name_or_path == a.load and a.ref_load is None and not a.ref_logps
        assert (a.data_parallel_size, a.global_batch_size, a.train_epochs) == (2, 16, 1)
    assert len({simpo.save, orpo.save, simpo.metrics_file, orpo.metrics_file}) == 4
    with pytest.raises(FlagError, match="STAGE=dpo"):
        _qwen25("tune_qwen25_7b_4k_simpo_pack.sh", STAGE="dpo")


def test_qwen25_training_validates_the_world_size():
    # 6 GPUs cannot hold TP 4: the world size the script computes reaches the real validation
    with pytest.raises(FlagError, match="world size 6 is not divisible by TP 4"):
        _qwen25("tune_qwen25_7b_4k_full_pack.sh", GPUS_PER_NODE="6")
    # two nodes double data parallelism; GBS 8 still divides MBS 1 x DP 4
    a = _qwen25("tune_qwen25_7b_4k_full_pack.sh", NNODES="2", NODE_RANK="1", MASTER_ADDR="10.0.0.1")
    assert (a.data_parallel_size, a.num_micro_batches) == (4, 2)


def test_qwen25_training_recomputes_the_layers_asked_for():
    assert _qwen25("tune_qwen25_7b_4k_full_pack.sh").recompute_granularity is None
    a = _qwen25("tune_qwen25_7b_4k_full_pack.sh", RECOMPUTE_LAYERS="7")
    assert (a.recompute_granularity, a.recompute_method, a.recompute_num_layers) == ("full", "block", 7)
    with pytest.raises(FlagError, match="--recompute-num-layers between 1 and 28"):
        _qwen25("tune_qwen25_7b_4k_full_pack.sh", RECOMPUTE_LAYERS="29")


def _mutated_copy(script: Path, tmp_path: Path, flag: str, replacement: str) -> Path:
    """A copy of ``script`` in which the argument-array element ``flag`` is renamed: examples/ and scripts/ are
    copied whole (the scripts source their neighbours), and the flag is renamed in the first of the script and
    the ``*.bash`` files it may source (its model's arguments, examples/common/) that holds it."""
    for tree in ("examples", "scripts"):
        shutil.copytree(REPO / tree, tmp_path / tree)
    copy = tmp_path / script.relative_to(REPO)
    pattern = re.compile(rf"^(\s+){re.escape(flag)}(?=\s|$)", re.M)
    for path in [copy, *sorted(copy.parent.glob("*.bash")), *sorted((tmp_path / "examples" / "common").glob("*.bash"))]:
        mutated, n = pattern.subn(lambda m: m.group(1) + replacement, path.read_text(), count=1)
        if n:
            path.write_text(mutated)
            return copy
    raise AssertionError(f"{script} and the files it sources have no argument line starting with {flag}")


@pytest.mark.parametrize("name, flag", [
    ("tune_qwen25_7b_4k_full_pack.sh", "--num-query-groups"),
    ("data_convert_qwen25_instruction_pack.sh", "--neat-pack"),
    ("ckpt_convert_qwen25_hf2mcore.sh", "--target-tensor-parallel-size"),
    ("ckpt_convert_qwen25_mcore2hf.sh", "--tokenizer-dir"),
])
def test_misspelled_flag_fails(tmp_path, name, flag):
    check_script(QWEN25 / name)  # the original parses ...
    copy = _mutated_copy(QWEN25 / name, tmp_path, flag, flag + "s")
    with pytest.raises(FlagError, match=re.escape(flag + "s")):  # ... the misspelled copy does not
        check_script(copy)


@pytest.mark.parametrize("name, flag, abbreviation", [
    ("tune_qwen25_7b_4k_full_pack.sh", "--seq-length", "--seq-len"),
    ("data_convert_qwen25_instruction_pack.sh", "--seq-length", "--seq-len"),  # argparse would accept this one
    ("ckpt_convert_qwen25_hf2mcore.sh", "--params-dtype", "--params-dt"),
])
def test_abbreviated_flag_fails(tmp_path, name, flag, abbreviation):
    copy = _mutated_copy(QWEN25 / name, tmp_path, flag, abbreviation)
    with pytest.raises(FlagError, match=re.escape(abbreviation)):
        check_script(copy)


@pytest.mark.parametrize("name, ok", [
    ("tune_qwen25_7b_4k_full_pack.sh", "\ntensor-model-parallel-size: 4\n"),
    ("data_convert_qwen25_instruction_pack.sh", "preprocess_data.py arguments OK"),
    ("tune_qwen25_7b_32k_full_pack_cp.sh", "\ncontext-parallel-size: 2\n"),  # through the wrapper's exec
    ("tune_qwen25_7b_dynamic_cp.sh", "\nsequence-packing-scheduler: default_dynamic_cp\n"),
    ("tune_qwen25_7b_4k_lora_pack.sh", "\nlora-r: 16\n"),
    ("tune_qwen25_7b_4k_kto_pack.sh", "\nkto-beta: 0.1\n"),  # both steps' checks, the packs not there
    # --train-epochs without the packs (orm, prm), or raw pairs not there yet (simpo, orpo): planned, not refused
    ("tune_qwen25_7b_4k_orm_pack.sh", "# iterations: from --train-epochs 1 once the data is found\n"),
    ("tune_qwen25_7b_4k_prm_pack.sh", "\nstage: prm\n"),
    ("tune_qwen25_7b_4k_simpo_pack.sh", "\nstage: simpo\n"),
    ("tune_qwen25_7b_4k_orpo_pack.sh", "\nstage: orpo\n"),
    # the converters' DRY_RUN is the same parse as above in a fresh interpreter (one megatron import, ~5 s): skipped
])
def test_dry_run_needs_no_gpu_data_or_weights(tmp_path, name, ok):
    """``DRY_RUN=1`` checks the flags with the real entry point on a machine without GPU, data or weights."""
    proc = subprocess.run(["bash", str(QWEN25 / name)], env=_clean_env(DRY_RUN="1", LOG_DIR=str(tmp_path / "logs")),
                          cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ok in proc.stdout
    assert not any(tmp_path.iterdir()), "a dry run must not write anything"


# ---------------------------------------------------------------------------- configs/
CONFIGS_DIR = REPO / "configs"
# every example config: (entry script, world size, the example script running the same job, extra flags)
CONFIGS = {
    "sft/qwen25_7b_4k_full_pack.yaml": ("posttrain.py", 8, QWEN25 / "tune_qwen25_7b_4k_full_pack.sh", []),
    "sft/qwen25_7b_32k_full_pack_cp.yaml": ("posttrain.py", 8, QWEN25 / "tune_qwen25_7b_32k_full_pack_cp.sh", []),
    "sft/qwen25_7b_dynamic_cp.yaml": ("posttrain.py", 8, QWEN25 / "tune_qwen25_7b_dynamic_cp.sh", []),
    "sft/qwen3_8b_4k_full_pack.yaml": ("posttrain.py", 8, QWEN3 / "tune_qwen3_8b_4k_full_pack.sh", []),
    "sft/qwen3_30b_a3b_4k_full_pack.yaml": ("posttrain.py", 16, QWEN3_MOE / "tune_qwen3_30b_a3b_4k_full_pack.sh", []),
    "sft/qwen25_7b_4k_lora_pack.yaml": ("posttrain.py", 8, QWEN25 / "tune_qwen25_7b_4k_lora_pack.sh", []),
    "sft/qwen25_7b_4k_from_hf.yaml": ("posttrain.py", 8, None, None),  # needs its HF --load: its own test below
    "dpo/qwen25_7b_4k_dpo_pack.yaml": ("posttrain.py", 8, None, []),
    "orm/qwen25_7b_4k_orm_pack.yaml": ("posttrain.py", 8, QWEN25 / "tune_qwen25_7b_4k_orm_pack.sh", []),
    "prm/qwen25_7b_4k_prm_pack.yaml": ("posttrain.py", 8, QWEN25 / "tune_qwen25_7b_4k_prm_pack.sh", []),
    "kto/qwen25_7b_4k_kto_pack.yaml": ("posttrain.py", 8, None, []),  # the script's two steps in one: test below
    "simpo/qwen25_7b_4k_simpo_pack.yaml": ("posttrain.py", 8, QWEN25 / "tune_qwen25_7b_4k_simpo_pack.sh", []),
    "orpo/qwen25_7b_4k_orpo_pack.yaml": ("posttrain.py", 8, QWEN25 / "tune_qwen25_7b_4k_orpo_pack.sh", []),
    "grpo/qwen3_8b_grpo_step.yaml": ("posttrain.py", 8, None, []),
    "pretrain/qwen25_7b_4k_pretrain.yaml": ("pretrain_gpt.py", 8, None, []),
    "data/qwen25_alpaca_4k_pack.yaml": ("preprocess_data.py", 1, QWEN25 / "data_convert_qwen25_instruction_pack.sh", []),
    "data/qwen25_alpaca_32k_pack_cp.yaml": ("preprocess_data.py", 1,
                                            QWEN25 / "data_convert_qwen25_instruction_pack_32k_cp.sh", []),
    "data/qwen25_alpaca_64k_unpacked.yaml": ("preprocess_data.py", 1,
                                             QWEN25 / "data_convert_qwen25_instruction_dynamic_cp.sh", []),
    "data/qwen3_alpaca_4k_pack.yaml": ("preprocess_data.py", 1, QWEN3 / "data_convert_qwen3_instruction_pack.sh", []),
    "data/qwen25_pretrain_text.yaml": ("preprocess_data.py", 1, None, []),
    # the quickstart gives its paths on the command line (examples/quickstart/run.sh, checked above)
    "quickstart.yaml": ("posttrain.py", 1, None, ["--data-path", "sharegpt.jsonl"]),
}


def _config_command(name: str) -> Command:
    entry, world_size, _, extra = CONFIGS[name]
    return Command(entry, ["--config", str(CONFIGS_DIR / name), *(extra or [])], world_size)


def test_every_example_config_is_checked():
    found = {str(p.relative_to(CONFIGS_DIR)) for p in CONFIGS_DIR.rglob("*.yaml")}
    assert found == set(CONFIGS), f"add new configs to CONFIGS in {__file__}: {sorted(found ^ set(CONFIGS))}"


@pytest.mark.parametrize("name", sorted(n for n, (*_, extra) in CONFIGS.items() if extra is not None))
def test_example_config_passes_the_example_scripts_flag_checks(name):
    """The parser of the config's entry script, every key a flag, the cross-flag rules at its world size."""
    assert check_command(_config_command(name))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_example_config_usage_line_runs_that_config(name):
    """The header's command line for the config's own job (its entry script with ``--config``) names this file: the
    64k unpacked data config told users to run the 32k packed one."""
    entry = CONFIGS[name][0]
    header = (CONFIGS_DIR / name).read_text().split("\n\n", 1)[0]
    named = re.findall(rf"{re.escape(entry)} --config (configs/\S+\.yaml)", header)
    assert not named or f"configs/{name}" in named, (name, named)


def _resolved(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if k not in ("config", "flag_sources")}


@pytest.mark.parametrize("name", sorted(n for n, (_, _, script, _) in CONFIGS.items() if script))
def test_example_config_is_its_example_script(name):
    """A config and the shell script of the same job resolve to the same arguments: they cannot drift apart."""
    (from_script,) = check_script(CONFIGS[name][2])
    assert _resolved(check_command(_config_command(name))) == _resolved(from_script)


# Qwen2.5-7B-Instruct's config.json as published
QWEN25_7B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
    "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064,
}


def test_one_command_config_takes_the_model_from_the_hf_directory_with_the_finetuning_defaults(tmp_path):
    """configs/sft/qwen25_7b_4k_from_hf.yaml against a stand-in of the HF directory (config.json; weights are
    not read while parsing): the 4k recipe's model, raw data, epochs, and the fine-tuning defaults."""
    hf = tmp_path / "qwen2.5-7b-instruct"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(QWEN25_7B_CONFIG))
    (hf / "model.safetensors").write_bytes(b"")
    (hf / "tokenizer_config.json").write_text("{}")  # it ships its tokenizer: the run's tokenizer by default
    name = "sft/qwen25_7b_4k_from_hf.yaml"
    cmd = _config_command(name)
    args = check_command(Command(cmd.entry, cmd.argv + ["--load", str(hf)], cmd.world_size))
    (recipe,) = check_script(QWEN25 / "tune_qwen25_7b_4k_full_pack.sh")
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "add_qkv_bias", "swiglu", "normalization", "norm_epsilon", "rotary_base", "padded_vocab_size",
                "untie_embeddings_and_output_weights", "seq_length", "tensor_model_parallel_size", "prompt_type"):
        assert getattr(args, key) == getattr(recipe, key), key
    assert (args.load_format, args.finetune, args.train_epochs, args.train_iters) == ("hf", True, 2, None)
    assert (args.lr_warmup_fraction, args.lr_decay_style, args.min_lr) == (0.03, "cosine", 1e-6)
    assert args.save_hf == "./ckpt/qwen2.5-7b-sft-from-hf/hf" and args.tokenizer_name_or_path == str(hf)
    assert args.data_path[0].endswith(".parquet") and args.handler_name == "AlpacaStyleInstructionHandler"
    finetune = [name for name, origin in args.flag_sources.values() if origin == "finetune"]
    assert set(finetune) == {"lr-warmup-fraction", "lr-decay-style", "min-lr", "save-hf", "tokenizer-name-or-path"}

"""A checkpoint is used only as the model and with the tokenizer it was trained as.

``--load`` and ``--ref-load`` (a Megatron checkpoint or a Hugging Face directory alike) refuse flags that
differ from the checkpoint's in any setting that changes the model's function, naming the flag, both values
and the checkpoint; a checkpoint records its tokenizer's vocabulary, and one of another tokenizer is refused
(one that records none is warned about). Errors name the flag the user passed.
"""
import logging
import os

import pytest
import torch

import posttrain
from mindspeed_pack.checkpoint.errors import CheckpointError
from mindspeed_pack.convert import megatron_layout as layout
from mindspeed_pack.convert.model_specs import FUNCTION_ARGS, model_differences
from mindspeed_pack.convert.tokenizer_record import read_tokenizer_record
from tests.model_utils import TINY_FLAGS, save_word_tokenizer, write_converted_tiny_qwen2
from tests.pair_utils import random_pairs, write_pair_dataset

WORDS = ["<pad>", "<eos>", *[f"w{i}" for i in range(248)]]  # 250 ids: the pairs' ids, in the 256 rows


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("ckpt_identity")
    tok = {"a": save_word_tokenizer(root / "tok_a", WORDS),
           "b": save_word_tokenizer(root / "tok_b", [*WORDS[:100], "other", *WORDS[101:]])}
    policy = write_converted_tiny_qwen2(root / "policy", tokenizer=tok["a"])
    # the policy's tokenizer as preprocessing extends it for a template: a marker added after its ids
    extended = transformers.AutoTokenizer.from_pretrained(root / "policy" / "hf")
    extended.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    extended.save_pretrained(root / "tok_a_ext")
    tok["a_extended"] = str(root / "tok_a_ext")
    return {"root": root, "tok": tok, "policy": policy,
            # rope_theta 10000 and eps 0.1 where the flags say 1e6 and 1e-6
            "rope": write_converted_tiny_qwen2(root / "rope", seed=1, rope_theta=1e4, rms_norm_eps=0.1),
            "other_tokenizer": write_converted_tiny_qwen2(root / "other_tok", seed=2, tokenizer=tok["b"]),
            "data": write_pair_dataset(str(root / "pairs"), random_pairs(8, seed=3))}


def dpo(made, *extra):
    return [*TINY_FLAGS, "--stage", "dpo", "--seq-length", "128", "--neat-pack", "--micro-batch-size", "1",
            "--global-batch-size", "2", "--train-iters", "1", "--data-path", made["data"], *extra]


def _rank_file(ckpt, iteration=layout.RELEASE):
    return layout.checkpoint_file(ckpt, iteration, 0, 0, 1)


def test_every_setting_that_changes_the_function_is_compared():
    from tests.model_utils import tiny_args

    run = tiny_args(kv_channels=None, num_experts=None, qk_layernorm=False, position_embedding_type="rope",
                    rotary_percent=1.0, use_rope_scaling=True, rope_scaling_factor=8.0, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position_embeddings=8192)
    recorded = {k: getattr(run, k) for k in FUNCTION_ARGS if hasattr(run, k)}
    recorded.update(kv_channels=16, rotary_base=1000000)  # the head size run's None means; 1e6 as an int
    assert model_differences(recorded, run) == []
    # Megatron-LM keeps --num-query-groups' default (1) when it has no GQA: it means one group per head
    assert model_differences({**recorded, "group_query_attention": False, "num_query_groups": 1},
                             tiny_args(group_query_attention=False, num_query_groups=4)) == []
    changed = {"num_layers": 3, "hidden_size": 32, "ffn_hidden_size": 96, "num_attention_heads": 2,
               "num_query_groups": 1, "kv_channels": 32, "add_qkv_bias": False, "disable_bias_linear": False,
               "swiglu": False, "normalization": "LayerNorm", "norm_epsilon": 0.1, "qk_layernorm": True,
               "untie_embeddings_and_output_weights": False, "padded_vocab_size": 384,
               "position_embedding_type": "learned_absolute", "rotary_base": 10000, "rotary_percent": 0.5,
               "use_rope_scaling": False, "rope_scaling_factor": 32.0, "low_freq_factor": 2.0,
               "high_freq_factor": 2.0, "original_max_position_embeddings": 4096, "num_experts": 4}
    assert set(changed) | {"moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
                           "moe_router_pre_softmax"} == set(FUNCTION_ARGS)
    for key, value in changed.items():
        assert [d[0] for d in model_differences({**recorded, key: value}, run)] == [key], key
    # the expert settings of an MoE checkpoint, compared as the builder reads them
    moe = {**recorded, "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": None, "moe_layer_freq": [1, 1],
           "moe_router_pre_softmax": False}
    run_moe = tiny_args(**{**vars(run), "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 128,
                           "moe_layer_freq": 1, "moe_router_pre_softmax": False})
    assert model_differences(moe, run_moe) == []
    for key, value in {"moe_router_topk": 1, "moe_ffn_hidden_size": 64, "moe_layer_freq": [0, 1],
                       "moe_router_pre_softmax": True}.items():
        assert [d[0] for d in model_differences({**moe, key: value}, run_moe)] == [key], key
    # what the recorded model does not read is not compared: scaling factors without scaling, experts of a dense one
    unscaled = {**recorded, "use_rope_scaling": False, "rope_scaling_factor": 32.0}
    assert [d[0] for d in model_differences(unscaled, run)] == ["use_rope_scaling"]
    assert model_differences({**recorded, "moe_router_topk": 8}, run) == []


@pytest.mark.parametrize("form", ["megatron", "hf"])
def test_load_refuses_flags_that_differ_from_the_models_own(made, capsys, form):
    """The issue's case: a model with rope_theta 10000 / eps 0.1 trained under 1e6 / 1e-6 flags. ``--load`` takes
    the model flags from the model (a converted checkpoint's recorded arguments, a HF directory's config.json);
    those given are compared by the same function, and the error names both values."""
    hf = os.path.join(os.path.dirname(made["rope"]), "hf")
    load, where, verb = ((made["rope"], _rank_file(made["rope"]), "records") if form == "megatron" else
                         (hf, os.path.join(hf, "config.json"), "gives"))
    with pytest.raises(SystemExit):
        posttrain.main(dpo(made, "--load", load, "--finetune"))
    assert (f"--norm-epsilon 1e-06 but {where} {verb} --norm-epsilon 0.1; --rotary-base 1000000 but {where} {verb} "
            "--rotary-base 10000") in capsys.readouterr().err


def test_a_megatron_load_fills_the_model_flags_it_records(made):
    """No model flag given: the converted checkpoint's record gives them all, listed as its in the resolved
    configuration."""
    from mindspeed_pack.config.arguments import parse_args

    args = parse_args(["--seq-length", "128", "--train-iters", "1", "--data-path", made["data"], "--load",
                       made["rope"], "--finetune"], world_size=1)
    assert (args.num_layers, args.hidden_size, args.num_query_groups, args.add_qkv_bias, args.normalization,
            args.norm_epsilon, args.rotary_base, args.vocab_size, args.padded_vocab_size) == (
        2, 64, 2, True, "RMSNorm", 0.1, 10000, 256, 256)
    assert args.flag_sources["hidden_size"][1] == args.flag_sources["norm_epsilon"][1] == "checkpoint"
    assert args.flag_sources["seq_length"][1] == "given"


@pytest.mark.parametrize("form", ["megatron", "hf"])
def test_use_checkpoint_args_lets_the_checkpoint_override_the_flags(made, capsys, caplog, form):
    """Megatron-LM's --use-checkpoint-args (its scripts pass the model flags and it): 'unrecognized arguments'
    here. The checkpoint's values replace those given, warned; without --load it is refused by name."""
    from mindspeed_pack.config.arguments import parse_args

    load = made["rope"] if form == "megatron" else os.path.join(os.path.dirname(made["rope"]), "hf")
    with caplog.at_level(logging.WARNING):
        args = parse_args(["--seq-length", "128", "--train-iters", "1", "--data-path", made["data"], "--load", load,
                           "--finetune", "--norm-epsilon", "1e-6", "--num-layers", "2", "--use-checkpoint-args"],
                          world_size=1)
    assert (args.norm_epsilon, args.rotary_base, args.num_layers) == (0.1, 10000, 2)
    assert "--use-checkpoint-args: the " in caplog.text and "--norm-epsilon 1e-06 but " in caplog.text
    with pytest.raises(SystemExit):
        parse_args(["--seq-length", "128", "--train-iters", "1", "--data-path", made["data"], *TINY_FLAGS,
                    "--use-checkpoint-args"], world_size=1)
    assert "--use-checkpoint-args takes the model flags from --load's checkpoint: pass --load" in capsys.readouterr().err


def _as_megatron_lm_checkpoint(release: str, root: str) -> str:
    """``release``'s weights as a Megatron-LM run under Transformer Engine saves them: its parsed flags as a
    Namespace (``add_bias_linear``, the dest of --disable-bias-linear; no family), TE's fused layer-norm names and
    ``_extra_state`` entries, iteration 100."""
    import argparse

    record = torch.load(_rank_file(release), weights_only=True)
    recorded = {k: v for k, v in record["args"].items() if k not in ("disable_bias_linear", "model_type_hf")}
    te_names = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
    model = {}
    for name, tensor in record["model"].items():
        for local, te in te_names.items():
            name = name.replace(local, te)
        model[name] = tensor
        if name.endswith(("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")):
            model[name[: -len("weight")] + "_extra_state"] = torch.empty(0, dtype=torch.uint8)
    path = layout.checkpoint_file(root, 100, 0, 0, 1)
    os.makedirs(os.path.dirname(path))
    torch.save({"args": argparse.Namespace(**recorded, add_bias_linear=False, transformer_impl="transformer_engine"),
                "checkpoint_version": 3.0, "iteration": 100, "model": model}, path)
    with open(os.path.join(root, layout.TRACKER), "w") as f:
        f.write("100")
    return root


def test_a_megatron_lm_checkpoint_loads_with_no_model_flag(made, tmp_path):
    """Megatron-LM records --disable-bias-linear as add_bias_linear=False and, under TE, saves the norms fused into
    the linears: the model was built with linear biases and the load refused the names."""
    from mindspeed_pack.checkpoint.save_load import load_weights
    from mindspeed_pack.config.arguments import parse_args
    from mindspeed_pack.model.gpt import build_gpt_model
    from tests.model_utils import init_single_process

    ckpt = _as_megatron_lm_checkpoint(made["policy"], str(tmp_path / "megatron_lm"))
    args = parse_args(["--seq-length", "128", "--train-iters", "1", "--data-path", made["data"], "--load", ckpt,
                       "--finetune", "--attention-backend", "local"], world_size=1)
    assert args.disable_bias_linear and args.flag_sources["disable_bias_linear"][1] == "checkpoint"
    init_single_process()
    model = build_gpt_model(args)
    load_weights(args, ckpt, model)
    release = torch.load(_rank_file(made["policy"]), weights_only=True)["model"]
    loaded = layout.model_state_for_save(model)
    assert sorted(loaded) == sorted(release) and all(torch.equal(loaded[k], release[k]) for k in release)


def test_a_checkpoint_recording_no_model_shape_asks_for_the_model_flags(made, tmp_path, capsys):
    """MindSpeed-LLM's converter records its own arguments (--model-type-hf qwen25, the target layout), not the
    model's: without model flags the run said 'missing required arguments', naming neither file nor why."""
    import argparse

    from mindspeed_pack.config.arguments import parse_args

    record = torch.load(_rank_file(made["policy"]), weights_only=True)
    ckpt = str(tmp_path / "mindspeed_llm")
    path = layout.checkpoint_file(ckpt, 1, 0, 0, 1)
    os.makedirs(os.path.dirname(path))
    converter = argparse.Namespace(load_model_type="hf", save_model_type="mg", model_type_hf="qwen25",
                                   target_tensor_parallel_size=1, target_pipeline_parallel_size=1, num_layers=None)
    torch.save({"args": converter, "checkpoint_version": 3.0, "iteration": 1, "model": record["model"]}, path)
    layout.write_tracker(ckpt, 1)
    run = ["--seq-length", "128", "--train-iters", "1", "--data-path", made["data"], "--load", ckpt, "--finetune"]
    with pytest.raises(SystemExit):
        parse_args(run, world_size=1)
    assert (f"--load {ckpt}: {path} records no --num-layers, --hidden-size, --num-attention-heads (a checkpoint of "
            "another tool, such as MindSpeed-LLM's converter") in capsys.readouterr().err
    assert parse_args([*run, *TINY_FLAGS], world_size=1).num_layers == 2


def test_a_megatron_lm_checkpoint_converts_to_hf_given_its_family(made, tmp_path, capsys):
    """A Megatron-LM run records no family and, under TE, other names: mg->hf (and mg->mg) said 'args lacks
    ['model_type_hf']' whatever --model-type-hf was given, then knew no rule for TE's fused norm names."""
    from safetensors.torch import load_file

    from mindspeed_pack.convert.convert import main as convert_main

    ckpt = _as_megatron_lm_checkpoint(made["policy"], str(tmp_path / "megatron_lm"))
    mg2hf = ["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", ckpt]
    assert convert_main([*mg2hf, "--save-dir", str(tmp_path / "no_family")]) == 2
    assert "records no model family (a Megatron-LM checkpoint): pass --model-type-hf" in capsys.readouterr().err
    assert convert_main([*mg2hf, "--model-type-hf", "qwen25", "--save-dir", str(tmp_path / "hf")]) == 0
    original = load_file(os.path.join(os.path.dirname(made["policy"]), "hf", "model.safetensors"))
    written = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(original) == sorted(written) and all(torch.equal(t, written[k]) for k, t in original.items())
    # a reshard names the family too (it said to pass --model-type-hf, then did not read it), and records it
    tp2 = str(tmp_path / "tp2")
    assert convert_main(["--load-model-type", "mg", "--save-model-type", "mg", "--load-dir", ckpt, "--save-dir", tp2,
                         "--target-tensor-parallel-size", "2", "--model-type-hf", "qwen2"]) == 0
    assert torch.load(layout.checkpoint_file(tp2, layout.RELEASE, 1, 0, 1), weights_only=True)["args"][
        "model_type_hf"] == "qwen2"


@pytest.mark.parametrize("form", ["megatron", "hf"])
def test_ref_load_refuses_a_reference_of_another_model(made, form):
    """As a DPO reference the same checkpoint silently took the policy's settings."""
    ref = made["rope"] if form == "megatron" else os.path.join(os.path.dirname(made["rope"]), "hf")
    where = _rank_file(ref) if form == "megatron" else os.path.join(ref, "config.json")
    with pytest.raises(CheckpointError) as e:
        posttrain.main(dpo(made, "--load", made["policy"], "--finetune", "--ref-load", ref))
    assert str(e.value) == (
        f"--ref-load {ref}: the model flags differ from the checkpoint's ({where}): --norm-epsilon 1e-06 here, "
        "0.1 in the checkpoint; --rotary-base 1000000 here, 10000 in the checkpoint; the reference model is built "
        "with the policy's flags, so it must be the same model: pass a reference of this model")


def test_ref_load_errors_name_the_flag(made, tmp_path):
    with pytest.raises(CheckpointError, match=f"^--ref-load {tmp_path}/absent: no such directory$"):
        posttrain.main(dpo(made, "--load", made["policy"], "--finetune", "--ref-load", str(tmp_path / "absent")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=f"^--ref-load {tmp_path}/empty: no checkpoint found "
                                              r"\(latest_checkpointed_iteration.txt is missing\); nor is it a Hugging "
                                              r"Face model \(config.json and \*.safetensors\)$"):
        posttrain.main(dpo(made, "--load", made["policy"], "--finetune", "--ref-load", str(tmp_path / "empty")))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "qwen2"}')
    with pytest.raises(CheckpointError, match=f"^--ref-load {tmp_path}/hf: no \\*.safetensors weights"):
        posttrain.main(dpo(made, "--load", made["policy"], "--finetune", "--ref-load", str(tmp_path / "hf")))


def test_conversion_and_training_record_the_tokenizers_vocabulary(made, tmp_path):
    import transformers

    record = torch.load(_rank_file(made["policy"]), weights_only=True)["tokenizer"]
    loaded = transformers.AutoTokenizer.from_pretrained(os.path.join(os.path.dirname(made["policy"]), "hf"))
    assert record["base_size"] == len(WORDS) == loaded.vocab_size
    assert record["added"] == {str(i): t for t, i in loaded.get_added_vocab().items() if i >= len(WORDS)}
    # the same vocabulary saved with other files records the same; one token changed does not
    resaved = transformers.AutoTokenizer.from_pretrained(made["tok"]["a"])
    resaved.chat_template = "{{ messages }}"
    resaved.save_pretrained(tmp_path / "resaved")
    first, again = read_tokenizer_record(made["tok"]["a"]), read_tokenizer_record(str(tmp_path / "resaved"))
    assert first["base_sha256"] == again["base_sha256"] == record["base_sha256"] and first["added"] == again["added"]
    assert read_tokenizer_record(made["tok"]["b"])["base_sha256"] != record["base_sha256"]
    # a training save records the run's tokenizer: here one extended by an added marker, which the
    # checkpoint of the tokenizer it extends agrees with (no refusal)
    save = str(tmp_path / "saved")
    posttrain.main(dpo(made, "--load", made["policy"], "--finetune", "--tokenizer-name-or-path",
                       made["tok"]["a_extended"], "--save", save))
    saved = torch.load(_rank_file(save, 1), weights_only=True)["tokenizer"]
    assert saved == read_tokenizer_record(made["tok"]["a_extended"])
    assert saved["base_sha256"] == record["base_sha256"]
    assert saved["added"] == {**record["added"], str(len(WORDS) + len(record["added"])): "<|im_start|>"}


def test_data_tokenized_with_another_tokenizer_than_the_runs_is_refused(tmp_path):
    # data preprocessed with tokenizer b trained on --load of tokenizer a: the run's tokenizer defaults to the --load
    # directory's, which the checkpoint agrees with, so ids meaning other tokens were trained with no word
    import argparse
    import json

    from mindspeed_pack.checkpoint.hf_checkpoint import check_data_tokenizer

    a = save_word_tokenizer(tmp_path / "a", WORDS)
    b = save_word_tokenizer(tmp_path / "b", [*WORDS[:100], "other", *WORDS[101:]])
    same = save_word_tokenizer(tmp_path / "a_copy", WORDS)

    def check(data_tokenizer, **meta):
        (tmp_path / "d_packed_meta.json").write_text(json.dumps({"tokenizer_path": data_tokenizer, **meta}))
        check_data_tokenizer(argparse.Namespace(data_path=[str(tmp_path / "d")]), read_tokenizer_record(a))

    with pytest.raises(CheckpointError) as e:
        check(b)
    assert str(e.value).startswith(f"the data {tmp_path}/d were tokenized with another tokenizer than this run's (the "
                                   f"base vocabularies differ): the data's is {b}: 250 base tokens")
    check(same)  # the same vocabulary in another directory
    check(b, extended_tokenizer={"path": "d_tokenizer"})  # an extended P_tokenizer/ is the run's own
    check(str(tmp_path / "gone"))  # a tokenizer no longer there cannot be read


def test_a_validation_set_of_another_tokenizer_is_refused_too(tmp_path):
    # only the first --data-path/--train-data-path prefix was checked: a --valid-data-path preprocessed with another
    # tokenizer gave validation losses of ids that mean other tokens, with no word
    import argparse
    import json

    from mindspeed_pack.checkpoint.hf_checkpoint import check_data_tokenizer

    a = save_word_tokenizer(tmp_path / "a", WORDS)
    b = save_word_tokenizer(tmp_path / "b", [*WORDS[:100], "other", *WORDS[101:]])
    for name, tokenizer in (("train", a), ("valid", b)):
        (tmp_path / f"{name}_packed_meta.json").write_text(json.dumps({"tokenizer_path": tokenizer}))
    args = argparse.Namespace(train_data_path=[str(tmp_path / "train")], valid_data_path=[str(tmp_path / "valid")])
    with pytest.raises(CheckpointError, match=rf"^the data {tmp_path}/valid were tokenized with another tokenizer"):
        check_data_tokenizer(args, read_tokenizer_record(a))


def test_pretraining_documents_of_another_tokenizer_are_refused_in_a_per_split_blend(tmp_path):
    # preprocess_data.py records a pretraining prefix P_text_document's tokenizer in P_text_meta.json, which the check
    # never found (it looked for P_text_document_meta.json): pretrain_gpt.py's data went unchecked, a blend's
    # second prefix and --valid-data-path's too
    import argparse
    import json

    from mindspeed_pack.checkpoint.hf_checkpoint import check_data_tokenizer

    a = save_word_tokenizer(tmp_path / "a", WORDS)
    b = save_word_tokenizer(tmp_path / "b", [*WORDS[:100], "other", *WORDS[101:]])
    for name, tokenizer in (("x", a), ("y", a), ("v", b)):
        (tmp_path / f"{name}_text_meta.json").write_text(json.dumps({"tokenizer_path": tokenizer}))
    args = argparse.Namespace(train_data_path=["0.5", str(tmp_path / "x_text_document"), "0.5",
                                               str(tmp_path / "y_text_document")],
                              valid_data_path=[str(tmp_path / "v_text_document")])
    with pytest.raises(CheckpointError, match=rf"^the data {tmp_path}/v_text_document were tokenized with another"):
        check_data_tokenizer(args, read_tokenizer_record(a))
    args = argparse.Namespace(data_path=["0.5", str(tmp_path / "x_text_document"), "0.5",
                                         str(tmp_path / "v_text_document")])
    with pytest.raises(CheckpointError, match=rf"^the data {tmp_path}/v_text_document were tokenized with another"):
        check_data_tokenizer(args, read_tokenizer_record(a))


def test_a_reference_of_another_tokenizer_is_refused_and_one_without_a_record_warned(made, caplog):
    ref = made["other_tokenizer"]
    with pytest.raises(CheckpointError) as e:
        posttrain.main(dpo(made, "--load", made["policy"], "--finetune", "--ref-load", ref))
    msg = str(e.value)
    assert msg.startswith(f"--ref-load {ref} was trained with another tokenizer than this run's (the base "
                          "vocabularies differ): the checkpoint's is ")
    # the reference's, converted with tokenizer b; this run's, none given: the policy's (converted with a)
    assert f"{os.path.dirname(ref)}/hf: 250 base tokens" in msg and f"{os.path.dirname(made['policy'])}/hf: 250 base" in msg
    # the same tokenizer, and a reference converted from a directory without one (warned, trained)
    bare = os.path.join(str(made["root"]), "bare")
    write_converted_tiny_qwen2(bare)
    with caplog.at_level(logging.WARNING):
        posttrain.main(dpo(made, "--load", made["policy"], "--finetune", "--ref-load", os.path.join(bare, "mg")))
    assert f"--ref-load {bare}/mg records no tokenizer" in caplog.text

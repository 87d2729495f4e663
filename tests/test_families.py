"""Qwen3, Llama-3.1 (llama3 RoPE scaling), Mistral and Mixtral against transformers, packed, at TP1, TP2 and PP2.

Each family is a tiny random transformers model using the family's real features: GQA
everywhere; Qwen3 with q/k norms, ``head_dim`` 24 != hidden/heads 16 and tied embeddings;
Llama-3.1 with llama3 RoPE scaling whose ``original_max_position_embeddings`` (16) is shorter
than the packed samples, and tied embeddings; Mistral with a sliding window that covers the
sequence. One pack of four samples runs through the converted Megatron model (THD,
``cu_seqlens``) in ONE pair of gloo processes; its logits must equal transformers' logits of
each sample run alone. At PP2 every stage's core attention must receive the pack's
``cu_seqlens``, and a pipeline whose second stage loses the isolation must fail the same check.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from mindspeed_pack.convert import ConversionError, hf_to_megatron, megatron_to_hf
from tests.dist_harness import run_distributed
from tests.model_utils import forward_pipeline, load_release_checkpoint, spread_weights

VOCAB = 300
SAMPLE_LENGTHS = (21, 9, 30, 17)  # longer than llama3's original context (16) for three of them
PACK_LEN = 88  # 77 sample tokens + 11 padding (a fifth segment)
LAYOUTS = ((1, 1), (2, 1), (1, 2))
REL = 1e-4

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "qwen3": ("Qwen3", dict(head_dim=24, tie_word_embeddings=True, rope_theta=1e6)),
    "llama31": ("Llama", dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})),
    "mistral": ("Mistral", dict(tie_word_embeddings=False, sliding_window=4096, rope_theta=1e6)),
    "mixtral": ("Mixtral", dict(tie_word_embeddings=False, sliding_window=None, rope_theta=1e6, num_local_experts=4,
                                num_experts_per_tok=2)),
}


def build_hf_model(name: str):
    import transformers

    arch, kwargs = FAMILIES[name]
    config = getattr(transformers, f"{arch}Config")(**COMMON, **kwargs)
    torch.manual_seed(len(name))
    return spread_weights(getattr(transformers, f"{arch}ForCausalLM")(config).eval())


def pack():
    g = torch.Generator().manual_seed(11)
    samples = [torch.randint(3, VOCAB, (n,), generator=g) for n in SAMPLE_LENGTHS]
    ids = torch.zeros(PACK_LEN, dtype=torch.long)
    segments = torch.zeros(PACK_LEN, dtype=torch.long)
    pos = 0
    for i, s in enumerate(samples):
        ids[pos:pos + len(s)], segments[pos:pos + len(s)] = s, i + 1
        pos += len(s)
    return samples, ids, segments


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    samples, _, _ = pack()
    out = {"root": root, "hf": {}, "mg": {}, "ref": {}}
    for name in FAMILIES:
        model = build_hf_model(name)
        hf_dir = str(root / f"{name}_hf")
        model.save_pretrained(hf_dir)
        out["hf"][name] = hf_dir
        with torch.no_grad():
            out["ref"][name] = torch.cat([model(s[None]).logits[0] for s in samples])  # each sample alone
        for tp, pp in LAYOUTS:
            out["mg"][(name, tp, pp)] = str(root / f"{name}_tp{tp}pp{pp}")
            hf_to_megatron(hf_dir, out["mg"][(name, tp, pp)], tp, pp, padded_vocab_size=VOCAB)
    return out


def _packed_worker(jobs):
    """Packed logits of every job; per stage, the cu_seqlens each core attention received."""
    from megatron.core import parallel_state as ps

    from mindspeed_pack.model.packed_attention import PackedDotProductAttention
    from mindspeed_pack.packing.segments import build_packed_batch
    from mindspeed_pack.runtime.process_groups import initialize_distributed
    from mindspeed_pack.training.batches import packed_seq_params

    _, ids, segments = pack()
    batch = build_packed_batch(ids[None], ids[None], segments[None])
    results = {}
    for name, ckpt_dir, tp, pp, corrupt_later_stage in jobs:
        if ps.model_parallel_is_initialized():
            from mindspeed_pack.runtime.process_groups import release_model_parallel
            release_model_parallel()
        initialize_distributed(tp, pp)
        model, args = load_release_checkpoint(ckpt_dir)
        seen = []
        for module in model.modules():
            if isinstance(module, PackedDotProductAttention):
                module.register_forward_pre_hook(
                    lambda m, a, kw: seen.append(kw["packed_seq_params"].cu_seqlens_q.clone()), with_kwargs=True)
        psp = packed_seq_params(batch)  # what the trainer hands every stage
        if corrupt_later_stage and not ps.is_pipeline_first_stage():
            whole = torch.tensor([0, PACK_LEN], dtype=torch.int32)  # the pack as one sequence: no isolation
            psp.cu_seqlens_q = psp.cu_seqlens_kv = psp.cu_seqlens_q_padded = psp.cu_seqlens_kv_padded = whole
            psp.max_seqlen_q = psp.max_seqlen_kv = PACK_LEN
            psp.host_cu_seqlens = whole.numpy().astype("int64")  # the host's copy, which attention plans read
            psp.rope_positions = torch.arange(PACK_LEN)
        with torch.no_grad():
            logits = forward_pipeline(model, args, batch.tokens, batch.position_ids, packed_seq_params=psp)
        stage = ps.get_pipeline_model_parallel_rank()
        results[(name, "cu_seqlens", stage)] = seen
        if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
            results[name] = logits[0, :sum(SAMPLE_LENGTHS), :VOCAB].clone()  # THD: [1, tokens, vocab]
    return results


@pytest.fixture(scope="module")
def megatron_outputs(work):
    jobs = [(f"{name}_tp{tp}pp{pp}", work["mg"][(name, tp, pp)], tp, pp, False)
            for name in FAMILIES for tp, pp in LAYOUTS]
    jobs.append(("qwen3_pp2_later_stage_unisolated", work["mg"][("qwen3", 1, 2)], 1, 2, True))
    merged = {}
    for rank_results in run_distributed(_packed_worker, 2, jobs, timeout=300):
        merged.update(rank_results)
    return merged


def _rel(got, ref):
    return float((got - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=["tp1", "tp2", "pp2"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_packed_logits_equal_transformers_per_sample(work, megatron_outputs, name, tp, pp):
    got, ref = megatron_outputs[f"{name}_tp{tp}pp{pp}"], work["ref"][name]
    assert got.shape == ref.shape
    assert _rel(got, ref) <= REL, _rel(got, ref)
    assert ref.std() > 0.5  # large enough for a misplaced tensor to show


def test_every_pipeline_stage_receives_the_packs_cu_seqlens(megatron_outputs):
    _, ids, segments = pack()
    bounds = [0]
    for n in (*SAMPLE_LENGTHS, PACK_LEN - sum(SAMPLE_LENGTHS)):
        bounds.append(bounds[-1] + n)
    for name in FAMILIES:
        for stage in (0, 1):
            seen = megatron_outputs[(f"{name}_tp1pp2", "cu_seqlens", stage)]
            assert len(seen) == 1  # one layer per stage, each called once
            assert seen[0].tolist() == bounds


def test_a_later_stage_without_isolation_fails_the_check(work, megatron_outputs):
    """Negative control: the same check catches a pipeline stage that lost the pack's cu_seqlens."""
    assert megatron_outputs[("qwen3_pp2_later_stage_unisolated", "cu_seqlens", 1)][0].tolist() == [0, PACK_LEN]
    assert _rel(megatron_outputs["qwen3_pp2_later_stage_unisolated"], work["ref"]["qwen3"]) > 100 * REL


@pytest.mark.parametrize("name", list(FAMILIES))
def test_hf_megatron_hf_is_bit_exact(work, name):
    for tp, pp in ((2, 1), (1, 2)):
        back = str(work["root"] / f"{name}_back_tp{tp}pp{pp}")
        megatron_to_hf(work["mg"][(name, tp, pp)], back)
        original = load_file(os.path.join(work["hf"][name], "model.safetensors"))
        restored = load_file(os.path.join(back, "model.safetensors"))
        assert sorted(original) == sorted(restored)
        assert all(torch.equal(t, restored[k]) for k, t in original.items())
        cfg_in = json.load(open(os.path.join(work["hf"][name], "config.json")))
        cfg_out = json.load(open(os.path.join(back, "config.json")))
        differ = {k: (cfg_in.get(k), cfg_out.get(k)) for k in set(cfg_in) | set(cfg_out)
                  if cfg_in.get(k) != cfg_out.get(k) and k not in ("dtype", "architectures", "transformers_version")}
        # MixtralConfig saves head_dim null (read as hidden / heads); the converter writes the width it used
        if differ.get("head_dim") == (None, cfg_in["hidden_size"] // cfg_in["num_attention_heads"]):
            del differ["head_dim"]
        assert differ == {}, differ


def test_converted_args_carry_the_family(work):
    def args(name):
        return torch.load(os.path.join(work["mg"][(name, 1, 1)], "release", "mp_rank_00", "model_optim_rng.pt"),
                          weights_only=True)["args"]

    q = args("qwen3")
    assert (q["qk_layernorm"], q["kv_channels"], q["add_qkv_bias"], q["untie_embeddings_and_output_weights"]) == \
        (True, 24, False, False)
    ll = args("llama31")
    assert (ll["use_rope_scaling"], ll["rope_scaling_factor"], ll["low_freq_factor"], ll["high_freq_factor"],
            ll["original_max_position_embeddings"]) == (True, 8.0, 1.0, 4.0, 16)
    assert args("mistral")["sliding_window"] == 4096


def test_a_config_without_head_dim_gets_its_config_class_default():
    """Qwen3Config's head_dim defaults to 128, not hidden / heads: a config.json without it was read as hidden /
    heads (the tensors then "did not match the config"), while transformers builds 128-wide heads from it."""
    import transformers

    from mindspeed_pack.convert.model_specs import args_from_hf_config

    config = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 256,
              "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 512,
              "vocab_size": 512, "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    assert transformers.Qwen3Config(**config).head_dim == 128
    assert args_from_hf_config(config, None, 1, 1).kv_channels == 128
    assert args_from_hf_config({**config, "head_dim": 64}, None, 1, 1).kv_channels == 64
    qwen2 = {**config, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
    assert args_from_hf_config(qwen2, None, 1, 1).kv_channels == 64  # Qwen2's heads are hidden / heads


# Mixtral-8x7B-Instruct-v0.1's config.json as published (transformers 4.x: rope_theta at the top, no head_dim)
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0",
    "use_cache": True, "vocab_size": 32000}


def test_the_published_mixtral_config_is_megatron_lms_mixtral():
    """Every layer MoE with 8 experts 14336 wide, top-2 renormalised (no --moe-router-pre-softmax), and back
    to a MixtralConfig with the same fields."""
    import argparse

    from mindspeed_pack.convert.model_specs import MODEL_SPECS, args_from_hf_config, hf_config_from_args, settings_lost

    args = args_from_hf_config(MIXTRAL_8X7B, None, 8, 4, seq_length=4096)
    assert (args.model_type_hf, args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size,
            args.moe_router_pre_softmax, args.moe_layer_freq, args.num_query_groups, args.kv_channels,
            args.rotary_base, args.sliding_window, args.qk_layernorm, args.add_qkv_bias) == \
        ("mixtral", 8, 2, 14336, False, [1] * 32, 8, 128, 1000000, None, False, False)
    back = hf_config_from_args(args, MODEL_SPECS["mixtral"], "bfloat16", MIXTRAL_8X7B).to_dict()
    for key in ("num_local_experts", "num_experts_per_tok", "intermediate_size", "router_aux_loss_coef",
                "sliding_window", "num_key_value_heads"):
        assert back[key] == MIXTRAL_8X7B[key], key
    # every layer is MoE: --ffn-hidden-size shapes nothing, and another value than the experts' width (a script
    # that gives both) was named a setting the export would lose, and --save-hf refused
    assert settings_lost(vars(args), MODEL_SPECS["mixtral"], "--save-hf") == []
    assert settings_lost({**vars(args), "ffn_hidden_size": 28672}, MODEL_SPECS["mixtral"], "--save-hf") == []
    wide = argparse.Namespace(**{**vars(args), "ffn_hidden_size": 28672})
    assert hf_config_from_args(wide, MODEL_SPECS["mixtral"], "bfloat16").intermediate_size == 14336  # the experts'


def test_megatron_cores_llama3_constants_match_transformers():
    """With Llama-3.1's own constants megatron-core's scaling is used; both paths equal transformers'."""
    import argparse

    import transformers
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from mindspeed_pack.model.rope import gpt_model_rope_kwargs, llama3_inv_freq

    for original in (8192, 16):
        params = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": original}
        config = transformers.LlamaConfig(hidden_size=2048, num_attention_heads=32, rope_parameters=params)
        ref, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
        args = argparse.Namespace(use_rope_scaling=True, rope_scaling_factor=32.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=original)
        kwargs = gpt_model_rope_kwargs(args)
        assert bool(kwargs) == (original == 8192)  # megatron-core's only where its constants are the config's
        if kwargs:
            mcore = RotaryEmbedding(64, 1.0, rotary_base=500000, use_cpu_initialization=True, **kwargs).inv_freq
            assert torch.equal(mcore, ref)
        plain = RotaryEmbedding(64, 1.0, rotary_base=500000, use_cpu_initialization=True).inv_freq
        assert torch.equal(llama3_inv_freq(plain, 32.0, 1.0, 4.0, original), ref)


# --------------------------------------------------------------------------- refused configs
def _with_config(src, dst, drop=(), **changes) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    config = json.load(open(path))
    config.update(changes)
    for key in drop:
        config.pop(key, None)
    json.dump(config, open(path, "w"))
    return str(dst)


@pytest.mark.parametrize("family,changes,message", [
    ("mistral", dict(sliding_window=64),
     r"config.json: sliding_window=64 is not supported: it is below the sequence length 128.*--seq-length 64"),
    ("qwen3", dict(use_sliding_window=True), r"use_sliding_window=True is not supported"),
    ("qwen3", dict(num_experts=8, num_experts_per_tok=2), r"mixture-of-experts field\(s\) num_experts, "
                                                          r"num_experts_per_tok are not supported"),
    ("llama31", dict(quantization_config={"quant_method": "fp8"}), r"field\(s\) quantization_config are not "
                                                                   r"understood by the llama mapping"),
    ("qwen3", dict(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"]),
     r"unknown architecture \(model_type='qwen3_next'"),
    ("llama31", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                                      "partial_rotary_factor": 0.5}),
     r"rope_parameters field\(s\) partial_rotary_factor are not supported"),
    ("qwen3", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e6}),
     r"rope_parameters.rope_type='llama3' is not supported for qwen3"),
    ("qwen3", dict(attention_bias=True), r"attention_bias=True is not supported"),
    ("mixtral", dict(sliding_window=64), r"sliding_window=64 is not supported: it is below the sequence length 128"),
    ("mixtral", dict(router_jitter_noise=0.1), r"router_jitter_noise=0.1 is not supported"),
    ("mixtral", dict(mlp_only_layers=[0]), r"mixture-of-experts field\(s\) mlp_only_layers are not supported: the "
                                           r"mixtral mapping reads MixtralForCausalLM's expert fields only"),
], ids=["mistral-window", "qwen-window", "moe", "unknown-field", "model-type", "rope-key", "rope-type", "bias",
        "mixtral-window", "mixtral-jitter", "mixtral-dense-layers"])
def test_unsupported_configs_are_refused_naming_the_field(work, tmp_path, family, changes, message):
    bad = _with_config(work["hf"][family], tmp_path / "bad", **changes)
    with pytest.raises(ConversionError, match=message):
        hf_to_megatron(bad, str(tmp_path / "out"), 1, 1)
    assert not os.path.exists(tmp_path / "out")


def test_a_shape_error_names_the_head_dim_it_assumed(work, tmp_path):
    """Weights with 24-wide heads and a config.json without head_dim: the shapes cannot match the assumed 128, and
    the error says 128 was assumed, not only that the tensor disagrees with "config.json"."""
    bad = _with_config(work["hf"]["qwen3"], tmp_path / "bad", drop=("head_dim",))
    with pytest.raises(ConversionError, match=r"has shape \[96, 64\], but config.json implies \[512, 64\] "
                                              r"\(config.json has no head_dim, so 128 was assumed.*qwen3"):
        hf_to_megatron(bad, str(tmp_path / "out"), 1, 1)


def test_a_window_covering_the_training_length_converts(work, tmp_path):
    windowed = _with_config(work["hf"]["mistral"], tmp_path / "w", sliding_window=64)
    hf_to_megatron(windowed, str(tmp_path / "out"), 1, 1, seq_length=64)
    record = torch.load(os.path.join(tmp_path, "out", "release", "mp_rank_00", "model_optim_rng.pt"), weights_only=True)
    assert (record["args"]["sliding_window"], record["args"]["seq_length"]) == (64, 64)


def test_the_transformer_engine_path_is_handed_the_family(monkeypatch):
    """What the TE spec receives on a GPU machine: qk_layernorm for the spec and the config alike, and the
    scaled RoPE (the layer spec builder is TE's on a GPU; here it records its arguments and builds the local one)."""
    import mindspeed_pack.model.gpt as gpt
    from mindspeed_pack.model import spec as spec_module
    from mindspeed_pack.model.rope import llama3_inv_freq
    from tests.model_utils import init_single_process, tiny_args

    init_single_process()
    handed = []

    def te_layer_spec(backend, config, qk_layernorm=False, vp_stage=None):
        handed.append((backend, config.qk_layernorm, qk_layernorm, config.kv_channels))
        return spec_module.layer_spec("local", config, qk_layernorm, vp_stage)

    monkeypatch.setattr(gpt, "resolve_backend", lambda requested, *dtype_and_dropout, **quiet: "te")
    monkeypatch.setattr(gpt, "layer_spec", te_layer_spec)
    args = tiny_args(add_qkv_bias=False, qk_layernorm=True, kv_channels=24, use_rope_scaling=True,
                     rope_scaling_factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=16)
    model = gpt.build_gpt_model(args)
    assert handed == [("te", True, True, 24)]
    assert model.decoder.layers[0].self_attention.q_layernorm.weight.shape == (24,)
    plain = 1.0 / (1000000 ** (torch.arange(0, 24, 2, dtype=torch.float32) / 24))
    assert torch.equal(model.rotary_pos_emb.inv_freq, llama3_inv_freq(plain, 8.0, 1.0, 4.0, 16))
    assert not torch.equal(model.rotary_pos_emb.inv_freq, plain)


def _with_lm_head(src, dst, lm_head) -> str:
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    weights = load_file(path)
    weights["lm_head.weight"] = lm_head(weights["model.embed_tokens.weight"])
    save_file(weights, path, metadata={"format": "pt"})
    return str(dst)


def test_a_tied_models_stored_lm_head_is_ignored_only_when_it_is_the_embedding(work, tmp_path):
    """transformers ties a stored lm_head.weight equal to the embedding, and keeps one that differs as its own output
    layer: the tied Megatron model would drop it, so that one is refused (naming tie_word_embeddings)."""
    import transformers

    same = _with_lm_head(work["hf"]["qwen3"], tmp_path / "same", lambda e: e.clone())
    hf_to_megatron(same, str(tmp_path / "same_mg"), 1, 1, padded_vocab_size=VOCAB)
    other = _with_lm_head(work["hf"]["qwen3"], tmp_path / "other", lambda e: e.flip(0))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(other)
    assert not torch.equal(loaded.lm_head.weight, loaded.model.embed_tokens.weight)  # transformers' reading
    with pytest.raises(ConversionError, match=r"lm_head.weight' differs from 'model.embed_tokens.weight'.*"
                                              r"tie_word_embeddings to false"):
        hf_to_megatron(other, str(tmp_path / "out"), 1, 1, padded_vocab_size=VOCAB)
    assert not os.path.exists(tmp_path / "out")

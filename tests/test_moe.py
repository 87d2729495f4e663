"""Qwen3-MoE: conversion, packed loss against transformers, and a router that sees samples, not packs.

One tiny random transformers Qwen3-MoE (8 experts, top-2, 2 layers, layer 0 dense through
``mlp_only_layers``) is converted once; one process runs every check on the converted model:

- HF -> Megatron -> HF is bit-exact;
- the packed fp32 LM loss equals transformers' loss of the samples run one by one;
- the auxiliary loss equals transformers' ``load_balancing_loss_func`` over the real tokens
  (``aux_loss``), and the per-sample mean of it (``seq_aux_loss``);
- packing the same samples differently, or adding pads, changes neither loss nor aux loss;
- with pad id == EOS every real EOS token is routed, and no pad reaches an expert;
- the load-balancing gradient is ``coeff x grad`` of the step's aux loss under every stage and
  loss aggregation, whatever each divides its own loss by (and at EP2 and CP2).
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from mindspeed_pack.convert import ConversionError, hf_to_megatron, megatron_to_hf
from tests.model_utils import spread_weights

VOCAB, EXPERTS, TOPK = 256, 8, 2
EOS = 2  # also the pad id
SAMPLE_LENGTHS = (19, 7, 26, 12)
REL = 1e-4


def build_hf_model():
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=EXPERTS, num_experts_per_tok=TOPK,
        norm_topk_prob=True, mlp_only_layers=[0], tie_word_embeddings=False, max_position_embeddings=128,
        rms_norm_eps=1e-6, rope_theta=1e6, bos_token_id=1, eos_token_id=EOS, pad_token_id=EOS)
    torch.manual_seed(5)
    return spread_weights(transformers.Qwen3MoeForCausalLM(config).eval())


def samples():
    """Samples ending with EOS (== the pad id), as the chat templates end an answer."""
    g = torch.Generator().manual_seed(3)
    return [torch.cat([torch.randint(3, VOCAB, (n - 1,), generator=g), torch.tensor([EOS])]) for n in SAMPLE_LENGTHS]


def pack_rows(rows, row_length):
    """Micro-batch [b, row_length] of the given sample groups (lists of sample indices), EOS-padded."""
    sams = samples()
    ids = torch.full((len(rows), row_length), EOS, dtype=torch.long)
    segments = torch.zeros_like(ids)
    for r, group in enumerate(rows):
        pos = 0
        for k, i in enumerate(group):
            ids[r, pos:pos + len(sams[i])], segments[r, pos:pos + len(sams[i])] = sams[i], k + 1
            pos += len(sams[i])
    labels = torch.where(segments > 0, ids, torch.full_like(ids, -100))
    return ids, labels, segments


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_moe")
    model = build_hf_model()
    model.save_pretrained(root / "hf")
    hf_to_megatron(str(root / "hf"), str(root / "mg"), 1, 1, padded_vocab_size=VOCAB)
    return {"root": root, "model": model}


@pytest.fixture(scope="module")
def megatron(converted):
    from tests.model_utils import init_single_process, load_release_checkpoint

    init_single_process()
    model, args = load_release_checkpoint(str(converted["root"] / "mg"))
    return model, args


def run_pack(model, ids, labels, segments, routing_type="aux_loss"):
    """(summed per-token loss, trained tokens, aux loss, tokens per expert, routing maps) of one micro-batch."""
    from mindspeed_pack.model import moe
    from mindspeed_pack.packing.segments import build_packed_batch
    from mindspeed_pack.training.batches import packed_seq_params

    batch = build_packed_batch(ids, labels, segments)
    routers = moe.routers(model)
    maps = []
    hooks = [r.register_forward_hook(lambda m, a, out: maps.append(out[1].detach().clone())) for r in routers]
    for r in routers:
        r.routing_type = routing_type
        r.reset_statistics()
    moe.set_routing_segments(model, batch.routing_segments)
    model.train()  # the aux loss is a training-time statistic (dropout is 0 in the converted model)
    losses = model(batch.tokens, batch.position_ids, None, labels=batch.target,
                   packed_seq_params=packed_seq_params(batch))
    model.eval()
    for h in hooks:
        h.remove()
    aux = sum(r.step_aux_loss / r.step_units for r in routers) / len(routers)
    load = torch.stack([r.step_tokens_per_expert for r in routers])
    loss = float((losses.float().reshape(-1) * batch.loss_mask.reshape(-1)).sum().detach())
    return loss, float(batch.loss_mask.sum()), aux, load, maps, batch


def test_qwen3_moe_hf_megatron_hf_is_bit_exact(converted):
    root = converted["root"]
    megatron_to_hf(str(root / "mg"), str(root / "back"))
    original, back = load_file(root / "hf" / "model.safetensors"), load_file(root / "back" / "model.safetensors")
    assert sorted(original) == sorted(back)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in back and "model.layers.0.mlp.gate_proj.weight" in back
    for name in original:
        assert torch.equal(original[name], back[name]), name
    config = json.loads((root / "back" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    num_experts = config.get("num_experts", config.get("num_local_experts"))
    assert (num_experts, config["num_experts_per_tok"], config["moe_intermediate_size"], config["norm_topk_prob"],
            config["mlp_only_layers"]) == (EXPERTS, TOPK, 32, True, [0])


@pytest.fixture(scope="module")
def converted_ep2(converted):
    """The same HF model through convert_ckpt.py at --target-expert-parallel-size 2."""
    from mindspeed_pack.convert.convert import main as convert_main

    root = converted["root"]
    assert convert_main(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(root / "hf"),
                         "--save-dir", str(root / "mg_ep2"), "--target-expert-parallel-size", "2",
                         "--padded-vocab-size", str(VOCAB)]) == 0
    return str(root / "mg_ep2")


def test_convert_at_ep2_is_megatron_lm_layout_and_round_trips_bit_exact(converted, converted_ep2):
    """Megatron-LM's per-EP-rank directories, each with its own experts under local indices; back to HF
    bit-exact, and resharded to EP1 it equals the direct EP1 conversion tensor for tensor."""
    from mindspeed_pack.convert.convert import main as convert_main
    from mindspeed_pack.convert.megatron_layout import RELEASE, checkpoint_file
    from mindspeed_pack.convert.megatron_layout import load_file as load_megatron_file

    root = converted["root"]
    assert sorted(p.name for p in (root / "mg_ep2" / RELEASE).iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"]
    direct = load_megatron_file(checkpoint_file(str(root / "mg"), RELEASE, 0, 0, 1))["model"]
    expert = "decoder.layers.1.mlp.experts.local_experts.{}.linear_fc1.weight"
    for ep_rank in range(2):
        record = load_megatron_file(checkpoint_file(converted_ep2, RELEASE, 0, 0, 1, ep_rank, 2))
        assert record["args"]["expert_model_parallel_size"] == 2
        assert sorted(k for k in record["model"] if ".local_experts." in k and k.endswith("fc1.weight")) == [
            expert.format(j) for j in range(EXPERTS // 2)]
        for j in range(EXPERTS // 2):  # local expert j of EP rank e is global expert e * 4 + j
            assert torch.equal(record["model"][expert.format(j)], direct[expert.format(ep_rank * 4 + j)])
    megatron_to_hf(converted_ep2, str(root / "back_ep2"))
    # HF directories hold safetensors (read by safetensors), Megatron ones torch files (read as data)
    original = load_file(root / "hf" / "model.safetensors")
    back = load_file(root / "back_ep2" / "model.safetensors")
    assert sorted(original) == sorted(back) and all(torch.equal(original[k], back[k]) for k in original)
    assert convert_main(["--load-model-type", "mg", "--save-model-type", "mg", "--load-dir", converted_ep2,
                         "--save-dir", str(root / "mg_ep1"), "--target-expert-parallel-size", "1"]) == 0
    resharded = load_megatron_file(checkpoint_file(str(root / "mg_ep1"), RELEASE, 0, 0, 1))["model"]
    assert sorted(resharded) == sorted(direct) and all(torch.equal(resharded[k], direct[k]) for k in direct)


def test_ep2_checkpoint_loads_into_an_ep1_run(converted, converted_ep2, megatron):
    """A run at another --expert-model-parallel-size regroups the experts from the files holding them."""
    import copy

    from mindspeed_pack.checkpoint.save_load import load_weights
    from mindspeed_pack.convert.megatron_layout import RELEASE, checkpoint_file, load_file
    from mindspeed_pack.model.gpt import build_gpt_model

    _, args = megatron
    args = copy.copy(args)
    args.allow_unsafe_checkpoint_load = False
    model = build_gpt_model(args)
    load_weights(args, converted_ep2, model)
    direct = load_file(checkpoint_file(str(converted["root"] / "mg"), RELEASE, 0, 0, 1))["model"]
    loaded = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    assert sorted(loaded) == sorted(direct) and all(torch.equal(loaded[k], direct[k]) for k in direct)


def test_packed_loss_equals_transformers_per_sample(converted, megatron):
    model, _ = megatron
    hf = converted["model"]
    ids, labels, segments = pack_rows([[0, 1, 2, 3]], 80)
    loss, count, *_ = run_pack(model, ids, labels, segments)
    ref_sum, ref_count = 0.0, 0
    with torch.no_grad():
        for s in samples():
            logits = hf(s[None]).logits[0, :-1].float()
            ref_sum += float(torch.nn.functional.cross_entropy(logits, s[1:], reduction="sum"))
            ref_count += len(s) - 1
    assert count == ref_count
    assert abs(loss / count - ref_sum / ref_count) <= REL * abs(ref_sum / ref_count)


def _hf_router_logits(hf):
    """transformers' router logits of the MoE layer, each sample run alone: a list per sample."""
    with torch.no_grad():
        return [hf(s[None], output_router_logits=True).router_logits[0] for s in samples()]


def test_aux_loss_equals_transformers_over_real_tokens(converted, megatron):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model, _ = megatron
    per_sample = _hf_router_logits(converted["model"])
    ids, labels, segments = pack_rows([[0, 1, 2, 3]], 80)  # 64 real tokens, 16 pads (== EOS)
    _, _, aux, *_ = run_pack(model, ids, labels, segments, "aux_loss")
    # transformers' loss counts fractions of tokens over the top-k slots: megatron's is 1/topk of it
    ref = float(load_balancing_loss_func((torch.cat(per_sample),), EXPERTS, TOPK)) / TOPK
    assert abs(aux - ref) <= REL * ref
    _, _, seq_aux, *_ = run_pack(model, ids, labels, segments, "seq_aux_loss")
    ref_seq = sum(float(load_balancing_loss_func((x,), EXPERTS, TOPK)) for x in per_sample) / len(per_sample) / TOPK
    assert abs(seq_aux - ref_seq) <= REL * ref_seq
    assert abs(seq_aux - aux) > 10 * REL * ref  # the two losses differ here: the check above is not vacuous


@pytest.mark.parametrize("routing_type", ["aux_loss", "seq_aux_loss"])
def test_repacking_and_padding_change_neither_loss_nor_aux_loss(megatron, routing_type):
    model, _ = megatron
    ref = run_pack(model, *pack_rows([[0, 1, 2, 3]], 64), routing_type)  # one full pack, no padding
    for rows, length in (([[2, 0], [3, 1]], 48), ([[3], [1, 0, 2]], 70), ([[0, 1, 2, 3]], 128)):
        got = run_pack(model, *pack_rows(rows, length), routing_type)
        assert got[1] == ref[1]
        assert abs(got[0] - ref[0]) <= 1e-5 * abs(ref[0]), (rows, length)
        assert abs(got[2] - ref[2]) <= 1e-5 * ref[2], (rows, length, routing_type)
        assert torch.equal(got[3], ref[3]), (rows, length)  # tokens per expert: pads never counted


def test_pad_id_equal_to_eos_routes_every_real_eos_and_no_pad(megatron):
    model, _ = megatron
    ids, labels, segments = pack_rows([[0, 1, 2, 3]], 100)
    *_, load, maps, batch = run_pack(model, ids, labels, segments)
    (routing_map,) = maps
    real = batch.routing_segments.reshape(-1) != 0
    eos = batch.tokens.reshape(-1) == EOS
    assert int((real & eos).sum()) == len(SAMPLE_LENGTHS)  # one EOS per sample: same id as the 36 pads
    assert (routing_map[real & eos].sum(-1) == TOPK).all()  # every real EOS reaches its experts
    assert not routing_map[~real].any()  # pads reach none
    assert float(load.sum()) == TOPK * int(real.sum())


def test_a_scoring_pass_routes_by_its_own_micro_batch(megatron):
    """Reference / KL scoring runs the policy between training micro-batches: its routers must not keep the last
    micro-batch's samples (there, tokens 7.. were padding: routed to no expert, their log-probs wrong)."""
    from mindspeed_pack.model import moe
    from mindspeed_pack.packing.segments import build_packed_batch
    from mindspeed_pack.training.batches import packed_seq_params
    from mindspeed_pack.training.stages.reference import score_sequences
    from mindspeed_pack.training.stages.sequences import sequence_logps

    model, _ = megatron
    batch = build_packed_batch(*pack_rows([[0, 1, 2, 3]], 64))
    moe.set_routing_segments(model, batch.routing_segments)
    with torch.no_grad():
        out = model(batch.tokens, batch.position_ids, None, labels=batch.target,
                    packed_seq_params=packed_seq_params(batch))
    expected, _ = sequence_logps(batch, out)
    moe.set_routing_segments(model, build_packed_batch(*pack_rows([[1]], 64)).routing_segments)  # the last step's
    (scored,) = score_sequences([model], [batch], 64)
    assert torch.allclose(scored.float(), expected, rtol=1e-6, atol=1e-5), (scored, expected)


def test_shared_expert_family_is_refused_by_name(tmp_path):
    import transformers

    config = transformers.Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, num_experts=4)
    transformers.Qwen2MoeForCausalLM(config).save_pretrained(tmp_path / "hf")
    with pytest.raises(ConversionError, match=r"Qwen2MoeForCausalLM \(qwen2_moe\) has shared experts"):
        hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "mg"), 1, 1)


MOE_FLAGS = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--qk-layernorm",
             "--moe-layer-freq", "[0,1]", "--moe-router-load-balancing-type", "seq_aux_loss",
             "--moe-aux-loss-coeff", "0.01", "--seq-length", "128", "--micro-batch-size", "2",
             "--global-batch-size", "4", "--neat-pack", "--train-iters", "3", "--lr", "1e-3"]
# build_hf_model()'s shape as flags (a Megatron --load needs them; a HF --load checks them against config.json)
QWEN3_MOE_FLAGS = (
    "--num-layers 2 --hidden-size 64 --ffn-hidden-size 96 --num-attention-heads 4 --group-query-attention "
    "--num-query-groups 2 --kv-channels 24 --qk-layernorm --disable-bias-linear --swiglu --normalization RMSNorm "
    "--norm-epsilon 1e-6 --rotary-base 1000000 --untie-embeddings-and-output-weights --padded-vocab-size 256 "
    "--position-embedding-type rope --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 32 "
    "--moe-layer-freq [0,1] --attention-dropout 0.0 --hidden-dropout 0.0 --lr-decay-style cosine "
    "--log-interval 1 --eval-iters 0 --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 0.01 "
    "--seq-length 128 --micro-batch-size 2 --global-batch-size 4 --neat-pack --train-iters 5 --lr 1e-3"
).split()
EP2 = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]


def test_ep2_tp2xep2_pp2xcp2_match_one_process_and_ep2_resumes_exactly(converted, tmp_path):
    """The tiny Qwen3-MoE loaded straight from its HF directory (each rank reads its own experts)
    trains the same at EP2 (alltoall dispatcher over gloo), TP2 x EP2 with sequence parallelism and
    PP2 (a dense stage, then an MoE stage) x CP2 (4 processes each) as in one process over 5 steps:
    losses, aux losses, grad norms and expert loads. Under CP every sample is split over two ranks, so
    equal seq_aux_loss means each sample's statistic is taken over the whole sample. The EP2 run saves
    at step 3 (one directory per EP rank); resumed from there, steps 4-5 are bit-equal."""
    from tests.train_utils import run_posttrain, write_copy_task

    data = write_copy_task(str(tmp_path / "data"), num_packs=24)
    hf, ckpt = str(converted["root"] / "hf"), str(tmp_path / "ckpt_ep2")
    runs = {}
    for name, nproc, extra in (
            ("one", 1, ["--load", hf]),
            ("ep2", 2, [*EP2, "--load", hf, "--save", ckpt, "--save-interval", "3"]),
            ("ep2_resumed", 2, [*EP2, "--load", ckpt, "--save-hf", str(tmp_path / "hf_out")]),
            ("tp2xep2", 4, [*EP2, "--load", hf, "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
            ("pp2xcp2", 4, ["--load", hf, "--pipeline-model-parallel-size", "2", "--context-parallel-size", "2"])):
        if name == "ep2_resumed":
            assert sorted(os.listdir(os.path.join(ckpt, "iter_0000003"))) == ["mp_rank_00_000", "mp_rank_00_001"]
            with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("3")  # resume from step 3 (the run also saved its last step)
        proc, records = run_posttrain(["--data-path", data, *extra], nproc=nproc, model_flags=QWEN3_MOE_FLAGS,
                                      metrics=str(tmp_path / f"{name}.jsonl"))
        runs[name] = [r for r in records if r["split"] == "train"]
        if name == "one":  # the console line carries the MoE fields
            assert "moe aux loss:" in proc.stdout and "expert load max/mean:" in proc.stdout
    ref = runs["one"]
    assert len(ref) == 5
    for name in ("ep2", "tp2xep2", "pp2xcp2"):
        for got, want in zip(runs[name], ref, strict=True):
            for key in ("lm loss", "moe aux loss", "grad norm", "expert load max/mean"):
                assert abs(got[key] - want[key]) <= 1e-5 * abs(want[key]), (name, got["iteration"], key)
            assert got["tokens per expert"] == want["tokens per expert"], (name, got["iteration"])
    assert sum(ref[0]["tokens per expert"][0]) == 2 * ref[0]["tokens"]  # top-2 of every real token, no pad
    assert [r["iteration"] for r in runs["ep2_resumed"]] == [4, 5]
    for got, want in zip(runs["ep2_resumed"], runs["ep2"][3:], strict=True):
        for key in ("lm loss", "moe aux loss", "grad norm", "tokens per expert"):
            assert got[key] == want[key], (got["iteration"], key)
    # --save-hf at EP2 merges every EP rank's experts: the resumed run's model is the uninterrupted one's
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("5")
    megatron_to_hf(ckpt, str(tmp_path / "hf_at_5"))
    exported, uninterrupted = load_file(tmp_path / "hf_out" / "model.safetensors"), \
        load_file(tmp_path / "hf_at_5" / "model.safetensors")
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in exported and sorted(exported) == sorted(uninterrupted)
    assert all(torch.equal(exported[k], uninterrupted[k]) for k in exported)


def _rel(mine, theirs):
    return float((mine - theirs).abs().max() / theirs.abs().max())


def _assert_same_aux_grads(mine, theirs, what):
    (router, embedding, norm), (t_router, t_embedding, t_norm) = mine, theirs
    assert _rel(router, t_router) <= 1e-5 and _rel(embedding, t_embedding) <= 1e-5, (what, norm, t_norm)
    assert abs(norm / t_norm - 1) <= 1e-5, (what, norm, t_norm)


def test_aux_loss_gradient_is_coeff_times_its_gradient_at_every_stage(converted):
    """SFT (per token, per sample), DPO (per pair) and GRPO (every --loss-agg) divide their own loss by
    different counts; the load-balancing gradient of a step is coeff x grad of the step's aux loss under
    each of them (megatron-core's scaling would multiply it by the routed tokens per normaliser unit), for
    aux_loss and seq_aux_loss. Each stage's own term is exactly zero here, or subtracted (SFT)."""
    from tests import moe_aux_utils as aux

    trainer = aux.aux_trainer(str(converted["root"] / "hf"), [])
    for routing_type in ("aux_loss", "seq_aux_loss"):
        for case in aux.CASES:
            micro_batches = aux.case_micro_batches(case, seed=1)
            mine = aux.trainer_aux_grads(trainer, case, micro_batches, routing_type, coeff=1.0)
            theirs = aux.expected_aux_grads(converted["model"], micro_batches, routing_type, coeff=1.0)
            _assert_same_aux_grads(mine, theirs, (routing_type, case))


@pytest.mark.parametrize("layout,flags,data_parallel,cases", [
    ("ep2", EP2, 2, ("dpo", "grpo seq-mean-token-mean")),
    ("cp2", ["--context-parallel-size", "2"], 1, ("sft token-mean", "grpo dr-grpo")),
], ids=["ep2", "cp2"])
def test_aux_loss_gradient_at_ep2_and_cp2(converted, layout, flags, data_parallel, cases):
    """At EP2 (two data-parallel ranks, alltoall dispatcher) the step's aux loss covers both ranks'
    micro-batches; at CP2 each rank holds part of every sample (and one rank only the padding of a
    1-token sample, which used to crash seq_aux_loss's all-reduce): the gradient is coeff x its
    gradient in both, under a per-token, a per-pair and a per-sample stage."""
    from tests import moe_aux_utils as aux
    from tests.dist_harness import run_distributed

    routing_types = ("aux_loss", "seq_aux_loss")
    results = run_distributed(aux.rank_aux_grads, 2, str(converted["root"] / "hf"), flags, cases, routing_types, 3,
                              timeout=300, threads_per_process=1, env={"OMP_NUM_THREADS": "1"})
    for case in cases:
        step = [mb for rank in range(data_parallel) for mb in aux.case_micro_batches(case, 3 + rank)]
        for routing_type in routing_types:
            theirs = aux.expected_aux_grads(converted["model"], step, routing_type, coeff=1.0)
            for rank in (0, 1):
                _assert_same_aux_grads(results[rank][case, routing_type], theirs, (layout, rank, routing_type, case))


def test_model_flops_count_the_active_experts():
    """Throughput counts an MoE layer's top-k experts, not all of them nor a dense FFN: Qwen3-30B-A3B
    runs ~3B parameters per token (the published 3.3B includes the input embedding)."""
    import types

    from mindspeed_pack.packing.balance import cost_model

    args = types.SimpleNamespace(hidden_size=2048, num_layers=48, num_attention_heads=32, kv_channels=128,
                                 num_query_groups=4, ffn_hidden_size=6144, padded_vocab_size=151936, swiglu=True,
                                 num_experts=128, moe_layer_freq=1, moe_ffn_hidden_size=768, moe_router_topk=8)
    active = cost_model(args).linear / 2  # FLOPs per token = 2 x parameters used
    assert 2.9e9 < active < 3.2e9


def test_te_names_keep_moe_layers_own_norm_and_map_grouped_experts():
    """On the TE spec a dense layer's pre-MLP norm is fused into linear_fc1 but an MoE layer keeps its
    own, and --moe-grouped-gemm stores expert j as weight{j}: checkpoints keep the local names."""
    from mindspeed_pack.convert.megatron_layout import to_backend_names, to_canonical_names

    canonical = {"decoder.layers.0.pre_mlp_layernorm.weight": torch.ones(2),
                 "decoder.layers.1.pre_mlp_layernorm.weight": torch.ones(2),
                 "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight": torch.ones(2),
                 "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight": torch.ones(2)}
    te_module = ["decoder.layers.0.mlp.linear_fc1.layer_norm_weight", "decoder.layers.1.pre_mlp_layernorm.weight",
                 "decoder.layers.1.mlp.experts.linear_fc1.weight3", "decoder.layers.1.mlp.experts.linear_fc2.weight3"]
    te = to_backend_names(canonical, "te", te_module)
    assert sorted(te) == sorted(te_module)
    assert sorted(to_canonical_names(te)) == sorted(canonical)


@pytest.mark.parametrize("extra,world,message", [
    (["--tensor-model-parallel-size", "2"], 2, "needs --sequence-parallel"),
    (["--expert-model-parallel-size", "3", "--global-batch-size", "6"], 3, "must divide --num-experts 4"),
    (["--moe-layer-freq", "[0,1,1]"], 1, "--moe-layer-freq lists 3 layers"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2"], 2,
     "must divide the data-parallel size 1 (world size 2 / TP 2 x PP 1 x CP 1): launch a multiple of 4 processes"),
], ids=["tp-without-sp", "ep-experts", "layer-freq", "ep-over-dp"])
def test_moe_flag_combinations_are_refused_by_name(extra, world, message, capsys):
    from mindspeed_pack.config.arguments import parse_args
    from tests.model_utils import TINY_FLAGS

    with pytest.raises(SystemExit):
        parse_args([*TINY_FLAGS, *MOE_FLAGS, "--data-path", "data", *extra], world_size=world)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("balancing,warned", [("aux_loss", True), ("seq_aux_loss", False)])
def test_token_level_aux_loss_with_packing_is_warned_about(balancing, warned, caplog):
    """aux_loss's gradient depends on how many samples share a row (measured under GRPO: grad norm 9.1e-5, 6.5e-5,
    2.4e-5 at 1, 2, 4 rollouts per row); seq_aux_loss does not: choosing aux_loss on packed data is warned about."""
    import logging

    from mindspeed_pack.config.arguments import parse_args
    from tests.model_utils import TINY_FLAGS

    flags = [a for a in MOE_FLAGS]
    if "--moe-router-load-balancing-type" in flags:
        i = flags.index("--moe-router-load-balancing-type")
        del flags[i:i + 2]
    with caplog.at_level(logging.WARNING):
        parse_args([*TINY_FLAGS, *flags, "--data-path", "data", "--neat-pack", "--moe-aux-loss-coeff", "0.01",
                    "--moe-router-load-balancing-type", balancing, "--train-iters", "1"])
    assert any("seq_aux_loss balances each sample" in r.message for r in caplog.records) == warned


def test_a_hf_load_says_its_router_aux_loss_coef_is_not_applied(converted, caplog):
    """A Qwen3-MoE --load keeps Megatron-LM's --moe-aux-loss-coeff 0 (a training setting, not the model's), while
    config.json has router_aux_loss_coef: one line says the aux loss is logged but adds no gradient, unless given."""
    import logging

    from mindspeed_pack.config.arguments import parse_args

    hf = str(converted["root"] / "hf")
    coef = json.load(open(os.path.join(hf, "config.json")))["router_aux_loss_coef"]
    flags = ["--load", hf, "--data-path", "data", "--neat-pack", "--seq-length", "64", "--train-iters", "1"]
    with caplog.at_level(logging.INFO, logger="mindspeed_pack.config.hf_flags"):
        assert parse_args(flags).moe_aux_loss_coeff == 0.0
    said = [r.getMessage() for r in caplog.records if "router_aux_loss_coef" in r.getMessage()]
    assert said == [f"--load {hf}: config.json's router_aux_loss_coef {coef} is not applied (--moe-aux-loss-coeff 0.0: "
                    "the load-balancing loss is logged as 'moe aux loss' but adds no gradient); pass "
                    f"--moe-aux-loss-coeff {coef} to train with it"], said
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mindspeed_pack.config.hf_flags"):
        assert parse_args([*flags, "--moe-aux-loss-coeff", str(coef)]).moe_aux_loss_coeff == coef
    assert not [r for r in caplog.records if "router_aux_loss_coef" in r.getMessage()]


def test_router_aux_loss_coef_of_config_json_survives_the_round_trip(tmp_path):
    """config.json's router_aux_loss_coef came back as transformers' default 0.001 (HF -> Megatron -> HF)."""
    import transformers

    config = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(tmp_path / "hf")
    hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "mg"), 1, 1, ep=2)
    megatron_to_hf(str(tmp_path / "mg"), str(tmp_path / "back"))
    assert json.load(open(tmp_path / "back" / "config.json"))["router_aux_loss_coef"] == 0.02


def test_shared_experts_forced_onto_qwen3_moe_are_not_called_a_dense_conversion(tmp_path):
    """--model-type-hf qwen3_moe on a Qwen2-MoE config said 'qwen3_moe is converted as a dense model'."""
    import transformers

    config = transformers.Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, num_experts=4, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=32)
    transformers.Qwen2MoeForCausalLM(config).save_pretrained(tmp_path / "hf")
    with pytest.raises(ConversionError) as e:
        hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "mg"), 1, 1, model_type_hf="qwen3_moe")
    assert "shared_expert_intermediate_size" in str(e.value) and "dense" not in str(e.value)


def test_reshard_of_an_ep2_training_checkpoint_names_its_ep(converted, tmp_path, caplog):
    """The warning said 'to continue that run, resume at TP=1, PP=1' for a run saved at EP2 (which a resume at
    EP1 refuses without --no-load-optim)."""
    import logging

    from mindspeed_pack.convert import megatron_to_megatron

    ep2 = tmp_path / "ep2"
    hf_to_megatron(str(converted["root"] / "hf"), str(ep2), 1, 1, padded_vocab_size=VOCAB, ep=2)
    os.rename(ep2 / "release", ep2 / "iter_0000003")  # as a training run saves it
    (ep2 / "latest_checkpointed_iteration.txt").write_text("3")
    with caplog.at_level(logging.WARNING, logger="mindspeed_pack.convert.convert"):
        megatron_to_megatron(str(ep2), str(tmp_path / "ep1"), 1, 1, ep=1)
    assert "resume at TP=1, PP=1, --expert-model-parallel-size 2" in caplog.text


# --------------------------------------------------------------------------- Mixtral
# a tiny random transformers Mixtral: every layer sparse, experts under block_sparse_moe.experts.{j}.w1/w3/w2
MIXTRAL_FLAGS = (
    "--num-layers 2 --hidden-size 32 --ffn-hidden-size 48 --num-attention-heads 4 --group-query-attention "
    "--num-query-groups 2 --disable-bias-linear --swiglu --normalization RMSNorm --norm-epsilon 1e-5 "
    "--rotary-base 1000000 --untie-embeddings-and-output-weights --padded-vocab-size 256 "
    "--position-embedding-type rope --num-experts 4 --moe-router-topk 2 --attention-dropout 0.0 --hidden-dropout 0.0 "
    "--log-interval 1 --eval-iters 0 --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 0.01 "
    "--seq-length 128 --micro-batch-size 2 --global-batch-size 4 --neat-pack --train-iters 3 --lr 1e-3"
).split()


def build_mixtral(path):
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
        bos_token_id=1, eos_token_id=EOS, pad_token_id=EOS)
    torch.manual_seed(7)
    spread_weights(transformers.MixtralForCausalLM(config)).save_pretrained(path)
    return str(path)


def test_mixtral_converts_at_ep2_and_trains_packed_from_its_hf_directory(tmp_path):
    """Mixtral (MixtralForCausalLM) at --target-expert-parallel-size 2 goes HF -> Megatron -> HF bit-exact under
    the published names (block_sparse_moe.gate, experts.{j}.w1/w3/w2); loaded straight from its HF directory it
    trains packed SFT steps at EP2 (alltoall) as in one process, and --save-hf at EP2 writes a Mixtral that
    transformers loads."""
    import transformers

    from mindspeed_pack.convert.convert import main as convert_main
    from tests.train_utils import run_posttrain, write_copy_task

    hf = build_mixtral(tmp_path / "hf")
    assert convert_main(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", hf, "--save-dir",
                         str(tmp_path / "mg_ep2"), "--target-expert-parallel-size", "2",
                         "--padded-vocab-size", str(VOCAB)]) == 0
    megatron_to_hf(str(tmp_path / "mg_ep2"), str(tmp_path / "back"))
    original, back = load_file(os.path.join(hf, "model.safetensors")), load_file(tmp_path / "back" / "model.safetensors")
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in back and \
        "model.layers.0.block_sparse_moe.gate.weight" in back
    assert sorted(original) == sorted(back) and all(torch.equal(original[k], back[k]) for k in original)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (config["architectures"], config["num_local_experts"], config["num_experts_per_tok"],
            config["intermediate_size"]) == (["MixtralForCausalLM"], 4, 2, 48)
    assert not {"norm_topk_prob", "mlp_only_layers", "moe_intermediate_size", "num_experts"} & set(config)

    data = write_copy_task(str(tmp_path / "data"), num_packs=12)
    runs = {}
    for name, nproc, extra in (("one", 1, []),
                               ("ep2", 2, [*EP2, "--save-hf", str(tmp_path / "hf_out")])):
        _, records = run_posttrain(["--data-path", data, "--load", hf, *extra], nproc=nproc, model_flags=MIXTRAL_FLAGS,
                                   metrics=str(tmp_path / f"{name}.jsonl"))
        runs[name] = [r for r in records if r["split"] == "train"]
    assert len(runs["one"]) == 3
    for got, want in zip(runs["ep2"], runs["one"], strict=True):
        for key in ("lm loss", "moe aux loss", "grad norm"):
            assert abs(got[key] - want[key]) <= 1e-5 * abs(want[key]), (got["iteration"], key)
        assert got["tokens per expert"] == want["tokens per expert"], got["iteration"]
    assert sum(runs["one"][0]["tokens per expert"][0]) == 2 * runs["one"][0]["tokens"]  # top-2 of every real token
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf_out"))
    assert type(exported).__name__ == "MixtralForCausalLM"
    assert not torch.equal(exported.model.layers[1].mlp.experts.down_proj,
                           transformers.AutoModelForCausalLM.from_pretrained(hf).model.layers[1].mlp.experts.down_proj)


@pytest.mark.parametrize("extra,lost", [
    (["--qk-layernorm", "--moe-ffn-hidden-size", "16"], None),  # Qwen3-MoE, every layer MoE as examples/qwen3_moe
    ([], None),  # Mixtral: experts --ffn-hidden-size wide
    (["--moe-layer-freq", "[0,1]"], r"--moe-layer-freq \[0, 1\] \(a MixtralForCausalLM has \[1, 1\]\)"),
    (["--moe-router-pre-softmax"], r"--moe-router-pre-softmax True \(a MixtralForCausalLM has False\)"),
], ids=["qwen3_moe", "mixtral", "mixtral-dense-layer", "mixtral-pre-softmax"])
def test_save_hf_of_a_moe_model_given_by_flags(extra, lost, tmp_path):
    """--save-hf of an MoE model given by flags (Megatron-LM's --moe-layer-freq 1, no --moe-ffn-hidden-size) was
    refused before training: '--moe-layer-freq 1 (a Qwen3MoeForCausalLM has [1, 1])', the same model compared as
    written, not as built. What the family cannot hold is still named."""
    from mindspeed_pack.checkpoint.errors import CheckpointError
    from mindspeed_pack.checkpoint.hf_checkpoint import check_exportable
    from mindspeed_pack.config.arguments import parse_args

    flags = [f for f in MIXTRAL_FLAGS if f != "--neat-pack"]
    args = parse_args([*flags, *extra, "--data-path", "unused", "--save-hf", str(tmp_path / "hf")])
    if lost is None:
        check_exportable(args)
    else:
        with pytest.raises(CheckpointError, match=lost):
            check_exportable(args)


def test_fused_experts_in_memory_layout_are_refused_naming_save_pretrained(tmp_path):
    """A Mixtral whose files hold transformers' in-memory experts (mlp.experts.gate_up_proj, as a raw
    model.state_dict() saves them; transformers loads them too) was refused as '26 tensors the config implies are
    missing'; the error now says what the files hold and how to write the per-expert layout."""
    import shutil

    import transformers
    from safetensors.torch import save_file

    hf = build_mixtral(tmp_path / "hf")
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(os.path.join(hf, "config.json"), fused / "config.json")
    state = transformers.AutoModelForCausalLM.from_pretrained(hf).state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(fused / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"'model.layers.0.mlp.experts.(gate_up|down)_proj' holds every expert "
                                              r".*'model.layers.0.block_sparse_moe.experts.0.w1.weight'.*"
                                              r"save_pretrained\(NEW_DIR\)"):
        hf_to_megatron(str(fused), str(tmp_path / "mg"), 1, 1)

"""``--dry-run``'s plan (mindspeed_pack/training/run_plan.py): the memory it estimates and the micro-batch it suggests
are what megatron-core would hold and what keeps a pipeline busy."""
from __future__ import annotations

import os

import pytest

from mindspeed_pack.config.arguments import parse_args
from mindspeed_pack.training import run_plan

ROOT = os.path.join(os.path.dirname(__file__), "..")
QWEN3_MOE = os.path.join(ROOT, "configs", "sft", "qwen3_30b_a3b_4k_full_pack.yaml")
GiB = 1024 ** 3


def moe_args(*extra, world_size=16):
    """configs/sft/qwen3_30b_a3b_4k_full_pack.yaml at 16 GPUs: TP 4 x PP 2 x DP 2, EP 2 (no data, no weights)."""
    return parse_args(["--config", QWEN3_MOE, *extra], world_size=world_size)


def test_expert_optimizer_state_is_sharded_over_the_expert_data_parallel_group_only():
    """megatron-core's distributed optimizer shards a dense parameter's state over DP x CP, an expert's over the
    expert-data-parallel group, world / (ETP x EP x PP) ranks: Qwen3-30B-A3B at TP4 PP2 EP2 on 16 GPUs keeps its
    1.81B expert parameters' state whole on every rank (21.35 GiB, not the 11.20 GiB of everything over DP 2)."""
    args = moe_args()
    h, layers, tp, pp, ep = 2048, 48, 4, 2, 2
    experts = layers // pp * 128 * 3 * h * 768 / (tp * ep)  # gate, up, down of 128 experts
    attention = h * (32 + 2 * 4) * 128 + 32 * 128 * h
    dense = layers // pp * (attention / tp + h * 128) + 151936 * h / tp  # + the router, + the embedding (stage 1)
    assert (round(experts / 1e6), round(dense / 1e6)) == (1812, 197)
    m = run_plan.memory_estimate(args)
    assert m["optimizer"] == pytest.approx((dense / 2 + experts) * 12 / GiB)
    assert round(m["optimizer"], 2) == 21.35
    # EP 1: the expert-data-parallel group is the data-parallel group, every state sharded over DP 2
    one = run_plan.memory_estimate(moe_args("--expert-model-parallel-size", "1"))
    assert one["optimizer"] == pytest.approx((dense + experts * ep) / 2 * 12 / GiB)


def test_activations_follow_the_mlp_shape_and_an_moe_layers_top_k_copies():
    """Korthikanti's 34h per token assumes a 4h GELU MLP; the estimate takes the MLP from the model: a GELU 4h
    model gives exactly 34h (under sequence parallelism, all of it split over TP), a SwiGLU one keeps its gated
    intermediate, and an MoE layer keeps each of a token's top-k copies through its expert (Qwen3-30B-A3B: the
    estimate was that of a dense 4h GELU layer, 3.19 GiB at TP4, about half the real figure)."""
    h = 2048
    from types import SimpleNamespace

    gelu = SimpleNamespace(num_layers=2, hidden_size=h, num_attention_heads=16, ffn_hidden_size=None, swiglu=False,
                           num_experts=None, tensor_model_parallel_size=4, sequence_parallel=True)
    assert run_plan.layer_activation_bytes(gelu) == 34 * h / 4
    args = moe_args()  # TP 4, SP, 48 MoE layers of 128 experts, top-8, expert FFN 768, SwiGLU
    moe = 10 * h + 8 * h + 8 * (4 * h + 6 * 768)
    assert run_plan.layer_activation_bytes(args) == moe / 4
    m = run_plan.memory_estimate(args)  # stage 1 of PP 2 holds 2 micro-batches in flight under 1F1B
    assert m["activations"] == pytest.approx(4096 * moe / 4 * 24 * 2 / GiB)  # 24 layers, the logits on stage 2
    assert round(m["activations"], 2) == 6.38


def test_micro_batch_suggestion_keeps_a_pipeline_busy(monkeypatch):
    """Under PP 2 a micro-batch size that leaves one micro-batch per step idles a stage (1F1B): --dry-run suggests
    only sizes that keep at least PP micro-batches per step, and says so."""
    monkeypatch.setattr(run_plan, "device_memory_gib", lambda: (80.0, "test"))
    args = moe_args()  # global batch 16 = micro-batch 1 x DP 2 x 8 micro-batches
    assert run_plan.largest_micro_batch(args, 80.0)[0] == 8  # 8 fit, but 16 / (8 x DP 2) = 1 micro-batch
    line = run_plan._micro_batch_line(args)
    assert "--micro-batch-size 4 trains the same losses" in line, line
    assert line.endswith("4, not 8: the largest that keeps at least PP 2 micro-batches per step at "
                         "--global-batch-size 16, since fewer idle a pipeline stage under 1F1B"), line
    small = moe_args("--global-batch-size", "4")  # 4 = 1 x DP 2 x 2: any larger size leaves one micro-batch
    line = run_plan._micro_batch_line(small)
    assert "--micro-batch-size 2" not in line and "keep --micro-batch-size 1: a larger one leaves fewer than PP 2 " \
        "micro-batches per step at --global-batch-size 4" in line, line
    assert line.endswith("--global-batch-size 32 would take --micro-batch-size 8"), line


def test_epochs_note_and_layout_describe_load_time_packing_alike(tmp_path):
    """Under dp_balanced the global batch counts samples packed at load time into as many micro-batches as they fill
    (the layout line); the --train-epochs note said 'micro-batch 1 x data-parallel 1 x 16 micro-batches'."""
    from tests.data_utils import write_packed_instruction_dataset
    from tests.model_utils import TINY_FLAGS

    data = write_packed_instruction_dataset(str(tmp_path / "d"), num_packs=40, meta=True)
    common = [*TINY_FLAGS, "--data-path", data, "--neat-pack", "--seq-length", "128", "--global-batch-size", "16",
              "--train-epochs", "1"]
    for scheduler, batch in (("dp_balanced", "16 samples on data-parallel 1, packed at load time into as many "
                                             "micro-batches as they fill"),
                             ("none", "micro-batch 1 x data-parallel 1 x 16 micro-batches")):
        args = parse_args([*common, "--sequence-packing-scheduler", scheduler],
                          extra_args_provider=run_plan.train_epochs_arg)
        run_plan.resolve_epochs(args)
        assert f"/ global batch 16 ({batch}) = 3 iterations" in args.epochs_note, args.epochs_note
        layout = next(line for line in run_plan.plan_lines(args) if line.startswith("layout:"))
        assert ("packed at load time" in layout) == (scheduler == "dp_balanced"), layout


CP_32K = os.path.join(ROOT, "configs", "sft", "qwen25_7b_32k_full_pack_cp.yaml")


def test_memory_estimate_counts_the_rows_packed_at_load_time(tmp_path):
    """dp_balanced on unpacked data packs rows of CP x --max-seqlen-per-dp-cp-rank tokens (default --seq-length), so
    a rank holds --max-seqlen-per-dp-cp-rank tokens, not --seq-length / CP: the 32k CP2 recipe's estimate at
    dp_balanced is that of a 64k row split over CP 2 (it said 17.66 GiB of activations, those of a 32k row)."""
    from tests.test_dynamic_cp import write_long_tail

    def estimate(*extra, data=None):
        args = parse_args(["--config", CP_32K, *(["--data-path", data] if data else []), *extra], world_size=8)
        return run_plan.memory_estimate(args), run_plan._loss_line(args)

    unpacked = write_long_tail(str(tmp_path / "docs"))
    balanced = ["--sequence-packing-scheduler", "dp_balanced"]
    assert estimate(*balanced, data=unpacked) == estimate("--seq-length", "65536")
    assert estimate(*balanced, "--max-seqlen-per-dp-cp-rank", "8192", data=unpacked) == \
        estimate("--seq-length", "16384")
    # offline packs are only assigned to ranks: a rank holds --seq-length / CP of each, as without a scheduler
    packed = write_long_tail(str(tmp_path / "packs"))
    with open(f"{packed}_packed_meta.json", "w") as f:
        f.write('{"layout": {"kind": "packed", "seq_length": 32768, "neat_pack": true}}')
    assert estimate(*balanced, data=packed) == estimate()


def test_a_reward_models_plan_counts_its_score_head_not_a_vocabulary():
    """--stage orm swaps the output layer for a hidden -> 1 score head: the plan counted Qwen2.5-7B's 0.54B-row
    output layer and its fp32 logits (7.62B parameters, 2 GiB per GPU too many)."""
    import posttrain

    args = parse_args(["--config", os.path.join(ROOT, "configs", "orm", "qwen25_7b_4k_orm_pack.yaml")], world_size=8,
                      extra_args_provider=posttrain.posttrain_args)
    assert args.reward_head
    total, _, _ = run_plan.parameters_per_rank(args)
    assert round(total / 1e9, 2) == 7.07
    assert run_plan._loss_line(args).startswith("loss: the score head's")
    head_off = run_plan.memory_estimate(type(args)(**{**vars(args), "reward_head": False}))
    assert run_plan.memory_estimate(args)["activations"] < head_off["activations"]


def test_a_dpo_plan_counts_its_reference_model():
    """--stage dpo (and kto) builds a frozen reference model beside the policy, a second copy of its weights: the plan
    left it out (Qwen2.5-7B at TP4, bf16: 27.20 GiB per GPU where the run holds 3.55 GiB more); --ref-logps and a
    reference-free stage hold none."""
    import posttrain

    def estimate(*extra):
        args = parse_args(["--config", os.path.join(ROOT, "configs", "dpo", "qwen25_7b_4k_dpo_pack.yaml"), *extra],
                          world_size=8, extra_args_provider=posttrain.posttrain_args)
        return run_plan.memory_estimate(args)

    dpo, table, simpo = estimate(), estimate("--ref-logps"), estimate("--stage", "simpo")
    assert dpo["reference model"] == pytest.approx(dpo["weights"]) and round(dpo["reference model"], 2) == 3.55
    assert dpo["total"] == pytest.approx(table["total"] + dpo["weights"])
    assert table["reference model"] == simpo["reference model"] == 0
    assert estimate("--stage", "kto")["reference model"] == dpo["reference model"]


def test_a_model_the_hosts_memory_cannot_hold_stops_before_anything_is_built(tmp_path, monkeypatch):
    """Without a CUDA device the tensors live in host memory: `bash examples/qwen25/tune_qwen25_7b_4k_full_pack.sh` on
    a CPU machine built Qwen2.5-7B in 8 processes until the kernel killed them (torchrun's SIGKILL summary, no word of
    why, and a --save claimed). posttrain.py now stops first with --dry-run's estimate x the host's processes."""
    import posttrain
    from mindspeed_pack.config.errors import ArgumentError

    monkeypatch.setattr(run_plan, "cuda_usable", lambda: False)
    monkeypatch.setattr(run_plan, "host_memory_gib", lambda: 20.0)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    save = tmp_path / "ckpt"
    with pytest.raises(ArgumentError, match=r"no CUDA device: this run would hold about 27\.20 GiB per process .* "
                                            r"x 8 process\(es\) on this host = 217\.6 GiB, and the host has 20\.0 GiB "
                                            r"free: run it on GPUs \(--dry-run"):
        posttrain.main(["--config", os.path.join(ROOT, "configs", "sft", "qwen25_7b_4k_full_pack.yaml"),
                        "--save", str(save)])
    assert not save.exists()
    # a model that fits (the quickstart's) is not stopped
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    quickstart = parse_args(["--config", os.path.join(ROOT, "configs", "quickstart.yaml"), "--data-path",
                             str(tmp_path / "sft")], extra_args_provider=posttrain.posttrain_args)
    run_plan.check_host_memory(quickstart)


def test_a_plan_without_a_gpu_says_the_fine_tuning_defaults_train_bf16_on_one(tmp_path, monkeypatch):
    """A --load HF_DIR --stage sft run gets --bf16 from the fine-tuning defaults on a GPU that has it, and stays in
    fp32 where none is visible: the plan sized the GPU job (an H100 assumed) in fp32 without a word, so a job
    planned on a login node was estimated for the wrong precision."""
    import posttrain
    from mindspeed_pack.config import finetune_defaults
    from tests.model_utils import write_converted_tiny_qwen2

    write_converted_tiny_qwen2(tmp_path)
    monkeypatch.setattr(finetune_defaults, "bf16_supported", lambda: False)

    def plan(*extra):
        args = parse_args(["--load", str(tmp_path / "hf"), "--data-path", str(tmp_path / "none"), "--seq-length",
                           "128", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4", "--dry-run", *extra],
                          world_size=1, extra_args_provider=posttrain.posttrain_args)
        return args, [line for line in run_plan.plan_lines(args) if line.startswith("precision:")]

    args, lines = plan()
    assert not args.bf16 and len(lines) == 1, lines
    bf16_args, _ = plan("--bf16")
    assert lines[0].startswith("precision: fp32 here (no GPU visible); on a GPU with bf16 the fine-tuning defaults "
                               "turn on --bf16")
    assert f"(estimate) {run_plan.memory_estimate(bf16_args)['total']:.2f} GiB; pass --bf16" in lines[0]
    assert plan("--bf16")[1] == plan("--fp16")[1] == []


def test_the_fused_losss_fp32_weight_gradient_buffer_is_counted_in_fp32_runs_too():
    """The chunked loss sums a trained output layer's gradient in an fp32 buffer of the weight's shape whatever the
    weight's dtype (vocab_cross_entropy.py: ``promote_types(weight.dtype, float32)``); the plan counted it only in
    bf16/fp16 (Qwen2.5-7B at TP1 in fp32: 2.03 GiB left out)."""
    from types import SimpleNamespace

    def activations(**changes):
        args = SimpleNamespace(**{**vars(lora_free_qwen7b()), **changes})
        return run_plan.memory_estimate(args)["activations"] * GiB

    assert run_plan.loss_path(lora_free_qwen7b()) > 0  # 2 packs of 4096 tokens: over the unfused loss's budget
    buffer, chunk = 152064 * 3584 * 4, run_plan.loss_path(lora_free_qwen7b())
    layers = 8192 * run_plan.layer_activation_bytes(lora_free_qwen7b()) * 28  # 16-bit bytes of 2 packs
    assert activations() == pytest.approx(2 * layers + chunk * 152064 * 8 + buffer)
    assert activations(bf16=True) == pytest.approx(layers + chunk * 152064 * 8 + buffer)
    unfused = activations(micro_batch_size=1)  # the unfused loss: megatron-core's, no such buffer
    assert unfused == pytest.approx(layers + 4096 * 152064 * 8)


def lora_free_qwen7b():
    """Qwen2.5-7B's flags at TP1, fp32, micro-batch 2 of 4096 tokens (a namespace as the parser would give)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28, num_query_groups=4,
        kv_channels=None, swiglu=True, add_qkv_bias=True, padded_vocab_size=152064, max_position_embeddings=4096,
        position_embedding_type="rope", untie_embeddings_and_output_weights=True, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, expert_model_parallel_size=1, context_parallel_size=1, data_parallel_size=1,
        use_distributed_optimizer=False, bf16=False, fp16=False, optimizer="adam", seq_length=4096,
        micro_batch_size=2, sequence_parallel=False, num_micro_batches=1, num_experts=None, lora_r=None)


def test_the_plan_says_what_a_step_costs_and_given_a_peak_how_long_the_run_takes():
    """--dry-run gave memory but no compute: sizing a job's hours took a hand count. The line's FLOPs are the model
    FLOPs the training log counts (6 x the linear weights a token passes through, plus causal attention), for full
    rows whose attention runs from none to one sample per row."""
    from tests.model_utils import TINY_FLAGS

    flags = [*TINY_FLAGS, "--seq-length", "512", "--global-batch-size", "8", "--train-iters", "1000", "--data-path", "x"]
    args = parse_args(flags)
    hidden, ffn, head_dim, heads, groups, layers, vocab = 64, 128, 16, 4, 2, 2, 256
    per_layer = hidden * heads * head_dim + 2 * hidden * groups * head_dim + heads * head_dim * hidden + 3 * hidden * ffn
    tokens = 8 * 512
    low = 6 * (layers * per_layer + hidden * vocab) * tokens
    high = low + 6 * layers * heads * head_dim * 8 * 512 ** 2
    assert run_plan.step_flops(args) == (pytest.approx(low, rel=1e-12), pytest.approx(high, rel=1e-12))
    line = next(x for x in run_plan.plan_lines(args) if x.startswith("compute:"))
    assert f"{low / 1e15:.3g}-{high / 1e15:.3g} PFLOP per step" in line and "--peak-tflops P" in line
    timed = next(x for x in run_plan.plan_lines(parse_args([*flags, "--peak-tflops", "100"]))
                 if x.startswith("compute:"))
    rate = 100e12 * run_plan.ASSUMED_MFU  # one device
    assert f"{low / rate:.3g}-{high / rate:.3g} s per step" in timed
    assert f"{1000 * low / rate / 3600:.3g}-{1000 * high / rate / 3600:.3g} h for 1000 iterations" in timed

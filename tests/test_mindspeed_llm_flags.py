"""MindSpeed-LLM's own flags: a MindSpeed-LLM tune script's flags parse, and each means here what it means there
(translated, checked, accepted as an Ascend optimisation with a warning, or refused by name); Megatron-LM's
``--manual-gc``, ``--exit-on-missing-checkpoint`` and ``--calculate-per-token-loss``; ``--no-shared-storage``.
"""
import gc
import logging
import shlex

import pytest

import posttrain
from mindspeed_pack.checkpoint.errors import CheckpointError
from mindspeed_pack.config.arguments import build_parser, parse_args
from mindspeed_pack.training.manual_gc import ManualGC
from mindspeed_pack.training.raw_data import node_leaders
from tests.dist_harness import run_distributed
from tests.model_utils import TINY_FLAGS
from tests.train_utils import sft_trainer, write_copy_task

# the flags of MindSpeed-LLM's tune scripts (Qwen3-8B full, Qwen3-30B-A3B MoE, Qwen2.5-7B LoRA; shapes made tiny,
# paths local; --no-pad-to-seq-lengths, refused here, dropped), as their GPT/DATA/CKPT/TUNE blocks pass them
QWEN3_TUNE = """--use-mcore-models --spec mindspeed_llm.tasks.models.spec.qwen3_spec layer_spec --kv-channels 16
    --qk-layernorm --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --sequence-parallel
    --use-distributed-optimizer --use-flash-attn --num-layers 2 --hidden-size 64 --use-rotary-position-embeddings
    --num-attention-heads 4 --ffn-hidden-size 128 --max-position-embeddings 4096 --seq-length 128
    --make-vocab-size-divisible-by 1 --padded-vocab-size 256 --rotary-base 1000000 --micro-batch-size 1
    --global-batch-size 2 --disable-bias-linear --train-iters 2 --swiglu --tokenizer-type PretrainedFromHF
    --normalization RMSNorm --position-embedding-type rope --norm-epsilon 1e-6 --hidden-dropout 0
    --attention-dropout 0 --no-gradient-accumulation-fusion --attention-softmax-in-fp32 --exit-on-missing-checkpoint
    --no-masked-softmax-fusion --group-query-attention --untie-embeddings-and-output-weights --num-query-groups 2
    --min-lr 1.25e-7 --lr 1.25e-6 --weight-decay 1e-1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
    --initial-loss-scale 4096 --no-load-optim --no-load-rng --seed 42 --bf16 --ckpt-format torch
    --handler-name AlpacaStyleInstructionHandler --enable-thinking true --prompt-type qwen3 --workers 4
    --split 100,0,0 --log-interval 1 --save-interval 1000 --eval-interval 1000 --eval-iters 0 --finetune
    --stage sft --is-instruction-dataset"""
QWEN3_MOE_TUNE = """--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-grouped-gemm
    --moe-permutation-async-comm --moe-token-dispatcher-type alltoall_seq --moe-router-load-balancing-type aux_loss
    --moe-layer-freq -1 --first-k-dense-replace -1 --moe-aux-loss-coeff 0.001 --use-flash-attn
    --use-fused-rotary-pos-emb --sequence-parallel --use-rotary-position-embeddings --use-fused-swiglu
    --use-fused-rmsnorm --no-masked-softmax-fusion --use-distributed-optimizer --micro-batch-size 1
    --global-batch-size 2 --lr 1.25e-5 --lr-decay-style cosine --min-lr 1.25e-7 --weight-decay 1e-1
    --lr-warmup-fraction 0.01 --attention-dropout 0.0 --init-method-std 0.01 --hidden-dropout 0.0 --clip-grad 1.0
    --adam-beta1 0.9 --adam-beta2 0.95 --initial-loss-scale 4096 --seed 42 --bf16 --train-iters 2 --seq-length 128
    --no-shared-storage --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
    --expert-model-parallel-size 1 --use-mcore-models --spec mindspeed_llm.tasks.models.spec.qwen3_spec layer_spec
    --kv-channels 16 --qk-layernorm --norm-topk-prob --max-position-embeddings 128 --num-layers 2 --hidden-size 64
    --ffn-hidden-size 128 --num-attention-heads 4 --tokenizer-type PretrainedFromHF --make-vocab-size-divisible-by 1
    --padded-vocab-size 256 --rotary-base 1000000 --untie-embeddings-and-output-weights --disable-bias-linear
    --position-embedding-type rope --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --attention-softmax-in-fp32
    --no-gradient-accumulation-fusion --group-query-attention --num-query-groups 2 --ckpt-format torch
    --handler-name AlpacaStyleInstructionHandler --split 100,0,0 --log-interval 1 --save-interval 2
    --eval-interval 2 --eval-iters 0 --no-load-optim --no-load-rng --finetune --stage sft --is-instruction-dataset
    --tokenizer-not-use-fast --prompt-type qwen3"""
QWEN25_LORA_TUNE = """--use-mcore-models --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
    --sequence-parallel --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4
    --max-position-embeddings 128 --seq-length 128 --disable-bias-linear --add-qkv-bias --group-query-attention
    --num-query-groups 2 --use-flash-attn --swiglu --use-fused-swiglu --normalization RMSNorm --norm-epsilon 1e-6
    --use-fused-rmsnorm --position-embedding-type rope --rotary-base 1000000 --use-fused-rotary-pos-emb
    --untie-embeddings-and-output-weights --micro-batch-size 1 --global-batch-size 2 --make-vocab-size-divisible-by 1
    --padded-vocab-size 256 --lr 1.25e-6 --train-iters 2 --lr-decay-style cosine --attention-dropout 0.0
    --init-method-std 0.01 --hidden-dropout 0.0 --no-masked-softmax-fusion --attention-softmax-in-fp32
    --min-lr 1.25e-7 --weight-decay 1e-1 --lr-warmup-fraction 0.01 --clip-grad 1.0 --adam-beta1 0.9
    --initial-loss-scale 4096 --adam-beta2 0.95 --no-gradient-accumulation-fusion --no-load-optim --no-load-rng
    --seed 42 --bf16 --lora-r 8 --lora-alpha 16 --lora-fusion --lora-target-modules linear_qkv linear_proj
    linear_fc1 linear_fc2 --lora-ckpt-filter --lora-register-forward-hook word_embeddings input_layernorm --split 100,0,0 --log-interval 1 --save-interval 1000
    --eval-interval 1000 --eval-iters 0 --finetune --stage sft --is-instruction-dataset --prompt-type qwen"""
# MindSpeed-LLM's tune_mixtral_8x7B_full_ptd.sh (shapes tiny): Megatron-LM's deprecated --no-position-embedding and
# --no-check-for-nan-in-loss-and-grad were unrecognized arguments
MIXTRAL_TUNE = """--num-experts 4 --expert-model-parallel-size 1 --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.02 --moe-permutation-async-comm
    --moe-layer-freq -1 --first-k-dense-replace -1 --moe-token-dispatcher-type alltoall_seq --use-mcore-models
    --disable-bias-linear --seq-length 128 --max-position-embeddings 128 --num-layers 2 --hidden-size 64
    --ffn-hidden-size 128 --num-attention-heads 4 --init-method-std 0.02 --attention-dropout 0.0 --hidden-dropout 0.0
    --normalization RMSNorm --prompt-type mixtral --variable-seq-lengths --use-rotary-position-embeddings
    --position-embedding-type rope --no-check-for-nan-in-loss-and-grad --overlap-grad-reduce --overlap-param-gather
    --use-distributed-optimizer --swiglu --untie-embeddings-and-output-weights --group-query-attention
    --num-query-groups 2 --no-position-embedding --vocab-size 256 --rotary-base 1000000 --norm-epsilon 1e-5
    --no-masked-softmax-fusion --use-fused-rotary-pos-emb --use-flash-attn --use-fused-swiglu --use-fused-rmsnorm
    --make-vocab-size-divisible-by 1 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
    --sequence-parallel --context-parallel-size 1 --context-parallel-algo megatron_cp_algo
    --tokenizer-type PretrainedFromHF --micro-batch-size 1 --global-batch-size 2 --adam-beta1 0.9 --adam-beta2 0.999
    --initial-loss-scale 4096 --lr 1.0e-6 --train-iters 2 --lr-decay-style cosine --lr-decay-iters 2
    --lr-warmup-iters 0 --weight-decay 1e1 --clip-grad 1.0 --bf16 --no-load-optim --no-load-rng --no-shared-storage
    --vocab-size 256 --finetune --stage sft --is-instruction-dataset --split 99990,8,2 --log-interval 1
    --save-interval 2000 --eval-interval 2000 --eval-iters 0"""


def _parser():
    parser = build_parser()
    posttrain.posttrain_args(parser)
    return parser


@pytest.mark.parametrize("script", [QWEN3_TUNE, QWEN3_MOE_TUNE, QWEN25_LORA_TUNE, MIXTRAL_TUNE],
                         ids=["qwen3", "qwen3_moe", "lora", "mixtral"])
def test_every_flag_of_a_mindspeed_llm_tune_script_is_known(script):
    _, unknown = _parser().parse_known_args(shlex.split(script))
    assert unknown == []


def _parse(data, extra, capsys=None):
    """posttrain's arguments for ``extra`` on the tiny model; (args, None) or (None, the parser's error)."""
    try:
        return parse_args([*TINY_FLAGS, "--seq-length", "128", "--global-batch-size", "2", "--train-iters", "2",
                           "--data-path", data, *extra], extra_args_provider=posttrain.posttrain_args), None
    except SystemExit:
        return None, capsys.readouterr().err if capsys else "error"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_copy_task(str(tmp_path_factory.mktemp("ms_flags") / "copy"), num_packs=8)


MOE = ["--num-experts", "4", "--moe-router-topk", "2"]


@pytest.mark.parametrize("extra,layers", [
    (["--first-k-dense-replace", "1"], [0, 1]),
    (["--first-k-dense-replace", "-1", "--moe-layer-freq", "-1"], [1, 1]),  # MindSpeed-LLM's Qwen3-MoE scripts
    (["--first-k-dense-replace", "0", "--moe-layer-freq", "2"], [1, 0]),
])
def test_first_k_dense_replace_follows_mindspeed_llms_rule(data, extra, layers):
    args, error = _parse(data, [*MOE, *extra])
    assert error is None and args.moe_layer_freq == layers


def test_mindspeed_llm_translations(data):
    args, _ = _parse(data, [*MOE, "--moe-token-dispatcher-type", "alltoall_seq", "--norm-topk-prob",
                            "--qk-layernorm", "--spec", "mindspeed_llm.tasks.models.spec.qwen3_spec", "layer_spec",
                            "--expert-tensor-parallel-size", "1", "--calculate-per-token-loss",
                            "--attention-mask-type", "general"])
    assert args.moe_token_dispatcher_type == "alltoall"
    assert not args.moe_router_pre_softmax and args.qk_layernorm
    args, _ = _parse(data, [*MOE, "--moe-intermediate-size", "96", "--npu-deterministic", "--dataloader-type",
                            "cyclic"])  # MindSpeed-LLM's Qwen3 DPO scripts
    assert args.moe_ffn_hidden_size == 96 and args.deterministic_mode
    args, _ = _parse(data, ["--stage", "rm"])  # LLaMA-Factory's name of the reward model stage
    assert args.stage == "orm"


def test_pad_vocab_size_to_is_the_padded_vocab_size(data):
    # ModelLink's (MindSpeed-LLM's) Llama-2 scripts pass --pad-vocab-size-to 32000: it was an unrecognized argument
    i = TINY_FLAGS.index("--padded-vocab-size")
    flags = [*TINY_FLAGS[:i], *TINY_FLAGS[i + 2:], "--seq-length", "128", "--global-batch-size", "2", "--train-iters", "2"]
    args = parse_args([*flags, "--data-path", data, "--pad-vocab-size-to", "384"],
                      extra_args_provider=posttrain.posttrain_args)
    assert args.padded_vocab_size == 384


@pytest.mark.parametrize("extra,message", [
    ([*MOE, "--norm-topk-prob", "--moe-router-pre-softmax"], "--norm-topk-prob renormalises"),
    (["--spec", "mindspeed_llm.tasks.models.spec.qwen3_spec", "layer_spec"], "pass --qk-layernorm"),
    (["--spec", "my.module", "layer_spec"], "only mindspeed_llm.tasks.models.spec.qwen3_spec"),
    (["--is-pairwise-dataset"], "--stage sft does not train on preference pairs"),
    (["--lora-ckpt-filter"], "--lora-ckpt-filter saves a LoRA run's adapters only"),
    (["--lora-register-forward-hook", "word_embeddings", "input_layernorm"],
     "--lora-register-forward-hook word_embeddings input_layernorm goes with LoRA"),
    (["--lora-modules-to-save", "word_embeddings", "output_layer"],
     "--lora-modules-to-save word_embeddings output_layer: modules trained in full beside the adapters"),
    (["--expert-tensor-parallel-size", "2"], "must equal --tensor-model-parallel-size 1"),
    (["--enable-hf2mg-convert"], "is not a Hugging Face model directory"),
    (["--model-type-hf", "qwen3"], "goes with --enable-hf2mg-convert"),
    (["--num-layers-per-virtual-pipeline-stage", "1"], "--num-layers-per-virtual-pipeline-stage 1: the interleaved"),
    (["--noop-layers", "0,1"], "--noop-layers 0,1: no-op padding layers"),
    (["--num-layer-list", "1,1"], "--num-layer-list 1,1: uneven pipeline stages"),
    (["--no-pad-to-seq-lengths"], "--no-pad-to-seq-lengths: unpacked samples are padded to --seq-length here"),
    (["--qlora"], "--qlora: a 4-bit quantised base (QLoRA) is not built here"),  # was 'unrecognized arguments'
    ([*MOE, "--first-k-dense-replace", "2"], "--first-k-dense-replace 2 must be below --num-layers 2"),
    (["--first-k-dense-replace", "1"], "needs --num-experts"),
    ([*MOE, "--moe-intermediate-size", "96", "--moe-ffn-hidden-size", "64"], "name the same size: pass one"),
    (["--calculate-per-token-loss", "--per-sample-loss"], "--calculate-per-token-loss and --per-sample-loss"),
    (["--manual-gc-interval", "5"], "--manual-gc-interval 5 schedules manual collections: pass --manual-gc"),
    (["--no-check-for-nan-in-loss-and-grad", "--nan-policy", "stop"],
     "--no-check-for-nan-in-loss-and-grad (here --nan-policy skip"),
    (["--no-position-embedding", "--position-embedding-type", "learned_absolute"],
     "--no-position-embedding turns off the learned position embedding"),
])
def test_what_cannot_mean_the_same_is_refused_by_name(data, capsys, extra, message):
    args, error = _parse(data, extra, capsys)
    assert args is None and message in error


def test_a_layer_list_of_the_even_split_is_accepted(data, capsys):
    """--num-layer-list 1,1 on 2 layers at PP 2 is the split the pipeline builds: it was refused as 'uneven'."""
    def parse(layers):
        return parse_args([*TINY_FLAGS, "--seq-length", "128", "--global-batch-size", "2", "--train-iters", "2",
                           "--data-path", data, "--pipeline-model-parallel-size", "2", "--num-layer-list", layers],
                          world_size=2, extra_args_provider=posttrain.posttrain_args)

    assert parse("1,1").pipeline_model_parallel_size == 2
    capsys.readouterr()
    with pytest.raises(SystemExit):
        parse("2,0")
    assert "--num-layer-list 2,0: uneven pipeline stages" in capsys.readouterr().err


def test_ascend_optimisations_are_accepted_with_one_warning(data, caplog):
    with caplog.at_level(logging.WARNING, logger="mindspeed_pack.config.mindspeed_llm_flags"):
        args, error = _parse(data, ["--use-ascend-coc", "--swap-optimizer", "--moe-zero-memory", "level1",
                                    "--reuse-fp32-param"])
    assert error is None
    warned = [r.getMessage() for r in caplog.records if "Ascend optimisations" in r.getMessage()]
    assert len(warned) == 1
    for flag in ("--use-ascend-coc", "--swap-optimizer", "--moe-zero-memory", "--reuse-fp32-param"):
        assert flag in warned[0]


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    from tests.model_utils import write_converted_tiny_qwen2

    root = tmp_path_factory.mktemp("ms_hf")
    write_converted_tiny_qwen2(root)
    return str(root / "hf")


def test_mindspeed_llms_lora_forward_hook_is_accepted_with_lora(data, tiny_hf):
    """MindSpeed-LLM's LoRA examples pass --lora-register-forward-hook (its PP gradient-chain repair): a LoRA run here
    needs none, so the flag parses with LoRA instead of stopping the script as an unknown argument."""
    args = parse_args(["--seq-length", "128", "--global-batch-size", "2", "--train-iters", "2", "--data-path", data,
                       "--load", tiny_hf, "--lora-r", "4", "--lora-register-forward-hook", "word_embeddings",
                       "input_layernorm"], extra_args_provider=posttrain.posttrain_args)
    assert args.lora_r == 4 and args.lora_register_forward_hook == ["word_embeddings", "input_layernorm"]


def test_enable_hf2mg_convert_names_the_family_of_the_hugging_face_load(data, tiny_hf, capsys):
    run = ["--seq-length", "128", "--global-batch-size", "2", "--train-iters", "2", "--data-path", data,
           "--load", tiny_hf, "--enable-hf2mg-convert"]
    args = parse_args([*run, "--model-type-hf", "qwen25"], extra_args_provider=posttrain.posttrain_args)
    assert args.load_format == "hf" and args.model_type_hf == "qwen2"
    with pytest.raises(SystemExit):
        parse_args([*run, "--model-type-hf", "qwen3"], extra_args_provider=posttrain.posttrain_args)
    assert "--model-type-hf qwen3, but --load" in capsys.readouterr().err


# ---------------------------------------------------------------------------- Megatron-LM's runtime flags
def test_manual_gc_collects_only_on_schedule():
    class Args:
        manual_gc, manual_gc_interval, manual_gc_eval = True, 3, True

    assert gc.isenabled()
    collector = ManualGC(Args())
    try:
        assert not gc.isenabled() and collector.collections == 1  # the setup's garbage, once
        assert gc.get_freeze_count() > 0  # the setup's objects are not walked by the collections that follow
        for iteration in range(1, 8):
            collector.after_iteration(iteration)
        assert collector.collections == 3  # iterations 3 and 6
        collector.around_evaluation_step()
        assert collector.collections == 4
    finally:
        collector.close()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    off = ManualGC(type("Off", (), {})())
    off.after_iteration(3)
    assert off.collections == 0 and gc.isenabled()


def test_manual_gc_in_a_training_run(data):
    args, _ = _parse(data, ["--manual-gc", "--manual-gc-interval", "2", "--train-iters", "4", "--neat-pack",
                            "--micro-batch-size", "2"])
    from mindspeed_pack.datasets.packed_dataset import PackedBatchSource

    trainer = sft_trainer(args, PackedBatchSource())
    trainer.setup()
    try:
        assert not gc.isenabled()
        for _ in range(4):
            trainer.train_iteration()
        assert trainer.collector.collections == 3  # setup, iterations 2 and 4
    finally:
        trainer.cleanup()
    assert gc.isenabled()


def test_exit_on_missing_checkpoint_stops_a_first_launch(data, tmp_path):
    save = str(tmp_path / "ckpt")
    args, _ = _parse(data, ["--load", save, "--save", save, "--neat-pack", "--exit-on-missing-checkpoint"])
    from mindspeed_pack.datasets.packed_dataset import PackedBatchSource

    trainer = sft_trainer(args, PackedBatchSource())
    try:
        with pytest.raises(CheckpointError, match="holds no checkpoint yet and --exit-on-missing-checkpoint"):
            trainer.setup()
    finally:
        trainer.cleanup(barrier=False)


# ---------------------------------------------------------------------------- several nodes
def test_node_leaders_are_each_nodes_first_rank():
    assert node_leaders(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert node_leaders(2, 1) == [[0], [1]]


def _lead_and_resume(no_shared_storage: bool, iterations: tuple):
    """A rank of a job whose every process is its own node (LOCAL_WORLD_SIZE 1): which rank did the work it
    heard of, and why the ranks resuming at ``iterations[rank]`` were stopped (None: they were not)."""
    import os
    import types

    import torch.distributed as dist

    from mindspeed_pack.checkpoint import resume
    from mindspeed_pack.training import raw_data

    args = types.SimpleNamespace(no_shared_storage=no_shared_storage, data_path=["raw.jsonl"], load="ckpt",
                                 lora_load=None, resumed_from=None)
    os.environ["GROUP_RANK"] = os.environ["RANK"]  # torchrun's node rank: each process is its own node here
    dist.init_process_group("gloo")
    worker = raw_data.run_on_leader(args, lambda: dist.get_rank())
    try:
        resume._check_ranks_agree(args, (iterations[dist.get_rank()], 0))
        stopped = None
    except CheckpointError as e:
        stopped = str(e)
    return {"worker": worker, "stopped": stopped}


def _groups_alive(no_shared_storage: bool) -> list:
    """How many process groups c10d holds: after megatron's groups were made, after raw data was prepared three
    times, after three round trips to another layout and back."""
    import types

    from torch.distributed import distributed_c10d as c10d

    from mindspeed_pack.runtime.process_groups import initialize_distributed
    from mindspeed_pack.training import raw_data

    args = types.SimpleNamespace(no_shared_storage=no_shared_storage, data_path=["raw.jsonl"])
    initialize_distributed(1, 1)
    counts = [len(c10d._world.pg_map)]
    for _ in range(3):
        raw_data.run_on_leader(args, lambda: None)
    counts.append(len(c10d._world.pg_map))
    for _ in range(3):
        initialize_distributed(2, 1)
        initialize_distributed(1, 1)
    counts.append(len(c10d._world.pg_map))
    return counts


def test_a_job_releases_the_groups_it_no_longer_uses():
    """raw data's wait group was made per call and never destroyed, and a layout change only made megatron forget
    its groups: c10d kept each (a gloo group keeps its threads), and a long job's processes slowed down."""
    for counts in run_distributed(_groups_alive, 2, True, env={"LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"}):
        assert counts[0] > 1 and counts == [counts[0]] * 3, counts


@pytest.mark.parametrize("no_shared_storage", [False, True])
def test_no_shared_storage_makes_each_nodes_first_rank_preprocess(no_shared_storage):
    out = run_distributed(_lead_and_resume, 2, no_shared_storage, (3, 3 if no_shared_storage else 5),
                          env={"LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    # shared storage: rank 0 preprocesses for all; none: every node's first rank (each rank here) for its node
    assert [o["worker"] for o in out] == ([0, 1] if no_shared_storage else [0, 0])
    if no_shared_storage:
        assert all(o["stopped"] is None for o in out)
    else:  # ranks resuming different iterations (trackers on disks the nodes do not share) stop, every one
        assert all("found different checkpoints to resume" in o["stopped"] for o in out)
        # every rank's message names what each node found (node 0's log used to say only 'the ranks range over
        # iterations 3..5', not which node's --save lacked the files)
        assert all("node 0 (host " in o["stopped"] and ", rank 0): iteration 3; node 1 (host " in o["stopped"]
                   and ", rank 1): iteration 5;" in o["stopped"] for o in out), out


# ---------------------------------------------------------------------------- convert_ckpt.py
def test_convert_takes_mindspeed_llms_family_names_and_refuses_its_layouts(tiny_hf, tmp_path, capsys):
    from mindspeed_pack.convert.convert import main as convert_main
    from mindspeed_pack.convert.megatron_layout import read_tracker

    hf2mg = ["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", tiny_hf]
    assert convert_main([*hf2mg, "--model-type-hf", "qwen25", "--moe-grouped-gemm",
                         "--save-dir", str(tmp_path / "mg")]) == 0
    assert read_tracker(str(tmp_path / "mg")) == "release"
    for extra, message in ((["--noop-layers", "0,1"], "--noop-layers 0,1: uneven or virtual pipeline stages"),
                           (["--num-layer-list", "1,1"], "--num-layer-list 1,1: uneven"),
                           (["--expert-tensor-parallel-size", "2"], "must equal --target-tensor-parallel-size 1"),
                           (["--hf-cfg-dir", tiny_hf], "read when one is written back (--save-model-type hf)"),
                           (["--lora-r", "8"], "--lora-r: the LoRA settings are read from the adapters' checkpoint")):
        capsys.readouterr()
        assert convert_main([*hf2mg, *extra, "--save-dir", str(tmp_path / "refused")]) == 2
        assert message in capsys.readouterr().err, extra
        assert not (tmp_path / "refused").exists()


def test_convert_takes_num_layer_list_naming_the_even_split(tiny_hf, tmp_path, capsys):
    """Its hf2mcore scripts' --num-layer-list 1,1 for 2 layers at PP 2 is the split written anyway: posttrain.py
    took it, the converter refused it as 'uneven'."""
    import os

    from mindspeed_pack.convert.convert import main as convert_main
    from mindspeed_pack.convert.megatron_layout import checkpoint_file

    hf2mg = ["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", tiny_hf,
             "--target-pipeline-parallel-size", "2"]
    mg = str(tmp_path / "mg")
    assert convert_main([*hf2mg, "--num-layer-list", "1,1", "--save-dir", mg]) == 0
    assert os.path.isfile(checkpoint_file(mg, "release", 0, 1, 2))
    assert convert_main(["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", mg, "--num-layer-list",
                         "1,1", "--save-dir", str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    assert convert_main([*hf2mg, "--num-layer-list", "2,0", "--save-dir", str(tmp_path / "uneven")]) == 2
    assert "--num-layer-list 2,0: uneven" in capsys.readouterr().err


# ---------------------------------------------------------------------------- running MindSpeed-LLM's scripts
def test_max_position_embeddings_of_a_rope_model_is_not_compared(data, tiny_hf):
    """MindSpeed-LLM's scripts pass --max-position-embeddings ${SEQ_LENGTH}, below the config's (Qwen3: 40960): RoPE
    computes any position, so the flag is not the model's; it was refused as disagreeing with config.json."""
    args = parse_args(["--seq-length", "64", "--global-batch-size", "2", "--train-iters", "2", "--data-path", data,
                       "--load", tiny_hf, "--max-position-embeddings", "64"],
                      extra_args_provider=posttrain.posttrain_args)
    assert args.position_embedding_type == "rope" and args.max_position_embeddings == 128  # the model's own


def test_pretraining_from_a_hugging_face_directory_keeps_megatron_lms_defaults(tiny_hf, tmp_path):
    import pretrain_gpt

    args = parse_args(["--seq-length", "64", "--global-batch-size", "2", "--train-iters", "2", "--data-path",
                       str(tmp_path / "P_text_document"), "--load", tiny_hf, "--save", str(tmp_path / "s")],
                      extra_args_provider=pretrain_gpt.pretrain_args)
    assert (args.lr_decay_style, args.lr_warmup_fraction, args.save_hf) == ("linear", None, None)


def test_convert_refuses_a_directory_of_the_other_kind(tiny_hf, tmp_path, capsys):
    """mcore2hf_lora with the HF directory as --load-dir and --load-model-type mg wrote a PEFT export with no base."""
    from mindspeed_pack.convert.convert import main as convert_main

    mg = str(tmp_path / "mg")
    assert convert_main(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", tiny_hf,
                         "--save-dir", mg]) == 0
    for load_type, load_dir, message in (("mg", tiny_hf, "is a Hugging Face model directory"),
                                         ("hf", mg, "is a Megatron checkpoint")):
        capsys.readouterr()
        assert convert_main(["--load-model-type", load_type, "--save-model-type", "hf", "--load-dir", load_dir,
                             "--save-dir", str(tmp_path / "out")]) == 2
        assert message in capsys.readouterr().err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra,policy", [([], "skip"), (["--nan-policy", "skip"], "skip")])
def test_no_check_for_nan_in_loss_and_grad_is_the_skip_policy(data, extra, policy):
    """Megatron-LM's --no-check-for-nan-in-loss-and-grad (Mixtral's scripts) goes on past a non-finite step."""
    args, error = _parse(data, ["--no-check-for-nan-in-loss-and-grad", *extra])
    assert error is None and args.nan_policy == policy
    assert _parse(data, [])[0].nan_policy == "stop"  # the default is unchanged


def test_no_position_embedding_is_nothing_under_rope_and_turns_a_learned_one_off(data):
    args, error = _parse(data, ["--no-position-embedding"])  # TINY_FLAGS: --position-embedding-type rope
    assert error is None and args.position_embedding_type == "rope"
    i = TINY_FLAGS.index("--position-embedding-type")
    flags = [*TINY_FLAGS[:i], *TINY_FLAGS[i + 2:], "--seq-length", "128", "--global-batch-size", "2",
             "--train-iters", "1", "--data-path", data, "--neat-pack"]
    learned = parse_args(flags, extra_args_provider=posttrain.posttrain_args)
    assert learned.position_embedding_type == "learned_absolute"  # Megatron-LM's default
    args = parse_args([*flags, "--no-position-embedding"], extra_args_provider=posttrain.posttrain_args)
    assert args.position_embedding_type == "none"
    from mindspeed_pack.datasets.packed_dataset import PackedBatchSource

    trainer = sft_trainer(args, PackedBatchSource())
    trainer.setup()
    try:
        names = [n for n, _ in trainer.model[0].module.named_parameters()]
        assert not [n for n in names if "position_embeddings" in n] and any("word_embeddings" in n for n in names)
        loss, *_ = trainer.train_step()
        assert loss == loss  # finite: the model trains without any position embedding
    finally:
        trainer.cleanup()

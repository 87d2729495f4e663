"""Dynamic context parallelism (--sequence-packing-scheduler default_dynamic_cp) trains exactly what one sample
per row on one rank trains, with short samples on single ranks and long ones split over CP groups.

Long-tail data: most samples under N tokens, some between N and 4N (up to 128 tokens), unpacked (one sample a
document). Reference: one sample per row of 128 tokens on one rank (scheduler none). Dynamic CP must give the
same loss and gradient norm every step (rel <= 1e-5) on 2 ranks (CP groups of 1 and 2, N = 64) and on 4 ranks
(groups of 1, 2 and 4, N = 32), with steps that really mix group sizes, and resume exactly mid-epoch.

The stages on units of two sequences (DPO, SimPO, ORM on preference pairs, KTO on couples: one unit a document)
and a mixture of experts train the same way: one 2-rank job runs them all under dynamic CP, one 1-rank job one
unit (sample) per row; every unit is planned whole on one group. The same 2-rank job runs DPO, KTO and ORM
under dp_balanced (units packed whole into rows) at fixed CP 2 and at DP 2 (SimPO too at DP 2). So do GRPO on
long-tailed rollouts (each rollout a unit, under three --loss-agg modes) and --stage score of them, against the
same rollouts on one rank.
"""
import json

import numpy as np
import pytest

from tests.data_utils import IGNORE_INDEX, _builder, read_metrics, rel_err
from tests.model_utils import TINY_FLAGS
from tests.train_utils import run_posttrain

ITERS = 3
GBS = 8
BASE = ["--seq-length", "128", "--micro-batch-size", "1", "--global-batch-size", str(GBS), "--lr", "1e-3",
        "--min-lr", "1e-4", "--lr-warmup-iters", "1", "--log-interval", "1", "--train-iters", str(ITERS),
        "--rotary-base", "100"]  # positions matter to every dimension: a CP rank's misplaced share shows
COMMON = [*BASE, "--no-shuffle", "--split", "100,0,0"]  # the rollout stages read their file in order, no split
DYNAMIC = ["--sequence-packing-scheduler", "default_dynamic_cp"]

# most samples short, one in four long: 33..128 tokens (over N = 32 at CP 4, over N = 64 for some at CP 2)
LENGTHS = [9, 17, 100, 5, 23, 30, 41, 12, 7, 26, 3, 128, 19, 70, 11, 28, 6, 14, 57, 21, 31, 2, 95, 16,
           8, 29, 13, 66, 4, 25]


def write_long_tail(prefix, lengths=LENGTHS, seed=0, vocab=200):
    """One sample per document (preprocess_data.py without --pack): prompt = first half, answer copies it."""
    rng = np.random.default_rng(seed)
    keys = ("input_ids", "attention_mask", "labels")
    builders = {k: _builder(f"{prefix}_packed_{k}_document.bin") for k in keys}
    for n in lengths:
        x = rng.integers(3, vocab, n).astype(np.int32)
        x[n // 2:] = x[: n - n // 2]
        labels = np.full(n, IGNORE_INDEX, np.int32)
        labels[max(1, n // 2):] = x[max(1, n // 2):]
        for key, arr in zip(keys, (x, np.ones(n, np.int32), labels)):
            builders[key].add_document(arr, [n])
    for key, b in builders.items():
        b.finalize(f"{prefix}_packed_{key}_document.idx")
    with open(f"{prefix}_packed_meta.json", "w") as f:
        json.dump({"layout": {"kind": "unpacked", "seq_length": 128, "neat_pack": False}}, f)
    return prefix


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_long_tail(str(tmp_path_factory.mktemp("long_tail") / "docs"))


def _run(tmp_path, name, data, nproc, *extra, model_flags=TINY_FLAGS):
    metrics = str(tmp_path / f"{name}.jsonl")
    run_posttrain([*COMMON, "--data-path", data, *extra], nproc=nproc, metrics=metrics, model_flags=model_flags)
    return read_metrics(metrics)


@pytest.fixture(scope="module")
def one_per_row(tmp_path_factory, data):
    return _run(tmp_path_factory.mktemp("ref"), "ref", data, 1)


def _assert_same_steps(got, want, rel=1e-5):
    assert sorted(got) == sorted(want) == list(range(1, ITERS + 1))
    for it in want:
        for key in ("lm loss", "grad norm"):
            assert rel_err(got[it][key], want[it][key]) <= rel, (it, key, got[it][key], want[it][key])
        assert got[it]["tokens"] == want[it]["tokens"]  # every real token trained, none twice


def _group_sizes_used(records):
    return [sorted(int(k.rsplit(" ", 1)[1]) for k in rec if k.startswith("samples at CP ")) for rec in records.values()]


def test_dynamic_cp2_equals_one_sample_per_row_and_resumes_exactly(tmp_path, data, one_per_row):
    ckpt = str(tmp_path / "ckpt")
    flags = [*DYNAMIC, "--context-parallel-size", "2", "--max-seqlen-per-dp-cp-rank", "64"]
    first = _run(tmp_path, "first", data, 2, *flags, "--save", ckpt, "--save-interval", "2", "--exit-interval", "2")
    assert sorted(first) == [1, 2]
    resumed = _run(tmp_path, "resumed", data, 2, *flags, "--load", ckpt)
    assert sorted(resumed) == [3]
    got = {**first, **resumed}
    _assert_same_steps(got, one_per_row)
    assert [1, 2] in _group_sizes_used(got)  # short samples alone, long ones over two ranks, in one step
    for rec in got.values():
        assert sum(v for k, v in rec.items() if k.startswith("samples at CP ")) == GBS


def test_dynamic_cp4_equals_one_sample_per_row_and_fixed_cp(tmp_path, data, one_per_row):
    got = _run(tmp_path, "dyn4", data, 4, *DYNAMIC, "--context-parallel-size", "4", "--max-seqlen-per-dp-cp-rank", "32")
    _assert_same_steps(got, one_per_row)
    assert [1, 2, 4] in _group_sizes_used(got)
    # fixed CP 4 (dp_balanced: every sample split over all four ranks) trains the same
    fixed = _run(tmp_path, "fixed4", data, 4, "--sequence-packing-scheduler", "dp_balanced",
                 "--context-parallel-size", "4", "--max-seqlen-per-dp-cp-rank", "32")
    _assert_same_steps(got, fixed)



@pytest.mark.parametrize("layout", [
    ["--tensor-model-parallel-size", "2", "--sequence-parallel"],  # samples on two ranks padded to 2 x 2 x TP 2
    ["--pipeline-model-parallel-size", "2"],  # every micro-batch N tokens per rank: one shape for the stages
], ids=["tp2-sp", "pp2"])
def test_dynamic_cp2_with_other_parallelism_equals_one_sample_per_row(tmp_path, data, one_per_row, layout):
    got = _run(tmp_path, "dyn", data, 4, *DYNAMIC, "--context-parallel-size", "2", "--max-seqlen-per-dp-cp-rank", "64",
               *layout)
    _assert_same_steps(got, one_per_row)


@pytest.fixture(scope="module")
def lora_base(tmp_path_factory):
    from tests.model_utils import write_converted_tiny_qwen2

    root = tmp_path_factory.mktemp("lora_base")
    write_converted_tiny_qwen2(root / "qwen", rope_theta=100.0)
    return str(root / "qwen" / "hf")


def test_lora_bf16_under_dynamic_cp_tracks_one_sample_per_row(tmp_path, data, lora_base):
    """The 7B LoRA recipe's precision (bf16 weights, fp32 masters) on a Hugging Face base: only the
    reduction order changes."""
    flags = ["--load", lora_base, "--lora-r", "4", "--lora-alpha", "8", "--bf16", "--lr", "2e-2"]
    ref = _run(tmp_path, "lora-ref", data, 1, *flags, model_flags=())
    got = _run(tmp_path, "lora-dyn", data, 2, *flags, *DYNAMIC, "--context-parallel-size", "2",
               "--max-seqlen-per-dp-cp-rank", "64", model_flags=())
    _assert_same_steps(got, ref, rel=1e-3)


# ---------------------------------------------------------------------------- the plan (pure, no ranks)
def _plan(lengths, ranks=4, per_rank=32, max_cp=4, **kw):
    from mindspeed_pack.packing.balance import CostModel
    from mindspeed_pack.packing.dynamic_cp import plan_dynamic_cp

    return plan_dynamic_cp(lengths, ranks, per_rank, max_cp, CostModel(linear=1.0, attention=0.05), **kw)


def test_each_sample_gets_the_smallest_power_of_two_group_that_holds_it_padded():
    from mindspeed_pack.packing.dynamic_cp import group_sizes

    assert group_sizes([1, 32, 33, 64, 65, 128, 129], per_rank=32, max_cp=4).tolist() == [1, 1, 2, 2, 4, 4, 0]
    # 62 tokens pad to 64 (2 x 2 x TP 2 = 8) and fit 2 x 32; 63 pads to 64 too; at TP 4 x SP 61 pads to 64
    assert group_sizes([62, 63], per_rank=32, max_cp=4, tp=2, sequence_parallel=True).tolist() == [2, 2]
    # --min-dynamic-context-parallel-size 2: nothing runs alone
    assert group_sizes([3, 40], per_rank=32, max_cp=4, min_cp=2).tolist() == [2, 2]


@pytest.mark.parametrize("ranks, max_cp, min_cp", [(4, 4, 1), (8, 4, 1), (8, 2, 1), (4, 4, 2)])
def test_plan_places_every_sample_once_on_aligned_groups_in_the_fewest_slots(ranks, max_cp, min_cp):
    from mindspeed_pack.packing.dynamic_cp import group_sizes, planned_lengths

    rng = np.random.default_rng(ranks + max_cp)
    per_rank = 32
    lengths = np.where(rng.random(96) < 0.85, rng.integers(1, 33, 96), rng.integers(33, max_cp * per_rank + 1, 96))
    plan = _plan(lengths, ranks, per_rank, max_cp, min_cp=min_cp)
    again = _plan(lengths, ranks, per_rank, max_cp, min_cp=min_cp)  # deterministic: every rank derives the same
    assert [(j.slot, j.first_rank, j.samples.tolist()) for j in plan.jobs] == \
        [(j.slot, j.first_rank, j.samples.tolist()) for j in again.jobs]
    placed = np.concatenate([job.samples for job in plan.jobs])
    assert sorted(placed.tolist()) == list(range(len(lengths)))  # every sample exactly once
    sizes = group_sizes(lengths, per_rank, max_cp, min_cp)
    for job in plan.jobs:
        # a row's group is its longest sample's own size; shorter samples only fill its room
        assert sizes[job.samples].max() == job.size
        assert job.first_rank % job.size == 0 and job.first_rank + job.size <= ranks  # an aligned block
        assert planned_lengths(lengths[job.samples], job.size).sum() <= job.size * per_rank  # the row holds it
        assert list(job.samples) == sorted(job.samples)  # data order within a row
    assert plan.slots == -(-sum(j.size for j in plan.jobs) // ranks)
    for rank in range(ranks):  # one job per rank and slot, the same job on every rank of its group
        jobs = plan.rank_jobs(rank)
        assert len(jobs) == plan.slots
        for slot, job in enumerate(jobs):
            assert job is None or (job.slot == slot and job.first_rank <= rank < job.first_rank + job.size)
    stats = plan.stats(lengths)
    assert sum(v for k, v in stats.items() if k.startswith("samples at CP ")) == len(lengths)
    assert 1.0 <= stats["rank imbalance"] < 1.5


def test_plan_mixes_group_sizes_in_one_step_and_balances_the_ranks():
    plan = _plan([3, 5, 2, 12, 30, 6], ranks=4, per_rank=8, max_cp=4)
    assert plan.slots == 2
    # the 3-token sample fills the room of the 12-token one's CP 2 row (the module docstring's example)
    assert [(j.slot, j.first_rank, j.size, j.samples.tolist()) for j in plan.jobs] == \
        [(0, 0, 4, [4]), (1, 0, 2, [0, 3]), (1, 2, 1, [2, 5]), (1, 3, 1, [1])]
    assert plan.stats([3, 5, 2, 12, 30, 6])["samples at CP 1"] == 3
    # the long-tail mix of the training tests: a step with samples on one, two and four ranks
    sizes = [sorted(int(k.rsplit(" ", 1)[1]) for k in _plan(LENGTHS[i:i + GBS]).stats(LENGTHS[i:i + GBS])
                    if k.startswith("samples at CP ")) for i in range(0, ITERS * GBS, GBS)]
    assert [1, 2, 4] in sizes


def test_single_rank_rows_are_packed_as_tightly_as_the_cpp_packer_packs():
    """Best-fit decreasing alone leaves gaps between short samples that cost a step a micro-batch; the rows of
    one rank are packed again by the C++ packer (its exact-fill pass) when it needs fewer."""
    # best fit: [15 14] [13 9 8] [4], three rows of N = 32 on two ranks, two micro-batches; [13 15 4] [9 14 8]: one
    plan = _plan([9, 13, 14, 15, 8, 4], ranks=2, per_rank=32, max_cp=2)
    assert plan.slots == 1 and sorted(j.samples.tolist() for j in plan.jobs) == [[0, 2, 4], [1, 3, 5]]
    # beside a row over two ranks (56 tokens and room for a sample padded to 4): 2 x 2 rank-rows, two micro-batches
    lengths = [11, 9, 9, 56, 9, 1, 10, 13]
    plan = _plan(lengths, ranks=2, per_rank=32, max_cp=2)
    assert plan.slots == 2 and [j.size for j in plan.jobs] == [2, 1, 1]
    assert sorted(np.concatenate([j.samples for j in plan.jobs]).tolist()) == list(range(len(lengths)))


def test_the_micro_batch_names_its_group_for_the_attention():
    from megatron.core.packed_seq_params import PackedSeqParams

    from mindspeed_pack.model.thd import context_parallel_group

    layer, own = object(), object()
    assert context_parallel_group(None, layer) is layer  # no packed params: the layer's (megatron's) group
    assert context_parallel_group(PackedSeqParams(qkv_format="thd"), layer) is layer  # fixed CP
    assert context_parallel_group(PackedSeqParams(qkv_format="thd", local_cp_size=1), layer) is None  # alone
    assert context_parallel_group(PackedSeqParams(qkv_format="thd", local_cp_size=2, cp_group=own), layer) is own


# ---------------------------------------------------------------------------- bad input, dry run
def _parse(*extra, world_size=2, data_path="x"):
    from mindspeed_pack.config.arguments import parse_args
    from tests.model_utils import TINY_FLAGS

    return parse_args([*TINY_FLAGS, *COMMON, "--data-path", data_path, *DYNAMIC, *extra], world_size=world_size)


@pytest.mark.parametrize("extra, world_size, message", [
    (["--context-parallel-size", "2", "--max-seqlen-per-dp-cp-rank", "33"], 2,
     "--max-seqlen-per-dp-cp-rank 33 must be a multiple of 2 under default_dynamic_cp"),
    (["--context-parallel-size", "2", "--max-seqlen-per-dp-cp-rank", "34", "--tensor-model-parallel-size", "2",
      "--sequence-parallel"], 4, r"--max-seqlen-per-dp-cp-rank 34 must be a multiple of 4 .* x TP 2"),
    (["--context-parallel-size", "3"], 3, "--context-parallel-size 3 is the largest CP group"),
    (["--context-parallel-size", "2", "--min-dynamic-context-parallel-size", "4"], 2,
     "--min-dynamic-context-parallel-size 4 must be a power of two between 1 and --context-parallel-size 2"),
    (["--context-parallel-size", "2", "--attention-backend", "te"], 2, "does not support --attention-backend te"),
    (["--context-parallel-size", "2", "--stage", "prm"], 2, r"does not support --stage prm \(its step labels"),
    (["--context-parallel-size", "2", "--stage", "grpo", "--overlong-samples", "drop"], 2,
     "--overlong-samples drop: --stage grpo reads rollouts, whose over-long ones --rollout-overlong refuses or drops"),
    (["--context-parallel-size", "2", "--stage", "dpo_reference"], 2, "--stage dpo_reference .* score with "
     "--sequence-packing-scheduler none"),
])
def test_bad_dynamic_cp_flags_are_refused_by_name(extra, world_size, message, capsys):
    with pytest.raises(SystemExit):
        _parse(*extra, world_size=world_size)
    assert len(__import__("re").findall(message, capsys.readouterr().err)) == 1


def test_overlong_samples_flag_belongs_to_the_dynamic_scheduler(capsys):
    from mindspeed_pack.config.arguments import parse_args
    from tests.model_utils import TINY_FLAGS

    with pytest.raises(SystemExit):
        parse_args([*TINY_FLAGS, *COMMON, "--data-path", "x", "--overlong-samples", "drop"])
    err = capsys.readouterr().err
    assert "--overlong-samples drop applies to --sequence-packing-scheduler default_dynamic_cp" in err


def test_a_sample_over_c_times_n_is_refused_naming_it_and_the_flag(data, monkeypatch):
    from megatron.core import parallel_state as ps

    from mindspeed_pack.datasets.online_packing import DynamicCPBatchSource
    from mindspeed_pack.datasets.packed_documents import DataError

    monkeypatch.setattr(ps, "get_data_parallel_rank", lambda **kw: 0)
    monkeypatch.setattr(ps, "get_data_parallel_world_size", lambda **kw: 2)
    args = _parse("--context-parallel-size", "2", "--max-seqlen-per-dp-cp-rank", "48", data_path=data)
    with pytest.raises(DataError, match=r"sample 2 of '.*docs' \(train split\) has 100 tokens, more than "
                                        r"--context-parallel-size 2 x --max-seqlen-per-dp-cp-rank 48 = 96 \(2 such "
                                        r"samples\): .* --overlong-samples drop"):
        DynamicCPBatchSource().setup(args, {"train": ITERS * GBS})


def test_dry_run_shows_the_first_steps_plan_and_writes_nothing(tmp_path, data, monkeypatch, capsys):
    import os
    import shutil

    import posttrain
    from tests.model_utils import TINY_FLAGS

    copy = tmp_path / "d"
    copy.mkdir()
    for name in os.listdir(os.path.dirname(data)):
        shutil.copy(os.path.join(os.path.dirname(data), name), copy / name)
    before = sorted(os.listdir(copy))
    monkeypatch.setenv("WORLD_SIZE", "4")
    posttrain.main([*TINY_FLAGS, *COMMON, "--data-path", str(copy / "docs"), *DYNAMIC, "--context-parallel-size", "4",
                    "--max-seqlen-per-dp-cp-rank", "32", "--dry-run"])
    out = capsys.readouterr().out
    assert "# dynamic CP: 4 data x context parallel ranks, CP groups of 1/2/4 ranks" in out
    assert "# step 1: 2 micro-batches; samples at CP 1 4, samples at CP 2 2, samples at CP 4 2" in out
    # document 2 (100 tokens) on all four ranks, document 4 (23 tokens) in the room its row leaves
    assert "#   micro-batch 0: ranks 0-3: CP 4 samples [2, 4]" in out
    assert sorted(os.listdir(copy)) == before


def test_dry_run_refuses_offline_packs_as_training_does(tmp_path, monkeypatch, capsys):
    """Offline packs under default_dynamic_cp stop the run at data setup; --dry-run printed a plan of each pack as
    one sample (padding 0.000) instead of saying so."""
    import posttrain
    from tests.data_utils import write_packed_instruction_dataset
    from tests.model_utils import TINY_FLAGS

    packs = write_packed_instruction_dataset(str(tmp_path / "packs"), num_packs=16, seq_length=128, meta=True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    posttrain.main([*TINY_FLAGS, *COMMON, "--data-path", packs, "--neat-pack", *DYNAMIC, "--context-parallel-size",
                    "2", "--max-seqlen-per-dp-cp-rank", "64", "--dry-run"])
    out = capsys.readouterr().out
    assert "# step 1:" not in out, out
    assert "# dynamic CP plan: --sequence-packing-scheduler default_dynamic_cp packs samples at load time: " \
        f"'{packs}' holds offline packs; preprocess without --pack" in out, out


def test_overlong_samples_drop_counts_them_per_step(data, monkeypatch):
    from megatron.core import parallel_state as ps

    from mindspeed_pack.datasets import online_packing

    monkeypatch.setattr(ps, "get_data_parallel_rank", lambda **kw: 0)
    monkeypatch.setattr(ps, "get_data_parallel_world_size", lambda **kw: 2)
    monkeypatch.setattr(online_packing, "check_dynamic_cp_groups", lambda max_cp: None)  # no process groups here
    args = _parse("--context-parallel-size", "2", "--max-seqlen-per-dp-cp-rank", "48", "--overlong-samples", "drop",
                  data_path=data)
    source = online_packing.DynamicCPBatchSource()
    source.setup(args, {"train": ITERS * GBS})
    for consumed, dropped in ((0, 1), (GBS, 1), (2 * GBS, 0)):  # documents 2 (100 tokens) and 11 (128)
        slots, tokens, stats = source.step_shape("train", consumed)
        assert tokens == 2 * 48 and stats["dropped samples"] == dropped
        assert sum(v for k, v in stats.items() if k.startswith("samples at CP ")) == GBS - dropped
        rows = list(source.micro_batches("train", consumed))
        assert len(rows) == slots and all(len(r["input_ids"][0]) == r["cp_size"] * 48 for r in rows)


def test_transformer_engine_is_refused_at_model_build_and_auto_skips_it():
    """A GPU run with --attention-backend auto must not pick TE under dynamic CP (its RoPE uses the fixed group)."""
    from types import SimpleNamespace

    from mindspeed_pack.model.gpt import _no_te
    from mindspeed_pack.model.spec import resolve_backend

    reason = _no_te(SimpleNamespace(sequence_packing_scheduler="default_dynamic_cp"))
    assert reason and not _no_te(SimpleNamespace(sequence_packing_scheduler="dp_balanced"))
    with pytest.raises(RuntimeError, match="--attention-backend te: --sequence-packing-scheduler default_dynamic_cp"):
        resolve_backend("te", no_te=reason)
    assert resolve_backend("auto", no_te=reason) in ("flash", "local")



# ---------------------------------------------------------------------------- units of two sequences, MoE
def long_tail_pairs(n=32, seed=11):
    """Preference pairs, one in four long (82-92 tokens: a CP group of 2 at N = 64), the rest 12-33 tokens."""
    from tests.pair_utils import random_pairs

    short = random_pairs(n, seed=seed)
    long = random_pairs(n, seed=seed + 1, prompt=(18, 26), answer=(14, 24))
    return [long[i] if i % 4 == 1 else short[i] for i in range(n)]


def long_tail_kto(n=32, seed=5):
    from tests.pair_utils import random_kto_rows

    short, labels = random_kto_rows(n, seed=seed)
    long, _ = random_kto_rows(n, seed=seed + 1, prompt=(20, 28), answer=(16, 24))
    return [long[i] if i % 4 == 2 else short[i] for i in range(n)], labels


UNIT_FLAGS = ["--neat-pack", "--lr-warmup-iters", "0", "--seed", "7"]
DYNAMIC2 = [*DYNAMIC, "--context-parallel-size", "2", "--max-seqlen-per-dp-cp-rank", "64"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
       "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.1"]
STAGE_RUNS = {
    "dpo": ["--stage", "dpo", "--dpo-beta", "0.5", *UNIT_FLAGS],
    "kto": ["--stage", "kto", *UNIT_FLAGS],
    "orm": ["--stage", "orm", "--center-rewards-coefficient", "0.01", *UNIT_FLAGS],
    "simpo": ["--stage", "simpo", "--simpo-beta", "2.0", "--gamma-beta-ratio", "0.5", *UNIT_FLAGS],
    "orpo": ["--stage", "orpo", "--orpo-beta", "0.5", *UNIT_FLAGS],
    "moe": MOE,
}
STAGE_KEYS = {
    "dpo": ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"),
    "kto": ("kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"),
    "orm": ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"),
    "simpo": ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"),
    "orpo": ("nll_loss", "log_odds_ratio", "log_odds_chosen", "rewards/chosen", "rewards/rejected"),
    "moe": ("moe aux loss", "expert load max/mean"),
}
# GRPO on long-tailed rollouts: PPO-clip with a k3 KL to their reference log-probs; token-mean also takes the
# logits path (an entropy bonus, the vocabulary's entropy per position)
GRPO_FLAGS = ["--stage", "grpo", "--kl-coef", "0.05", "--clip-ratio", "0.1", "0.3"]
GRPO_MODES = {"token-mean": ["--entropy-coef", "0.01"], "seq-mean-token-mean": [], "dr-grpo": [],
              "token-mean moe": MOE}  # a mixture of experts: a long rollout's CP pads reach no expert
GRPO_KEYS = ("pg loss", "clip fraction", "approx kl", "ratio mean", "ratio max", "response length", "ref kl")


# the unit stages under dp_balanced: at fixed CP 2 (ORM's reward read past each sequence's own CP pads) and at DP 2
BALANCED_FIXED = ("dpo", "kto", "orm")
BALANCED_DP = ("dpo", "kto", "orm", "simpo")


@pytest.fixture(scope="module")
def unit_runs(tmp_path_factory, data, lora_base):
    """{stage: (dynamic CP steps, one unit per row on one rank steps)}: one 1-rank job trains the references (and
    scores DPO's reference log-probs once, --stage dpo_reference), one 2-rank job every stage under dynamic CP (DPO
    also from the precomputed table; SimPO stopped at step 2 and resumed from its checkpoint), GRPO on the
    long-tailed rollouts under each --loss-agg mode (on one rank: rows of 128 tokens, packed as the rollout stages
    pack) and --stage score of them (``score``: the two written files), then DPO and KTO under dp_balanced at fixed
    CP 2 and, after it, at DP 2 (KTO also on packs of one couple each)."""
    from tests.pair_utils import write_kto_dataset, write_kto_units, write_pair_units
    from tests.rollout_utils import long_tail_rollouts, write_jsonl
    from tests.train_utils import run_posttrain_runs

    root = tmp_path_factory.mktemp("units")
    rollouts = write_jsonl(root / "rollouts.jsonl", long_tail_rollouts(ITERS * GBS, seed=3))
    pairs = long_tail_pairs()
    # pad id 1 (no token is 1): a reward read at a CP pad (id 0) instead of the sample's last token would show
    sources = {"pairs": write_pair_units(str(root / "pairs"), pairs, margins=[(i % 5) / 4 for i in range(len(pairs))],
                                         pad_id=1),
               "kto": write_kto_units(str(root / "kto"), *long_tail_kto()), "sft": data}
    rows, labels = long_tail_kto()
    kto_packs = write_kto_dataset(str(root / "kto_packs"), rows, labels, groups=[[i] for i in range(len(rows))])
    source_of = {"dpo": "pairs", "kto": "kto", "orm": "pairs", "simpo": "pairs", "orpo": "pairs", "moe": "sft"}
    # DPO's and KTO's reference another model (a Hugging Face directory): margins and KL point are not 0
    reference = {"dpo": ["--ref-load", lora_base], "kto": ["--ref-load", lora_base]}

    def argv(stage, *extra, ref=True):
        return [*COMMON, *STAGE_RUNS[stage], "--data-path", sources[source_of[stage]],
                *(reference.get(stage, ()) if ref else ()), *extra]

    def metrics(name):
        return str(root / f"{name}.jsonl")

    def rl(layout):  # GRPO per mode and score, on one rank (rows of 128 tokens) or under dynamic CP
        flags = {"ref": ["--max-seqlen-per-dp-cp-rank", "128"], "dyn": DYNAMIC2}[layout]
        runs = [([*BASE, *GRPO_FLAGS, "--rollout-path", rollouts, "--loss-agg", mode.split()[0], *extra, *flags],
                 metrics(f"{layout}_grpo_{mode.replace(' ', '_')}")) for mode, extra in GRPO_MODES.items()]
        return runs + [([*BASE, "--stage", "score", "--rollout-path", rollouts, "--load", lora_base, "--score-entropy",
                         "--score-output", str(root / f"{layout}_scored.jsonl"), *flags], metrics(f"{layout}_score"))]

    # the MoE reference's row padding is its own segment, routed nowhere (as every pad under dynamic CP)
    one_per_row = {"moe": ["--reset-attention-mask"]}
    scoring = [*COMMON, "--stage", "dpo_reference", "--neat-pack", "--data-path", sources["pairs"], "--load", lora_base]
    run_posttrain_runs([(scoring, metrics("scoring"))] + [
        (argv(stage, *one_per_row.get(stage, ())), metrics(f"ref_{stage}")) for stage in STAGE_RUNS] + rl("ref"),
        nproc=1)
    ckpt = str(root / "simpo_ckpt")
    trained_once = ("dpo", "kto", "orm", "orpo", "moe")
    dynamic = [(argv(stage, *DYNAMIC2), metrics(f"dyn_{stage}")) for stage in trained_once]
    # fixed CP 2 (dp_balanced) lays its rows out the same way: their CP pads reach no expert either
    fixed = ["--sequence-packing-scheduler", "dp_balanced", "--context-parallel-size", "2",
             "--max-seqlen-per-dp-cp-rank", "64"]
    dynamic += [(argv("moe", *fixed), metrics("fixed_moe")),
                (argv("dpo", *DYNAMIC2, "--ref-logps", ref=False), metrics("dyn_dpo_table")),
                (argv("simpo", *DYNAMIC2, "--save", ckpt, "--save-interval", "2", "--exit-interval", "2"),
                 metrics("dyn_simpo_first")),
                (argv("simpo", *DYNAMIC2, "--load", ckpt), metrics("dyn_simpo_resumed"))] + rl("dyn")
    # dp_balanced: whole units packed into rows, at fixed CP 2, then (the job's groups made anew) at DP 2
    balanced = ["--sequence-packing-scheduler", "dp_balanced"]
    dynamic += [(argv(stage, *fixed), metrics(f"fixed_{stage}")) for stage in BALANCED_FIXED]
    dynamic += [(argv(stage, *balanced), metrics(f"balanced_{stage}")) for stage in BALANCED_DP]
    dynamic += [(argv("kto", *balanced, "--data-path", kto_packs), metrics("balanced_kto_packs"))]
    run_posttrain_runs(dynamic, nproc=2)
    out = {stage: (read_metrics(metrics(f"dyn_{stage}")), read_metrics(metrics(f"ref_{stage}")))
           for stage in trained_once}
    out["dpo --ref-logps"] = (read_metrics(metrics("dyn_dpo_table")), out["dpo"][1])
    out["moe dp_balanced"] = (read_metrics(metrics("fixed_moe")), out["moe"][1])
    for stage in BALANCED_FIXED:
        out[f"{stage} dp_balanced cp2"] = (read_metrics(metrics(f"fixed_{stage}")), out[stage][1])
    for stage in BALANCED_DP:
        ref = read_metrics(metrics(f"ref_{stage}"))
        out[f"{stage} dp_balanced dp2"] = (read_metrics(metrics(f"balanced_{stage}")), ref)
    out["kto dp_balanced dp2 packs"] = (read_metrics(metrics("balanced_kto_packs")), out["kto"][1])
    first, resumed = (read_metrics(metrics(f"dyn_simpo_{part}")) for part in ("first", "resumed"))
    assert sorted(first) == [1, 2] and sorted(resumed) == [3]  # stopped mid-epoch, resumed at its step 3
    out["simpo"] = ({**first, **resumed}, read_metrics(metrics("ref_simpo")))
    for mode in GRPO_MODES:
        out[f"grpo {mode}"] = tuple(read_metrics(metrics(f"{layout}_grpo_{mode.replace(' ', '_')}"))
                                    for layout in ("dyn", "ref"))
    out["score"] = (str(root / "dyn_scored.jsonl"), str(root / "ref_scored.jsonl"))
    return out


BALANCED_RUNS = [*(f"{s} dp_balanced cp2" for s in BALANCED_FIXED), *(f"{s} dp_balanced dp2" for s in BALANCED_DP),
                 "kto dp_balanced dp2 packs"]


@pytest.mark.parametrize("stage", [*STAGE_RUNS, "dpo --ref-logps", "moe dp_balanced", *BALANCED_RUNS])
def test_pair_kto_orm_and_moe_under_dynamic_cp_equal_one_unit_per_row(unit_runs, stage):
    """DPO (its reference model on the same group layout, or its log-probs scored once and looked up per
    document), SimPO (resumed at step 2), ORPO (its NLL weight from the step's pairs and tokens over the pool), ORM
    (rewards read at each sequence's last real token, not its CP pads) on preference pairs, KTO on couples (its KL
    point summed over the pool, each micro-batch counted on its group's first rank) and a mixture of experts
    (seq_aux_loss: each sample's routing statistic over its own group; also at fixed CP 2) train as one unit per
    row on one rank, with steps mixing groups of 1 and 2. So do DPO, KTO, ORM and SimPO under dp_balanced (whole
    units packed into rows, at fixed CP 2 and over DP 2: the KL point over both ranks' rows; KTO also on offline
    packs)."""
    got, want = unit_runs[stage]
    _assert_same_steps(got, want)
    if stage.startswith("kto"):
        assert all(rec["kl"] > 0.1 for rec in want.values())  # a KL point summed over the wrong ranks would show
    if "dp_balanced" not in stage:
        assert [1, 2] in _group_sizes_used(got)
    elif "packs" not in stage:  # units share rows (two sequences each): packed, not one a row
        assert all(rec["samples per pack"] > 2 for rec in got.values())
    for it in want:
        for key in STAGE_KEYS[stage.split()[0]]:
            atol = 1e-4 if key.startswith("rewards/") else 1e-6  # beta x differences of log-prob sums ~50 (fp32)
            assert abs(got[it][key] - want[it][key]) <= atol + 1e-5 * abs(want[it][key]), \
                (stage, it, key, got[it][key], want[it][key])
        if stage.startswith("moe"):
            assert got[it]["tokens per expert"] == want[it]["tokens per expert"]


@pytest.mark.parametrize("mode", GRPO_MODES)
def test_grpo_under_dynamic_cp_equals_one_rank(unit_runs, mode):
    """GRPO on long-tailed rollouts (short ones alone on a rank, long ones over two; advantages from their groups'
    rewards at load, so a group's rollouts may land on different groups of ranks): per-sample means and the
    sample count (seq-mean-token-mean, dr-grpo) reduce over each micro-batch's own CP group and count on its first
    rank, the advantages and old/reference log-probs follow each row's own zigzag split, a mixture of experts'
    routers see no CP pad; loss, grad norm and the policy metrics equal the same rollouts on one rank, with steps
    mixing groups of 1 and 2."""
    got, want = unit_runs[f"grpo {mode}"]
    _assert_same_steps(got, want)
    assert [1, 2] in _group_sizes_used(got)
    assert all(0.05 < rec["clip fraction"] < 0.95 for rec in want.values())  # ratios both clipped and not
    keys = GRPO_KEYS + (("entropy",) if mode == "token-mean" else ()) + \
        (STAGE_KEYS["moe"] if mode.endswith("moe") else ())
    for it in want:
        for key in keys:
            assert abs(got[it][key] - want[it][key]) <= 1e-6 + 1e-5 * abs(want[it][key]), (mode, it, key)
        if mode.endswith("moe"):
            assert got[it]["tokens per expert"] == want[it]["tokens per expert"]


def test_score_under_dynamic_cp_writes_what_one_rank_writes(unit_runs):
    """--stage score of the long-tailed rollouts (the long ones scored over a CP group of two, their shares put
    back together by that group; the short ones alone): every rollout once, in file order, with the log-probs and
    entropies one rank writes."""
    got, want = ([json.loads(line) for line in open(path)] for path in unit_runs["score"])
    assert [r["response_ids"] for r in got] == [r["response_ids"] for r in want] and len(want) == ITERS * GBS
    assert any(len(r["prompt_ids"]) + len(r["response_ids"]) > 64 for r in want)  # over N: scored on two ranks
    for mine, theirs in zip(got, want):
        for field in ("old_logprobs", "entropy"):
            a, b = np.array(mine[field]), np.array(theirs[field])
            assert a.shape == b.shape and np.abs(a - b).max() <= 1e-5 * np.abs(b).max(), field


# the layouts of a 2-rank job: (scheduler, CP, N): groups of 1 and 2 over the pool; rows over DP 2; or CP 2
UNIT_LAYOUTS = [("default_dynamic_cp", 2, 64), ("dp_balanced", 1, 128), ("dp_balanced", 2, 64)]


def _unit_source(data, rank, monkeypatch, scheduler="default_dynamic_cp", cp=2, per_rank=64):
    """Rank ``rank``'s batch source of a 2-rank job on ``data``: a dynamic CP pool of 2, or dp_balanced over the
    job's 2 / ``cp`` data-parallel ranks."""
    from megatron.core import parallel_state as ps

    from mindspeed_pack.datasets import online_packing

    dp = 2 if scheduler == "default_dynamic_cp" else 2 // cp
    monkeypatch.setattr(ps, "get_data_parallel_rank", lambda **kw: rank)
    monkeypatch.setattr(ps, "get_data_parallel_world_size", lambda **kw: dp)
    monkeypatch.setattr(online_packing, "check_dynamic_cp_groups", lambda max_cp: None)  # no process groups here
    args = _parse("--context-parallel-size", str(cp), "--max-seqlen-per-dp-cp-rank", str(per_rank), "--neat-pack",
                  "--stage", "dpo", "--sequence-packing-scheduler", scheduler, data_path=data)
    source = online_packing.batch_source(args)
    source.setup(args, {"train": ITERS * GBS})
    return source, dp


@pytest.mark.parametrize("scheduler, cp, per_rank", UNIT_LAYOUTS, ids=["dynamic", "dp_balanced-dp2", "dp_balanced-cp2"])
def test_the_plan_never_splits_a_pair_and_each_sequence_is_padded_on_its_own(tmp_path, monkeypatch, scheduler, cp,
                                                                             per_rank):
    """Every pair of a global batch lies in exactly one job: the same row on every rank of its group (dynamic CP),
    or one row of one data-parallel rank (dp_balanced, packed with others); its chosen and rejected answers
    neighbouring segments 2j-1, 2j, each padded to a multiple of 2 x CP on its own."""
    from mindspeed_pack.packing.dynamic_cp import group_sizes
    from mindspeed_pack.packing.segments import build_packed_batch
    from mindspeed_pack.training.stages.sequences import pair_segments
    from tests.pair_utils import sequence, write_pair_units

    # a unit's sequences pad separately: 30 + 2 fit one rank; 31 + 31 pad to 32 + 32 at CP 2; 30 + 33 to 32 + 36
    assert group_sizes([[10, 12], [30, 2], [31, 31], [30, 33]], per_rank=32, max_cp=2).tolist() == [1, 1, 2, 0]
    pairs = long_tail_pairs()
    data = write_pair_units(str(tmp_path / "pairs"), pairs)
    sources = [_unit_source(data, rank, monkeypatch, scheduler, cp, per_rank) for rank in (0, 1)]
    sources = [source for source, dp in sources][:sources[0][1]]  # dp_balanced: one source per data-parallel rank
    dynamic = scheduler == "default_dynamic_cp"
    sizes, shared = [], 0
    for consumed in range(0, ITERS * GBS, GBS):
        seen = {}  # document -> (slot, cp size, ranks)
        slots = []
        for rank, source in enumerate(sources):
            rows = list(source.micro_batches("train", consumed))
            slots.append(len(rows))
            for slot, row in enumerate(rows):
                size = row["cp_size"] if dynamic else cp
                assert row["input_ids"].shape[1] == size * per_rank
                seg = row["segment_ids"][0].numpy()
                k = 0
                for doc in row["documents"]:
                    prompt, chosen, rejected = pairs[doc]
                    for j, answer in ((k + 1, chosen), (k + 2, rejected)):
                        n = len(sequence(prompt, answer)[0])
                        span = int((seg == j).sum())  # the segment, its CP pads included
                        assert span == (n if size == 1 else -(-n // (2 * size)) * 2 * size), (consumed, doc, j)
                        assert np.array_equal(row["input_ids"][0].numpy()[seg == j][:n], sequence(prompt, answer)[0])
                    k += 2
                    where = seen.setdefault(doc, (slot, size, set()))
                    assert where[:2] == (slot, size) and (dynamic or not where[2])  # one job (dp_balanced: one row)
                    where[2].add(rank)
                assert int(seg.max()) == k  # nothing but whole pairs in the row
                assert row["document_segments"] == [2] * len(row["documents"])
                shared += len(row["documents"]) > 1
                batch = build_packed_batch(row["input_ids"], row["labels"], row["segment_ids"])
                assert len(pair_segments(batch)[0]) == len(row["documents"])
        assert sorted(seen) == list(range(consumed, consumed + GBS))  # every pair of the batch, once
        assert len(set(slots)) == 1  # every rank runs the same number of micro-batches
        if dynamic:
            assert all(len(ranks) == size for _, size, ranks in seen.values())  # on all of its group's ranks
        sizes.append(sorted({size for _, size, _ in seen.values()}))
    assert [1, 2] in sizes if dynamic else shared  # dynamic: groups of 1 and 2 in one step; else rows shared


def _rollout_args(path, *extra, stage="grpo"):
    from mindspeed_pack.config.arguments import parse_args
    from mindspeed_pack.training.stages import stage_args

    return parse_args([*TINY_FLAGS, *BASE, "--stage", stage, "--rollout-path", path, *DYNAMIC2, *extra],
                      world_size=2, extra_args_provider=stage_args)


def test_each_rollout_runs_once_on_the_smallest_group_its_fields_laid_out_for_that_group(tmp_path, monkeypatch):
    """The rollout source under dynamic CP: every rollout of a global batch in exactly one job, the same row on
    every rank of its group (a row's group: its longest rollout's, CP 1 up to N = 64 tokens, CP 2 beyond), its
    segment padded to 2 x 2 on two ranks and not at all on one, its advantage and old/ref log-probs at the
    positions that predict its response tokens."""
    from megatron.core import parallel_state as ps

    from mindspeed_pack.datasets.rollouts import RolloutBatchSource
    from mindspeed_pack.runtime import process_groups
    from tests.rollout_utils import long_tail_rollouts, write_jsonl

    rows = long_tail_rollouts(ITERS * GBS, seed=3)
    path = write_jsonl(tmp_path / "r.jsonl", rows)
    monkeypatch.setattr(process_groups, "check_dynamic_cp_groups", lambda max_cp: None)  # no process groups here
    monkeypatch.setattr(ps, "get_data_parallel_world_size", lambda with_context_parallel=False: 2)
    sources = []
    for rank in (0, 1):
        monkeypatch.setattr(ps, "get_data_parallel_rank", lambda with_context_parallel=False, r=rank: r)
        source = RolloutBatchSource(need_advantages=True)
        source.setup(_rollout_args(path), {})
        sources.append(source)
    assert all(s.dynamic_cp for s in sources)
    sizes = []
    for consumed in range(0, ITERS * GBS, GBS):
        seen = {}  # rollout -> (slot, cp size, ranks)
        shapes = [source.step_shape("train", consumed) for source in sources]
        assert shapes[0] == shapes[1] and shapes[0][1] == 128  # C x N, as megatron counts a micro-batch
        for rank, source in enumerate(sources):
            mbs = list(source.micro_batches("train", consumed))
            assert len(mbs) == shapes[0][0]
            for slot, mb in enumerate(mbs):
                g = mb["cp_size"]
                seg = mb["segment_ids"][0].numpy()
                assert len(seg) == g * 64 and int(seg.max()) == len(mb["rollouts"])
                own = [1 if len(source.rollouts[i]) <= 64 else 2 for i in mb["rollouts"]]
                assert not own or max(own) == g  # the row's longest rollout's own group; short ones fill its room
                for k, (i, start) in enumerate(zip(mb["rollouts"], mb["response_starts"]), start=1):
                    row, n = rows[i], len(rows[i]["prompt_ids"]) + len(rows[i]["response_ids"])
                    assert int((seg == k).sum()) == (n if g == 1 else -(-n // 4) * 4)
                    r = len(row["response_ids"])
                    for field in ("old_logprobs", "ref_logprobs"):
                        assert np.allclose(mb[field][0, start:start + r].numpy(), row[field])
                    assert np.all(mb["advantages"][0, start:start + r].numpy() == source.rollouts[i].advantages)
                    where = seen.setdefault(i, (slot, g, set()))
                    assert where[:2] == (slot, g)
                    where[2].add(rank)
        assert sorted(seen) == list(range(consumed, consumed + GBS))  # every rollout of the batch, once
        assert all(len(ranks) == size for _, size, ranks in seen.values())  # on all of its group's ranks
        sizes.append(sorted({size for _, size, _ in seen.values()}))
    assert [1, 2] in sizes


def test_dry_run_of_grpo_shows_the_rollouts_plan(tmp_path, monkeypatch, capsys):
    import posttrain
    from tests.rollout_utils import long_tail_rollouts, write_jsonl

    path = write_jsonl(tmp_path / "r.jsonl", long_tail_rollouts(ITERS * GBS, seed=3))
    monkeypatch.setenv("WORLD_SIZE", "2")
    posttrain.main([*TINY_FLAGS, *BASE, "--stage", "grpo", "--rollout-path", path, *DYNAMIC2, "--dry-run"])
    out = capsys.readouterr().out
    assert f"# dynamic CP: 2 data x context parallel ranks, CP groups of 1/2 ranks, 64 tokens per rank per " \
           f"micro-batch; rollouts named by their place in {path}" in out
    assert "# step 1: 3 micro-batches; samples at CP 1 4, samples at CP 2 4" in out
    # rollouts 2 (90 tokens) and 6 (98) on both ranks, 1 and 5 in the room they leave; the short ones alone
    assert "#   micro-batch 1: ranks 0-1: CP 2 samples [1, 2]" in out
    assert "#   micro-batch 2: rank 0: CP 1 samples [3, 4]; rank 1: CP 1 samples [0, 7]" in out
    # rows are packed at load time: no fixed micro-batch count, no --micro-batch-size advice (rollouts refuse it)
    assert "packed at load time into rows of 64 tokens per rank" in out and "# micro-batch: up to" not in out


def test_a_unit_over_c_times_n_once_padded_is_refused_naming_it(tmp_path, monkeypatch):
    """A pair of 5 + 122 tokens fits 2 x 64 (and --seq-length) unpadded, not once each answer is padded to a
    multiple of 4 (8 + 124)."""
    from mindspeed_pack.datasets.packed_documents import DataError
    from tests.pair_utils import write_pair_units

    pairs = long_tail_pairs()
    pairs[5] = (pairs[5][0][:3], pairs[5][1][:2], np.arange(4, 123, dtype=np.int64))
    data = write_pair_units(str(tmp_path / "pairs"), pairs)
    with pytest.raises(DataError, match=r"sample 5 of '.*pairs' \(train split\) has 127 tokens \(132 with each "
                                        r"sequence padded to a multiple of 4\), more than --context-parallel-size 2 "
                                        r".*--overlong-samples drop"):
        _unit_source(data, 0, monkeypatch)
    # dp_balanced: a row of 2 x 64 at fixed CP 2; a unit is never truncated to it (nor dropped: no such flag there)
    with pytest.raises(DataError, match=r"sample 5 of '.*pairs' \(train split\) has 127 tokens \(132 with each "
                                        r"sequence padded to a multiple of 4\), more than --context-parallel-size 2 "
                                        r"x --max-seqlen-per-dp-cp-rank 64 = 128 \(1 such samples\): raise either "
                                        r"flag; they are never truncated"):
        _unit_source(data, 0, monkeypatch, "dp_balanced", 2, 64)


def test_a_step_that_leaves_ranks_empty_splits_single_rank_rows_onto_them():
    """Eight short samples fit one row of N: the plan put them all on rank 0 and gave rank 1 an empty row (rank
    imbalance 2.0, the step as slow as one rank doing everything; seen on the first steps of a long-tail run).
    A row of several samples is split onto the empty rank, in the same number of micro-batches."""
    lengths = [40, 35, 38, 52, 61, 44, 70, 30]
    plan = _plan(lengths, ranks=2, per_rank=512, max_cp=2)
    assert plan.slots == 1
    assert sorted(j.first_rank for j in plan.jobs) == [0, 1]  # both ranks run a row
    assert sorted(np.concatenate([j.samples for j in plan.jobs]).tolist()) == list(range(8))
    assert all(list(j.samples) == sorted(j.samples) for j in plan.jobs)  # data order within a row
    stats = plan.stats(lengths)
    assert stats["rank imbalance"] < 1.1 and stats["tokens per rank max/mean"] < 1.1
    # beside a row over both ranks: a second micro-batch of single-rank rows uses both ranks too
    plan = _plan([1000, 100, 90, 80], ranks=2, per_rank=512, max_cp=2)  # 24 tokens of room beside 1000
    assert plan.slots == 2 and sorted((j.slot, j.first_rank, j.size) for j in plan.jobs) == \
        [(0, 0, 2), (1, 0, 1), (1, 1, 1)]
    # a single sample cannot be split: its step keeps an empty row
    plan = _plan([40], ranks=2, per_rank=512, max_cp=2)
    assert [j.samples.tolist() for j in plan.jobs] == [[0]] and plan.rank_jobs(1) == [None]

"""GRPO and scoring are exact in every parallel layout: at TP2, PP2, CP2 and DP2 the policy step's
loss and gradients equal a per-sample, unpadded transformers computation for each ``--loss-agg``
mode, and ``--stage score`` writes transformers' per-sample log-probs and entropies.

One 2-process launch per layout runs one step per mode on the same rollouts (``--lr 0``: the
weights stay, so the steps are comparable) and then scores them. Gradients are compared as
per-layer norms (embedding, each transformer layer, final norm, output layer): every rank sums
the squares of its DP-reduced gradient shards, counting TP-replicated tensors once, and the
model-parallel group adds them up; exact under any sharding, and fused QKV / gate-up tensors
only reorder elements. The transformers reference is computed once, in the test process.
"""
import json

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.model_utils import TINY_FLAGS
from tests.rollout_utils import hf_logps_entropy, per_sample_grpo_loss, random_rollouts, write_jsonl

S = 128
CLIP_LOW, CLIP_HIGH, KL, ENTROPY = 0.1, 0.3, 0.05, 0.01
# (mode, --entropy-coef): token-mean also runs the logits path (vocab-parallel entropy under TP)
STEPS = (("token-mean", ENTROPY), ("seq-mean-token-mean", 0.0), ("dr-grpo", 0.0))
GROUPS = ("embedding", "layer 0", "layer 1", "final norm", "output")
COMMON = ["--seq-length", str(S), "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "1",
          "--lr", "0", "--min-lr", "0", "--lr-warmup-iters", "0", "--clip-grad", "1e9", "--finetune",
          "--max-seqlen-per-dp-cp-rank", "64", "--clip-ratio", str(CLIP_LOW), str(CLIP_HIGH),
          "--kl-coef", str(KL), "--kl-estimator", "k3"]


def _group(name: str, layer_of: dict) -> str:
    if "embedding" in name:
        return "embedding"
    if "output_layer" in name:
        return "output"
    if "final_layernorm" in name:
        return "final norm"
    local = int(name.split("decoder.layers.")[1].split(".")[0])
    return f"layer {layer_of[local]}"


def _layer_grad_norms(model) -> list:
    """Per-layer norms of the model's (DP-reduced) gradients over the whole model-parallel group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    chunk = model.module if hasattr(model, "module") else model
    layer_of = {k: layer.layer_number - 1 for k, layer in enumerate(chunk.decoder.layers)}
    squares = torch.zeros(len(GROUPS), dtype=torch.float64)
    for name, p in chunk.named_parameters():
        sharded = getattr(p, "tensor_model_parallel", False)
        if sharded or ps.get_tensor_model_parallel_rank() == 0:
            squares[GROUPS.index(_group(name, layer_of))] += p.main_grad.double().pow(2).sum()
    dist.all_reduce(squares, group=ps.get_model_parallel_group())
    return squares.sqrt().tolist()


def _layout_rank(ckpt: str, rollouts: str, out: str, flags: list) -> dict:
    """One rank: a GRPO step per mode (loss, optimizer's grad norm, per-layer grad norms), then score."""
    from mindspeed_pack.config.arguments import parse_args, per_split_data_args
    from mindspeed_pack.datasets.packed_dataset import resolve_vocab_size
    from mindspeed_pack.training.stages import stage_args
    from mindspeed_pack.training.stages.grpo import GRPOStage
    from mindspeed_pack.training.stages.score import ScoreStage
    from mindspeed_pack.training.trainer import Trainer

    argv = [*TINY_FLAGS, *COMMON, "--load", ckpt, "--rollout-path", rollouts, "--stage", "grpo",
            "--entropy-coef", str(ENTROPY), "--score-output", out, "--score-entropy", *flags]
    args = parse_args(argv, extra_args_provider=lambda p: stage_args(per_split_data_args(p)))
    resolve_vocab_size(args)
    trainer = Trainer(args, GRPOStage(args).batch_source(args), GRPOStage(args))
    trainer.setup()
    results = {}
    try:
        for mode, entropy_coef in STEPS:
            args.loss_agg, args.entropy_coef = mode, entropy_coef
            trainer.stage = GRPOStage(args)
            loss, grad_norm, _, ok = trainer.train_step()
            assert ok
            results[mode] = (loss, grad_norm, _layer_grad_norms(trainer.model[0]))
        for chunk in trainer.model:
            chunk.eval()
        ScoreStage(args).score(trainer)
    finally:
        trainer.cleanup()
    return results


def _hf_group_norms(hf) -> list:
    squares = dict.fromkeys(GROUPS, 0.0)
    for name, p in hf.named_parameters():
        group = ("embedding" if "embed_tokens" in name else "output" if "lm_head" in name else
                 "final norm" if name == "model.norm.weight" else f"layer {int(name.split('.')[2])}")
        squares[group] += float(p.grad.double().pow(2).sum())
    return [squares[g] ** 0.5 for g in GROUPS]


def _expected(hf, rows, mode, entropy_coef):
    return per_sample_grpo_loss(hf, rows, mode, clip_low=CLIP_LOW, clip_high=CLIP_HIGH, kl_coef=KL,
                                entropy_coef=entropy_coef, seq_length=S)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Checkpoints at TP1 / TP2 / PP2 of one random Qwen2, rollouts whose old and reference log-probs
    are perturbed from the model's own (so that clipping and the KL term act), and the reference."""
    import transformers

    from mindspeed_pack.convert import hf_to_megatron
    from tests.model_utils import write_converted_tiny_qwen2

    root = tmp_path_factory.mktemp("grpo_layouts")
    ckpts = {"tp1": write_converted_tiny_qwen2(root)}
    for name, tp, pp in (("tp2", 2, 1), ("pp2", 1, 2)):
        ckpts[name] = str(root / f"mg_{name}")
        hf_to_megatron(str(root / "hf"), ckpts[name], tp, pp, padded_vocab_size=256)
    hf = transformers.Qwen2ForCausalLM.from_pretrained(str(root / "hf"), torch_dtype=torch.float32,
                                                       attn_implementation="eager")
    # lengths around the row (64 per rank): rows of one sample, of several, and the CP pitfalls
    rows = random_rollouts(8, seed=7, prompt=(1, 30), response=(1, 34))
    g = torch.Generator().manual_seed(0)
    scores = []
    with torch.no_grad():
        for row in rows:
            logp, entropy = hf_logps_entropy(hf, row)
            scores.append((logp.double(), entropy.double()))
            noise = torch.randn(2, len(logp), generator=g, dtype=torch.float64)
            row["old_logprobs"] = (logp.double() + 0.3 * noise[0]).tolist()
            row["ref_logprobs"] = (logp.double() + 0.2 * noise[1]).tolist()
    expected = {}
    for mode, entropy_coef in STEPS:
        hf.zero_grad()
        loss = _expected(hf, rows, mode, entropy_coef)
        loss.backward()
        expected[mode] = (float(loss.detach()), _hf_group_norms(hf))
    return {"root": root, "ckpts": ckpts, "rollouts": write_jsonl(root / "rollouts.jsonl", rows), "rows": rows,
            "scores": scores, "expected": expected}


def _rel(a, b):
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("layout,ckpt,flags", [
    ("tp2", "tp2", ["--tensor-model-parallel-size", "2"]),
    ("pp2", "pp2", ["--pipeline-model-parallel-size", "2"]),
    ("cp2", "tp1", ["--context-parallel-size", "2"]),
    ("dp2", "tp1", []),
])
def test_grpo_and_score_equal_per_sample_transformers(setup, layout, ckpt, flags):
    out = str(setup["root"] / f"scored_{layout}.jsonl")
    results = run_distributed(_layout_rank, 2, setup["ckpts"][ckpt], setup["rollouts"], out, flags,
                              timeout=300, threads_per_process=1, env={"OMP_NUM_THREADS": "1"})
    for mode, _ in STEPS:
        loss, grad_norm, norms = results[0][mode]
        expected_loss, expected_norms = setup["expected"][mode]
        assert _rel(loss, expected_loss) <= 1e-5, (layout, mode, loss, expected_loss)
        for group, mine, theirs in zip(GROUPS, norms, expected_norms):
            assert _rel(mine, theirs) <= 1e-5, (layout, mode, group, mine, theirs)
        total = sum(n ** 2 for n in expected_norms) ** 0.5
        assert _rel(grad_norm, total) <= 1e-5, (layout, mode, grad_norm, total)
    with open(out) as f:
        scored = [json.loads(line) for line in f]
    assert [r["response_ids"] for r in scored] == [r["response_ids"] for r in setup["rows"]]
    for row, (logp, entropy) in zip(scored, setup["scores"]):
        for field, theirs in (("old_logprobs", logp), ("entropy", entropy)):
            mine = torch.tensor(row[field], dtype=torch.float64)
            assert float((mine - theirs).abs().max() / theirs.abs().max()) <= 1e-5, (layout, field)

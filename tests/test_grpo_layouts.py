"""GRPO, scoring and the reward models are exact in every parallel layout: at TP2, PP2, CP2 and DP2 the
policy step's loss and gradients equal a per-sample, unpadded transformers computation for each
``--loss-agg`` mode, ``--stage score`` writes transformers' per-sample log-probs and entropies, and three
steps of the outcome and process reward models (``--stage orm``, ``--stage prm``) equal the TP1 run's.

One 2-process launch per layout runs one step per mode on the same rollouts (``--lr 0``: the
weights stay, so the steps are comparable) and then scores them; then, from the same checkpoint, three
training steps of ``--stage orm`` (at TP2 also with ``--sequence-parallel``: the score head's gathered
rewards and its TP-summed gradient) and of ``--stage prm``, and ``--stage score`` of the rollouts' rewards
with the saved reward model. Those are compared with the DP2 job's (TP1: no model parallelism), step by step
(loss, grad norm, logged metrics). Gradients are compared as
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
from tests.train_utils import trainer_steps

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


def _layout_rank(ckpt: str, rollouts: str, out: str, flags: list, reward: dict) -> dict:
    """One rank: a GRPO step per mode (loss, optimizer's grad norm, per-layer grad norms), then score; then the
    reward models' steps (:func:`_reward_stages`)."""
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
    results.update(_reward_stages(ckpt, rollouts, flags, **reward))
    return results


REWARD_COMMON = [*TINY_FLAGS, "--seq-length", str(S), "--neat-pack", "--micro-batch-size", "1", "--global-batch-size",
                 "4", "--train-iters", "3", "--lr", "2e-3", "--min-lr", "2e-3", "--lr-warmup-iters", "0", "--seed", "7",
                 "--finetune"]
ORM_KEYS = ("lm loss", "grad norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
PRM_KEYS = ("lm loss", "grad norm", "accuracy")


def _reward_stages(ckpt: str, rollouts: str, flags: list, pairs: str, steps: str, save: str, scored: str,
                   sp: bool) -> dict:
    """Three steps of --stage orm (saved; its rewards of the rollouts scored by --stage score) and of --stage prm,
    from the language model ``ckpt``; at TP2 (``sp``) the ORM steps again under --sequence-parallel."""
    from mindspeed_pack.training.stages.score import ScoreStage
    from mindspeed_pack.config.arguments import parse_args
    from mindspeed_pack.training.stages import stage_args

    orm = [*REWARD_COMMON, "--stage", "orm", "--load", ckpt, "--data-path", pairs, *flags]
    out = {"orm": trainer_steps([*orm, "--save", save]),
           "prm": trainer_steps([*REWARD_COMMON, "--stage", "prm", "--load", ckpt, "--data-path", steps, *flags])}
    if sp:
        out["orm sp"] = trainer_steps([*orm, "--sequence-parallel"])
    score = parse_args([*TINY_FLAGS, "--stage", "score", "--load", save, "--finetune", "--rollout-path", rollouts,
                        "--score-output", scored, "--seq-length", str(S), "--micro-batch-size", "1",
                        "--global-batch-size", "8", "--max-seqlen-per-dp-cp-rank", "64", *flags],
                       extra_args_provider=stage_args)
    assert score.reward_head  # the saved checkpoint records its score head
    ScoreStage(score).run(score)
    return out


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

    from tests.pair_utils import random_pairs, write_pair_dataset
    from tests.step_utils import random_step_samples, write_step_dataset

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
            "scores": scores, "expected": expected,
            "pairs": write_pair_dataset(str(root / "pairs"), random_pairs(40, seed=5)),
            "steps": write_step_dataset(str(root / "steps"), random_step_samples(60, seed=6))}


LAYOUTS = {"tp2": ("tp2", ["--tensor-model-parallel-size", "2"]), "pp2": ("pp2", ["--pipeline-model-parallel-size", "2"]),
           "cp2": ("tp1", ["--context-parallel-size", "2"]), "dp2": ("tp1", [])}


@pytest.fixture(scope="module")
def layout_run(setup):
    """``layout_run(name)``: the results of the layout's 2-process job, run once per module."""
    done = {}

    def run(layout):
        if layout not in done:
            ckpt, flags = LAYOUTS[layout]
            root = setup["root"]
            reward = {"pairs": setup["pairs"], "steps": setup["steps"], "save": str(root / f"orm_{layout}"),
                      "scored": str(root / f"rewards_{layout}.jsonl"), "sp": layout == "tp2"}
            done[layout] = run_distributed(_layout_rank, 2, setup["ckpts"][ckpt], setup["rollouts"],
                                           str(root / f"scored_{layout}.jsonl"), flags, reward, timeout=600,
                                           threads_per_process=1, env={"OMP_NUM_THREADS": "1"})
        return done[layout]

    return run


def _rel(a, b):
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grpo_and_score_equal_per_sample_transformers(setup, layout_run, layout):
    out = str(setup["root"] / f"scored_{layout}.jsonl")
    results = layout_run(layout)
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


def _same_steps(mine: list, theirs: list, keys, what) -> None:
    assert len(mine) == len(theirs) == 3, what
    for a, b in zip(mine, theirs):
        for k in keys:
            assert abs(a[k] - b[k]) <= 1e-6 + 1e-5 * max(abs(a[k]), abs(b[k])), (what, a["iteration"], k, a[k], b[k])


@pytest.mark.parametrize("layout", ["tp2", "pp2", "cp2"])
def test_reward_models_equal_tp1_over_three_steps(setup, layout_run, layout):
    """--stage orm and --stage prm at TP2 (ORM also under --sequence-parallel), PP2 and CP2: the three steps' loss,
    grad norm and metrics are the TP1 (DP2) job's, and so are the rewards --stage score writes with the saved
    reward model. The same jobs as the GRPO checks above: no launch of its own when they ran."""
    mine, tp1 = layout_run(layout)[0], layout_run("dp2")[0]
    assert all(r["lr"] > 0 and r["grad norm"] > 0 for r in tp1["orm"] + tp1["prm"])  # the weights move
    _same_steps(mine["orm"], tp1["orm"], ORM_KEYS, (layout, "orm"))
    _same_steps(mine["prm"], tp1["prm"], PRM_KEYS, (layout, "prm"))
    if layout == "tp2":
        _same_steps(mine["orm sp"], tp1["orm"], ORM_KEYS, (layout, "orm --sequence-parallel"))
    rewards = {}
    for name in (layout, "dp2"):
        with open(setup["root"] / f"rewards_{name}.jsonl") as f:
            rewards[name] = torch.tensor([json.loads(line)["reward"] for line in f], dtype=torch.float64)
    assert len(rewards[layout]) == len(setup["rows"])
    assert float((rewards[layout] - rewards["dp2"]).abs().max() / rewards["dp2"].abs().max()) <= 1e-5

"""SimPO, ORPO, KTO and the reward models (ORM, PRM) in the layouts their own tests do not run: the distributed
optimizer, TP2 with sequence parallelism, LoRA at TP2 with sequence parallelism, and MoE at EP2 each equal the
TP1 run over three steps (fp32: loss, grad norm and every logged metric, rel <= 1e-5); in bf16, TP2 with sequence
parallelism tracks TP1 (loss and grad norm, rel <= 1e-2). TP2 x PP2 and CP2 are in tests/test_dpo_training.py,
tests/test_kto_training.py and tests/test_grpo_layouts.py.

One 2-process job runs every stage in every layout, megatron's groups remade for each run's layout: per stage,
the TP1 (DP2) runs of the dense model (from the HF directory), of its LoRA adapters, of a tiny MoE model (from
the same seeded draw at every layout) and of the dense model in bf16, each followed by the layouts compared with it.
"""
import math

import pytest

from tests.dist_harness import run_distributed
from tests.model_utils import TINY_FLAGS
from tests.train_utils import trainer_steps

COMMON = [*TINY_FLAGS, "--seq-length", "128", "--neat-pack", "--micro-batch-size", "1", "--global-batch-size", "4",
          "--train-iters", "3", "--lr-warmup-iters", "0", "--seed", "7"]
PAIR_KEYS = ("lm loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
# (data, flags, logged keys compared); SimPO and ORPO at a small lr, as in tests/test_dpo_training.py
STAGES = {
    "simpo": ("pairs", ["--stage", "simpo", "--simpo-beta", "2.0", "--gamma-beta-ratio", "0.5", "--pref-ftx", "0.2",
                        "--lr", "1e-3", "--min-lr", "1e-3"], PAIR_KEYS),
    "orpo": ("pairs", ["--stage", "orpo", "--orpo-beta", "0.5", "--lr", "1e-3", "--min-lr", "1e-3"],
             PAIR_KEYS + ("nll_loss", "log_odds_ratio", "log_odds_chosen")),
    "kto": ("kto", ["--stage", "kto", "--kto-beta", "0.5", "--lr", "1e-3", "--min-lr", "1e-3"],
            ("lm loss", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")),
    "orm": ("pairs", ["--stage", "orm", "--lr", "2e-3", "--min-lr", "2e-3"],
            ("lm loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")),
    "prm": ("steps", ["--stage", "prm", "--lr", "2e-3", "--min-lr", "2e-3"], ("lm loss", "accuracy")),
}
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
LORA = ["--lora-r", "4", "--lora-alpha", "8"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-aux-loss-coeff", "0.01",
       "--moe-router-load-balancing-type", "seq_aux_loss"]
EP2 = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
# model: (the TP1 run's flags, {layout: its flags}); "hf" is replaced by the directory
MODELS = {
    "dense": (["--load", "hf", "--finetune"], {"dist-opt": ["--use-distributed-optimizer"], "tp2 sp": TP2_SP}),
    "lora": (["--load", "hf", *LORA], {"lora tp2 sp": TP2_SP}),
    "moe": (MOE, {"moe ep2": EP2}),
    "bf16": (["--load", "hf", "--finetune", "--bf16"], {"bf16 tp2 sp": TP2_SP}),
}
BF16_REL = 1e-2  # bf16 reductions round in another order at TP2 (tests/test_mixed_precision.py)


def _rank(runs: list) -> list:
    """Each run's step records in turn (megatron's groups remade for its layout)."""
    from megatron.core import parallel_state as ps

    out = []
    for argv in runs:
        if ps.model_parallel_is_initialized():
            from mindspeed_pack.runtime.process_groups import release_model_parallel
            release_model_parallel()
        out.append(trainer_steps(argv))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{(stage, run name): rank 0's step records} of the one job (run names: the models' TP1 runs, "dense",
    "lora", "moe", and their layouts)."""
    from tests.model_utils import write_converted_tiny_qwen2
    from tests.pair_utils import random_kto_rows, random_pairs, write_kto_dataset, write_pair_dataset
    from tests.step_utils import random_step_samples, write_step_dataset

    root = tmp_path_factory.mktemp("stage_layouts")
    write_converted_tiny_qwen2(root / "qwen")
    hf = str(root / "qwen" / "hf")
    data = {"pairs": write_pair_dataset(str(root / "pairs"), random_pairs(40, seed=5)),
            "kto": write_kto_dataset(str(root / "kto"), *random_kto_rows(40, seed=11, desirable=0.6)),
            "steps": write_step_dataset(str(root / "steps"), random_step_samples(60, seed=6))}
    names, argvs = [], []
    for stage, (source, flags, _) in STAGES.items():
        for model, (start, layouts) in MODELS.items():
            start = [hf if f == "hf" else f for f in start]
            for name, extra in ((model, []), *layouts.items()):
                names.append((stage, name))
                argvs.append([*COMMON, *flags, "--data-path", data[source], *start, *extra])
    results = run_distributed(_rank, 2, argvs, timeout=900, threads_per_process=1, env={"OMP_NUM_THREADS": "1"})
    return dict(zip(names, results[0]))


def _close(a: float, b: float, atol: float) -> bool:
    if math.isnan(a) or math.isnan(b):  # KTO: a step without desirable (or undesirable) samples logs NaN
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= atol + 1e-5 * max(abs(a), abs(b))


@pytest.mark.parametrize("stage", list(STAGES))
def test_layouts_equal_tp1_over_three_steps(runs, stage):
    keys = STAGES[stage][2] + ("grad norm",)
    for model, (_, layouts) in MODELS.items():
        tp1 = runs[(stage, model)]
        assert len(tp1) == 3 and all(r["grad norm"] > 0 for r in tp1), (stage, model)
        assert tp1[-1]["lm loss"] != tp1[0]["lm loss"], (stage, model)  # the weights move
        for layout in layouts:
            for mine, theirs in zip(runs[(stage, layout)], tp1, strict=True):
                if model == "bf16":
                    for k in ("lm loss", "grad norm"):
                        assert abs(mine[k] - theirs[k]) <= BF16_REL * abs(theirs[k]), (stage, layout, k, mine, theirs)
                    continue
                for k in keys + (("moe aux loss",) if model == "moe" else ()):
                    # rewards and log-prob sums are beta x differences of sums ~50 in size: atol 1e-4
                    atol = 1e-4 if k.startswith(("rewards/", "logps/")) else 1e-6
                    assert _close(mine[k], theirs[k], atol), (stage, layout, mine["iteration"], k, mine[k], theirs[k])

"""Weight gradients accumulated into main_grad by the matmul (mindspeed_pack/model/wgrad_fusion.py): the same
training as megatron-core's separate add, in the layouts that reach its linear layers differently.

On a GPU the accumulation is installed when its check passes; here a test installs it (fp32 matmuls stand in for
addmm's output dtype) and trains with and without it: fp32 runs equal (loss and grad norm over three steps, rel
<= 1e-5), bf16 runs track (rel <= 1e-2: the fused sum skips a bf16 rounding), and the accumulation was called.
"""
import pytest
import torch

from tests.dist_harness import run_distributed
from tests.model_utils import TINY_FLAGS
from tests.train_utils import trainer_steps

COMMON = ["--seq-length", "128", "--neat-pack", "--micro-batch-size", "1", "--global-batch-size", "4",
          "--train-iters", "3", "--lr", "1e-3", "--min-lr", "1e-3", "--lr-warmup-iters", "0", "--seed", "3"]
TIED = [f for f in TINY_FLAGS if f != "--untie-embeddings-and-output-weights"]
RUNS = {  # name: (flags, rel)
    "untied": ([*TINY_FLAGS], 1e-5),
    "tied embeddings": (TIED, 1e-5),  # the output layer's dummy gradient is zeros, the embedding's own is added
    "tp2 sp": ([*TINY_FLAGS, "--tensor-model-parallel-size", "2", "--sequence-parallel"], 1e-5),
    # the adapters are not megatron-core linears and the base is frozen: LoRA trains as it did ("hf": the directory)
    "lora": ([*TINY_FLAGS, "--load", "hf", "--lora-r", "4", "--lora-alpha", "8"], 1e-5),
    "bf16": ([*TINY_FLAGS, "--bf16"], 1e-2),
}


def _rank(data, hf):
    from megatron.core import parallel_state as ps

    from mindspeed_pack.model import wgrad_fusion

    calls = {"n": 0}
    accumulate = wgrad_fusion.accumulate

    def counted(*args):
        calls["n"] += 1
        return accumulate(*args)

    out = {}
    for fused in (False, True):
        if fused:
            assert wgrad_fusion.install(probe=False, device="cpu")
            import megatron.core.tensor_parallel.layers as layers

            layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32 = counted
        for name, (flags, _) in RUNS.items():
            if ps.model_parallel_is_initialized():
                from mindspeed_pack.runtime.process_groups import release_model_parallel
                release_model_parallel()
            records = trainer_steps([hf if f == "hf" else f for f in flags] + [*COMMON, "--data-path", data])
            out[(name, fused)] = [(r["lm loss"], r["grad norm"]) for r in records]
    out["calls"] = calls["n"]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.train_utils import copy_task_and_tiny_qwen2

    data, hf = copy_task_and_tiny_qwen2(tmp_path_factory.mktemp("wgrad"))
    return run_distributed(_rank, 2, data, hf, timeout=600)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_fused_accumulation_trains_as_the_separate_add(runs, name):
    rel = RUNS[name][1]
    plain, fused = runs[(name, False)], runs[(name, True)]
    assert len(plain) == len(fused) == 3
    for (l0, g0), (l1, g1) in zip(plain, fused):
        assert l1 == pytest.approx(l0, rel=rel) and g1 == pytest.approx(g0, rel=rel), (name, plain, fused)
    assert runs["calls"] > 0  # (an accumulation that does nothing fails every layout but LoRA)


def test_accumulate_sums_in_fp32():
    from mindspeed_pack.model import wgrad_fusion

    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(2, 5, 6, generator=g), torch.randn(2, 5, 3, generator=g)
    main = torch.randn(3, 6, generator=g)
    want = main + dy.reshape(10, 3).t() @ x.reshape(10, 6)
    got = main.clone()
    wgrad_fusion.accumulate(x, dy, got)
    torch.testing.assert_close(got, want)
    # bf16 inputs, fp32 buffer: products summed in fp32, no bf16 rounding of the gradient
    got = main.clone()
    wgrad_fusion.accumulate(x.bfloat16(), dy.bfloat16(), got)
    exact = main + dy.bfloat16().float().reshape(10, 3).t() @ x.bfloat16().float().reshape(10, 6)
    torch.testing.assert_close(got, exact)
    assert wgrad_fusion._probe("cpu") is None and wgrad_fusion._probe("cpu", torch.float32) is None

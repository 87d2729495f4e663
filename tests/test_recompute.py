"""Activation recomputation (Megatron-LM's ``--recompute-granularity full|selective``, ``--recompute-method
uniform|block``, ``--recompute-num-layers``, ``--recompute-modules``; megatron-core's checkpointing).

Recomputed layers train exactly as stored ones: three fp32 steps give the same losses and gradient norms, on the
flash backend (torch's varlen op with reference CPU kernels) and the local one, with layers compiled whole, and
under LoRA, where megatron-core's checkpoint function would see only a frozen embedding's output and leave the
adapters without gradients unless the input is made to need one, and with MoE layers (the router runs again; its
auxiliary loss counts once). A forward under full recomputation keeps a
fraction of the activations for the backward; ``--dry-run``'s memory estimate follows.
"""
import pytest

from tests.dist_harness import run_distributed
from tests.model_utils import TINY_FLAGS

COMMON = ["--seq-length", "128", "--neat-pack", "--micro-batch-size", "1", "--global-batch-size", "4",
          "--train-iters", "3", "--lr", "1e-3", "--min-lr", "1e-3", "--lr-warmup-iters", "0", "--seed", "3"]
UNIFORM = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
BLOCK = ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"]
SELECTIVE = ["--recompute-granularity", "selective"]
FLASH, LOCAL = ["--attention-backend", "flash"], ["--attention-backend", "local"]
LAYERS = ["--torch-compile-kernels", "layers"]
LORA = ["--load", "hf", "--lora-r", "4", "--lora-alpha", "8"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-layer-freq", "[0,1]",
       "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.01"]
RUNS = {
    "flash": FLASH, "flash full uniform": [*FLASH, *UNIFORM], "flash full block": [*FLASH, *BLOCK],
    "flash selective": [*FLASH, *SELECTIVE],
    "local": LOCAL, "local full uniform": [*LOCAL, *UNIFORM], "local selective": [*LOCAL, *SELECTIVE],
    "flash layers": [*FLASH, *LAYERS], "flash layers full uniform": [*FLASH, *LAYERS, *UNIFORM],
    "lora": [*FLASH, *LORA], "lora full uniform": [*FLASH, *LORA, *UNIFORM],
    # a layer recomputed runs its router twice: the auxiliary loss and its logged value count once
    "moe": [*FLASH, *MOE], "moe full uniform": [*FLASH, *MOE, *UNIFORM],
    "moe selective": [*FLASH, *MOE, "--recompute-granularity", "selective", "--recompute-modules", "moe"],
}


def _rank(data, hf):
    import torch
    from megatron.core import parallel_state as ps

    from mindspeed_pack.model.packed_gpt import PackedGPTModel
    from tests.train_utils import trainer_steps
    from tests.varlen_cpu import use_cpu_flash

    use_cpu_flash()
    saved, forward = [], PackedGPTModel.forward

    def counting_forward(self, *args, **kwargs):
        """Bytes the autograd graph keeps for the backward from this forward (a recomputed layer keeps its input)."""
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward(self, *args, **kwargs)
        if torch.is_grad_enabled():
            saved.append(total[0])
        return out

    PackedGPTModel.forward = counting_forward
    out = {}
    try:
        for name, flags in RUNS.items():
            if ps.model_parallel_is_initialized():
                from mindspeed_pack.runtime.process_groups import release_model_parallel
                release_model_parallel()
            torch._dynamo.reset()
            saved.clear()
            flags = [hf if f == "hf" else f for f in flags]
            records = trainer_steps([*TINY_FLAGS, *COMMON, "--data-path", data, *flags])
            out[name] = {"steps": [(r["lm loss"], r["grad norm"], r.get("moe aux loss")) for r in records],
                         "saved bytes": max(saved)}
    finally:
        PackedGPTModel.forward = forward
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.train_utils import copy_task_and_tiny_qwen2

    data, hf = copy_task_and_tiny_qwen2(tmp_path_factory.mktemp("recompute"))
    return run_distributed(_rank, 1, data, hf, timeout=900)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name,reference", [("flash full uniform", "flash"), ("flash full block", "flash"),
                                            ("flash selective", "flash"), ("local full uniform", "local"),
                                            ("local selective", "local"), ("moe full uniform", "moe"),
                                            ("moe selective", "moe")])
def test_recomputed_layers_train_exactly_as_stored_ones(runs, name, reference):
    """The same ops run again in the backward, in the same order: the same numbers, bit for bit."""
    assert len(runs[name]["steps"]) == 3
    assert all((aux is not None) == name.startswith("moe") for _, _, aux in runs[name]["steps"])
    assert runs[name]["steps"] == runs[reference]["steps"]


@pytest.mark.slow
def test_recomputed_lora_layers_train_their_adapters(runs):
    """Under LoRA the embedding is frozen: its output is made to need a gradient, or megatron-core's checkpoint
    function would pass none to the adapters (their gradient norm 0, the next steps' losses off by ~1e-2). And the
    same numbers bit for bit, as for full fine-tuning: the adapters' matmuls take one kernel in the recomputed
    (no-grad) forward too (``torch.matmul`` batched a 3-D input there, a few 1e-8 apart)."""
    assert runs["lora full uniform"]["steps"] == runs["lora"]["steps"]


@pytest.mark.slow
def test_compiled_layers_recompute_as_eager(runs):
    for (l0, g0, _), (l1, g1, _) in zip(runs["flash"]["steps"], runs["flash layers full uniform"]["steps"]):
        assert l1 == pytest.approx(l0, rel=1e-5) and g1 == pytest.approx(g0, rel=1e-5)


@pytest.mark.slow
def test_full_recomputation_keeps_a_fraction_of_the_activations(runs):
    """A layer recomputed whole keeps its input for the backward; selective recomputation of the core attention
    keeps little less with the flash kernel, whose saved state is already small."""
    stored, full, block = (runs[k]["saved bytes"] for k in ("flash", "flash full uniform", "flash full block"))
    assert full < 0.5 * stored and full < block < stored, (stored, block, full)


def _args(*flags):
    from mindspeed_pack.config.arguments import parse_args

    return parse_args([*TINY_FLAGS, "--seq-length", "128", "--micro-batch-size", "1", "--global-batch-size", "4",
                       "--train-iters", "1", "--data-path", "unread", "--num-layers", "4", *flags])


@pytest.mark.parametrize("flags,message", [
    (["--recompute-granularity", "full"], "needs --recompute-method uniform or block"),
    (["--recompute-granularity", "full", "--recompute-method", "block"], "--recompute-num-layers between 1 and 4"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "5"],
     "between 1 and 4"),
    (["--recompute-method", "block", "--recompute-num-layers", "2"], "go with --recompute-granularity full"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "2"], "goes with --recompute-granularity full"),
    (["--recompute-modules", "mlp"], "--recompute-modules goes with --recompute-granularity selective"),
    (["--recompute-activations", "--recompute-granularity", "full", "--recompute-method", "block",
      "--recompute-num-layers", "1"], "--recompute-activations is --recompute-granularity selective"),
    (["--recompute-granularity", "selective", "--attention-backend", "flash", "--torch-compile-kernels", "layers"],
     "selective recomputation checkpoints modules inside the layer"),
])
def test_inconsistent_recompute_flags_are_refused(flags, message, capsys):
    with pytest.raises(SystemExit):
        _args(*flags)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("modules,message", [
    (["layernorm"], "--recompute-modules layernorm needs Transformer Engine, not importable here"),
    (["mlp", "moe_act"], "--recompute-modules moe_act needs Transformer Engine"),
    (["bogus"], "argument --recompute-modules: invalid choice: 'bogus'"),
])
def test_recompute_modules_megatron_cannot_run_are_refused_at_setup(modules, message, capsys):
    """Without Transformer Engine megatron-core 0.16.1 checkpoints layernorm and moe_act through TE's FP8 state
    (the first forward stopped with a NameError); an unknown name was an assertion of the model build."""
    with pytest.raises(SystemExit):
        _args("--recompute-granularity", "selective", "--recompute-modules", *modules)
    assert message in capsys.readouterr().err


def test_recompute_activations_is_selective():
    assert _args("--recompute-activations").recompute_granularity == "selective"


def test_memory_estimate_follows_the_recomputation():
    from mindspeed_pack.training.run_plan import memory_estimate

    def activations(*flags):
        args = _args("--num-layers", "8", "--seq-length", "4096", "--bf16", *flags)
        args.padded_vocab_size = 1024
        return memory_estimate(args)["activations"]

    stored = activations()
    assert activations("--recompute-granularity", "selective") == stored
    block_2, block_6 = (activations("--recompute-granularity", "full", "--recompute-method", "block",
                                    "--recompute-num-layers", n) for n in ("2", "6"))
    uniform_1, uniform_4 = (activations("--recompute-granularity", "full", "--recompute-method", "uniform",
                                        "--recompute-num-layers", n) for n in ("1", "4"))
    assert uniform_1 < uniform_4 < stored and uniform_1 < block_6 < block_2 < stored

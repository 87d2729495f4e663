"""``--torch-compile-kernels layers`` (mindspeed_pack/model/compiled_layers.py): every transformer layer compiled
whole trains as the eager layers do.

The ``flash`` backend runs on this CPU through PyTorch's real varlen op with reference kernels
(tests/varlen_cpu.py), so dynamo traces what it traces on a GPU: the op, megatron-core's layer, the packed RoPE.
Three fp32 steps each: loss and grad norm equal the eager flash run's and the exact local backend's (rel <=
1e-5), with megatron-core's fused SwiGLU and bias-dropout-add as a GPU builds them, with the gradient-accumulation
fusion installed, at two packs per forward, with LoRA, for DPO (a no-grad reference forward), under PP2, DP2,
TP2 and TP2 with sequence parallelism (their collectives inside the graph);
bf16 tracks. Each layer is one graph (``fullgraph``: a break is an error) and all layers share a handful of
compilations. With the gradient-accumulation fusion installed (as on a GPU) every linear of a compiled layer
adds its weight gradient into ``main_grad`` inside the compiled backward (megatron-core's own fused backward
sets attributes of the weight, which dynamo cannot trace), and the DDP hook adds nothing more.
"""
import warnings

import pytest

from tests.dist_harness import run_distributed
from tests.model_utils import TINY_FLAGS

COMMON = ["--seq-length", "128", "--neat-pack", "--micro-batch-size", "1", "--global-batch-size", "4",
          "--train-iters", "3", "--lr", "1e-3", "--min-lr", "1e-3", "--lr-warmup-iters", "0", "--seed", "3"]
LORA = ["--load", "hf", "--lora-r", "4", "--lora-alpha", "8"]
DPO = ["--stage", "dpo", "--dpo-beta", "0.5", "--data-path", "pairs"]
GPU_FUSIONS = "gpu fusions"  # megatron-core's fused SwiGLU and bias-dropout-add, as a GPU builds the layers
RUNS = {  # name: (flags, wgrad fusion installed)
    "local": (["--attention-backend", "local"], False),
    "flash": (["--attention-backend", "flash"], False),
    "flash layers": (["--attention-backend", "flash", "--torch-compile-kernels", "layers"], False),
    "flash, gpu fusions": (["--attention-backend", "flash", GPU_FUSIONS], False),
    "flash layers, gpu fusions": (["--attention-backend", "flash", "--torch-compile-kernels", "layers", GPU_FUSIONS],
                                  False),
    # several packs per forward: one THD sequence of twice the tokens
    "flash mbs2": (["--attention-backend", "flash", "--micro-batch-size", "2"], False),
    "flash layers mbs2": (["--attention-backend", "flash", "--micro-batch-size", "2", "--torch-compile-kernels",
                           "layers"], False),
    "bf16 flash": (["--attention-backend", "flash", "--bf16"], False),
    "bf16 flash layers": (["--attention-backend", "flash", "--bf16", "--torch-compile-kernels", "layers"], False),
    # DPO: the reference forward runs without gradients (its own compilation)
    "dpo flash": ([*DPO, "--attention-backend", "flash"], False),
    "dpo flash layers": ([*DPO, "--attention-backend", "flash", "--torch-compile-kernels", "layers"], False),
    "lora flash": ([*LORA, "--attention-backend", "flash"], False),
    "lora flash layers": ([*LORA, "--attention-backend", "flash", "--torch-compile-kernels", "layers"], False),
    # last: installing the accumulation is for the rest of the process
    "flash layers, fusion installed": (["--attention-backend", "flash", "--torch-compile-kernels", "layers"], True),
}


def _rank(data, hf, pairs):
    import torch
    from megatron.core import parallel_state as ps
    from torch._dynamo.utils import counters

    from mindspeed_pack.model import gpt, wgrad_fusion
    from tests.train_utils import trainer_steps
    from tests.varlen_cpu import use_cpu_flash

    use_cpu_flash()
    cpu_fusions = gpt.fusion_settings
    in_graph = _count_in_graph_accumulations(wgrad_fusion)
    out = {}
    for name, (flags, fused) in RUNS.items():
        # the switches a GPU turns on (the accumulation fusion aside: installed by the last run)
        gpt.fusion_settings = (lambda *a: {**cpu_fusions(*a), "bias_activation_fusion": True,
                                           "bias_dropout_fusion": True}) if GPU_FUSIONS in flags else cpu_fusions
        flags = [f for f in flags if f != GPU_FUSIONS]
        if fused:
            assert wgrad_fusion.install(probe=False, device="cpu")
        if ps.model_parallel_is_initialized():
            from mindspeed_pack.runtime.process_groups import release_model_parallel
            release_model_parallel()
        torch._dynamo.reset()
        counters.clear()
        in_graph.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            argv = [*TINY_FLAGS, *COMMON, "--data-path", data, *flags]  # (the last --data-path counts)
            records = trainer_steps([{"hf": hf, "pairs": pairs}.get(f, f) for f in argv])
        out[name] = {"steps": [(r["lm loss"], r["grad norm"]) for r in records],
                     "compiles": counters["stats"]["unique_graphs"],
                     "graph breaks": sum(counters["graph_break"].values()),
                     "tp_group warnings": sum("tp_group is None" in str(w.message) for w in caught),
                     "in-graph accumulations": len(in_graph)}
    return out


def _count_in_graph_accumulations(wgrad_fusion) -> list:
    """Record each call of the accumulation from inside a compiled backward (through its custom operation; the
    output layer's eager fused backward calls it too, through megatron-core's shim module)."""
    import sys

    calls, accumulate = [], wgrad_fusion.accumulate

    def counted(total_input, grad_output, main_grad):
        caller = sys._getframe(1).f_code
        if caller.co_name == "_accumulate_op" and caller.co_filename == wgrad_fusion.__file__:
            calls.append(tuple(main_grad.shape))
        accumulate(total_input, grad_output, main_grad)

    wgrad_fusion.accumulate = counted
    return calls


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.pair_utils import random_pairs, write_pair_dataset
    from tests.train_utils import copy_task_and_tiny_qwen2

    root = tmp_path_factory.mktemp("layers")
    data, hf = copy_task_and_tiny_qwen2(root)
    pairs = write_pair_dataset(str(root / "pairs"), random_pairs(24, seed=11))
    return run_distributed(_rank, 1, data, hf, pairs, timeout=900)[0]


def _same(a, b, rel=1e-5):
    assert len(a) == len(b) == 3
    for (l0, g0), (l1, g1) in zip(a, b):
        assert l1 == pytest.approx(l0, rel=rel) and g1 == pytest.approx(g0, rel=rel), (a, b)


@pytest.mark.slow
@pytest.mark.parametrize("name,reference", [("flash layers", "flash"), ("flash layers", "local"),
                                            ("flash layers, fusion installed", "flash"),
                                            ("flash, gpu fusions", "flash"),
                                            ("flash layers, gpu fusions", "flash, gpu fusions"),
                                            ("dpo flash layers", "dpo flash"),
                                            ("flash layers mbs2", "flash mbs2"),
                                            ("lora flash layers", "lora flash")])
def test_compiled_layers_train_as_eager(runs, name, reference):
    _same(runs[reference]["steps"], runs[name]["steps"])


@pytest.mark.slow
def test_compiled_bf16_layers_track_eager(runs):
    """bf16 (the GPU's dtype): inductor fuses and rounds differently from the eager ops, so the runs track."""
    _same(runs["bf16 flash"]["steps"], runs["bf16 flash layers"]["steps"], rel=2e-2)


@pytest.mark.slow
def test_each_layer_is_one_graph_shared_by_all_layers(runs):
    for name in ("flash layers", "flash layers, fusion installed", "flash layers, gpu fusions", "flash layers mbs2",
                 "bf16 flash layers", "dpo flash layers", "lora flash layers"):
        # 2 layers x 4 micro-batches x 3 steps, packs of other segment counts and longest segments: one
        # compilation; never one per layer or per pack (without the steady inputs: 6 here, 2 with the segment
        # count symbolic but the longest segment static at first). LoRA twice that: its frozen embedding hands
        # the first layer an input that needs no gradient; DPO: the reference's no-grad forward
        want = 2 if name.startswith(("lora", "dpo")) else 1
        assert runs[name]["graph breaks"] == 0 and runs[name]["compiles"] == want, (name, runs[name])
    assert runs["flash"]["compiles"] == 0  # eager on a CPU: the regions compile on CUDA only
    assert runs["flash, gpu fusions"]["compiles"] > 0  # (megatron-core's fused SwiGLU and bias-dropout-add did run)


@pytest.mark.slow
def test_weight_gradients_accumulate_inside_the_compiled_backward(runs):
    """Installed, the fusion runs in the graph for every linear of every layer and micro-batch (2 layers x 4
    linears x 4 micro-batches x 3 steps), and the runs above train as eager: the DDP hook added nothing twice."""
    assert runs["flash layers, fusion installed"]["in-graph accumulations"] == 2 * 4 * 4 * 3
    assert all(r["in-graph accumulations"] == 0 for name, r in runs.items() if "fusion installed" not in name)


@pytest.mark.slow
def test_row_parallel_linear_no_longer_warns_per_call(runs):
    """megatron-core 0.16.1's RowParallelLinear warned on every call (tp_group=None): ours passes its group."""
    assert all(r["tp_group warnings"] == 0 for r in runs.values()), {k: r["tp_group warnings"] for k, r in
                                                                     runs.items()}


@pytest.mark.parametrize("overrides,backend,match", [
    ({}, "local", "needs --attention-backend flash"),
    ({}, "te", "needs --attention-backend flash"),
    ({"num_experts": 4}, "flash", "MoE"),
    ({"context_parallel_size": 2}, "flash", "context parallelism"),
    ({"sequence_packing_scheduler": "default_dynamic_cp"}, "flash", "context parallelism"),
    # (its pre-hooks, traced into each layer, guarded on that layer's parameters: 2 compilations at 2 layers)
    ({"overlap_param_gather": True}, "flash", "--overlap-param-gather waits"),
])
def test_unsupported_layouts_are_refused_with_the_reason(overrides, backend, match):
    import types

    from mindspeed_pack.model import compiled_layers

    args = types.SimpleNamespace(**overrides)
    with pytest.raises(ValueError, match=rf"--torch-compile-kernels layers: .*{match}"):
        compiled_layers.check_supported(args, backend)
    assert compiled_layers.unsupported_reason(types.SimpleNamespace(), "flash") == ""


def test_a_layer_that_cannot_be_traced_whole_stops_with_the_flag_named():
    import torch

    from mindspeed_pack.model import compiled_layers

    class Layer(torch.nn.Module):
        layer_number = 7

        def forward(self, hidden_states):
            torch._dynamo.graph_break()  # (a construct dynamo cannot put into one graph)
            return hidden_states + 1

    layer = Layer()
    forward = compiled_layers._compiled_forward(layer)
    with pytest.raises(compiled_layers.LayerCompileError, match=r"layers: transformer layer 7 could not be compiled "
                                                               r"whole .*--torch-compile-kernels regions"):
        forward(torch.zeros(2))


@pytest.mark.parametrize("extra,match", [(["--num-experts", "4", "--attention-backend", "flash"], "MoE"),
                                         (["--attention-backend", "local"], "needs --attention-backend flash"),
                                         ([], "needs --attention-backend flash (this run's is 'local'")])
def test_the_command_line_is_refused_before_anything_is_built(capsys, extra, match):
    """One usage error, the reason named (``auto`` resolved as the build would: ``local`` on this CPU)."""
    import posttrain
    from mindspeed_pack.config.arguments import parse_args

    argv = [*TINY_FLAGS, "--seq-length", "128", "--data-path", "x", "--train-iters", "2", "--torch-compile-kernels",
            "layers", *extra]
    with pytest.raises(SystemExit):
        parse_args(argv, world_size=2, extra_args_provider=posttrain.posttrain_args)
    assert f"--torch-compile-kernels layers: {match}" in capsys.readouterr().err


PARALLEL = {"pp2": ["--pipeline-model-parallel-size", "2"],
            # the weight gradients' reduction overlapped with the backward, the optimizer state sharded
            "dp2": ["--use-distributed-optimizer", "--overlap-grad-reduce"],
            "tp2": ["--tensor-model-parallel-size", "2"],
            "tp2 sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
            "lora tp2 sp": [*LORA, "--tensor-model-parallel-size", "2", "--sequence-parallel"]}


def _parallel_rank(data, hf):
    import torch
    from megatron.core import parallel_state as ps

    from tests.train_utils import trainer_steps
    from tests.varlen_cpu import use_cpu_flash

    from torch._dynamo.utils import counters

    from mindspeed_pack.model import wgrad_fusion

    use_cpu_flash()
    assert wgrad_fusion.install(probe=False, device="cpu")  # as on a GPU: eager fused, and in the graph
    in_graph = _count_in_graph_accumulations(wgrad_fusion)
    out = {}
    for name, flags in PARALLEL.items():
        if name == "tp2":
            out["mappings"] = _compare_mappings()  # (with TP2's groups initialised by the previous run)
        for mode in ("auto", "layers"):
            if ps.model_parallel_is_initialized():
                from mindspeed_pack.runtime.process_groups import release_model_parallel
                release_model_parallel()
            torch._dynamo.reset()
            counters.clear()
            records = trainer_steps([*TINY_FLAGS, *[hf if f == "hf" else f for f in flags], *COMMON, "--data-path",
                                     data, "--attention-backend", "flash", "--torch-compile-kernels", mode])
            out[(name, mode)] = [(r["lm loss"], r["grad norm"]) for r in records]
            out[(name, mode, "compiles")] = counters["stats"]["unique_graphs"]
    out["in-graph accumulations"] = len(in_graph)
    return out


def _compare_mappings() -> dict:
    """Each of megatron-core's mappings (eager) against its traceable twin compiled whole, over 2 ranks: the
    largest difference of the output and of the input's gradient."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import mappings

    from mindspeed_pack.model import traced_mappings

    group = torch.distributed.new_group([0, 1])
    rank = torch.distributed.get_rank()
    cases = {name: (getattr(mappings, name), getattr(traced_mappings, name), {}) for name in (
        "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
        "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region")}
    cases["gather, its gradient split"] = (mappings.gather_from_sequence_parallel_region,
                                           traced_mappings.gather_from_sequence_parallel_region,
                                           {"tensor_parallel_output_grad": False})
    diffs = {}
    for name, (megatron_fn, ours, kwargs) in cases.items():
        results = []
        for fn in (megatron_fn, torch.compile(ours, fullgraph=True)):
            x = (torch.arange(48, dtype=torch.float64).reshape(8, 1, 6) * (rank + 1) / 7).requires_grad_()
            y = fn(x, group=group, **kwargs)
            (y * torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape).cos()).sum().backward()
            results.append((y.detach(), x.grad))
        (y0, g0), (y1, g1) = results
        diffs[name] = max(float((y0 - y1).abs().max()), float((g0 - g1).abs().max()))
    assert ps.model_parallel_is_initialized()
    return diffs


@pytest.fixture(scope="module")
def parallel_runs(tmp_path_factory):
    from tests.train_utils import copy_task_and_tiny_qwen2

    data, hf = copy_task_and_tiny_qwen2(tmp_path_factory.mktemp("parallel"))
    return run_distributed(_parallel_rank, 2, data, hf, timeout=900, threads_per_process=1)


@pytest.mark.slow
def test_compiled_layers_under_pipeline_tensor_and_data_parallelism(parallel_runs):
    """The pipeline's stages each compile their own layers (the second stage's first layer gets its input from the
    first stage); data-parallel ranks each compile theirs; under TP (and TP with sequence parallelism) each
    layer's all-reduces (all-gathers, reduce-scatters) run inside its graphs, LoRA's adapters' too: all train as
    their eager runs on every rank, with the gradient-accumulation fusion as a GPU has it."""
    for rank, out in enumerate(parallel_runs):
        for name in PARALLEL:
            _same(out[(name, "auto")], out[(name, "layers")])
            # as on one rank: the collectives add no compilation (no guard on a group per call)
            want = 2 if name.startswith("lora") else 1
            assert out[(name, "layers", "compiles")] == want, (rank, name, out[(name, "layers", "compiles")])
        assert out["in-graph accumulations"] > 0, rank  # the fusion installed: in the graph under layers


@pytest.mark.slow
def test_traced_mappings_equal_megatron_cores(parallel_runs):
    """Compiled, each tensor/sequence-parallel mapping of model/traced_mappings.py (functional collectives) gives
    megatron-core's eager output and input gradient (torch 2.11's dynamo lost the all-gather of megatron-core's
    own reduce-scatter backward: an uninitialised weight gradient)."""
    for rank, out in enumerate(parallel_runs):
        assert out["mappings"] and all(d < 1e-12 for d in out["mappings"].values()), (rank, out["mappings"])


def test_dry_run_says_what_is_compiled(capsys, monkeypatch):
    import posttrain
    from mindspeed_pack.model import spec

    monkeypatch.setattr(spec, "flash_unavailable_reason", lambda *a, **k: None)  # (as on a GPU)
    common = [*TINY_FLAGS, "--seq-length", "128", "--micro-batch-size", "1", "--global-batch-size", "2",
              "--train-iters", "1", "--data-path", "none", "--dry-run"]
    posttrain.main([*common, "--torch-compile-kernels", "layers"])
    assert "# torch.compile: every transformer layer whole, forward and backward" in capsys.readouterr().out
    posttrain.main(common)  # auto: the layers on CUDA
    assert "# torch.compile (auto): on CUDA every transformer layer whole, forward and backward, with the flash " \
        "backend" in capsys.readouterr().out
    posttrain.main([*common, "--num-experts", "4", "--moe-router-topk", "2"])  # a layout that keeps the regions
    assert "# torch.compile (auto): on CUDA RoPE's and the loss's elementwise regions (layers not compiled whole: " \
        "MoE layers route" in capsys.readouterr().out
    posttrain.main([*common, "--torch-compile-kernels", "regions"])
    assert "# torch.compile: RoPE's and the loss's elementwise regions, on CUDA" in capsys.readouterr().out


@pytest.mark.parametrize("overrides,backend,on_gpu,mode", [
    ({}, "flash", True, "layers"),  # the default on CUDA: measured 2.29x (0.5B) and 1.32x (1.5B) the regions
    ({}, "flash", False, "regions"),  # on a CPU: eager (a compile per run costs short jobs and tests more)
    ({}, "te", True, "regions"), ({}, "local", True, "regions"),
    ({"context_parallel_size": 2}, "flash", True, "regions"), ({"num_experts": 4}, "flash", True, "regions"),
    ({"recompute_granularity": "selective"}, "flash", True, "regions"),
    ({"torch_compile_kernels": "regions"}, "flash", True, "regions"),
    ({"torch_compile_kernels": "off"}, "flash", True, "off"),
    ({"torch_compile_kernels": "layers"}, "flash", False, "layers"),
])
def test_auto_compiles_the_layers_whole_on_cuda_where_they_can_be(overrides, backend, on_gpu, mode):
    import types

    from mindspeed_pack.model import compiled_layers

    got, why = compiled_layers.resolve_mode(types.SimpleNamespace(**overrides), backend, on_gpu)
    assert got == mode and why


def test_under_a_counting_dispatch_mode_a_layer_runs_eagerly():
    """The host-sync counter (a Python dispatch mode) must see every op; dynamo traces nothing under it."""
    import torch

    from mindspeed_pack.model import compiled_layers
    from mindspeed_pack.tools.host_syncs import HostSyncCounter

    class Layer(torch.nn.Module):
        layer_number = 1

        def forward(self, hidden_states):
            if hidden_states.sum().item() > 0:  # a read back that Python branches on: a break when compiled
                return hidden_states * 2
            return hidden_states

    forward = compiled_layers._compiled_forward(Layer())
    with HostSyncCounter() as syncs:
        out = forward(torch.ones(3))
    assert out.tolist() == [2.0, 2.0, 2.0] and syncs.by_name["item"] == 1, syncs.by_name
    with pytest.raises(compiled_layers.LayerCompileError):
        forward(torch.ones(3))

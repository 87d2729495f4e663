"""bench/bench_gpu_train.py keeps running where the suite runs (a CPU, the tiny shape): both sides train the
same packs step for step, the FLOPs are those of the timed packs, and ``--suite`` writes one JSON naming what
it could not run (no timing is asserted)."""
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest


def _bench():
    path = Path(__file__).resolve().parents[1] / "bench" / "bench_gpu_train.py"
    spec = importlib.util.spec_from_file_location("bench_gpu_train", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.slow
def test_gpu_suite_trains_the_same_packs_and_names_what_it_skipped(tmp_path, monkeypatch):
    bench = _bench()
    monkeypatch.setitem(sys.modules, "peft", None)  # as on a machine without peft: the PEFT baseline is skipped
    out = tmp_path / "suite.json"
    bench.main(["--suite", "--profile", "--seq-length", "128", "--global-batch", "2", "--warmup", "1",
                "--steps", "2", "--micro-batches", "1", "2", "--json", str(out)])
    suite = json.loads(out.read_text())
    parts = suite["suite"]
    assert set(parts) == {"shapes", "layers", "loss", "lora", "microbatch"}, parts
    skipped = " | ".join(f"{s['part']}: {s['why']}" for s in suite["skipped"])
    assert "peft" in skipped and "no GPU" in skipped and "flash attention" in skipped, skipped

    # (a) both sides walk packs 0, 1, 2, ... (G per step): the timed steps train the same packs on both sides
    tiny = parts["shapes"]["tiny"]
    ours, theirs = tiny["ours"], tiny["transformers"]
    walk = [[2 * k, 2 * k + 1] for k in range(1 + 2 + 1 + 2)]  # warm-up, timed, syncs, profile (counts launches)
    assert ours["packs per step"] == theirs["packs per step"] == walk
    assert ours["timed packs"] == theirs["timed packs"] == [[2, 3], [4, 5]]
    assert tiny["same packs"] and ours["tokens"] == theirs["tokens"] > 0 and tiny["ratio"] > 0
    # the FLOPs are the timed packs' (not the average pack's)
    timed = [bench.sample_lengths(row) for row in bench.make_packs(128, 12, 1000)[2][2:6]]
    expected = bench.step_flops("tiny", timed)
    for side in (ours, theirs):
        assert side["TFLOP/s"] * side["seconds"] * 1e12 == pytest.approx(expected, rel=1e-9)
        profile = side["profile"]
        assert set(profile["time split ms/iteration"]) == {*bench.CATEGORIES, "idle"}
        assert profile["time split ms/iteration"]["matmuls"] > 0 and len(profile["top 10 kernels"]) == 10
        assert profile["kernel launches/iteration"] > 0
        assert isinstance(side["torch.compile"], dict)  # dynamo's counters of the run (none compile on a CPU)
        assert side["warm-up seconds"] > 0 and len(side["step seconds"]) == 2
        assert sum(side["step seconds"]) == pytest.approx(side["seconds"])

    # (b) LoRA: ours ran with adapters (tokens counted over the same packs), the PEFT side is named as skipped
    lora = parts["lora"]
    assert lora["r"] == 16 and lora["ours"]["tokens/s"] > 0 and "peft" in lora["transformers+peft"]["skipped"]
    assert lora["ours"]["timed packs"] == [[2, 3], [4, 5]]
    assert lora["ours"]["TFLOP/s"] * lora["ours"]["seconds"] * 1e12 == pytest.approx(
        bench.step_flops("tiny", timed, lora_r=16), rel=1e-9)

    # compiled layers: the flash backend's, so named as skipped here; the row keeps (a)'s two sides to compare with
    for packs in ("1 pack", "2 packs"):
        assert f"--torch-compile-kernels layers, {packs} per forward at tiny: compiled layers need the flash " \
            "backend: no CUDA device" in skipped
    assert parts["layers"]["tiny"]["default"]["tokens/s"] == ours["tokens/s"]
    assert parts["layers"]["tiny"]["transformers"]["tokens/s"] == theirs["tokens/s"]

    # the loss paths: the unfused loss on the same packs as the default
    unfused = parts["loss"]["tiny"]["--cross-entropy-chunk-size 0"]
    assert unfused["packs per step"] == walk and unfused["tokens"] == ours["tokens"]
    assert parts["loss"]["tiny"]["default"]["tokens/s"] == ours["tokens/s"]

    # (c) the sweep: the same packs per step at every micro-batch size; 1 pack per forward is (a)'s run
    sweep = parts["microbatch"]
    assert sweep["1 packs per forward"]["packs per step"] == sweep["2 packs per forward"]["packs per step"] == walk
    assert sweep["1 packs per forward"]["source"] == "(a)"
    assert suite["seconds"] > 0


@pytest.mark.slow
def test_layers_part_compares_compiled_layers_with_the_default(tmp_path, monkeypatch):
    """The ``layers`` part where the flash backend runs (here: torch's varlen op with CPU reference kernels): the
    compiled runs train the same packs as (a)'s default and report their ratios to it and to transformers."""
    from mindspeed_pack.model import spec
    from tests.varlen_cpu import register_cpu_kernels

    register_cpu_kernels()
    monkeypatch.setattr(spec, "flash_unavailable_reason", lambda *a, **k: None)
    bench = _bench()
    out = tmp_path / "suite.json"
    bench.main(["--suite", "--parts", "shapes", "layers", "--seq-length", "128", "--global-batch", "2", "--warmup",
                "1", "--steps", "2", "--json", str(out)])
    layers = json.loads(out.read_text())["suite"]["layers"]["tiny"]
    default = layers["default"]
    assert default["backend"] == "flash"
    for packs in ("1 pack", "2 packs"):
        run = layers[f"--torch-compile-kernels layers, {packs} per forward"]
        assert run["backend"] == "flash" and run["packs per step"] == default["packs per step"]
        assert run["tokens"] == default["tokens"] and run["torch.compile"]["stats"]["unique_graphs"] >= 1
        assert run["x default"] == pytest.approx(run["tokens/s"] / default["tokens/s"])
        assert run["x transformers"] == pytest.approx(run["tokens/s"] / layers["transformers"]["tokens/s"])


def test_suite_runs_nothing_past_its_deadline_and_names_what_it_left(tmp_path):
    bench = _bench()
    out = tmp_path / "suite.json"
    bench.main(["--suite", "--parts", "microbatch", "lora", "--deadline", "0", "--json", str(out)])
    suite = json.loads(out.read_text())
    assert list(suite["suite"]) == ["microbatch", "lora"]  # the order asked for
    skipped = [s["part"] for s in suite["skipped"] if "--deadline" in s["why"]]
    assert skipped == ["(c) micro-batch 1", "(c) micro-batch 2", "(c) micro-batch 4", "(b) LoRA at tiny"], skipped


def test_lora_flops_count_the_frozen_base_without_weight_gradients():
    bench = _bench()
    lengths = [np.array([100, 20]), np.array([7])]
    full = bench.step_flops("0.5b", lengths)
    lora = bench.step_flops("0.5b", lengths, lora_r=16)
    # base: 4 of full training's 6 FLOPs per parameter and token; the adapters 6, attention unchanged
    assert full * 2 / 3 < lora < full
    c = bench.SHAPES["0.5b"]
    h, ffn, layers, q, kv = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], 896, 128
    assert bench.lora_parameters("0.5b", 16) == 16 * layers * ((h + q) + 2 * (h + kv) + (q + h) + 3 * (h + ffn))


def test_profile_summary_splits_device_time_by_kernel_and_scope():
    bench = _bench()
    K = bench.KernelRecord
    records = [  # microseconds; two iterations; the last two kernels overlap on two streams
        K("sm90_xmma_gemm_bf16bf16", 300, 0, ("aten::mm", "aten::linear")),
        K("flash_fwd_kernel", 200, 300, ("aten::_flash_attention_forward",)),
        K("triton_red_fused_exp_sub_sum_0", 100, 500, ("aten::exp", "loss")),
        K("multi_tensor_apply_kernel", 50, 600, ("aten::_fused_adamw_", "optimizer")),
        K("vectorized_elementwise_kernel", 50, 650, ("aten::mul",)),
        K("ncclDevKernel_AllReduce_Sum_f32", 100, 700, ("c10d::allreduce_",)),
        K("vectorized_elementwise_kernel", 100, 750, ("aten::add",)),
    ]
    s = bench.summarize(records, wall_s=2e-3, iterations=2, on_device=True)
    split = s["time split ms/iteration"]
    assert split == pytest.approx({"matmuls": 0.15, "attention": 0.1, "loss": 0.05, "optimizer": 0.025,
                                   "elementwise/norm/RoPE": 0.075, "communication": 0.05, "idle": 0.575})
    assert s["GPU busy"] == pytest.approx(0.425)  # 850 us of kernels in the union, of 2000
    assert s["top 10 kernels"][0]["name"].startswith("sm90") and s["top 10 kernels"][0]["category"] == "matmuls"
    assert s["busy ms/iteration"] == pytest.approx(0.425)
    assert [k["name"] for k in s["top 3 per category"]["elementwise/norm/RoPE"]] == ["vectorized_elementwise_kernel"]


def test_profiler_ranges_are_not_counted_as_kernels():
    """A record_function label ("loss") appears on the GPU's timeline as a user annotation spanning its kernels:
    counted as a kernel it doubled the loss's share of the step (seen on an H200)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    bench = _bench()

    def event(i, name, device, start, end, annotation=False, correlation=0):
        return SimpleNamespace(id=i, name=name, device_type=device, is_user_annotation=annotation,
                               time_range=SimpleNamespace(start=start, end=end), linked_correlation_id=correlation,
                               cpu_parent=None)

    events = [event(1, "loss", DeviceType.CPU, 0, 100, annotation=True),
              event(2, "loss", DeviceType.CUDA, 0, 100, annotation=True),
              event(3, "triton_red_fused_exp", DeviceType.CUDA, 10, 60, correlation=1)]
    records = bench.kernel_records(events, on_device=True)
    assert [(r.name, r.us, r.scope) for r in records] == [("triton_red_fused_exp", 50, ("loss",))]


def test_host_summary_splits_the_hosts_time():
    from types import SimpleNamespace

    bench = _bench()

    def event(name, us, annotation=False):
        return SimpleNamespace(name=name, self_cpu_time_total=us, is_user_annotation=annotation)

    events = [event("aten::mm", 300), event("aten::mm", 100), event("aten::add", 100), event("cudaLaunchKernel", 200),
              event("cuLaunchKernel", 100), event("loss", 5000, annotation=True)]
    h = bench.host_summary(events, wall_s=2e-3, iterations=2)  # 1 ms per iteration
    assert h["ATen ops self ms/iteration"] == pytest.approx(0.25)
    assert h["CUDA runtime calls ms/iteration"] == pytest.approx(0.15)
    assert h["rest ms/iteration (Python, dispatch, profiler)"] == pytest.approx(0.6)
    assert h["top 10 host ops"][0] == {"name": "aten::mm", "self ms/iteration": 0.2, "calls/iteration": 1.0}


def test_a_finished_run_frees_its_model_while_its_side_is_still_held(tmp_path):
    """``with ours(...) as side`` leaves ``side`` bound after the block; its profiler labels reached the model and the
    optimizer, and megatron-core's DDP hooks make cycles: the last run's weights and optimizer state stayed allocated
    through the next run (71 GiB where ~45 were the run's own, on an H200)."""
    import gc
    import weakref
    from types import SimpleNamespace

    from megatron.core.models.gpt import GPTModel

    bench = _bench()
    opts = SimpleNamespace(seq_length=128, global_batch=2, warmup=1, steps=1, profile=False, backend="auto")
    hf, prefix, _, _ = bench.Workspace(str(tmp_path), opts).get("tiny")
    with bench.ours(hf, prefix, opts) as side:
        side.step()
        models = [weakref.ref(m) for m in gc.get_objects() if isinstance(m, GPTModel)]
    assert models and side is not None  # the side is still held here, as the suite's loops hold it
    gc.collect()
    assert [m for m in models if m() is not None] == []

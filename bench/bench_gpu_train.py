"""Training throughput on a GPU: posttrain's step against a plain transformers padding-free loop (issues 35, 42).

One process, identical packs for both sides, step for step:

* data: instruction-like samples (heavy-tailed lengths, ~27 per 4096-token pack, 40% prompt), packed
  by the project's C++ packer into ``--seq-length`` rows and written as the packed indexed datasets
  ``preprocess_data.py --pack --neat-pack`` writes;
* model: a Qwen2.5 shape with random weights (``--shape tiny|0.5b|1.5b|7b|7b-4l``), saved by transformers;
* ``ours``: posttrain.py's Trainer, ``--load HF_DIR --bf16`` (fp32 on a CPU), ``--attention-backend``
  (default auto: TE, else flash, else local), ``--micro-batch-size`` packs per forward, ``--global-batch``
  packs per step, each step through ``Trainer.train_iteration`` (the loop's own step: it advances the
  consumed samples, so step ``k`` trains packs ``k*G .. k*G+G-1``);
* ``transformers``: the same directory loaded by ``AutoModelForCausalLM`` (sdpa), each pack flattened
  to one row with ``position_ids`` restarting per sample (padding-free; sdpa does not isolate the
  samples, so it attends across them: more work than ours, never less), the same labels, per-token mean
  over the step, torch's fused AdamW; the same packs in the same steps (each side records the packs it
  trained: ``packs per step``);
* LoRA (``--lora-r``): ours with ``--lora-r R --lora-alpha 2R`` on every linear layer, against transformers
  + PEFT (``target_modules="all-linear"``), the same packs.

Printed per side: real (non-pad) tokens/s, model TFLOP/s and MFU (FLOPs of the *timed* packs' real
samples, the trainer's formula; LoRA: the frozen base's forward and input gradients only, see
:func:`step_flops`), peak memory, kernel launches per step (aten ops dispatched on a CPU), host syncs
per step (:mod:`mindspeed_pack.tools.host_syncs`: reads of GPU tensors; on a CPU every read, host-side
batch building included), GPU busy share; then ours / transformers.

``--profile`` adds a torch.profiler summary of two more steps per side: GPU busy, kernel launches and host
syncs per iteration, GPU time split into matmuls, attention, loss, optimizer, elementwise/norm/RoPE,
communication and idle, and the top 10 kernels (on a CPU aten ops stand in for kernels).

``--suite`` runs the issue's whole table in one command and writes one JSON (``--json``, after every run), its
parts in ``--parts`` order: (a) ``shapes``: ``--suite-shapes`` (0.5b 1.5b), ours vs transformers; ``layers``: ours
with every transformer layer compiled whole (``--torch-compile-kernels layers``; at the sweep shape also at 2 packs
per forward) against the default (on CUDA the default compiles the layers whole too since 2026-11-28, so there the
1-pack run repeats (a)'s; ``--torch-compile-kernels regions`` was the default before); ``loss``: ours
with ``--loss-chunks`` (0: the unfused loss) against the default at those shapes; (b) ``lora``: LoRA r=16 at
``--lora-shape`` (7b), ours vs transformers + PEFT; (c) ``microbatch``: ours at ``--micro-batches`` (1 2 4) packs
per forward at ``--sweep-shape`` (0.5b; 1 is (a)'s run); (d) with ``--profile``, the profile of every run (it
also counts the launches). What cannot run here (no GPU, no flash kernel, no peft, a run past ``--deadline``) is
named under ``"skipped"`` and the rest goes on; on a CPU every shape defaults to ``tiny``::

    python bench/bench_gpu_train.py --shape 0.5b            # H100: one shape
    python bench/bench_gpu_train.py --suite --profile --json suite.json
    python bench/bench_gpu_train.py --suite --parts lora --json lora.json   # one part (fits a 10-minute call)
    python bench/bench_gpu_train.py --shape tiny            # any machine, CPU included
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import resource
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, List, Optional

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mindspeed_pack.packing.balance import cost_model, model_shape  # noqa: E402
from mindspeed_pack.packing.binpack import pack_lengths  # noqa: E402
from mindspeed_pack.packing.segments import IGNORE_INDEX, build_packed_batch  # noqa: E402
from mindspeed_pack.tools.host_syncs import HostSyncCounter  # noqa: E402

QWEN = dict(rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768)
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    # Qwen2.5-7B's layers, 4 of its 28 (fits one GPU with full fine-tuning's optimizer state)
    "7b-4l": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=4, num_attention_heads=28,
                  num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0}
SUITE_PARTS = ("shapes", "layers", "loss", "lora", "microbatch")
PROFILED_STEPS = 2


# --------------------------------------------------------------------------- data
def make_packs(seq_length: int, num_packs: int, vocab: int, seed: int = 0):
    """``num_packs`` packed rows (ids, aligned labels, segment ids) of heavy-tailed instruction samples."""
    rng = np.random.default_rng(seed)
    mean = seq_length / 27
    lengths = np.clip(rng.lognormal(np.log(mean) - 0.32, 0.8, size=num_packs * 40), 8, seq_length).astype(np.int64)
    plan = pack_lengths(lengths, seq_length)
    if plan.num_bins < num_packs:
        raise SystemExit(f"only {plan.num_bins} packs from the generated samples")
    ids = np.zeros((num_packs, seq_length), np.int32)
    labels = np.full((num_packs, seq_length), IGNORE_INDEX, np.int32)
    segments = np.zeros((num_packs, seq_length), np.int32)
    for row, items in enumerate(plan.bins()[:num_packs]):
        pos = 0
        for k, item in enumerate(items, start=1):
            n = int(lengths[item])
            x = rng.integers(3, vocab, n)
            ids[row, pos:pos + n], segments[row, pos:pos + n] = x, k
            prompt = max(1, int(0.4 * n))
            labels[row, pos + prompt:pos + n] = x[prompt:]
            pos += n
    return ids, labels, segments


def write_packs(prefix: str, ids, labels, segments) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    seq = ids.shape[1]
    for key, arr in (("input_ids", ids), ("attention_mask", segments), ("labels", labels)):
        builder = IndexedDatasetBuilder(f"{prefix}_packed_{key}_document.bin", dtype=np.int32)
        for row in arr:
            builder.add_document(row, [seq])
        builder.finalize(f"{prefix}_packed_{key}_document.idx")
    with open(f"{prefix}_packed_meta.json", "w") as f:
        json.dump({"layout": {"kind": "packed", "neat_pack": True, "seq_length": seq}}, f)


def sample_lengths(segments_row) -> np.ndarray:
    seg = np.asarray(segments_row)
    starts = np.flatnonzero(np.diff(np.concatenate([[-1], seg])) != 0)
    lengths = np.diff(np.concatenate([starts, [len(seg)]]))
    return lengths[seg[starts] > 0]


# --------------------------------------------------------------------------- FLOPs
def shape_args(shape: str) -> SimpleNamespace:
    """Megatron-LM model flags of a shape (what the trainer's cost model reads)."""
    c = SHAPES[shape]
    return SimpleNamespace(hidden_size=c["hidden_size"], num_layers=c["num_hidden_layers"],
                           num_attention_heads=c["num_attention_heads"], num_query_groups=c["num_key_value_heads"],
                           ffn_hidden_size=c["intermediate_size"], padded_vocab_size=c["vocab_size"], swiglu=True)


def lora_parameters(shape: str, r: int) -> int:
    """Adapter parameters of rank ``r`` on every linear layer (q, k, v, o, gate, up, down: PEFT's all-linear)."""
    m = model_shape(shape_args(shape))
    h, ffn = m.hidden, SHAPES[shape]["intermediate_size"]
    q, kv = m.heads * m.head_dim, (m.qkv_rows - m.heads * m.head_dim) // 2
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + ffn) + (ffn + h)
    return r * per_layer * m.layers


def step_flops(shape: str, lengths: List[np.ndarray], lora_r: Optional[int] = None) -> float:
    """Model FLOPs of training on the samples of ``lengths`` (the trainer's formula: 3 x forward).

    LoRA: the frozen base computes its forward and its input gradients (2 x its forward, no weight
    gradients), the adapters train fully (6 FLOPs per parameter and token), attention as in full training."""
    cm = cost_model(shape_args(shape))
    lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    tokens, sum_sq = float(lengths.sum()), float((lengths.astype(np.float64) ** 2).sum())
    if not lora_r:
        return cm.flops(tokens, sum_sq)
    return 2.0 * cm.linear * tokens + 3.0 * cm.attention * sum_sq + 6.0 * lora_parameters(shape, lora_r) * tokens


# --------------------------------------------------------------------------- measurements
def on_gpu() -> bool:
    return torch.cuda.is_available()


def sync():
    if on_gpu():
        torch.cuda.synchronize()


def peak_memory_gib() -> float:
    if on_gpu():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB -> GiB (RSS, whole process)


def reset_peak_memory():
    if on_gpu():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def launches_and_busy(step) -> tuple:
    """Kernel launches of one step and the share of its wall time the GPU computed (CPU: aten ops, n/a)."""
    if not on_gpu():
        from torch.utils._python_dispatch import TorchDispatchMode

        class Ops(TorchDispatchMode):
            n = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                Ops.n += 1
                return func(*args, **(kwargs or {}))

        with Ops():
            step()
        return Ops.n, float("nan")
    profiled = profile_steps(step, 1)
    return profiled["kernel launches/iteration"], profiled["GPU busy"]


def syncs_of(step) -> int:
    with HostSyncCounter(device_only=on_gpu()) as counter:
        step()
        sync()
    return counter.total


# --------------------------------------------------------------------------- the profile
CATEGORIES = ("matmuls", "attention", "loss", "optimizer", "elementwise/norm/RoPE", "communication")
_COMM = re.compile(r"nccl|c10d::|all_?reduce|all_?gather|reduce_?scatter|broadcast", re.I)
_ATTENTION = re.compile(r"attention|attn|flash|fmha|sdpa", re.I)
_MATMUL_KERNEL = re.compile(r"gemm|cutlass|xmma|nvjet|cublas|wgmma|s16816|s1688", re.I)
_MATMUL_OP = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|addbmm|matmul|addmv|mv|dot|_addmm_activation)$")
_OPTIMIZER = re.compile(r"optimizer|adam|multi_tensor|clip_grad|_foreach_norm", re.I)
_LOSS = re.compile(r"^loss$|cross_?entropy|nll_?loss|log_?softmax", re.I)
_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
_LAUNCH_CALLS = re.compile(r"^cu(da)?LaunchKernel|^cudaLaunchCooperativeKernel|^cudaGraphLaunch")


@dataclass
class KernelRecord:
    """One kernel (on a CPU: one aten op's self time): name, microseconds, start, and the enclosing ops' names."""

    name: str
    us: float
    start: float = 0.0
    scope: tuple = field(default_factory=tuple)


def categorize(record: KernelRecord) -> str:
    """The share of the step a kernel belongs to: by its own name first (communication, attention, GEMM),
    then by the op or labelled region that launched it (optimizer step, loss); the rest is elementwise."""
    names = (record.name, *record.scope)
    if any(_COMM.search(n) for n in names):
        return "communication"
    if any(_ATTENTION.search(n) for n in names):
        return "attention"
    if _MATMUL_KERNEL.search(record.name) or _MATMUL_OP.match(record.name):
        return "matmuls"
    if any(_OPTIMIZER.search(n) for n in names):
        return "optimizer"
    if any(_LOSS.search(n) for n in names):
        return "loss"
    return "elementwise/norm/RoPE"


def _busy_us(records: List[KernelRecord], on_device: bool) -> float:
    """Time any kernel ran (GPU: the union of kernel intervals across streams; CPU: the ops' self times)."""
    if not on_device:
        return sum(r.us for r in records)
    busy, end = 0.0, float("-inf")
    for r in sorted(records, key=lambda r: r.start):
        stop = r.start + r.us
        if stop > end:
            busy += stop - max(r.start, end)
            end = stop
    return busy


def summarize(records: List[KernelRecord], wall_s: float, iterations: int, on_device: bool) -> dict:
    """Per iteration: time per category (ms) and its share of the wall time, idle, busy share, top 10 kernels."""
    per = {c: 0.0 for c in CATEGORIES}
    by_name = {}
    for r in records:
        c = categorize(r)
        per[c] += r.us
        total, calls, _ = by_name.get(r.name, (0.0, 0, c))
        by_name[r.name] = (total + r.us, calls + 1, c)
    wall_ms = wall_s * 1e3 / iterations
    busy_ms = _busy_us(records, on_device) / 1e3 / iterations
    split = {c: per[c] / 1e3 / iterations for c in CATEGORIES}
    split["idle"] = max(0.0, wall_ms - busy_ms)
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    top = ranked[:10]

    def row(n, t, k, c):
        return {"name": n[:160], "ms/iteration": t / 1e3 / iterations, "calls/iteration": k / iterations,
                "category": c}
    return {
        "wall ms/iteration": wall_ms,
        "busy ms/iteration": busy_ms,
        # on a CPU: the share of the wall time spent inside aten ops
        "GPU busy" if on_device else "busy in aten ops": min(1.0, busy_ms / wall_ms) if wall_ms > 0 else float("nan"),
        "time split ms/iteration": split,
        "time split share": {k: v / wall_ms for k, v in split.items()} if wall_ms > 0 else {},
        "top 10 kernels": [row(n, t, k, c) for n, (t, k, c) in top],
        # what each category is made of (the next GPU session's question is usually "which kernel of the loss?")
        "top 3 per category": {cat: [row(n, t, k, c) for n, (t, k, c) in ranked if c == cat][:3]
                               for cat in CATEGORIES},
    }


def _scope(event) -> tuple:
    names, parent = [], event.cpu_parent
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    return tuple(names)


def kernel_records(events, on_device: bool) -> List[KernelRecord]:
    """GPU: every device kernel with the scope of the CPU op that launched it (kineto links them by
    correlation id); CPU: every aten/c10d op's self time (the stand-in for kernels)."""
    from torch.autograd import DeviceType

    cpu_ops = {e.id: e for e in events if e.device_type == DeviceType.CPU}
    out = []
    for e in events:
        # a record_function range (the "loss" and "optimizer" labels) shows on the GPU's timeline too, as a user
        # annotation spanning its kernels: not a kernel (counted, it doubled the loss's time)
        if getattr(e, "is_user_annotation", False):
            continue
        if on_device and e.device_type == DeviceType.CUDA:
            op = cpu_ops.get(getattr(e, "linked_correlation_id", 0))
            scope = ((op.name,) + _scope(op)) if op is not None else ()
            out.append(KernelRecord(e.name, e.time_range.end - e.time_range.start, e.time_range.start, scope))
        elif not on_device and e.device_type == DeviceType.CPU and re.match(r"(aten|c10d)::", e.name):
            out.append(KernelRecord(e.name, e.self_cpu_time_total, e.time_range.start, _scope(e)))
    return out


def profile_steps(step, iterations: int = PROFILED_STEPS) -> dict:
    """torch.profiler over ``iterations`` steps, summarised (:func:`summarize`)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    device = on_gpu()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device else [])
    sync()
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(iterations):
            step()
        sync()
    wall = time.perf_counter() - start
    events = prof.events()
    records = kernel_records(events, device)
    out = summarize(records, wall, iterations, device)
    if device:
        runtime = [e.name for e in events if e.device_type == DeviceType.CPU]
        out["kernel launches/iteration"] = sum(1 for n in runtime if _LAUNCH_CALLS.match(n)) / iterations
        # the bench's own synchronize at the end excluded
        syncs = sum(1 for n in runtime if n in _SYNC_CALLS) - 1
        out["host syncs/iteration (CUDA API)"] = max(0, syncs) / iterations
        out["host"] = host_summary([e for e in events if e.device_type == DeviceType.CPU], wall, iterations)
    else:
        out["kernel launches/iteration"] = len(records) / iterations
        out["device"] = "cpu: aten ops stand in for kernels, 'idle' is time outside them"
    return out


def host_summary(cpu_events, wall_s: float, iterations: int) -> dict:
    """Where the host's time goes (a host-bound step's question): per iteration, the self time of the ATen ops and
    of the CUDA runtime calls (launches, copies, syncs), the rest (Python, the dispatcher outside the ops, the
    profiler itself), and the 10 ATen ops of most self time (with their calls per iteration)."""
    ops, runtime = {}, 0.0
    for e in cpu_events:
        if getattr(e, "is_user_annotation", False):
            continue
        if e.name.startswith("cu"):  # cudaLaunchKernel, cuLaunchKernel, cudaMemcpyAsync, ...
            runtime += e.self_cpu_time_total
        elif e.name.startswith(("aten::", "c10d::")):
            total, calls = ops.get(e.name, (0.0, 0))
            ops[e.name] = (total + e.self_cpu_time_total, calls + 1)
    wall_ms = wall_s * 1e3 / iterations
    aten_ms = sum(t for t, _ in ops.values()) / 1e3 / iterations
    runtime_ms = runtime / 1e3 / iterations
    top = sorted(ops.items(), key=lambda kv: -kv[1][0])[:10]
    return {"wall ms/iteration (profiled)": wall_ms, "ATen ops self ms/iteration": aten_ms,
            "CUDA runtime calls ms/iteration": runtime_ms,
            "rest ms/iteration (Python, dispatch, profiler)": max(0.0, wall_ms - aten_ms - runtime_ms),
            "top 10 host ops": [{"name": n, "self ms/iteration": t / 1e3 / iterations,
                                 "calls/iteration": k / iterations} for n, (t, k) in top]}


@contextlib.contextmanager
def labelled(obj, attr: str, label: str):
    """``obj.attr`` called inside a profiler range named ``label`` (how the profile tells the loss and the
    optimizer step from the rest), restored afterwards."""
    from torch.profiler import record_function

    original = getattr(obj, attr)
    own = attr in vars(obj)  # an instance attribute (else a method of the class)

    def call(*args, **kwargs):
        with record_function(label):
            return original(*args, **kwargs)

    setattr(obj, attr, call)
    try:
        yield
    finally:
        if own:
            setattr(obj, attr, original)
        else:
            delattr(obj, attr)


# --------------------------------------------------------------------------- the sides
@dataclass
class Side:
    """A training loop to measure: ``step()`` trains the next global batch and returns its real tokens;
    ``trained`` gets each step's pack indices."""

    step: Callable[[], int]
    trained: list
    backend: str
    labels: list = field(default_factory=list)  # (object, attribute, profiler label) for the profile


def steps_run(opts) -> int:
    """Steps each side trains: warm-up, timed, one counting host syncs, then the profiled steps (``--profile``)
    or one counting kernel launches."""
    return opts.warmup + opts.steps + 1 + (PROFILED_STEPS if opts.profile else 1)


def measure(side: Side, opts, shape: str, lengths: List[np.ndarray], peak: Optional[float],
            lora_r: Optional[int] = None) -> dict:
    """Warm-up, timed steps (tokens/s, TFLOP/s of the timed packs, MFU, peak memory), one step counting
    launches, one counting host syncs, and with ``--profile`` two profiled steps. The warm-up's seconds (compiles
    included) and each timed step's are kept: runs of the same code varied by 20% between device calls."""
    warm = time.perf_counter()
    for _ in range(opts.warmup):
        side.step()
    sync()
    warm = time.perf_counter() - warm
    reset_peak_memory()
    first = len(side.trained)
    times, tokens = [], 0
    for _ in range(opts.steps):
        start = time.perf_counter()
        tokens += int(side.step())
        sync()
        times.append(time.perf_counter() - start)
    seconds = float(np.sum(times))
    timed_packs = side.trained[first:first + opts.steps]
    flops = step_flops(shape, [lengths[i] for packs in timed_packs for i in packs], lora_r)
    result = {"backend": side.backend, "seconds": seconds, "tokens": tokens, "tokens/s": tokens / seconds,
              "TFLOP/s": flops / seconds / 1e12, "peak memory GiB": peak_memory_gib(),
              "warm-up seconds": warm, "step seconds": times}
    result["MFU"] = result["TFLOP/s"] / peak if peak else None
    result["syncs/step"] = syncs_of(side.step)
    if opts.profile:  # the profile counts the launches and the busy share too: no separate step for them
        with contextlib.ExitStack() as stack:
            for obj, attr, label in side.labels:
                stack.enter_context(labelled(obj, attr, label))
            result["profile"] = profile_steps(side.step, PROFILED_STEPS)
        result["profile"]["host syncs/iteration (HostSyncCounter)"] = result["syncs/step"]
        result["launches/step"] = result["profile"]["kernel launches/iteration"]
        # the profiler slows the host (twice the wall time at 0.5B): the GPU's share of a *timed* step is the
        # profiled kernels' busy time over the timed step's mean
        result["GPU busy"] = min(1.0, result["profile"]["busy ms/iteration"] / (seconds / opts.steps * 1e3)) \
            if on_gpu() else float("nan")
    else:
        result["launches/step"], result["GPU busy"] = launches_and_busy(side.step)
    result["torch.compile"] = compile_report()
    result["timed packs"] = timed_packs
    result["packs per step"] = list(side.trained)
    return result


def _attention_backend(trainer) -> str:
    chunk = trainer.model[0]
    return chunk.module.attention_backend if hasattr(chunk, "module") else chunk.attention_backend


def release(side: Optional["Side"]) -> None:
    """Free a finished run's model and optimizer now. The caller still holds its :class:`Side` (``with ... as
    side`` outlives the block), whose profiler labels reach the model and the optimizer, and megatron-core's DDP
    hooks make reference cycles that only a collection frees: left alone, the last run's weights and optimizer
    state stayed allocated through the next run (on the H200: 71 GiB at 1.5B with two packs per forward, ~26 GiB
    of it the previous run's)."""
    if side is not None:
        side.step, side.labels = None, []
    gc.collect()
    if on_gpu():
        torch.cuda.empty_cache()


def fresh_compile() -> None:
    """Forget every torch.compile'd function before a run. A region compiled at one shape and called at another
    is recompiled with symbolic sizes, and stays so: on an H200 megatron-core's compiled SwiGLU backward then
    ran 3x slower at 1.5B after a 0.5B run in the same process. Each run compiles at its own shape, as a
    training job does."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    release(None)  # whatever an earlier run left behind


def compile_report() -> dict:
    """torch.compile's counters since the run began: frames compiled, recompilations, graph breaks and
    fallbacks to eager (a region that hit the recompile limit runs eagerly, silently but for a log line)."""
    from torch._dynamo.utils import counters

    return {group: {str(k)[:120]: v for k, v in c.items()} for group, c in counters.items() if c}


@contextlib.contextmanager
def ours(hf_dir, prefix, opts, extra_flags=()):
    """posttrain's Trainer on the packs (``--no-shuffle``: step ``k`` reads packs ``k*G .. k*G+G-1``)."""
    from megatron.core.models.gpt import GPTModel

    from mindspeed_pack.config.arguments import parse_args
    from mindspeed_pack.datasets.packed_dataset import PackedBatchSource
    from mindspeed_pack.training.stages.sft import SFTStage
    from mindspeed_pack.training.trainer import Trainer

    fresh_compile()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    argv = ["--load", hf_dir, "--data-path", prefix, "--neat-pack", "--seq-length", str(opts.seq_length),
            "--micro-batch-size", "1", "--global-batch-size", str(opts.global_batch), "--train-iters",
            str(steps_run(opts)), "--lr", "1e-5", "--min-lr", "1e-6", "--lr-warmup-iters", "0",
            "--lr-decay-style", "constant", "--no-shuffle", "--eval-iters", "0", "--log-interval", "1000000",
            "--attention-backend", opts.backend, "--clip-grad", "1.0", *(["--bf16"] if on_gpu() else []),
            *extra_flags]
    args = parse_args(argv)
    trainer = Trainer(args, PackedBatchSource(), SFTStage(args))
    trainer.setup()
    try:
        for chunk in trainer.model:
            chunk.train()
        trained = []
        read = trainer.source.micro_batches

        def recording(split, consumed):  # which packs (documents of the prefix) each step trains
            packs = []
            trained.append(packs)
            for mb in read(split, consumed):
                packs.extend(int(d) for d in mb["documents"])
                yield mb

        trainer.source.micro_batches = recording
        gpt = next(m for m in trainer.model[0].modules() if isinstance(m, GPTModel))
        labels = [(gpt, "_postprocess", "loss"), (trainer.optimizer, "step", "optimizer"),
                  (trainer.optimizer, "zero_grad", "optimizer")]
        side = Side(lambda: trainer.train_iteration()["tokens"], trained, _attention_backend(trainer), labels)
        yield side
    finally:
        trainer.cleanup()
        del trainer
        release(locals().get("side"))


@contextlib.contextmanager
def transformers_loop(hf_dir, packs, opts, lora_r: Optional[int] = None):
    """The transformers padding-free loop (with PEFT adapters when ``lora_r``) over the packs in order."""
    import transformers

    fresh_compile()
    device = "cuda" if on_gpu() else "cpu"
    dtype = torch.bfloat16 if on_gpu() else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype, attn_implementation="sdpa")
    backend = "sdpa (position_ids; not isolated)"
    if lora_r:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0,
                                                 target_modules="all-linear", bias="none"))
        backend += f" + PEFT LoRA r={lora_r}"
    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    ids, labels, segments = packs
    state = {"next": 0}
    trained = []

    def loss_of(logits, target, trained_tokens):
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), target.view(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum") / trained_tokens

    def update():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    side = SimpleNamespace(loss_of=loss_of, update=update, zero=optimizer.zero_grad)

    def step():
        side.zero(set_to_none=True)
        chosen = [i % len(ids) for i in range(state["next"], state["next"] + opts.global_batch)]
        state["next"] += opts.global_batch
        trained.append(chosen)
        rows = [build_packed_batch(torch.from_numpy(ids[i]).long()[None], torch.from_numpy(labels[i]).long()[None],
                                   torch.from_numpy(segments[i]).long()[None]) for i in chosen]
        trained_tokens = sum(float(b.loss_mask.sum()) for b in rows)
        real = 0
        for b in rows:
            b = b.to(device)
            logits = model(input_ids=b.tokens, position_ids=b.position_ids).logits
            target = torch.where(b.loss_mask > 0, b.target, torch.full_like(b.target, IGNORE_INDEX))
            side.loss_of(logits, target, trained_tokens).backward()
            real += b.num_tokens - b.num_pad_tokens
        side.update()
        return real

    measured = Side(step, trained, backend, [(side, "loss_of", "loss"), (side, "update", "optimizer"),
                                             (side, "zero", "optimizer")])
    try:
        yield measured
    finally:
        del model, optimizer, params
        release(measured)


# --------------------------------------------------------------------------- one shape
class Workspace:
    """The shapes' HF directories and packed datasets of one run (built once per shape, in ``root``)."""

    def __init__(self, root: str, opts):
        self.root, self.opts, self.made = root, opts, {}

    def get(self, shape: str):
        if shape not in self.made:
            import transformers

            opts = self.opts
            config = transformers.Qwen2Config(**SHAPES[shape], **QWEN)
            torch.manual_seed(0)
            dtype = torch.bfloat16 if on_gpu() else torch.float32
            previous = torch.get_default_dtype()
            torch.set_default_dtype(dtype)  # built in the training dtype: a 7B model never exists in fp32
            try:
                with torch.device("cuda" if on_gpu() else "cpu"):
                    model = transformers.Qwen2ForCausalLM(config)
            finally:
                torch.set_default_dtype(previous)
            hf_dir = os.path.join(self.root, shape, "hf")
            model.save_pretrained(hf_dir)
            del model
            gc.collect()
            if on_gpu():
                torch.cuda.empty_cache()
            packs = make_packs(opts.seq_length, steps_run(opts) * opts.global_batch, config.vocab_size)
            prefix = os.path.join(self.root, shape, "data", "bench")
            os.makedirs(os.path.dirname(prefix))
            write_packs(prefix, *packs)
            lengths = [sample_lengths(row) for row in packs[2]]
            real = sum(int(x.sum()) for x in lengths)
            print(f"data ({shape}): {len(lengths)} packs, {sum(len(x) for x in lengths) / len(lengths):.1f} samples "
                  f"per pack, padding {1 - real / packs[0].size:.3f}", flush=True)
            self.made[shape] = (hf_dir, prefix, packs, lengths)
        return self.made[shape]


def compare(ws: Workspace, shape: str, opts, peak, only: Optional[str] = None, lora_r: Optional[int] = None,
            skipped: Optional[list] = None) -> dict:
    """Ours vs the transformers loop (+ PEFT with ``lora_r``) at ``shape``, the same packs in the same steps."""
    hf_dir, prefix, packs, lengths = ws.get(shape)
    baseline = "transformers+peft" if lora_r else "transformers"
    results = {}
    if only != baseline:
        flags = ["--lora-r", str(lora_r), "--lora-alpha", str(2 * lora_r)] if lora_r else []
        with ours(hf_dir, prefix, opts, flags) as side:
            results["ours"] = measure(side, opts, shape, lengths, peak, lora_r)
    if only != "ours":
        missing = _missing_peft() if lora_r else None
        if missing:
            (skipped if skipped is not None else []).append({"part": f"{shape} {baseline}", "why": missing})
            results[baseline] = {"skipped": missing}
        else:
            with transformers_loop(hf_dir, packs, opts, lora_r) as side:
                results[baseline] = measure(side, opts, shape, lengths, peak, lora_r)
    measured = [r for r in results.values() if "tokens/s" in r]
    if len(measured) == 2:
        results["ratio"] = measured[0]["tokens/s"] / measured[1]["tokens/s"]
        results["same packs"] = measured[0]["packs per step"] == measured[1]["packs per step"]
    return results


def _missing_peft() -> Optional[str]:
    try:
        import peft  # noqa: F401
    except ImportError as e:
        return f"peft is not installed ({e}): pip install peft"
    return None


def print_table(title: str, results: dict) -> None:
    print(f"\n{title}\n{'side':<30}{'backend':<32}{'tokens/s':>10}{'TFLOP/s':>9}{'MFU':>7}{'peak GiB':>10}"
          f"{'launches':>10}{'syncs':>7}{'GPU busy':>9}")
    for side, r in results.items():
        if not isinstance(r, dict) or "tokens/s" not in r:
            continue
        mfu = f"{r['MFU']:.1%}" if r.get("MFU") is not None else "n/a"
        busy = r["GPU busy"]
        busy = f"{busy:.1%}" if busy == busy else "n/a"  # NaN without a GPU
        print(f"{side[:29]:<30}{r['backend'][:31]:<32}{r['tokens/s']:>10.0f}{r['TFLOP/s']:>9.2f}{mfu:>7}"
              f"{r['peak memory GiB']:>10.2f}{r['launches/step']:>10}{r['syncs/step']:>7}{busy:>9}")
    if "ratio" in results:
        print(f"ours / baseline: {results['ratio']:.2f}x real tokens/s; same packs in every step: "
              f"{results['same packs']}")


# --------------------------------------------------------------------------- the suite
def _flash_missing(backend: str) -> Optional[str]:
    from mindspeed_pack.model.flash_attention import flash_unavailable_reason

    if backend in ("flash", "te"):
        return None
    why = flash_unavailable_reason(torch.bfloat16, on_gpu(), 0.0)
    return f"ours ran the {backend} backend: {why or 'not chosen'}"


def _layers_missing() -> Optional[str]:
    """Why compiled layers cannot run here (they need the flash backend; a test lends one to a CPU)."""
    from mindspeed_pack.model import spec

    why = spec.flash_unavailable_reason(torch.bfloat16 if on_gpu() else torch.float32, on_gpu(), 0.0)
    return f"compiled layers need the flash backend: {why}" if why else None


def run_suite(opts, ws: Workspace, peak, device_name: str) -> dict:
    """The parts in ``--parts`` order: (a) shapes, the loss paths, (b) LoRA, (c) the micro-batch sweep, and the
    profiles (``--profile``). The JSON is written after every run, so a part that fails or a call that times out
    keeps what was measured; a run that would start after ``--deadline`` seconds is skipped and named."""
    out = {"device": device_name, "torch": torch.__version__, "suite": {}, "skipped": []}
    skipped = out["skipped"]
    started = time.perf_counter()
    if not on_gpu():
        skipped.append({"part": "MFU, GPU busy, kernel time split", "why": "no GPU: MFU needs a device peak, the "
                        "profile's split is of aten ops on the CPU"})

    def save():
        if opts.json:
            with open(opts.json, "w") as f:
                json.dump(out, f, indent=1, default=str)

    def late(what) -> bool:
        """Past ``--deadline``: ``what`` is not started (named under "skipped")."""
        elapsed = time.perf_counter() - started
        if opts.deadline is None or elapsed < opts.deadline:
            return False
        skipped.append({"part": what, "why": f"not started: {elapsed:.0f} s elapsed, past --deadline {opts.deadline}"})
        return True

    def part(name, fn):
        print(f"\n=== {name} ({time.perf_counter() - started:.0f} s)", flush=True)
        out["suite"][name] = results = {}
        try:
            fn(results)
        except Exception as e:  # one part's failure (out of memory, a missing kernel) never loses the others
            traceback.print_exc()
            results["failed"] = f"{type(e).__name__}: {e}"
            skipped.append({"part": name, "why": f"failed: {type(e).__name__}: {e}"})
        save()

    def shapes(res):
        for shape in opts.suite_shapes:
            if late(f"(a) {shape}"):
                continue
            res[shape] = compare(ws, shape, opts, peak, skipped=skipped)
            save()
            print_table(f"(a) {shape}: ours vs transformers padding-free", res[shape])
            backend = res[shape].get("ours", {}).get("backend")
            if backend and _flash_missing(backend):
                skipped.append({"part": f"{shape} flash attention", "why": _flash_missing(backend)})

    def loss(res):
        """Ours with each ``--loss-chunks`` setting (0: megatron-core's unfused loss) against the default path of
        (a), the same packs: which loss path the default should take at each shape."""
        for shape in opts.suite_shapes:
            default = out["suite"].get("shapes", {}).get(shape, {}).get("ours")
            res[shape] = row = {"default": default} if default else {}
            hf_dir, prefix, _, lengths = ws.get(shape)
            for chunk in opts.loss_chunks:
                if late(f"loss path --cross-entropy-chunk-size {chunk} at {shape}"):
                    continue
                with ours(hf_dir, prefix, opts, ["--cross-entropy-chunk-size", str(chunk)]) as side:
                    row[f"--cross-entropy-chunk-size {chunk}"] = measure(side, opts, shape, lengths, peak)
                save()
            print_table(f"loss paths at {shape} (ours; default: chunked above 512 MiB of fp32 logits)", row)

    def layers(res):
        """Ours with every transformer layer compiled whole (``--torch-compile-kernels layers``) against (a)'s
        default, the same packs, at each shape and, at the sweep shape, at 2 packs per forward too."""
        for shape in opts.suite_shapes:
            row = {"default": out["suite"].get("shapes", {}).get(shape, {}).get("ours"),
                   "transformers": out["suite"].get("shapes", {}).get(shape, {}).get("transformers")}
            res[shape] = row = {k: v for k, v in row.items() if v}
            hf_dir, prefix, _, lengths = ws.get(shape)
            for mbs in ([1, 2] if shape == opts.sweep_shape and opts.global_batch % 2 == 0 else [1]):
                what = f"--torch-compile-kernels layers, {mbs} pack{'s' if mbs > 1 else ''} per forward"
                missing = _layers_missing()
                if missing:
                    skipped.append({"part": f"{what} at {shape}", "why": missing})
                    continue
                if late(f"{what} at {shape}"):
                    continue
                try:  # a layer that does not compile on this machine is this run's result, not the part's end
                    with ours(hf_dir, prefix, opts, ["--torch-compile-kernels", "layers", "--micro-batch-size",
                                                     str(mbs)]) as side:
                        row[what] = measure(side, opts, shape, lengths, peak)
                except Exception as e:
                    traceback.print_exc()
                    row[what] = {"failed": f"{type(e).__name__}: {e}"}
                    skipped.append({"part": f"{what} at {shape}", "why": f"failed: {type(e).__name__}: {e}"})
                save()
            print_table(f"layers compiled whole at {shape} (ours) against the default and transformers", row)
            for what, r in row.items():
                for base in ("default", "transformers"):
                    if what.startswith("--") and "tokens/s" in r and base in row:
                        r[f"x {base}"] = r["tokens/s"] / row[base]["tokens/s"]
                        print(f"{what}: {r[f'x {base}']:.2f}x {base} real tokens/s")

    def lora(res):
        res.update(shape=opts.lora_shape, r=opts.lora_r, **{"adapter parameters": lora_parameters(opts.lora_shape,
                                                                                                opts.lora_r)})
        if late(f"(b) LoRA at {opts.lora_shape}"):
            return
        res.update(compare(ws, opts.lora_shape, opts, peak, lora_r=opts.lora_r, skipped=skipped))
        print_table(f"(b) LoRA r={opts.lora_r} all linear at {opts.lora_shape}: ours vs transformers + PEFT", res)

    def sweep(res):
        res["shape"] = opts.sweep_shape
        hf_dir, prefix, _, lengths = ws.get(opts.sweep_shape)
        for mbs in opts.micro_batches:
            key = f"{mbs} packs per forward"
            if opts.global_batch % mbs:
                skipped.append({"part": f"micro-batch {mbs}", "why": f"--global-batch {opts.global_batch} is "
                                f"not a multiple of {mbs}"})
                continue
            measured = out["suite"].get("shapes", {}).get(opts.sweep_shape, {}).get("ours")
            if mbs == 1 and measured:  # (a) measured this very run: not again
                res[key] = dict(measured, source="(a)")
                continue
            if late(f"(c) micro-batch {mbs}"):
                continue
            with ours(hf_dir, prefix, opts, ["--micro-batch-size", str(mbs)]) as side:
                res[key] = measure(side, opts, opts.sweep_shape, lengths, peak)
            save()
        print_table(f"(c) micro-batch sweep at {opts.sweep_shape} (ours)", res)

    for name in opts.parts:
        part(name, {"shapes": shapes, "layers": layers, "loss": loss, "lora": lora, "microbatch": sweep}[name])
    if not opts.profile:
        skipped.append({"part": "profile", "why": "not asked for (--profile)"})
    out["seconds"] = time.perf_counter() - started
    save()
    print(f"\nsuite: {out['seconds']:.0f} s; skipped:" + "".join(f"\n- {s['part']}: {s['why']}" for s in skipped))
    return out


# --------------------------------------------------------------------------- main
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="tiny", choices=list(SHAPES))
    p.add_argument("--seq-length", type=int, default=None, help="pack length (default 4096; CPU: 512)")
    p.add_argument("--global-batch", type=int, default=None, help="packs per optimizer step (default 16; CPU: 4)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--backend", default="auto", choices=["auto", "te", "flash", "local"])
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak (default: by device name)")
    p.add_argument("--only", choices=["ours", "transformers"], default=None, help="run one side only")
    p.add_argument("--lora-r", type=int, default=None, help="LoRA rank on all linear layers (ours and PEFT)")
    p.add_argument("--profile", action="store_true", help="torch.profiler summary of two steps per side")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--suite", action="store_true", help="the issue's parts in one run, one JSON (see above)")
    p.add_argument("--parts", nargs="+", default=list(SUITE_PARTS), choices=SUITE_PARTS, help="suite parts to run")
    p.add_argument("--suite-shapes", nargs="+", default=None, choices=list(SHAPES), help="(a): default 0.5b 1.5b")
    p.add_argument("--lora-shape", default=None, choices=list(SHAPES), help="(b): default 7b")
    p.add_argument("--sweep-shape", default=None, choices=list(SHAPES), help="(c): default 0.5b")
    p.add_argument("--micro-batches", nargs="+", type=int, default=[1, 2, 4], help="(c): packs per forward")
    p.add_argument("--loss-chunks", nargs="+", type=int, default=[0],
                   help="loss part: --cross-entropy-chunk-size settings measured against the default (0: unfused)")
    p.add_argument("--deadline", type=float, default=None,
                   help="suite: seconds after which no further run starts (what is left is named as skipped)")
    opts = p.parse_args(argv)
    gpu = on_gpu()
    small = not gpu or opts.shape == "tiny" and not opts.suite
    opts.seq_length = opts.seq_length or (512 if small else 4096)
    opts.global_batch = opts.global_batch or (4 if small else 16)
    opts.suite_shapes = opts.suite_shapes or (["0.5b", "1.5b"] if gpu else ["tiny"])
    opts.lora_shape = opts.lora_shape or ("7b" if gpu else "tiny")
    opts.sweep_shape = opts.sweep_shape or ("0.5b" if gpu else "tiny")
    if opts.suite and opts.lora_r is None:
        opts.lora_r = 16
    device_name = torch.cuda.get_device_name() if gpu else f"CPU ({os.cpu_count()} cores)"
    peak = opts.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if gpu and k in device_name), None)
    print(f"device: {device_name}; torch {torch.__version__}; seq {opts.seq_length}; {opts.global_batch} packs per "
          f"step; {'bf16' if gpu else 'fp32'}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_gpu_train_") as root:
        ws = Workspace(root, opts)
        if opts.suite:
            return run_suite(opts, ws, peak, device_name)
        side = {"ours": "ours", "transformers": "transformers+peft" if opts.lora_r else "transformers", None: None}
        results = compare(ws, opts.shape, opts, peak, only=side[opts.only], lora_r=opts.lora_r)
    print_table(f"{opts.shape}: ours vs {'transformers + PEFT' if opts.lora_r else 'transformers padding-free'}",
                results)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"device": device_name, "shape": opts.shape, **results}, f, indent=1, default=str)
    return results


if __name__ == "__main__":
    main()

"""Training throughput on a GPU: posttrain's step against a plain transformers padding-free loop (issue 35).

One process, one call, identical packs for both sides:

* data: instruction-like samples (heavy-tailed lengths, ~27 per 4096-token pack, 40% prompt), packed
  by the project's C++ packer into ``--seq-length`` rows and written as the packed indexed datasets
  ``preprocess_data.py --pack --neat-pack`` writes;
* model: a Qwen2.5 shape with random weights (``--shape tiny|0.5b|1.5b|7b-4l``), saved by transformers;
* ``ours``: posttrain.py's Trainer, ``--load HF_DIR --bf16`` (fp32 on a CPU), ``--attention-backend``
  (default auto: TE, else flash, else local), micro-batch 1, ``--global-batch-size`` packs per step;
* ``transformers``: the same directory loaded by ``AutoModelForCausalLM`` (sdpa), each pack flattened
  to one row with ``position_ids`` restarting per sample (padding-free; sdpa does not isolate the
  samples, so it attends across them: more work than ours, never less), the same labels, per-token mean
  over the step, torch's fused AdamW.

Printed per side: real (non-pad) tokens/s, MFU (model FLOPs of the real samples, as the trainer logs them,
over the device's peak), peak memory, kernel launches per step (aten ops dispatched on a CPU), host syncs
per step (:mod:`mindspeed_pack.tools.host_syncs`: reads of GPU tensors; on a CPU every read, host-side batch
building included), GPU busy share; then ours / transformers. Also the
device name. Needs nothing but the project's environment (and a GPU for the real shapes)::

    python bench/bench_gpu_train.py --shape 0.5b            # H100: the issue's table
    python bench/bench_gpu_train.py --shape tiny            # any machine, CPU included
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mindspeed_pack.packing.balance import cost_model  # noqa: E402
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
    # Qwen2.5-7B's layers, 4 of its 28 (fits one GPU with full fine-tuning's optimizer state)
    "7b-4l": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=4, num_attention_heads=28,
                  num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0}


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
    from torch.profiler import ProfilerActivity, profile

    sync()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        sync()
    wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time_total for e in kernels) / 1e6  # us -> s (overlap between streams not removed)
    return len(kernels), min(1.0, busy / wall)


def syncs_of(step) -> int:
    with HostSyncCounter(device_only=on_gpu()) as counter:
        step()
        sync()
    return counter.total


def timed(step, warmup: int, steps: int, tokens_of) -> dict:
    for _ in range(warmup):
        step()
    sync()
    reset_peak_memory()
    times, tokens = [], 0
    for _ in range(steps):
        start = time.perf_counter()
        out = step()
        sync()
        times.append(time.perf_counter() - start)
        tokens += tokens_of(out)
    return {"seconds": float(np.sum(times)), "tokens": tokens, "tokens/s": tokens / float(np.sum(times)),
            "peak memory GiB": peak_memory_gib()}


# --------------------------------------------------------------------------- the two sides
def run_ours(hf_dir, prefix, opts, dtype_flag):
    from mindspeed_pack.config.arguments import parse_args
    from mindspeed_pack.datasets.packed_dataset import PackedBatchSource
    from mindspeed_pack.training.stages.sft import SFTStage
    from mindspeed_pack.training.trainer import Trainer

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    total = opts.warmup + opts.steps + 3
    argv = ["--load", hf_dir, "--data-path", prefix, "--neat-pack", "--seq-length", str(opts.seq_length),
            "--micro-batch-size", "1", "--global-batch-size", str(opts.global_batch), "--train-iters", str(total),
            "--lr", "1e-5", "--min-lr", "1e-6", "--lr-warmup-iters", "0", "--lr-decay-style", "constant",
            "--no-shuffle", "--eval-iters", "0", "--log-interval", "1000000", "--attention-backend", opts.backend,
            "--clip-grad", "1.0", *dtype_flag]
    args = parse_args(argv)
    trainer = Trainer(args, PackedBatchSource(), SFTStage(args))
    trainer.setup()
    try:
        step = trainer.train_step
        result = timed(step, opts.warmup, opts.steps, lambda out: int(out[2]["real tokens"]))
        result["launches/step"], result["GPU busy"] = launches_and_busy(step)
        result["syncs/step"] = syncs_of(step)
        result["backend"] = trainer.model[0].module.attention_backend if hasattr(trainer.model[0], "module") \
            else trainer.model[0].attention_backend
        return result, trainer.args
    finally:
        trainer.cleanup()
        del trainer
        gc.collect()
        if on_gpu():
            torch.cuda.empty_cache()


def run_transformers(hf_dir, packs, opts, dtype):
    import transformers

    device = "cuda" if on_gpu() else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype, attn_implementation="sdpa")
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    ids, labels, segments = packs
    state = {"next": 0}

    def step():
        optimizer.zero_grad(set_to_none=True)
        rows = [build_packed_batch(torch.from_numpy(ids[i]).long()[None], torch.from_numpy(labels[i]).long()[None],
                                   torch.from_numpy(segments[i]).long()[None])
                for i in range(state["next"], state["next"] + opts.global_batch)]
        state["next"] = (state["next"] + opts.global_batch) % len(ids)
        trained = sum(float(b.loss_mask.sum()) for b in rows)
        real = 0
        for b in rows:
            b = b.to(device)
            logits = model(input_ids=b.tokens, position_ids=b.position_ids).logits
            target = torch.where(b.loss_mask > 0, b.target, torch.full_like(b.target, IGNORE_INDEX))
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), target.view(-1),
                                   ignore_index=IGNORE_INDEX, reduction="sum") / trained
            loss.backward()
            real += b.num_tokens - b.num_pad_tokens
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return real

    result = timed(step, opts.warmup, opts.steps, lambda real: real)
    result["launches/step"], result["GPU busy"] = launches_and_busy(step)
    result["syncs/step"] = syncs_of(step)
    result["backend"] = "sdpa (position_ids; not isolated)"
    del model, optimizer
    gc.collect()
    return result


# --------------------------------------------------------------------------- main
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="tiny", choices=list(SHAPES))
    p.add_argument("--seq-length", type=int, default=None, help="pack length (default 4096; tiny: 512)")
    p.add_argument("--global-batch", type=int, default=None, help="packs per optimizer step (default 16; tiny: 4)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--backend", default="auto", choices=["auto", "te", "flash", "local"])
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak (default: by device name)")
    p.add_argument("--only", choices=["ours", "transformers"], default=None, help="run one side only")
    p.add_argument("--json", default=None, help="also write the results here")
    opts = p.parse_args(argv)
    tiny = opts.shape == "tiny"
    opts.seq_length = opts.seq_length or (512 if tiny else 4096)
    opts.global_batch = opts.global_batch or (4 if tiny else 16)
    gpu = on_gpu()
    device_name = torch.cuda.get_device_name() if gpu else f"CPU ({os.cpu_count()} cores)"
    peak = opts.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if gpu and k in device_name), None)
    dtype = torch.bfloat16 if gpu else torch.float32
    print(f"device: {device_name}; torch {torch.__version__}; shape {opts.shape}; seq {opts.seq_length}; "
          f"{opts.global_batch} packs per step; {'bf16' if gpu else 'fp32'}", flush=True)

    import transformers

    with tempfile.TemporaryDirectory(prefix="bench_gpu_train_") as root:
        config = transformers.Qwen2Config(**SHAPES[opts.shape], **QWEN)
        torch.manual_seed(0)
        with torch.device("cuda" if gpu else "cpu"):
            model = transformers.Qwen2ForCausalLM(config).to(dtype)
        model.save_pretrained(os.path.join(root, "hf"))
        del model
        num_packs = (opts.warmup + opts.steps + 3) * opts.global_batch
        packs = make_packs(opts.seq_length, num_packs, config.vocab_size)
        prefix = os.path.join(root, "data", "bench")
        os.makedirs(os.path.dirname(prefix))
        write_packs(prefix, *packs)
        lengths = [sample_lengths(row) for row in packs[2]]
        real = sum(int(x.sum()) for x in lengths)
        print(f"data: {num_packs} packs, {sum(len(x) for x in lengths) / num_packs:.1f} samples per pack, "
              f"padding {1 - real / packs[0].size:.3f}", flush=True)
        hf_dir = os.path.join(root, "hf")
        results, args = {}, None
        if opts.only != "transformers":
            results["ours"], args = run_ours(hf_dir, prefix, opts, ["--bf16"] if gpu else [])
        if opts.only != "ours":
            results["transformers"] = run_transformers(hf_dir, packs, opts, dtype)
    # model FLOPs of the real samples (the trainer's formula), per step of the average pack mix
    if args is None:
        from types import SimpleNamespace

        c = SHAPES[opts.shape]
        args = SimpleNamespace(hidden_size=c["hidden_size"], num_layers=c["num_hidden_layers"],
                               num_attention_heads=c["num_attention_heads"], num_query_groups=c["num_key_value_heads"],
                               ffn_hidden_size=c["intermediate_size"], padded_vocab_size=c["vocab_size"], swiglu=True)
    per_token = cost_model(args).flops(real, sum(int((x * x).sum()) for x in lengths)) / real
    print(f"\n{'side':<14}{'backend':<36}{'tokens/s':>10}{'MFU':>7}{'peak GiB':>10}{'launches':>10}"
          f"{'syncs':>7}{'GPU busy':>9}")
    for side, r in results.items():
        r["TFLOP/s"] = r["tokens/s"] * per_token / 1e12
        r["MFU"] = r["TFLOP/s"] / peak if peak else float("nan")
        print(f"{side:<14}{r['backend']:<36}{r['tokens/s']:>10.0f}{r['MFU']:>7.1%}{r['peak memory GiB']:>10.2f}"
              f"{r['launches/step']:>10}{r['syncs/step']:>7}{r['GPU busy']:>9.1%}")
    if len(results) == 2:
        ratio = results["ours"]["tokens/s"] / results["transformers"]["tokens/s"]
        print(f"\nours / transformers: {ratio:.2f}x real tokens/s (target >= 1.5x on a GPU; MFU target >= 35% at 1.5b)")
        results["ratio"] = ratio
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"device": device_name, "shape": opts.shape, **results}, f, indent=1, default=str)
    return results


if __name__ == "__main__":
    main()

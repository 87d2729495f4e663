"""Full fine-tuning vs LoRA (r=8 and r=64 on all linear layers): memory, trainable parameters, step time.

One run trains the same model (a random Qwen2-style model saved as a HF directory and loaded with
``--load``, as a user starts), on the same packed data and layout, once per configuration, each in a
fresh process so its peak memory is its own:

- peak memory: the process's peak RSS (``VmHWM``) on a CPU; ``torch.cuda.max_memory_allocated`` on a GPU;
- trainable parameters, and the bytes of gradient buffers, optimizer state (Adam's two moments, plus the
  fp32 master copy under ``--bf16``) and weights actually allocated;
- step time (median of the timed steps, after a warm-up step) and real tokens/s.

It prints the optimizer-state memory LoRA saves and its throughput relative to full fine-tuning.

    python bench/bench_lora.py                 # hidden 512, 8 layers, seq 512, GBS 4 (2 passes of 3 processes)
    python bench/bench_lora.py --quick         # hidden 256, 4 layers, 2 timed steps
    python bench/bench_lora.py --bf16          # the precision the examples train in
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

CONFIGS = (("full", []), ("lora r=8", ["--lora-r", "8", "--lora-alpha", "16"]),
           ("lora r=64", ["--lora-r", "64", "--lora-alpha", "128"]))


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _tensor_bytes(obj) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _leaf_optimizers(optimizer):
    return getattr(optimizer, "chained_optimizers", None) or [optimizer]


def child(config: dict) -> dict:
    """One configuration, in this process: setup, warm-up step, timed steps; the measurements."""
    import torch

    from mindspeed_pack.config.arguments import parse_args
    from mindspeed_pack.datasets.packed_dataset import PackedBatchSource
    from mindspeed_pack.training.stages.sft import SFTStage
    from mindspeed_pack.training.trainer import Trainer

    args = parse_args(config["argv"])
    trainer = Trainer(args, PackedBatchSource(), SFTStage(args))
    trainer.setup()
    module = trainer.model[0].module
    params = list(module.parameters())
    trained = [p for p in params if p.requires_grad]
    times, tokens = [], []
    for step in range(config["steps"] + 1):
        start = time.perf_counter()
        record = trainer.train_iteration()
        if step:  # the first step allocates the optimizer state
            times.append(time.perf_counter() - start)
            tokens.append(record["tokens"])
    optimizer_state = 0
    for opt in _leaf_optimizers(trainer.optimizer):
        optimizer_state += _tensor_bytes(list(opt.optimizer.state.values()))
        if getattr(opt, "fp32_from_float16_groups", None):  # the fp32 master copy under --bf16
            optimizer_state += _tensor_bytes(opt.fp32_from_float16_groups)
    out = {
        "params": sum(p.numel() for p in params),
        "trainable": sum(p.numel() for p in trained),
        "weight bytes": _tensor_bytes(params),
        "grad buffer bytes": sum(b.grad_data.numel() * b.grad_data.element_size() for b in trainer.model[0].buffers),
        "optimizer state bytes": optimizer_state,
        "step s": statistics.median(times),
        "tokens/s": sum(tokens) / sum(times),
        "peak rss bytes": _peak_rss_bytes(),
    }
    if torch.cuda.is_available():
        out["peak gpu bytes"] = torch.cuda.max_memory_allocated()
    trainer.cleanup()
    return out


def _build_inputs(root: str, hidden: int, layers: int, seq: int, vocab: int) -> tuple:
    import torch
    import transformers

    from tests.data_utils import write_packed_instruction_dataset

    config = transformers.Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                      num_key_value_heads=max(1, hidden // 256), tie_word_embeddings=False,
                                      max_position_embeddings=seq, rope_theta=1e6, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    hf = os.path.join(root, "base")
    transformers.Qwen2ForCausalLM(config).save_pretrained(hf)
    data = write_packed_instruction_dataset(os.path.join(root, "data", "pack"), num_packs=64, seq_length=seq,
                                            vocab=vocab - 1, meta=True)
    return hf, data


def _mb(n: float) -> str:
    return f"{n / 2**20:9.1f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--global-batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="timed steps (after one warm-up step)")
    p.add_argument("--repeats", type=int, default=2, help="passes over the configurations (the fastest counts)")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--quick", action="store_true", help="hidden 256, 4 layers, 2 timed steps")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print("BENCH_RESULT " + json.dumps(child(json.loads(a.child))), flush=True)
        return 0
    if a.quick:
        a.hidden, a.layers, a.steps = 256, 4, 2
    with tempfile.TemporaryDirectory(prefix="bench_lora_") as root:
        hf, data = _build_inputs(root, a.hidden, a.layers, a.seq_length, a.vocab)
        common = ["--load", hf, "--data-path", data, "--seq-length", str(a.seq_length), "--neat-pack",
                  "--micro-batch-size", "1", "--global-batch-size", str(a.global_batch_size),
                  "--train-iters", str(a.steps + 1), "--lr", "1e-4", "--log-interval", "1000", "--eval-iters", "0",
                  *(["--bf16"] if a.bf16 else [])]
        env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
        results = {}
        for _ in range(a.repeats):  # round robin: a busy machine slows every configuration alike
            for name, flags in CONFIGS:
                cfg = {"argv": [*common, *flags], "steps": a.steps}
                proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(cfg)],
                                      env=env, cwd=ROOT, capture_output=True, text=True)
                line = next((x for x in proc.stdout.splitlines() if x.startswith("BENCH_RESULT ")), None)
                if proc.returncode or line is None:
                    print(proc.stderr[-3000:], file=sys.stderr)
                    return 1
                r = json.loads(line[len("BENCH_RESULT "):])
                if name not in results or r["step s"] < results[name]["step s"]:  # the fastest pass
                    results[name] = r
    full = results["full"]
    gpu = "peak gpu bytes" in full
    print(f"model: Qwen2-style, hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}, {full['params'] / 1e6:.1f}M "
          f"parameters; packed seq {a.seq_length}, GBS {a.global_batch_size}, TP1, "
          f"{'bf16' if a.bf16 else 'fp32'}, {env['OMP_NUM_THREADS']} threads; step time: median of {a.steps} "
          f"steps, the fastest of {a.repeats} passes")
    print(f"{'config':10} {'trainable':>12} {'grads MiB':>9} {'optim MiB':>9} {'weights MiB':>10} "
          f"{'peak ' + ('GPU' if gpu else 'RSS') + ' MiB':>12} {'step s':>7} {'tokens/s':>9}")
    for name, r in results.items():
        peak = r["peak gpu bytes"] if gpu else r["peak rss bytes"]
        print(f"{name:10} {r['trainable']:>12,} {_mb(r['grad buffer bytes'])} {_mb(r['optimizer state bytes'])} "
              f"{_mb(r['weight bytes']):>10} {_mb(peak):>12} {r['step s']:7.3f} {r['tokens/s']:9.0f}")
    for name in ("lora r=8", "lora r=64"):
        r = results[name]
        peak_key = "peak gpu bytes" if gpu else "peak rss bytes"
        print(f"{name}: {100 * r['trainable'] / full['params']:.2f}% of the parameters train; optimizer state "
              f"{_mb(full['optimizer state bytes'] - r['optimizer state bytes']).strip()} MiB smaller "
              f"({full['optimizer state bytes'] / max(1, r['optimizer state bytes']):.0f}x), gradient buffers "
              f"{_mb(full['grad buffer bytes'] - r['grad buffer bytes']).strip()} MiB smaller; peak "
              f"{_mb(full[peak_key] - r[peak_key]).strip()} MiB lower; throughput "
              f"{r['tokens/s'] / full['tokens/s']:.2f}x full fine-tuning's")
    return 0


if __name__ == "__main__":
    sys.exit(main())

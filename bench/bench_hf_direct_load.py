"""Peak memory per rank of ``--load HF_DIR`` (direct loading) at TP2, against the full model's size.

Builds a random transformers Qwen2 (fp32, about 1.2 GB with the defaults; seeded, so the same
every run), saves it as safetensors, then runs two gloo ranks (TP2) that each build their
Megatron shard and load it the way ``posttrain.py --load HF_DIR`` does
(:func:`mindspeed_pack.checkpoint.hf_checkpoint.read_rank_units`). Each rank reports its resident
memory before the load, the peak during it (``VmHWM`` reset just before), and the bytes it read
from the weight files. The full state dict's size is the sum of the safetensors tensors.

    python bench/bench_hf_direct_load.py                 # ~1.2 GB model, about two minutes on 2 cores
    python bench/bench_hf_direct_load.py --layers 4      # quicker
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GiB = 1024**3


def _status(field: str) -> int:
    """A ``/proc/self/status`` memory field in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux)


def write_model(out_dir: str, a) -> int:
    """A random transformers Qwen2 saved with safetensors; returns the full state dict's bytes."""
    import torch
    import transformers
    from safetensors import safe_open

    config = transformers.Qwen2Config(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, tie_word_embeddings=False,
        max_position_embeddings=4096, dtype="float32")
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(out_dir)
    total = 0
    for name in os.listdir(out_dir):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(out_dir, name), framework="pt") as f:
                for key in f.keys():
                    s = f.get_slice(key)
                    n = 1
                    for d in s.get_shape():
                        n *= d
                    total += n * 4
    return total


def worker(hf_dir: str) -> None:
    """One TP rank: build the shard, load it from ``hf_dir`` unit by unit, report memory."""
    import torch
    import torch.distributed as dist

    from mindspeed_pack.checkpoint import hf_checkpoint
    from mindspeed_pack.convert import hf_io
    from mindspeed_pack.convert.model_specs import args_from_hf_config
    from mindspeed_pack.model.gpt import build_gpt_model
    from mindspeed_pack.runtime.process_groups import initialize_distributed

    initialize_distributed(2, 1)
    imports = _status("VmRSS")  # the process without a model: python, torch, megatron-core
    args = args_from_hf_config(hf_io.read_config(hf_dir), tp=2)
    args.load, args.attention_backend = hf_dir, "local"
    model = build_gpt_model(args)
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    counted = {"read": 0}
    get, get_range = hf_io.HFCheckpointReader.get, hf_io.HFCheckpointReader.get_range

    def counting(fn):
        def wrapped(self, *a):
            t = fn(self, *a)
            counted["read"] += t.numel() * t.element_size()
            return t
        return wrapped

    hf_io.HFCheckpointReader.get, hf_io.HFCheckpointReader.get_range = counting(get), counting(get_range)
    before = _status("VmRSS")
    _reset_peak()
    with torch.no_grad():
        for unit in hf_checkpoint.read_rank_units(args):
            model.load_state_dict(unit, strict=False)
    report = {"rank": dist.get_rank(), "shard": shard, "imports": imports, "before": before, "peak": _status("VmHWM"),
              "read": counted["read"], "after": _status("VmRSS")}
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:
        print("REPORT " + json.dumps(reports), flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a.worker)
    with tempfile.TemporaryDirectory(prefix="bench_hf_direct_") as d:
        full = write_model(d, a)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               os.path.abspath(__file__), "--worker", d]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("REPORT ")]
        if proc.returncode or not lines:
            sys.exit(f"workers failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        reports = json.loads(lines[-1][len("REPORT "):])
    print(f"full state dict (fp32 safetensors): {full / GiB:.2f} GiB; TP2, each rank loads its slice")
    print("imports = RSS of the process before the model is built; model = peak - imports")
    print(f"{'rank':>4} {'shard GiB':>9} {'read GiB':>8} {'imports GiB':>11} {'before load GiB':>15} {'peak RSS GiB':>12} "
          f"{'load extra GiB':>14} {'peak/full':>10} {'model/full':>11}")
    for r in reports:
        print(f"{r['rank']:>4} {r['shard'] / GiB:>9.2f} {r['read'] / GiB:>8.2f} {r['imports'] / GiB:>11.2f} "
              f"{r['before'] / GiB:>15.2f} {r['peak'] / GiB:>12.2f} {(r['peak'] - r['before']) / GiB:>14.2f} "
              f"{r['peak'] / full:>10.2f} {(r['peak'] - r['imports']) / full:>11.2f}")


if __name__ == "__main__":
    main()

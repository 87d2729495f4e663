"""Host time per transformer layer per pack, the flash path on a CPU: eager layers, layers compiled whole
(``--torch-compile-kernels layers``) and the transformers padding-free loop, on identical work (issue 42).

At Qwen2.5-0.5B's shape with one 4096-token pack per forward an H200 waits on the host for half of each step
(docs/gpu.md): what bounds that step is the Python and dispatch per layer, not the kernels. This stand-in makes
the kernels cost next to nothing: a model of many thin layers (hidden 64) on short packs, and attention kernels
that only return their outputs' shapes on both sides (torch's varlen op with a free CPU kernel for ours, a free
attention function registered with transformers for theirs). The step is then nearly all host work, measured
per layer and micro-batch: the same packs, the same layers, heads, vocabulary and optimizer (AdamW) per side::

    OMP_NUM_THREADS=1 python bench/bench_host_time.py            # 24 layers, 128-token packs, 4 per step
    OMP_NUM_THREADS=1 python bench/bench_host_time.py --layers 12 --steps 10
    OMP_NUM_THREADS=1 python bench/bench_host_time.py --no-accumulation-fusion
    OMP_NUM_THREADS=1 python bench/bench_host_time.py --packs-per-forward 2   # 2 packs per forward, both sides

Ours runs with the gradient-accumulation fusion installed, as a GPU builds it (weight gradients added into
``main_grad`` by the linear's backward, eagerly or inside the compiled layer; ``model/wgrad_fusion.py``), unless
``--no-accumulation-fusion`` (the DDP hook adds them, one more op per weight).

Until 2026-11-28 the CPU runtime redirected CUDA devices through a torch-function mode, a Python call on every
torch operation of both sides (the transformers loop ran in the same process): the eager figures here were about
1.5x a GPU host's share. It now wraps only torch's factories and ``Tensor.to`` (``runtime/platform.py``). Checked
against an H200 (docs/gpu.md): the eager/transformers ratio here, 0.64x, against 0.82x of the GPU's 0.5B step,
which is host-bound on both sides but not wholly. The GPU's own figure is
``bench_gpu_train.py --suite --parts shapes layers``.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.data_utils import write_packed_instruction_dataset  # noqa: E402
from tests.model_utils import TINY_FLAGS  # noqa: E402
from tests.varlen_cpu import use_cpu_flash  # noqa: E402

PACKS_PER_STEP = 4


def ours(data: str, layers: int, mode: str, warmup: int, steps: int, per_forward: int = 1) -> float:
    """Seconds per step of posttrain's trainer on the flash path, ``--torch-compile-kernels mode``,
    ``per_forward`` packs per forward (``--micro-batch-size``: flattened into one THD sequence)."""
    import posttrain
    from mindspeed_pack.config.arguments import parse_args
    from mindspeed_pack.training.stages import get_stage
    from mindspeed_pack.training.trainer import Trainer

    torch._dynamo.reset()
    flags = [*TINY_FLAGS, "--data-path", data, "--neat-pack", "--seq-length", "128",
             "--micro-batch-size", str(per_forward),
             "--global-batch-size", str(PACKS_PER_STEP), "--train-iters", str(warmup + steps), "--lr", "1e-5",
             "--num-layers", str(layers), "--attention-backend", "flash", "--torch-compile-kernels", mode,
             "--no-shuffle", "--eval-iters", "0", "--log-interval", "1000000"]
    args = parse_args(flags, extra_args_provider=posttrain.posttrain_args)
    stage = get_stage(args)
    trainer = Trainer(args, stage.batch_source(args), stage)
    trainer.setup()
    try:
        for _ in range(warmup):
            trainer.train_iteration()
        start = time.perf_counter()
        for _ in range(steps):
            trainer.train_iteration()
        return (time.perf_counter() - start) / steps
    finally:
        trainer.cleanup()
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()


def _free_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention interface: the output's shape ([b, s, h, d]) and nothing else."""
    return query.transpose(1, 2).clone(), None


def transformers_loop(data: str, layers: int, warmup: int, steps: int, per_forward: int = 1) -> float:
    """Seconds per step of a transformers padding-free loop on the same packs and the same model shape,
    ``per_forward`` packs concatenated into one row per forward (positions restart at every sample)."""
    from transformers import AttentionInterface, Qwen2Config, Qwen2ForCausalLM

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    AttentionInterface.register("free", _free_attention)
    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, attn_implementation="free")
    model = Qwen2ForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = IndexedDataset(data + "_packed_input_ids_document")
    masks = IndexedDataset(data + "_packed_attention_mask_document")
    labels = IndexedDataset(data + "_packed_labels_document")

    def batch(i):
        seg = torch.as_tensor(masks[i].astype("int64"))
        starts = torch.ones_like(seg, dtype=torch.bool)
        starts[1:] = seg[1:] != seg[:-1]
        index = torch.arange(len(seg))
        position = index - torch.cummax(torch.where(starts, index, 0), 0).values
        return (torch.as_tensor(ids[i].astype("int64"))[None], position[None],
                torch.as_tensor(labels[i].astype("int64"))[None])

    def step(k):
        for m in range(0, PACKS_PER_STEP, per_forward):
            rows = [batch((k * PACKS_PER_STEP + m + j) % len(ids)) for j in range(per_forward)]
            x, pos, y = (torch.cat(parts, dim=-1) for parts in zip(*rows))
            logits = model(input_ids=x, position_ids=pos).logits
            loss = torch.nn.functional.cross_entropy(logits[0, :-1], y[0, 1:], ignore_index=-100)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for k in range(warmup):
        step(k)
    start = time.perf_counter()
    for k in range(steps):
        step(warmup + k)
    return (time.perf_counter() - start) / steps


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--packs-per-forward", type=int, default=1, choices=(1, 2, 4),
                   help="packs per forward on both sides (ours: --micro-batch-size; theirs: one concatenated row)")
    p.add_argument("--no-accumulation-fusion", action="store_true",
                   help="ours without the gradient-accumulation fusion (installed by default, as on a GPU)")
    opts = p.parse_args(argv)
    torch.set_num_threads(1)
    if not opts.no_accumulation_fusion:
        from mindspeed_pack.model import wgrad_fusion

        wgrad_fusion.install(probe=False, device="cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    use_cpu_flash("free")
    per_layer = 1e6 / (PACKS_PER_STEP * opts.layers)
    k = opts.packs_per_forward
    with tempfile.TemporaryDirectory() as root:
        data = write_packed_instruction_dataset(os.path.join(root, "copy"), num_packs=64, meta=True)
        rows = {"ours, eager layers (default)": ours(data, opts.layers, "auto", opts.warmup, opts.steps, k),
                "ours, --torch-compile-kernels layers": ours(data, opts.layers, "layers", opts.warmup, opts.steps, k),
                "transformers padding-free loop": transformers_loop(data, opts.layers, opts.warmup, opts.steps, k)}
    base = rows["transformers padding-free loop"]
    print(f"{opts.layers} layers, hidden 64, 128-token packs, {PACKS_PER_STEP} per step, {k} per forward, "
          f"free attention kernels, "
          f"1 thread; {opts.steps} steps after {opts.warmup}; ours with"
          f"{'out' if opts.no_accumulation_fusion else ''} the gradient-accumulation fusion")
    for name, seconds in rows.items():
        print(f"{name:40s} {seconds * per_layer:8.0f} us per layer per pack   "
              f"{base / seconds:5.2f}x the transformers loop")
    return rows


if __name__ == "__main__":
    main()

"""Fixed vs dynamic context parallelism, trained for real on 2 CPU ranks: ``bench_cp_balance.py --real-cpu``.

One global batch of long-tail samples (the toy word tasks of ``mindspeed_pack.data.toy``, lengths drawn from a
long-tail mix: 90% lognormal, median N/8, up to N; 10% log-uniform in N+1..2N; the words per row chosen to hit the
drawn length, the toy tokenizer having one token per word), written ``--cpu-steps`` times over and preprocessed
once without ``--pack`` (``preprocess_data.py``, qwen template, one sample per document, ``--seq-length`` 2N so
nothing is cut), is trained by ``posttrain.py`` under ``torchrun --nproc-per-node 2`` (gloo) with

* fixed: ``--sequence-packing-scheduler dp_balanced --context-parallel-size 2``: every row of 2N tokens split
  over both ranks (zigzag, keys and values all-gathered in every layer of every micro-batch);
* dynamic: ``default_dynamic_cp --context-parallel-size 2``: samples <= N on one rank each, longer ones on two;

both with ``--max-seqlen-per-dp-cp-rank N``, ``--no-shuffle``, the quickstart's tiny Qwen2-style model
(configs/quickstart.yaml: 2 layers, hidden 128) and seed, in ``--cpu-rounds`` rounds of the two runs back to back
(the order alternating). Every step trains the same batch with the same plan, so a run's steps are repeated
measurements: tokens/s = the step's trained tokens / its time (the trainer's metrics JSONL, which also carries the
plan: samples at each CP size, padding ratio, tokens per rank max/mean), median and best over the steps after the
first (a warm-up) of every round. The runs must train the same tokens every step (checked).

CPU-bound: gloo over loopback is fast next to CPU matmuls, so this shows the work each plan gives the ranks
(micro-batches, padding, the CP attention's gather and index work, the balance), not the GPU communication the
simulation models; on a shared machine other processes slow random steps (hence the median and the best).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ("--num-layers 2 --hidden-size 128 --ffn-hidden-size 384 --num-attention-heads 4 --group-query-attention "
         "--num-query-groups 2 --add-qkv-bias --disable-bias-linear --swiglu --normalization RMSNorm "
         "--norm-epsilon 1e-6 --position-embedding-type rope --rotary-base 1000000 "
         "--untie-embeddings-and-output-weights --attention-dropout 0.0 --hidden-dropout 0.0").split()
SCHEDULERS = {"fixed": "dp_balanced", "dynamic": "default_dynamic_cp"}
TEMPLATE_TOKENS = 20  # qwen template + instruction, about (the lengths reported are the tokenized ones)


def target_lengths(n: int, per_rank: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    short = np.clip(np.rint(rng.lognormal(np.log(per_rank / 8), 0.9, n)), 24, per_rank)
    long = np.rint(np.exp(rng.uniform(np.log(per_rank + 1), np.log(2 * per_rank), n)))
    return np.where(rng.random(n) < 0.1, long, short).astype(np.int64)


def rows_of(lengths, seed: int) -> list:
    """Alpaca rows of the toy word tasks sized to ``lengths`` tokens (input and answer of about equal words)."""
    from mindspeed_pack.data.toy import WORDS

    rng = random.Random(seed)
    rows = []
    for length in lengths:
        words = [rng.choice(WORDS) for _ in range(max(1, (int(length) - TEMPLATE_TOKENS) // 2))]
        kind = rng.randrange(3)
        instruction, answer = (("Reverse the words.", list(reversed(words))), ("Sort the words alphabetically.",
                               sorted(words)), ("Write the words in upper case.", [w.upper() for w in words]))[kind]
        rows.append({"instruction": instruction, "input": " ".join(words), "output": " ".join(answer)})
    return rows


def _run(cmd, env=None) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")


def prepare(work: str, per_rank: int, samples: int, repeats: int, seed: int) -> tuple:
    """Toy tokenizer, ``samples`` long-tail rows written ``repeats`` times, preprocessed without --pack; returns
    (data prefix, tokenizer, the batch's tokenized lengths)."""
    from mindspeed_pack.data.toy import write_dataset

    # the toy CLI in its own process, as the quickstart runs it: training the tokenizer (Rust threads) in a
    # process that has imported torch can crash
    _run([sys.executable, "-m", "mindspeed_pack.data.toy", "--out", os.path.join(work, "toy"), "--samples", "1"])
    tokenizer = os.path.join(work, "toy", "tokenizer")
    batch = rows_of(target_lengths(samples, per_rank, seed), seed)
    rows = write_dataset(os.path.join(work, "long_tail.jsonl"), batch * repeats)
    prefix = os.path.join(work, "data", "long_tail")
    os.makedirs(os.path.dirname(prefix))
    _run([sys.executable, "preprocess_data.py", "--input", str(rows), "--tokenizer-type", "PretrainedFromHF",
          "--tokenizer-name-or-path", tokenizer, "--output-prefix", prefix, "--handler-name",
          "AlpacaStyleInstructionHandler", "--prompt-type", "qwen", "--seq-length", str(2 * per_rank),
          "--workers", "1"])
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = IndexedDataset(f"{prefix}_packed_input_ids_document")
    lengths = np.array(docs.sequence_lengths[:samples], np.int64)  # a copy: the index maps a file closed with docs
    return prefix, tokenizer, lengths


def train(work: str, name: str, prefix: str, tokenizer: str, per_rank: int, gbs: int, steps: int) -> list:
    metrics = os.path.join(work, f"{name}.{time.monotonic_ns()}.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "posttrain.py",
           *MODEL, "--data-path", prefix, "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", tokenizer,
           "--prompt-type", "qwen", "--seq-length", str(2 * per_rank), "--micro-batch-size", "1",
           "--global-batch-size", str(gbs), "--train-iters", str(steps), "--lr", "1e-3", "--min-lr", "1e-4",
           "--lr-warmup-iters", "1", "--lr-decay-style", "cosine", "--no-shuffle", "--split", "100,0,0",
           "--log-interval", "1", "--eval-iters", "0", "--seed", "1234", "--metrics-file", metrics,
           "--sequence-packing-scheduler", SCHEDULERS[name], "--context-parallel-size", "2",
           "--max-seqlen-per-dp-cp-rank", str(per_rank)]
    _run(cmd, env={"OMP_NUM_THREADS": "1"})
    with open(metrics) as f:
        return [r for r in (json.loads(line) for line in f if line.strip()) if r.get("split") == "train"]


def compare_real_cpu(a) -> None:
    per_rank, gbs, steps = a.cpu_per_rank, a.cpu_gbs, a.cpu_steps
    work = tempfile.mkdtemp(prefix="cp_dynamic_cpu_")
    try:
        prefix, tokenizer, lengths = prepare(work, per_rank, gbs, steps, a.seed)
        long = lengths > per_rank
        print(f"real CPU run: 2 gloo ranks, C 2, N {per_rank}; one batch of {gbs} samples preprocessed without --pack "
              f"(median {np.median(lengths):.0f}, max {lengths.max()} tokens; {long.mean():.0%} over N holding "
              f"{lengths[long].sum() / lengths.sum():.0%} of the tokens) trained {steps} times (the first a warm-up) "
              f"per run, {a.cpu_rounds} round(s) of fixed and dynamic back to back; tiny model (2 layers, hidden 128)")
        runs = {"fixed": [], "dynamic": []}
        for r in range(a.cpu_rounds):
            for name in (("fixed", "dynamic") if r % 2 == 0 else ("dynamic", "fixed")):
                runs[name].append(train(work, name, prefix, tokenizer, per_rank, gbs, steps))
        tokens = {x["tokens"] for rs in runs.values() for recs in rs for x in recs}
        if len(tokens) != 1:
            sys.exit(f"the runs trained different tokens per step: {sorted(tokens)}")
        tokens = tokens.pop()
        print(f"\n{'run':>8} {'tokens/s median':>15} {'best':>7} {'per round (median)':>24} {'padding':>8} "
              f"{'mb/rank':>7} {'tok/rank max/mean':>17} plan of a step")
        med, best = {}, {}
        for name, rs in runs.items():
            ms = np.array([[x["step time (ms)"] for x in recs[1:]] for recs in rs])
            med[name], best[name] = tokens / (np.median(ms) / 1e3), tokens / (ms.min() / 1e3)
            last = rs[0][-1]
            balance = f"{last['tokens per rank max/mean']:.3f}" if "tokens per rank max/mean" in last else "-"
            plan = ", ".join(f"{k[len('samples at '):]}: {v}" for k, v in last.items()
                             if k.startswith("samples at CP "))
            print(f"{name:>8} {med[name]:>15.0f} {best[name]:>7.0f} "
                  f"{' '.join(f'{tokens / (np.median(r) / 1e3):.0f}' for r in ms):>24} {last['padding ratio']:>8.3f} "
                  f"{tokens / (1 - last['padding ratio']) / (2 * per_rank):>7.1f} {balance:>17} "
                  f"{plan or 'every sample at CP 2'}")
        print(f"dynamic / fixed tokens/s: {med['dynamic'] / med['fixed']:.2f}x (medians), "
              f"{best['dynamic'] / best['fixed']:.2f}x (best steps); {tokens} tokens a step in every run")
    finally:
        shutil.rmtree(work, ignore_errors=True)

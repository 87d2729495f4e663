"""DPO on packed pairs vs padded pairs, on a heavy-tailed preference set, in one run.

- ``packed``: pairs placed by the preprocessing planner (``data/pairwise.pair_plan``: the
  pair is the unit of packing) into rows of ``seq_length``; chosen and rejected are segments
  of their pack (THD, segment-isolated attention).
- ``padded``: MindSpeed-LLM's layout: a micro-batch of pairs is ``2 x pairs`` rows (chosen,
  rejected), each padded to the micro-batch's longest sequence, one causal row each.

Both train the same pairs with the same model (forward + backward of the DPO loss + Adam)
in global batches of ``--global-pairs`` pairs; printed: padding ratio, rows per step, real
tokens/s and step time of each (best of ``--repeats`` alternating passes), and the speed-up.

Then the stages on the same packed pairs, each through its real ``loss_func`` (``posttrain.py
--stage``'s): ``dpo`` with its reference forward (a frozen copy of the policy, no gradient, before
each micro-batch, as the in-job reference runs), ``simpo`` and ``orpo`` with none; real tokens/s and
their ratio to DPO's. ``orm`` (the scalar score head in place of the output layer, Bradley-Terry on
the pairs) and ``sft`` (the language model's per-token loss on the same packed sequences, chosen and
rejected alike): real tokens/s and ORM's ratio to SFT's.

Last, the peak memory of training two steps of ``dpo`` with its reference model, ``dpo`` with
``--ref-logps`` (the reference log-probs precomputed: no reference model), ``simpo``, ``orm`` and
``sft``, each in a fresh process of its own (``--memory-of``): the process's peak resident set while
it builds the model and trains (Linux's ``VmHWM``, CPU tensors live in it; the high-water mark is
reset just before the model is built, ``/proc/self/clear_refs``, so the imports' transient peak is not
it; ``getrusage``'s ``ru_maxrss`` would not do: it keeps the peak of the parent this process was
forked from) and that peak less the resident set at that moment (imports, the process group and the
pairs already in): what the model, its reference, the optimizer state and the steps' activations and
gradients add at the high-water mark. Memory the allocator keeps after freeing still counts, as in a
device's peak reserved.

    python bench/bench_dpo_packing.py [--pairs 128] [--seq-length 1024] [--hidden-size 512]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.bench_train_throughput import packed_rows, padded_rows  # noqa: E402
from mindspeed_pack.data.pairwise import pair_plan  # noqa: E402
from mindspeed_pack.model.gpt import build_gpt_model  # noqa: E402
from mindspeed_pack.packing.segments import IGNORE_INDEX, build_packed_batch, sequence_sums  # noqa: E402
from mindspeed_pack.training.batches import packed_seq_params  # noqa: E402
from mindspeed_pack.training.stages import get_stage, stage_args  # noqa: E402
from mindspeed_pack.training.stages.dpo import preference_losses  # noqa: E402
from mindspeed_pack.training.stages.sequences import pair_segments  # noqa: E402
from mindspeed_pack.training.stages.sequences import sequence_logps  # noqa: E402
from tests.model_utils import init_single_process, tiny_args  # noqa: E402


def heavy_tailed_pairs(n, seq_length, vocab, seed=0):
    """[(chosen ids, chosen labels, rejected ids, rejected labels)]: lognormal prompt and answer lengths."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        p, c, r = (int(x) for x in np.clip(rng.lognormal(np.log(seq_length / 16), 0.9, 3), 4, seq_length))
        if 2 * p + c + r > seq_length:
            continue  # preprocessing drops such a pair (never one-side truncated)
        prompt = rng.integers(3, vocab, p)
        pair = []
        for n_answer in (c, r):
            ids = np.concatenate([prompt, rng.integers(3, vocab, n_answer)])
            labels = ids.copy()
            labels[:p] = IGNORE_INDEX
            pair += [torch.from_numpy(ids), torch.from_numpy(labels)]
        out.append(tuple(pair))
    return out


def packed_step_rows(pairs, seq_length, packs_per_micro_batch=1):
    """Micro-batches of the pairs' packs (segments 2k-1 chosen, 2k rejected), as preprocessing plans them."""
    sequences = [x for pair in pairs for x in (pair[0:2], pair[2:4])]
    plan = pair_plan(np.array([len(i) for i, _ in sequences]), seq_length)
    rows = packed_rows(sequences, seq_length, plan=plan)
    return [tuple(torch.cat(x) for x in zip(*rows[i:i + packs_per_micro_batch]))
            for i in range(0, len(rows), packs_per_micro_batch)]


def padded_micro_batches(pairs, pairs_per_micro_batch):
    """[2b, longest] micro-batches: chosen and rejected rows padded to the batch's longest."""
    return padded_rows([x for pair in pairs for x in (pair[0:2], pair[2:4])], 2 * pairs_per_micro_batch)


def dpo_loss(model, rows, packed: bool):
    ids, labels, seg = rows
    batch = build_packed_batch(ids, labels, seg)
    out = model(batch.tokens, batch.position_ids, None, labels=batch.target, packed_seq_params=packed_seq_params(batch))
    logps = sequence_sums(-out.float().reshape(batch.loss_mask.shape) * batch.loss_mask, batch)
    if packed:
        chosen, rejected = pair_segments(batch)
    else:  # one row per sequence: chosen, rejected, chosen, ...
        chosen, rejected = torch.arange(0, len(logps), 2), torch.arange(1, len(logps), 2)
    pc, pr = logps[chosen], logps[rejected]
    losses = preference_losses(pc, pr, pc.detach() - 1, pr.detach() + 1, 0.1, "sigmoid")
    return losses.sum(), int(batch.loss_mask.numel())


def run(model, optimizer, steps, packed: bool):
    """steps: list of lists of micro-batch rows; returns (seconds, total tokens run)."""
    tokens = 0
    start = time.perf_counter()
    for step in steps:
        for rows in step:
            loss, n = dpo_loss(model, rows, packed)
            loss.backward()
            tokens += n
        optimizer.step()
        optimizer.zero_grad()
    return time.perf_counter() - start, tokens


def _forward(model, batch):
    return model(batch.tokens, batch.position_ids, None, labels=batch.target, packed_seq_params=packed_seq_params(batch))


def stage_step(model, stage, step_rows, reference=None):
    """One optimizer step's forward + backward of ``stage``'s loss over packed micro-batches, divided by the step's
    total count as the trainer divides it; DPO's reference log-probs from ``reference`` (forward only; a DPO stage
    without one: zeros, as a precomputed ``--ref-logps`` table hands them over), the others' step inputs from
    ``stage.prepare``."""
    batches = [build_packed_batch(*rows) for rows in step_rows]
    if stage.name == "dpo":
        with torch.no_grad():
            for batch in batches:
                chosen, rejected = pair_segments(batch)
                if reference is None:
                    batch.ref_logps = torch.zeros(len(chosen), 2)
                    continue
                seq = sequence_logps(batch, _forward(reference, batch))[0]
                batch.ref_logps = torch.stack([seq[chosen], seq[rejected]], dim=1)
    else:
        stage.prepare(None, batches, [{"input_ids": rows[0], "segment_ids": rows[2]} for rows in step_rows], "train",
                      batches[0].num_tokens)
    total = sum(int(stage.count(b)) for b in batches)
    for batch in batches:
        loss, _, _ = stage.loss_func(batch, _forward(model, batch))
        (loss / total).backward()


STAGES = ("dpo", "simpo", "orpo", "orm", "sft")
MEMORY = ("dpo", "dpo --ref-logps", "simpo", "orm", "sft")  # --memory-of configurations


def build_stage(config: str, model_args):
    """(model, optimizer, stage, reference model or None) of a configuration: a stage name, ``dpo`` with a frozen
    copy of the starting policy as its reference (as --stage dpo builds it), ``dpo --ref-logps`` without one."""
    p = stage_args(argparse.ArgumentParser())
    p.add_argument("--stage")
    args = p.parse_args(["--stage", config.split()[0]])
    args.per_sample_loss, args.reward_pad_token_id = False, None  # sft's token mean; orm: each sample's last token
    torch.manual_seed(0)
    orm = args.stage == "orm"
    if orm:  # the scalar score head in place of the output layer
        model_args = argparse.Namespace(**{**vars(model_args), "reward_head": True})
    model = build_gpt_model(model_args)
    reference = None
    if config == "dpo":
        reference = build_gpt_model(model_args)
        reference.load_state_dict(model.state_dict())
        reference.eval().requires_grad_(False)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5), get_stage(args), reference


def compare_stages(model_args, steps, real, repeats):
    """Real tokens/s of each stage on the same packed steps: the stages take turns step by step (a shared
    machine's load hits them alike), each step's best of ``repeats`` timed passes kept."""
    runs = {name: build_stage(name, model_args) for name in STAGES}
    best = {name: [float("inf")] * len(steps) for name in runs}
    for i in range(repeats + 1):  # the first pass warms up
        for k, step in enumerate(steps):
            for name, (model, optimizer, stage, reference) in runs.items():
                start = time.perf_counter()
                stage_step(model, stage, step, reference)
                optimizer.step()
                optimizer.zero_grad()
                if i:
                    best[name][k] = min(best[name][k], time.perf_counter() - start)
    total = {name: sum(times) for name, times in best.items()}
    print(f"{'stage':8s} {'reference':>9s} {'step (s)':>9s} {'tokens/s':>10s} {'ratio':>13s}")
    for name in runs:
        against = "sft" if name == "orm" else "dpo"
        ratio = f"{total[against] / total[name]:6.2f}x {against}" if name not in ("dpo", "sft") else ""
        print(f"{name:8s} {'forward' if name == 'dpo' else 'none':>9s} {total[name] / len(steps):9.3f} "
              f"{real / total[name]:10.1f} {ratio:>13s}")


def _status_mib(field: str) -> float:
    """A memory field of /proc/self/status (``VmRSS``: resident now, ``VmHWM``: its high-water mark), in MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def measure_memory(config: str, model_args, steps) -> None:
    """This process (a fresh one): two steps of ``config``; prints its resident set before the model is built and
    its peak from then on (the high-water mark reset first)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux: reset the peak resident set (VmHWM) to the current one
    before = _status_mib("VmRSS")
    model, optimizer, stage, reference = build_stage(config, model_args)
    for step in steps[:2]:
        stage_step(model, stage, step, reference)
        optimizer.step()
        optimizer.zero_grad()
    print(f"MEMORY {before:.1f} {_status_mib('VmHWM'):.1f}")


def compare_memory(argv) -> None:
    """Each :data:`MEMORY` configuration in a fresh process (this script with ``--memory-of``): peak RSS."""
    print(f"{'config':16s} {'reference':>9s} {'peak RSS (MiB)':>15s} {'over start (MiB)':>17s}")
    for config in MEMORY:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--memory-of", config],
                             capture_output=True, text=True, check=True).stdout
        line = next(line for line in out.splitlines() if line.startswith("MEMORY"))
        before, peak = (float(x) for x in line.split()[1:])
        print(f"{config:16s} {'model' if config == 'dpo' else 'none':>9s} {peak:15.1f} {peak - before:17.1f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=128)
    p.add_argument("--global-pairs", type=int, default=32, help="pairs per optimizer step")
    p.add_argument("--pairs-per-micro-batch", type=int, default=4, help="padded layout: pairs per micro-batch")
    p.add_argument("--packs-per-micro-batch", type=int, default=2, help="packed layout: packs per micro-batch")
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=1024, help="the model's (padded) vocabulary")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per layout and per stage (best kept)")
    p.add_argument("--memory-of", choices=MEMORY, default=None,
                   help="(internal) measure this configuration's peak memory in this process, print it, stop")
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    init_single_process()
    model_args = tiny_args(seq_length=args.seq_length, hidden_size=args.hidden_size, ffn_hidden_size=4 * args.hidden_size,
                           num_layers=args.num_layers, padded_vocab_size=args.vocab_size)
    pairs = heavy_tailed_pairs(args.pairs, args.seq_length, min(1000, args.vocab_size - 24))
    real = sum(len(x[0]) + len(x[2]) for x in pairs)
    steps = range(0, len(pairs), args.global_pairs)
    packed = [packed_step_rows(pairs[s:s + args.global_pairs], args.seq_length, args.packs_per_micro_batch)
              for s in steps]  # one pack per micro-batch, each step's packs planned from its own pairs
    if args.memory_of:
        measure_memory(args.memory_of, model_args, packed)
        return
    layouts = {"packed": packed, "padded": [padded_micro_batches(pairs[s:s + args.global_pairs],
                                                                 args.pairs_per_micro_batch) for s in steps]}
    print(f"{len(pairs)} pairs (heavy-tailed, real tokens {real}), {len(steps)} steps of "
          f"{args.global_pairs} pairs, seq_length {args.seq_length}, hidden {args.hidden_size}")
    print(f"{'layout':8s} {'rows/step':>9s} {'padding':>8s} {'step (s)':>9s} {'tokens/s':>10s}")
    models = {}
    for name in layouts:
        torch.manual_seed(0)
        model = build_gpt_model(model_args)
        models[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-5))
        run(*models[name], layouts[name][:1], name == "packed")  # warm-up
    # layouts alternate, best of --repeats: a shared machine's noise hits both alike
    best = {name: float("inf") for name in layouts}
    for _ in range(args.repeats):
        for name, layout in layouts.items():
            seconds, total = run(*models[name], layout, name == "packed")
            best[name] = min(best[name], seconds)
    results = {}
    for name, layout in layouts.items():
        total = sum(sum(r[0].numel() for r in step) for step in layout)
        rows = sum(sum(r[0].shape[0] for r in step) for step in layout) / len(layout)
        results[name] = real / best[name]
        print(f"{name:8s} {rows:9.1f} {(total - real) / total:8.3f} {best[name] / len(layout):9.3f} {results[name]:10.1f}")
    print(f"packed / padded tokens/s: {results['packed'] / results['padded']:.2f}x")
    print()
    compare_stages(model_args, layouts["packed"], real, args.repeats)
    print()
    compare_memory(argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    main()

"""Replay rollout files round after round in one job: score, step, save, export (the trainer stays up).

Each ``--rollout-rounds`` file (``.jsonl``/``.parquet``, the format of ``--stage grpo``; see docs/rl.md)
is one round of a generation engine's output. For each, in order:

1. ``old_logprobs``: kept if every row has them and ``--rescore`` is not given, else scored
   under the current weights (``session.score``: exact, the step's first ratio is 1);
2. ``session.step``: ``--steps-per-round`` GRPO optimizer steps (default ceil(rollouts / GBS): each rollout
   once, the first ones twice where GBS does not divide them, which is logged);
3. ``session.save()`` (``--save``, a Megatron checkpoint) and ``session.export_hf(OUT/hf/iter_N)``
   (``--rl-output-dir``): the weights the engine reloads for the next round.

    torchrun --nproc-per-node N examples/rl/replay_rollouts.py POSTTRAIN FLAGS (no --rollout-path) \\
        --rollout-rounds r0.jsonl r1.jsonl ... --rl-output-dir OUT [--rescore] [--steps-per-round K]
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch.distributed as dist  # noqa: E402

from mindspeed_pack.data.errors import PreprocessError  # noqa: E402
from mindspeed_pack.data.readers import chunk_rows, iter_chunks, resolve_input_files  # noqa: E402
from mindspeed_pack.datasets.packed_dataset import DataError  # noqa: E402
from mindspeed_pack.training.cli import run_cli, setup_logging  # noqa: E402
from mindspeed_pack.training.rl_session import RLSession  # noqa: E402

LOGGED = ("lm loss", "grad norm", "clip fraction", "approx kl", "ratio mean", "ratio max", "response length",
          "padding ratio")


def script_args(p):
    g = p.add_argument_group("rollout replay (examples/rl/replay_rollouts.py)")
    g.add_argument("--rollout-rounds", nargs="+", required=True, help="one rollout file per round, in order")
    g.add_argument("--rl-output-dir", required=True, help="HF exports of each round (hf/iter_N) go here")
    g.add_argument("--rescore", action="store_true", help="score old_logprobs even where the files have them")
    g.add_argument("--steps-per-round", type=int, default=None,
                   help="optimizer steps per round (default: ceil(rollouts / GBS), each rollout once; the last step "
                        "fills up with the first rollouts again where GBS does not divide them)")
    g.add_argument("--no-export-hf", action="store_true", help="skip the per-round HF export")
    return p


def read_round(path: str) -> tuple[list, list]:
    """(rows, where) of one rollout file: where = "FILE: line N" for the session's error messages."""
    rows, where = [], []
    try:
        for chunk in iter_chunks(resolve_input_files(path), 4096):
            for w, row in chunk_rows(chunk):
                if isinstance(row, Exception):
                    raise DataError(str(row))
                rows.append(row)
                where.append(w)
    except PreprocessError as exc:
        raise DataError(str(exc)) from None
    return rows, where


def main(argv=None):
    setup_logging()
    session = RLSession.from_argv(argv, extra_args_provider=script_args)
    args = session.args
    with session:
        for k, path in enumerate(args.rollout_rounds):
            rows, where = read_round(path)
            scored = args.rescore or any(row.get("old_logprobs") is None for row in rows)
            if scored:
                for row, logps in zip(rows, session.score(rows, where=where)):
                    if logps is not None:  # None: over-long, dropped (--rollout-overlong drop), as the step drops it
                        row["old_logprobs"] = logps.tolist()
            records = session.step(rows, steps=args.steps_per_round, where=where)
            if args.save:
                session.save()
            hf_dir = None
            if not args.no_export_hf:
                hf_dir = os.path.join(os.path.abspath(args.rl_output_dir), "hf", f"iter_{session.iteration:07d}")
                session.export_hf(hf_dir)
            if dist.get_rank() == 0:
                last = records[-1]
                print(json.dumps({"round": k, "file": path, "rollouts": len(rows), "old_logprobs scored": scored,
                                  "iteration": session.iteration, **{m: last[m] for m in LOGGED if m in last},
                                  "hf export": hf_dir}), flush=True)


if __name__ == "__main__":
    run_cli("replay_rollouts.py", main, own_process=True)

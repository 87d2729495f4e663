"""Summarise a packed training run: pack fill, padding saved, loss start to end, tokens/s.

    python -m mindspeed_pack.tools.run_summary METRICS.jsonl [--data-prefix P] [--plot loss.png]

Reads the trainer's ``--metrics-file`` and, with ``--data-prefix``, the preprocessing
sidecar (``P_packed_meta.json``) for the packing statistics. The PNG shows the training
loss (and validation loss, if any) per iteration.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Optional

from mindspeed_pack.tools.run_metrics import RunMetricsError, load_all_splits


def _mean(values):
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else float("nan")


def _rate(train: dict, steps) -> float:
    """Tokens per second over ``steps`` (the first left out: compilation and warm-up): their tokens over their
    time, not the mean of per-step rates (a slow step weighs as much as its time); the logged rates' mean where
    a console log gives no token counts."""
    tokens, ms = train.get("tokens") or {}, train.get("step time (ms)") or {}
    if all(i in tokens and i in ms for i in steps) and sum(ms[i] for i in steps) > 0:
        return sum(tokens[i] for i in steps) / (sum(ms[i] for i in steps) / 1000.0)
    return _mean((train.get("tokens/s") or {}).get(i) for i in steps)


def _step_weighted(train: dict, key: str) -> float:
    """The run's ``key`` (padding ratio, samples per pack) over all its steps: each step weighted by the tokens it
    ran, real and padding (``tokens`` / (1 - padding ratio)), as the console's interval lines weigh them. The plain
    mean of the steps' values was off where steps run different numbers of rows (online packing): 0.198 for a run
    that padded 27% of its tokens. A console log gives no token counts: the mean of its lines."""
    values, tokens, padding = (train.get(k) or {} for k in (key, "tokens", "padding ratio"))
    steps = [i for i in values if i in tokens and i in padding and padding[i] < 1.0]
    if not steps or len(steps) < len(values):
        return _mean(values.values())
    ran = {i: tokens[i] / (1.0 - padding[i]) for i in steps}
    total = sum(ran.values())
    return sum(values[i] * ran[i] for i in steps) / total if total > 0 else _mean(values.values())


def summarise(metrics_path: str, data_prefix: Optional[str] = None) -> dict:
    splits = load_all_splits(metrics_path)
    train = splits.get("train") or {}
    loss = train.get("lm loss") or {}
    if not loss:
        raise RunMetricsError(f"{metrics_path}: no training 'lm loss' records")
    steps = sorted(loss)
    window = max(1, min(10, len(steps) // 10))
    summary = {
        "iterations": steps[-1],
        "loss start": _mean(loss[i] for i in steps[:window]),
        "loss end": _mean(loss[i] for i in steps[-window:]),
        "tokens/s": _rate(train, steps[1:] or steps),
        "padding ratio": _step_weighted(train, "padding ratio"),
        "samples per pack": _step_weighted(train, "samples per pack"),
    }
    tokens = train.get("tokens") or {}
    if tokens:  # the metrics file's (a console log has none): prompts included, padding not
        summary["tokens (not padding)"] = int(sum(tokens.values()))
    valid = (splits.get("valid") or {}).get("lm loss") or {}
    if valid:
        summary["valid loss"] = valid[max(valid)]
    if data_prefix:
        meta_path = f"{data_prefix}_packed_meta.json"
        with open(meta_path) as f:
            stats = json.load(f).get("statistics", {})
        summary.update({
            "samples": stats.get("samples_written"),
            "packs": stats.get("packs"),
            "packs lower bound": stats.get("lower_bound"),
            "pack fill rate": stats.get("fill_rate"),
        })
        mean_len = stats.get("mean_sample_length")
        seq = json.load(open(meta_path)).get("layout", {}).get("seq_length")
        if stats.get("fill_rate") is not None:
            summary["padding, packed"] = 1.0 - stats["fill_rate"]
        if mean_len and seq:
            # what one-sample-per-row training at the same --seq-length would pad
            summary["padding, one sample per row"] = 1.0 - mean_len / seq
    return summary


def plot(metrics_path: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = load_all_splits(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4))
    for split, style in (("train", "-"), ("valid", "o--")):
        loss = (splits.get(split) or {}).get("lm loss") or {}
        if loss:
            xs = sorted(loss)
            ax.plot(xs, [loss[x] for x in xs], style, label=f"{split} lm loss")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (per-token mean)")
    ax.set_title("mindspeed-pack: packed fine-tuning")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = out + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("metrics", help="the run's --metrics-file (JSON lines) or log")
    p.add_argument("--data-prefix", default=None, help="preprocessing --output-prefix, for packing statistics")
    p.add_argument("--plot", default=None, help="write the loss curve to this PNG")
    p.add_argument("--json", default=None, help="also write the summary as JSON")
    args = p.parse_args(argv)
    try:
        summary = summarise(args.metrics, args.data_prefix)
    except (RunMetricsError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    width = max(len(k) for k in summary)
    print("== run summary")
    for k, v in summary.items():
        print(f"  {k:<{width}}  {v:.4f}" if isinstance(v, float) else f"  {k:<{width}}  {v}")
    if args.plot:
        plot(args.metrics, args.plot)
        print(f"  loss curve: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Training metrics to the console (Megatron-LM format), TensorBoard and a JSON-lines file.

Console lines keep Megatron-LM's ``key: value |`` layout so existing log parsers (and
``mindspeed_pack.tools.compare_runs``) read them. Only the last pipeline stage's first
tensor/data-parallel rank writes.
"""
from __future__ import annotations

import json
import math
import os
import time


class MetricsLogger:
    def __init__(self, args, enabled: bool):
        self.enabled = enabled
        self.train_iters = args.train_iters or 0
        self.log_interval = max(1, args.log_interval)
        self.jsonl = None
        self.tb = None
        if not enabled:
            return
        if args.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(args.metrics_file)), exist_ok=True)
            self.jsonl = open(args.metrics_file, "a", buffering=1)
        if args.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=args.tensorboard_dir)

    def precision(self, iteration: int, record: dict) -> None:
        """The run's numerics, once at start: printed, and the metrics file's first line of this run."""
        if not self.enabled:
            return
        print(" precision: " + json.dumps(record), flush=True)
        if self.jsonl:
            self.jsonl.write(json.dumps({"iteration": iteration, "split": "setup", "precision": record}) + "\n")

    def step(self, record: dict) -> None:
        """Record one training step; print it every ``--log-interval`` iterations."""
        if not self.enabled:
            return
        if self.jsonl:
            self.jsonl.write(json.dumps(record) + "\n")
        it = record["iteration"]
        if self.tb:
            for k, v in record.items():
                if k not in ("iteration", "split") and isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(f"train/{k}", v, it)
        if it % self.log_interval == 0 or it == self.train_iters:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            print(
                f" [{stamp}] iteration {it:8d}/{self.train_iters:8d} |"
                f" consumed samples: {record['consumed samples']:12d} |"
                f" elapsed time per iteration (ms): {record['step time (ms)']:.1f} |"
                f" learning rate: {record['lr']:.6E} |"
                f" global batch size: {record['global batch size']:5d} |"
                f" lm loss: {record['lm loss']:.6E} |"
                f" grad norm: {record['grad norm']:.4f} |"
                f" tokens/s: {record['tokens/s']:.1f} |"
                f" samples per pack: {record['samples per pack']:.2f} |"
                f" padding ratio: {record['padding ratio']:.4f} |"
                f" number of skipped iterations: {record['skipped']:3d} |",
                flush=True,
            )

    def validation(self, iteration: int, loss: float, tokens: int) -> None:
        if not self.enabled:
            return
        ppl = math.exp(min(20.0, loss)) if math.isfinite(loss) else float("nan")
        print(f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |",
              flush=True)
        if self.jsonl:
            self.jsonl.write(json.dumps({"iteration": iteration, "split": "valid", "lm loss": loss,
                                         "tokens": tokens}) + "\n")
        if self.tb:
            self.tb.add_scalar("valid/lm loss", loss, iteration)

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()


"""Training metrics to the console (Megatron-LM format), TensorBoard and a JSON-lines file.

Console lines keep Megatron-LM's ``key: value |`` layout so existing log parsers (and
``mindspeed_pack.tools.compare_runs``) read them, and its ``--log-interval`` meaning: a line
every N iterations with the interval's means (loss over the iterations not skipped, time
per iteration, tokens/s, padding ratio, samples per pack, and for MoE models the auxiliary
loss and expert load max/mean) and its skipped count; learning
rate, loss scale and grad norm are the last iteration's. The JSON-lines file keeps every
step. Counts are the whole job's (summed over data-parallel ranks by the trainer). Only the last
pipeline stage's first tensor/data-parallel rank writes.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time

from mindspeed_pack.config.errors import ArgumentError
from mindspeed_pack.runtime import faults
from mindspeed_pack.runtime.disk import DiskFullError, disk_full_message, is_disk_full
from mindspeed_pack.training import metrics_history

log = logging.getLogger(__name__)


def _finite_mean(values) -> float:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else float("nan")


class MetricsLogger:
    def __init__(self, args, enabled: bool, start_iteration: int = 0, extra_metrics: tuple = ()):
        """``start_iteration``: where training starts; the records after it are
        replaced (:mod:`mindspeed_pack.training.metrics_history`); ``replaced`` lists them.
        ``extra_metrics``: a stage's own metrics, printed as interval means."""
        self.args = args
        self.extra_metrics = tuple(extra_metrics)  # a stage's own metrics: interval means on the console
        self.enabled = enabled
        self.log_throughput = bool(getattr(args, "log_throughput", False))  # tools log with bare namespaces
        self.world_size = max(1, int(os.environ.get("WORLD_SIZE", "1")))
        self._interval = []
        self._skipped_printed = 0
        self._skipped_seen = 0
        self.train_iters = args.train_iters or 0
        self.log_interval = max(1, args.log_interval)
        self.jsonl = None
        self._full = False  # the metrics file hit a full disk (reported once)
        self.tb = None
        self.replaced = []
        if not enabled:
            return
        replace = metrics_history.replaces_records(start_iteration, trains=not getattr(args, "skip_train", False))
        if args.metrics_file:
            self.jsonl = self._open_metrics_file(args.metrics_file, replace, start_iteration)
        if args.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=args.tensorboard_dir, purge_step=start_iteration + 1 if replace else None,
                                    max_queue=max(1, getattr(args, "tensorboard_queue_size", 1000)))

    def _open_metrics_file(self, path: str, replace: bool, start_iteration: int):
        """The metrics file, for appending (a resume's re-run steps taken out first); a directory that cannot be
        written is one error line, not a traceback after the model was loaded."""
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            if replace:
                self.replaced = metrics_history.drop_records_after(path, start_iteration)
            return open(path, "a", buffering=1)
        except OSError as e:
            if is_disk_full(e):
                raise DiskFullError(disk_full_message("--metrics-file", path, None)) from None
            raise ArgumentError(f"--metrics-file {path} cannot be written ({e.strerror or e}"
                                f"{f': {e.filename}' if e.filename else ''}): pass a --metrics-file in a directory "
                                "this job can write") from None

    def resumed(self, iteration: int, loaded_from: str) -> None:
        """Once per job start: where training resumes (``loaded_from`` at ``iteration``) and which logged
        steps it runs again."""
        attempt = faults.restart_attempt()
        if not self.enabled or not (iteration or self.replaced or attempt):
            return
        if self.replaced:
            first, last, n = min(self.replaced), max(self.replaced), len(self.replaced)
            steps = f"iteration {first} (1 step), logged before, is" if n == 1 else \
                f"iterations {first}-{last} ({n} steps), logged before, are"
            rerun = f"; {steps} run again and replaced in {self.args.metrics_file}"
        else:
            rerun = "; no logged step is re-run" if self.args.metrics_file else ""
        where = f"{loaded_from} at iteration {iteration}" if iteration else "scratch (no checkpoint yet)"
        log.info("resumed from %s%s%s", where, f" (torchrun restart {attempt})" if attempt else "", rerun)

    def precision(self, iteration: int, record: dict) -> None:
        """The run's numerics, once at start: printed, and the metrics file's first line of this run."""
        if not self.enabled:
            return
        print(" precision: " + json.dumps(record), flush=True)
        if self.jsonl:
            self._write({"iteration": iteration, "split": "setup", "precision": record})

    def step(self, record: dict, total_tokens: float = 0.0, samples: float = 0.0, rows: float = 0.0) -> None:
        """Record one training step; print the interval's means every ``--log-interval`` iterations.

        Model FLOPs come from the record (``mindspeed_pack.training.throughput``: attention
        counted by real sample lengths); ``--log-throughput`` adds Megatron-LM's TFLOP/s/GPU."""
        if not self.enabled:
            return
        flops = record.get("model TFLOPs", 0.0) * 1e12
        if self.log_throughput:
            record["TFLOP/s/GPU"] = record.get("model TFLOP/s per device", 0.0)
        # skipped iterations (overflow, --nan-policy skip) stay out of the interval's mean loss
        skipped_now = record.get("skipped", 0) > self._skipped_seen
        self._skipped_seen = record.get("skipped", 0)
        self._interval.append((record, total_tokens, samples, rows, flops, skipped_now))
        self._write(record)
        it = record["iteration"]
        if self.tb and it % max(1, getattr(self.args, "tensorboard_log_interval", 1)) == 0:
            for k, v in record.items():
                if k not in ("iteration", "split") and isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(f"train/{k}", v, it)
        if it % self.log_interval == 0 or it == self.train_iters:
            self._print_interval(record)

    def _print_interval(self, last: dict) -> None:
        steps, self._interval = self._interval, []
        seconds = sum(r["step time (ms)"] for r, *_ in steps) / 1000.0
        real = sum(r["tokens"] for r, *_ in steps)
        total = sum(t for _, t, *_ in steps)
        losses = [r["lm loss"] for r, *_, skipped_now in steps if not skipped_now and math.isfinite(r["lm loss"])]
        skipped, self._skipped_printed = last["skipped"] - self._skipped_printed, last["skipped"]
        loss = sum(losses) / len(losses) if losses else float("nan")
        throughput = ""
        moe = "".join(f" {key}: {sum(r[key] for r, *_ in steps) / len(steps):.6E} |"
                      for key in ("moe aux loss", "expert load max/mean") if key in last)
        if self.log_throughput:
            tflops = sum(f for *_, f, _ in steps) / max(seconds, 1e-12) / self.world_size / 1e12
            throughput = f" throughput per GPU (TFLOP/s/GPU): {tflops:.4f} |"
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        print(
            f" [{stamp}] iteration {last['iteration']:8d}/{self.train_iters:8d} |"
            f" consumed samples: {last['consumed samples']:12d} |"
            f" elapsed time per iteration (ms): {seconds * 1000.0 / len(steps):.1f} |"
            f"{throughput}"
            f" learning rate: {last['lr']:.6E} |"
            f" global batch size: {last['global batch size']:5d} |"
            f" lm loss: {loss:.6E} |"
            f"{moe}"
            f" loss scale: {last.get('loss scale', 1.0):.1f} |"
            f" grad norm: {last['grad norm']:.6E} |"
            f" tokens/s: {real / seconds if seconds > 0 else 0.0:.1f} |"
            f" samples per pack: {sum(s for _, _, s, *_ in steps) / max(1.0, sum(r for *_, r, _, _ in steps)):.2f} |"
            f" padding ratio: {(total - real) / total if total else 0.0:.4f} |"
            f" number of skipped iterations: {skipped:3d} |"
            # a window cut short (a resume off a --log-interval boundary, the last one): its means are of fewer steps
            + (f" iterations in mean: {len(steps)} |" if len(steps) != self.log_interval else "")
            + "".join(f" {k}: {_finite_mean([r.get(k) for r, *_ in steps]):.6E} |" for k in self.extra_metrics),
            flush=True,
        )

    def validation(self, iteration: int, loss: float, tokens: int, split: str = "valid",
                   label: str | None = None, extra: dict | None = None) -> None:
        """One evaluation (``split`` valid or test); ``label`` as Megatron-LM prints it, e.g.
        "the end of training for test data" (default "iteration N"); ``extra``: the stage's other metrics
        (a preference stage's rewards and accuracies), as in its training lines."""
        if not self.enabled:
            return
        # a perplexity is the exp of a language model's per-token NLL: of SFT's and pretraining's loss, not of a
        # preference or reward loss (exp of a DPO loss means nothing)
        ppl = ""
        if getattr(self.args, "stage", "sft") == "sft":
            value = math.exp(min(20.0, loss)) if math.isfinite(loss) else float("nan")
            ppl = f" lm loss PPL: {value:.6E} |"
        extra = extra or {}
        others = "".join(f" {k}: {v:.6E} |" for k, v in extra.items())
        print(f" validation loss at {label or f'iteration {iteration}'} | lm loss value: {loss:.6E} |{ppl}{others}",
              flush=True)
        if self.jsonl:
            record = {"iteration": iteration, "split": split, "lm loss": loss, "tokens": tokens, **extra}
            if label:  # the end of training evaluates the last iteration again: tell the records apart
                record["label"] = label
            self._write(record)
        if self.tb:
            self.tb.add_scalar(f"{split}/lm loss", loss, iteration)
            if ppl and getattr(self.args, "log_validation_ppl_to_tensorboard", False):
                self.tb.add_scalar(f"{split}/lm loss PPL", value, iteration)
            for k, v in extra.items():
                self.tb.add_scalar(f"{split}/{k}", v, iteration)

    def _write(self, record: dict) -> None:
        """One line of the metrics file; a full disk stops the run with one line naming the file."""
        if not self.jsonl:
            return
        try:
            self.jsonl.write(json.dumps(record) + "\n")
        except OSError as e:
            if not is_disk_full(e):
                raise
            self._full = True
            raise DiskFullError(disk_full_message("--metrics-file", self.args.metrics_file, None)
                                + f" (iteration {record.get('iteration')}'s record was not written; the checkpoints "
                                "saved so far are intact)") from None

    def close(self) -> None:
        """Print the window a stop before its --log-interval boundary cut short (--exit-interval,
        --exit-duration-in-mins, a signal), whose steps no console line showed, then close the files."""
        if self._interval:
            self._print_interval(self._interval[-1][0])
        if self.jsonl:
            try:
                self.jsonl.close()
            except OSError:
                if not self._full:  # a full disk was reported already
                    raise
        if self.tb:
            self.tb.close()



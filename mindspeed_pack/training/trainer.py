"""The training loop shared by ``posttrain.py`` and ``pretrain_gpt.py``.

Reads top to bottom: :meth:`Trainer.setup` (model, optimizer, data, checkpoint),
:meth:`Trainer.train` (the loop), :meth:`Trainer.evaluate`, :meth:`Trainer.cleanup`.
The scripts differ only in the :class:`BatchSource` they pass: how a rank gets its
micro-batches (rows of tokens, aligned labels and segment ids) for a split, and the stages
(``--stage``, :mod:`mindspeed_pack.training.stages`) in their loss and per-step inputs.

Every micro-batch becomes a :class:`~mindspeed_pack.packing.segments.PackedBatch` (THD,
``cu_seqlens``) on every device, so CPU and GPU, packed and unpacked data run one path.
The loss is the per-token mean over the global batch (megatron-core's
``calculate_per_token_loss``), the only choice that does not change with packing.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from functools import partial
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from mindspeed_pack.checkpoint import hf_checkpoint, identity, save_dir, save_load
from mindspeed_pack.checkpoint.errors import CheckpointError
from mindspeed_pack.checkpoint.resume import load_run_checkpoint, loaded_from
from mindspeed_pack.config import finetune_defaults, resolved_config
from mindspeed_pack.datasets.packed_documents import DataError
from mindspeed_pack.datasets.sidecar_checks import check_data
from mindspeed_pack.model import moe
from mindspeed_pack.packing import context_parallel as cp_view
from mindspeed_pack.runtime import error_scope, faults, peers
from mindspeed_pack.runtime.exit_signal import ExitSignal
from mindspeed_pack.runtime.platform import cuda_usable, node_and_host
from mindspeed_pack.runtime.process_groups import initialize_from_args
from mindspeed_pack.training import layout, throughput
from mindspeed_pack.training.batches import BatchSource, host_packed_batch, model_device, packed_seq_params
from mindspeed_pack.training.fused_adam import use_fused_adam
from mindspeed_pack.training.manual_gc import ManualGC
from mindspeed_pack.training.metrics import MetricsLogger
from mindspeed_pack.training.model_setup import build_model, build_optimizer
from mindspeed_pack.training.optimizer_step import guarded_step, non_finite_grad_name
from mindspeed_pack.training.precision import loss_scale, precision_record
from mindspeed_pack.training.reductions import any_rank, dp_sum, global_means, global_totals

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    pass


class Trainer:
    def __init__(self, args, batch_source: BatchSource, stage, resume_save: bool = True, saves: bool = True):
        """``resume_save``: a run started again resumes from its own ``--save`` (checkpoint/resume.py); an RL
        session's driver chooses that itself (its rounds of rollouts are its own). ``saves``: False for a
        forward-only pass (scoring), which writes nothing into ``--save`` and so neither creates nor claims it."""
        self.args = args
        self.saves = saves
        self.started = time.monotonic()  # --exit-duration-in-mins counts from here, the job's start (Megatron-LM)
        self.resume_save = resume_save
        self.source = batch_source
        self.stage = stage
        self.stage_reports = {}
        self.iteration = 0
        self.consumed_samples = 0
        self.consumed_valid_samples = 0  # where the next validation starts in its split
        self.skipped = 0
        self.dynamic_cp = False  # set by setup from the batch source
        self.exit_signal = None
        self.slowest_step_s = 0.0
        self.phase = "the start (process groups, model, checkpoint, data)"  # what a peer failure interrupted

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        args = self.args
        initialize_from_args(args, flags=resolved_config.flag_values(args))  # the same on every rank
        if self.saves:  # before anything is built: an unwritable --save, or another job's, stops here
            save_dir.claim(args)
        if args.deterministic_mode:
            torch.use_deterministic_algorithms(True, warn_only=not cuda_usable())
        self.model = build_model(args)
        self.optimizer, self.scheduler = build_optimizer(args, self.model)
        identity.guard_scheduler_resume(args, self.scheduler)
        if args.load:  # LoRA: the base (weights only), then the adapters of --lora-load
            self.iteration, self.consumed_samples = load_run_checkpoint(args, self.model, self.optimizer,
                                                                        self.scheduler, self.resume_save)
            use_fused_adam(self.optimizer)  # a loaded optimizer takes the saved groups' settings
        # validation goes on through its split (cycling) from evaluation to evaluation, as in Megatron-LM:
        # its place after a resume follows from the iteration; --skip-train reads from the split's start
        eval_samples = args.eval_iters * args.global_batch_size
        self.consumed_valid_samples = 0 if args.skip_train else self.iteration // args.eval_interval * eval_samples
        with error_scope.files_read_alike(DataError):  # every rank reads the same files: one line per node
            self.source.setup(args, self._samples_to_read())
            for docs in getattr(self.source, "docs", None) or []:  # packed data and its sidecar, per prefix
                check_data(docs, args)
        # dynamic CP: each rank of the data x context parallel pool holds its own micro-batches, so the step's
        # counts are summed over the pool (with a fixed CP group, every CP rank counts its replica's rows)
        self.dynamic_cp = getattr(self.source, "dynamic_cp", False)
        self._same_data_on_every_rank()
        self._no_validation_warning()
        self.stage.setup(self)
        self.metrics = MetricsLogger(args, enabled=self._is_logging_rank(), start_iteration=self.iteration,
                                     extra_metrics=self.stage.metric_names)
        self.metrics.resumed(self.iteration, loaded_from(args))
        if self.metrics.enabled:  # the world every node joined, and what a step runs on it
            log.info(layout.layout_line(args))
        self.metrics.precision(self.iteration, precision_record(args, self.model, self.optimizer))
        self.collector = ManualGC(args)  # last: the setup's garbage is collected once, then none at random
        if args.exit_signal_handler:
            # the current iteration and the agreement to stop, with room for a slow step
            self.exit_signal = ExitSignal(grace_s=lambda: 10.0 + 2.0 * self.slowest_step_s,
                                          describe=lambda: self.phase)

    def _same_data_on_every_rank(self) -> None:
        """Every rank reads the same files at each data path: per-node copies at one path (the same --data-path on
        every node, so the flags agree) that differ (a stale copy, another preprocessing) mixed two datasets in one
        run without a word, each node's replicas reading theirs."""
        if dist.get_world_size() == 1:
            return
        mine = {docs.prefix: docs.fingerprint() for docs in getattr(self.source, "docs", None) or []}
        gathered = [None] * dist.get_world_size()  # every rank calls it: ranks that read no data bring {}
        dist.all_gather_object(gathered, (mine, *node_and_host()))
        for prefix in dict.fromkeys(p for prints, _, _ in gathered for p in prints):
            seen: dict = {}
            for rank, (prints, node, host) in enumerate(gathered):
                if prefix in prints:
                    seen.setdefault(prints[prefix], []).append(f"node {node} (host {host}, rank {rank})")
            if len(seen) > 1:
                found = "; ".join(f"{', '.join(where[:3])}{' ...' if len(where) > 3 else ''}: {what}"
                                  for what, where in seen.items())
                raise DataError(f"the ranks read different data at {prefix}: {found}; per-node copies must be the "
                                "same files (copy node 0's to every node, or use a filesystem every node shares)")

    def _no_validation_warning(self) -> None:
        """Evaluation asked for (--eval-interval or --eval-iters given) with no validation data: said once, where
        it was skipped without a word."""
        args = self.args
        given = [f"--{d.replace('_', '-')}" for d in ("eval_interval", "eval_iters")
                 if (getattr(args, "flag_sources", {}).get(d) or [None, None])[1] == "given"]
        if given and args.eval_iters and not args.skip_train and not self.source.has_split("valid") \
                and dist.get_rank() == 0:
            log.warning("%s given, but there is no validation data (--split %s gives it none, and no "
                        "--valid-data-path): no evaluation runs; give --split e.g. 98,2,0 or --valid-data-path",
                        " and ".join(given), args.split)

    def _samples_to_read(self) -> dict:
        """How many samples of each split this run reads from here on (a resume with another global batch
        size continues from the checkpoint's consumed samples)."""
        args = self.args
        remaining = max(0, (args.train_iters or 0) - self.iteration)
        eval_samples = args.eval_iters * args.global_batch_size
        # validation: every --eval-interval and once at the end; test: once, from the split's start
        evaluations = 1 if args.skip_train or not args.train_iters else (args.train_iters // args.eval_interval + 1)
        return {"train": self.consumed_samples + remaining * args.global_batch_size if remaining else 0,
                "valid": max(evaluations * eval_samples, self.consumed_valid_samples + eval_samples),
                "test": eval_samples}

    def sync_params(self) -> None:
        """With --overlap-param-gather the optimizer's all-gather of updated weights is finished lazily
        by the next forward: complete it before anything reads the weights directly (a save)."""
        if self.args.overlap_param_gather:
            for chunk in self.model:
                chunk.start_param_sync(force_sync=True)

    def _is_logging_rank(self) -> bool:
        return (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
                and ps.get_data_parallel_rank(with_context_parallel=True) == 0)

    # ------------------------------------------------------------------ steps
    def _run_batches(self, split: str, consumed: int, forward_only: bool):
        """Forward (and backward) over one global batch; returns (loss sum, stats)."""
        step = self._host_step(split, consumed)
        return self._device_step(step, split, forward_only), step["stats"]

    def _host_step(self, split: str, consumed: int) -> dict:
        """This rank's micro-batches of a global batch, laid out on the host: packed batches (THD), the
        context-parallel share, statistics. Nothing here touches the device."""
        args = self.args
        num_micro_batches, tokens_per_micro_batch, plan_stats = self._step_shape(split, consumed)
        source = self.source.micro_batches(split, consumed)
        # the plan's figures are the whole job's already (kept out of the sums over ranks)
        stats = {"rows": 0, "samples": 0, "tokens": 0, "real tokens": 0, "sum sq lengths": 0, "plan": plan_stats}
        batches, raw = [], []
        for _ in range(num_micro_batches):
            try:
                mb = next(source)
            except StopIteration:
                raise RuntimeError(f"{split} data exhausted at consumed samples {consumed}: the sample index "
                                   "is shorter than train-iters x global-batch-size") from None
            b = host_packed_batch(mb, args)
            if mb.get("cp_rank", 0) == 0:  # dynamic CP: a group's micro-batch is counted by its first rank
                stats["rows"] += mb["input_ids"].shape[0]
                stats["samples"] += mb.get("sample_count", b.num_samples)
                stats["tokens"] += b.num_tokens
                throughput.add_micro_batch(stats, mb)
            batches.append(b)
            raw.append(mb)
        if self.dynamic_cp:  # each micro-batch on its own CP group (packing/dynamic_cp.py)
            tp, sp = args.tensor_model_parallel_size, args.sequence_parallel
            per_rank = self.source.max_tokens_per_cp_rank
            batches = [cp_view.group_view(b, mb["cp_size"], mb["cp_rank"],
                                          cp_view.padding_multiple(mb["cp_size"], tp, sp), mb["cp_size"] * per_rank)
                       for b, mb in zip(batches, raw)]
            if any(b.num_tokens != per_rank for b in batches):
                raise ValueError(f"dynamic CP: a micro-batch holds {[b.num_tokens for b in batches]} tokens on this "
                                 f"rank, not --max-seqlen-per-dp-cp-rank {per_rank}")
            stats["tokens"] = sum(b.num_tokens for b in batches)  # this rank's, summed over the whole pool
        elif args.context_parallel_size > 1:  # this rank's zigzag share of every sample (packing/context_parallel.py)
            multiple = cp_view.padding_multiple(args.context_parallel_size, args.tensor_model_parallel_size,
                                                args.sequence_parallel)
            batches, tokens_per_micro_batch = cp_view.step_views(
                batches, args.context_parallel_size, ps.get_context_parallel_rank(), multiple,
                same_length=ps.get_pipeline_model_parallel_world_size() > 1,
                max_per_rank=getattr(self.source, "max_tokens_per_cp_rank", None))
            # the tokens the CP group really runs (its per-sample padding counts as padding)
            stats["tokens"] = sum(b.num_tokens for b in batches) * args.context_parallel_size
        stats["pad"] = stats["tokens"] - stats["real tokens"]  # also counts unpacked rows' padding
        return {"batches": batches, "raw": raw, "stats": stats, "tokens_per_micro_batch": tokens_per_micro_batch}

    def _device_step(self, step: dict, split: str, forward_only: bool) -> torch.Tensor:
        """Forward (and backward) of the host-built micro-batches; the loss sum [sum, count] on the host.

        Nothing in it waits on the device but the one read of the step's summed reports at its end
        (``tests/test_host_syncs.py`` counts)."""
        args = self.args
        device = model_device()
        batches = [b.to(device) for b in step["batches"]]  # asynchronous copies from pinned memory on a GPU
        batches = self.stage.prepare(self, batches, step["raw"], split, step["tokens_per_micro_batch"])
        if args.num_experts and not forward_only:  # the aux loss's gradient follows the stage's normaliser
            moe.scale_aux_loss(self.model, batches, sum(self.stage.count(b) for b in batches))
        data = iter(batches)

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            if args.num_experts:  # the routers group their statistics by sample (over its CP group), skip pads
                moe.set_routing_segments(model, batch.routing_segments, batch.routing_groups, batch.local_cp_size)
            # a stage that needs the distribution (entropy) gets the vocab-parallel logits, not the loss
            labels = None if getattr(self.stage, "needs_logits", False) else batch.target
            # a stage whose loss is a fixed weighting of the token losses gets their weighted sum (stages/__init__)
            weights = getattr(self.stage, "loss_weights", None)
            extra = {"loss_weights": weights(batch)} if weights is not None and labels is not None else {}
            output = model(batch.tokens, batch.position_ids, None, labels=labels,
                           packed_seq_params=packed_seq_params(batch), **extra)
            return output, partial(self.stage.loss_func, batch)

        results = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data, model=self.model,
            num_microbatches=len(batches), seq_length=step["tokens_per_micro_batch"],
            micro_batch_size=1, forward_only=forward_only,
        )
        # every micro-batch's [sum, count] reports, reduced on the device and read back once per step
        maxima = getattr(self.stage, "max_metrics", ())  # reported as [max, 1] and reduced by MAX
        names = ("lm loss", *self.stage.metric_names)
        sums = {name: torch.tensor([-math.inf if name in maxima else 0.0, 0.0], dtype=torch.float64)
                for name in names}
        if ps.is_pipeline_last_stage() and results:
            stacked = torch.stack([torch.stack([r[name].detach().double().reshape(2) for name in names])
                                   for r in results])  # [micro-batches, metrics, 2]
            largest, total = torch.stack([stacked.max(dim=0).values, stacked.sum(dim=0)]).cpu()
            sums = {name: torch.maximum(sums[name], largest[i]) if name in maxima else total[i]
                    for i, name in enumerate(names)}
        loss_sum = sums.pop("lm loss")
        self.stage_reports = sums  # the stage's other metrics, [sum, count] on this rank
        return loss_sum

    def _step_shape(self, split: str, consumed: int):
        """(micro-batches, tokens per micro-batch, plan statistics) of a step; online packing varies them."""
        step_shape = getattr(self.source, "step_shape", None)
        if step_shape is not None:
            return step_shape(split, consumed)
        return self.args.num_micro_batches, self.args.seq_length * self.args.micro_batch_size, {}

    def _global_mean(self, loss_sum: torch.Tensor) -> float:
        """Per-token mean over the global batch, known on every rank."""
        return global_means({"lm loss": loss_sum})["lm loss"]

    def train_step(self):
        args = self.args
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss_sum, stats = self._run_batches("train", self.consumed_samples, forward_only=False)
        total, count = global_totals({"lm loss": loss_sum})["lm loss"]
        loss = total / count if count > 0 else float("nan")
        if not math.isfinite(loss):
            # 0/0: a step whose every label is masked has nothing to learn from (not a diverged run)
            what = (f"non-finite loss {loss}" if count > 0 else "no trained token in the global batch (every label "
                    "masked: the data's labels, a rollout's response_mask, prompts filling their samples)")
            if args.nan_policy == "stop":
                raise NonFiniteLossError(f"{what} at iteration {self.iteration + 1}; use --nan-policy skip to skip "
                                         "such updates")
            log.warning("%s at iteration %d: update skipped", what, self.iteration + 1)
            self.skipped += 1
            return loss, float("nan"), stats, False
        # a non-finite gradient norm stops the step before the update; under --fp16 dynamic loss scaling an
        # overflow is expected: the scaler skips the update and lowers the scale (Megatron-LM)
        ok, grad_norm, non_finite = guarded_step(self.optimizer)
        if non_finite:
            where = f"iteration {self.iteration + 1} (first non-finite gradient: {non_finite_grad_name(self.model)})"
            if args.nan_policy == "stop":
                raise NonFiniteLossError(f"non-finite gradient at {where}; use --nan-policy skip to skip such "
                                         "updates")
            log.warning("non-finite gradient at %s: update skipped, weights unchanged", where)
            self.skipped += 1
            return loss, float("inf"), stats, False
        faults.fire("step", self.iteration + 1)  # crash tests: die after the update, before log and save
        if ok:
            self.scheduler.step(increment=args.global_batch_size)  # schedule counted in samples
        else:
            self.skipped += 1
        return loss, (float(grad_norm) if grad_norm is not None else float("nan")), stats, ok

    # ------------------------------------------------------------------ loop
    def train(self) -> None:
        args = self.args
        if args.skip_train:
            if not self.source.has_split("valid"):
                raise ValueError(f"--skip-train: the validation split is empty (--split {args.split})")
            self.evaluate()
            if self.source.has_split("test"):
                self.evaluate("test", "the end of training for test data")
            return
        if self.iteration >= args.train_iters:
            # the same command again after the run ended: its end-of-training evaluation ran then (a second one
            # appended its records to the metrics file again)
            log.info("checkpoint iteration %d >= --train-iters %d: nothing to train, nor to evaluate again",
                     self.iteration, args.train_iters)
            return
        for chunk in self.model:
            chunk.train()
        while self.iteration < args.train_iters:
            self.train_iteration()
            if args.eval_iters and self.iteration % args.eval_interval == 0 and self.source.has_split("valid"):
                self.evaluate()
            save_now = args.save and args.save_interval and self.iteration % args.save_interval == 0
            exit_now = self._should_exit()
            if save_now or (exit_now and args.save):
                self.phase = f"the save of iteration {self.iteration}"
                self.save()
            if exit_now:
                log.info("exiting at iteration %d", self.iteration)
                return
        if args.save and not (args.save_interval and self.iteration % args.save_interval == 0):
            self.phase = f"the save of iteration {self.iteration}"
            self.save()
        self._evaluate_at_end()

    def train_iteration(self) -> dict:
        """One optimizer step on the next global batch, counted and logged; returns the logged record."""
        self.phase = f"iteration {self.iteration + 1}"
        start = time.perf_counter()
        loss, grad_norm, stats, _ = self.train_step()
        elapsed = time.perf_counter() - start
        self.slowest_step_s = max(self.slowest_step_s, elapsed)
        self.iteration += 1
        self.consumed_samples += self.args.global_batch_size
        record = self._log_step(loss, grad_norm, stats, elapsed)
        self.collector.after_iteration(self.iteration)
        return record

    def _evaluate_at_end(self) -> None:
        """Megatron-LM's end of training: validation on the next ``--eval-iters`` global batches
        of the split and the test split's first ones."""
        if not self.args.eval_iters:
            return
        if self.source.has_split("valid"):
            self.evaluate("valid", "the end of training for val data")
        if self.source.has_split("test"):
            self.evaluate("test", "the end of training for test data")

    def _should_exit(self) -> bool:
        args = self.args
        signalled = bool(self.exit_signal and self.exit_signal.requested)
        flag = signalled or bool(args.exit_interval and self.iteration % args.exit_interval == 0)
        if args.exit_duration_in_mins and (time.monotonic() - self.started) / 60.0 > args.exit_duration_in_mins:
            flag = True  # the ranks' clocks differ a little: one rank past the limit stops them all
        stop = any_rank(flag)
        if stop and self.exit_signal:
            self.exit_signal.agreed()
        return stop

    def _log_step(self, loss, grad_norm, stats, elapsed) -> dict:
        args = self.args
        plan = stats.pop("plan")  # the whole job's already: kept out of the sum
        stage_metrics = global_means(self.stage_reports, getattr(self.stage, "max_metrics", ()))
        # a report nothing in the step counted (a KTO step without an undesirable sample): left out, as TRL does,
        # not a NaN (which the metrics file would hold as bare NaN, not JSON)
        stage_metrics = {k: v for k, v in stage_metrics.items() if not math.isnan(v)}
        stats = dp_sum(stats, with_context_parallel=self.dynamic_cp)
        total = int(stats["tokens"])
        real = int(stats["real tokens"])
        stats.update(plan)
        record = {
            "iteration": self.iteration,
            "split": "train",
            "lm loss": loss,
            "lr": self.optimizer.param_groups[0]["lr"],
            "grad norm": grad_norm,
            "tokens": real,
            "tokens/s": real / elapsed if elapsed > 0 else 0.0,
            "padding ratio": (total - real) / total if total else 0.0,
            "samples per pack": stats["samples"] / max(1, stats["rows"]),
            "step time (ms)": elapsed * 1000.0,
            "consumed samples": self.consumed_samples,
            "global batch size": args.global_batch_size,
            "skipped": self.skipped,
            "loss scale": loss_scale(self.optimizer),
            **throughput.step_fields(args, stats, elapsed, 1, dist.get_world_size()),
            **(moe.step_statistics(self.model, args.num_layers, args.num_experts) if args.num_experts else {}),
            **stage_metrics,
            **{k: v for k, v in plan.items() if k != "rank imbalance"},  # e.g. dynamic CP's group sizes
        }
        self.metrics.step(record, total_tokens=total, samples=stats["samples"], rows=stats["rows"])
        return record

    def evaluate(self, split: str = "valid", label: Optional[str] = None) -> Optional[float]:
        """Loss over ``--eval-iters`` global batches of ``split``: valid continues where its last
        evaluation stopped, test starts at the split's start (evaluated once, at the end)."""
        args = self.args
        if not self.source.has_split(split):
            log.warning("no %s split (--split gives it no documents): skipping evaluation", split)
            return None
        for chunk in self.model:
            chunk.eval()
        self.collector.around_evaluation_step()
        phase, self.phase = self.phase, f"the {split} evaluation at iteration {self.iteration}"
        total = torch.zeros(2, dtype=torch.float64)
        tokens = 0
        start = self.consumed_valid_samples if split == "valid" else 0
        maxima = getattr(self.stage, "max_metrics", ())
        reports = {}  # the stage's other metrics (a preference stage's rewards and accuracies), over the batches
        with torch.no_grad():
            for i in range(args.eval_iters):
                loss_sum, stats = self._run_batches(split, start + i * args.global_batch_size, forward_only=True)
                total += loss_sum
                tokens += stats["tokens"] - stats["pad"]
                for name, value in self.stage_reports.items():
                    seen = reports.get(name)
                    reports[name] = value.clone() if seen is None else (
                        torch.maximum(seen, value) if name in maxima else seen + value)
        if split == "valid":
            self.consumed_valid_samples += args.eval_iters * args.global_batch_size
        loss = self._global_mean(total)
        tokens = int(dp_sum({"tokens": tokens}, with_context_parallel=self.dynamic_cp)["tokens"])
        extra = {k: v for k, v in global_means(reports, maxima).items() if not math.isnan(v)}
        self.metrics.validation(self.iteration, loss, tokens, split=split, label=label, extra=extra)
        self.collector.around_evaluation_step()
        for chunk in self.model:
            chunk.train()
        self.phase = phase
        return loss

    def save(self) -> None:
        self.sync_params()
        save_load.save_checkpoint(self.args, self.iteration, self.consumed_samples, self.model,
                                  self.optimizer, self.scheduler, writing=self.writing)

    def writing(self):
        """A signal's grace (--exit-signal-handler) does not run out while this rank writes its checkpoint files."""
        return self.exit_signal.writing() if self.exit_signal else contextlib.nullcontext()

    def cleanup(self, barrier: bool = True) -> None:
        """Close the logs; after a normal end wait for every rank (never after a failure: a dead
        or hung peer would hold this rank until the timeout)."""
        if getattr(self, "metrics", None):
            self.metrics.close()
        if getattr(self, "collector", None):
            self.collector.close()
        if self.exit_signal:
            self.exit_signal.close()
        save_dir.release(self.args.save)
        if barrier and dist.is_initialized():
            self.phase = "the other ranks to finish (final barrier)"
            dist.barrier()


def _existing_export(args, iteration: int) -> bool:
    """A non-empty ``--save-hf`` of a run that resumed a checkpoint: whether the export at the end replaces it.

    The export of this run's last iteration: none is written again (``args.save_hf`` cleared). This run's export
    of an earlier iteration (the run trains on, or its export predates a longer ``--train-iters``): replaced when
    the run ends. Another run's export, or a directory no run wrote: refused before training. The export inside
    ``--save`` (``SAVE/hf``, the default) is the run's wherever ``--save`` was copied, moved or linked to."""
    if not finetune_defaults.exported(args.save_hf):
        return False
    record = hf_checkpoint.export_record(args.save_hf)
    inside = bool(args.save) and os.path.realpath(os.path.dirname(os.path.abspath(args.save_hf))) == \
        os.path.realpath(args.save)
    theirs = (record or {}).get("save")
    ours = record is not None and (inside or theirs is None or (bool(args.save) and os.path.realpath(theirs) ==
                                                                os.path.realpath(args.save)))
    # an export written before exports recorded themselves: a model (or adapter) directory, taken as the last one
    legacy = record is None and hf_checkpoint.looks_like_export(args.save_hf)
    # what it holds against what this run writes: PEFT adapters, or a model (--lora-merge added after the run ended)
    same_kind = hf_checkpoint.holds_adapters(args.save_hf) == hf_checkpoint.exports_adapters(args)
    if iteration >= args.train_iters and same_kind and (legacy or (ours and record["iteration"] == iteration)):
        log.info("--save-hf %s holds the export of iteration %d, where the run ends: none is written again",
                 args.save_hf, iteration)
        args.save_hf = None
        return False
    if ours:
        kind = "" if same_kind else (" (PEFT adapters; --lora-merge writes the merged model)" if
                                     hf_checkpoint.holds_adapters(args.save_hf) else " (a merged model)")
        log.info("--save-hf %s holds this run's export of iteration %d%s: the export of iteration %d replaces it when "
                 "the run ends", args.save_hf, record["iteration"], kind, max(iteration, args.train_iters))
        return True
    what = (f"holds the export of another run (--save {theirs})" if record is not None else
            "exists and is not an empty directory" + ("" if legacy else " (no model a run exported)"))
    trains = (f"this run trains iterations {iteration + 1}..{args.train_iters}" if iteration < args.train_iters
              else f"this run ends at iteration {iteration}")
    raise CheckpointError(f"--save-hf {args.save_hf} {what}, and {trains}: choose a new directory")


def run(args, batch_source: BatchSource, stage, before_train: Optional[Callable] = None) -> Trainer:
    trainer = Trainer(args, batch_source, stage)
    with peers.waiting_for(lambda: trainer.phase, args.distributed_timeout_minutes):
        try:
            trainer.setup()
            if args.save_hf:
                hf_checkpoint.remove_killed_exports(args)  # first: a replacement killed midway is undone
            with error_scope.files_read_alike(CheckpointError):  # what every rank reads alike: one line per node
                replace = bool(args.save_hf) and _existing_export(args, trainer.iteration)
                if args.save_hf:
                    hf_checkpoint.check_exportable(args)  # before training, not after it
            if before_train:
                before_train(trainer)
            trainer.train()
            # a run stopped early (--exit-interval, a signal) exports nothing: it is not the trained model
            if args.save_hf and not args.skip_train and trainer.iteration >= args.train_iters:
                trainer.phase = "the Hugging Face export (--save-hf)"
                trainer.sync_params()
                hf_checkpoint.save_hf(args, trainer.model, iteration=trainer.iteration, replace=replace)
        except BaseException:
            trainer.cleanup(barrier=False)
            raise
        trainer.cleanup()
    return trainer

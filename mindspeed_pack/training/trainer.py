"""The training loop shared by ``posttrain.py`` and ``pretrain_gpt.py``.

Reads top to bottom: :meth:`Trainer.setup` (model, optimizer, data, checkpoint),
:meth:`Trainer.train` (the loop), :meth:`Trainer.evaluate`, :meth:`Trainer.cleanup`.
The scripts differ only in the :class:`BatchSource` they pass: how a rank gets its
micro-batches (rows of tokens, aligned labels and segment ids) for a split.

Every micro-batch becomes a :class:`~mindspeed_pack.packing.segments.PackedBatch` (THD,
``cu_seqlens``) on every device, so CPU and GPU, packed and unpacked data run one path.
The loss is the per-token mean over the global batch (megatron-core's
``calculate_per_token_loss``), the only choice that does not change with packing.
"""
from __future__ import annotations

import logging
import math
import os
import signal
import time
from functools import partial
from typing import Callable, Iterator, List, Optional, Protocol

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config

from mindspeed_pack.model.gpt import build_gpt_model
from mindspeed_pack.packing.segments import PackedBatch, build_packed_batch
from mindspeed_pack.training import checkpointing, throughput
from mindspeed_pack.platform import cuda_usable
from mindspeed_pack.training.init_weights import parallel_invariant_init
from mindspeed_pack.training.initialize import initialize_distributed
from mindspeed_pack.training.metrics import MetricsLogger

log = logging.getLogger(__name__)


class BatchSource(Protocol):
    """Where a script's data comes from."""

    def setup(self, args, num_samples: dict) -> None:
        """Build the splits' datasets for ``num_samples`` {'train': n, 'valid': n}."""

    def micro_batches(self, split: str, consumed_samples: int) -> Iterator[dict]:
        """This rank's micro-batches ({'input_ids','labels','segment_ids'} [b, s]) from a position."""

    def has_split(self, split: str) -> bool:
        ...

    # optional: step_shape(split, consumed) -> (micro-batches, tokens per micro-batch, stats) for
    # sources whose step shape varies (online packing); default args.num_micro_batches x seq_length


class NonFiniteLossError(RuntimeError):
    pass


def to_packed_batch(mb: dict, args) -> PackedBatch:
    batch = build_packed_batch(
        mb["input_ids"], mb["labels"], mb["segment_ids"],
        reset_position_ids=args.reset_position_ids, per_sample_loss=args.per_sample_loss,
    )
    if "loss_mask" in mb:  # e.g. --eod-mask-loss: extra untrained targets from the data side
        batch.loss_mask = batch.loss_mask * mb["loss_mask"].reshape(batch.loss_mask.shape).float()
    return batch.to(torch.cuda.current_device() if cuda_usable() else "cpu")


def packed_seq_params(batch: PackedBatch) -> PackedSeqParams:
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=batch.cu_seqlens, cu_seqlens_kv=batch.cu_seqlens,
        max_seqlen_q=batch.max_seqlen, max_seqlen_kv=batch.max_seqlen,
    )


def loss_func(batch: PackedBatch, per_sample: bool, output_tensor: torch.Tensor):
    """Summed loss and its normaliser; megatron divides by the global batch's total."""
    losses = output_tensor.float().reshape(batch.loss_mask.shape)
    if per_sample:
        loss = (losses * batch.loss_weights).sum()
        count = torch.tensor(batch.num_samples, dtype=torch.int, device=loss.device)
    else:
        loss = (losses * batch.loss_mask).sum()
        count = batch.loss_mask.sum().to(torch.int)
    report = torch.stack([loss.detach(), count.to(loss.dtype)])
    return loss, count, {"lm loss": report}


class Trainer:
    def __init__(self, args, batch_source: BatchSource):
        self.args = args
        self.source = batch_source
        self.iteration = 0
        self.consumed_samples = 0
        self.skipped = 0
        self.exit_requested = False

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        args = self.args
        if args.deterministic_mode:
            # cuBLAS needs a fixed workspace for deterministic GEMMs; NCCL must not pick algorithms per run
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            os.environ.setdefault("NCCL_ALGO", "Ring")
            os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")  # TE fused attention backward
        initialize_distributed(args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.seed,
                               args.distributed_timeout_minutes)
        if args.deterministic_mode:
            torch.use_deterministic_algorithms(True, warn_only=not cuda_usable())
        self.model = self._build_model()
        self.optimizer, self.scheduler = self._build_optimizer()
        if args.load:
            self.iteration, self.consumed_samples = checkpointing.load_checkpoint(
                args, self.model, self.optimizer, self.scheduler)
        num_samples = {"train": (args.train_iters or 0) * args.global_batch_size,
                       "valid": args.eval_iters * args.global_batch_size}
        self.source.setup(args, num_samples)
        self.metrics = MetricsLogger(args, enabled=self._is_logging_rank())
        if args.exit_signal_handler:
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)

    def _build_model(self) -> List[torch.nn.Module]:
        args = self.args
        pre = ps.is_pipeline_first_stage()
        post = ps.is_pipeline_last_stage()
        model = build_gpt_model(args, pre_process=pre, post_process=post)
        if not args.load and not args.no_parallel_invariant_init:
            parallel_invariant_init(model, args, args.seed)
        if cuda_usable():
            model.cuda(torch.cuda.current_device())
        config = get_model_config(model)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=args.overlap_grad_reduce,
            use_distributed_optimizer=args.use_distributed_optimizer,
            check_for_nan_in_grad=False,
        )
        model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
        if dist.get_rank() == 0:
            n = sum(p.numel() for p in model.parameters())
            log.info("model chunk on rank 0: %.2fM parameters, attention backend %s", n / 1e6,
                     model.module.attention_backend)
        return [model]

    def _build_optimizer(self):
        args = self.args
        opt_config = OptimizerConfig(
            optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
            clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16,
            params_dtype=torch.bfloat16 if args.bf16 else (torch.float16 if args.fp16 else torch.float32),
            use_distributed_optimizer=args.use_distributed_optimizer,
            initial_loss_scale=args.initial_loss_scale, loss_scale=args.loss_scale,
        )
        optimizer = get_megatron_optimizer(opt_config, self.model)
        decay_iters = args.lr_decay_iters or args.train_iters or 1
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0 if args.lr_warmup_iters else args.lr, max_lr=args.lr, min_lr=args.min_lr,
            lr_warmup_steps=args.lr_warmup_iters, lr_decay_steps=max(decay_iters, args.lr_warmup_iters + 1),
            lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
            wd_incr_steps=decay_iters, wd_incr_style="constant",
        )
        config = get_model_config(self.model[0])
        config.grad_scale_func = optimizer.scale_loss
        config.no_sync_func = self.model[0].no_sync
        config.finalize_model_grads_func = finalize_model_grads
        config.timers = None
        return optimizer, scheduler

    def _is_logging_rank(self) -> bool:
        return (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
                and ps.get_data_parallel_rank() == 0)

    def _on_signal(self, signum, frame) -> None:
        log.warning("signal %d received: saving a checkpoint after this iteration and exiting", signum)
        self.exit_requested = True

    # ------------------------------------------------------------------ steps
    def _run_batches(self, split: str, consumed: int, forward_only: bool):
        """Forward (and backward) over one global batch; returns (loss sum, count, stats)."""
        args = self.args
        num_micro_batches, tokens_per_micro_batch, plan_stats = self._step_shape(split, consumed)
        source = self.source.micro_batches(split, consumed)
        stats = {"rows": 0, "samples": 0, "tokens": 0, **plan_stats}
        batches = []
        for _ in range(num_micro_batches):
            try:
                mb = next(source)
            except StopIteration:
                raise RuntimeError(f"{split} data exhausted at consumed samples {consumed}: the sample index "
                                   "is shorter than train-iters x global-batch-size") from None
            b = to_packed_batch(mb, args)
            stats["rows"] += mb["input_ids"].shape[0]
            stats["samples"] += b.num_samples
            stats["tokens"] += b.num_tokens
            throughput.add_micro_batch(stats, mb)
            batches.append(b)
        stats["pad"] = stats["tokens"] - stats["real tokens"]  # also counts unpacked rows' padding
        data = iter(batches)

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            output = model(batch.tokens, batch.position_ids, None, labels=batch.target,
                           packed_seq_params=packed_seq_params(batch))
            return output, partial(loss_func, batch, args.per_sample_loss)

        results = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data, model=self.model,
            num_microbatches=num_micro_batches, seq_length=tokens_per_micro_batch,
            micro_batch_size=1, forward_only=forward_only,
        )
        loss_sum = torch.zeros(2, dtype=torch.float64)
        if ps.is_pipeline_last_stage():
            for r in results:
                loss_sum += r["lm loss"].detach().double().cpu()
        return loss_sum, stats

    def _step_shape(self, split: str, consumed: int):
        """(micro-batches, tokens per micro-batch, plan statistics) of a step; online packing varies them."""
        step_shape = getattr(self.source, "step_shape", None)
        if step_shape is not None:
            return step_shape(split, consumed)
        return self.args.num_micro_batches, self.args.seq_length * self.args.micro_batch_size, {}

    def _global_mean(self, loss_sum: torch.Tensor) -> float:
        """Per-token mean over the global batch, known on every rank."""
        t = loss_sum.clone()
        device = torch.cuda.current_device() if cuda_usable() else "cpu"
        t = t.to(device)
        dist.all_reduce(t, group=ps.get_data_parallel_group())
        # the last pipeline stage holds the loss: share it with the whole pipeline
        dist.all_reduce(t, group=ps.get_pipeline_model_parallel_group())
        t = t.cpu()
        return float(t[0] / t[1]) if t[1] > 0 else float("nan")

    def train_step(self):
        args = self.args
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss_sum, stats = self._run_batches("train", self.consumed_samples, forward_only=False)
        loss = self._global_mean(loss_sum)
        if not math.isfinite(loss):
            if args.nan_policy == "stop":
                raise NonFiniteLossError(f"non-finite loss {loss} at iteration {self.iteration + 1}; "
                                         "use --nan-policy skip to skip such updates")
            log.warning("non-finite loss at iteration %d: update skipped", self.iteration + 1)
            self.skipped += 1
            return loss, float("nan"), stats, False
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)  # schedule counted in iterations
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
            return
        if self.iteration >= args.train_iters:
            log.info("checkpoint iteration %d >= --train-iters %d: nothing to train", self.iteration, args.train_iters)
        for chunk in self.model:
            chunk.train()
        while self.iteration < args.train_iters:
            start = time.perf_counter()
            loss, grad_norm, stats, _ = self.train_step()
            elapsed = time.perf_counter() - start
            self.iteration += 1
            self.consumed_samples += args.global_batch_size
            self._log_step(loss, grad_norm, stats, elapsed)
            if args.eval_interval and args.eval_iters and self.iteration % args.eval_interval == 0:
                self.evaluate()
            save_now = args.save and args.save_interval and self.iteration % args.save_interval == 0
            exit_now = self._should_exit()
            if save_now or (exit_now and args.save):
                self.save()
            if exit_now:
                log.info("exiting at iteration %d", self.iteration)
                return
        if args.save and not (args.save_interval and self.iteration % args.save_interval == 0):
            self.save()

    def _should_exit(self) -> bool:
        flag = self.exit_requested or bool(self.args.exit_interval and self.iteration % self.args.exit_interval == 0)
        t = torch.tensor([int(flag)], device=torch.cuda.current_device() if cuda_usable() else "cpu")
        dist.all_reduce(t)  # every rank must agree
        return bool(t.item())

    def _log_step(self, loss, grad_norm, stats, elapsed) -> None:
        args = self.args
        # tokens seen by the whole job this step: this rank's rows x data-parallel size (real tokens:
        # exact from the data plan when the source gives it, as under dp_balanced)
        dp = ps.get_data_parallel_world_size()
        total = stats["tokens"] * dp
        real = throughput.job_figures(stats, dp)[0]
        self.metrics.step({
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
            **throughput.step_fields(args, stats, elapsed, dp, dist.get_world_size()),
        })

    def evaluate(self) -> Optional[float]:
        """Validation loss over ``--eval-iters`` global batches from the start of the valid split."""
        args = self.args
        if not self.source.has_split("valid"):
            log.warning("no validation split (--split gives it no documents): skipping evaluation")
            return None
        for chunk in self.model:
            chunk.eval()
        total = torch.zeros(2, dtype=torch.float64)
        tokens = 0
        with torch.no_grad():
            for i in range(args.eval_iters):
                loss_sum, stats = self._run_batches("valid", i * args.global_batch_size, forward_only=True)
                total += loss_sum
                tokens += stats["tokens"] - stats["pad"]
        loss = self._global_mean(total)
        self.metrics.validation(self.iteration, loss, tokens * ps.get_data_parallel_world_size())
        for chunk in self.model:
            chunk.train()
        self.last_valid_loss = loss
        return loss

    def save(self) -> None:
        checkpointing.save_checkpoint(self.args, self.iteration, self.consumed_samples, self.model,
                                      self.optimizer, self.scheduler)

    def cleanup(self) -> None:
        self.metrics.close()
        if dist.is_initialized():
            dist.barrier()


def run(args, batch_source: BatchSource, before_train: Optional[Callable] = None) -> Trainer:
    trainer = Trainer(args, batch_source)
    trainer.setup()
    if before_train:
        before_train(trainer)
    try:
        trainer.train()
    finally:
        trainer.cleanup()
    return trainer

"""The model chunks and optimizer a run trains, built as Megatron-LM's ``get_model`` and
``setup_model_and_optimizer`` build them: GPTModel -> Float16Module (bf16/fp16) -> megatron DDP, then
megatron-core's optimizer with the learning-rate schedule counted in samples."""
from __future__ import annotations

import logging
from typing import List

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_model_config

from mindspeed_pack.checkpoint import save_load
from mindspeed_pack.model import lora
from mindspeed_pack.model.gpt import build_gpt_model
from mindspeed_pack.model.score_head import SCORE
from mindspeed_pack.model.te_spec import kernel_fallbacks
from mindspeed_pack.runtime.platform import cuda_usable
from mindspeed_pack.training.fused_adam import use_fused_adam
from mindspeed_pack.training.init_weights import parallel_invariant_init
from mindspeed_pack.training.multi_tensor import use_foreach_kernels
from mindspeed_pack.training.schedule import build_scheduler

log = logging.getLogger(__name__)


def build_model(args) -> List[torch.nn.Module]:
    """This rank's model chunk, initialised the same at every layout (or left for ``--load`` to fill)."""
    model = build_gpt_model(args, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    # a first launch of --load D --save D (nothing in D yet) starts from scratch: initialised as without --load
    filled = args.load and not (args.load_format != "hf" and save_load.first_launch(args))
    if not filled and not args.no_parallel_invariant_init:
        parallel_invariant_init(model, args, args.seed)
    elif lora.trains_adapters(args):  # the adapters of a loaded base, and a reward model's head (a reward model
        parallel_invariant_init(model, args, args.seed, only=lora.is_trained_name)  # as base loads its own over it)
    elif model.score is not None:  # a reward model started from a language model's weights: a fresh head, the
        parallel_invariant_init(model, args, args.seed, only=lambda name: name == SCORE)  # same at every layout
    if cuda_usable():
        model.cuda(torch.cuda.current_device())
    config = get_model_config(model)
    backend = model.attention_backend
    if args.bf16 or args.fp16:
        # every parameter in the half dtype (no fp32 stragglers), fp32 logits out of the last stage
        model = Float16Module(config, model)
        model.attention_backend = backend
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,  # Megatron-LM's default under --bf16 (accumulate_allreduce_grads_in_fp32)
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        check_for_nan_in_grad=False,
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    if dist.get_rank() == 0:
        _log_model(args, model, backend)
    return [model]


def _log_model(args, model, backend) -> None:
    n = sum(p.numel() for p in model.parameters())
    log.info("model chunk on rank 0: %.2fM parameters, attention backend %s", n / 1e6, backend)
    if kernel_fallbacks():
        log.info("kernels: %s", kernel_fallbacks())
    if lora.trains_adapters(args):
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        settings = lora.settings_from_args(args)  # the scale: rsLoRA's alpha / sqrt(r) differs from alpha / r
        log.info("LoRA r=%d alpha=%g scale %g (%s) on %s: %d adapter parameters train (%.3f%% of the chunk), the "
                 "base is frozen (no gradient buffer, no optimizer state)", args.lora_r, args.lora_alpha,
                 settings.scale, "rsLoRA: alpha / sqrt(r)" if settings.rslora else "alpha / r",
                 " ".join(args.lora_target_modules or [lora.ALL_LINEAR]), trained, 100.0 * trained / n)


def build_optimizer(args, model: List[torch.nn.Module]):
    """(optimizer, scheduler) over ``model``'s chunks; the chunks' config learns the hooks the pipeline
    schedules call (loss scaling, gradient sync, gradient finalisation)."""
    opt_config = OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16,
        params_dtype=torch.bfloat16 if args.bf16 else (torch.float16 if args.fp16 else torch.float32),
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather=args.overlap_param_gather,
        initial_loss_scale=args.initial_loss_scale, loss_scale=args.loss_scale,
        min_loss_scale=args.min_loss_scale, loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
    )
    optimizer = get_megatron_optimizer(opt_config, model)
    use_fused_adam(optimizer)
    use_foreach_kernels()  # the gradient norm without a read per gradient tensor (no TE/Apex kernels)
    scheduler = build_scheduler(args, optimizer)  # counted in samples, as Megatron-LM does
    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = model[0].no_sync
    if args.overlap_grad_reduce:
        # start each bucket's reduction as soon as its gradients are ready (Megatron-LM's train())
        config.grad_sync_func = model[0].start_grad_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.timers = None
    return optimizer, scheduler

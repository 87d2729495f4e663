"""Save and load training checkpoints in Megatron's layout, atomically and exactly.

A save writes every rank's file under ``iter_N.tmp/``; after a barrier rank 0 renames the
directory to ``iter_N`` and only then moves the tracker file, so a crash at any moment
leaves the previous checkpoint complete and pointed to. A checkpoint holds the model
(canonical names), optimizer, scheduler, RNG states and ``consumed_samples`` (the position
in the sample index), so a resumed run continues exactly as the uninterrupted one.
"""
from __future__ import annotations

import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import get_cuda_rng_tracker

from mindspeed_pack.training import checkpoint_layout as layout
from mindspeed_pack.training.cpu_platform import cuda_usable

log = logging.getLogger(__name__)

# model-shape arguments that must match between a checkpoint and the flags
SHAPE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "padded_vocab_size", "add_qkv_bias", "swiglu", "untie_embeddings_and_output_weights")


class CheckpointError(RuntimeError):
    pass


def _ranks():
    return (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
            ps.get_pipeline_model_parallel_world_size())


def _rng_state() -> dict:
    return {
        "random": random.getstate(),
        "np": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if cuda_usable() else None,
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["np"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and cuda_usable():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _model_args(args) -> dict:
    keys = SHAPE_ARGS + ("group_query_attention", "kv_channels", "disable_bias_linear", "normalization",
                         "norm_epsilon", "position_embedding_type", "rotary_base", "max_position_embeddings",
                         "seq_length", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                         "make_vocab_size_divisible_by", "vocab_size")
    return {k: getattr(args, k, None) for k in keys}


def save_checkpoint(args, iteration, consumed_samples, model, optimizer, scheduler) -> None:
    root = args.save
    final_dir = layout.iteration_dir(root, iteration)
    tmp_dir = final_dir + ".tmp"
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        layout.remove_tree(tmp_dir)
    dist.barrier()
    tp_rank, pp_rank, pp_size = _ranks()
    state = {
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "checkpoint_version": layout.CHECKPOINT_VERSION,
        "args": _model_args(args),
        "model": layout.model_state_for_save(model[0]),
    }
    if not args.no_save_optim:
        state["optimizer"] = optimizer.state_dict()
        state["opt_param_scheduler"] = scheduler.state_dict()
    if not args.no_save_rng:
        state["rng_state"] = _rng_state()
    if ps.get_data_parallel_rank() == 0:
        path = os.path.join(tmp_dir, layout.rank_dir_name(tp_rank, pp_rank, pp_size), "model_optim_rng.pt")
        layout.save_file_atomic(state, path)
    if args.use_distributed_optimizer and not args.no_save_optim:
        # the distributed optimizer's parameter state is sharded over data-parallel ranks
        optimizer.save_parameter_state(os.path.join(tmp_dir, layout.rank_dir_name(tp_rank, pp_rank, pp_size),
                                                    "distrib_optim.pt"))
    dist.barrier()
    if dist.get_rank() == 0:
        old = final_dir + ".old"
        if os.path.isdir(final_dir):  # re-saving the same iteration: keep the old one until the new is in place
            os.replace(final_dir, old)
        os.replace(tmp_dir, final_dir)
        layout.write_tracker(root, iteration)
        layout.remove_tree(old)
        log.info("saved checkpoint at iteration %d to %s", iteration, root)
    dist.barrier()


def _read_rank_file(args, iteration) -> dict:
    tp_rank, pp_rank, pp_size = _ranks()
    path = layout.checkpoint_file(args.load, iteration, tp_rank, pp_rank, pp_size)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: the checkpoint in {args.load} is incomplete")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # truncated or corrupt
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e}); the file is truncated or "
                              "corrupt, load an earlier iteration") from e


def _check_shapes(path_hint: str, module, state: dict) -> None:
    expected = {k: v.shape for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)
                and not k.endswith("_extra_state")}
    for name, tensor in state.items():
        if name in expected and tuple(tensor.shape) != tuple(expected[name]):
            raise CheckpointError(f"{path_hint}: tensor {name} has shape {tuple(tensor.shape)} but the model "
                                  f"built from the flags expects {tuple(expected[name])}: check the model-shape "
                                  "flags (--hidden-size, --num-layers, --ffn-hidden-size, heads, vocab)")
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{path_hint}: parameter names differ from the model: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")


def load_checkpoint(args, model, optimizer, scheduler):
    """Restore from ``--load``; returns (iteration, consumed_samples)."""
    root = args.load
    if not os.path.isdir(root):
        raise CheckpointError(f"--load {root}: no such directory")
    iteration = layout.read_tracker(root)
    if iteration is None:
        raise CheckpointError(f"--load {root}: no checkpoint found ({layout.TRACKER} is missing)")
    saved_tp, saved_pp = layout.saved_parallel_sizes(root, iteration)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if (saved_tp, saved_pp) != (tp, pp):
        raise CheckpointError(
            f"--load {root}: checkpoint saved at TP={saved_tp}, PP={saved_pp} but this run uses TP={tp}, PP={pp}; "
            f"reshard it first: python convert_ckpt.py --load-model-type mg --save-model-type mg --load-dir {root} "
            f"--save-dir NEW_DIR --target-tensor-parallel-size {tp} --target-pipeline-parallel-size {pp}")
    state = _read_rank_file(args, iteration)
    saved_args = state.get("args") or {}
    for key in SHAPE_ARGS:
        if saved_args.get(key) is not None and getattr(args, key, None) is not None \
                and saved_args[key] != getattr(args, key):
            raise CheckpointError(f"--load {root}: checkpoint has {key}={saved_args[key]} but the flags say "
                                  f"{getattr(args, key)}")
    module = model[0].module
    from mindspeed_pack.training.checkpoint_layout import to_backend_names

    weights = to_backend_names(state["model"], module.attention_backend)
    _check_shapes(f"--load {root}", module, weights)
    module.load_state_dict(weights, strict=False)
    release = iteration == layout.RELEASE
    if args.finetune or release:
        log.info("loaded weights from %s (%s): iteration reset to 0", root, "release" if release else "finetune")
        return 0, 0
    if not args.no_load_optim:
        if "optimizer" not in state:
            raise CheckpointError(f"--load {root}: no optimizer state saved; use --no-load-optim or --finetune")
        optimizer.load_state_dict(state["optimizer"])
        if args.use_distributed_optimizer:
            tp_rank, pp_rank, pp_size = _ranks()
            optimizer.load_parameter_state(os.path.join(layout.iteration_dir(root, iteration),
                                                        layout.rank_dir_name(tp_rank, pp_rank, pp_size),
                                                        "distrib_optim.pt"))
        scheduler.load_state_dict(state["opt_param_scheduler"])
    if not args.no_load_rng and "rng_state" in state:
        _set_rng_state(state["rng_state"])
    log.info("resumed from %s at iteration %d", root, iteration)
    return int(state["iteration"]), int(state.get("consumed_samples", iteration * args.global_batch_size))

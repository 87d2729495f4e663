"""Save and load training checkpoints in Megatron's layout, atomically and exactly.

A save writes every rank's file under ``iter_N.tmp/``; after a barrier rank 0 renames the
directory to ``iter_N`` and only then moves the tracker file, so a crash at any moment
leaves the previous checkpoint complete and pointed to (re-saving an existing ``iter_N``
parks the old one as ``iter_N.old`` for the two renames; a load falls back to it). A
checkpoint holds the model (canonical names), optimizer, scheduler, RNG states and
``consumed_samples`` (the position in the sample index), so a resumed run continues
exactly as the uninterrupted one; and the model's arguments and its tokenizer's record, which
every load (``--load``, ``--ref-load``; a Hugging Face directory too) checks against the flags
and this run's tokenizer (:mod:`~mindspeed_pack.checkpoint.identity`).

Files hold only tensors, numbers, strings and plain containers (RNG states included), so
they load back with ``weights_only`` and no allow-list; every read goes through
:func:`~mindspeed_pack.convert.megatron_layout.load_file`, which refuses a file that asks for code.
A save that fails (a full disk) removes its partial files on every rank and raises a
:class:`CheckpointError` saying the previous checkpoint is intact.

Crash tests arm :mod:`mindspeed_pack.runtime.faults` (``MINDSPEED_PACK_FAULT=write@N:kill``, ...) to
die or fail at each phase of a save.
"""
from __future__ import annotations

import contextlib
import errno
import glob
import logging
import os
import random
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import get_cuda_rng_tracker

from mindspeed_pack.checkpoint import hf_checkpoint, identity
from mindspeed_pack.checkpoint.errors import CheckpointError
from mindspeed_pack.checkpoint.rank_files import is_shard_writer, rank_dir_name_here, tp_pp_ranks
from mindspeed_pack.convert import hf_io
from mindspeed_pack.convert import megatron_layout as layout
from mindspeed_pack.convert.model_specs import recorded_family, training_model_args
from mindspeed_pack.convert.tokenizer_record import read_tokenizer_record
from mindspeed_pack.convert.weight_map import MG_OUTPUT, MG_SCORE
from mindspeed_pack.model import lora
from mindspeed_pack.runtime import faults
from mindspeed_pack.runtime.peers import all_ranks_ok
from mindspeed_pack.runtime.platform import cuda_usable

log = logging.getLogger(__name__)

POLICY_FLAGS = ("--load", "--save")  # checkpoints of the model this run trains (--save: its own, resumed)


def _rng_state() -> dict:
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "random": random.getstate(),  # a tuple of ints
        "np": [name, keys.tolist(), pos, has_gauss, gauss],  # plain, so no numpy type in the file
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if cuda_usable() else None,
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def _rng_states_by_dp_rank() -> list:
    """Every data- (and context-) parallel rank's RNG state (dropout draws differ with each rank's tokens)."""
    local = _rng_state()
    dp = ps.get_data_parallel_world_size(with_context_parallel=True)
    if dp == 1:
        return [local]
    states = [None] * dp
    dist.all_gather_object(states, local, group=ps.get_data_parallel_group(with_context_parallel=True))
    return states


def _has_dropout(args) -> bool:
    """Whether the run draws dropout masks (a Qwen or Llama fine-tune has none: a changed DP size then changes
    nothing the RNG states decide, and saying otherwise was a false alarm on every such resume)."""
    return any((getattr(args, k, 0) or 0) > 0 for k in ("attention_dropout", "hidden_dropout", "lora_dropout"))


def _restore_rng(states, path: str, args) -> None:
    if isinstance(states, dict):  # one state for every rank
        states = [states]
    dp = ps.get_data_parallel_world_size(with_context_parallel=True)
    dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
    if len(states) != dp:
        log.log(logging.WARNING if _has_dropout(args) else logging.DEBUG,
                "%s holds RNG states of %d data(xcontext)-parallel ranks, this run has %d: every rank takes rank "
                "0's, so dropout will not continue exactly", path, len(states), dp)
        dp_rank = 0
    _set_rng_state(states[dp_rank])


# Megatron-LM's names for the same states (its get_rng_state), read from its checkpoints
_MEGATRON_LM_RNG_KEYS = {"random_rng_state": "random", "np_rng_state": "np", "torch_rng_state": "torch",
                         "cuda_rng_state": "cuda", "rng_tracker_states": "tracker"}


def _set_rng_state(state: dict) -> None:
    state = {_MEGATRON_LM_RNG_KEYS.get(k, k): v for k, v in state.items()}  # a resume of Megatron-LM's: KeyError
    version, internal, gauss = state["random"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, gauss = state["np"]  # a list (or an array in older checkpoints)
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and cuda_usable():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _fsync_dir(path: str) -> None:
    """Make renames inside ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _save_failed(root: str, iteration: int, error, tmp_dir: str) -> CheckpointError:
    if dist.get_rank() == 0:
        layout.remove_tree(tmp_dir)
    dist.barrier()
    try:
        previous = layout.read_tracker(root)
    except ValueError:
        previous = None
    kept = (f"{root} still holds iteration {previous}, which --load {root} resumes from" if previous is not None
            else f"{root} holds no earlier checkpoint")
    if error is None:
        error_text = "another rank failed to write its files"
    else:
        error_text = f"{error.strerror or error}" + (f" writing {error.filename}" if error.filename else "")
    hint = "free disk space (or --save elsewhere)" if getattr(error, "errno", None) == errno.ENOSPC else \
        "fix the cause"
    return CheckpointError(f"saving iteration {iteration} to {root} failed: {error_text}; this save's partial files "
                           f"were removed and {kept}: {hint} and resume from there")


# what decides the sample a resumed run reads next: consumed_samples counts into the index these build
DATA_ORDER_ARGS = ("data_path", "train_data_path", "seq_length", "split", "seed", "no_shuffle", "padded_samples")
DATA_PATH_ARGS = ("data_path", "train_data_path")  # compared by content where the record holds it
DATA_IDENTITY = "data_identity"  # {absolute prefix: content identity}, recorded beside DATA_ORDER_ARGS


def _data_order(args) -> dict:
    """This run's :data:`DATA_ORDER_ARGS` (paths absolute, a blend's weights as given), recorded in its checkpoints,
    with each prefix's content identity (:func:`~mindspeed_pack.datasets.packed_documents.content_identity`)."""
    from mindspeed_pack.datasets.packed_documents import content_identity, is_blend_weight

    def value(key):
        v = getattr(args, key, None)
        return [p if is_blend_weight(p) else os.path.abspath(p) for p in v] if key.endswith("data_path") and v else v
    order = {key: value(key) for key in DATA_ORDER_ARGS}
    order[DATA_IDENTITY] = {p: content_identity(p) for key in DATA_PATH_ARGS for p in order[key] or []
                            if not is_blend_weight(p)}
    return order


def _by_content(paths, identities: dict):
    """``paths`` with each prefix replaced by its content identity where known."""
    return [identities.get(p) or p for p in paths] if isinstance(paths, list) else paths


def _warn_other_data(args, source: str, state: dict, consumed: int) -> None:
    """A resume with other data or another sample order (``--data-path``, ``--seq-length``, ``--seed``, ...) went on
    silently at the checkpoint's consumed samples of *this* run's sample index: not where the saved run stopped.
    Prefixes are compared by content where the checkpoint recorded it: the same files moved to another directory
    are the same data (said in an info line), other files at the same path are not; older records compare paths."""
    saved = state.get("data_order")
    if not isinstance(saved, dict) or dist.get_rank() != 0:
        return  # a checkpoint older than the record, or another tool's
    mine = _data_order(args)
    def show(v):
        return " ".join(map(str, v)) if isinstance(v, list) else v
    by_content = isinstance(saved.get(DATA_IDENTITY), dict)
    differing, moved = [], []
    per_split = bool(mine.get("train_data_path")) and bool(saved.get("train_data_path"))
    for k in DATA_ORDER_ARGS:
        if k not in saved or (saved[k] == mine[k] and not (by_content and k in DATA_PATH_ARGS)):
            continue
        if k == "split" and per_split:  # per-split paths are used whole: --split orders nothing
            continue
        flag = f"--{k.replace('_', '-')}"
        if by_content and k in DATA_PATH_ARGS:
            here, there = _by_content(mine[k], mine[DATA_IDENTITY]), _by_content(saved[k], saved[DATA_IDENTITY])
            if here == there:
                if saved[k] != mine[k]:
                    moved.append(f"{flag} {show(mine[k])} here, {show(saved[k])} there")
                continue
            if saved[k] == mine[k]:
                changed = [p for p in mine[k] if mine[DATA_IDENTITY].get(p) != saved[DATA_IDENTITY].get(p)]
                differing.append(f"{flag} {show(mine[k])}: the files of {', '.join(changed)} changed since (other "
                                 "index contents)")
                continue
        differing.append(f"{flag} {show(mine[k])} here, {show(saved[k])} there")
    if moved:
        log.info("%s: the data moved (%s): the same contents (their index files and sizes), so this run goes on "
                 "where iteration %s stopped", source, "; ".join(moved), state.get("iteration"))
    if differing:
        log.warning("%s: iteration %s was trained on other data or in another sample order (%s): this run goes on "
                    "at sample %d of its own sample index, which is not where that run stopped (samples may be read "
                    "again or skipped%s); --finetune starts this data from its first sample with these weights",
                    source, state.get("iteration"), "; ".join(differing), consumed,
                    "" if by_content else "; the same files moved elsewhere are no change")


# what --no-load-optim keeps and drops (Megatron-LM's meaning: the learning-rate schedule is the optimizer's)
NO_LOAD_OPTIM = ("the run goes on from the saved step and data position with fresh Adam moments and a learning-rate "
                 "schedule started over, as in Megatron-LM")
_PRECISION_FLAGS = {"bf16": "--bf16", "fp16": "--fp16", "fp32": "neither --bf16 nor --fp16"}


def _check_optimizer_layout(args, source: str, it_dir: str) -> None:
    """Refuse optimizer state saved with the distributed optimizer on into a run with it off, or the reverse: the
    two keep Adam's moments in other layouts (sharded in ``distrib_optim.pt``, or whole in the rank file), and the
    load stopped with a bare ``KeyError`` that named neither."""
    saved = os.path.isfile(os.path.join(it_dir, rank_dir_name_here(), "distrib_optim.pt"))
    if saved == bool(args.use_distributed_optimizer):
        return
    was, now = ("with", "without") if saved else ("without", "with")
    raise CheckpointError(f"{source}: its optimizer state was saved {was} --use-distributed-optimizer, this run is "
                          f"{now} it (the two keep Adam's moments in other layouts): resume {was} "
                          "--use-distributed-optimizer (at any data-parallel size), or pass --no-load-optim "
                          f"({NO_LOAD_OPTIM}) or --finetune")


def _precision(args) -> str:
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def save_checkpoint(args, iteration, consumed_samples, model, optimizer, scheduler, writing=None) -> None:
    """``writing()``: a context around this rank's own file writes (no collective inside), which a signal's
    grace does not count (:meth:`~mindspeed_pack.runtime.exit_signal.ExitSignal.writing`)."""
    writing = writing or contextlib.nullcontext
    root = args.save
    final_dir = layout.iteration_dir(root, iteration)
    tmp_dir = final_dir + ".tmp"
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        for stale in glob.glob(os.path.join(root, "iter_*.tmp")):  # left by a crashed save
            layout.remove_tree(stale)
    dist.barrier()
    state = {
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "checkpoint_version": layout.CHECKPOINT_VERSION,
        "args": training_model_args(args),
        "tokenizer": hf_checkpoint.run_tokenizer_record(args),
        "precision": _precision(args),  # the optimizer state's layout depends on it
        "model": layout.model_state_for_save(model[0]),
        "data_order": _data_order(args),  # a resume with other data is warned about
    }
    state.update(lora.checkpoint_entries(args, state["model"]))  # LoRA: the adapters only, and their base
    if not args.no_save_optim:
        state["optimizer"] = optimizer.state_dict()
        state["opt_param_scheduler"] = scheduler.state_dict()
    if not args.no_save_rng:
        state["rng_state"] = _rng_states_by_dp_rank()  # a collective: every rank takes part
    rank_dir = os.path.join(tmp_dir, rank_dir_name_here())
    error = None
    try:
        if is_shard_writer():
            with writing():
                layout.save_file_atomic(state, os.path.join(rank_dir, "model_optim_rng.pt"), iteration)
        if args.use_distributed_optimizer and not args.no_save_optim:
            # the distributed optimizer's parameter state is sharded over data-parallel ranks
            optimizer.save_parameter_state(os.path.join(rank_dir, "distrib_optim.pt"))
        faults.fire("written", iteration, tmp_dir)
    except OSError as e:  # a full disk, a quota, a lost mount
        error = e
    if not all_ranks_ok(error):
        raise _save_failed(root, iteration, error, tmp_dir)
    error = None
    if dist.get_rank() == 0:
        try:
            with writing():
                _publish(root, iteration, final_dir, tmp_dir)
        except OSError as e:
            error = e
    if not all_ranks_ok(error):
        raise _save_failed(root, iteration, error, tmp_dir)
    if dist.get_rank() == 0:
        log.info("saved checkpoint at iteration %d to %s", iteration, root)


def _publish(root: str, iteration: int, final_dir: str, tmp_dir: str) -> None:
    """Rename the complete ``iter_N.tmp`` into place, then point the tracker at it (rank 0)."""
    old = final_dir + ".old"
    if os.path.isdir(final_dir):  # re-saving the same iteration: keep the old one until the new is in place
        layout.remove_tree(old)
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    _fsync_dir(root)
    faults.fire("renamed", iteration, final_dir)
    layout.write_tracker(root, iteration)
    _fsync_dir(root)
    faults.fire("tracker", iteration, root)
    layout.remove_tree(old)


def _iteration_dir_for_load(root: str, iteration, flag: str = "--load") -> str:
    """``iter_N``, or ``iter_N.old`` when a crash hit between the two renames of a re-save."""
    it_dir = layout.iteration_dir(root, iteration)
    if not os.path.isdir(it_dir) and os.path.isdir(it_dir + ".old"):
        log.warning("%s is missing but %s.old is complete (a re-save was interrupted): loading it", it_dir, it_dir)
        return it_dir + ".old"
    if not os.path.isdir(it_dir):
        raise CheckpointError(f"{flag} {root}: {layout.missing_iteration(root, iteration)}")
    return it_dir


def _warn_later_iterations(args, root: str, iteration, flag: str) -> None:
    """Rank 0 warns when ``root`` holds iterations later than its tracker's (:func:`layout.later_iterations`), and
    says what this run does to them: one it saves into ``root`` at its --save-interval or last iteration is saved over
    when the run reaches it; one it does not save stays, another trajectory's weights beside this run's."""
    later = layout.later_iterations(root, iteration)
    if not later or (dist.is_initialized() and dist.get_rank() != 0):
        return
    note = layout.later_iterations_note(root, iteration, later)
    if args.save and os.path.abspath(args.save) == os.path.abspath(root) and not getattr(args, "skip_train", False):
        interval, last = getattr(args, "save_interval", None), getattr(args, "train_iters", None) or 0
        saves = {name: n <= last and (n == last or bool(interval and n % interval == 0))
                 for name, n in ((name, int(name[len("iter_"):])) for name in later)}
        saved_over = [name for name in later if saves[name]]
        stays = [name for name in later if not saves[name]]
        them = "it" if len(saved_over) == 1 else "them"
        said = [f"this run saves over {', '.join(saved_over)} when it reaches {them}"] if saved_over else []
        if stays:
            said.append(f"{', '.join(stays)} {'stays' if len(stays) == 1 else 'stay'} beside this run's checkpoints "
                        f"(not an iteration it saves: --save-interval {interval}, --train-iters {last}), holding the "
                        f"other weights: remove {'it' if len(stays) == 1 else 'them'} if not wanted (rm -r "
                        f"{' '.join(os.path.join(root, name) for name in stays)})")
        note += "; " + "; ".join(said)
    log.warning("%s %s: %s", flag, root, note)


def _allow_unsafe(args) -> bool:
    """``--allow-unsafe-checkpoint-load`` (weights-only loads from model-shape namespaces have no such flag)."""
    return bool(getattr(args, "allow_unsafe_checkpoint_load", False))


def _saved_parallel_sizes(args, it_dir: str) -> tuple:
    try:
        return layout.parallel_sizes_in(it_dir, _allow_unsafe(args))
    except FileNotFoundError as e:
        raise CheckpointError(f"{it_dir}: no mp_rank_* directories; not a Megatron checkpoint") from e
    except (layout.UnsafeCheckpointError, layout.DistributedCheckpointError) as e:
        raise CheckpointError(str(e)) from None


def _read_file(args, root: str, path: str) -> dict:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: the checkpoint in {root} is incomplete")
    try:
        return layout.load_file(path, allow_unsafe=_allow_unsafe(args))
    except layout.UnsafeCheckpointError as e:
        raise CheckpointError(str(e)) from None
    except Exception as e:  # truncated or corrupt
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e}); the file is truncated or "
                              "corrupt: load an earlier iteration (edit the number in "
                              f"{os.path.join(root, layout.TRACKER)})") from e


def _read_rank_file(args, root: str, it_dir: str, saved_ep: int) -> tuple:
    """(path, record) of this rank's file. Saved at another expert-parallel size, the record's model
    is this rank's experts gathered from the files that hold them (every other tensor is the same in
    all of them); the rest of the record (optimizer, RNG) is the first such file's."""
    from mindspeed_pack.convert.sharding import expert_shard, experts_of_rank, merge_expert_shards

    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    if saved_ep == ep:
        path = os.path.join(it_dir, rank_dir_name_here(), "model_optim_rng.pt")
        return path, _read_file(args, root, path)
    mine = experts_of_rank(args.num_experts, ep_rank, ep)
    holders = [e for e in range(saved_ep) if set(experts_of_rank(args.num_experts, e, saved_ep)) & set(mine)]
    paths, models, record = [], {}, None
    for saved_rank in holders:
        path = os.path.join(it_dir, layout.rank_dir_name(*tp_pp_ranks(), saved_rank, saved_ep), "model_optim_rng.pt")
        loaded = _read_file(args, root, path)
        record = record or loaded
        models[saved_rank] = loaded["model"]
        paths.append(path)
    merged = merge_expert_shards(models, args.num_experts, saved_ep)
    record["model"] = expert_shard(merged, args.num_experts, ep_rank, ep)
    record["saved_expert_parallel_size"] = saved_ep
    return " + ".join(paths), record


def _check_shapes(path: str, module, state: dict, fresh=()) -> None:
    """Every tensor of ``state`` has the name and shape of the model built from the flags (what the recorded
    arguments cannot tell: checkpoints of other tools record other things). A LoRA run's checkpoint holds what
    it trains (its adapters, a reward model's score head), a base model no adapters; ``fresh`` names the
    parameters this load leaves as drawn."""
    adapters = lora.holds_adapters(state)
    held = lora.is_trained_name if adapters else (lambda k: not lora.is_adapter_name(k))
    expected = {k: v.shape for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)
                and not k.endswith("_extra_state") and held(k) and k not in fresh}
    if adapters and not lora.holds_adapters(expected):  # a model built without them
        raise CheckpointError(f"{path}: holds LoRA adapters only (a LoRA run's --save): pass their base as --load, "
                              "this checkpoint as --lora-load, and the LoRA flags they were trained with")
    for name, tensor in state.items():
        if name in expected and tuple(tensor.shape) != tuple(expected[name]):
            raise CheckpointError(f"{path}: tensor {name} has shape {tuple(tensor.shape)} in the checkpoint but "
                                  f"{tuple(expected[name])} in the model built from the flags: pass the model-shape "
                                  "flags the checkpoint was trained with")
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{path}: parameter names differ from the model built from the flags: missing "
                              f"{missing[:5]}, unexpected {unexpected[:5]}")


def _saved_iterations(root: str) -> list:
    """Names of complete-looking iteration directories (not a crashed save's ``.tmp``)."""
    return layout.held_iterations(root)


def refresh_master_weights(optimizer) -> None:
    """Copy freshly loaded model weights into the optimizer's fp32 master copy (Megatron-LM does this too).

    Under --bf16/--fp16 the optimizer, built before the load, holds fp32 copies of the *initial*
    weights; its first step would write them back over the loaded ones. (A full resume loads the
    master copy from the checkpoint instead.) Every megatron optimizer kind has this method; for the
    fp32 optimizer it is a no-op.
    """
    optimizer.reload_model_params()


def load_distributed_parameter_state(optimizer, path: str) -> None:
    """The distributed optimizer's sharded fp32 masters and Adam moments, back from ``path``.

    Works around gaps of megatron-core 0.16.1 when torch's Adam stands in for TE/Apex
    FusedAdam (always on a CPU): torch's Adam keeps a per-parameter ``step`` that the saved
    file does not hold, yet the loader copies into every per-parameter state (the step comes
    back with ``load_state_dict``: it is set aside here and restored); ``load_state_dict``
    gives every parameter the *same* step tensor, which torch's Adam then increments once
    per parameter (each gets its own copy here); and in fp32 the main params are views of
    the model's leaf parameters, so the copies need ``no_grad``.
    """
    set_aside = []
    for leaf in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        for state in leaf.optimizer.state.values():
            if "step" in state:
                set_aside.append((state, state.pop("step")))
    try:
        with torch.no_grad():
            optimizer.load_parameter_state(path)
    finally:
        for state, step in set_aside:
            state["step"] = step.clone()


def _check_tokenizer(args, record, source: str, policy: bool) -> None:
    """The checkpoint's tokenizer against this run's; a run that knows none takes the policy checkpoint's."""
    run_record = hf_checkpoint.run_tokenizer_record(args)
    hf_checkpoint.check_data_tokenizer(args, run_record)
    identity.check_tokenizer(record, run_record, source)
    if policy and run_record is None:
        args.tokenizer_record = record  # the model's tokenizer: what this run's checkpoints record in turn


def load_hf_weights(args, path: str, module, flag: str = "--load") -> None:
    """The weights of Hugging Face directory ``path`` into ``module``, each rank reading only its own slice,
    one unit at a time (:func:`~mindspeed_pack.checkpoint.hf_checkpoint.read_rank_units`), after the model and
    tokenizer checks of every load."""
    source = f"{flag} {path}"
    model_args = hf_checkpoint.hf_model_args(args, path, flag)
    identity.check_model_settings(vars(model_args), args, source, os.path.join(path, "config.json"))
    _check_tokenizer(args, read_tokenizer_record(path), source, policy=flag == "--load")
    fresh = _fresh_head(identity.check_model_head(bool(getattr(model_args, "reward_head", False)), args, source),
                        source)
    expected = {k: v.shape for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}
    loaded = {}  # name -> a shape-only stand-in, for the final check
    for unit in hf_checkpoint.read_rank_units(args, path, flag):  # one unit in memory at a time
        weights = layout.to_backend_names(_without_output_layer(unit) if fresh else unit, module.attention_backend,
                                          expected)
        loaded.update({k: torch.empty(v.shape, device="meta") for k, v in weights.items()})
        if any(k in expected and tuple(v.shape) != tuple(expected[k]) for k, v in weights.items()):
            break  # named by the check below
        module.load_state_dict(weights, strict=False)
    _check_shapes(path, module, loaded, fresh)


def _fresh_head(fresh: bool, source: str) -> tuple:
    """The parameters a load leaves as drawn: a reward model's score head, when the checkpoint is a language model."""
    if not fresh:
        return ()
    log.info("%s is a language model: its output layer is not loaded, the reward model's score head starts from "
             "its seeded draw", source)
    return (MG_SCORE,)


def _without_output_layer(state: dict) -> dict:
    return {k: v for k, v in state.items() if k != MG_OUTPUT}


def _load_hf_weights(args, model, optimizer):
    """``--load HF_DIR``: training starts at iteration 0."""
    load_hf_weights(args, args.load, model[0].module)
    refresh_master_weights(optimizer)
    args.loaded_model_type_hf = args.model_type_hf
    log.info("loaded Hugging Face weights from %s: iteration 0", args.load)
    return 0, 0


def load_weights(args, root: str, module, flag: str = "--load", step=None) -> tuple:
    """The model weights of Megatron checkpoint ``root`` (its tracked iteration, or iteration ``step``) into
    ``module``, checked against this run's TP/PP layout, model flags and tokenizer; returns (iteration, its
    directory, rank file, state). ``flag`` (``--load``, ``--ref-load``, ``--lora-load``) names the checkpoint in
    errors; ``step`` comes with the flag that picked it (``--refer-model-iter``), else ``--ckpt-step`` picks
    ``--load``'s."""
    source = f"{flag} {root}"
    if not os.path.isdir(root):
        raise CheckpointError(f"{source}: no such directory")
    try:
        iteration = layout.read_tracker(root)
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None
    if iteration is None:
        found = _saved_iterations(root)
        hint = (f"; it holds {', '.join(found[-3:])}: write the iteration to load into {layout.TRACKER}"
                if found else "; nor is it a Hugging Face model (config.json and *.safetensors)")
        hint = layout.inside_checkpoint(root) or hint
        raise CheckpointError(f"{source}: no checkpoint found ({layout.TRACKER} is missing){hint}")
    picked_by = "--refer-model-iter" if step is not None else "--ckpt-step"
    # Megatron-LM's --ckpt-step picks --load's iteration instead of the tracked one
    if step is None and flag == "--load" and root == getattr(args, "load", None):
        step = getattr(args, "ckpt_step", None)
    if step is not None:
        if not os.path.isdir(layout.iteration_dir(root, step)):
            raise CheckpointError(f"{picked_by} {step}: {layout.iteration_dir(root, step)} does not exist; {root} "
                                  f"holds {', '.join(_saved_iterations(root)) or 'no iteration'}")
        iteration = step
    else:
        _warn_later_iterations(args, root, iteration, flag)
    it_dir = _iteration_dir_for_load(root, iteration, flag)
    saved_tp, saved_pp, saved_ep = _saved_parallel_sizes(args, it_dir)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ep = getattr(args, "expert_model_parallel_size", 1)  # weights-only loads: model-shape namespaces too
    if (saved_tp, saved_pp) != (tp, pp):
        raise CheckpointError(
            f"{source}: checkpoint saved at TP={saved_tp}, PP={saved_pp} but this run uses TP={tp}, PP={pp}; "
            f"reshard it first: python convert_ckpt.py --load-model-type mg --save-model-type mg --load-dir {root} "
            f"--save-dir NEW_DIR --target-tensor-parallel-size {tp} --target-pipeline-parallel-size {pp}"
            + (f" --target-expert-parallel-size {ep}" if getattr(args, "num_experts", None) else "")
            + ("; it keeps the adapters' optimizer state and data position (a PEFT export loads at any layout too, "
               "as weights)" if flag == "--lora-load" else
               "; a model's reshard is its weights alone (iteration 0: its optimizer state, schedule and data "
               "position stay with this layout), a start for --finetune; to continue this run, resume at "
               f"TP={saved_tp}, PP={saved_pp}"))
    if saved_ep != ep and not getattr(args, "num_experts", None):
        raise CheckpointError(f"{source}: checkpoint saved with expert parallelism (EP={saved_ep}) but this run "
                              "has no --num-experts: pass the model flags it was trained with")
    path, state = _read_rank_file(args, root, it_dir, saved_ep)
    saved_args = layout.args_of(state)
    window = saved_args.get("sliding_window")
    if window is not None and args.seq_length > window:
        raise CheckpointError(f"{path}: the model's sliding_window={window} (config.json) is below --seq-length "
                              f"{args.seq_length}: the model attends to the whole sample, so train with "
                              f"--seq-length <= {window}")
    identity.check_model_settings(saved_args, args, source, path)
    fresh = _fresh_head(identity.check_model_head(bool(saved_args.get("reward_head")), args, source), source)
    if fresh and iteration != layout.RELEASE and not getattr(args, "finetune", False):
        raise CheckpointError(f"{source}: a language model's training checkpoint cannot be resumed as a reward model "
                              "(its optimizer state has no score head): pass --finetune to start the reward model "
                              "from its weights")
    _check_tokenizer(args, state.get("tokenizer"), source, policy=flag in POLICY_FLAGS)
    # a Megatron-LM run under Transformer Engine saves TE's fused layer-norm names and _extra_state entries
    model = layout.to_canonical_names(state["model"])
    model = _without_output_layer(model) if fresh else model
    weights = layout.to_backend_names(model, module.attention_backend, module.state_dict().keys())
    _check_shapes(path, module, weights, fresh)
    module.load_state_dict(weights, strict=False)
    return iteration, it_dir, path, state


def load_adapter_weights(path: str, module, state: dict, fresh=()) -> None:
    """LoRA adapters (this rank's, canonical names; read from ``path``) into ``module``, checked name by name and
    shape by shape against the model built from the flags (``fresh``: the parameters ``state`` may lack, kept)."""
    weights = layout.to_backend_names(state, module.attention_backend, module.state_dict().keys())
    _check_shapes(path, module, weights, fresh)
    module.load_state_dict(weights, strict=False)


def load_model_weights(args, path: str, module, flag: str, step=None) -> None:
    """A frozen model's weights (``--ref-load``): a Megatron checkpoint (its tracked iteration, or ``step``:
    ``--refer-model-iter``) or a Hugging Face directory, through the loaders and checks of ``--load``."""
    if hf_io.looks_like_hf(path):
        if step is not None:
            raise CheckpointError(f"--refer-model-iter {step} picks an iteration of a Megatron checkpoint, but the "
                                  f"reference {flag} {path} is a Hugging Face directory (one set of weights): drop "
                                  "--refer-model-iter")
        hf_io.check_hf_dir(path, flag, CheckpointError)
        load_hf_weights(args, path, module, flag)
    else:
        load_weights(args, path, module, flag, step=step)


def uncommitted_iterations(root: str, flag: str) -> list:
    """The iteration directories of ``root``, which has no tracker (the tracker is a save's commit point).

    A first save killed between its rename and its tracker leaves one, never committed, which the run
    saves over. Two or more complete iterations without a tracker are damage (the file was removed),
    not a first save: refused, naming the latest and how to resume from it."""
    found = _saved_iterations(root) if os.path.isdir(root) else []
    if len(found) > 1:
        numbers = [int(name[len("iter_"):]) for name in found]
        raise CheckpointError(
            f"{flag} {root} holds complete iterations {', '.join(map(str, numbers))} but no {layout.TRACKER}: the "
            "file was removed or lost (an interrupted first save leaves one iteration, not several), and starting "
            f"over would overwrite them; to resume from the latest, iteration {numbers[-1]}, write its number into "
            f"the file (echo {numbers[-1]} > {os.path.join(root, layout.TRACKER)}) and run again; to start over in "
            "it, pass --overwrite-output-dir")
    return found


def first_launch(args, root: Optional[str] = None, finetune: Optional[bool] = None) -> bool:
    """``--load D --save D`` with no checkpoint in D yet: the run starts from scratch (initialised as without
    ``--load``, so the first launch trains what a run without it would)."""
    root = root or args.load
    finetune = args.finetune if finetune is None else finetune
    same_as_save = bool(args.save and root) and os.path.abspath(args.save) == os.path.abspath(root)
    return same_as_save and not finetune and not os.path.exists(os.path.join(root, layout.TRACKER)) \
        and not os.path.isdir(os.path.join(root, layout.RELEASE))


def load_checkpoint(args, model, optimizer, scheduler, root=None, flag: str = "--load", weights_only=None):
    """Restore from ``--load`` (or ``root``, named ``flag`` in messages: a LoRA run's ``--lora-load``, a run's
    own ``--save``); returns (iteration, consumed_samples). ``weights_only`` (default ``--finetune``): the
    weights alone, at iteration 0 with a fresh optimizer.

    ``--load D --save D`` on a first launch (D empty or absent, or holding only a first save that
    died before its tracker was written) starts from scratch, so a job script can always pass both;
    any other ``--load`` without a checkpoint is an error.
    """
    if root is None and args.load_format == "hf":
        return _load_hf_weights(args, model, optimizer)
    finetune = args.finetune if weights_only is None else weights_only
    root = args.load if root is None else root
    if first_launch(args, root, finetune):
        uncommitted = uncommitted_iterations(root, f"{flag} (= --save)")
        if getattr(args, "exit_on_missing_checkpoint", False):
            raise CheckpointError(f"{flag} {root} (= --save) holds no checkpoint yet and --exit-on-missing-checkpoint "
                                  "is given: stopping instead of starting from scratch")
        log.warning("%s %s (= --save) holds no checkpoint yet%s: starting from scratch", flag, root,
                    f" ({', '.join(uncommitted)} without {layout.TRACKER}: an interrupted first save)"
                    if uncommitted else "")
        return 0, 0
    iteration, it_dir, path, state = load_weights(args, root, model[0].module, flag)
    args.loaded_model_type_hf = recorded_family(layout.args_of(state).get("model_type_hf"))
    args.loaded_sliding_window = layout.args_of(state).get("sliding_window")
    release = iteration == layout.RELEASE
    if finetune or release or args.no_load_optim:
        refresh_master_weights(optimizer)
    if finetune or release:
        log.info("loaded weights from %s (%s): iteration reset to 0", root, "release" if release else "finetune")
        return 0, 0
    consumed = state.get("consumed_samples", layout.args_of(state).get("consumed_train_samples"))  # Megatron-LM's
    if consumed is None:  # another tool's (MindSpeed-LLM's converter writes iteration 1): Megatron-LM reads 0
        log.info("%s records no consumed samples: iteration %d reads the data from its start, as Megatron-LM does",
                 path, iteration + 1)
    consumed = int(consumed or 0)
    _warn_other_data(args, f"{flag} {root}", state, consumed)
    if args.no_load_optim:  # MindSpeed-LLM's scripts pass it always: its resume is then not the uninterrupted run
        log.warning("%s %s: --no-load-optim: resuming at iteration %d with fresh Adam moments and the learning-rate "
                    "schedule started over (warmup again), as in Megatron-LM; drop the flag to go on as the "
                    "uninterrupted run would", flag, root, iteration)
    if not args.no_load_optim and "optimizer" not in state and args.no_save_optim:
        # the run saves no optimizer state (--no-save-optim), so its own resume finds none: fresh moments, the
        # schedule stepped to the saved position (a function of the samples consumed), not started over
        log.warning("%s holds no optimizer state (--no-save-optim): resuming at iteration %d with fresh Adam moments "
                    "(the losses differ from an uninterrupted run's) and the learning-rate schedule at its saved step",
                    path, iteration)
        refresh_master_weights(optimizer)
        scheduler.step(increment=consumed)
    elif not args.no_load_optim:
        saved_ep = state.get("saved_expert_parallel_size")
        if saved_ep is not None:
            raise CheckpointError(
                f"{flag} {root}: checkpoint saved at --expert-model-parallel-size {saved_ep}, this run uses "
                f"{args.expert_model_parallel_size}: its weights are regrouped on load but its optimizer state is "
                f"not; resume at --expert-model-parallel-size {saved_ep}, or pass --no-load-optim ({NO_LOAD_OPTIM}) "
                "or --finetune")
        if "optimizer" not in state:
            raise CheckpointError(f"{path}: no optimizer state saved (--no-save-optim); pass --no-save-optim (resume "
                                  "with fresh Adam moments, the schedule at its saved step), --no-load-optim "
                                  f"({NO_LOAD_OPTIM}) or --finetune")
        saved = state.get("precision")
        if saved is not None and saved != _precision(args):
            raise CheckpointError(f"{flag} {root}: its optimizer state was saved by a {saved} run, this run is "
                                  f"{_precision(args)}: resume with the precision flag it was saved with "
                                  f"({_PRECISION_FLAGS[saved]}), or pass --no-load-optim ({NO_LOAD_OPTIM}) or "
                                  "--finetune")
        _check_optimizer_layout(args, f"{flag} {root}", it_dir)
        try:
            optimizer.load_state_dict(state["optimizer"])
        except (KeyError, ValueError, IndexError, RuntimeError) as e:  # a checkpoint older than its precision record
            raise CheckpointError(f"{flag} {root}: its optimizer state does not fit this run's optimizer "
                                  f"({type(e).__name__}: {e}): it was saved with other --bf16/--fp16, LoRA or "
                                  f"optimizer flags; resume with them, or pass --no-load-optim ({NO_LOAD_OPTIM}) or "
                                  "--finetune") from None
        if args.use_distributed_optimizer:
            load_distributed_parameter_state(optimizer, os.path.join(it_dir, rank_dir_name_here(), "distrib_optim.pt"))
        scheduler.load_state_dict(state["opt_param_scheduler"])
    if not args.no_load_rng:
        if "rng_state" in state:
            _restore_rng(state["rng_state"], path, args)
        elif state.get("resharded_from"):  # convert_ckpt.py's reshard of a LoRA run's checkpoint
            log.warning("%s was resharded from %s, whose RNG states belong to that layout's ranks and were not "
                        "carried: dropout draws start afresh from --seed", path, state["resharded_from"])
        else:
            log.warning("%s holds no RNG state (--no-save-rng): dropout will not continue exactly", path)
    log.debug("loaded %s at iteration %d", root, iteration)  # the trainer logs the resume once
    return int(state["iteration"]), consumed

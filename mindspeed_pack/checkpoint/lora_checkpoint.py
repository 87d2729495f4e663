"""A LoRA run's checkpoints: the frozen base it adapts, identified by content, and its adapters.

``--load BASE`` (a Hugging Face directory or a Megatron checkpoint) is always loaded as weights
only, at iteration 0, and fingerprinted by content (its weight files sampled, in parallel over the ranks:
:func:`mindspeed_pack.convert.adapters.fingerprint` gives the same value;
:func:`~mindspeed_pack.convert.adapters.file_digest` says what it reads).
``--save`` then writes a checkpoint in Megatron's layout holding the adapters only, with their
optimizer state, the schedule, RNG states and data position, and a ``lora`` record: the LoRA
settings and the base (path and fingerprint) (:func:`mindspeed_pack.model.lora.checkpoint_entries`).
``--lora-load DIR`` resumes from it exactly (with ``--finetune``: its adapters only, at iteration 0),
after checking that the flags are its LoRA settings and that ``--load`` is its base (or a reshard of it:
:func:`mindspeed_pack.convert.adapters.check_base`). Loading itself is the ordinary checkpoint code
(:mod:`.save_load`); at another layout, ``convert_ckpt.py`` reshards the checkpoint first
(:mod:`mindspeed_pack.convert.adapter_reshard`).

``--lora-load PEFT_DIR`` (``adapter_config.json`` + ``adapter_model.safetensors``: the export's format, or
PEFT's own) starts from those adapters at any layout, as weights (iteration 0, like ``--finetune``): each
rank takes its slice with the base linears' sharding rules. Its settings are the flags'
(:mod:`mindspeed_pack.config.peft_flags` fills or checks them at parse time); its base is checked against
``--load`` by the fingerprint this project's export records, else by ``base_model_name_or_path`` when that
is a local directory.
"""
from __future__ import annotations

import logging
import os
import time

import torch.distributed as dist

from mindspeed_pack.checkpoint import save_load
from mindspeed_pack.checkpoint.errors import CheckpointError
from mindspeed_pack.checkpoint.rank_files import rank_dir_name_here
from mindspeed_pack.convert import adapters
from mindspeed_pack.convert import megatron_layout as layout
from mindspeed_pack.convert.model_specs import ConversionError
from mindspeed_pack.model import lora

log = logging.getLogger(__name__)


def _fingerprint(path: str, flag: str) -> str:
    """:func:`mindspeed_pack.convert.adapters.fingerprint` of ``path``, every rank hashing some of its files."""
    start = time.perf_counter()
    files = adapters.base_files(path)
    if not files:
        raise CheckpointError(f"{flag} {path}: no model files to fingerprint")
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {f: adapters.file_digest(os.path.join(path, f)) for f in files[rank::world]}
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    fingerprint = adapters.combine({k: v for part in gathered for k, v in part.items()})
    log.info("LoRA base %s %s: content fingerprint %s (%d files sampled over %d ranks in %.1f s)", flag, path,
             adapters.short(fingerprint), len(files), world, time.perf_counter() - start)
    return fingerprint


def base_record(args) -> dict:
    """The base ``--load``: its path, content fingerprint and, for a Megatron checkpoint, the fingerprints of the
    checkpoints it was resharded from and the HF directory it was converted from (the PEFT export's base)."""
    record = {"path": os.path.abspath(args.load), "format": getattr(args, "load_format", None) or "mg",
              "fingerprint": _fingerprint(args.load, "--load")}
    if record["format"] == "mg":
        record.update(adapters.lineage(args.load))  # one read of the base's rank file
    return record


def _rank_record(root: str):
    """(path, record) of this rank's file of checkpoint ``root``; (None, None) when there is none to check
    (the checkpoint loader then says why, or starts from scratch on a first ``--lora-load D --save D``)."""
    try:
        iteration = layout.read_tracker(root) if os.path.isdir(root) else None
    except ValueError:
        return None, None
    if iteration is None:
        return None, None
    path = os.path.join(layout.iteration_dir(root, iteration), rank_dir_name_here(), "model_optim_rng.pt")
    if not os.path.isfile(path):
        return None, None
    try:
        return path, layout.load_file(path, mmap=True)
    except Exception:  # unreadable: the loader names it
        return None, None


def _refuse_adapters_as_base(args) -> None:
    if getattr(args, "load_format", None) == "hf":
        return
    path, record = _rank_record(args.load)
    if record is not None and record.get("lora") is not None:
        base = (record["lora"].get("base") or {}).get("path")
        raise CheckpointError(f"--load {args.load} holds LoRA adapters (a LoRA run's --save), not a base model: pass "
                              f"their base{f' ({base})' if base else ''} as --load and {args.load} as --lora-load")


def _check_adapter_record(args, root: str, flag: str) -> None:
    """``--lora-load`` (or the run's own ``--save``): a LoRA checkpoint of these settings, trained on this base."""
    path, record = _rank_record(root)
    if record is None:
        return
    saved = record.get("lora")
    if saved is None:
        raise CheckpointError(f"{flag} {root}: {path} holds no LoRA adapters (a full model's checkpoint): pass "
                              "it as --load instead")
    mine = lora.settings_from_args(args).record()
    flags = {"r": "--lora-r", "alpha": "--lora-alpha", "targets": "--lora-target-modules",
             "rslora": "--lora-use-rslora"}
    differ = [f"{name}: checkpoint {saved.get(k)}, flags {mine[k]}" for k, name in flags.items()
              if saved.get(k) != mine[k]]
    if differ:
        raise CheckpointError(f"{flag} {root}: the LoRA flags differ from the checkpoint's ({'; '.join(differ)}): "
                              "pass the flags it was trained with")
    _check_base(saved, f"{flag} {root}", args)


def _check_base(saved: dict, where: str, args) -> None:
    base = args.lora_base
    try:
        adapters.check_base(saved, args.load, base["fingerprint"], where,
                            same_here=base.get(adapters.SAME_WEIGHTS_AS, ()))
    except ConversionError as e:
        raise CheckpointError(str(e)) from None


def _check_peft_base(args, peft: dict) -> None:
    """A PEFT directory's base: this project's export records it (checked as a checkpoint's is); PEFT's own
    ``base_model_name_or_path`` is checked by content when it is a local directory other than ``--load``."""
    where = f"--lora-load {args.lora_load}"
    if peft["base"] is not None:
        _check_base({"base": peft["base"]}, where, args)
        return
    named = peft["base_model_name_or_path"]
    if named and os.path.abspath(named) == os.path.abspath(args.load):
        return
    if named and os.path.isdir(named):
        base = args.lora_base  # --load, or what it was converted from, is the directory named
        same = adapters.same_base({_fingerprint(named, f"{where}: base_model_name_or_path")}, args.load,
                                  base["fingerprint"], base.get(adapters.SAME_WEIGHTS_AS, ()))
        if same is None:
            log.warning("%s: --load %s records its lineage by a fingerprint of an older version: whether it holds "
                        "the weights of %s (adapter_config.json's base) cannot be checked", where, args.load, named)
        elif not same:
            raise CheckpointError(f"{where}: adapter_config.json names the base {named}, whose content differs from "
                                  f"--load {args.load}'s: pass --load {named} (or that model's exact copy)")
        return
    log.warning("%s: adapter_config.json names the base %r, which is no local directory: the adapters cannot be "
                "checked against --load %s", where, named, args.load)


def _load_peft(args, model, optimizer) -> None:
    """``--lora-load PEFT_DIR``: this rank's slice of its adapters into the model, as weights."""
    from megatron.core import parallel_state as ps

    from mindspeed_pack.convert.sharding import shard_state_dict

    root = args.lora_load
    try:
        peft = adapters.read_peft_settings(root)
        full = adapters.read_peft_adapters(root)
        if peft["layers"] != args.num_layers:
            raise ConversionError(f"{os.path.join(root, adapters.ADAPTER_WEIGHTS)}: adapters of {peft['layers']} "
                                  f"layers, this model has {args.num_layers}")
        _check_peft_base(args, peft)
        head = bool(getattr(args, "reward_head", False))
        if peft["trained_in_full"] and not head:
            raise ConversionError(f"holds a reward model's score head ({', '.join(peft['trained_in_full'])}, its "
                                  "modules_to_save) beside the adapters: train it on with --stage orm")
        tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
        local = shard_state_dict(full, args, ps.get_tensor_model_parallel_rank(), tp,
                                 ps.get_pipeline_model_parallel_rank(), pp)
    except ConversionError as e:
        raise CheckpointError(f"--lora-load {root}: {e}") from None
    fresh = tuple(k for k in lora.TRAINED_IN_FULL if head and k not in peft["trained_in_full"])
    save_load.load_adapter_weights(os.path.join(root, adapters.ADAPTER_WEIGHTS), model[0].module, local, fresh)
    save_load.refresh_master_weights(optimizer)
    log.info("loaded the PEFT adapters of %s (r=%d, %s%s): iteration 0", root, peft["r"], " ".join(peft["projections"]),
             "; the reward model's score head from its modules_to_save" if peft["trained_in_full"] else
             "; it holds no score head: the reward model's head is --load's (or its seeded draw)" if head else "")


def load_checkpoint(args, model, optimizer, scheduler, adapters_root=None):
    """The base (weights only), then the adapters and training state of ``--lora-load`` (a PEFT directory: its
    adapters only; or ``adapters_root``, the run's own ``--save`` it resumes from); returns (iteration,
    consumed_samples) as :func:`.save_load.load_checkpoint` does."""
    _refuse_adapters_as_base(args)
    save_load.load_checkpoint(args, model, optimizer, scheduler, weights_only=True)  # the base: iteration 0
    args.lora_base = base_record(args)
    root, flag = (adapters_root, "--save") if adapters_root else (args.lora_load, "--lora-load")
    if not root:
        return 0, 0
    if not adapters_root and adapters.is_peft_dir(root):
        _load_peft(args, model, optimizer)
        return 0, 0
    _check_adapter_record(args, root, flag)
    return save_load.load_checkpoint(args, model, optimizer, scheduler, root=root, flag=flag,
                                     weights_only=False if adapters_root else None)

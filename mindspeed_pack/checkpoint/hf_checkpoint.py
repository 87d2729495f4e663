"""Train straight from a Hugging Face model directory, and write one at the end.

``--load HF_DIR`` (a directory with ``config.json`` and ``*.safetensors``, or any directory
with ``--load-format hf``) needs no offline ``convert_ckpt.py`` step:

1. before the flags are validated, :func:`mindspeed_pack.config.hf_flags.apply_hf_flags` derives the
   model's shape from config.json with the converter's own
   :func:`~mindspeed_pack.convert.model_specs.args_from_hf_config`: a flag the user also passed must agree
   (the error names both values), the rest are filled in;
2. at load, every rank reads only its own TP/PP slice (:func:`rank_units`): the rows or
   columns of each HF tensor that its shard holds, through ``safe_open(...).get_slice``, then
   the converter's weight map (``hf_to_mg_unit``) turns them into that rank's Megatron tensors.
   No rank ever holds the full model, nor a full tensor that TP splits, nor another expert-parallel
   rank's experts;
3. the run starts at iteration 0 with a fresh optimizer (``--finetune`` semantics).

``--save-hf DIR`` writes a transformers-loadable model when training ends: every TP x PP
shard is written as a weights-only Megatron checkpoint next to DIR, then rank 0 merges it
with the converter (``megatron_to_hf``: the same weight map, one unit at a time, into a
temporary directory renamed onto DIR when complete) and copies the tokenizer files. That
temporary (``.DIR.tmp-HOST-PID``) of an export killed midway is removed when the next run starts.
The export records the iteration it holds and the ``--save`` of its run (``mindspeed_pack_export.json``): a
resume of that run writes none again when it holds the last iteration, and replaces it when the run trains on.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import logging
import os
from typing import Callable, Dict, Iterator, Optional

import torch
from safetensors import SafetensorError

from mindspeed_pack.checkpoint.errors import CheckpointError
from mindspeed_pack.checkpoint.rank_files import is_shard_writer, rank_dir_name_here
from mindspeed_pack.convert import hf_io
from mindspeed_pack.convert.model_specs import (
    ConversionError,
    args_from_hf_config,
    get_spec,
    training_model_args,
)
from mindspeed_pack.convert.sharding import expert_shard, experts_of_rank, shard_state_dict, stage_units
from mindspeed_pack.convert.tokenizer_record import (
    describe,
    disagreement,
    has_tokenizer,
    read_tokenizer_record,
    recorded_directory,
)
from mindspeed_pack.convert.weight_map import check_hf_tensors, hf_to_mg_unit, hf_unit_shapes
from mindspeed_pack.model import lora
from mindspeed_pack.runtime.disk import disk_full_message, is_disk_full, tree_bytes
from mindspeed_pack.runtime.peers import all_ranks_ok
from mindspeed_pack.runtime.stale_files import remove_stale_temporaries

log = logging.getLogger(__name__)

MERGE_TIMEOUT_MINUTES = 240  # how long the other ranks wait for rank 0's --save-hf merge
EXPORT_RECORD = "mindspeed_pack_export.json"  # in an export: {"iteration": N, "save": the run's --save}

# --------------------------------------------------------------------------- which --load
def loads_hf(args) -> bool:
    return getattr(args, "load_format", None) == "hf"  # weights-only loads: model-shape namespaces too


# --------------------------------------------------------------------------- one rank's slice
def _tp_local_args(model: argparse.Namespace, tp: int) -> argparse.Namespace:
    """What one tensor-parallel rank holds, described as a model of its own.

    Heads, query groups, FFN width and the padded vocabulary are divided by ``tp`` (the
    vocabulary counts its padded rows). Run through the converter's weight map on a rank's
    slices of the HF tensors, these arguments give exactly that rank's shard, because every
    split megatron makes is a contiguous range of one HF tensor: fused QKV rows are grouped
    per query group, the SwiGLU gate and up halves are split separately, row-parallel
    weights by columns (:mod:`mindspeed_pack.convert.sharding`).
    """
    local = copy.copy(model)
    local.num_attention_heads //= tp
    local.num_query_groups //= tp
    local.ffn_hidden_size //= tp
    if getattr(local, "moe_ffn_hidden_size", None):  # each expert's MLP is split like the dense one
        local.moe_ffn_hidden_size //= tp
    local.padded_vocab_size //= tp
    local.vocab_size = local.padded_vocab_size
    local.tensor_model_parallel_size = 1
    return local


def _slice_plan(unit, model, local, spec, tp_rank: int, tp: int) -> Dict[str, Optional[tuple]]:
    """HF tensor name -> ``(dim, start, stop)`` of this rank's part, or None when it needs all of it.

    The split dimension is the one where the rank's shape (``local``) is ``1/tp`` of the full
    shape with the vocabulary padded; the stop is clipped to the stored rows (padding rows
    are zeros added by the weight map).
    """
    full = copy.copy(model)
    full.vocab_size = model.padded_vocab_size
    full_shapes, local_shapes = hf_unit_shapes(unit, full, spec), hf_unit_shapes(unit, local, spec)
    plan = {}
    for name, shape in full_shapes.items():
        dims = [d for d, (a, b) in enumerate(zip(shape, local_shapes[name])) if a != b]
        if not dims:
            plan[name] = None
            continue
        if len(dims) != 1 or shape[dims[0]] != local_shapes[name][dims[0]] * tp:
            raise ConversionError(f"{name}: no contiguous tensor-parallel split from shape {tuple(shape)} to "
                                  f"{tuple(local_shapes[name])}")
        dim, width = dims[0], local_shapes[name][dims[0]]
        plan[name] = (dim, tp_rank * width, (tp_rank + 1) * width)
    return plan


def rank_units(open_reader: Callable[[], hf_io.HFCheckpointReader], model: argparse.Namespace, tp_rank: int,
               tp: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> Iterator[Dict[str, torch.Tensor]]:
    """Rank ``(tp_rank, pp_rank, ep_rank)``'s Megatron tensors (canonical names), one unit at a time.

    ``model`` is the converter's argument namespace at this TP/PP (:func:`mindspeed_pack.config.hf_flags.fill_model_args`).
    Together the units equal ``shard_state_dict`` of the offline conversion's full tensors.
    Each unit is read through a reader opened for it and closed after it, so the file pages a
    rank touched are unmapped unit by unit: a rank holds its model shard plus one unit's slice.
    """
    spec = get_spec(model.model_type_hf)
    local = _tp_local_args(model, tp)
    for unit in stage_units(model, pp_rank, pp):
        plan = _slice_plan(unit, model, local, spec, tp_rank, tp)
        with open_reader() as reader:

            def get(name, plan=plan, reader=reader):
                part = plan.get(name)
                if part is None:
                    return reader.get(name)
                dim, start, stop = part
                stored = reader.shape(name)[dim]
                return reader.get_range(name, dim, min(start, stored), min(stop, stored)).contiguous()

            mine = experts_of_rank(model.num_experts, ep_rank, ep) if ep > 1 else None  # only its experts are read
            yield expert_shard(shard_state_dict(hf_to_mg_unit(unit, get, local, spec, mine), local, 0, 1, pp_rank, pp),
                               model.num_experts, ep_rank, ep)


def rank_state_dict(open_reader, model, tp_rank: int, tp: int, pp_rank: int, pp: int) -> Dict[str, torch.Tensor]:
    """All of :func:`rank_units` in one dictionary."""
    out: Dict[str, torch.Tensor] = {}
    for tensors in rank_units(open_reader, model, tp_rank, tp, pp_rank, pp):
        out.update(tensors)
    return out


def hf_model_args(args, path: str, flag: str = "--load", config: Optional[dict] = None) -> argparse.Namespace:
    """The converter's arguments for the HF model in ``path`` at this run's layout (vocabulary padded as the run's)."""
    try:
        config = config if config is not None else hf_io.read_config(path)
        return args_from_hf_config(config, None, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                   args.make_vocab_size_divisible_by, args.padded_vocab_size,
                                   where=os.path.join(path, hf_io.CONFIG), seq_length=args.seq_length,
                                   ep=getattr(args, "expert_model_parallel_size", 1))
    except ConversionError as e:
        raise CheckpointError(f"{flag} {path}: {e}") from None


def read_rank_units(args, path: Optional[str] = None, flag: str = "--load") -> Iterator[Dict[str, torch.Tensor]]:
    """This rank's weights from the HF directory ``path`` (default ``args.load``), unit by unit (canonical names).

    Every tensor's name and shape is checked against config.json first (file headers only).
    """
    from megatron.core import parallel_state as ps

    path = path or args.load
    tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    try:
        with hf_io.HFCheckpointReader(path) as reader:
            model = hf_model_args(args, path, flag, reader.config)
            spec = get_spec(model.model_type_hf)
            check_hf_tensors(reader, model, spec)
        yield from rank_units(lambda: hf_io.HFCheckpointReader(path), model,
                              ps.get_tensor_model_parallel_rank(), tp, ps.get_pipeline_model_parallel_rank(), pp,
                              ps.get_expert_model_parallel_rank(), ep)
    except ConversionError as e:
        raise CheckpointError(f"{flag} {path}: {e}") from None


# --------------------------------------------------------------------------- --save-hf
def _data_prefixes(args) -> list:
    paths = list(getattr(args, "data_path", None) or getattr(args, "train_data_path", None) or [])  # RL sessions: none
    out = []
    for p in paths:
        try:
            float(p)  # a blend weight
        except ValueError:
            out.append(p)
    return out


def tokenizer_dir(args) -> Optional[str]:
    """Where the tokenizer of this run lives: the data's extended ``P_tokenizer/`` (it holds the
    template's added tokens), else ``--tokenizer-name-or-path``, else the HF ``--load`` directory."""
    from mindspeed_pack.datasets.packed_documents import read_meta

    candidates = []
    for prefix in _data_prefixes(args)[:1]:
        extended = (read_meta(prefix) or {}).get("extended_tokenizer")
        if extended:
            candidates.append(os.path.join(os.path.dirname(os.path.abspath(prefix)), extended["path"]))
    candidates += [getattr(args, "tokenizer_name_or_path", None), args.load if loads_hf(args) else None]
    found = next((path for path in candidates if has_tokenizer(path)), None)
    # a resume from --load SAVE: the tokenizer its checkpoint recorded, where it still is with the same vocabulary
    return found or recorded_directory(getattr(args, "tokenizer_record", None))


def run_tokenizer_record(args) -> Optional[dict]:
    """The record (:mod:`~mindspeed_pack.convert.tokenizer_record`) of the tokenizer this run's ids come from:
    :func:`tokenizer_dir`'s, read once, else the one the ``--load`` checkpoint recorded; None when unknown.
    Checkpoints this run saves record it; loaded checkpoints are checked against it."""
    if not hasattr(args, "tokenizer_record"):
        args.tokenizer_record = read_tokenizer_record(tokenizer_dir(args))
    return args.tokenizer_record


def check_data_tokenizer(args, run_record: Optional[dict]) -> None:
    """Refuse data whose ids another tokenizer wrote than this run's (its sidecar names the directory): the run's
    tokenizer is the HF ``--load`` directory's unless told, and a checkpoint is checked against that one only."""
    from mindspeed_pack.datasets.packed_documents import data_prefixes, read_meta

    if run_record is None or getattr(args, "data_tokenizer_checked", False):
        return
    args.data_tokenizer_checked = True
    seen = set()
    for prefix in data_prefixes(args):  # a validation set of another tokenizer evaluates wrong too
        meta = read_meta(prefix) or {}
        path = meta.get("tokenizer_path")
        if meta.get("extended_tokenizer") or not has_tokenizer(path) or os.path.abspath(path) == run_record["source"]:
            continue  # an extended P_tokenizer/ is the run's; a tokenizer gone (or a .model file) cannot be read
        if os.path.abspath(path) in seen:
            continue
        seen.add(os.path.abspath(path))
        data = read_tokenizer_record(path)
        why = data and disagreement(data, run_record)
        if why:
            raise CheckpointError(f"the data {prefix} were tokenized with another tokenizer than this run's ({why}): "
                                  f"the data's is {describe(data)}; this run's is {describe(run_record)}; preprocess "
                                  "the data with this run's tokenizer, or train a model of the data's")


def _export_args(args) -> dict:
    """The model-shape arguments a saved checkpoint records, with the defaults the flags left open."""
    out = training_model_args(args)
    if out["vocab_size"] is None:  # only --padded-vocab-size given: every row is a real row
        out["vocab_size"] = args.padded_vocab_size
    if out["kv_channels"] is None:
        out["kv_channels"] = args.hidden_size // args.num_attention_heads
    return out


def check_exportable(args) -> None:
    """Refuse ``--save-hf`` before training when the model is not one the converter writes.

    The model's arguments go through the converter both ways (to a transformers config and
    back): any field that does not come back (LayerNorm, learned positions, no SwiGLU, ...)
    would be lost in the HF model.
    """
    from mindspeed_pack.convert.model_specs import settings_lost, spec_for_args

    mine = _export_args(args)
    try:
        spec = get_spec(mine["model_type_hf"]) if mine["model_type_hf"] else spec_for_args(args)
        lost = settings_lost(mine, spec, where=f"--save-hf ({spec.hf_architecture})")
    except ConversionError as e:
        raise CheckpointError(f"--save-hf {args.save_hf}: {e}") from None
    if lost:
        raise CheckpointError(f"--save-hf {args.save_hf}: this model cannot be written as a Hugging Face "
                              f"{spec.hf_architecture}: {'; '.join(lost)}; drop --save-hf and keep the Megatron "
                              "checkpoint (--save)")


def remove_killed_exports(args) -> None:
    """Before training, on rank 0 (the rank that writes the export): the temporary directory of an export to
    ``--save-hf`` that was killed before its rename (the whole model) is removed, not kept through training; a
    replacement killed midway leaves the previous export in place. Every rank calls it."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        out_dir = os.path.abspath(args.save_hf)
        remove_stale_temporaries(out_dir, f"--save-hf {args.save_hf}")
        from mindspeed_pack.convert import megatron_layout as layout

        aside = os.path.join(os.path.dirname(out_dir), f".{os.path.basename(out_dir)}.replaced")
        if os.path.isdir(aside) and not os.path.exists(out_dir):  # killed between the swap's two renames
            os.rename(aside, out_dir)
        for leftover in (_replacement_dir(out_dir), aside):  # a replacement killed before its swap
            layout.remove_tree(leftover)
    dist.barrier()  # every rank then sees the export as it is


def _weights_record(args, model) -> dict:
    """One shard for the merge; a LoRA run's holds its adapters only (a PEFT export) or the base and the
    adapters (``--lora-merge``), with the adapters' settings."""
    from mindspeed_pack.convert import megatron_layout as layout
    from mindspeed_pack.model.lora import checkpoint_entries

    state = layout.model_state_for_save(model[0])
    record = {"model": state, "args": _export_args(args), "iteration": 0,
              "checkpoint_version": layout.CHECKPOINT_VERSION, "hf_config": getattr(args, "hf_config", None)}
    adapters = checkpoint_entries(args, state)
    if adapters:
        record["lora"] = adapters["lora"]
        if not args.lora_merge:
            record["model"] = adapters["model"]
    return record


def exports_adapters(args) -> bool:
    """Whether this run's export is a PEFT adapter directory (a LoRA run without --lora-merge)."""
    return lora.trains_adapters(args) and not args.lora_merge


def save_hf(args, model, out_dir: Optional[str] = None, iteration: Optional[int] = None,
            replace: bool = False) -> None:
    """Write the trained model as a Hugging Face directory ``out_dir`` (default ``--save-hf``).

    Each TP x PP shard (one data-parallel replica) goes to a weights-only Megatron
    checkpoint next to the output; rank 0 merges it through the converter, so the HF
    tensors come from the same weight map as ``convert_ckpt.py``. The output is complete or
    absent; the staging files are removed either way. A LoRA run writes a PEFT adapter directory
    (only the adapters are staged), or with ``--lora-merge`` the model with its adapters merged.
    ``iteration``: recorded in the export (:data:`EXPORT_RECORD`); ``replace``: ``out_dir`` holds this run's
    export of an earlier iteration, removed once the new one is staged.
    """
    import torch.distributed as dist

    from mindspeed_pack.convert import megatron_layout as layout
    from mindspeed_pack.convert.convert import megatron_to_hf, megatron_to_peft

    out_dir = os.path.abspath(out_dir or args.save_hf)
    staging = os.path.join(os.path.dirname(out_dir), f".{os.path.basename(out_dir)}.megatron-staging")
    if dist.get_rank() == 0:
        layout.remove_tree(staging)
    dist.barrier()
    error = None
    try:
        if is_shard_writer():  # one writer per TP x PP (x EP) shard
            layout.save_file_atomic(_weights_record(args, model), os.path.join(
                layout.iteration_dir(staging, layout.RELEASE), rank_dir_name_here(), "model_optim_rng.pt"))
    except OSError as e:
        error = e
    ok = all_ranks_ok(error)
    # the merge runs on rank 0 alone and may outlast the collective timeout: the others wait on a
    # CPU group of their own with a long one
    wait_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(
        minutes=max(MERGE_TIMEOUT_MINUTES, args.distributed_timeout_minutes)))
    tokenizer = tokenizer_dir(args)
    needed = 0  # about the export's size: the staged weights (the merge writes them once more, in the export dtype)
    if ok and dist.get_rank() == 0:
        try:
            needed = tree_bytes(staging)
            layout.write_tracker(staging, layout.RELEASE)
            # this run's export of an earlier iteration (trainer.run checked the record) stays until the new one is
            # whole beside it: then the two are swapped
            target = _replacement_dir(out_dir) if replace else out_dir
            if replace:
                layout.remove_tree(target)
            if exports_adapters(args):
                base = args.lora_base
                megatron_to_peft(staging, target, _dtype_name(args), base["path"] if base["format"] == "hf" else None,
                                 tokenizer_dir=tokenizer)
            else:
                megatron_to_hf(staging, target, _dtype_name(args), tokenizer_dir=tokenizer)
            if iteration is not None:
                _write_export_record(target, args, iteration)
            if replace:
                _swap_in(target, out_dir)
        except (OSError, ConversionError, SafetensorError) as e:  # every rank must hear of it, not wait it out
            error = e
        finally:
            layout.remove_tree(staging)
    elif dist.get_rank() == 0:
        layout.remove_tree(staging)
    merge_failed = torch.tensor([int(dist.get_rank() == 0 and error is not None)])
    dist.all_reduce(merge_failed, group=wait_group)
    dist.destroy_process_group(wait_group)
    if merge_failed.item() or not ok:
        if error is not None and is_disk_full(error):
            raise CheckpointError(disk_full_message("--save-hf", out_dir, needed or tree_bytes(args.save or out_dir))
                                  + "; nothing was written there, the --save checkpoints are intact")
        raise CheckpointError(f"--save-hf {out_dir}: writing the Hugging Face model failed"
                              + (f": {error}" if error else " on another rank") + "; nothing was written there")
    if dist.get_rank() == 0 and exports_adapters(args):
        log.info("wrote PEFT adapter directory %s (peft.PeftModel.from_pretrained(base, DIR); --lora-merge writes "
                 "the merged model instead)", out_dir)
    elif dist.get_rank() == 0:
        log.info("wrote Hugging Face model %s%s", out_dir,
                 f" (tokenizer from {tokenizer})" if tokenizer else " (no tokenizer files found to copy: pass "
                 "--tokenizer-name-or-path)")


def holds_adapters(path: str) -> bool:
    """Whether the export in ``path`` is a PEFT adapter directory."""
    return os.path.isfile(os.path.join(path, "adapter_config.json"))


def looks_like_export(path: str) -> bool:
    """A transformers model or PEFT adapter directory (what an export writes)."""
    return hf_io.looks_like_hf(path) or holds_adapters(path)


def export_record(path: str) -> Optional[dict]:
    """What the export in ``path`` records of itself (:data:`EXPORT_RECORD`); None for a directory no run wrote
    (or an export written before the record was)."""
    try:
        with open(os.path.join(path, EXPORT_RECORD)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("iteration"), int) else None


def _write_export_record(out_dir: str, args, iteration: int) -> None:
    record = {"iteration": int(iteration), "save": os.path.abspath(args.save) if args.save else None}
    tmp = os.path.join(out_dir, f".{EXPORT_RECORD}.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, os.path.join(out_dir, EXPORT_RECORD))


def _replacement_dir(out_dir: str) -> str:
    return os.path.join(os.path.dirname(out_dir), f".{os.path.basename(out_dir)}.replacement")


def _swap_in(new: str, out_dir: str) -> None:
    """``new`` (a whole export) in place of the export ``out_dir``: the old one moved aside, then removed."""
    from mindspeed_pack.convert import megatron_layout as layout

    aside = os.path.join(os.path.dirname(out_dir), f".{os.path.basename(out_dir)}.replaced")
    layout.remove_tree(aside)
    if os.path.lexists(out_dir):  # (gone if someone removed it during training: the new one simply goes in)
        os.rename(out_dir, aside)
    os.rename(new, out_dir)
    layout.remove_tree(aside)


def _dtype_name(args) -> str:
    return "bf16" if args.bf16 else ("fp16" if args.fp16 else "fp32")

"""A LoRA run's checkpoint (its ``--save``) at another TP/PP/EP layout, to resume there.

``convert_ckpt.py --load-model-type mg --save-model-type mg --load-dir SAVE`` of an adapter checkpoint
writes the same iteration at the target layout with what a resume reads:

=========================================  ==========================================================
the adapters                               merged and split with their base linears' rules
                                           (:mod:`.sharding`): exact
Adam's per-parameter state (``exp_avg``,   elementwise, so merged and split with its parameter's
``exp_avg_sq``; under bf16/fp16 the fp32   rule: exact
master copy)
each parameter's step count, the param     the same on every rank: copied (the step counts checked
group's settings, the grad scaler          equal)
iteration, consumed samples, schedule,     layout-free: copied
LoRA record (settings, base), tokenizer
RNG states                                 one per rank of the old layout: not carried (the full
                                           reshard carries none either); the resumed run draws dropout
                                           afresh from ``--seed`` and says so at load
=========================================  ==========================================================

Megatron numbers an optimizer's parameters in the model's parameter order, group by group; the
adapters (2-D, no weight-decay exemption) make one group, in the order of the rank file's ``model``
entries; each state tensor's shape is checked against its parameter's. Megatron's distributed
optimizer keeps the moments in flat buffers laid out by the old layout's gradient buckets
(``distrib_optim.pt``), and a chained optimizer is a list of several: both are refused by name.
Adapter checkpoints are small (the adapters and about twice as much optimizer state), so the whole
checkpoint is merged in memory.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Dict, List

import torch

from mindspeed_pack.convert import megatron_layout as layout
from mindspeed_pack.convert.model_specs import ConversionError, args_to_dict
from mindspeed_pack.convert.sharding import layer_offset, merge_state_dicts, shard_state_dict

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
MASTER = "fp32_master"  # the mixed-precision optimizer's fp32 copy, one more per-parameter tensor here
RESHARDED_FROM = "resharded_from"  # the record's note of the layout it was resharded from (the RNG message)


@dataclass
class Plan:
    iteration: object  # an int, or "release"
    records: Dict[tuple, dict]  # (tp_rank, pp_rank, ep_rank) -> the rank file's record


def _global_name(name: str, offset: int) -> str:
    m = _LAYER.match(name)
    return f"decoder.layers.{int(m.group(1)) + offset}.{m.group(2)}" if m else name


def _torch_state(optimizer, path: str, rank_dir: str) -> dict:
    """torch's optimizer state dict inside megatron's (the mixed-precision optimizer wraps it)."""
    where = f"{path}: optimizer state"
    if isinstance(optimizer, list):
        raise ConversionError(f"{where} of a chained optimizer ({len(optimizer)} optimizers): the converter "
                              "reshards one optimizer over the adapters")
    inner = optimizer.get("optimizer", optimizer)
    if os.path.isfile(os.path.join(rank_dir, "distrib_optim.pt")) or "state" not in inner:
        raise ConversionError(
            f"{where} of megatron's distributed optimizer (--use-distributed-optimizer): its Adam moments are in "
            f"{os.path.join(rank_dir, 'distrib_optim.pt')}, flat buffers laid out by this layout's gradient "
            "buckets, which the converter cannot reshard. Resume at the saved layout, or start the new layout from "
            "the adapters alone: export them (convert_ckpt.py --load-model-type hf --load-dir BASE --lora-load "
            "SAVE --save-model-type hf --save-dir PEFT_DIR) and train with --lora-load PEFT_DIR (iteration 0)")
    return inner


def _per_parameter(record: dict, path: str) -> Dict[str, dict]:
    """Adapter name (local) -> its optimizer entries (``exp_avg``, ``exp_avg_sq``, ``step``, :data:`MASTER`)."""
    model, optimizer = record["model"], record.get("optimizer")
    if optimizer is None:
        return {}
    inner = _torch_state(optimizer, path, os.path.dirname(path))
    groups = [(i, g) for i, g in enumerate(inner["param_groups"]) if g["params"]]
    names = list(model)
    if len(groups) != 1 or len(groups[0][1]["params"]) != len(names):
        raise ConversionError(f"{path}: the optimizer's parameter groups hold {[len(g['params']) for _, g in groups]} "
                              f"parameters, the model {len(names)} adapter tensors in one group: not a LoRA run's "
                              "optimizer this converter knows")
    position, group = groups[0]
    masters = optimizer.get("fp32_from_fp16_params") if "optimizer" in optimizer else None
    out = {}
    for i, (index, name) in enumerate(zip(group["params"], names)):
        entries = dict(inner["state"].get(index, {}))
        if masters is not None:
            entries[MASTER] = masters[position][i]
        for key, value in entries.items():
            if isinstance(value, torch.Tensor) and value.dim() and tuple(value.shape) != tuple(model[name].shape):
                raise ConversionError(f"{path}: optimizer state {key} of parameter {index} has shape "
                                      f"{tuple(value.shape)}, but the model's parameter {index} ({name}) has "
                                      f"{tuple(model[name].shape)}: the state does not follow the model's order")
        out[name] = entries
    return out


def _elementwise(entries: dict, key: str) -> bool:
    value = entries[key]
    return isinstance(value, torch.Tensor) and value.dim() > 0


def plan(source, args) -> Plan:
    """The rank records of adapter checkpoint ``source`` (a :class:`~.convert.MegatronCheckpoint`) at the layout
    of ``args`` (its model arguments with the new parallel sizes and vocabulary), every input checked."""
    src = source.args
    first = source.rank_file(0, 0)
    models, states = {}, {}  # (tp, pp) -> local name -> tensor / optimizer entries (EP ranks hold the same)
    for pp_rank in range(source.pp):
        for tp_rank in range(source.tp):
            record = source.rank_file(tp_rank, pp_rank)
            path = source.files[(tp_rank, pp_rank, 0)]
            if record.get("iteration") != first.get("iteration") or (record.get("optimizer") is None) != (
                    first.get("optimizer") is None):
                raise ConversionError(f"{path}: its iteration or optimizer state differs from "
                                      f"{source.files[(0, 0, 0)]}'s: the checkpoint's ranks are of different saves")
            models[(tp_rank, pp_rank)] = record["model"]
            states[(tp_rank, pp_rank)] = _per_parameter(record, path)
    full = {"model": merge_state_dicts(models, src, source.tp, source.pp)}
    keys = sorted({k for rank in states.values() for e in rank.values() for k in e if _elementwise(e, k)})
    for key in keys:
        full[key] = merge_state_dicts({rank: {n: e[key] for n, e in s.items()} for rank, s in states.items()},
                                      src, source.tp, source.pp)
    constants: Dict[str, dict] = {}  # global name -> per-parameter values that are no tensors of its shape
    for (tp_rank, pp_rank), rank_states in states.items():
        offset = layer_offset(src.num_layers, pp_rank, source.pp)
        for name, entries in rank_states.items():
            values = {k: v for k, v in entries.items() if not _elementwise(entries, k)}
            seen = constants.setdefault(_global_name(name, offset), values)
            if any(not torch.equal(torch.as_tensor(seen[k]), torch.as_tensor(v)) for k, v in values.items()):
                raise ConversionError(f"{source.files[(tp_rank, pp_rank, 0)]}: the optimizer's {sorted(values)} of "
                                      f"{name} differ from tensor rank 0's")

    tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    saved_args = {**first["args"], **args_to_dict(args)}
    records = {}
    for pp_rank in range(pp):
        offset = layer_offset(args.num_layers, pp_rank, pp)
        for tp_rank in range(tp):
            shards = {k: shard_state_dict(v, args, tp_rank, tp, pp_rank, pp) for k, v in full.items()}
            record = {k: v for k, v in first.items() if k not in ("model", "optimizer", "rng_state", "args")}
            record.update(args=saved_args, model=shards["model"], **{RESHARDED_FROM: _layout(source)})
            if first.get("optimizer") is not None:
                record["optimizer"] = _optimizer(first["optimizer"], list(shards["model"]), shards, constants, offset)
            for ep_rank in range(ep):
                records[(tp_rank, pp_rank, ep_rank)] = record
    return Plan(source.iteration, records)


def _layout(source) -> str:
    return f"TP{source.tp} PP{source.pp} EP{source.ep}"


def _optimizer(template, names: List[str], shards: dict, constants: dict, offset: int):
    """Megatron's optimizer state dict of one target rank: ``template``'s (rank 0's) settings, one entry per
    adapter ``names`` (its local parameters, in order)."""
    inner = template.get("optimizer", template)
    state = {}
    for i, name in enumerate(names):
        entries = dict(constants.get(_global_name(name, offset), {}))
        entries.update({k: shard[name] for k, shard in shards.items() if k != "model" and name in shard})
        state[i] = entries
    adapter_group = next(i for i, g in enumerate(inner["param_groups"]) if g["params"])
    groups = [{**g, "params": list(range(len(names))) if i == adapter_group else []}
              for i, g in enumerate(inner["param_groups"])]
    masters = [state[i].pop(MASTER) for i in range(len(names))] if MASTER in shards else None
    new_inner = {**{k: v for k, v in inner.items() if k not in ("state", "param_groups")}, "state": state,
                 "param_groups": groups}
    if "optimizer" not in template:
        return new_inner
    out = {**template, "optimizer": new_inner}
    if masters is not None:
        out["fp32_from_fp16_params"] = [masters if i == adapter_group else [] for i in range(len(groups))]
    return out


def write(root: str, plan: Plan) -> None:
    """The planned rank files under ``root``, then the tracker."""
    for (tp_rank, pp_rank, ep_rank), record in plan.records.items():
        sizes = record["args"]
        path = layout.checkpoint_file(root, plan.iteration, tp_rank, pp_rank, sizes["pipeline_model_parallel_size"],
                                      ep_rank, sizes["expert_model_parallel_size"])
        layout.save_file_atomic(record, path)
    layout.write_tracker(root, plan.iteration)

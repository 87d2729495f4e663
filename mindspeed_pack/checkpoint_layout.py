"""Megatron's checkpoint directory layout, shared by training and the converter.

::

    SAVE/latest_checkpointed_iteration.txt       "N" (or "release" for converted weights)
    SAVE/iter_000000N/mp_rank_TT/model_optim_rng.pt          (PP = 1)
    SAVE/iter_000000N/mp_rank_TT_PPP/model_optim_rng.pt      (PP > 1)

Each file holds ``{"model": state_dict, "iteration", "args", "checkpoint_version", ...}``
with parameter names of megatron-core's *local* layer spec (the canonical names); the TE
spec's fused layer-norm names are mapped on load (:func:`to_backend_names`).
"""
from __future__ import annotations

import os
import re
import shutil
from typing import Dict

import torch

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0
RELEASE = "release"


def iteration_dir(root: str, iteration) -> str:
    name = RELEASE if iteration == RELEASE else f"iter_{int(iteration):07d}"
    return os.path.join(root, name)


def rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def checkpoint_file(root: str, iteration, tp_rank: int, pp_rank: int, pp_size: int) -> str:
    return os.path.join(iteration_dir(root, iteration), rank_dir_name(tp_rank, pp_rank, pp_size), "model_optim_rng.pt")


def read_tracker(root: str):
    """Return the iteration (int) or "release" named by the tracker file, or None."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if text == RELEASE:
        return RELEASE
    if not text.isdigit():
        raise ValueError(f"{path}: expected an iteration number or 'release', found {text!r}")
    return int(text)


def write_tracker(root: str, iteration) -> None:
    """Point the tracker at a complete checkpoint, atomically."""
    tmp = os.path.join(root, f".{TRACKER}.tmp")
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER))


def save_file_atomic(obj, path: str) -> None:
    """torch.save to a temporary name in the same directory, fsync, then rename."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def saved_parallel_sizes(root: str, iteration) -> tuple[int, int]:
    """(tp, pp) of a saved checkpoint, read from its rank directory names."""
    return parallel_sizes_in(iteration_dir(root, iteration))


def parallel_sizes_in(it_dir: str) -> tuple[int, int]:
    """(tp, pp) from the ``mp_rank_TT[_PPP]`` directories of one iteration directory."""
    tp_ranks, pp_ranks = set(), set()
    for name in os.listdir(it_dir):
        m = re.fullmatch(r"mp_rank_(\d{2})(?:_(\d{3}))?", name)
        if m:
            tp_ranks.add(int(m.group(1)))
            pp_ranks.add(int(m.group(2) or 0))
    if not tp_ranks:
        raise FileNotFoundError(f"{it_dir}: no mp_rank_* directories")
    return max(tp_ranks) + 1, max(pp_ranks) + 1


def remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


_TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}


def to_backend_names(state_dict: Dict[str, torch.Tensor], backend: str) -> Dict[str, torch.Tensor]:
    """Canonical (local spec) names -> the names of ``backend``'s modules."""
    if backend != "te":
        return state_dict
    out = {}
    for name, tensor in state_dict.items():
        for local, te in _TE_NAMES.items():
            if name.endswith(local):
                name = name[: -len(local)] + te
                break
        out[name] = tensor
    return out


def to_canonical_names(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`to_backend_names`; drops TE's ``_extra_state`` entries."""
    out = {}
    for name, tensor in state_dict.items():
        if name.endswith("_extra_state"):
            continue
        for local, te in _TE_NAMES.items():
            if name.endswith(te):
                name = name[: -len(te)] + local
                break
        out[name] = tensor
    return out


def model_state_for_save(model) -> Dict[str, torch.Tensor]:
    """A model chunk's weights under canonical names (DDP wrapper unwrapped)."""
    module = getattr(model, "module", model)
    return to_canonical_names({k: v for k, v in module.state_dict().items() if v is not None})

"""Megatron's checkpoint directory layout, shared by training and the converter.

::

    SAVE/latest_checkpointed_iteration.txt       "N" (or "release" for converted weights)
    SAVE/iter_000000N/mp_rank_TT/model_optim_rng.pt          (PP = 1)
    SAVE/iter_000000N/mp_rank_TT_PPP/model_optim_rng.pt      (PP > 1)
    SAVE/iter_000000N/mp_rank_TT[_PPP]_EEE/model_optim_rng.pt (expert parallel, EP > 1)

As Megatron-LM's ``get_checkpoint_name``: with EP > 1 the expert-parallel rank is appended,
and each file holds the non-expert weights plus that rank's experts under *local* indices
(``local_experts.j`` is global expert ``ep_rank * num_experts / EP + j``). ``mp_rank_TT_NNN``
is PP or EP: the file's ``args`` (``expert_model_parallel_size``) say which.

Each file holds ``{"model": state_dict, "iteration", "args", "checkpoint_version", ...}``
with parameter names of megatron-core's *local* layer spec (the canonical names); the TE
spec's fused layer-norm names are mapped on load (:func:`to_backend_names`).

Checkpoints are data, not code: every file is read by :func:`load_file`, a
``weights_only`` load that accepts tensors, plain containers and numbers, plus the short
allow-list of :func:`safe_globals`. A file asking for anything else (a pickle that would
run a command when read) is refused before any of it runs, unless the user vouches for it
with ``--allow-unsafe-checkpoint-load``.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import zipfile
from typing import Dict, Optional

import torch

from mindspeed_pack.runtime import faults

log = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
RUN_CONFIG = "run_config.yaml"  # beside the checkpoints: the resolved flags of the run that wrote them
CHECKPOINT_VERSION = 3.0
RELEASE = "release"


def iteration_dir(root: str, iteration) -> str:
    name = RELEASE if iteration == RELEASE else f"iter_{int(iteration):07d}"
    return os.path.join(root, name)


def rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int, ep_rank: int = 0, ep_size: int = 1) -> str:
    name = f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return name + (f"_{ep_rank:03d}" if ep_size > 1 else "")


def checkpoint_file(root: str, iteration, tp_rank: int, pp_rank: int, pp_size: int, ep_rank: int = 0,
                    ep_size: int = 1) -> str:
    return os.path.join(iteration_dir(root, iteration), rank_dir_name(tp_rank, pp_rank, pp_size, ep_rank, ep_size),
                        "model_optim_rng.pt")


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


@contextlib.contextmanager
def _atomic_file(path: str, tmp: str, mode: str):
    """Write ``tmp``, fsync, then rename it to ``path``; on any error ``tmp`` goes and ``path`` is untouched."""
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    os.replace(tmp, path)


def write_tracker(root: str, iteration) -> None:
    """Point the tracker at a complete checkpoint, atomically."""
    with _atomic_file(os.path.join(root, TRACKER), os.path.join(root, f".{TRACKER}.tmp"), "w") as f:
        f.write(str(iteration))


def save_file_atomic(obj, path: str, iteration: Optional[int] = None) -> None:
    """torch.save to a temporary name in the same directory, fsync, then rename.

    On any error (a full disk) the temporary file is removed and ``path`` is untouched.
    ``iteration`` lets a ``write@N`` fault (:mod:`mindspeed_pack.runtime.faults`) strike half-way.
    """
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    fault = faults.action_at("write", iteration)
    with _atomic_file(path, tmp, "wb") as f:
        if fault:
            buf = io.BytesIO()
            torch.save(obj, buf)
            f.write(buf.getbuffer()[: buf.tell() // 2])  # a half-written file, as a crash leaves it
            f.flush()
            os.fsync(f.fileno())
            faults.trigger(fault, "write", iteration, tmp)
        writer = _WriteErrorKeeper(f)
        try:
            torch.save(obj, writer)
        except RuntimeError:
            if writer.error is not None:  # torch turns a failed write into "unexpected pos ..."
                raise writer.error from None
            raise


class _WriteErrorKeeper:
    """A file wrapper that remembers why a write failed: an OSError (disk full, file too large), or the exception of
    a signal that came during it (SIGTERM's SystemExit, Ctrl-C), which torch would otherwise turn into its own
    "unexpected pos" error."""

    def __init__(self, f):
        self._f = f
        self.error: Optional[BaseException] = None

    def write(self, data) -> int:
        try:
            return self._f.write(data)
        except BaseException as e:
            if isinstance(e, OSError) and e.filename is None:
                e.filename = self._f.name
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self._f.flush()


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file that asks the unpickler for code, not data."""


class DistributedCheckpointError(ValueError):
    """An iteration saved in Megatron-LM's distributed format (its default ``--ckpt-format torch_dist``)."""


def distributed_format(it_dir: str) -> Optional[str]:
    """The ``--ckpt-format`` of a Megatron-LM distributed checkpoint in ``it_dir`` (``metadata.json``'s sharded
    backend, or its ``*.distcp`` files), None for any other directory."""
    try:
        with open(os.path.join(it_dir, "metadata.json"), encoding="utf-8") as f:
            return str(json.load(f).get("sharded_backend") or "torch_dist")
    except (OSError, ValueError, AttributeError):
        pass
    return "torch_dist" if os.path.isdir(it_dir) and any(n.endswith(".distcp") for n in os.listdir(it_dir)) else None


def refuse_distributed(it_dir: str) -> None:
    """Megatron-LM's distributed checkpoints hold no ``mp_rank_*`` files: named, with Megatron-LM's own way to
    re-save one in the per-rank format read here (it was 'no mp_rank_* directories; not a Megatron checkpoint')."""
    fmt = distributed_format(it_dir)
    if fmt:
        root = os.path.dirname(os.path.normpath(it_dir))
        raise DistributedCheckpointError(
            f"{it_dir} is a Megatron-LM distributed checkpoint (--ckpt-format {fmt}), which is not read here: only "
            "--ckpt-format torch (one model_optim_rng.pt per rank under mp_rank_*). Re-save it with Megatron-LM: its "
            f"training script with the run's flags and --load {root} --ckpt-convert-format torch --ckpt-convert-save "
            "NEW_DIR, then load NEW_DIR")


UNSAFE_FLAG = "--allow-unsafe-checkpoint-load"


def safe_globals() -> list:
    """The non-tensor types a checkpoint may hold beyond torch's ``weights_only`` defaults.

    This project saves only tensors, numbers, strings and plain containers, so it needs
    none of them; they are here for files written elsewhere: Megatron-LM / MindSpeed-LLM
    checkpoints (``args`` as an ``argparse.Namespace``, megatron-core enums, numpy RNG
    arrays: megatron-core's own list) and this project's older checkpoints (numpy RNG
    state as an array; now a list).
    """
    import argparse

    from megatron.core.safe_globals import SAFE_GLOBALS as MEGATRON_CORE_SAFE_GLOBALS

    return [argparse.Namespace, *MEGATRON_CORE_SAFE_GLOBALS]


def _refused_code(path: str, error: Exception) -> str:
    """What the safe loader refused in ``path``: "the global NAME" (names it imports), or the instruction."""
    m = re.search(r"GLOBAL ([\w.]+)", str(error))
    if m:
        return f"the global {m.group(1)}"
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:
        found = []
    allowed = {f"{g.__module__}.{g.__qualname__}" for g in safe_globals() if hasattr(g, "__qualname__")}
    found = [g for g in found if g not in allowed]
    if found:
        return ("the global " if len(found) == 1 else "the globals ") + ", ".join(found)
    detail = re.search(r"Unsupported [^\n]*", str(error))
    return "a pickle instruction that only a code-running loader accepts" + (f" ({detail.group(0)})" if detail else "")


def load_file(path: str, allow_unsafe: bool = False, mmap: bool = False):
    """Read one checkpoint file as data (``weights_only``); nothing in it can run.

    A file that needs another global raises :class:`UnsafeCheckpointError` naming the file
    and the global; with ``allow_unsafe`` (the user vouches for the file) it is loaded with
    full pickle instead, logged loudly. Other errors (a truncated file) propagate.
    """
    mmap = mmap and zipfile.is_zipfile(path)  # older (non-zip) torch files cannot be memory-mapped
    try:
        with torch.serialization.safe_globals(safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        needed = _refused_code(path, e)
        if not allow_unsafe:
            raise UnsafeCheckpointError(
                f"{path}: refused to load: the file asks for {needed}, which is code, not checkpoint data, and "
                "would run while the file is read (a crafted or foreign pickle). Nothing was loaded or executed. "
                f"If you trust where this file comes from, re-run with {UNSAFE_FLAG}, or re-save its tensors as "
                "safetensors") from None
        log.warning("!" * 80)
        log.warning("%s: %s: loading with full pickle although it asks for %s; this can run arbitrary code",
                    UNSAFE_FLAG, path, needed)
        log.warning("!" * 80)
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)


def saved_parallel_sizes(root: str, iteration) -> tuple[int, int, int]:
    """(tp, pp, ep) of a saved checkpoint, read from its rank directory names."""
    return parallel_sizes_in(iteration_dir(root, iteration))


def parallel_sizes_in(it_dir: str, allow_unsafe: bool = False) -> tuple[int, int, int]:
    """(tp, pp, ep) from the ``mp_rank_TT[_PPP][_EEE]`` directories of one iteration directory.

    A second number alone is the pipeline rank unless the checkpoint's args say it was saved
    with expert parallelism (Megatron-LM's names do not tell the two apart)."""
    ranks, with_ep = [], False
    for name in os.listdir(it_dir):
        m = re.fullmatch(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?", name)
        if m:
            ranks.append(tuple(int(g or 0) for g in m.groups()))
            with_ep = with_ep or m.group(3) is not None
    if not ranks:
        refuse_distributed(it_dir)
        raise FileNotFoundError(f"{it_dir}: no mp_rank_* directories")
    tp, second = max(r[0] for r in ranks) + 1, max(r[1] for r in ranks) + 1
    if with_ep:
        return tp, second, max(r[2] for r in ranks) + 1
    if second > 1 and _saved_expert_parallel_size(os.path.join(it_dir, "mp_rank_00_000", "model_optim_rng.pt"),
                                                  allow_unsafe) > 1:
        return tp, 1, second
    return tp, second, 1


def _saved_expert_parallel_size(path: str, allow_unsafe: bool) -> int:
    if not os.path.isfile(path):
        return 1
    return int(args_of(load_file(path, allow_unsafe=allow_unsafe, mmap=True) or {}).get("expert_model_parallel_size")
               or 1)


def args_of(record: dict) -> dict:
    """The arguments a checkpoint file records, as a dict (Megatron-LM's files hold a Namespace). Megatron-LM stores
    --disable-bias-linear under its dest, ``add_bias_linear``: read as ``disable_bias_linear``, or a --load of its
    checkpoint builds linear biases the file does not hold."""
    saved = record.get("args") or {}
    saved = saved if isinstance(saved, dict) else vars(saved)
    if "disable_bias_linear" not in saved and isinstance(saved.get("add_bias_linear"), bool):
        saved = {**saved, "disable_bias_linear": not saved["add_bias_linear"]}
    return saved


def first_rank_file(root: str, iteration=None) -> Optional[str]:
    """The first rank file (TP, PP and EP rank 0) of checkpoint ``root``'s tracked iteration (or ``iteration``: a
    --ckpt-step), whose ``args`` record the model it holds; None where ``root`` holds no tracked iteration (a first
    launch's ``--load D --save D``) or that iteration lacks the file, for the load to report.
    Raises ValueError for a tracker that names no iteration, or an iteration in Megatron-LM's distributed format."""
    if iteration is None:
        iteration = read_tracker(root) if os.path.isdir(root) else None
    if iteration is None:
        return None
    it_dir = iteration_dir(root, iteration)
    if not os.path.isdir(it_dir) and os.path.isdir(it_dir + ".old"):  # an interrupted re-save: the load takes it
        it_dir += ".old"
    first = sorted(n for n in os.listdir(it_dir) if re.fullmatch(r"mp_rank_00(?:_000){0,2}", n)) \
        if os.path.isdir(it_dir) else []
    if not first:
        refuse_distributed(it_dir)
    path = os.path.join(it_dir, first[0], "model_optim_rng.pt") if first else None
    return path if path and os.path.isfile(path) else None


def held_iterations(root: str) -> list:
    """Names of ``root``'s complete-looking iteration directories (not a crashed save's ``.tmp``), oldest first."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(n for n in names if re.fullmatch(r"iter_\d{7}", n) and os.path.isdir(os.path.join(root, n)))


def later_iterations(root: str, iteration) -> list:
    """``root``'s iteration directories later than ``iteration``, its tracker's, oldest first. The tracker is a save's
    commit point, so they are not the checkpoint: the tracker was set back by hand (to redo the last steps), or a
    save was killed between its rename and its tracker. Megatron-LM loads the tracked iteration and leaves them;
    a run saving into ``root`` saves over each one it reaches, and until then whoever takes the highest ``iter_*``
    (a script, a user) takes one of them."""
    if not isinstance(iteration, int):  # release
        return []
    return [name for name in held_iterations(root) if int(name[len("iter_"):]) > iteration]


def later_iterations_note(root: str, iteration, later: list) -> str:
    """What the load of ``root`` at its tracked ``iteration`` says about ``later`` (:func:`later_iterations`)."""
    tracker = os.path.join(root, TRACKER)
    newest = int(later[-1][len("iter_"):])
    return (f"{tracker} names iteration {iteration}, but {root} also holds the later {', '.join(later)} (the tracker "
            f"set back by hand, or a save killed before it wrote the tracker): iteration {iteration} is loaded, as "
            f"the tracker says (Megatron-LM's rule); to load iteration {newest} instead, write it into the tracker "
            f"(echo {newest} > {tracker})")


def inside_checkpoint(path: str) -> str:
    """A hint when ``path`` is an iteration directory of a checkpoint (or one of its rank directories), which a
    ``--load`` names by its root: '' otherwise."""
    path = os.path.normpath(os.path.abspath(path))
    if re.fullmatch(r"mp_rank_\d{2}(?:_\d{3}){0,2}", os.path.basename(path)):
        path = os.path.dirname(path)
    found = re.fullmatch(r"iter_(\d{7})", os.path.basename(path))
    if not found:
        return ""
    root, iteration = os.path.dirname(path), int(found.group(1))
    try:
        tracked = read_tracker(root)
    except ValueError:  # an unreadable tracker: name the iteration
        tracked = None
    step = "" if tracked == iteration else f" --ckpt-step {iteration}"
    return f"; it is iteration {iteration} of the checkpoint {root}: pass --load {root}{step}"


def missing_iteration(root: str, iteration) -> str:
    """Why ``root``'s tracker names nothing to load (its iteration directory is gone), and what to do: the load
    and the model flags read from the checkpoint say the same."""
    return f"{TRACKER} names iteration {iteration} but {iteration_dir(root, iteration)} does not exist; " \
        + other_iterations(root)


def other_iterations(root: str) -> str:
    """Which iterations ``root`` holds and how to load one of them instead of the tracked one."""
    held = held_iterations(root)
    return (f"{root} holds {', '.join(held)}: write the iteration to load into {os.path.join(root, TRACKER)}, or pass "
            "--ckpt-step N" if held else f"{root} holds no other iteration")


def remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


_TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}
# MoE experts under TE grouped GEMM (--moe-grouped-gemm): one GroupedLinear per fc, weight{j} per expert
_LOCAL_EXPERT = re.compile(r"^(.*\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_GROUPED_EXPERT = re.compile(r"^(.*\.experts\.)(linear_fc[12])\.weight(\d+)$")


def to_backend_names(state_dict: Dict[str, torch.Tensor], backend: str, names=None) -> Dict[str, torch.Tensor]:
    """Canonical (local spec) names -> the names of ``backend``'s modules. ``names``: the module's own
    parameter names; a name is renamed only into one of them (an MoE layer keeps its own
    ``pre_mlp_layernorm``: TE fuses that norm into ``linear_fc1`` in dense layers only)."""
    if backend != "te":
        return state_dict
    names = set(names) if names is not None else None
    out = {}
    for name, tensor in state_dict.items():
        candidates = [name[: -len(local)] + te for local, te in _TE_NAMES.items() if name.endswith(local)]
        expert = _LOCAL_EXPERT.match(name)
        if expert:
            candidates.append(f"{expert.group(1)}{expert.group(3)}.weight{expert.group(2)}")
        for candidate in candidates:
            if names is None or candidate in names:
                name = candidate
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
        grouped = _GROUPED_EXPERT.match(name)
        if grouped:
            name = f"{grouped.group(1)}local_experts.{grouped.group(3)}.{grouped.group(2)}.weight"
        out[name] = tensor
    return out


def model_state_for_save(model) -> Dict[str, torch.Tensor]:
    """A model chunk's weights under canonical names (DDP wrapper unwrapped)."""
    module = getattr(model, "module", model)
    return to_canonical_names({k: v for k, v in module.state_dict().items() if v is not None})

"""Reading and writing Hugging Face checkpoint directories, one tensor at a time.

Reading opens every ``*.safetensors`` file with ``safe_open`` (memory-mapped) and loads a
tensor only when asked, so a 7B model never sits in memory whole. Safetensors come first;
a directory with only ``pytorch_model*.bin`` weights is read through the safe
(``weights_only``, memory-mapped) load of :func:`~mindspeed_pack.convert.megatron_layout.load_file`,
so a crafted ``.bin`` runs nothing. Writing streams tensors
into shards of at most ``max_shard_bytes`` and names them like ``save_pretrained`` does
(``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` + index).
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mindspeed_pack.convert.model_specs import ConversionError

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
BIN_SINGLE_FILE = "pytorch_model.bin"
BIN_INDEX_FILE = "pytorch_model.bin.index.json"

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)


# --------------------------------------------------------------------------- which directory is HF
def _has_safetensors(path: str) -> bool:
    return any(name.endswith(".safetensors") for name in os.listdir(path))


def looks_like_hf(path: str) -> bool:
    """A directory holding HF files (config.json or safetensors) and no Megatron tracker."""
    from mindspeed_pack.convert.megatron_layout import TRACKER

    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, TRACKER)):
        return False
    return os.path.isfile(os.path.join(path, CONFIG)) or _has_safetensors(path)


def check_hf_dir(path: str, flag: str, error: type) -> None:
    """``path`` holds what direct loading reads (config.json, safetensors); ``flag`` names it in ``error``
    (the caller's error type: a flag's or a checkpoint's)."""
    if not os.path.isdir(path):
        raise error(f"{flag} {path}: no such directory")
    if not os.path.isfile(os.path.join(path, CONFIG)):
        raise error(f"{flag} {path}: no config.json; a Hugging Face model directory needs config.json "
                    "next to its *.safetensors weights")
    if not _has_safetensors(path):
        found = sorted(n for n in os.listdir(path) if n.endswith((".bin", ".pt", ".pth")))
        hint = f" (found {found[:3]}: re-save with save_pretrained(..., safe_serialization=True), or convert " \
               "it offline with convert_ckpt.py)" if found else ""
        raise error(f"{flag} {path}: no *.safetensors weights; direct loading reads each rank's slice "
                    f"from safetensors{hint}")


def read_config(model_dir: str) -> dict:
    if not os.path.isdir(model_dir):
        raise ConversionError(f"{model_dir}: not a directory")
    path = os.path.join(model_dir, CONFIG)
    if not os.path.isfile(path):
        raise ConversionError(f"{path}: missing; a Hugging Face model directory needs config.json next to its weights")
    try:
        with open(path) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path}: expected a JSON object, found {type(config).__name__}")
    return config


def _read_index(model_dir: str, index_name: str) -> Tuple[List[str], Dict[str, str]]:
    index_path = os.path.join(model_dir, index_name)
    try:
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ConversionError(f"{index_path}: unreadable index ({e!r}); expected {{'weight_map': {{name: file}}}}") from None
    files = sorted(set(weight_map.values()))
    absent = [f for f in files if not os.path.isfile(os.path.join(model_dir, f))]
    if absent:
        raise ConversionError(f"{index_path}: lists shard files that do not exist: {absent}")
    return files, weight_map


def _weight_files(model_dir: str) -> Tuple[List[str], Optional[Dict[str, str]], Optional[str]]:
    """The weight files to read, the index's name -> file map when sharded, and that index's name.

    ``*.safetensors`` when there are any; else ``pytorch_model*.bin`` (read safely).
    """
    if os.path.isfile(os.path.join(model_dir, INDEX_FILE)):
        return (*_read_index(model_dir, INDEX_FILE), INDEX_FILE)
    if os.path.isfile(os.path.join(model_dir, SINGLE_FILE)):
        return [SINGLE_FILE], None, None
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if files:
        return files, None, None
    if os.path.isfile(os.path.join(model_dir, BIN_INDEX_FILE)):
        return (*_read_index(model_dir, BIN_INDEX_FILE), BIN_INDEX_FILE)
    bins = sorted(f for f in os.listdir(model_dir) if f.startswith("pytorch_model") and f.endswith(".bin"))
    if bins:
        return bins, None, None
    others = sorted(f for f in os.listdir(model_dir) if f.endswith(".bin") or f.endswith(".pt"))
    hint = (f" (found {others[:3]}: weights are read from *.safetensors or pytorch_model*.bin; re-save with "
            "save_pretrained(..., safe_serialization=True))") if others else ""
    raise ConversionError(f"{model_dir}: no *.safetensors or pytorch_model*.bin weights{hint}")


def weight_files(model_dir: str) -> List[str]:
    """The files that hold a HF model's weights (with its index when sharded), as the reader reads them."""
    files, _, index_name = _weight_files(model_dir)
    return files + ([index_name] if index_name else [])


class _TorchBinFile:
    """A ``pytorch_model*.bin`` behind the part of safetensors' ``safe_open`` API the reader uses."""

    def __init__(self, path: str, allow_unsafe: bool):
        from mindspeed_pack.convert import megatron_layout as layout

        try:
            state = layout.load_file(path, allow_unsafe=allow_unsafe, mmap=True)
        except layout.UnsafeCheckpointError as e:
            raise ConversionError(str(e)) from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ConversionError(f"{path}: expected a dictionary of tensors (a state_dict)")
        self._state = state

    def keys(self):
        return list(self._state)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._state[name]

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self._state[name].shape)


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


class HFCheckpointReader:
    """Lazy access to the tensors of a HF model directory (single file or sharded)."""

    def __init__(self, model_dir: str, allow_unsafe: bool = False):
        self.model_dir = model_dir
        self.config = read_config(model_dir)
        files, index, index_name = _weight_files(model_dir)
        self.allow_unsafe = allow_unsafe
        self._handles = {}
        self._where: Dict[str, str] = {}
        self._unread: Dict[str, set] = {}  # see stream()
        for name in files:
            handle = self._handles[name] = self._open(name)
            for key in handle.keys():
                if key in self._where:
                    raise ConversionError(f"tensor {key!r} is stored twice: in {self._where[key]} and {name}")
                self._where[key] = name
        if index is not None:
            for key, fname in index.items():
                if self._where.get(key) != fname:
                    raise ConversionError(
                        f"{os.path.join(model_dir, index_name)}: maps {key!r} to {fname}, "
                        f"but that tensor is {'in ' + self._where[key] if key in self._where else 'absent'}"
                    )

    def _open(self, name: str):
        path = os.path.join(self.model_dir, name)
        if name.endswith(".bin"):
            try:
                return _TorchBinFile(path, self.allow_unsafe)
            except (RuntimeError, EOFError, pickle.UnpicklingError) as e:
                raise ConversionError(f"{path}: not a readable torch file ({e})") from None
        try:
            return safe_open(path, framework="pt")
        except Exception as e:  # safetensors raises its own error types
            raise ConversionError(f"{path}: not a readable safetensors file ({e})") from None

    def _handle(self, name: str):
        """The open file ``name`` (reopened if :meth:`stream` let it go)."""
        handle = self._handles.get(name)
        if handle is None:
            handle = self._handles[name] = self._open(name)
        return handle

    def stream(self, names: Iterable[str]) -> None:
        """From now on, let a weight file go once :meth:`get` has read every one of ``names`` it holds.

        An open file keeps every page read from it mapped, so a conversion held the whole model's pages until the
        end, on top of what it writes (a 70B model's 140 GB); let go, a file's pages are freed with the tensors read
        from it, when their stage is written. A file read again is reopened."""
        self._unread = {}
        for name in names:
            if name in self._where:
                self._unread.setdefault(self._where[name], set()).add(name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self):
        self._handles.clear()

    def keys(self) -> List[str]:
        return list(self._where)

    def file_of(self, name: str) -> str:
        return os.path.join(self.model_dir, self._where[name])

    def shape(self, name: str) -> Tuple[int, ...]:
        handle = self._handle(self._where[name])
        if isinstance(handle, _TorchBinFile):
            return handle.shape(name)
        return tuple(handle.get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        """The dtype ``name`` is stored in, read from the file's header (no tensor data)."""
        handle = self._handle(self._where[name])
        if isinstance(handle, _TorchBinFile):
            return handle.get_tensor(name).dtype
        stored = handle.get_slice(name).get_dtype()
        return _SAFETENSORS_DTYPES.get(stored) or getattr(torch, stored.lower(), torch.float32)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise ConversionError(f"{self.model_dir}: tensor {name!r} not found in the weight files")
        fname = self._where[name]
        tensor = self._handle(fname).get_tensor(name)
        unread = self._unread.get(fname)
        if unread is not None:
            unread.discard(name)
            if not unread:  # all read: its pages go with the tensors read from it
                del self._handles[fname]
        return tensor

    def get_range(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows (``dim`` 0) or columns (``dim`` 1) ``[start, stop)`` of a tensor; from safetensors
        only those bytes are read (``get_slice``), so a rank never loads another rank's part."""
        if name not in self._where:
            raise ConversionError(f"{self.model_dir}: tensor {name!r} not found in the weight files")
        handle = self._handle(self._where[name])
        if isinstance(handle, _TorchBinFile):  # memory-mapped: narrow touches only the range
            return handle.get_tensor(name).narrow(dim, start, stop - start).clone()
        piece = handle.get_slice(name)
        return piece[start:stop] if dim == 0 else piece[:, start:stop]

    def check_shapes(self, expected: Dict[str, Tuple[int, ...]], ignorable, assumed: str = "") -> None:
        """Every expected tensor present with its shape, and no unexplained extra tensor.

        ``assumed`` names the defaults filled in for fields config.json lacks: a wrong shape may come from one."""
        missing = [n for n in expected if n not in self._where]
        if missing:
            raise ConversionError(
                f"{self.model_dir}: {len(missing)} tensors the config implies are missing, e.g. {missing[:4]}"
            )
        for name, shape in expected.items():
            found = self.shape(name)
            if found != tuple(shape):
                raise ConversionError(
                    f"{self.file_of(name)}: tensor {name!r} has shape {list(found)}, but config.json implies "
                    f"{list(shape)}" + (f" ({assumed})" if assumed else "")
                )
        extra = [n for n in self._where if n not in expected and not ignorable(n)]
        if extra:
            raise ConversionError(
                f"{self.model_dir}: {len(extra)} tensors are not used by the conversion, e.g. {extra[:4]}; "
                "the weights do not match the architecture in config.json"
            )


class ShardedSafetensorsWriter:
    """Append tensors; they are written in shards of at most ``max_shard_bytes``."""

    def __init__(self, out_dir: str, max_shard_bytes: int = 5 * 1024**3):
        self.out_dir = out_dir
        self.max_shard_bytes = max_shard_bytes
        self._pending: Dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: List[List[str]] = []  # names per written shard
        self.total_bytes = 0
        os.makedirs(out_dir, exist_ok=True)

    def _part(self, i: int) -> str:
        return os.path.join(self.out_dir, f".part-{i:05d}.safetensors")

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().contiguous()
        self._pending_bytes += size
        self.total_bytes += size

    def add_all(self, tensors: Dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            self.add(name, tensor)

    def _flush(self) -> None:
        if not self._pending:
            return
        save_file(self._pending, self._part(len(self._shards)), metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> List[str]:
        """Write the last shard, give the shards their final names, write the index."""
        self._flush()
        n = len(self._shards)
        if n == 0:
            raise ConversionError("no tensors were written")
        if n == 1:
            os.replace(self._part(0), os.path.join(self.out_dir, SINGLE_FILE))
            return [SINGLE_FILE]
        names, weight_map = [], {}
        for i, tensor_names in enumerate(self._shards):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self._part(i), os.path.join(self.out_dir, fname))
            names.append(fname)
            weight_map.update({t: fname for t in tensor_names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(self.out_dir, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)
        return names


def tokenizer_files(tokenizer_dir: str) -> List[str]:
    """Tokenizer files present in ``tokenizer_dir``; an error if there are none."""
    if not os.path.isdir(tokenizer_dir):
        raise ConversionError(f"--tokenizer-dir {tokenizer_dir}: not a directory")
    found = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(tokenizer_dir, f))]
    if not found:
        raise ConversionError(f"--tokenizer-dir {tokenizer_dir}: none of {list(TOKENIZER_FILES)} found")
    return found


def copy_files(src_dir: str, names: Iterable[str], dst_dir: str) -> None:
    for name in names:
        shutil.copy2(os.path.join(src_dir, name), os.path.join(dst_dir, name))

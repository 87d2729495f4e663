"""LoRA adapters in the converter: Megatron's tensors <-> PEFT's, merged into HF weights, and their base.

Canonical adapter tensors (full, global layer ids) are the model's own parameters
(:mod:`mindspeed_pack.model.lora`): ``decoder.layers.{i}.{linear}.lora_A.{p}`` ``[r, in]`` and
``...lora_B.{p}`` ``[out_p, r]``, one pair per Hugging Face projection ``p``, B's rows in HF order.
The PEFT export is therefore a renaming through the weight map's module names::

    decoder.layers.3.self_attention.linear_qkv.lora_B.k_proj
        <->  base_model.model.model.layers.3.self_attn.k_proj.lora_B.weight

and a merged model adds ``scale * B @ A`` to each adapted projection's HF weight (computed in fp32).

The base an adapter was trained on is recorded as its path and a content fingerprint: sha256 over
the base's weight files (a HF directory's config.json and weight files, a Megatron checkpoint's
``model_optim_rng.pt`` files of its tracked iteration), checked wherever adapters meet a base again.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Dict, Iterable, List, Optional

import torch

from mindspeed_pack.convert import hf_io
from mindspeed_pack.convert import megatron_layout as layout
from mindspeed_pack.convert.model_specs import ConversionError
from mindspeed_pack.convert.weight_map import HF_MODULE, hf_projection
from mindspeed_pack.model.lora import ADAPTED_LINEARS, is_adapter_name

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."

_MG_ADAPTER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)\.lora_([AB])\.(\w+)$")
_PEFT_ADAPTER = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight$")


def _parse(name: str):
    m = _MG_ADAPTER.match(name)
    if m is None or m.group(2) not in ADAPTED_LINEARS or m.group(4) not in ADAPTED_LINEARS[m.group(2)]:
        raise ConversionError(f"{name!r} is not a LoRA adapter tensor of a known linear")
    return int(m.group(1)), m.group(2), m.group(3), m.group(4)


def to_peft(adapters: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Canonical adapter tensors -> PEFT's ``adapter_model.safetensors`` keys (same tensors)."""
    out = {}
    for name, tensor in adapters.items():
        layer, linear, ab, p = _parse(name)
        out[f"{PEFT_PREFIX}{hf_projection(layer, linear, p)}.lora_{ab}.weight"] = tensor
    return out


def from_peft(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`to_peft`."""
    owners = {hf: mg for mg, hf in HF_MODULE.items()}
    out = {}
    for key, tensor in tensors.items():
        m = _PEFT_ADAPTER.match(key)
        linear = None if m is None else next((lin for lin, parts in ADAPTED_LINEARS.items()
                                              if lin.split(".")[0] == owners.get(m.group(2)) and m.group(3) in parts),
                                             None)
        if linear is None:
            raise ConversionError(f"PEFT tensor {key!r} is not a LoRA adapter of a projection this model adapts")
        out[f"decoder.layers.{m.group(1)}.{linear}.lora_{m.group(4)}.{m.group(3)}"] = tensor
    return out


def adapted_projections(adapters: Iterable[str]) -> List[str]:
    """HF module names of the projections that carry an adapter (PEFT's ``target_modules``), sorted."""
    return sorted({hf_projection(layer, linear, p) for layer, linear, _, p in map(_parse, adapters)})


def merge_into_hf(hf: Dict[str, torch.Tensor], adapters: Dict[str, torch.Tensor], scale: float
                  ) -> Dict[str, torch.Tensor]:
    """HF tensors of a unit with ``scale * B @ A`` added to each adapted projection's weight."""
    pairs = {}
    for name, tensor in adapters.items():
        layer, linear, ab, p = _parse(name)
        pairs.setdefault(hf_projection(layer, linear, p), {})[ab] = tensor
    out = dict(hf)
    for projection, ab in pairs.items():
        weight = projection + ".weight"
        if weight not in out or set(ab) != {"A", "B"}:
            raise ConversionError(f"LoRA adapter of {projection}: needs its lora_A and lora_B and the base weight "
                                  f"{weight}; found {sorted(ab)}" + ("" if weight in out else " and no base weight"))
        base = out[weight]
        out[weight] = (base.float() + scale * (ab["B"].float() @ ab["A"].float())).to(base.dtype)
    return out


def scale_of(record: dict) -> float:
    r = record["r"]
    return float(record["alpha"]) / (r ** 0.5 if record.get("rslora") else r)


def peft_config(record: dict, target_modules: List[str], base_model: Optional[str]) -> dict:
    """``adapter_config.json``: what ``peft.PeftModel.from_pretrained`` needs (the rest are PEFT's defaults)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(record["r"]), "lora_alpha": record["alpha"],
        "lora_dropout": record.get("dropout", 0.0), "use_rslora": bool(record.get("rslora")),
        "target_modules": target_modules, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "modules_to_save": None, "base_model_name_or_path": base_model,
    }


def write_peft_dir(out_dir: str, adapters: Dict[str, torch.Tensor], record: dict, base_model: Optional[str],
                   dtype: torch.dtype) -> None:
    """``adapter_config.json`` + ``adapter_model.safetensors`` of canonical ``adapters`` into ``out_dir``."""
    from safetensors.torch import save_file

    tensors = {k: v.to(dtype).contiguous() for k, v in to_peft(adapters).items()}
    save_file(tensors, os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(peft_config(record, adapted_projections(adapters), base_model), f, indent=2)


# --------------------------------------------------------------------------- the base
def base_files(path: str) -> List[str]:
    """The files whose bytes identify a base model, relative to ``path`` (sorted)."""
    iteration = layout.read_tracker(path) if os.path.isdir(path) else None
    if iteration is not None:
        it_dir = layout.iteration_dir(path, iteration)
        ranks = sorted(n for n in os.listdir(it_dir) if n.startswith("mp_rank_")) if os.path.isdir(it_dir) else []
        files = [os.path.join(os.path.basename(it_dir), r, "model_optim_rng.pt") for r in ranks]
        return [f for f in files if os.path.isfile(os.path.join(path, f))]
    return sorted([hf_io.CONFIG, *hf_io.weight_files(path)])


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def combine(digests: Dict[str, str]) -> str:
    """One fingerprint of a base from its files' digests (relative path -> sha256)."""
    h = hashlib.sha256()
    for rel in sorted(digests):
        h.update(f"{rel}:{digests[rel]}\n".encode())
    return h.hexdigest()


def fingerprint(path: str) -> str:
    files = base_files(path)
    if not files:
        raise ConversionError(f"{path}: no model files to fingerprint")
    return combine({f: file_sha256(os.path.join(path, f)) for f in files})


def check_base(record: dict, base_dir: str, fingerprint_here: str, where: str, flag: str = "--load") -> None:
    """Refuse adapters (their checkpoint's ``lora`` record, from ``where``) on a base that is not theirs."""
    base = record.get("base") or {}
    if base.get("fingerprint") != fingerprint_here:
        raise ConversionError(
            f"{where}: the adapters were trained on the base {base.get('path')} (content fingerprint "
            f"{str(base.get('fingerprint'))[:16]}), but {flag} {base_dir} has fingerprint {fingerprint_here[:16]}: "
            f"pass {flag} {base.get('path')} (or that model's exact copy)")


def split_adapters(tensors: Dict[str, torch.Tensor]):
    """(base tensors, adapter tensors) of one unit."""
    adapters = {k: v for k, v in tensors.items() if is_adapter_name(k)}
    return {k: v for k, v in tensors.items() if k not in adapters}, adapters

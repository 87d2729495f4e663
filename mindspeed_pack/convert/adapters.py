"""LoRA adapters in the converter: Megatron's tensors <-> PEFT's, merged into HF weights, and their base.

Canonical adapter tensors (full, global layer ids) are the model's own parameters
(:mod:`mindspeed_pack.model.lora`): ``decoder.layers.{i}.{linear}.lora_A.{p}`` ``[r, in]`` and
``...lora_B.{p}`` ``[out_p, r]``, one pair per Hugging Face projection ``p``, B's rows in HF order.
The PEFT export is therefore a renaming through the weight map's module names::

    decoder.layers.3.self_attention.linear_qkv.lora_B.k_proj
        <->  base_model.model.model.layers.3.self_attn.k_proj.lora_B.weight

and a merged model adds ``scale * B @ A`` to each adapted projection's HF weight (computed in fp32).
A reward model's score head, trained in full beside the adapters, is PEFT's ``modules_to_save``: its
tensor goes in as ``base_model.model.score.weight`` (``task_type`` ``SEQ_CLS``), and into a merged
model as is.

The base an adapter was trained on is recorded as its path and a content fingerprint: sha256 over
the base's weight files (a HF directory's config.json and weight files, a Megatron checkpoint's
``model_optim_rng.pt`` files of its tracked iteration), checked wherever adapters meet a base again.
A Megatron checkpoint's files depend on its layout, so ``convert_ckpt.py``'s mg->mg reshard records in
the new files the fingerprints of the checkpoints it was resharded from (``same_weights_as``): a base
and its reshards are the same model, and adapters of one are accepted on the others. A lossless hf->mg
conversion records the HF directory it came from (``hf_origin``): PEFT loads adapters on a HF model, so the
export of adapters trained on the conversion names that directory as its base. The PEFT export
records the base in ``adapter_model.safetensors``' metadata; a PEFT directory of another tool names
its base by ``base_model_name_or_path`` only.
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
from mindspeed_pack.model.lora import ADAPTED_LINEARS, TRAINED_IN_FULL, is_adapter_name

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."

SAME_WEIGHTS_AS = "same_weights_as"  # a reshard's record: fingerprints of the checkpoints it was resharded from
HF_ORIGIN = "hf_origin"  # a lossless conversion's record: its HF directory (PEFT's base_model_name_or_path)
PEFT_BASE_METADATA = "mindspeed_pack.lora_base"  # adapter_model.safetensors metadata: the base record (JSON)

_MG_ADAPTER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)\.lora_([AB])\.(\w+)$")
_PEFT_ADAPTER = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight$")


def _parse(name: str):
    m = _MG_ADAPTER.match(name)
    if m is None or m.group(2) not in ADAPTED_LINEARS or m.group(4) not in ADAPTED_LINEARS[m.group(2)]:
        raise ConversionError(f"{name!r} is not a LoRA adapter tensor of a known linear")
    return int(m.group(1)), m.group(2), m.group(3), m.group(4)


def to_peft(adapters: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Canonical adapter tensors (and the score head) -> PEFT's ``adapter_model.safetensors`` keys (same tensors;
    the score head's HF name is its Megatron name)."""
    out = {}
    for name, tensor in adapters.items():
        if name in TRAINED_IN_FULL:
            out[PEFT_PREFIX + name] = tensor
            continue
        layer, linear, ab, p = _parse(name)
        out[f"{PEFT_PREFIX}{hf_projection(layer, linear, p)}.lora_{ab}.weight"] = tensor
    return out


def canonical_name(key: str) -> str:
    """A PEFT tensor's name -> its canonical adapter name (inverse of :func:`to_peft`'s renaming)."""
    if key.startswith(PEFT_PREFIX) and key[len(PEFT_PREFIX):] in TRAINED_IN_FULL:
        return key[len(PEFT_PREFIX):]
    owners = {hf: mg for mg, hf in HF_MODULE.items()}
    m = _PEFT_ADAPTER.match(key)
    linear = None if m is None else next((lin for lin, parts in ADAPTED_LINEARS.items()
                                          if lin.split(".")[0] == owners.get(m.group(2)) and m.group(3) in parts), None)
    if linear is None:
        module = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        if any(part in module.split(".") for part in ("embed_tokens", "lm_head")):  # PEFT adapts them on request
            raise ConversionError(f"PEFT tensor {key!r}: adapters (or trained copies) of the embedding or output "
                                  "layer are not supported here, only of the attention and MLP projections "
                                  "(--lora-target-modules); train the adapters without them")
        raise ConversionError(f"PEFT tensor {key!r} is not a LoRA adapter of a projection this model adapts")
    return f"decoder.layers.{m.group(1)}.{linear}.lora_{m.group(4)}.{m.group(3)}"


def from_peft(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`to_peft`."""
    return {canonical_name(key): tensor for key, tensor in tensors.items()}


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


def peft_config(record: dict, target_modules: List[str], base_model: Optional[str], modules_to_save=()) -> dict:
    """``adapter_config.json``: what ``peft.PeftModel.from_pretrained`` needs (the rest are PEFT's defaults); a
    reward model's (``modules_to_save`` ``["score"]``) is a sequence classifier's (``SEQ_CLS``)."""
    return {
        "peft_type": "LORA", "task_type": "SEQ_CLS" if modules_to_save else "CAUSAL_LM", "r": int(record["r"]),
        "lora_alpha": record["alpha"], "lora_dropout": record.get("dropout", 0.0),
        "use_rslora": bool(record.get("rslora")), "target_modules": target_modules, "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
        "modules_to_save": list(modules_to_save) or None, "base_model_name_or_path": base_model,
    }


def write_peft_dir(out_dir: str, adapters: Dict[str, torch.Tensor], record: dict, base_model: Optional[str],
                   dtype: torch.dtype) -> None:
    """``adapter_config.json`` + ``adapter_model.safetensors`` of canonical ``adapters`` (with the tensors trained
    in full beside them) into ``out_dir``."""
    from safetensors.torch import save_file

    tensors = {k: v.to(dtype).contiguous() for k, v in to_peft(adapters).items()}
    metadata = {"format": "pt"}
    if record.get("base"):
        metadata[PEFT_BASE_METADATA] = json.dumps(record["base"])
    save_file(tensors, os.path.join(out_dir, ADAPTER_WEIGHTS), metadata=metadata)
    modules = sorted(TRAINED_IN_FULL[k] for k in adapters if k in TRAINED_IN_FULL)
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(peft_config(record, adapted_projections([k for k in adapters if is_adapter_name(k)]), base_model,
                              modules), f, indent=2)


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


def lineage(path: str) -> dict:
    """What Megatron checkpoint ``path`` holds the same weights as, from its first rank file: ``SAME_WEIGHTS_AS``
    and ``HF_ORIGIN``, those it records ({} for a HF directory)."""
    iteration = layout.read_tracker(path) if os.path.isdir(path) else None
    files = base_files(path) if iteration is not None else []
    if not files:
        return {}
    record = layout.load_file(os.path.join(path, files[0]), mmap=True)
    return {k: record[k] for k in (SAME_WEIGHTS_AS, HF_ORIGIN) if record.get(k)} if isinstance(record, dict) else {}


def same_weights_as(path: str) -> List[str]:
    """Fingerprints of the checkpoints Megatron checkpoint ``path`` is a reshard of (none for a HF directory)."""
    return list(lineage(path).get(SAME_WEIGHTS_AS) or [])


def hf_origin(path: str) -> Optional[str]:
    """The HF directory Megatron checkpoint ``path`` (or the one it is a reshard of) was converted from without
    loss, else None."""
    return lineage(path).get(HF_ORIGIN)


def peft_base_model(record: Optional[dict]) -> Optional[str]:
    """``base_model_name_or_path`` for adapters whose checkpoint's ``lora`` record is ``record``: their HF base,
    or the HF directory their Megatron base was converted from (PEFT loads adapters on a HF model only)."""
    base = (record or {}).get("base") or {}
    return base.get("path") if base.get("format") == "hf" else base.get(HF_ORIGIN)


def check_base(record: dict, base_dir: str, fingerprint_here: str, where: str, flag: str = "--load",
               same_here=()) -> None:
    """Refuse adapters (their checkpoint's ``lora`` record, from ``where``) on a base that is not theirs: the
    fingerprints of their base and of ``base_dir`` (``fingerprint_here``), each with the checkpoints it was
    resharded from (``same_weights_as``; ``same_here``), have none in common."""
    base = record.get("base") or {}
    theirs = {base.get("fingerprint"), *(base.get(SAME_WEIGHTS_AS) or [])} - {None}
    if not theirs & {fingerprint_here, *same_here}:
        raise ConversionError(
            f"{where}: the adapters were trained on the base {base.get('path')} (content fingerprint "
            f"{str(base.get('fingerprint'))[:16]}), but {flag} {base_dir} has fingerprint {fingerprint_here[:16]}: "
            f"pass {flag} {base.get('path')} (or that model's exact copy, or its reshard by convert_ckpt.py)")


def split_adapters(tensors: Dict[str, torch.Tensor]):
    """(base tensors, adapter tensors) of one unit."""
    adapters = {k: v for k, v in tensors.items() if is_adapter_name(k)}
    return {k: v for k, v in tensors.items() if k not in adapters}, adapters


def trained_in_full(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The tensors of a unit that a LoRA run trained in full beside its adapters (a reward model's score head)."""
    return {k: v for k, v in tensors.items() if k in TRAINED_IN_FULL}


# --------------------------------------------------------------------------- a PEFT directory as --lora-load
# adapter_config.json settings that this trainer's adapters (plain LoRA: one A and B per adapted projection, on
# every layer, one rank and alpha) cannot express: each refused when set (modules_to_save: but a reward model's
# score head, see _modules_to_save)
_PEFT_UNSUPPORTED = {
    "use_dora": "DoRA", "lora_bias": "a bias on lora_B", "fan_in_fan_out": "transposed (Conv1D) weights",
    "trainable_token_indices": "trained token rows",
    "rank_pattern": "ranks per module", "alpha_pattern": "alphas per module",
    "layers_to_transform": "adapters on some layers only", "layer_replication": "replicated layers",
    "target_parameters": "adapters on parameters", "use_qalora": "QA-LoRA", "use_bdlora": "BD-LoRA",
    "alora_invocation_tokens": "activated LoRA",
}


def is_peft_dir(path: str) -> bool:
    """A PEFT adapter directory (``adapter_config.json``; a Megatron checkpoint's tracker wins: ``--lora-load D
    --save D`` resumes from D's own saves)."""
    return os.path.isfile(os.path.join(path, ADAPTER_CONFIG)) and not os.path.isfile(os.path.join(path, layout.TRACKER))


def named_peft_adapters(path: str) -> List[str]:
    """Subdirectories of ``path`` that are PEFT directories, when ``path`` is neither one nor a Megatron checkpoint:
    PEFT's ``save_pretrained`` writes an adapter not named ``default`` into ``DIR/NAME``."""
    if not os.path.isdir(path) or is_peft_dir(path) or os.path.isfile(os.path.join(path, layout.TRACKER)):
        return []
    return sorted(n for n in os.listdir(path) if is_peft_dir(os.path.join(path, n)))


def _modules_to_save(config: dict, where: str) -> List[str]:
    """The modules trained in full that adapter_config.json names: none, or a reward model's score head (PEFT's
    sequence classifiers name ``classifier`` and ``score`` whichever the model has)."""
    named = config.get("modules_to_save") or []
    known = set(TRAINED_IN_FULL.values())
    if not isinstance(named, list) or not set(named) & known or set(named) - known - {"classifier"}:
        raise ConversionError(f"{where}: modules_to_save {json.dumps(named)} (fully trained extra modules): this "
                              f"trainer trains in full beside the adapters only a reward model's {sorted(known)}")
    return sorted(set(named) & known)


def read_peft_settings(path: str) -> dict:
    """What PEFT directory ``path`` holds, checked: ``r``, ``alpha``, ``rslora``, ``dropout`` (adapter_config.json),
    ``projections`` (the HF projections its tensors adapt, on every layer), ``trained_in_full`` (the canonical
    names of the tensors of its ``modules_to_save``: a reward model's score head), ``base`` (this project's base
    record, from the weights' metadata; None from other tools) and ``base_model_name_or_path``."""
    from safetensors import safe_open

    where = os.path.join(path, ADAPTER_CONFIG)
    try:
        with open(where) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ConversionError(f"{where}: unreadable ({e})") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{where}: holds a {type(config).__name__}, not PEFT's settings")
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise ConversionError(f"{where}: peft_type {config.get('peft_type')!r}; only LoRA adapters load")
    for key, what in _PEFT_UNSUPPORTED.items():
        if config.get(key):
            raise ConversionError(f"{where}: {key} {json.dumps(config[key])} ({what}): this trainer's adapters are "
                                  "plain LoRA, one A and B per adapted projection on every layer")
    modules = _modules_to_save(config, where) if config.get("modules_to_save") else []
    if config.get("bias", "none") != "none":
        raise ConversionError(f"{where}: bias {config['bias']!r}: the adapters train no biases (bias \"none\")")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0 or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ConversionError(f"{where}: r {r!r} and lora_alpha {alpha!r} must be positive numbers (r an integer)")
    weights = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(weights):
        raise ConversionError(f"{path}: no {ADAPTER_WEIGHTS} (PEFT's safetensors weights; save the adapter with "
                              "safe_serialization=True)")
    try:
        with safe_open(weights, "pt") as f:
            names, metadata = [canonical_name(k) for k in f.keys()], f.metadata() or {}
            ranks = {k: f.get_slice(k).get_shape()[0 if ".lora_A." in k else -1] for k in f.keys()
                     if ".lora_A." in k or ".lora_B." in k}
    except ConversionError as e:
        raise ConversionError(f"{weights}: {e}") from None
    except Exception as e:  # a truncated or foreign file
        raise ConversionError(f"{weights}: unreadable ({e})") from None
    other = next((k for k, n in sorted(ranks.items()) if n != r), None)
    if other is not None:  # else the load blames the model flags, which came from this very config
        raise ConversionError(f"{weights}: {other} has rank {ranks[other]}, but {ADAPTER_CONFIG} says r {r}: the "
                              "file and its config disagree; set r to the tensors' rank")
    full = sorted(k for k in names if k in TRAINED_IN_FULL)
    missing = sorted(set(modules) - {TRAINED_IN_FULL[k] for k in full})
    if missing or (full and not modules):
        raise ConversionError(f"{weights}: " + (f"no tensors of modules_to_save {missing} (named in {ADAPTER_CONFIG})"
                                                if missing else f"holds {full}, which {ADAPTER_CONFIG}'s "
                                                "modules_to_save does not name"))
    names = [k for k in names if k not in TRAINED_IN_FULL]
    layers: Dict[int, set] = {}
    for layer, linear, ab, p in map(_parse, names):
        layers.setdefault(layer, set()).add((p, ab))
    projections = sorted({p for held in layers.values() for p, _ in held})
    want = {(p, ab) for p in projections for ab in "AB"}
    gap = next((i for i in range(max(layers, default=-1) + 1) if layers.get(i) != want), None)
    if not names or gap is not None:
        have = sorted(f"{p}.lora_{ab}" for p, ab in layers.get(gap, ()))
        raise ConversionError(f"{weights}: " + ("no adapter tensors" if not names else
                              f"layer {gap} holds {have or 'no adapters'}, the others lora_A and lora_B of "
                              f"{projections}: this trainer adapts the same projections on every layer"))
    base = metadata.get(PEFT_BASE_METADATA)
    return {"r": r, "alpha": float(alpha), "rslora": bool(config.get("use_rslora")),
            "dropout": float(config.get("lora_dropout") or 0.0), "projections": projections,
            "layers": len(layers), "trained_in_full": full, "base": json.loads(base) if base else None,
            "base_model_name_or_path": config.get("base_model_name_or_path")}


def read_peft_adapters(path: str) -> Dict[str, torch.Tensor]:
    """The canonical adapter tensors (full, global layer ids) of PEFT directory ``path``."""
    from safetensors.torch import load_file

    return from_peft(load_file(os.path.join(path, ADAPTER_WEIGHTS)))

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

The base an adapter was trained on is recorded as its path and a content fingerprint of the base's weight files
(a HF directory's config.json and weight files, a Megatron checkpoint's ``model_optim_rng.pt`` files of its
tracked iteration; sampled, not every byte hashed: :func:`file_digest`), checked wherever adapters meet a base
again.
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
import logging
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

log = logging.getLogger(__name__)

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


# A base's fingerprint says which model adapters were trained on, so that they are not applied to another one.
# Another base that fits the same adapters (same names and shapes) differs in every element of the tensors it
# changed: another checkpoint of the family, a full fine-tune, a LoRA merge (B @ A is dense over each adapted
# projection), another precision (other dtypes and sizes). Hashing every byte (sha256, ~0.5 s per GB: minutes
# for a 70B base, at every LoRA start and every conversion) is not needed to tell those apart:
# - a safetensors file: its size, its header (the first 8 bytes give its length; its JSON names every tensor
#   with its dtype, shape and offsets) and, of every tensor, evenly spaced chunks (its first and last bytes
#   among them; a small tensor whole);
# - a zip file (torch.save's .pt/.bin: a Megatron checkpoint's rank files): its central directory, which holds
#   every entry's name, size and CRC-32 (torch computes it over the entry's bytes when it saves): every byte
#   counted, read from the file's end;
# - anything else (config.json, an index): hashed whole when small, else sampled like a tensor.
# What a sample misses is a change confined to the bytes between the chunks of a safetensors tensor (one edited
# element): not another base for the adapters' purpose. Such a fingerprint starts with SAMPLED; a record of
# the older kind (a sha256 of every byte, 64 hex digits) is compared by that method (check_base).
SAMPLED = "sampled1:"
_CHUNK = 4096  # bytes of one sample
_CHUNKS_PER_TENSOR = 8
_WHOLE_BELOW = 16 << 20  # a small file outside the formats above is hashed whole


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _sample(f, h, start: int, end: int) -> None:
    """Evenly spaced chunks of the bytes [start, end) of open file ``f`` into hash ``h`` (all of them when few)."""
    length = end - start
    if length <= _CHUNK * _CHUNKS_PER_TENSOR:
        f.seek(start)
        h.update(f.read(length))
        return
    step = (length - _CHUNK) / (_CHUNKS_PER_TENSOR - 1)
    for i in range(_CHUNKS_PER_TENSOR):
        f.seek(start + int(i * step))  # the first chunk at start, the last ending at end
        h.update(f.read(_CHUNK))


def _safetensors_digest(f, size: int, h) -> bool:
    """The header and every tensor's samples of safetensors file ``f`` into ``h``; False when it is none."""
    import struct

    head = f.read(8)
    if len(head) < 8:
        return False
    (n,) = struct.unpack("<Q", head)
    if n > min(size - 8, 100 << 20):
        return False
    header = f.read(n)
    try:
        tensors = json.loads(header)
    except ValueError:
        return False
    h.update(head + header)
    spans = sorted(tuple(t["data_offsets"]) for k, t in tensors.items() if k != "__metadata__")
    for begin, end in spans:
        _sample(f, h, 8 + n + begin, 8 + n + end)
    return True


def _zip_digest(path: str, h) -> bool:
    """Every entry's name, size and CRC-32 of zip file ``path`` into ``h``; False when it is none, or when its
    writer recorded no CRC (then the entries' bytes are not vouched for)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            entries = [(i.filename, i.file_size, i.CRC) for i in z.infolist()]
    except (zipfile.BadZipFile, OSError):
        return False
    if any(size and not crc for _, size, crc in entries):
        return False
    for name, size, crc in entries:
        h.update(f"{name}:{size}:{crc:08x}\n".encode())
    return True


def file_digest(path: str) -> str:
    """The sampled digest of one file of a base (the comment above says what it reads and why)."""
    import zipfile

    size = os.path.getsize(path)
    h = hashlib.sha256(f"size {size}\n".encode())
    with open(path, "rb") as f:
        if path.endswith(".safetensors") and _safetensors_digest(f, size, h):
            return h.hexdigest()
    if zipfile.is_zipfile(path) and _zip_digest(path, h):
        return h.hexdigest()
    if size <= _WHOLE_BELOW:
        return file_sha256(path)
    with open(path, "rb") as f:
        _sample(f, h, 0, size)
    return h.hexdigest()


def combine(digests: Dict[str, str], sampled: bool = True) -> str:
    """One fingerprint of a base from its files' digests (relative path -> :func:`file_digest`; ``sampled``
    False: -> :func:`file_sha256`, the older kind)."""
    h = hashlib.sha256()
    for rel in sorted(digests):
        h.update(f"{rel}:{digests[rel]}\n".encode())
    return (SAMPLED if sampled else "") + h.hexdigest()


def fingerprint(path: str, sampled: bool = True) -> str:
    """The content fingerprint of base ``path`` (``sampled`` False: the older kind, a sha256 of every byte)."""
    files = base_files(path)
    if not files:
        raise ConversionError(f"{path}: no model files to fingerprint")
    digest = file_digest if sampled else file_sha256
    return combine({f: digest(os.path.join(path, f)) for f in files}, sampled)


def is_sampled(fingerprint_: str) -> bool:
    """Whether a recorded fingerprint is of the sampled kind (else a sha256 of every byte, recorded before)."""
    return str(fingerprint_).startswith(SAMPLED)


def short(fingerprint_: Optional[str]) -> str:
    """A fingerprint's first 16 hex digits, after its kind's tag."""
    text = str(fingerprint_)
    return text[:len(SAMPLED) + 16] if is_sampled(text) else text[:16]


def same_base(recorded, path: str, here: str, same_here=()) -> Optional[bool]:
    """Whether base ``path`` (fingerprint ``here``, and ``same_here``: those of the checkpoints it was converted or
    resharded from) holds the weights of one of the ``recorded`` fingerprints. A recorded fingerprint of the
    older kind is compared by its method (``path``'s every byte hashed, once); None when it cannot be told: a
    match could only be through ``same_here`` and their kinds differ (a conversion recorded by an older version
    and adapters of this one, or the reverse)."""
    recorded = set(recorded) - {None}
    if recorded & {here, *same_here}:
        return True
    if any(not is_sampled(r) for r in recorded) and fingerprint(path, sampled=False) in recorded:
        return True
    if any(is_sampled(r) != is_sampled(s) for r in recorded for s in same_here):
        return None
    return False


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
    same = same_base(theirs, base_dir, fingerprint_here, same_here)
    if same is None:
        log.warning("%s: the adapters' base %s is recorded by a fingerprint of another kind than %s %s's lineage "
                    "(one written by an older version): the base cannot be checked, and is taken as theirs", where,
                    base.get("path"), flag, base_dir)
    elif not same:
        raise ConversionError(
            f"{where}: the adapters were trained on the base {base.get('path')} (content fingerprint "
            f"{short(base.get('fingerprint'))}), but {flag} {base_dir} has fingerprint {short(fingerprint_here)}: "
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
    # PEFT's LoRA variants whose forward is not scale x B A x (each refused, not read as the plain LoRA it is not)
    "kasa_config": "KaSA: a learned singular-value diagonal between A and B, over a truncated base",
    "arrow_config": "Arrow: per-token routing among several LoRAs",
}
# init_lora_weights (its prefix) -> the method that subtracts the adapters' initial product from the base weights:
# PEFT saves such adapters for that residual base (PeftModel.from_pretrained redoes the subtraction), so on the
# original base they would give another model. PEFT's save_pretrained(path_initial_model_for_weight_conversion=...)
# writes them as plain LoRA of the original base (init_lora_weights true), which loads.
_RESIDUAL_INITS = {"pissa": "PiSSA", "olora": "OLoRA", "corda": "CorDA", "loftq": "LoftQ", "lora_ga": "LoRA-GA"}


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
    init = config.get("init_lora_weights", True)
    residual = next((name for key, name in _RESIDUAL_INITS.items()
                     if isinstance(init, str) and init.lower().startswith(key)), None)
    if residual:
        raise ConversionError(f"{where}: init_lora_weights {init!r}: {residual} subtracts the adapters' starting "
                              "product from the base weights, so these adapters belong to that residual base, not "
                              "to --load's: save them with PEFT's save_pretrained(DIR, path_initial_model_for_weight_"
                              "conversion=INITIAL_ADAPTER_DIR) (plain LoRA of the original base), or merge them")
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

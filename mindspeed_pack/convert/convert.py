"""Checkpoint conversion: Hugging Face -> Megatron, Megatron -> Hugging Face, Megatron resharding.

Every direction follows the same plan:

1. read and validate everything that can be checked without the weights (config, the
   name and shape of every tensor, parallel sizes, vocabulary sizes, the output dir);
   bad input fails here, before anything is written;
2. stream the model one *unit* (embedding, one layer, final norm + output layer) at a
   time: read it, map it to the other naming, shard or merge it; a pipeline stage's files
   are written as soon as the stage is complete and then freed, so memory stays near one
   stage of the model (one model at PP=1), not two;
3. everything goes into a temporary directory next to ``save_dir`` that is renamed onto
   it at the very end: the output is complete or absent.

Converted Megatron checkpoints are ``release`` checkpoints (iteration 0) in Megatron's
layout (:mod:`mindspeed_pack.convert.megatron_layout`), each file holding ``model``
(canonical local-spec names, no ``_extra_state`` entries), ``args`` (the model-shape
arguments, :data:`~.model_specs.MODEL_ARG_NAMES`: among them ``vocab_size``, config.json's, the
embedding's rows, all real, and ``padded_vocab_size``; training takes them as its flags,
:mod:`mindspeed_pack.config.checkpoint_flags`), ``iteration``, ``checkpoint_version``
``hf_config`` (the source config.json, for the way back) and ``tokenizer`` (the vocabulary of
the source directory's tokenizer, :mod:`.tokenizer_record`, or None without one: training checks
it at ``--load``/``--ref-load``). Padded vocabulary rows are zero.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import os
import pickle
import shutil
import signal
import sys
import threading
from typing import Dict, Optional

import torch
from tqdm import tqdm

from mindspeed_pack.convert import adapter_reshard, hf_io
from mindspeed_pack.convert import adapters as lora_map
from mindspeed_pack.convert import megatron_layout as layout
from mindspeed_pack.convert.model_specs import (
    MINDSPEED_MODEL_TYPES,
    MODEL_SPECS,
    ConversionError,
    args_from_dict,
    args_from_hf_config,
    args_to_dict,
    check_parallel_sizes,
    detect_model_type,
    get_spec,
    hf_config_from_args,
    resolve_padded_vocab,
    settings_lost,
)
from mindspeed_pack.convert.sharding import (
    expert_shard,
    merge_expert_shards,
    merge_state_dicts,
    shard_state_dict,
    stage_of_layer,
    stage_units,
)
from mindspeed_pack.convert.tokenizer_record import (
    describe,
    read_tokenizer_record,
    recorded_directory,
)
from mindspeed_pack.convert.weight_map import (
    EMBEDDING,
    FINAL,
    HF_EMBEDDING,
    MG_EMBEDDING,
    MG_OUTPUT,
    check_hf_tensors,
    expected_hf_shapes,
    hf_to_mg_unit,
    hf_unit_shapes,
    mg_layer_prefix,
    mg_to_hf_unit,
    mg_unit_names,
    units,
)
from mindspeed_pack.model.gpt import padded_vocab_size as megatron_padded_vocab_size
from mindspeed_pack.model.lora import is_trained_name, resolve_targets
from mindspeed_pack.runtime import faults, stale_files

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _dtype(name: Optional[str], stored: Optional[torch.dtype] = None, where: str = "") -> torch.dtype:
    """``--params-dtype``'s dtype; without it ``stored``, the dtype the source's weights are in (``where``): a bf16
    model stays bf16, bit for bit, instead of an fp32 copy twice its size on disk and in memory."""
    if name is None:
        if stored is None:  # nothing stored to keep (no tensors)
            return torch.float32
        if stored not in _HF_DTYPE_NAMES:
            raise ConversionError(f"{where} holds {stored} weights: pass --params-dtype ({', '.join(sorted(DTYPES))})")
        log.info("writing %s weights (those of %s; --params-dtype to change)", _HF_DTYPE_NAMES[stored], where)
        return stored
    if name not in DTYPES:
        raise ConversionError(f"--params-dtype {name!r}: choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def _stored_dtype(source: "MegatronCheckpoint") -> Optional[torch.dtype]:
    """The dtype of a Megatron checkpoint's weights: its word embedding's, else its first floating tensor's."""
    model = source.rank_file(0, 0)["model"]
    if MG_EMBEDDING in model:
        return model[MG_EMBEDDING].dtype
    return next((t.dtype for t in model.values() if isinstance(t, torch.Tensor) and t.is_floating_point()), None)


# --------------------------------------------------------------------------- output dir
def check_save_dir(save_dir: str, load_dir: Optional[str] = None) -> None:
    if load_dir is not None and os.path.abspath(save_dir) == os.path.abspath(load_dir):
        raise ConversionError(f"--save-dir {save_dir} is the same as --load-dir")
    if os.path.exists(save_dir):
        if not os.path.isdir(save_dir):
            raise ConversionError(f"--save-dir {save_dir} exists and is not a directory")
        if os.listdir(save_dir):
            raise ConversionError(f"--save-dir {save_dir} exists and is not empty; choose a new directory")


@contextlib.contextmanager
def staged_output(save_dir: str):
    """A temporary directory next to ``save_dir`` (``.NAME.tmp-HOST-PID``), renamed onto it when the block
    succeeds; those of killed exports to ``save_dir`` are removed first."""
    save_dir = os.path.abspath(save_dir)
    os.makedirs(os.path.dirname(save_dir), exist_ok=True)
    tmp = stale_files.temporary_for(save_dir, save_dir)
    layout.remove_tree(tmp)  # this process's own, of an earlier export that failed
    os.mkdir(tmp)
    try:
        yield tmp
        faults.fire("exported", 0, tmp)  # crash tests: killed with the output whole but not in place
        check_save_dir(save_dir)  # still free?
        if os.path.isdir(save_dir):
            os.rmdir(save_dir)
        os.rename(tmp, save_dir)
    except BaseException:
        layout.remove_tree(tmp)
        raise


def _progress(total: int, desc: str):
    return tqdm(total=total, desc=desc, unit="unit", dynamic_ncols=True, leave=False)


# --------------------------------------------------------------------------- megatron reading
def _load_rank_file(path: str, allow_unsafe: bool = False) -> dict:
    """A rank file, memory-mapped (tensors are read from disk when touched), read as data only."""
    try:
        record = layout.load_file(path, allow_unsafe=allow_unsafe, mmap=True)
    except layout.UnsafeCheckpointError as e:
        raise ConversionError(str(e)) from None
    except (RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise ConversionError(f"{path}: unreadable checkpoint file ({e}); it is truncated or not a torch "
                              "checkpoint") from None
    if not isinstance(record, dict):
        raise ConversionError(f"{path}: holds a {type(record).__name__}, not a checkpoint dictionary")
    return record


class MegatronCheckpoint:
    """A Megatron checkpoint directory: its args, parallel layout, and merged units."""

    def __init__(self, load_dir: str, allow_unsafe: bool = False, family: Optional[str] = None):
        """``family``: --model-type-hf as given, for a checkpoint that records none (Megatron-LM's own)."""
        self.allow_unsafe = allow_unsafe
        if not os.path.isdir(load_dir):
            raise ConversionError(f"--load-dir {load_dir}: not a directory")
        iteration = layout.read_tracker(load_dir)
        if iteration is None:
            raise ConversionError(f"{load_dir}: no {layout.TRACKER}; not a Megatron checkpoint directory")
        it_dir = layout.iteration_dir(load_dir, iteration)
        if not os.path.isdir(it_dir):
            raise ConversionError(f"{os.path.join(load_dir, layout.TRACKER)} names {iteration!r}, but {it_dir} does not exist")
        later = layout.later_iterations(load_dir, iteration)
        if later:  # the tracker set back: the tracked iteration is converted, not the highest iter_*
            log.warning("--load-dir %s: %s", load_dir, layout.later_iterations_note(load_dir, iteration, later))
        try:
            self.tp, self.pp, self.ep = layout.parallel_sizes_in(it_dir, allow_unsafe)
        except layout.DistributedCheckpointError as e:
            raise ConversionError(str(e)) from None
        except FileNotFoundError as e:
            raise ConversionError(f"{e}; not a Megatron checkpoint") from None
        self.iteration = iteration
        self.files = {}
        for pp_rank in range(self.pp):
            for tp_rank in range(self.tp):
                for ep_rank in range(self.ep):
                    path = layout.checkpoint_file(load_dir, iteration, tp_rank, pp_rank, self.pp, ep_rank, self.ep)
                    if not os.path.isfile(path):
                        raise ConversionError(f"{path}: missing (checkpoint has TP={self.tp}, PP={self.pp}"
                                              + (f", EP={self.ep})" if self.ep > 1 else ")"))
                    self.files[(tp_rank, pp_rank, ep_rank)] = path
        self._loaded: Dict[tuple, dict] = {}
        first = self._file(0, 0)
        first_path = self.files[(0, 0, 0)]
        if first.get("args") is None:
            raise ConversionError(f"{first_path}: no 'args' entry")
        stored = layout.args_of(first)
        if stored.get("model_type_hf") is None:  # a Megatron-LM run's checkpoint: its flags name no family
            if family is None:
                raise ConversionError(f"{first_path}: records no model family (a Megatron-LM checkpoint): pass "
                                      f"--model-type-hf ({', '.join(sorted(MODEL_SPECS))})")
            stored = {**stored, "model_type_hf": family}
        self.args = args_from_dict(stored, first_path)
        saved = (self.args.tensor_model_parallel_size, self.args.pipeline_model_parallel_size,
                 self.args.expert_model_parallel_size)
        if saved != (self.tp, self.pp, self.ep):
            raise ConversionError(
                f"{first_path}: args say TP={saved[0]}, PP={saved[1]}, EP={saved[2]}, but the directory holds "
                f"TP={self.tp}, PP={self.pp}, EP={self.ep} ranks")
        self.hf_config = first.get("hf_config")
        self.tokenizer = first.get("tokenizer")
        self.lora = first.get("lora")  # a LoRA run's checkpoint: adapter settings and the base they belong to
        self.same_weights_as = list(first.get(lora_map.SAME_WEIGHTS_AS) or [])  # a reshard: what it was resharded from
        self.hf_origin = first.get(lora_map.HF_ORIGIN)  # a lossless conversion: the HF directory it came from

    def holds_base(self) -> bool:
        """False for a LoRA ``--save`` (what the run trained only: adapters, a reward model's score head)."""
        return any(not is_trained_name(k) for k in self._file(0, 0)["model"])

    def rank_file(self, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> dict:
        """The whole record of one rank's file (model, optimizer, ...), read once."""
        return self._file(tp_rank, pp_rank, ep_rank)

    def _file(self, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> dict:
        key = (tp_rank, pp_rank, ep_rank)
        if key not in self._loaded:
            record = _load_rank_file(self.files[key], self.allow_unsafe)
            if "model" not in record:
                raise ConversionError(f"{self.files[key]}: no 'model' entry")
            # a Megatron-LM run under Transformer Engine saves TE's fused layer-norm names and _extra_state entries
            record["model"] = layout.to_canonical_names(record["model"])
            self._loaded[key] = record
        return self._loaded[key]

    def release(self) -> None:
        """Drop the rank files read so far (read again when needed, a few milliseconds): a file is one memory map
        that keeps every page read from it while any of its tensors lives, so holding them kept the whole
        checkpoint's pages to the end; dropped after each unit, a unit's pages go with its tensors (once written)."""
        self._loaded.clear()

    def unit(self, unit) -> Dict[str, torch.Tensor]:
        """The canonical full tensors of ``unit`` (vocabulary still padded)."""
        if unit == EMBEDDING:
            stage, pick = 0, set(mg_unit_names(EMBEDDING, self.args)).__contains__
        elif unit == FINAL:
            stage, pick = self.pp - 1, set(mg_unit_names(FINAL, self.args)).__contains__
        else:
            stage, local = stage_of_layer(unit, self.args.num_layers, self.pp)
            prefix = mg_layer_prefix(local)
            pick = lambda name: name.startswith(prefix)  # noqa: E731
        shards = {}
        for tp_rank in range(self.tp):
            experts = isinstance(unit, int) and self.ep > 1  # a layer's experts are spread over EP ranks
            by_ep = {ep_rank: {k: v for k, v in self._file(tp_rank, stage, ep_rank)["model"].items()
                               if pick(k) and v is not None} for ep_rank in (range(self.ep) if experts else [0])}
            shards[(tp_rank, stage)] = merge_expert_shards(by_ep, self.args.num_experts, self.ep if experts else 1)
        return merge_state_dicts(shards, self.args, self.tp, self.pp)


def tokenizer_length(tokenizer_dir: str) -> int:
    """``len(tokenizer)``: the token ids the tokenizer can produce (added tokens included)."""
    from transformers import AutoTokenizer

    try:
        return len(AutoTokenizer.from_pretrained(tokenizer_dir))
    except Exception as e:  # transformers raises many kinds
        raise ConversionError(f"--tokenizer-dir {tokenizer_dir}: not loadable by AutoTokenizer ({e})") from None


def vocab_rows(source: MegatronCheckpoint, tokenizer_dir: Optional[str]) -> int:
    """How many vocabulary rows are real tokens, to keep when the padding is cut or changed.

    Preprocessing adds tokens a template needs (chatml markers on a base tokenizer) and
    training trains their rows, past the ``vocab_size`` the checkpoint was converted with.
    Cutting back to that size would drop them (the HF model then fails on those ids), so
    the tokenizer's length wins, as ``resize_token_embeddings(len(tokenizer))`` would. Without
    a tokenizer, trained (non-zero) rows past ``vocab_size`` of an untied input embedding are
    refused rather than dropped; a run given only ``--padded-vocab-size`` stored no
    ``vocab_size``: then every row is a real row.
    """
    args, padded = source.args, source.args.padded_vocab_size
    rows = args.vocab_size
    if tokenizer_dir:
        n = tokenizer_length(tokenizer_dir)
        if n > padded:
            raise ConversionError(
                f"--tokenizer-dir {tokenizer_dir}: {n} tokens, but the checkpoint's embedding has only {padded} "
                "rows: the model was not trained with this tokenizer")
        if rows is not None and n > rows:
            log.warning("--tokenizer-dir %s has %d tokens, the checkpoint's vocab_size is %d: keeping %d vocabulary "
                        "rows (the added tokens' rows were trained) and writing vocab_size=%d", tokenizer_dir, n,
                        rows, n, n)
        return max(rows or 0, n)
    if rows is None:
        return padded
    if args.untie_embeddings_and_output_weights and source.holds_base():  # adapters only: no embedding
        embedding = source.unit(EMBEDDING)[MG_EMBEDDING]
        trained = torch.nonzero(embedding[rows:].abs().sum(dim=1)).flatten()
        if len(trained):
            raise ConversionError(
                f"{source.files[(0, 0, 0)]}: word-embedding rows {rows}..{rows + int(trained[-1])} past the vocab_size "
                f"{rows} were trained (tokens added at preprocessing): pass --tokenizer-dir with the tokenizer used "
                "in training (P_tokenizer/ of preprocess_data.py) so they are kept")
    return rows


def _rank_record(model: Dict[str, torch.Tensor], args, hf_config: Optional[dict], tokenizer: Optional[dict],
                 lineage: Optional[dict] = None) -> dict:
    record = {
        "model": model,
        "args": args_to_dict(args),
        "iteration": 0,
        "checkpoint_version": layout.CHECKPOINT_VERSION,
        "hf_config": hf_config,
        "tokenizer": tokenizer,
    }
    record.update({k: v for k, v in (lineage or {}).items() if v})
    return record


def _write_stage(root: str, rank_dicts: Dict[tuple, Dict[str, torch.Tensor]], args, hf_config, tokenizer,
                 pp_rank: int, lineage: Optional[dict] = None) -> None:
    pp, ep = args.pipeline_model_parallel_size, args.expert_model_parallel_size
    for (tp_rank, ep_rank), model in rank_dicts.items():
        path = layout.checkpoint_file(root, layout.RELEASE, tp_rank, pp_rank, pp, ep_rank, ep)
        layout.save_file_atomic(_rank_record(model, args, hf_config, tokenizer, lineage), path)


def _write_sharded(root: str, args, hf_config, tokenizer, full_unit, desc: str,
                   lineage: Optional[dict] = None) -> None:
    """Shard the units produced by ``full_unit(unit)`` stage by stage (TP, then EP) and write them
    (``lineage``: what holds the same weights, recorded in every file: the checkpoints it was resharded from,
    the HF directory it was converted from)."""
    tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    stages = [stage_units(args, p, pp) for p in range(pp)]
    with _progress(sum(len(s) for s in stages), desc) as bar:
        for pp_rank, stage in enumerate(stages):
            rank_dicts: Dict[tuple, Dict[str, torch.Tensor]] = {(t, e): {} for t in range(tp) for e in range(ep)}
            for unit in stage:
                full = full_unit(unit)
                for tp_rank in range(tp):
                    shard = shard_state_dict(full, args, tp_rank, tp, pp_rank, pp)
                    for ep_rank in range(ep):
                        rank_dicts[(tp_rank, ep_rank)].update(expert_shard(shard, args.num_experts, ep_rank, ep))
                del full
                bar.update()
            _write_stage(root, rank_dicts, args, hf_config, tokenizer, pp_rank, lineage)
            del rank_dicts
    layout.write_tracker(root, layout.RELEASE)


# --------------------------------------------------------------------------- public API
def hf_to_megatron(
    load_dir: str,
    save_dir: str,
    tp: int,
    pp: int,
    params_dtype: Optional[str] = None,
    model_type_hf: Optional[str] = None,
    make_vocab_size_divisible_by: int = 128,
    padded_vocab_size: Optional[int] = None,
    allow_unsafe: bool = False,
    seq_length: Optional[int] = None,
    ep: int = 1,
) -> None:
    """Convert a HF model directory into a Megatron ``release`` checkpoint at TP=``tp``, PP=``pp``
    (and EP=``ep``: each expert-parallel rank's file holds its experts).

    ``seq_length`` (default: the config's ``max_position_embeddings``) is the longest training
    sequence; a sliding window below it is refused. ``params_dtype`` None keeps the weights' own dtype.
    """
    check_save_dir(save_dir, load_dir)
    with hf_io.HFCheckpointReader(load_dir, allow_unsafe) as reader:
        config_path = os.path.join(load_dir, hf_io.CONFIG)
        args = args_from_hf_config(reader.config, model_type_hf, tp, pp, make_vocab_size_divisible_by,
                                   padded_vocab_size, where=config_path, seq_length=seq_length, ep=ep)
        spec = get_spec(args.model_type_hf)
        check_hf_tensors(reader, args, spec)
        dtype = _dtype(params_dtype, reader.dtype(HF_EMBEDDING), reader.file_of(HF_EMBEDDING))
        reader.stream(expected_hf_shapes(args, spec))

        def full_unit(unit):
            return {k: v.to(dtype) for k, v in hf_to_mg_unit(unit, reader.get, args, spec).items()}

        tokenizer = read_tokenizer_record(load_dir)
        # the same weights as the HF directory when the dtype loses nothing: adapters trained on that directory
        # (--load HF_DIR) are accepted on this conversion too (convert_ckpt.py --lora-load, --lora-load at training)
        source_dtype = reader.config.get("torch_dtype") or reader.config.get("dtype")
        exact = dtype in (torch.float32, reader.dtype(HF_EMBEDDING)) or source_dtype == _HF_DTYPE_NAMES[dtype]
        lineage = {lora_map.SAME_WEIGHTS_AS: [lora_map.fingerprint(load_dir)],
                   lora_map.HF_ORIGIN: os.path.abspath(load_dir)} if exact else None
        with staged_output(save_dir) as tmp:
            _write_sharded(tmp, args, reader.config, tokenizer, full_unit, f"hf->mg TP{tp} PP{pp} EP{ep}", lineage)
    log.info("wrote Megatron checkpoint %s (TP=%d, PP=%d, EP=%d, padded vocab %d); tokenizer %s", save_dir, tp, pp,
             ep, args.padded_vocab_size, describe(tokenizer) if tokenizer else
             f"not recorded ({load_dir} holds none): training cannot check that data or a reference use this model's")


def megatron_to_hf(
    load_dir: str,
    save_dir: str,
    params_dtype: Optional[str] = None,
    model_type_hf: Optional[str] = None,
    tokenizer_dir: Optional[str] = None,
    max_shard_bytes: int = 5 * 1024**3,
    allow_unsafe: bool = False,
    lora_dir: Optional[str] = None,
) -> None:
    """Merge a Megatron checkpoint into a HF model directory (``from_pretrained``-loadable).

    ``model_type_hf`` defaults to the one stored in the checkpoint args. Token ids
    (bos/eos/pad) come from ``tokenizer_dir``'s config.json if present, else from the
    HF config stored at conversion; ``tokenizer_dir``'s tokenizer files and
    generation_config.json are copied. LoRA adapters, of the checkpoint itself (a LoRA run's
    ``--save-hf --lora-merge``) or of the adapter checkpoint ``lora_dir``, are merged into the weights.
    ``params_dtype`` None keeps the checkpoint's dtype.
    """
    check_save_dir(save_dir, load_dir)
    source = MegatronCheckpoint(load_dir, allow_unsafe, model_type_hf)
    dtype = _dtype(params_dtype, _stored_dtype(source), source.files[(0, 0, 0)])
    if source.lora is not None and lora_dir is None and not source.holds_base():
        raise ConversionError(f"{load_dir} holds LoRA adapters only (a LoRA run's --save): pass their base as "
                              f"--load-dir and {load_dir} as --lora-load")
    adapters = _adapter_checkpoint(lora_dir, allow_unsafe, source.args) if lora_dir else \
        (source if source.lora is not None else None)
    args = _export_args(source.args, adapters if adapters is not source else None)
    spec = get_spec(model_type_hf or args.model_type_hf)
    if spec.name != args.model_type_hf:  # another family's layout: only where it keeps every setting and tensor
        lost = settings_lost(vars(args), spec, where=f"--model-type-hf {spec.name}")
        if lost:
            raise ConversionError(f"{load_dir} holds a {args.model_type_hf} model: as a {spec.hf_architecture} "
                                  f"(--model-type-hf {spec.name}) it would lose {'; '.join(lost)}; leave "
                                  f"--model-type-hf out (the checkpoint's {args.model_type_hf} is written)")
        log.warning("checkpoint was converted as %s, writing it as %s (the same model: every setting kept)",
                    args.model_type_hf, spec.name)
    tok_source = tokenizer_dir or _recorded_tokenizer(source)
    tok_files = hf_io.tokenizer_files(tok_source) if tok_source else []
    args = copy.copy(args)
    args.vocab_size = vocab_rows(source, tokenizer_dir)
    extra = dict(source.hf_config or {})
    # the token ids of the tokenizer written beside the weights (a training checkpoint records no config.json)
    if tok_source and os.path.isfile(os.path.join(tok_source, hf_io.CONFIG)):
        extra.update(hf_io.read_config(tok_source))
    config = hf_config_from_args(args, spec, _HF_DTYPE_NAMES[dtype], extra)
    has_generation_config = bool(tok_source) and os.path.isfile(os.path.join(tok_source, hf_io.GENERATION_CONFIG))

    with staged_output(save_dir) as tmp:
        writer = hf_io.ShardedSafetensorsWriter(tmp, max_shard_bytes)
        all_units = units(args)
        with _progress(len(all_units), f"mg->hf from TP{source.tp} PP{source.pp} EP{source.ep}") as bar:
            for unit in all_units:
                base, own = lora_map.split_adapters(source.unit(unit))
                if unit == FINAL and adapters is not None and adapters is not source:
                    base = _with_trained_head(base, adapters)
                hf = mg_to_hf_unit(unit, base, args, spec)
                if adapters is not None and unit != EMBEDDING and unit != FINAL:
                    if adapters is not source:
                        own = lora_map.split_adapters(adapters.unit(unit))[1]
                    hf = lora_map.merge_into_hf(hf, own, lora_map.scale_of(adapters.lora))
                writer.add_all({k: v.to(dtype) for k, v in hf.items()})
                source.release()
                bar.update()
        writer.close()
        config.save_pretrained(tmp)
        if has_generation_config:
            hf_io.copy_files(tok_source, [hf_io.GENERATION_CONFIG], tmp)
        else:
            from transformers import GenerationConfig

            GenerationConfig.from_model_config(config).save_pretrained(tmp)
        if tok_files:
            hf_io.copy_files(tok_source, tok_files, tmp)
    log.info("wrote HF model %s (%s, %s)%s", save_dir, config.architectures[0], _HF_DTYPE_NAMES[dtype],
             f" with the tokenizer the checkpoint records ({tok_source})" if tok_source and not tokenizer_dir else "")


def _recorded_tokenizer(source) -> Optional[str]:
    """The tokenizer directory ``source``'s record names, when it is still there with the same vocabulary: its
    files go beside the weights (``--tokenizer-dir`` overrides)."""
    return recorded_directory(source.tokenizer)


def megatron_to_megatron(
    load_dir: str, save_dir: str, tp: int, pp: int, padded_vocab_size: Optional[int] = None,
    allow_unsafe: bool = False, tokenizer_dir: Optional[str] = None, ep: int = 1, model_type_hf: Optional[str] = None,
    params_dtype: Optional[str] = None,
) -> None:
    """Reshard a Megatron checkpoint to TP=``tp``, PP=``pp``, EP=``ep`` (dtype kept, or ``params_dtype``'s: a model's
    weights only); ``model_type_hf`` names the family of one that records none (a Megatron-LM run's), which the
    resharded checkpoint records.

    The padded vocabulary follows Megatron's rule for the new TP size
    (``make_vocab_size_divisible_by * tp``) when the source used that rule, else the
    source's explicit size is kept (or ``padded_vocab_size`` when given). The real rows
    kept are :func:`vocab_rows` (the tokenizer's length when ``tokenizer_dir`` is given).

    A model is written as weights (a release checkpoint: iteration 0, no optimizer or RNG state) and
    records the fingerprints of the checkpoints it is a reshard of (``same_weights_as``: LoRA adapters
    trained on one of them are accepted on it). A LoRA run's checkpoint keeps its iteration and
    what a resume needs (:mod:`.adapter_reshard`).
    """
    check_save_dir(save_dir, load_dir)
    source = MegatronCheckpoint(load_dir, allow_unsafe, model_type_hf)
    dtype = _dtype(params_dtype) if params_dtype is not None else None
    if dtype is not None and source.lora is not None:
        raise ConversionError(f"--params-dtype {params_dtype}: {load_dir} is a LoRA run's adapter checkpoint, resharded "
                              "as it is (its adapters beside their fp32 master copy, for a resume); drop the flag, or "
                              "choose the dtype when exporting (--save-model-type hf)")
    args = copy.copy(source.args)
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size = tp, pp, ep
    args.vocab_size = vocab_rows(source, tokenizer_dir)
    divisible = args.make_vocab_size_divisible_by
    source_rule = megatron_padded_vocab_size(args.vocab_size, divisible, source.tp)
    if padded_vocab_size is None and source.args.padded_vocab_size != source_rule:
        padded_vocab_size = source.args.padded_vocab_size  # explicit at conversion: keep it
    args.padded_vocab_size = resolve_padded_vocab(args.vocab_size, tp, divisible, padded_vocab_size)
    check_parallel_sizes(args, tp, pp, ep=ep)
    layouts = f"TP{source.tp} PP{source.pp} EP{source.ep} -> TP{tp} PP{pp} EP{ep}"
    if source.lora is not None:
        plan = adapter_reshard.plan(source, args)  # every check before anything is written
        with staged_output(save_dir) as tmp:
            adapter_reshard.write(tmp, plan)
        log.info("wrote LoRA adapter checkpoint %s at iteration %s (%s); RNG states are per rank of the old layout "
                 "and not carried: the resumed run draws dropout afresh from --seed", save_dir, source.iteration,
                 layouts)
        return

    same_padding = args.padded_vocab_size == source.args.padded_vocab_size

    def full_unit(unit):
        full = source.unit(unit)
        source.release()
        for name in (MG_EMBEDDING, MG_OUTPUT):
            if name in full and not same_padding:  # re-pad for the new size
                full[name] = full[name][: args.vocab_size]
        if dtype is not None:
            full = {k: v.to(dtype) if v.is_floating_point() else v for k, v in full.items()}
        return full  # same size: padded rows kept as trained, so resharding is exact

    tokenizer = read_tokenizer_record(tokenizer_dir) if tokenizer_dir else source.tokenizer
    # the same weights unless --params-dtype loses precision (adapters trained on the source would not fit them)
    exact = dtype in (None, torch.float32, _stored_dtype(source))
    lineage = {lora_map.SAME_WEIGHTS_AS: [lora_map.fingerprint(load_dir), *source.same_weights_as],
               lora_map.HF_ORIGIN: source.hf_origin} if exact else None
    with staged_output(save_dir) as tmp:
        _write_sharded(tmp, args, source.hf_config, tokenizer, full_unit, f"mg {layouts}", lineage)
        record = os.path.join(load_dir, layout.RUN_CONFIG)
        if os.path.isfile(record):  # what its run took from its HF model (dropout) holds for a --load of the reshard
            shutil.copy2(record, os.path.join(tmp, layout.RUN_CONFIG))
    log.info("wrote Megatron checkpoint %s (TP=%d, PP=%d, EP=%d)", save_dir, tp, pp, ep)
    if source.iteration != layout.RELEASE:
        log.warning("%s held iteration %s of a training run: %s holds its weights alone (a release checkpoint, "
                    "iteration 0); the optimizer state, schedule and data position stay with the old layout, so a run "
                    "from it starts over (--finetune); to continue that run, resume at TP=%d, PP=%d%s", load_dir,
                    source.iteration, save_dir, source.tp, source.pp,
                    f", --expert-model-parallel-size {source.ep}" if source.ep > 1 else "")


# --------------------------------------------------------------------------- LoRA adapters
def _export_args(base_args, adapters: Optional[MegatronCheckpoint]):
    """The merged model's arguments: the base's, or a reward model's when the adapter checkpoint ``adapters`` holds
    a score head trained in full beside them (a language model as base then exports a reward model)."""
    if adapters is None or not getattr(adapters.args, "reward_head", False):
        return base_args
    args = copy.copy(base_args)
    args.reward_head, args.reward_pad_token_id = True, adapters.args.reward_pad_token_id
    return args


def _with_trained_head(final: Dict[str, torch.Tensor], adapters: MegatronCheckpoint) -> Dict[str, torch.Tensor]:
    """The base's final unit (Megatron names) with the adapter checkpoint's score head in place of its own head."""
    head = lora_map.trained_in_full(adapters.unit(FINAL)) if getattr(adapters.args, "reward_head", False) else {}
    if not head:
        return final
    return {**{k: v for k, v in final.items() if k not in (MG_OUTPUT, *head)}, **head}


# model shape arguments the adapters and their base must share
_ADAPTER_SHAPE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                       "kv_channels")


def _adapter_checkpoint(lora_dir: str, allow_unsafe: bool, base_args=None) -> MegatronCheckpoint:
    """The LoRA run's adapter checkpoint ``lora_dir``, checked against the base's shape."""
    if lora_map.is_peft_dir(lora_dir):  # else: "no latest_checkpointed_iteration.txt", which says not what to do
        raise ConversionError(f"--lora-load {lora_dir}: a PEFT adapter directory, not a LoRA run's checkpoint (its "
                              "--save), which is what convert_ckpt.py exports: merge it with peft's "
                              f"PeftModel.from_pretrained(BASE, {lora_dir!r}).merge_and_unload(), or train on from it "
                              f"with posttrain.py --lora-load {lora_dir} (its --save then converts)")
    adapters = MegatronCheckpoint(lora_dir, allow_unsafe)
    if adapters.lora is None:
        raise ConversionError(f"--lora-load {lora_dir}: not a LoRA checkpoint (its files hold no 'lora' record: "
                              "a LoRA run's --save writes one)")
    if base_args is not None:
        differ = [f"{k}: adapters {getattr(adapters.args, k)}, base {getattr(base_args, k)}"
                  for k in _ADAPTER_SHAPE_ARGS if getattr(adapters.args, k, None) != getattr(base_args, k, None)]
        if differ:
            raise ConversionError(f"--lora-load {lora_dir}: the adapters belong to a model of another shape "
                                  f"({'; '.join(differ)})")
    return adapters


def megatron_to_peft(lora_dir: str, save_dir: str, params_dtype: Optional[str] = None, base_model: Optional[str] = None,
                     allow_unsafe: bool = False, tokenizer_dir: Optional[str] = None) -> None:
    """A LoRA run's adapter checkpoint (any TP/PP) -> a PEFT adapter directory (``PeftModel.from_pretrained``).

    ``base_model`` goes into ``adapter_config.json`` (``base_model_name_or_path``).
    """
    check_save_dir(save_dir, lora_dir)
    source = _adapter_checkpoint(lora_dir, allow_unsafe)
    tensors = {}
    for layer in range(source.args.num_layers):
        tensors.update(lora_map.split_adapters(source.unit(layer))[1])
    reward = bool(getattr(source.args, "reward_head", False))
    if reward:  # the score head trained in full beside the adapters: PEFT's modules_to_save
        tensors.update(lora_map.trained_in_full(source.unit(FINAL)))
    dtype = _dtype(params_dtype, next((t.dtype for t in tensors.values()), None), source.files[(0, 0, 0)])
    if getattr(source.args, "num_experts", None) and any(".mlp." in k for k in tensors):
        log.warning("%s: MoE model with adapters on dense layers' MLPs: peft (0.21, transformers 5) re-targets "
                    "gate_proj/up_proj/down_proj of MoE families to the fused experts and skips them; merge instead "
                    "(--lora-merge), or adapt only linear_qkv linear_proj on MoE models", save_dir)
    # the tokenizer the adapters were trained with (preprocessing may have added a template's tokens), as PEFT
    # trainers save it beside the adapters
    tok_source = tokenizer_dir or recorded_directory(source.tokenizer)
    base_model = base_model or lora_map.peft_base_model(source.lora)
    if base_model is None:
        log.warning("%s: base_model_name_or_path left empty: the adapters' base %s is a Megatron checkpoint with no "
                    "HF directory of the same weights (one converted from HF in a lower precision, or trained): load "
                    "them with peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE_HF), DIR) on "
                    "its HF export, or merge them (--lora-merge)", save_dir,
                    ((source.lora or {}).get("base") or {}).get("path"))
    with staged_output(save_dir) as tmp:
        lora_map.write_peft_dir(tmp, tensors, source.lora, base_model, dtype)
        if tok_source:
            hf_io.copy_files(tok_source, hf_io.tokenizer_files(tok_source), tmp)
    log.info("wrote PEFT adapter %s (%d tensors, r=%d, base %s)", save_dir, len(tensors), source.lora["r"],
             base_model)
    if reward:
        log.info("%s is a reward model's: its score head is in modules_to_save; load it on its base as a sequence "
                 "classifier: peft.PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(BASE, "
                 "num_labels=1, pad_token_id=%s), %r)", save_dir, source.args.reward_pad_token_id, save_dir)


def hf_merge_lora(hf_dir: str, lora_dir: str, save_dir: str, params_dtype: Optional[str] = None,
                  tokenizer_dir: Optional[str] = None, max_shard_bytes: int = 5 * 1024**3,
                  allow_unsafe: bool = False) -> None:
    """A HF base plus a LoRA run's adapters -> a HF model with the adapters merged, one unit at a time."""
    check_save_dir(save_dir, hf_dir)
    with hf_io.HFCheckpointReader(hf_dir, allow_unsafe) as reader:
        args = args_from_hf_config(reader.config, None, 1, 1, where=os.path.join(hf_dir, hf_io.CONFIG))
        spec = get_spec(args.model_type_hf)
        check_hf_tensors(reader, args, spec)
        dtype = _dtype(params_dtype, reader.dtype(HF_EMBEDDING), reader.file_of(HF_EMBEDDING))
        reader.stream(expected_hf_shapes(args, spec))  # each base shard let go once read, as hf->mg does
        adapters = _adapter_checkpoint(lora_dir, allow_unsafe, args)
        scale = lora_map.scale_of(adapters.lora)
        args = _export_args(args, adapters)
        config = hf_config_from_args(args, spec, _HF_DTYPE_NAMES[dtype], reader.config)
        # the tokenizer the adapters were trained with (preprocessing may have extended the base's), else the base's
        tok_dir = tokenizer_dir or recorded_directory(adapters.tokenizer) or hf_dir
        with staged_output(save_dir) as tmp:
            writer = hf_io.ShardedSafetensorsWriter(tmp, max_shard_bytes)
            for unit in units(args):
                # a reward model's adapters: the head trained beside them, whatever the base holds (its HF name is
                # its Megatron name)
                head = lora_map.trained_in_full(adapters.unit(FINAL)) if unit == FINAL else {}
                hf = {name: head[name] if name in head else reader.get(name)
                      for name in hf_unit_shapes(unit, args, spec)}
                if unit != EMBEDDING and unit != FINAL:
                    hf = lora_map.merge_into_hf(hf, lora_map.split_adapters(adapters.unit(unit))[1], scale)
                writer.add_all({k: v.to(dtype) for k, v in hf.items()})
                adapters.release()  # the adapters' rank files too (read again when needed)
            writer.close()
            config.save_pretrained(tmp)
            for d in (hf_dir, tok_dir):
                if os.path.isfile(os.path.join(d, hf_io.GENERATION_CONFIG)):
                    hf_io.copy_files(d, [hf_io.GENERATION_CONFIG], tmp)
            tokenizer = hf_io.tokenizer_files(tok_dir) if tok_dir != hf_dir else \
                [f for f in hf_io.TOKENIZER_FILES if os.path.isfile(os.path.join(hf_dir, f))]  # the base's, if any
            hf_io.copy_files(tok_dir, tokenizer, tmp)
    log.info("wrote HF model %s: %s with the LoRA adapters of %s merged", save_dir, hf_dir, lora_dir)


def lora_export(load_type: str, load_dir: str, lora_dir: str, save_dir: str, merge: bool,
                params_dtype: Optional[str] = None, tokenizer_dir: Optional[str] = None,
                max_shard_bytes: int = 5 * 1024**3, allow_unsafe: bool = False) -> None:
    """``convert_ckpt.py --lora-load``: a LoRA run's adapters on their base (checked by content) as a PEFT
    adapter directory, or merged into the base (``--lora-merge``, MindSpeed-LLM's converter does this)."""
    adapters = _adapter_checkpoint(lora_dir, allow_unsafe)
    try:
        lora_map.check_base(adapters.lora, load_dir, lora_map.fingerprint(load_dir), f"--lora-load {lora_dir}",
                            flag="--load-dir", same_here=lora_map.same_weights_as(load_dir))
    except (OSError, ConversionError) as e:
        raise ConversionError(str(e)) from None
    if not merge:
        megatron_to_peft(lora_dir, save_dir, params_dtype, os.path.abspath(load_dir) if load_type == "hf" else None,
                         allow_unsafe, tokenizer_dir)
    elif load_type == "hf":
        hf_merge_lora(load_dir, lora_dir, save_dir, params_dtype, tokenizer_dir, max_shard_bytes, allow_unsafe)
    else:
        megatron_to_hf(load_dir, save_dir, params_dtype, tokenizer_dir=tokenizer_dir, max_shard_bytes=max_shard_bytes,
                       allow_unsafe=allow_unsafe, lora_dir=lora_dir)


# --------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Convert checkpoints between Hugging Face and Megatron (and reshard Megatron ones, a LoRA run's "
                    "adapter checkpoint too: --load-model-type mg --save-model-type mg --load-dir SAVE).",
        allow_abbrev=False)  # MindSpeed-LLM's --model-type GPT must not be read as --model-type-hf
    # MindSpeed-LLM's defaults: hf -> mg (a Megatron --load-dir given as hf is named, with the flag to pass)
    p.add_argument("--load-model-type", choices=["hf", "mg"], default="hf", help="default: hf")
    p.add_argument("--save-model-type", choices=["mg", "hf"], default="mg", help="default: mg")
    p.add_argument("--model-type-hf", choices=sorted({*MODEL_SPECS, *MINDSPEED_MODEL_TYPES}), default=None,
        help="architecture; default: detected from config.json (hf) or the checkpoint args (mg); MindSpeed-LLM's "
             f"names too ({', '.join(f'{k} = {v}' for k, v in sorted(MINDSPEED_MODEL_TYPES.items()))})")
    p.add_argument("--load-dir", required=True)
    p.add_argument("--save-dir", required=True, help="must not exist or be empty")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1)
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    p.add_argument("--target-expert-parallel-size", type=int, default=1,
                   help="expert-parallel ranks of the written Megatron checkpoint (MoE models)")
    p.add_argument("--params-dtype", choices=sorted(DTYPES), default=None,
                   help="dtype of the written weights (hf->mg, mg->hf, mg->mg); default: the source's own (a bf16 "
                        "model stays bf16, bit for bit)")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--seq-length", type=int, default=None,
                   help="hf->mg: the longest training sequence (default max_position_embeddings); a sliding_window "
                        "below it is refused")
    p.add_argument("--padded-vocab-size", type=int, default=None,
                   help="explicit padded vocabulary (>= the HF vocab, divisible by TP)")
    p.add_argument("--tokenizer-dir", default=None,
                   help="the tokenizer used in training (P_tokenizer/ when preprocessing added tokens): its files are "
                        "copied into the HF output and at least len(tokenizer) vocabulary rows are kept (mg->hf, mg->mg)")
    p.add_argument("--max-shard-size-mb", type=int, default=5120, help="HF output shard size")
    p.add_argument("--allow-unsafe-checkpoint-load", action="store_true",
                   help="read input files that need full pickle (they can run code): only for a legacy checkpoint "
                        "you trust; refused by default")
    p.add_argument("--lora-load", default=None, metavar="DIR",
                   help="a LoRA run's adapter checkpoint (its --save) on the base --load-dir (hf or mg; checked by "
                        "content): written as a PEFT adapter directory (--save-model-type hf)")
    p.add_argument("--lora-merge", action="store_true",
                   help="with --lora-load: write the base with the adapters merged (a transformers model) instead")
    g = p.add_argument_group("MindSpeed-LLM's converter flags")
    g.add_argument("--hf-cfg-dir", default=None, metavar="DIR",
                   help="--save-model-type hf: the Hugging Face directory the model came from; its tokenizer, if it "
                        "has one, is written beside the weights (as --tokenizer-dir, which wins when given); "
                        "config.json is written from the checkpoint's own record")
    g.add_argument("--lora-r", type=int, default=None, help="with --lora-load: checked against the adapters' record")
    g.add_argument("--lora-alpha", type=float, default=None, help="with --lora-load: checked against the record")
    g.add_argument("--lora-target-modules", nargs="+", default=None,
                   help="with --lora-load: checked against the adapters' record")
    g.add_argument("--save-lora-to-hf", action="store_true",
                   help="--load-dir is a LoRA run's adapter checkpoint: write its adapters alone as a PEFT directory "
                        "(with --lora-load: what that writes without --lora-merge)")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="accepted: the written experts load with or without TE's grouped GEMM")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="experts are split like the other weights: only --target-tensor-parallel-size's value")
    for flag in _REFUSED_LAYOUTS:
        g.add_argument(flag, default=None, help="refused: uneven or virtual pipeline stages are not built here"
                       + (" (the even split is accepted)" if flag == "--num-layer-list" else ""))
    # its first converter's (convert_ckpt.py, not _v2): accepted, the family's config.json decides the layout
    g.add_argument("--use-mcore-models", action="store_true", help="accepted: checkpoints are megatron-core's")
    g.add_argument("--model-type", choices=["GPT"], default=None, help="accepted: GPT models only")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="accepted: the q/k/v biases follow the family (qwen2 has them)")
    g.add_argument("--spec", nargs="+", default=None, help="accepted: qwen3's layer spec follows the family")
    g.add_argument("--tokenizer-model", default=None, metavar="FILE",
                   help="a tokenizer file: its directory serves as --tokenizer-dir (mg->hf, mg->mg)")
    g.add_argument("--ai-framework", choices=["pytorch", "mindspore"], default=None,
                   help="accepted: the conversion runs on PyTorch and reads and writes the same files")
    return p


_REFUSED_LAYOUTS = ("--noop-layers", "--num-layer-list", "--num-layers-per-virtual-pipeline-stage")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _check_load_type(args) -> None:
    """``--load-model-type`` says what ``--load-dir`` holds (a Hugging Face directory given as mg wrote a PEFT
    export with no base, silently)."""
    try:
        megatron = os.path.isdir(args.load_dir) and layout.read_tracker(args.load_dir) is not None
    except ValueError:
        megatron = True  # a tracker that does not read: the loader names it
    hf = os.path.isdir(args.load_dir) and hf_io.looks_like_hf(args.load_dir)
    if args.load_model_type == "mg" and hf and not megatron:
        raise ConversionError(f"--load-dir {args.load_dir} is a Hugging Face model directory (config.json, "
                              "*.safetensors), not a Megatron checkpoint: pass --load-model-type hf")
    if args.load_model_type == "hf" and megatron and not hf:
        raise ConversionError(f"--load-dir {args.load_dir} is a Megatron checkpoint (it has "
                              f"{layout.TRACKER}): pass --load-model-type mg")


def _loaded_family(args) -> Optional[str]:
    """The family --load-dir holds (config.json's, or the Megatron checkpoint's record); None when unknown."""
    try:
        if args.load_model_type == "hf":
            return detect_model_type(hf_io.read_config(args.load_dir), os.path.join(args.load_dir, hf_io.CONFIG))
        return MegatronCheckpoint(args.load_dir, args.allow_unsafe_checkpoint_load).args.model_type_hf
    except (ConversionError, OSError, ValueError, AttributeError):
        return None  # the conversion itself names what is wrong with --load-dir


def _even_layer_list(args, value: str) -> bool:
    """Whether ``--num-layer-list`` names the even split of --load-dir's layers over the written (hf->mg, mg->mg) or
    read (mg->hf) pipeline stages: ``1,1`` for 2 layers at PP 2, the split built anyway."""
    try:
        counts = [int(n) for n in value.split(",")]
        if args.load_model_type == "hf":
            layers = hf_io.read_config(args.load_dir)["num_hidden_layers"]
        else:
            source = MegatronCheckpoint(args.load_dir, args.allow_unsafe_checkpoint_load)
            layers = source.args.num_layers
        stages = args.target_pipeline_parallel_size if args.save_model_type == "mg" else source.pp
    except (ConversionError, OSError, ValueError, KeyError, TypeError):
        return False  # refused as uneven; the conversion names what is wrong with --load-dir
    return len(counts) == stages and sum(counts) == layers and len(set(counts)) == 1


def _mindspeed_flags(args) -> None:
    """MindSpeed-LLM's converter flags: translated to ours, or refused by name."""
    given = args.model_type_hf
    alias = given in MINDSPEED_MODEL_TYPES
    args.model_type_hf = MINDSPEED_MODEL_TYPES.get(given, given)
    if alias and not args.lora_load and not args.save_lora_to_hf:
        # its names are converter settings more than families (its Qwen2.5 scripts pass llama2 with
        # --add-qkv-bias): the family --load-dir holds is converted
        found = _loaded_family(args)
        if found and found != args.model_type_hf:
            log.info("--model-type-hf %s (MindSpeed-LLM's name for %s): --load-dir holds a %s model, converted as "
                     "one", given, args.model_type_hf, found)
            args.model_type_hf = found
    if args.tokenizer_model is not None:
        if not os.path.exists(args.tokenizer_model):
            raise ConversionError(f"--tokenizer-model {args.tokenizer_model}: no such file")
        if args.tokenizer_dir is None and args.load_model_type == "mg":
            args.tokenizer_dir = os.path.dirname(os.path.abspath(args.tokenizer_model))
    if args.load_model_type == "mg" and args.save_model_type == "hf" and os.path.isdir(args.save_dir) \
            and hf_io.looks_like_hf(args.save_dir):
        # its first converter's --save-dir is the model's HF directory, the weights written into mg2hf/ beside it
        original = args.save_dir
        args.save_dir = os.path.join(original, "mg2hf")
        if args.hf_cfg_dir is None:
            args.hf_cfg_dir = original
        log.info("--save-dir %s is a Hugging Face model directory: writing into %s (as MindSpeed-LLM does), its "
                 "tokenizer beside the weights", original, args.save_dir)
    for flag in _REFUSED_LAYOUTS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if flag == "--num-layer-list" and value is not None and _even_layer_list(args, value):
            continue  # the stages the pipeline size gives (posttrain.py takes it too)
        if value is not None:
            raise ConversionError(f"{flag} {value}: uneven or virtual pipeline stages are not built here; "
                                  "--num-layers must divide over --target-pipeline-parallel-size")
    etp = args.expert_tensor_parallel_size
    if etp is not None and etp != args.target_tensor_parallel_size:
        raise ConversionError(f"--expert-tensor-parallel-size {etp}: experts are split over the tensor-parallel "
                              f"group here, so it must equal --target-tensor-parallel-size "
                              f"{args.target_tensor_parallel_size} (or be dropped)")
    if args.hf_cfg_dir is not None:
        if args.save_model_type != "hf":
            raise ConversionError("--hf-cfg-dir names the Hugging Face directory a Megatron checkpoint came from, "
                                  "read when one is written back (--save-model-type hf)")
        if not os.path.isdir(args.hf_cfg_dir):
            raise ConversionError(f"--hf-cfg-dir {args.hf_cfg_dir}: no such directory")
        has_tokenizer = any(os.path.exists(os.path.join(args.hf_cfg_dir, name)) for name in _TOKENIZER_FILES)
        if args.tokenizer_dir is None and has_tokenizer:
            args.tokenizer_dir = args.hf_cfg_dir
    if args.save_lora_to_hf:
        if args.lora_merge or args.save_model_type != "hf":
            raise ConversionError("--save-lora-to-hf writes the adapters alone as a PEFT directory: --save-model-type "
                                  "hf, without --lora-merge")
    lora_flags = [f for f, v in (("--lora-r", args.lora_r), ("--lora-alpha", args.lora_alpha),
                                 ("--lora-target-modules", args.lora_target_modules)) if v is not None]
    if lora_flags and not (args.lora_load or args.save_lora_to_hf):
        raise ConversionError(f"{', '.join(lora_flags)}: the LoRA settings are read from the adapters' checkpoint "
                              "(--lora-load, or --load-dir with --save-lora-to-hf) or from the run's flags at "
                              "training")


def _check_lora_settings(args, record: dict, lora_dir: str) -> None:
    """``--lora-r``/``--lora-alpha``/``--lora-target-modules`` given with ``--lora-load``: its record agrees."""
    differ = []
    if args.lora_r is not None and args.lora_r != record.get("r"):
        differ.append(f"--lora-r {args.lora_r} (record: {record.get('r')})")
    if args.lora_alpha is not None and args.lora_alpha != record.get("alpha"):
        differ.append(f"--lora-alpha {args.lora_alpha:g} (record: {record.get('alpha')})")
    if args.lora_target_modules is not None:
        try:
            mine = sorted(f"{linear}.{p}" for linear, p in resolve_targets(args.lora_target_modules))
        except ValueError as e:
            raise ConversionError(str(e)) from None
        if mine != sorted(record.get("targets") or []):
            differ.append(f"--lora-target-modules {' '.join(args.lora_target_modules)} (record: "
                          f"{' '.join(record.get('targets') or [])})")
    if differ:
        raise ConversionError(f"{lora_dir} was trained with other LoRA settings: {'; '.join(differ)}; "
                              "drop the flags (the record is used) or pass the adapters they describe")


def _on_sigterm(signum, frame) -> None:
    """SIGTERM (a scheduler's stop, ``timeout``, ``kill``) unwinds as Ctrl-C does: the partial output in the hidden
    temporary directory beside --save-dir (up to the model's size) is removed instead of left behind."""
    print(f"convert_ckpt: stopped by signal {signum}: the partial output is removed, --save-dir is not written",
          file=sys.stderr)
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if in_main_thread else None
    try:
        _mindspeed_flags(args)
        _check_load_type(args)
        if args.lora_merge and not args.lora_load:
            raise ConversionError("--lora-merge needs --lora-load DIR, the adapters to merge into --load-dir")
        if args.lora_load and args.save_model_type != "hf":
            raise ConversionError(
                f"--lora-load: adapters are exported to Hugging Face (--save-model-type hf: a PEFT adapter directory, "
                f"or merged with --lora-merge); to reshard the adapter checkpoint, pass it alone: --load-model-type mg "
                f"--save-model-type mg --load-dir {args.lora_load} --target-tensor-parallel-size N ...")
        if args.save_lora_to_hf and not args.lora_load:  # MindSpeed-LLM's lora2hf: the adapters alone, no base
            source = _adapter_checkpoint(args.load_dir, args.allow_unsafe_checkpoint_load)
            if any(v is not None for v in (args.lora_r, args.lora_alpha, args.lora_target_modules)):
                _check_lora_settings(args, source.lora, args.load_dir)
            megatron_to_peft(args.load_dir, args.save_dir, args.params_dtype,
                             os.path.abspath(args.hf_cfg_dir) if args.hf_cfg_dir else None,
                             args.allow_unsafe_checkpoint_load)
        elif args.lora_load:
            if any(v is not None for v in (args.lora_r, args.lora_alpha, args.lora_target_modules)):
                _check_lora_settings(args, _adapter_checkpoint(args.lora_load, args.allow_unsafe_checkpoint_load).lora,
                                     args.lora_load)
            lora_export(args.load_model_type, args.load_dir, args.lora_load, args.save_dir, args.lora_merge,
                        args.params_dtype, args.tokenizer_dir, args.max_shard_size_mb * 1024**2,
                        args.allow_unsafe_checkpoint_load)
        elif args.load_model_type == "hf" and args.save_model_type == "mg":
            hf_to_megatron(args.load_dir, args.save_dir, args.target_tensor_parallel_size,
                           args.target_pipeline_parallel_size, args.params_dtype, args.model_type_hf,
                           args.make_vocab_size_divisible_by, args.padded_vocab_size,
                           args.allow_unsafe_checkpoint_load, args.seq_length, args.target_expert_parallel_size)
        elif args.load_model_type == "mg" and args.save_model_type == "hf":
            megatron_to_hf(args.load_dir, args.save_dir, args.params_dtype, args.model_type_hf,
                           args.tokenizer_dir, args.max_shard_size_mb * 1024**2, args.allow_unsafe_checkpoint_load)
        elif args.load_model_type == "mg" and args.save_model_type == "mg":
            megatron_to_megatron(args.load_dir, args.save_dir, args.target_tensor_parallel_size,
                                 args.target_pipeline_parallel_size, args.padded_vocab_size,
                                 args.allow_unsafe_checkpoint_load, args.tokenizer_dir,
                                 args.target_expert_parallel_size, args.model_type_hf, args.params_dtype)
        else:
            raise ConversionError("--load-model-type hf --save-model-type hf: nothing to convert")
    except ConversionError as e:
        print(f"convert_ckpt: error: {e}", file=sys.stderr)
        return 2
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":  # python -m (it printed nothing and exited 0)
    sys.exit(main())

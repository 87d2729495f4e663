"""``posttrain.py --data-path data.jsonl``: raw files tokenised and packed first, once, then trained.

A ``--data-path`` naming files or a directory (any format ``preprocess_data.py`` reads) instead
of a packed prefix is preprocessed by ``preprocess_data.py``'s own code and cache
(:func:`mindspeed_pack.datasets.preprocess.run`):

* its flags (``--handler-name``, ``--map-keys``, ``--pack``, ...) are posttrain.py flags too, the
  very argparse actions of its parser (:func:`raw_data_args`); the flags both halves share
  (``--seq-length``, ``--tokenizer-name-or-path``, ``--prompt-type``, ``--neat-pack``, ``--seed``)
  are given once, so preprocessing and training cannot disagree;
* the packs go to ``CACHE/<name>-<hash of the inputs' paths and the preprocessing flags>`` (``CACHE``:
  ``--data-cache-path``, default ``mindspeed_pack_cache/`` beside the first input); the sidecar's
  cache key (the inputs' content, tokenizer, template, arguments) decides whether they are reused
  ("cache hit") or rebuilt (an edited file); two jobs on the same cache build it once (the second waits for
  the first, then reuses it), and a killed build's temporaries are removed by the next run;
* rank 0 preprocesses (with its progress bar) while the other ranks wait, then tells them the prefix:
  every rank trains on the same packs (one file system shared by the nodes, as for ``--save``); under
  ``--no-shared-storage`` (MindSpeed-LLM's flag) each node's first rank preprocesses onto its node's disk, the
  same files (the same inputs and flags give the same bytes), and tells its node's ranks.

A packed prefix given as before is used as it is; the preprocessing flags the user gave are
checked against its sidecar (the shared ones are checked by ``data.sidecar_checks.check_data``).
"""
from __future__ import annotations

import copy
import datetime
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Optional

from mindspeed_pack.config.resolved_config import json_flag_value
from mindspeed_pack.datasets.packed_documents import DataError, data_prefixes, dataset_paths, read_meta
from mindspeed_pack.runtime.error_scope import scoped

log = logging.getLogger(__name__)

# preprocess_data.py flags that only preprocessing reads (posttrain.py takes them for raw --data-path files)
PREPROCESS_ONLY = ("handler_name", "map_keys", "chat_template", "chat_template_kwargs", "reasoning_history",
                   "enable_thinking", "prompt_type_path", "pack", "append_eod", "pad_to_multiple_of", "workers",
                   "skip_bad_rows", "overwrite_cache", "placeholder_token", "reward_tokens")
# pretrain_gpt.py's: a pretraining handler's flags (documents, not packs)
PRETRAIN_ONLY = ("handler_name", "map_keys", "json_keys", "add_bos", "append_eod", "workers", "skip_bad_rows",
                 "overwrite_cache")
# flags of both halves, given once
SHARED = ("seq_length", "prompt_type", "tokenizer_name_or_path", "neat_pack", "seed")
# preprocessing flags that shape the packs: checked against a packed prefix's sidecar when given
RECORDED = ("handler_name", "map_keys", "chat_template", "chat_template_kwargs", "reasoning_history", "pack",
            "append_eod", "pad_to_multiple_of", "enable_thinking")
# recorded only when set: a sidecar without it was written without the flag
RECORDED_WHEN_SET = ("enable_thinking",)
CACHE_DIR = "mindspeed_pack_cache"
SPLITS = ("train", "valid", "test")
WAIT_HOURS = 24.0  # how long the other ranks wait for rank 0's preprocessing


def raw_data_args(parser, pretrain: bool = False):
    """Add preprocess_data.py's own flag definitions (:data:`PREPROCESS_ONLY`; ``pretrain``: pretrain_gpt.py's
    :data:`PRETRAIN_ONLY`, ``--handler-name`` GeneralPretrainHandler only) to ``parser``."""
    from mindspeed_pack.data.handlers import PRETRAIN
    from mindspeed_pack.datasets.preprocess import build_parser

    source = {action.dest: action for action in build_parser()._actions}
    group = parser.add_argument_group("raw --data-path files: preprocessed first, as preprocess_data.py does "
                                      "(--seq-length, --tokenizer-name-or-path, --prompt-type, --neat-pack, --seed "
                                      "serve both)" if not pretrain else
                                      "raw --data-path files: tokenised into documents first, as preprocess_data.py "
                                      "--handler-name GeneralPretrainHandler does (--tokenizer-name-or-path serves "
                                      "both)")
    if not pretrain:  # Megatron-LM's pretraining text flag: named (prepare), not argparse's "unrecognized"
        action = copy.copy(source["json_keys"])
        action.help = "refused: pretraining documents' text field; train them with pretrain_gpt.py"
        group._add_action(action)
    for dest in PRETRAIN_ONLY if pretrain else PREPROCESS_ONLY:
        action = copy.copy(source[dest])
        if pretrain and dest == "handler_name":
            action.default, action.choices = PRETRAIN, [PRETRAIN]
        elif dest == "handler_name" and action.default is None:
            action.default = "AlpacaStyleInstructionHandler"  # posttrain.py's raw rows: preprocess_data.py's default
        group._add_action(action)
    return parser


# ---------------------------------------------------------------------------- which --data-path
def _is_raw(path: str) -> bool:
    from mindspeed_pack.data.readers import FORMATS

    if os.path.isfile(dataset_paths(path)["input_ids"] + ".bin"):
        return False  # a packed prefix
    if os.path.isfile(path + ".bin") and os.path.isfile(path + ".idx"):
        return False  # an indexed dataset (pretraining documents), beside which a cache directory may share its name
    return os.path.exists(path) or Path(path).suffix.lower() in FORMATS


def _is_number(text: str) -> bool:
    return blend_weights([text, ""]) is not None


def raw_inputs(args) -> Optional[list]:
    """The raw files/directories of ``--data-path`` (None: packed prefixes, as before)."""
    for name in SPLITS:
        raw = [p for p in getattr(args, f"{name}_data_path", None) or [] if _is_raw(p)]
        if raw:
            raise DataError(f"--{name}-data-path {raw[0]}: raw files are preprocessed from --data-path only; "
                            f"preprocess this split with preprocess_data.py and pass its --output-prefix")
    paths = args.data_path or []
    raw = [p for p in paths if _is_raw(p)]
    if not raw:
        return None
    if len(raw) != len(paths):
        packed = next(p for p in paths if p not in raw)
        if _is_number(packed):
            raise DataError(f"--data-path {' '.join(paths)}: {packed} reads as a blend's weight; a blend is weight-path "
                            "pairs, every path weighted ('0.3 A 0.7 B'), and only pretrain_gpt.py takes one")
        raise DataError(f"--data-path mixes raw files ({raw[0]}) and a packed prefix ({packed}): give one or the other")
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        if getattr(args, "dry_run", False):  # a dry run checks a job's flags before its data exists (the plan: NOT FOUND)
            log.warning("--dry-run: --data-path %s: no such file or directory (nothing preprocessed)", missing[0])
            return None
        raise DataError(f"--data-path {missing[0]}: no such file or directory")
    return list(paths)


# ---------------------------------------------------------------------------- preprocessing
def _effective_map_keys(handler: str, map_keys):
    """The column and role names ``handler`` reads under ``map_keys`` (its defaults where not given); the flag's
    value as given where it does not resolve (preprocessing then says why)."""
    from mindspeed_pack.data.errors import PreprocessError
    from mindspeed_pack.data.handlers import resolve_map_keys

    value = json_flag_value(map_keys)
    if value is not None and not isinstance(value, dict):
        return value
    try:
        return resolve_map_keys(handler, value)[0]
    except PreprocessError:
        return value


def preprocess_namespace(args, inputs: list, pretrain: bool = False):
    """preprocess_data.py's arguments for ``inputs``: its defaults, this run's shared and preprocessing flags
    (``pretrain``: pretrain_gpt.py's, pretraining documents)."""
    from mindspeed_pack.data.handlers import PRETRAIN, PROCESS_REWARD, canonical_handler
    from mindspeed_pack.datasets.preprocess import _OUTPUT_ARGS, build_parser

    ns = build_parser().parse_args(["--input", *inputs, "--output-prefix", "unset"])
    for dest in PRETRAIN_ONLY + ("tokenizer_name_or_path", "seed") if pretrain else SHARED + PREPROCESS_ONLY:
        setattr(ns, dest, getattr(args, dest))
    ns.pack = False if pretrain else bool(args.pack or args.neat_pack)  # --neat-pack implies packing
    ns.tokenizer_type = "PretrainedFromHF"
    ns.handler_name, ns.map_keys = canonical_handler(ns.handler_name, ns.map_keys)
    if ns.handler_name == PRETRAIN and not pretrain:
        raise DataError("--handler-name GeneralPretrainHandler writes pretraining documents: train on them with "
                        "pretrain_gpt.py (which preprocesses raw --data-path files too)")
    if not pretrain:
        _check_handler_for_stage(getattr(args, "stage", "sft"), ns.handler_name)
    # the prefix names what shapes the packs, so runs with other flags keep their own cache
    identity = {"inputs": [os.path.abspath(p) for p in inputs], "tokenizer": ns.tokenizer_name_or_path,
                **{k: getattr(ns, k) for k in (*_OUTPUT_ARGS, "prompt_type_path", "chat_template",
                                                 "reasoning_history", "enable_thinking")},
                # JSON flags by value: a config file's mapping and the same JSON typed differently are one cache,
                # and so are an omitted --map-keys and one spelling out the handler's defaults
                "map_keys": _effective_map_keys(ns.handler_name, ns.map_keys),
                "chat_template_kwargs": json_flag_value(ns.chat_template_kwargs),
                **({"json_keys": ns.json_keys, "add_bos": ns.add_bos} if pretrain else {}),
                **({"step_tags": [ns.placeholder_token, *ns.reward_tokens]}
                   if ns.handler_name == PROCESS_REWARD else {})}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:10]
    first = Path(os.path.abspath(inputs[0]))
    root = args.data_cache_path or os.path.join(first.parent, CACHE_DIR)
    ns.output_prefix = os.path.join(root, f"{first.stem if first.is_file() else first.name}-{digest}")
    return ns


def _check_handler_for_stage(stage: str, handler: str) -> None:
    """Raw rows are read by the handler the stage's data needs (a DPO run on pair rows without it failed on
    "column 'output' not found", naming no handler)."""
    from mindspeed_pack.data import handlers as h

    needs = {**dict.fromkeys(("dpo", "simpo", "orpo", "orm"), ("preference pairs", (h.ALPACA_PAIRWISE,
                                                                                   h.SHAREGPT_PAIRWISE))),
             "kto": ("KTO rows", (h.ALPACA_KTO, h.SHAREGPT_KTO)), "prm": ("process reward rows", (h.PROCESS_REWARD,))}
    what, handlers = needs.get(stage, ("instruction rows", (h.ALPACA, h.SHAREGPT)))
    if stage in needs or stage == "sft":
        if handler not in handlers:
            raise DataError(f"--stage {stage} trains on {what}: raw --data-path files need --handler-name "
                            f"{' or '.join(handlers)} (--handler-name {handler} reads other rows)")


def _preprocess(ns) -> dict:
    """Run preprocess_data.py's pipeline (cache included); bad input becomes a :class:`DataError`."""
    from mindspeed_pack.data.errors import SKIP_BAD_ROWS_HINT, PreprocessError, RowError
    from mindspeed_pack.datasets.preprocess import run_or_reuse

    start = time.perf_counter()
    try:
        meta, hit = run_or_reuse(ns)
    except RowError as e:
        raise DataError(f"{e}; {SKIP_BAD_ROWS_HINT}") from None
    except PreprocessError as e:
        raise DataError(str(e)) from None
    stats = meta.get("statistics") or {}
    return {"prefix": ns.output_prefix, "cache hit": hit, "seconds": round(time.perf_counter() - start, 3),
            "packs": stats.get("packs", stats.get("documents")), "samples": stats.get("samples_written")}


def node_leaders(world: int, per_node: int) -> list:
    """The ranks of each node (torchrun numbers a node's ranks contiguously): the first one leads."""
    return [list(range(start, min(start + per_node, world))) for start in range(0, world, per_node)]


def _leader(args):
    """(whether this rank preprocesses, the group that waits for it, its global rank): rank 0 for the job, or
    under ``--no-shared-storage`` (MindSpeed-LLM's flag) each node's first rank, for its node's disk."""
    import torch.distributed as dist

    timeout = datetime.timedelta(hours=WAIT_HOURS)
    rank, world = dist.get_rank(), dist.get_world_size()
    if not getattr(args, "no_shared_storage", False):
        return rank == 0, dist.new_group(backend="gloo", timeout=timeout), 0
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = node_leaders(world, per_node)
    groups = [dist.new_group(ranks, backend="gloo", timeout=timeout) for ranks in nodes]  # every rank makes each
    node = rank // per_node
    if rank - nodes[node][0] != int(os.environ.get("LOCAL_RANK", rank - nodes[node][0])):
        raise DataError(f"--no-shared-storage: rank {rank} is local rank {os.environ.get('LOCAL_RANK')} of its node, "
                        f"not {rank - nodes[node][0]}: launch with torchrun (each node's ranks numbered together)")
    return rank == nodes[node][0], groups[node], nodes[node][0]


def _on_rank_zero(args, work, what: Optional[str] = None) -> dict:
    """``work()`` on rank 0 (each node's first rank under ``--no-shared-storage``) while the other ranks wait
    (up to :data:`WAIT_HOURS`); its result on every rank."""
    from mindspeed_pack.config.resolved_config import flag_values
    from mindspeed_pack.runtime.process_groups import initialize_from_args

    # the process groups training uses next (a second call is a no-op)
    initialize_from_args(args, flags=flag_values(args))
    return run_on_leader(args, work, what)


def run_on_leader(args, work, what: Optional[str] = None) -> dict:
    """:func:`_on_rank_zero` once the process groups exist."""
    import torch.distributed as dist

    from mindspeed_pack.runtime import peers

    leads, group, leader = _leader(args)
    rank, message, error = dist.get_rank(), [None], None
    if leads:
        try:
            message = [("ok", work())]
        except DataError as e:
            error, message = e, [("error", str(e))]
    else:
        log.info("rank %d: waiting for rank %d to preprocess %s", rank, leader,
                 what or f"--data-path {' '.join(args.data_path)}")
    try:
        with peers.waiting_for(f"rank {leader}'s preprocessing of {what or '--data-path'}", WAIT_HOURS * 60):
            dist.broadcast_object_list(message, src=leader, group=group)
    finally:
        # a gloo group keeps its threads until destroyed; this one is made per call (the other nodes' groups
        # under --no-shared-storage hold no state on this rank)
        dist.destroy_process_group(group)
    # the leader prints its error for the ranks that waited on it: rank 0 for the job, each node's under
    # --no-shared-storage (runtime.error_scope)
    scope = "node" if getattr(args, "no_shared_storage", False) else "job"
    if error is not None:
        raise error if getattr(error, "scope", None) else scoped(error, scope)
    status, payload = message[0]
    if status == "error":
        raise scoped(DataError(f"rank {leader} could not preprocess {what or '--data-path'}: {payload}"), scope)
    return payload


def prepare(args, pretrain: bool = False) -> Optional[dict]:
    """Turn raw ``--data-path`` files into packs (``pretrain``: pretraining documents) once and point
    ``args.data_path`` at them; ``args.raw_data_path`` keeps what was given. Packed prefixes: check the
    preprocessing flags given. ``pretrain``: a weighted blend ``0.3 a.jsonl 0.7 b.jsonl`` tokenises each raw
    file into its own cached documents, blended with the weights (:func:`_prepare_blend`)."""
    if not pretrain and getattr(args, "json_keys", None):
        raise DataError(f"--json-keys {' '.join(args.json_keys)} names pretraining documents' text field: train "
                        "plain text with pretrain_gpt.py (which preprocesses raw --data-path files too); "
                        "posttrain.py reads instruction rows (--handler-name, --map-keys)")
    if pretrain and any(getattr(args, f"{name}_data_path", None) for name in SPLITS):
        return _prepare_split_paths(args)
    if pretrain and blend_weights(args.data_path):
        return _prepare_blend(args)
    inputs = raw_inputs(args)
    if inputs is None:
        if not pretrain:
            if len(args.data_path or []) > 1:  # refused before the model is built, as the weights of a blend are
                from mindspeed_pack.config.arguments import ONE_PREFIX

                raise DataError(f"--data-path {' '.join(args.data_path)}: {ONE_PREFIX}")
            check_packed_flags(args)
        return None
    if pretrain:
        _check_documents_will_end_with_eod(args)
    ns = preprocess_namespace(args, inputs, pretrain)
    result = _on_leader(args, lambda: _preprocess(ns))
    prefix = _trained_prefix(result, pretrain)
    args.raw_data_path, args.data_path = inputs, [prefix]
    args.data_summary = _summary(inputs, prefix, result, pretrain)
    _log_summary(args)
    return result


def blend_weights(paths) -> Optional[list]:
    """The weights of a weighted ``--data-path`` (``w1 P1 w2 P2 ...``, megatron-core's blend), else None."""
    paths = list(paths or [])
    if len(paths) < 2 or len(paths) % 2:
        return None
    try:
        return [float(w) for w in paths[0::2]]
    except ValueError:
        return None


def _prepare_blend(args) -> Optional[dict]:
    """pretrain_gpt.py's ``--data-path 0.3 a.jsonl 0.7 b.jsonl``: each raw file (or directory) is tokenised into its
    own documents (its own cache entry, as ``--data-path a.jsonl`` alone makes them), and the blend takes those
    prefixes with the weights; a preprocessed prefix in the blend is used as it is."""
    paths = list(args.data_path)
    pairs = list(zip(paths[0::2], paths[1::2]))
    raw = [path for _, path in pairs if _is_raw(path)]
    if not raw:
        return None  # preprocessed prefixes, as before
    missing = [p for p in raw if not os.path.exists(p)]
    if missing:
        raise DataError(f"--data-path {missing[0]}: no such file or directory")
    _check_documents_will_end_with_eod(args)
    namespaces = {path: preprocess_namespace(args, [path], pretrain=True) for path in raw}
    results = _on_leader(args, lambda: {path: _preprocess(ns) for path, ns in namespaces.items()})
    prefixes = {path: _trained_prefix(result, True) for path, result in results.items()}
    args.raw_data_path = paths
    args.data_path = [item for weight, path in pairs for item in (weight, prefixes.get(path, path))]
    args.data_summary = "; ".join(f"{weight} " + (_summary([path], prefixes[path], results[path], True)
                                                   if path in results else path) for weight, path in pairs)
    _log_summary(args)
    return {"prefixes": prefixes, "results": results}


def _prepare_split_paths(args) -> Optional[dict]:
    """pretrain_gpt.py's ``--train/--valid/--test-data-path`` naming raw files: tokenised into documents as
    ``--data-path`` would be (a weighted blend's files each into its own, an unweighted list into one), all on
    the leader at once; ``args.raw_<split>_data_path`` keeps what was given. Preprocessed prefixes: as they are."""
    jobs, plans = {}, {}
    for name in SPLITS:
        flag, paths = f"--{name}-data-path", list(getattr(args, f"{name}_data_path", None) or [])
        weighted = blend_weights(paths) is not None
        items = paths[1::2] if weighted else paths
        raw = [p for p in items if _is_raw(p)]
        if not raw:
            continue
        if not weighted and len(raw) != len(items):
            other = next(p for p in items if p not in raw)
            raise DataError(f"{flag} mixes raw files ({raw[0]}) and "
                            + (f"a number ({other}): a blend is weight-path pairs, every path weighted "
                               "('0.3 A 0.7 B')" if _is_number(other) else f"a preprocessed prefix ({other}): give "
                               "one or the other, or weight them ('0.3 A 0.7 B')"))
        missing = [p for p in raw if not os.path.exists(p)]
        if missing:
            if getattr(args, "dry_run", False):  # a job's flags checked before its data exists (the plan: NOT FOUND)
                log.warning("--dry-run: %s %s: no such file or directory (nothing preprocessed)", flag, missing[0])
                return None
            raise DataError(f"{flag} {missing[0]}: no such file or directory")
        groups = [(p,) for p in raw] if weighted else [tuple(raw)]
        jobs.update(dict.fromkeys(groups))
        plans[name] = (paths, weighted, groups)
    if not plans:
        return None  # preprocessed prefixes, as before
    _check_documents_will_end_with_eod(args)
    namespaces = {group: preprocess_namespace(args, list(group), pretrain=True) for group in jobs}
    results = _on_leader(args, lambda: {group: _preprocess(ns) for group, ns in namespaces.items()},
                         what=" ".join(f"--{name}-data-path" for name in plans))
    summaries = []
    for name, (paths, weighted, groups) in plans.items():
        setattr(args, f"raw_{name}_data_path", paths)
        prefixes = {group: _trained_prefix(results[group], True) for group in groups}
        if weighted:
            new = [item for weight, path in zip(paths[0::2], paths[1::2])
                   for item in (weight, prefixes.get((path,), path))]
            summary = "; ".join(f"{weight} " + (_summary([path], prefixes[(path,)], results[(path,)], True)
                                                 if (path,) in prefixes else path)
                                for weight, path in zip(paths[0::2], paths[1::2]))
        else:
            new = [prefixes[groups[0]]]
            summary = _summary(list(groups[0]), new[0], results[groups[0]], True)
        setattr(args, f"{name}_data_path", new)
        summaries.append(f"{name}: {summary}")
    args.data_summary = "; ".join(summaries)
    _log_summary(args)
    return {"results": results}


def _check_documents_will_end_with_eod(args) -> None:
    """Before tokenising raw files for pretrain_gpt.py: the flags that find documents at their EOD need it written."""
    needs = [flag for flag, on in (("--reset-attention-mask", args.isolate_segments),
                                   ("--reset-position-ids", args.reset_position_ids),
                                   ("--eod-mask-loss", args.eod_mask_loss)) if on]
    if needs and not args.append_eod:
        raise DataError(f"{' and '.join(needs)} find{'s' if len(needs) == 1 else ''} documents at their EOD, and the "
                        "raw --data-path files would be tokenised without one: add --append-eod to this command")


def _on_leader(args, work, what: Optional[str] = None):
    """``work()`` here, or under torchrun on rank 0 (each node's first rank under ``--no-shared-storage``);
    ``what``: the flags whose files it preprocesses (default --data-path), for the waiting ranks' messages."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
        return _on_rank_zero(args, work, what)
    return work()


def _trained_prefix(result: dict, pretrain: bool) -> str:
    from mindspeed_pack.datasets.pack_writer import text_prefix

    return text_prefix(result["prefix"]) if pretrain else result["prefix"]


def _summary(inputs: list, prefix: str, result: dict, pretrain: bool) -> str:
    how = "cache hit" if result["cache hit"] else "preprocessed now"
    return (f"{' '.join(inputs)} -> {'documents' if pretrain else 'packs'} {prefix}: {result['packs']} documents"
            + ("" if pretrain else f", {result['samples']} samples") + f" ({how}, {result['seconds']:.2f} s)")


def _log_summary(args) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    log.info("data%s: %s", f" (rank {os.environ.get('RANK', 0)} of {world})" if world > 1 else "", args.data_summary)


def check_packed_flags(args) -> None:
    """The preprocessing flags the user gave agree with what each packed prefix's sidecar recorded."""
    sources = getattr(args, "flag_sources", {})
    given = [d for d in RECORDED if sources.get(d, [None, None])[1] == "given"]
    if not given:
        return
    for prefix in data_prefixes(args):
        recorded = (read_meta(prefix) or {}).get("arguments")
        if not recorded:
            continue
        for dest in given:
            mine, theirs = getattr(args, dest), recorded.get(dest)
            if dest == "map_keys":  # the names read, so spelled-out defaults equal an omitted flag
                from mindspeed_pack.data.handlers import canonical_handler

                mine = _effective_map_keys(*canonical_handler(args.handler_name, mine))
                theirs = _effective_map_keys(*canonical_handler(recorded.get("handler_name", args.handler_name),
                                                                theirs))
            elif dest == "chat_template_kwargs":
                mine = json_flag_value(mine)
            if dest in RECORDED_WHEN_SET:
                recorded = {**recorded, dest: recorded.get(dest)}
            if dest in recorded and theirs != mine:
                flag = "--" + sources[dest][0]
                raise DataError(f"{flag} {getattr(args, dest)}, but {prefix!r} was preprocessed with {flag} "
                                f"{recorded[dest]} ({prefix}_packed_meta.json): drop the flag, or re-run "
                                "preprocess_data.py (or pass the raw files as --data-path)")

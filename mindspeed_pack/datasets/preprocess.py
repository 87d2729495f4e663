"""``preprocess_data.py``: instruction or pretraining data -> Megatron indexed datasets.

Pipeline (memory bounded by the chunk window, not by the dataset)::

    input files --chunks--> --workers processes: parse rows, apply template, tokenize, truncate
                --ordered--> TokenStore on disk (ids int32 + trained mask uint8) + lengths
                             [each sample padded to a multiple of --pad-to-multiple-of]
                --lengths--> C++ packer over the whole dataset (--pack) -> PackPlan
                --mmap-----> packs in a --seed shuffled order, assembled in batches
                             -> IndexedDatasetBuilder (temporary names)
                --rename---> P_packed_{input_ids,attention_mask,labels}_document.{bin,idx}
                             [+ P_tokenizer/ when the template's tokens had to be added]
                             + P_packed_meta.json (arguments, tokenizer, template, statistics)

Each worker encodes a chunk's texts in one batch through the Rust backend, with the
tokenizer files' saved truncation/padding switched off (see ``tokenizer.py``): ids are those
of transformers' ``tokenizer(text, add_special_tokens=False)``; only ``--seq-length`` cuts.

Chunks are encoded in input order whatever ``--workers`` is, so the output is byte-identical
for any number of workers. Outputs appear only complete; the sidecar is written last and is
what the cache checks: inputs (size + sha256 of the content), tokenizer files hash, template and arguments
must match for a rebuild to be skipped (``--overwrite-cache`` forces it).
Errors in the input raise :class:`PreprocessError`; ``main`` prints ``error: ...`` and exits 2.
A malformed row (:class:`RowError`) does the same unless ``--skip-bad-rows``, which skips it
and counts it by reason next to the unusable rows (summary and sidecar ``statistics.skipped``,
with the first row of each reason in ``statistics.first_skipped``). What a sample is written without,
as its template renders it (a tool-call turn's text under Llama 3.1), is warned and counted in
``statistics.notes`` (first row in ``statistics.first_notes``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import numpy as np

from mindspeed_pack.config import yaml_file
from mindspeed_pack.data import chat_template as hf_chat
from mindspeed_pack.data import kto, pairwise, process_reward, readers
from mindspeed_pack.data.errors import SKIP_BAD_ROWS_HINT, PreprocessError, RowError
from mindspeed_pack.data.handlers import (
    COLUMN_KEYS,
    CONVERSATION_ELSEWHERE,
    HANDLER_NAMES,
    OPENAI,
    PRETRAIN,
    PROCESS_REWARD,
    REQUIRED_COLUMNS,
    SAMPLE_SKIPS,
    SHAREGPT,
    SampleEncoder,
    canonical_handler,
    resolve_map_keys,
)
from mindspeed_pack.data.templates import get_template, marker_tokens, with_thinking
from mindspeed_pack.data.tokenizer import (
    MEGATRON_HF_TYPE,
    TOKENIZER_TYPES,
    TokenizerSpec,
    check_eos,
    fold_megatron_hf_tokenizer,
    load_tokenizer,
)
from mindspeed_pack.datasets import pack_writer
from mindspeed_pack.runtime import faults, stale_files
from mindspeed_pack.runtime.disk import disk_full_message, is_disk_full, tree_bytes

HF_PROMPT_TYPE = "hf"  # --prompt-type hf: the model's own chat template (chat_template.py)
FORMAT_VERSION = 6  # 2: packs in a seeded random order; template tokens added when missing; 3: reasoning in a
# "thinking" field, bare tool schemas in OpenAI's form, thoughts without newlines, TRL's and the hub's pair and KTO rows;
# 4: --prompt-type hf turns of templates without an end-of-turn token (GLM-4) train the token that stops them;
# 5: a JSON template's tool calls follow a thought alone without the separator (qwen3 --enable-thinking);
# 6: an Alpaca row with an empty instruction has its input alone as the prompt (it was "\n" + input)
CHUNK_ROWS = 1000
# arguments that change the output bytes (the cache compares these; --workers does not)
_OUTPUT_ARGS = ("handler_name", "prompt_type", "seq_length", "pack", "neat_pack", "append_eod", "tokenizer_type", "seed",
                "pad_to_multiple_of", "skip_bad_rows")
TOKENIZER_SUFFIX = "tokenizer"  # P_tokenizer/: the tokenizer extended with a template's tokens


# MindSpeed-LLM's older handler names, and what reads their rows here
RENAMED_HANDLERS = {
    "GeneralInstructionHandler": "AlpacaStyleInstructionHandler (instruction/input/output rows)",
    "R1AlpacaStyleInstructionHandler": "AlpacaStyleInstructionHandler (a <think> block inside the output is written "
                                       "as given) or SharegptStyleInstructionHandler with reasoning_content",
}


def _handler_name(name: str) -> str:
    """``--handler-name`` as given; an older MindSpeed-LLM name is refused naming the handler that reads its rows
    (argparse's 'invalid choice' listed the names without saying which one)."""
    if name in RENAMED_HANDLERS:
        raise argparse.ArgumentTypeError(f"{name} is an older MindSpeed-LLM handler: use {RENAMED_HANDLERS[name]}")
    return name


def _true_false_none(text: str):
    """MindSpeed-LLM's --enable-thinking values: true, false, none (case-insensitive)."""
    try:
        return {"true": True, "false": False, "none": None}[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"{text!r}: give true, false or none") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="preprocess_data.py", description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("input / output")
    g.add_argument("--input", required=True, nargs="+",
                   help="files or directories (parquet, arrow, csv, json, jsonl, txt), preprocessed as one dataset")
    g.add_argument("--output-prefix", required=True, help="path prefix P of the outputs P_packed_*_document.{bin,idx}")
    g.add_argument("--cache-dir", default=None, help="where the temporary token store goes (default: next to the output)")
    g.add_argument("--overwrite-cache", action="store_true", help="rebuild even if matching outputs exist")
    g.add_argument("--dry-run", action="store_true",
                   help="check the flags (the parser and its combinations) and exit: no data read, no tokenizer loaded")
    g.add_argument("--skip-bad-rows", action="store_true",
                   help="skip malformed rows (bad JSON, missing field, wrong type, unknown role) and count them by "
                        "reason instead of stopping at the first one (default: stop, naming file, row and field)")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default="PretrainedFromHF", choices=(*TOKENIZER_TYPES, MEGATRON_HF_TYPE),
                   help=f"{MEGATRON_HF_TYPE} (Megatron-LM's name, with --tokenizer-model DIR) is PretrainedFromHF")
    g.add_argument("--tokenizer-name-or-path", default=None, help="HF tokenizer directory")
    g.add_argument("--tokenizer-model", default=None, help="SentencePiece .model file")
    g.add_argument("--tokenizer-not-use-fast", action="store_true",
                   help="refused: preprocessing encodes with the tokenizer's fast (Rust) backend, in batches")
    g = p.add_argument_group("handler")
    g.add_argument("--handler-name", default=None, choices=HANDLER_NAMES, type=_handler_name,
                   help="how rows are read (default: AlpacaStyleInstructionHandler; GeneralPretrainHandler with "
                        "--json-keys, as Megatron-LM's preprocessing passes it. OpenAIInstructionHandler: "
                        "MindSpeed-LLM's name for SharegptStyleInstructionHandler with OpenAI's keys: messages, role, "
                        "content)")
    g.add_argument("--prompt-type", default=None,
                   help="chat template name in templates.json (instruction handlers), or 'hf': the tokenizer's own "
                        "Jinja chat_template, rendered as apply_chat_template does")
    g.add_argument("--chat-template", default=None, metavar="FILE.jinja",
                   help="--prompt-type hf: render with this Jinja template instead of the tokenizer's")
    g.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help='--prompt-type hf: variables for the template, e.g. \'{"enable_thinking": false}\'; a '
                        f'Llama-3.x date header is pinned to date_string "{hf_chat.DEFAULT_DATE_STRING}" unless given')
    g.add_argument("--enable-thinking", type=_true_false_none, default=None, metavar="{true,false,none}",
                   help="MindSpeed-LLM's reasoning switch. A template with thought words (qwen3): true keeps each "
                        "answer's inline <think> thought (a reasoning_content field is written inline) and gives an "
                        "answer without one an empty one, trained; "
                        "false removes them and closes every prompt with the empty one, untrained. --prompt-type "
                        "hf: the chat template's enable_thinking variable. none (default): answers as written")
    g.add_argument("--reasoning-history", default="split", choices=hf_chat.REASONING_HISTORY,
                   help="--prompt-type hf, templates that rewrite earlier turns (Qwen3 drops old reasoning): 'split' "
                        "into the fewest samples whose context is what inference shows (default), or 'keep' one "
                        "sample with every turn's reasoning kept (differs from inference)")
    g.add_argument("--prompt-type-path", default=None, help="templates.json to use (default: configs/finetune/templates.json)")
    g.add_argument("--map-keys", default=None, help='JSON column/role renames, e.g. \'{"prompt": "question"}\'')
    g.add_argument("--json-keys", nargs="+", default=None, metavar="KEY",
                   help="GeneralPretrainHandler: the field holding each document's text (Megatron-LM's flag; one "
                        "key, = --map-keys '{\"text\": KEY}'; default text)")
    g.add_argument("--placeholder-token", default=process_reward.DEFAULT_PLACEHOLDER,
                   help="AlpacaStyleProcessRewardHandler: the step tag that ends every reasoning step of 'input' "
                        "(one token of the tokenizer; Math-Shepherd's ки)")
    g.add_argument("--reward-tokens", nargs="+", default=list(process_reward.DEFAULT_REWARD_TOKENS),
                   help="AlpacaStyleProcessRewardHandler: the step labels of 'value', each one token (+ -: right, "
                        "wrong); --stage prm classifies each tag among their logits")
    g = p.add_argument_group("packing")
    g.add_argument("--seq-length", type=int, default=None, help="pack length; also the truncation budget of a sample")
    g.add_argument("--pack", action="store_true", help="pack samples into documents of exactly --seq-length tokens")
    g.add_argument("--neat-pack", action="store_true", help="isolate samples: attention_mask holds segment ids (needs --pack)")
    g.add_argument("--append-eod", action="store_true", help="end every sample with EOS (trained) unless it already does")
    g.add_argument("--add-bos", action=argparse.BooleanOptionalAction, default=None,
                   help="GeneralPretrainHandler: start every document with the tokenizer's BOS (--no-add-bos: never); "
                        "default: as the tokenizer's own encoding does (Llama's add_bos_token), like Megatron-LM")
    g.add_argument("--pad-to-multiple-of", type=int, default=1, metavar="N",
                   help="pad every sample at its end (pad id, label -100, its own segment id) to a multiple of N "
                        "before packing: 2 x context-parallel size (x TP under sequence parallelism), so training "
                        "adds no padding; default 1 (off)")
    g.add_argument("--seed", type=int, default=1234,
                   help="seed of the pack order (packs are written shuffled so a contiguous --split is a fair sample)")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument("--log-interval", type=int, default=10000, help="rows between progress lines when stderr is not a TTY")
    g.add_argument("--n-subs", type=int, default=None,
                   help="accepted for MindSpeed-LLM compatibility and ignored: packing always sees the whole dataset")
    yaml_file.add_config_flag(p)
    return p


def _json_keys(args) -> None:
    """Megatron-LM's ``--json-keys KEY``: the pretraining handler's text field (``--map-keys '{"text": KEY}'``)."""
    keys = getattr(args, "json_keys", None)
    if not keys:
        return
    if args.handler_name != PRETRAIN:
        raise PreprocessError(f"--json-keys names pretraining documents' text field (GeneralPretrainHandler); "
                              f"{args.handler_name} takes --map-keys")
    if len(keys) > 1:
        raise PreprocessError(f"--json-keys {' '.join(keys)}: one field per run here (Megatron-LM writes a dataset "
                              "per key: run once per key, with its own --output-prefix)")
    mapped = dict(args.map_keys or {})
    if mapped.get("text", keys[0]) != keys[0]:
        raise PreprocessError(f"--json-keys {keys[0]} but --map-keys maps text to {mapped['text']!r}: pass one")
    args.map_keys = {**mapped, "text": keys[0]}


def _fold_enable_thinking(args) -> None:
    """``--enable-thinking`` under ``--prompt-type hf``: the chat template's ``enable_thinking`` variable (a JSON
    template applies it itself: :func:`~mindspeed_pack.data.templates.with_thinking`)."""
    value = args.enable_thinking
    if value is None:
        return
    if args.handler_name in (PRETRAIN, PROCESS_REWARD):
        raise PreprocessError(f"--enable-thinking applies to chat templates; {args.handler_name} renders none")
    if args.prompt_type != HF_PROMPT_TYPE:
        return
    kwargs = dict(args.chat_template_kwargs or {})
    if "enable_thinking" in kwargs and kwargs["enable_thinking"] != value:
        raise PreprocessError(f"--enable-thinking {str(value).lower()} but --chat-template-kwargs sets enable_thinking "
                              f"{json.dumps(kwargs['enable_thinking'])}: pass one of them")
    kwargs["enable_thinking"] = value
    args.chat_template_kwargs = kwargs


def _check_output_prefix(prefix: str) -> None:
    """``--output-prefix`` is a path prefix (``out/sft`` -> ``out/sft_packed_*``): one naming a directory
    (``out/sft/``) left the outputs no name, and failed only at the final rename, after all the work."""
    if prefix.endswith(("/", os.sep)) or Path(prefix).name in ("", ".", ".."):
        inside = prefix.rstrip("/" + os.sep) or "."
        raise PreprocessError(f"--output-prefix {prefix} names a directory; give a path prefix inside it, e.g. "
                              f"{inside}/NAME (the outputs are NAME_packed_*_document.bin/.idx and NAME's sidecar)")


def _make_output_dir(args) -> Path:
    """The directory of ``--output-prefix``, made when missing; one error line when it cannot be (a file in its
    path, no permission), not a traceback."""
    out_dir = Path(args.output_prefix).resolve().parent
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PreprocessError(f"--output-prefix {args.output_prefix}: cannot create its directory {out_dir} "
                              f"({exc.strerror}: {exc.filename})") from None
    return out_dir


def default_handler(args) -> str:
    """``--handler-name`` when none is given: Megatron-LM's ``--json-keys text --append-eod`` names no handler and
    means pretraining documents; otherwise Alpaca rows."""
    return PRETRAIN if getattr(args, "json_keys", None) else "AlpacaStyleInstructionHandler"


def validate_args(args) -> None:
    fold_megatron_hf_tokenizer(args)  # before the tokenizer flags are read (the cache key records PretrainedFromHF)
    _check_output_prefix(str(args.output_prefix))
    defaulted = args.handler_name is None
    if defaulted:
        args.handler_name = default_handler(args)
    args.handler_name, args.map_keys = canonical_handler(args.handler_name, args.map_keys)
    if getattr(args, "tokenizer_not_use_fast", False):
        raise PreprocessError("--tokenizer-not-use-fast: preprocessing encodes with the tokenizer's fast (Rust) "
                              "backend, in batches; drop the flag (a directory with only a slow tokenizer is "
                              "converted by transformers when it loads)")
    if args.neat_pack and not args.pack:
        raise PreprocessError("--neat-pack requires --pack")
    if args.seq_length is not None and args.seq_length < 2:
        raise PreprocessError(f"--seq-length must be >= 2, got {args.seq_length}")
    if args.n_subs not in (None, 1):
        print(f"note: --n-subs {args.n_subs} ignored; the whole dataset is packed at once (better fill)", file=sys.stderr)
    if args.workers < 1:
        raise PreprocessError(f"--workers must be >= 1, got {args.workers}")
    n = args.pad_to_multiple_of
    if n < 1:
        raise PreprocessError(f"--pad-to-multiple-of must be >= 1, got {n}")
    if n > 1 and args.seq_length is not None and args.seq_length % n:
        raise PreprocessError(f"--seq-length {args.seq_length} is not a multiple of --pad-to-multiple-of {n}: a sample "
                              "truncated to --seq-length could not be padded without overflowing it; choose a "
                              f"--seq-length that is a multiple of {n} (e.g. {-(-args.seq_length // n) * n})")
    if args.add_bos is not None and args.handler_name != PRETRAIN:
        raise PreprocessError(f"--{'' if args.add_bos else 'no-'}add-bos applies to GeneralPretrainHandler; "
                              "chat templates place BOS themselves ({\"token\": \"bos_token\"} slots)")
    if args.handler_name == PRETRAIN:
        if args.pack:
            raise PreprocessError("--pack applies to instruction handlers; GeneralPretrainHandler writes plain documents")
        if n > 1:
            raise PreprocessError("--pad-to-multiple-of applies to instruction handlers: GeneralPretrainHandler's "
                                  "documents have no labels, so their pads would be trained")
    else:
        if args.pack and args.seq_length is None:
            raise PreprocessError("--pack needs --seq-length")
        if n > 1 and args.pack and not args.neat_pack:
            raise PreprocessError("--pad-to-multiple-of with --pack needs --neat-pack: plain packs are split into "
                                  "samples at EOS at training time, so pads after a sample's EOS would be read as "
                                  "the start of the next sample")
        if args.handler_name == PROCESS_REWARD:
            if args.prompt_type is not None or args.append_eod:
                raise PreprocessError(f"{args.handler_name} tokenises each row's text as written (no template, no "
                                      "EOS, as MindSpeed-LLM): drop --prompt-type and --append-eod")
        elif args.prompt_type is None:
            raise PreprocessError(f"{args.handler_name} needs --prompt-type (a template of templates.json, or hf)"
                                  + (" (it is the default --handler-name; plain text for pretraining is --handler-name "
                                     "GeneralPretrainHandler --append-eod, MindSpeed-LLM's default, or Megatron-LM's "
                                     "--json-keys text --append-eod)" if defaulted else ""))
        if pairwise.is_pairwise(args.handler_name) and args.pack and not args.neat_pack:
            raise PreprocessError(f"{args.handler_name} needs --pack --neat-pack: a preference pair is a unit of "
                                  "packing, its chosen and rejected answers told apart by their segment ids (or "
                                  "neither flag: each pair its own document)")
        if kto.is_kto(args.handler_name) and args.pack and not args.neat_pack:
            raise PreprocessError(f"{args.handler_name} needs --pack --neat-pack: a KTO sample and its KL partner "
                                  "are a unit of packing, told apart by their segment ids (or neither flag: each "
                                  "couple its own document)")
    if args.prompt_type != HF_PROMPT_TYPE and (args.chat_template or args.chat_template_kwargs):
        raise PreprocessError("--chat-template and --chat-template-kwargs apply to --prompt-type hf")
    if args.prompt_type != HF_PROMPT_TYPE and getattr(args, "reasoning_history", None) == "keep":
        raise PreprocessError("--reasoning-history keep applies to --prompt-type hf: a JSON template never rewrites "
                              "history, it writes every answer as the row gives it (with --enable-thinking: see its help)")
    if args.prompt_type == HF_PROMPT_TYPE and args.append_eod:
        raise PreprocessError("--append-eod does not apply to --prompt-type hf: a sample is the chat template's "
                              "render, each turn trained through the end-of-turn token the template writes (GLM-4's "
                              "writes none: its turns train the <|user|> or <|observation|> that begins the next "
                              "message, and <|user|> is appended after the last, as GLM's own fine-tuning does: see "
                              "docs/chat_templates.md)")
    if args.prompt_type == HF_PROMPT_TYPE and args.tokenizer_type != "PretrainedFromHF":
        raise PreprocessError("--prompt-type hf needs --tokenizer-type PretrainedFromHF (a tokenizer with a chat template)")
    args.chat_template_kwargs = hf_chat.parse_template_kwargs(args.chat_template_kwargs)
    _fold_enable_thinking(args)
    if args.map_keys is not None and not isinstance(args.map_keys, dict):
        try:
            args.map_keys = json.loads(args.map_keys)
        except json.JSONDecodeError as exc:
            raise PreprocessError(f"--map-keys is not valid JSON ({exc.msg} at column {exc.colno}): {args.map_keys}") from None
        if not isinstance(args.map_keys, dict):
            raise PreprocessError(f"--map-keys must be a JSON object, got {args.map_keys!r}")
    _json_keys(args)
    path = args.tokenizer_model if args.tokenizer_type == "SentencePiece" and args.tokenizer_model else args.tokenizer_name_or_path
    if path is None:
        raise PreprocessError("give the tokenizer with --tokenizer-name-or-path (or --tokenizer-model for SentencePiece)")
    args.tokenizer_path = path


# ------------------------------------------------------------------ worker side
@dataclass(frozen=True)
class EncoderConfig:
    handler: str
    tokenizer: TokenizerSpec
    prompt_type: Optional[str]
    templates_path: Optional[str]
    map_keys: dict
    seq_length: Optional[int]
    append_eod: bool
    skip_bad_rows: bool = False
    add_bos: bool = False
    chat_template: Optional[str] = None  # --prompt-type hf: --chat-template FILE (None: the tokenizer's)
    chat_template_kwargs: Optional[dict] = None
    reasoning_history: str = "split"
    pad_to_multiple_of: int = 1  # pairs: a pair's padded length must fit --seq-length
    step_tags: Optional[tuple] = None  # process reward rows: (--placeholder-token, --reward-tokens)
    enable_thinking: Optional[bool] = None  # --enable-thinking for a JSON template (hf: in chat_template_kwargs)

    def build(self, tokenizer=None) -> SampleEncoder:
        tokenizer = tokenizer or load_tokenizer(self.tokenizer)
        template = chat = None
        if self.handler == PROCESS_REWARD:
            placeholder, reward_tokens = self.step_tags
            return process_reward.ProcessRewardEncoder(self.handler, tokenizer, self.map_keys, self.seq_length,
                                                       placeholder, reward_tokens, self.skip_bad_rows)
        if self.handler != PRETRAIN and self.prompt_type == HF_PROMPT_TYPE:
            source, origin = hf_chat.load_chat_template(tokenizer.hf, self.chat_template)
            chat = hf_chat.ChatTemplate(source, tokenizer.hf.special_tokens_map, self.chat_template_kwargs or {},
                                        self.reasoning_history, origin, atoms=tuple(tokenizer.hf.get_added_vocab()))
        elif self.handler != PRETRAIN:
            template = with_thinking(get_template(self.prompt_type, self.templates_path), self.enable_thinking)
        if pairwise.is_pairwise(self.handler):
            return pairwise.PairwiseEncoder(self.handler, tokenizer, template, self.map_keys, self.seq_length,
                                            self.append_eod, self.pad_to_multiple_of, self.skip_bad_rows, chat)
        if kto.is_kto(self.handler):
            return kto.KTOEncoder(self.handler, tokenizer, template, self.map_keys, self.append_eod,
                                  self.skip_bad_rows, chat)
        return SampleEncoder(self.handler, tokenizer, template, self.map_keys, self.seq_length, self.append_eod,
                             self.skip_bad_rows, self.add_bos, chat)


_ENCODER: Optional[SampleEncoder] = None


def _init_worker(config: EncoderConfig) -> None:
    global _ENCODER
    _ENCODER = config.build()


def _start_pool_worker(config: Optional[EncoderConfig]) -> None:
    """A pool worker leaves Ctrl-C (SIGINT to the whole process group) to the main process, which ends the pool and
    prints one line: handled here, every worker printed a KeyboardInterrupt traceback first."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if config is not None:  # None: the encoder was inherited through fork
        _init_worker(config)


def _encode_chunk(chunk: readers.Chunk):
    return _ENCODER.encode_rows(readers.chunk_rows(chunk))


def encode_in_order(chunks, config: EncoderConfig, workers: int, encoder: Optional[SampleEncoder] = None):
    """Encoded chunks in input order; at most ``2 * workers + 1`` chunks in flight (bounded memory).

    ``encoder`` (built by the caller from ``config``) is reused in this process and, under
    fork, inherited by the workers instead of loading the tokenizer once more in each.
    """
    global _ENCODER
    fork = "fork" in mp.get_all_start_methods()
    _ENCODER = encoder  # never a previous run's (tests call main() repeatedly in one process)
    if workers == 1:
        if _ENCODER is None:
            _init_worker(config)
        for chunk in chunks:
            yield _encode_chunk(chunk)
        return
    ctx = mp.get_context("fork" if fork else "spawn")
    inherited = fork and encoder is not None
    with ctx.Pool(workers, initializer=_start_pool_worker, initargs=(None if inherited else config,)) as pool:
        pending = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_encode_chunk, (chunk,)))
            if len(pending) > 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# ------------------------------------------------------------------ main side
def check_columns(files, handler: str, keys: dict, explicit: set, skip_bad_rows: bool = False) -> None:
    """Every required column, and every column named in --map-keys, exists in every file with rows."""
    wanted = [k for k in COLUMN_KEYS[handler] if k in REQUIRED_COLUMNS[handler] or k in explicit]
    empty = []
    for f in files:
        columns = readers.columns_of(f, skip_bad_rows)
        if columns is None:
            empty.append(f)
            continue
        absent = [keys[key] for key in wanted if keys[key] not in columns]
        if absent and readers.FORMATS[Path(f).suffix.lower()] in ("json", "jsonl"):  # the first record's keys only
            columns = list(columns) + sorted(readers.json_keys_present(f, absent))
        for key in wanted:
            elsewhere = () if key in explicit else CONVERSATION_ELSEWHERE.get(handler, {}).get(key, ())
            if keys[key] not in columns and not (elsewhere and all(keys[k] in columns for k in elsewhere)):
                raise PreprocessError(f"{f}: column {keys[key]!r} (--map-keys {key}) not found; "
                                      f"columns: {', '.join(map(str, columns))}{_known_column(key, columns)}"
                                      f"{_openai_rows(handler, key, keys, columns)}")
    if len(empty) < len(files):  # all empty: the empty-input error says so
        for f in empty:
            print(f"warning: {f}: no rows (an empty file); skipped", file=sys.stderr)


# other tools' names for a column, which a file missing ours may hold: LLaMA-Factory's KTO label, ms-swift's
# rejected answer
KNOWN_COLUMNS = {"label": "kto_tag", "rejected": "rejected_response"}


def _known_column(key: str, columns) -> str:
    """The --map-keys that reads another tool's name for ``key``'s column, when the file has it."""
    other = KNOWN_COLUMNS.get(key)
    return f"; pass --map-keys '{{\"{key}\": \"{other}\"}}' to read column {other!r} as it" if other in columns \
        else ""


def _openai_rows(handler: str, key: str, keys: dict, columns) -> str:
    """The handler that reads OpenAI rows, when ShareGPT's conversation column is missing and a ``messages`` one
    is there (MindSpeed-LLM reads those with OpenAIInstructionHandler)."""
    if handler != SHAREGPT or key != "messages" or keys[key] == "messages" or "messages" not in columns:
        return ""
    return (f"; OpenAI rows (messages of role/content) are read with --handler-name {OPENAI} (or --map-keys "
            "'{\"messages\": \"messages\", \"role\": \"role\", \"content\": \"content\"}')")


def warn_struct_key_order(files, handler: str, keys: dict) -> None:
    """Warn once when a Parquet/Arrow input stores objects whose key order a template renders (tool schemas,
    tool-call arguments) as Arrow structs: each row gets the column's key order (``readers.struct_objects``),
    so its tokens can differ from the same row in JSON lines, and the file cannot tell whether they do."""
    columns = sorted(COLUMN_KEYS[handler], key=lambda k: k != "tools")
    for f in files:
        found = []
        for key in columns:
            paths = readers.struct_objects(f, keys[key])
            if key != "tools":  # messages and answers are read by key; only their call arguments are rendered
                paths = [p for p in paths if ".arguments" in p]
            if paths:
                more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
                found.append(f"column {keys[key]!r} ({', '.join(paths[:3])}{more})")
        if found:
            print(f"warning: {f}: {' and '.join(found)} hold objects stored as Arrow structs, which keep one key order "
                  "for every row: each row's keys are rendered in the column's order, not in the order the row was "
                  "written, so its tokens can differ from the same row in JSON lines. To keep every row's own order, "
                  "store such columns as JSON text (e.g. df[col] = df[col].map(json.dumps)) or use JSON lines",
                  file=sys.stderr)
            return


def extend_tokenizer_for_template(tokenizer, template) -> dict:
    """Give the tokenizer what the template needs, as LLaMA-Factory and MindSpeed-LLM do.

    Stop words and ``<|...|>`` role markers that are not single tokens are added as special
    tokens; a tokenizer without EOS gets the template's stop word as EOS (``replace_eos``
    templates). Returns the changes (empty: the tokenizer is used as it is); warns once.
    """
    if template is None:
        return {}
    changes = {}
    missing = [t for t in marker_tokens(template) if len(tokenizer.encode(t)) != 1]
    if missing and not hasattr(tokenizer, "add_special_tokens"):
        raise PreprocessError(f"template {template.name!r} needs {', '.join(missing)} as single tokens, which "
                              f"{tokenizer.name} lacks and cannot add; use --tokenizer-type PretrainedFromHF with a "
                              "tokenizer that has them, or another --prompt-type")
    before = tokenizer.vocab_size
    if missing:
        tokenizer.add_special_tokens(missing)
        changes["added_tokens"] = missing
    if tokenizer.eos_id is None and template.eos_replacement and hasattr(tokenizer, "set_eos_token"):
        tokenizer.set_eos_token(template.eos_replacement)
        changes["eos_token"] = template.eos_replacement
    if changes:
        what = []
        if missing:
            what.append(f"added {', '.join(missing)} (not single tokens of the tokenizer) as special tokens, "
                        f"vocabulary {before} -> {tokenizer.vocab_size}")
        if "eos_token" in changes:
            what.append(f"made {changes['eos_token']} the EOS (the tokenizer has none)")
        print(f"warning: template {template.name!r}: {'; '.join(what)}. The extended tokenizer is saved as "
              f"P_{TOKENIZER_SUFFIX}/ beside the outputs: use it for inference, and a model vocabulary of at least "
              f"{tokenizer.vocab_size} (--padded-vocab-size) for training", file=sys.stderr)
    return changes


def _tokenizer_dir(args) -> str:
    return f"{args.output_prefix}_{TOKENIZER_SUFFIX}"


def _meta_path(args) -> str:
    suffix = "text_meta.json" if args.handler_name == PRETRAIN else "packed_meta.json"
    return f"{args.output_prefix}_{suffix}"


def _final_prefixes(args):
    if args.handler_name == PRETRAIN:
        return {"text": pack_writer.text_prefix(args.output_prefix)}
    if args.pack and not args.neat_pack:  # plain packs: where their samples end (the mask cannot tell)
        return pack_writer.packed_prefixes(args.output_prefix) | {
            "sample_lengths": pack_writer.sample_lengths_prefix(args.output_prefix)}
    if pairwise.is_pairwise(args.handler_name):  # each pack's pairs' reward margins
        return pack_writer.packed_prefixes(args.output_prefix) | {
            "pair_margins": pack_writer.pair_margins_prefix(args.output_prefix)}
    if kto.is_kto(args.handler_name):  # each segment's KTO label
        return pack_writer.packed_prefixes(args.output_prefix) | {
            "kto_labels": pack_writer.kto_labels_prefix(args.output_prefix)}
    return pack_writer.packed_prefixes(args.output_prefix)


def _cached(args, cache_key: dict) -> Optional[dict]:
    meta_path = _meta_path(args)
    if args.overwrite_cache or not os.path.exists(meta_path):
        return None
    if not all(os.path.exists(f) for f in pack_writer.output_files(_final_prefixes(args))):
        return None
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    if meta.get("extended_tokenizer") and not os.path.isdir(_tokenizer_dir(args)):
        return None
    return meta if meta.get("cache_key") == cache_key else None


class _Progress:
    """tqdm bar on a TTY, a log line every --log-interval rows otherwise."""

    def __init__(self, desc: str, unit: str, log_interval: int, total=None):
        from tqdm import tqdm

        self.tty = sys.stderr.isatty()
        self.bar = tqdm(desc=desc, unit=unit, total=total, disable=not self.tty, dynamic_ncols=True)
        self.desc, self.unit, self.every, self.count, self.next_log, self.t0 = desc, unit, log_interval, 0, log_interval, time.time()

    def update(self, n: int) -> None:
        self.bar.update(n)
        self.count += n
        if not self.tty and self.every and self.count >= self.next_log:
            rate = self.count / max(time.time() - self.t0, 1e-9)
            print(f"{self.desc}: {self.count} {self.unit} ({rate:.0f}/s)", file=sys.stderr, flush=True)
            self.next_log += self.every

    def close(self) -> None:
        self.bar.close()


def run(args) -> dict:
    """Preprocess as ``args`` say; returns the sidecar metadata (statistics included)."""
    return run_or_reuse(args)[0]


def run_or_reuse(args) -> Tuple[dict, bool]:
    """:func:`run`, and whether a cached output was reused (this job built nothing).

    One job builds an output at a time (a lock beside it): a second one waits, then reuses what the first
    built. A killed build leaves temporaries that the next run of the same output removes."""
    t0 = time.time()
    validate_args(args)
    inputs = args.input if isinstance(args.input, list) else [args.input]
    files = [f for path in inputs for f in readers.resolve_input_files(path)]
    for path in inputs:
        for folder, n in readers.unread_subdirectories(path):
            print(f"warning: {folder}: {n} data file(s) in a subdirectory, not read (only {path}'s own files are): "
                  "pass it as another --input, or move its files up", file=sys.stderr)
    tokenizer_spec = TokenizerSpec(args.tokenizer_type, args.tokenizer_path)
    tokenizer = load_tokenizer(tokenizer_spec, require_eos=False)
    template = None
    if args.handler_name not in (PRETRAIN, PROCESS_REWARD) and args.prompt_type != HF_PROMPT_TYPE:
        template = with_thinking(get_template(args.prompt_type, args.prompt_type_path), args.enable_thinking)
    keys, explicit = resolve_map_keys(args.handler_name, args.map_keys)
    check_columns(files, args.handler_name, keys, explicit, args.skip_bad_rows)
    warn_struct_key_order(files, args.handler_name, keys)
    changes = extend_tokenizer_for_template(tokenizer, template)
    check_eos(tokenizer, args.tokenizer_path)
    add_bos = resolve_add_bos(args, tokenizer)
    config = EncoderConfig(args.handler_name, tokenizer_spec, args.prompt_type, args.prompt_type_path, keys,
                           args.seq_length, args.append_eod, args.skip_bad_rows, add_bos, args.chat_template,
                           args.chat_template_kwargs, args.reasoning_history, args.pad_to_multiple_of,
                           (args.placeholder_token, tuple(args.reward_tokens)) if args.handler_name == PROCESS_REWARD
                           else None, args.enable_thinking if template is not None else None)
    encoder = config.build(tokenizer)  # fail here, in the main process, on template/tokenizer mismatches
    if encoder.chat is not None and encoder.chat.reasoning_history == "keep":
        print("warning: --reasoning-history keep: turns are trained after a history that keeps earlier reasoning, "
              "which this template drops at inference (the default, split, trains each turn in its inference "
              "context)", file=sys.stderr)

    cache_key = {
        "format_version": FORMAT_VERSION,
        "arguments": {k: getattr(args, k) for k in _OUTPUT_ARGS} | {"map_keys": keys, "add_bos": add_bos}
        | ({"step_tags": encoder.layout()} if args.handler_name == PROCESS_REWARD else {})
        | ({"enable_thinking": args.enable_thinking} if args.enable_thinking is not None else {}),
        "inputs": readers.fingerprint(files),
        # vocab_size: of the tokenizer the ids come from (extended, when tokens were added)
        "tokenizer": tokenizer.identity() | changes,
        "template": (encoder.chat.identity() if encoder.chat is not None else
                     None if template is None else {"name": template.name, "definition": template.definition}),
    }
    cache_key = json.loads(json.dumps(cache_key))  # compare in the form the sidecar stores
    out_dir = _make_output_dir(args)
    _remove_leftovers(args, out_dir)
    cached = _cached(args, cache_key)
    if cached is None:
        t_lock = time.time()
        with stale_files.exclusive(str(out_dir / f".{Path(args.output_prefix).name}.lock"),
                                   args.output_prefix) as waited:
            wait = time.time() - t_lock if waited else 0.0
            if waited:  # the build this job waited for was killed: its leftovers go
                _remove_leftovers(args, out_dir)
            cached = _cached(args, cache_key)  # or it finished (even as this job checked): reused
            if cached is None:
                meta = _build(args, files, config, tokenizer, encoder, changes, cache_key, out_dir, t0, wait)
                print_summary(meta)
                return meta, False
    print(f"cache hit: reusing cached output {args.output_prefix} (inputs, tokenizer, template and arguments match "
          f"{_meta_path(args)}; pass --overwrite-cache to rebuild)")
    return cached, True


def _remove_leftovers(args, out_dir: Path) -> None:
    """The temporaries of killed runs of this output (their owner process gone): outputs, token store, sidecar."""
    name = Path(args.output_prefix).name
    where = {str(out_dir): [f".{name}.tmp-", f".{Path(_meta_path(args)).name}.tmp-"]}
    where.setdefault(str(Path(args.cache_dir or out_dir).resolve()), []).append(f".{name}.tokens-")
    for directory, prefixes in where.items():
        stale_files.remove_stale(directory, prefixes, f"preprocessing {args.output_prefix}")


def _build(args, files, config: EncoderConfig, tokenizer, encoder, changes: dict, cache_key: dict, out_dir: Path,
           t0: float, lock_wait: float = 0.0) -> dict:
    """Tokenize and pack into temporaries named after this process, then move them into place.

    The rates count from here: reading, tokenizing, packing and writing, not loading the tokenizer, checking
    the inputs and importing megatron-core's writer before (``setup_seconds``): that import takes seconds, and in
    the rates it made 200 rows look 60x slower than they were written. ``lock_wait``: the seconds spent waiting for
    another job's build of this output (a killed one), recorded apart, not as setup."""
    pack_writer.indexed_dataset_module()
    t_build = time.time()
    name = Path(args.output_prefix).name
    tmp_out = out_dir / stale_files.owned_name(f".{name}.tmp-")
    tmp_store = Path(args.cache_dir or out_dir) / stale_files.owned_name(f".{name}.tokens-")
    store = None  # the tokenised samples, once encoded
    try:
        shutil.rmtree(tmp_out, ignore_errors=True)
        tmp_out.mkdir(parents=True)
        if changes:  # workers load the extended tokenizer from its (temporary) directory
            tokenizer.save(tmp_out / TOKENIZER_SUFFIX)
            config = dataclasses.replace(config, tokenizer=TokenizerSpec("PretrainedFromHF", str(tmp_out / TOKENIZER_SUFFIX)))
        stats = _encode_all(args, files, config, tmp_store, tokenizer.pad_or_eos_id, encoder)
        store = stats.pop("_store")
        faults.fire("tokenized", 0, str(tmp_store))  # crash tests: killed with only the temporaries written
        t_encoded = time.time()
        tmp_prefixes = {k: str(tmp_out / Path(v).name) for k, v in _final_prefixes(args).items()}
        stats.update(_write_outputs(args, store, tokenizer, tmp_prefixes, _label_table(encoder),
                                    stats.pop("_kto_labels", None)))
        t_end = time.time()
        building = t_end - t_build
        stats.update(setup_seconds=round(t_build - t0 - lock_wait, 3), encode_seconds=round(t_encoded - t_build, 3),
                     elapsed_seconds=round(t_end - t0, 3), **({"lock_wait_seconds": round(lock_wait, 3)}
                                                              if lock_wait else {}),
                     rows_per_second=round(stats["rows_read"] / max(building, 1e-9), 1),
                     samples_per_second=round(stats["samples_written"] / max(building, 1e-9), 1),
                     tokens_per_second=round(stats["tokens"] / max(building, 1e-9), 1))
        meta = {
            "format": "mindspeed-pack preprocessed data",
            "cache_key": cache_key,
            "outputs": [Path(f).name for f in pack_writer.output_files(_final_prefixes(args))],
            "layout": _layout(args, tokenizer, encoder),
            # absolute: the packs are read from other working directories (inspect_pack, training)
            "tokenizer_path": os.path.abspath(args.tokenizer_path) if os.path.isdir(str(args.tokenizer_path))
            else str(args.tokenizer_path),
            "extended_tokenizer": None if not changes else {
                "path": Path(_tokenizer_dir(args)).name, "vocab_size": tokenizer.vocab_size} | changes,
            "arguments": {k: v for k, v in vars(args).items() if k != "tokenizer_path"},
            "statistics": stats,
        }
        _publish(args, tmp_prefixes, meta, tmp_out / TOKENIZER_SUFFIX if changes else None)
    except OSError as e:
        if not is_disk_full(e):
            raise
        # what was written when the disk filled, and at least the outputs still to come (3 int32 arrays per
        # token for packs, or the tokens once for documents)
        written = tree_bytes(str(tmp_out)) + tree_bytes(str(tmp_store))
        outputs = store.num_tokens * 4 * (1 if args.handler_name == PRETRAIN else 3) if store is not None else 0
        raise PreprocessError(disk_full_message("--output-prefix", args.output_prefix, max(written + outputs, 1))
                              + "; nothing was written there") from None
    finally:
        shutil.rmtree(tmp_out, ignore_errors=True)
        shutil.rmtree(tmp_store, ignore_errors=True)
    return meta


def resolve_add_bos(args, tokenizer) -> bool:
    """Whether pretraining documents start with BOS: ``--add-bos/--no-add-bos``, else as the tokenizer encodes."""
    if args.handler_name != PRETRAIN:
        return False
    if args.add_bos and tokenizer.bos_id is None:
        raise PreprocessError(f"--add-bos: tokenizer {str(args.tokenizer_path)!r} ({tokenizer.name}) has no BOS token")
    return tokenizer.adds_bos if args.add_bos is None else args.add_bos


def bos_summary(layout: dict) -> str:
    if layout["add_bos"]:
        why = "the tokenizer adds it; --no-add-bos leaves it out" if layout["add_bos_from"] == "tokenizer" else layout["add_bos_from"]
        return f"BOS (id {layout['bos_id']}) starts every document ({why})"
    if layout["bos_id"] is None:
        return "no BOS (the tokenizer has none)"
    why = "the tokenizer adds none; --add-bos adds it" if layout["add_bos_from"] == "tokenizer" else layout["add_bos_from"]
    return f"no BOS added ({why})"


def _layout(args, tokenizer, encoder) -> dict:
    if args.handler_name == PRETRAIN:
        add_bos = encoder.bos_prefix != []
        return {"kind": "text_documents", "eod_id": tokenizer.eos_id, "append_eod": args.append_eod,
                "bos_id": tokenizer.bos_id, "add_bos": add_bos,
                "add_bos_from": "tokenizer" if args.add_bos is None else f"--{'' if add_bos else 'no-'}add-bos"}
    units = _units_per_document(args)  # unpacked pairs and KTO couples: one unit a document, segment ids 1, 2
    where = "a document's" if units else "a pack's k-th"
    first, second = ("1", "2") if units else ("2k-1", "2k")
    segment_ids = args.neat_pack or units
    return {"kind": "packed" if args.pack else "unpacked", "seq_length": args.seq_length, "neat_pack": segment_ids,
            "pad_id": tokenizer.pad_or_eos_id, "eos_id": encoder.eos_id, "ignore_index": pack_writer.IGNORE_INDEX,
            "attention_mask": "segment_ids" if segment_ids else "all_ones", "labels": "aligned",
            "pad_to_multiple_of": args.pad_to_multiple_of,
            **({"pairs": f"segments {first} (chosen) and {second} (rejected) are {where} preference pair",
                "pair_margins": Path(pack_writer.pair_margins_prefix(args.output_prefix)).name}
               if pairwise.is_pairwise(args.handler_name) else {}),
            # process reward samples: each step tag's label is a reward token's id (unshifted), read by --stage prm
            **({"step_tags": encoder.layout()} if args.handler_name == PROCESS_REWARD else {}),
            **({"kto": f"segments {first} (prompt + completion, labelled) and {second} (its KL partner: the same "
                       f"prompt + the previous sample's completion) are {where} KTO couple",
                "kto_labels": Path(pack_writer.kto_labels_prefix(args.output_prefix)).name}
               if kto.is_kto(args.handler_name) else {}),
            **({"sample_lengths": Path(pack_writer.sample_lengths_prefix(args.output_prefix)).name}
               if args.pack and not args.neat_pack else {})}


def _encode_all(args, files, config: EncoderConfig, tmp_store: Path, pad_id: int,
                encoder: Optional[SampleEncoder] = None) -> dict:
    store = pack_writer.TokenStore(tmp_store, args.pad_to_multiple_of, pad_id)
    rows = truncated = trained = max_len = 0
    skipped, first_skipped, notes, first_notes = Counter(), {}, Counter(), {}
    # a bar's total on a terminal (counting JSON lines reads the file once more: not for logs)
    progress = _Progress("tokenize", "rows", args.log_interval,
                         total=readers.count_rows(files) if sys.stderr.isatty() else None)
    where = ", ".join(str(f) for f in files[:3]) + (" ..." if len(files) > 3 else "")
    couples = kto.KLCouples(args.seq_length, args.pad_to_multiple_of) if kto.is_kto(args.handler_name) else None
    try:
        for chunk in encode_in_order(readers.iter_chunks(files, CHUNK_ROWS), config, args.workers, encoder):
            ready = chunk if couples is None else couples.add(chunk)  # KTO: (sample, KL partner) couples
            store.append(ready.input_ids, ready.trained, ready.lengths)
            if chunk.pair_margins is not None:
                store.append_pair_margins(chunk.pair_margins)
            rows += chunk.rows
            truncated += chunk.truncated
            skipped.update(chunk.skipped)
            for reason, example in chunk.first_skipped.items():
                first_skipped.setdefault(reason, example)
            notes.update(chunk.notes)
            for what, example in chunk.first_notes.items():
                first_notes.setdefault(what, example)
            trained += int(np.count_nonzero(chunk.trained))
            if len(chunk.lengths):
                max_len = max(max_len, int(chunk.lengths.max()))
            progress.update(chunk.rows)
        if couples is not None:
            last = couples.finish(where)
            store.append(last.input_ids, last.trained, last.lengths)
            if couples.skipped:
                skipped[kto.SKIP_TOO_LONG] += couples.skipped
                first_skipped.setdefault(kto.SKIP_TOO_LONG, couples.first_skipped)
    finally:
        progress.close()
        store.close()
    if rows == 0:
        raise PreprocessError(f"empty input: no rows in {where}")
    if len(store) == 0:
        raise PreprocessError(f"no usable sample in {where}: all {rows} rows were skipped ({dict(skipped)})")
    tokens = store.num_tokens - store.pad_tokens  # the samples' own tokens
    # a row gives one sample (several under --prompt-type hf): "skipped" holds every reason (as it always has), split
    # into rows skipped whole and samples dropped (SAMPLE_SKIPS); "samples_read" is the rows read (its old name)
    return {"rows_read": rows, "samples_read": rows, "samples_written": len(store),
            "skipped": dict(sorted(skipped.items())),
            "rows_skipped": {why: n for why, n in sorted(skipped.items()) if why not in SAMPLE_SKIPS},
            "samples_dropped": {why: n for why, n in sorted(skipped.items()) if why in SAMPLE_SKIPS},
            "first_skipped": dict(sorted(first_skipped.items())),
            "notes": dict(sorted(notes.items())), "first_notes": dict(sorted(first_notes.items())),
            "truncated": truncated, "tokens": tokens, "trained_tokens": trained if args.handler_name != PRETRAIN else None,
            "cp_pad_tokens": store.pad_tokens, "max_sample_length": max_len,
            "mean_sample_length": round(tokens / len(store), 2), "_store": store,
            **({"_kto_labels": couples.sample_labels()} if couples is not None else {})}


def _label_table(encoder) -> Optional[np.ndarray]:
    """The labels of trained codes past 1 (process reward steps: their reward tokens' ids), for the pack writer."""
    if not isinstance(encoder, process_reward.ProcessRewardEncoder):
        return None
    return pack_writer.step_label_table(encoder.reward_token_ids, process_reward.STEP_CODE)


def _write_outputs(args, store, tokenizer, prefixes, labels: Optional[np.ndarray] = None,
                   kto_labels=None) -> dict:
    if args.handler_name == PRETRAIN:
        progress = _Progress("write", "documents", args.log_interval, total=len(store))
        pack_writer.write_text_documents(store, prefixes["text"], tokenizer.vocab_size, progress=progress)
        progress.close()
        return {"documents": len(store)}
    if _units_per_document(args):  # one preference pair / KTO couple a document, in input order
        progress = _Progress("write", "units", args.log_interval, total=len(store) // 2)
        pack_writer.write_units(store, prefixes, progress=progress, kto_labels=kto_labels)
        progress.close()
        return {"documents": len(store) // 2, **_unit_statistics(store, prefixes, kto_labels)}
    if not args.pack:
        progress = _Progress("write", "samples", args.log_interval, total=len(store))
        pack_writer.write_unpacked(store, prefixes, progress=progress, labels=labels)
        progress.close()
        return {"documents": len(store)}
    from mindspeed_pack.packing.binpack import lower_bound, pack_lengths

    t = time.time()
    try:
        pairs = pairwise.is_pairwise(args.handler_name) or kto.is_kto(args.handler_name)  # units of two samples
        plan = pairwise.pair_plan(store.lengths, args.seq_length) if pairs else pack_lengths(store.lengths,
                                                                                              args.seq_length)
    except ValueError as exc:  # lengths are truncated to seq_length, so this is a bug, not bad input
        raise PreprocessError(f"internal error: packer refused the sample lengths: {exc}") from exc
    pack_seconds = time.time() - t
    progress = _Progress("write", "packs", args.log_interval, total=plan.num_bins)
    pack_writer.write_packed(store, plan, args.seq_length, tokenizer.pad_or_eos_id, args.neat_pack, prefixes,
                             seed=args.seed, progress=progress, labels=labels,
                             sample_values=None if kto_labels is None else {"kto_labels": kto_labels})
    progress.close()
    # lower bound: of the padded lengths the packer packs; fill rate: the samples' own tokens (CP pads are waste too)
    fill_rate = (store.num_tokens - store.pad_tokens) / (plan.num_bins * args.seq_length)
    out = {"packs": plan.num_bins, "lower_bound": lower_bound(store.lengths, args.seq_length),
           "fill_rate": round(fill_rate, 6), "pack_seconds": round(pack_seconds, 3)}
    if pairs:
        out.update(_unit_statistics(store, prefixes, kto_labels))
    return out


def _units_per_document(args) -> bool:
    """Preference pairs or KTO couples written without ``--pack``: each unit its own document."""
    return not args.pack and (pairwise.is_pairwise(args.handler_name) or kto.is_kto(args.handler_name))


def _unit_statistics(store, prefixes: dict, kto_labels) -> dict:
    """What a precomputed reference must have scored (mindspeed_pack/stages/reference.py): the written documents'
    fingerprint; and the pairs, or the KTO samples and their labels."""
    documents = {k: v for k, v in prefixes.items() if k in pack_writer.PACKED_KEYS}
    out = {"data_fingerprint": pack_writer.content_fingerprint(documents)}
    if kto_labels is None:
        out.update(pairs=len(store) // 2, pairs_with_margin=int(np.count_nonzero(store.pair_margins)))
    else:
        out.update(kto_samples=len(store) // 2, desirable=int((kto_labels == 1).sum()),
                   undesirable=int((kto_labels == 0).sum()))
    return out


def _publish(args, tmp_prefixes: dict, meta: dict, tmp_tokenizer: Optional[Path] = None) -> None:
    """Move complete outputs into place; the sidecar goes last, so it vouches only for whole files."""
    meta_path = _meta_path(args)
    pack_writer.remove_quietly([meta_path])
    for key, tmp in tmp_prefixes.items():
        final = _final_prefixes(args)[key]
        for ext in (".bin", ".idx"):
            os.replace(tmp + ext, final + ext)
    # an earlier output of this prefix of another kind (pairs, plain packs, KTO) left files this one does not
    # write: the new sidecar does not name them, so they go (a reader would take them for this data's)
    if args.handler_name != PRETRAIN:
        written = set(_final_prefixes(args).values())
        stale = [prefix(args.output_prefix) for prefix in (pack_writer.sample_lengths_prefix,
                                                           pack_writer.pair_margins_prefix,
                                                           pack_writer.kto_labels_prefix)]
        pack_writer.remove_quietly([p + ext for p in stale if p not in written for ext in (".bin", ".idx")])
    if tmp_tokenizer is not None:
        shutil.rmtree(_tokenizer_dir(args), ignore_errors=True)
        os.replace(tmp_tokenizer, _tokenizer_dir(args))
    tmp_meta = stale_files.temporary_for(meta_path, f"preprocessing {args.output_prefix}")
    with open(tmp_meta, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2, default=str)
    os.replace(tmp_meta, meta_path)


def print_summary(meta: dict) -> None:
    s = meta["statistics"]

    def counted(reasons: dict) -> str:
        return f"{sum(reasons.values())} ({', '.join(f'{n} {why}' for why, n in reasons.items())})" if reasons else "0"
    rows_skipped = s.get("rows_skipped", {k: n for k, n in s["skipped"].items() if k not in SAMPLE_SKIPS})
    dropped = s.get("samples_dropped", {k: n for k, n in s["skipped"].items() if k in SAMPLE_SKIPS})
    lines = [f"rows read {s.get('rows_read', s['samples_read'])}, skipped {counted(rows_skipped)}; samples written "
             f"{s['samples_written']}, truncated {s['truncated']} (cut at --seq-length), dropped {counted(dropped)}"]
    lines += [f"  first skipped ({why}): {example}" for why, example in s.get("first_skipped", {}).items()]
    if "pairs" in s:
        lines.append(f"preference pairs {s['pairs']} (data fingerprint {s['data_fingerprint']})")
    if "kto_samples" in s:
        lines.append(f"KTO samples {s['kto_samples']} ({s['desirable']} desirable, {s['undesirable']} undesirable), "
                     f"each packed with its KL partner (data fingerprint {s['data_fingerprint']})")
    for what, n in s.get("notes", {}).items():
        hint = hf_chat.NOTE_HINTS.get(what, "written as the template renders them")
        print(f"warning: {n} {what} ({hint}; first: {s['first_notes'][what]})", file=sys.stderr)
    if s["skipped"].get(pairwise.SKIP_IDENTICAL):
        print(f"warning: {s['skipped'][pairwise.SKIP_IDENTICAL]} rows with identical chosen and rejected answers "
              "skipped (they teach no preference)", file=sys.stderr)
    if "packs" in s:
        lines.append(f"packs {s['packs']} (lower bound {s['lower_bound']}), fill rate {s['fill_rate']:.4f}")
    else:
        lines.append(f"documents {s['documents']}")
    if meta["layout"].get("kind") == "text_documents":
        lines.append(bos_summary(meta["layout"]))
    if s.get("cp_pad_tokens"):
        multiple = meta["arguments"]["pad_to_multiple_of"]
        lines.append(f"cp pad tokens {s['cp_pad_tokens']} (every sample padded to a multiple of {multiple})")
    setup = (f" (setup {s['setup_seconds']:.2f}s: tokenizer, input checks, megatron-core import"
             + (f"; waited {s['lock_wait_seconds']:.2f}s for another job's build" if "lock_wait_seconds" in s else "")
             + ")" if "setup_seconds" in s else "")
    rows_per_second = f"{s['rows_per_second']:.0f} rows/s, " if "rows_per_second" in s else ""
    lines.append(f"tokens {s['tokens']}, {s['tokens_per_second']:.0f} tokens/s, {rows_per_second}"
                 f"{s['samples_per_second']:.0f} samples/s, elapsed {s['elapsed_seconds']:.2f}s{setup}")
    outputs = ", ".join(meta["outputs"])
    if meta.get("extended_tokenizer"):
        outputs += f", {meta['extended_tokenizer']['path']}/"
    print("\n".join(lines) + f"\nwrote {outputs} and {Path(_meta_path_from(meta)).name}")


def _meta_path_from(meta: dict) -> str:
    a = meta["arguments"]
    return f"{a['output_prefix']}_{'text_meta.json' if a['handler_name'] == PRETRAIN else 'packed_meta.json'}"


def main(argv=None) -> int:
    parser = build_parser()
    args, _ = yaml_file.parse(parser, argv)  # --config run.yaml: the same flags from a file
    try:
        if args.dry_run:
            validate_args(args)
            print("preprocess_data.py arguments OK")
            return 0
        run(args)
    except RowError as exc:
        print(f"error: {exc}; {SKIP_BAD_ROWS_HINT}", file=sys.stderr)
        return 2
    except PreprocessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # not a traceback: outputs are written under temporary names (removed on exit)
        print(f"interrupted: nothing half-written is left under --output-prefix {args.output_prefix} (outputs are "
              "renamed into place whole, the sidecar last, which vouches for them); run the same command again",
              file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

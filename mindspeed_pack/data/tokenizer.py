"""Load the tokenizer preprocessing encodes with, behind one small interface.

``PretrainedFromHF`` wraps ``transformers.AutoTokenizer``; ``SentencePiece`` wraps a
``.model`` file. Both expose exactly what the handlers need: ``encode_batch(texts)`` without
added specials, ``token_to_id``, the EOS/pad/BOS ids, ``adds_bos`` (whether the tokenizer's
own encoding starts a text with BOS, as Llama's ``add_bos_token`` does) and an ``identity()``
recorded in the output's sidecar so a cache is never reused with another tokenizer.

Exactness: ids are those of transformers' ``tokenizer(text, add_special_tokens=False)``
whatever the tokenizer files hold. A ``tokenizer.json`` saved after a padded/truncated call
carries ``truncation``/``padding`` settings that the Rust backend applies on every
``encode``; transformers switches them off per call. We encode through a private copy of the
backend with ``no_truncation()``/``no_padding()`` (and transformers' special-token splitting
setting), in batches (``encode_batch``, the backend's fast path). Truncation is the
project's decision alone (the ``--seq-length`` budget, counted in the summary).
"""
from __future__ import annotations

import abc
import copy
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from mindspeed_pack.data.byte_boundaries import byte_length_table
from mindspeed_pack.data.digest import sha256_of_files
from mindspeed_pack.data.errors import PreprocessError

TOKENIZER_TYPES = ("PretrainedFromHF", "SentencePiece")
# Megatron-LM's name for a Hugging Face tokenizer, whose directory (or hub name) it takes in --tokenizer-model; it
# loads it with AutoTokenizer.from_pretrained and ends documents with its EOS, as PretrainedFromHF does here
MEGATRON_HF_TYPE = "HuggingFaceTokenizer"


def fold_megatron_hf_tokenizer(args, error=PreprocessError) -> None:
    """Megatron-LM's ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR`` as ``--tokenizer-type
    PretrainedFromHF --tokenizer-name-or-path DIR`` (MindSpeed-LLM's names), so its scripts' tokenizer flags
    work unchanged; raises ``error`` when the two directory flags name different tokenizers."""
    if getattr(args, "tokenizer_type", None) != MEGATRON_HF_TYPE:
        return
    model, path = args.tokenizer_model, args.tokenizer_name_or_path
    if model and path and os.path.abspath(str(model)) != os.path.abspath(str(path)):
        raise error(f"--tokenizer-type {MEGATRON_HF_TYPE}: --tokenizer-model {model} and --tokenizer-name-or-path "
                    f"{path} name two tokenizers: pass one")
    if not (model or path):
        raise error(f"--tokenizer-type {MEGATRON_HF_TYPE} reads the tokenizer directory from --tokenizer-model DIR")
    args.tokenizer_type, args.tokenizer_name_or_path, args.tokenizer_model = "PretrainedFromHF", model or path, None


_NOT_READ = object()
# files that define a tokenizer (a model dir also holds weights, which must not be hashed)
_TOKENIZER_FILE_HINTS = ("tokenizer", "vocab", "merges", "special_tokens", "added_tokens", "chat_template", ".model", ".tiktoken")


@dataclass(frozen=True)
class TokenizerSpec:
    """Picklable recipe to load a tokenizer in each worker process."""

    tokenizer_type: str
    path: str


class TextTokenizer(abc.ABC):
    """What preprocessing needs from a tokenizer (HF or SentencePiece below)."""

    name: str
    vocab_size: int
    eos_id: Optional[int]
    pad_id: Optional[int]
    bos_id: Optional[int]
    eos_token: Optional[str]
    bos_token: Optional[str]
    adds_bos: bool = False  # tokenizer(text) starts with BOS by default (pretraining documents follow it)

    @abc.abstractmethod
    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text, no special tokens added, never truncated or padded."""

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_runs(self, texts: list[str]) -> list[list[int]]:
        """Ids of a JSON template's text runs, each encoded alone (as LLaMA-Factory encodes a template's slots)."""
        return self.encode_batch(texts)

    @abc.abstractmethod
    def decode(self, ids) -> str:
        """Implemented by each tokenizer kind."""

    @abc.abstractmethod
    def token_to_id(self, token: str) -> Optional[int]:
        """Implemented by each tokenizer kind."""

    @abc.abstractmethod
    def id_to_token(self, token_id: int) -> str:
        """Implemented by each tokenizer kind."""

    @property
    def pad_or_eos_id(self) -> int:
        """Padding id of packs: the pad token, else EOS."""
        return self.pad_id if self.pad_id is not None else self.eos_id

    def identity(self) -> dict:
        return {
            "class": self.name,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "pad_id": self.pad_id,
            "bos_id": self.bos_id,
            "files_sha256": self.files_hash,
        }


class HFTokenizer(TextTokenizer):
    def __init__(self, path: str):
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # parallelism comes from --workers
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        except Exception as exc:  # transformers raises many kinds; name the path and the cause
            raise PreprocessError(f"cannot load tokenizer from {path!r}: {type(exc).__name__}: {exc}") from exc
        self.name = type(self.hf).__name__
        self.vocab_size = len(self.hf)
        self.eos_id, self.pad_id, self.bos_id = self.hf.eos_token_id, self.hf.pad_token_id, self.hf.bos_token_id
        self.eos_token, self.bos_token = self.hf.eos_token, self.hf.bos_token
        self._backend = self._plain_backend()
        self.files_hash = hash_tokenizer_files(path)
        # observed, not read from add_bos_token: a reloaded Llama tokenizer adds BOS through its
        # post-processor while its add_bos_token attribute may read False
        with_specials, plain = self.hf("a")["input_ids"], self.hf("a", add_special_tokens=False)["input_ids"]
        self.adds_bos = self.bos_id is not None and with_specials[:1] == [self.bos_id] and with_specials[1:1 + len(plain)] == plain

    def _plain_backend(self):
        """A copy of the Rust backend with the saved truncation/padding switched off (None: slow tokenizer)."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        self._byte_lengths = _NOT_READ  # read on first use (only the chat path needs it)
        if backend is None:
            return None
        backend = copy.deepcopy(backend)  # the transformers object keeps its own settings
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = bool(getattr(self.hf, "split_special_tokens", False))
        return backend

    def byte_level_lengths(self):
        """The per-id byte lengths when this tokenizer's token boundaries can be read without offsets, else None
        (:func:`byte_length_table`, decided once)."""
        if self._byte_lengths is _NOT_READ:
            self._byte_lengths = None if self._backend is None else byte_length_table(self._backend.to_str())
        return self._byte_lengths

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        if self._backend is not None:
            # the same ids as encode_batch without the character offsets, which nothing here reads: a row of a
            # million words took 3x the time and 1.6x the memory computing them (bench/bench_long_rows.py)
            return [e.ids for e in self._backend.encode_batch_fast(list(texts), add_special_tokens=False)]
        return self.hf(list(texts), add_special_tokens=False, truncation=False, padding=False)["input_ids"]

    def encode_batch_offsets(self, texts: list[str]) -> list["EncodedText"]:
        """Each text's ids (int32, the same as :meth:`encode_batch`) with its token boundaries: from the ids'
        byte lengths where the tokenizer is byte-level BPE that keeps the text (:mod:`byte_boundaries`, no
        offsets computed), else asked of the backend's encoding per span (:class:`EncodedText`)."""
        if self._backend is None:
            raise PreprocessError(f"tokenizer {self.name} is not a fast tokenizer: --prompt-type hf needs character "
                                  "offsets (a tokenizer.json)")
        lengths = self.byte_level_lengths()
        if lengths is None:
            return self._encode_with_offsets(texts)
        out, by_offsets = [], []
        readable = [i for i, t in enumerate(texts) if lengths.accepts(t)]
        fast = self._backend.encode_batch_fast([texts[i] for i in readable], add_special_tokens=False)
        encoded = dict(zip(readable, fast))
        for i, text in enumerate(texts):
            e = encoded.get(i)
            out.append(None if e is None else lengths.encoded(text, np.array(e.ids, dtype=np.int32)))
            if out[-1] is None:
                by_offsets.append(i)
        for i, e in zip(by_offsets, self._encode_with_offsets([texts[i] for i in by_offsets])):
            out[i] = e
        return out

    def _encode_with_offsets(self, texts: list[str]) -> list["EncodedText"]:
        return [EncodedText(np.array(e.ids, dtype=np.int32), e)
                for e in self._backend.encode_batch(list(texts), add_special_tokens=False)]

    def add_special_tokens(self, tokens: list[str]) -> None:
        """Add ``tokens`` as special tokens (kept whole, never split), as LLaMA-Factory does for templates."""
        from tokenizers import AddedToken

        self.hf.add_tokens([AddedToken(t, special=True, normalized=False) for t in tokens], special_tokens=True)
        self.vocab_size = len(self.hf)
        self._backend = self._plain_backend()

    def set_eos_token(self, token: str) -> None:
        """Make ``token`` (already a token) the EOS, as LLaMA-Factory does for a template's stop word."""
        self.hf.eos_token = token
        self.eos_id, self.eos_token = self.hf.eos_token_id, self.hf.eos_token

    def save(self, directory) -> None:
        self.hf.save_pretrained(str(directory))

    def decode(self, ids) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def token_to_id(self, token: str) -> Optional[int]:
        tid = self.hf.convert_tokens_to_ids(token)
        if tid is None or (tid == self.hf.unk_token_id and token != self.hf.unk_token):
            return None
        return int(tid)

    def id_to_token(self, token_id: int) -> str:
        return self.hf.convert_ids_to_tokens(int(token_id))


class SentencePieceTokenizer(TextTokenizer):
    def __init__(self, path: str):
        import sentencepiece

        model = Path(path)
        if model.is_dir():
            model = model / "tokenizer.model"
        if not model.is_file():
            raise PreprocessError(f"SentencePiece model {str(model)!r} not found (pass --tokenizer-model FILE.model)")
        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(model))
        self.name = "SentencePieceProcessor"
        self.vocab_size = self.sp.get_piece_size()

        def opt(i):
            return None if i < 0 else int(i)

        self.eos_id, self.pad_id, self.bos_id = opt(self.sp.eos_id()), opt(self.sp.pad_id()), opt(self.sp.bos_id())
        self.eos_token = None if self.eos_id is None else self.sp.id_to_piece(self.eos_id)
        self.bos_token = None if self.bos_id is None else self.sp.id_to_piece(self.bos_id)
        self.files_hash = sha256_of_files([model])
        mark = self.token_to_id("\u2581")  # the word mark alone (a space), when it is a piece
        self._space_alone = [mark] if mark is not None else None
        self._dummy_prefix = self.sp.encode("a", out_type=str)[0].startswith("\u2581")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(list(texts), num_threads=1)  # no BOS/EOS; parallelism comes from --workers

    def encode_runs(self, texts: list[str]) -> list[list[int]]:
        """A run that starts with a space keeps that space as its only word mark, as transformers' Llama tokenizer
        (Metaspace) and Meta's one-call encoding of a turn read it: sentencepiece's dummy prefix would add a second
        one, a lone ``\u2581`` token (Llama-2's 29871) trained before every answer of ``llama2``'s ``" {{content}} "``."""
        if not self._dummy_prefix:
            return self.encode_batch(texts)
        spaced = [i for i, t in enumerate(texts) if t.startswith(" ")]
        out = self.encode_batch(texts)
        for i, ids in zip(spaced, self.encode_batch([texts[i][1:] for i in spaced])):
            out[i] = ids or self._space_alone or out[i]  # the dummy prefix stands for the space taken off
        return out

    def identity(self) -> dict:
        # a cache written when template runs took a second word mark is rebuilt, not reused
        return super().identity() | {"template_runs": "a leading space is the word mark"}

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])

    def token_to_id(self, token: str) -> Optional[int]:
        tid = self.sp.piece_to_id(token)
        if tid == self.sp.unk_id() and token != self.sp.id_to_piece(tid):
            return None
        return int(tid)

    def id_to_token(self, token_id: int) -> str:
        return self.sp.id_to_piece(int(token_id))


def load_tokenizer(spec: TokenizerSpec, *, require_eos: bool = True) -> TextTokenizer:
    """Load ``spec``; every tokenizer used for packing needs an EOS (it pads when there is no pad)."""
    if spec.tokenizer_type == "PretrainedFromHF":
        tokenizer = HFTokenizer(spec.path)
    elif spec.tokenizer_type == "SentencePiece":
        tokenizer = SentencePieceTokenizer(spec.path)
    else:
        raise PreprocessError(f"unknown --tokenizer-type {spec.tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}")
    if require_eos:
        check_eos(tokenizer, spec.path)
    return tokenizer


def check_eos(tokenizer: TextTokenizer, path) -> None:
    if tokenizer.eos_id is None:
        raise PreprocessError(
            f"tokenizer {str(path)!r} ({tokenizer.name}) has no EOS token (pad id: {tokenizer.pad_id}); "
            "preprocessing needs one to end answers and to pad packs. Set eos_token in tokenizer_config.json, "
            "or use a template whose stop word replaces the EOS (e.g. --prompt-type qwen or chatml)"
        )


def hash_tokenizer_files(path: str) -> str:
    """sha256 over the tokenizer-defining files of a directory (weights excluded)."""
    p = Path(path)
    if p.is_file():
        return sha256_of_files([p])
    if not p.is_dir():
        return hashlib.sha256(str(path).encode()).hexdigest()
    files = sorted(f for f in p.iterdir() if f.is_file() and any(h in f.name for h in _TOKENIZER_FILE_HINTS))
    return sha256_of_files(files)


class EncodedText:
    """A text's ids and its tokens' character offsets, read from the backend's encoding only where a span needs
    them: a sample's spans need a few token boundaries, and converting every token's offsets costs more than
    all the span checks together.

    Same answers as the full ``(n, 2)`` offsets: a backend encoding's offsets are non-decreasing in both start
    and end (byte-level tokens of one character share its offsets), so the tokens overlapping ``[s, e)`` are
    the contiguous run from the first token holding character ``s`` through the last one starting before
    ``e``. Where the encoding cannot answer (a character that no token holds, e.g. one a normaliser drops,
    or an empty span) the full offsets are built once and asked instead."""

    __slots__ = ("ids", "_encoding", "_offsets")

    def __init__(self, ids: np.ndarray, encoding):
        self.ids, self._encoding, self._offsets = ids, encoding, None

    @property
    def offsets(self) -> np.ndarray:
        """``[start, end)`` of every token (int64, ``(n, 2)``), built on first use."""
        if self._offsets is None:
            self._offsets = np.array(self._encoding.offsets, dtype=np.int64).reshape(-1, 2)
        return self._offsets

    def overlapping(self, s: int, e: int):
        """The tokens with ``end > s`` and ``start < e``: ``(index, first, last)``, ``index`` a slice or an
        index array for ``mask[index]``, ``first``/``last`` ``None`` when there is none."""
        enc = self._encoding
        lo = enc.char_to_token(s) if e > s else None
        last = enc.char_to_token(e - 1) if lo is not None else None
        if last is None:
            hit = np.flatnonzero((self.offsets[:, 1] > s) & (self.offsets[:, 0] < e))
            return (hit, int(hit[0]), int(hit[-1])) if len(hit) else (hit, None, None)
        n = len(self.ids)
        while last + 1 < n and enc.token_to_chars(last + 1)[0] < e:  # further byte tokens of character e - 1
            last += 1
        return slice(lo, last + 1), lo, last

    def token_start(self, i: int) -> int:
        return self._encoding.token_to_chars(i)[0] if self._offsets is None else int(self._offsets[i, 0])

    def token_end(self, i: int) -> int:
        return self._encoding.token_to_chars(i)[1] if self._offsets is None else int(self._offsets[i, 1])

    def starts_token(self, pos: int) -> bool:
        """Whether a token starts at character ``pos``."""
        t = self._encoding.char_to_token(pos)
        if t is None:
            return bool(np.any(self.offsets[:, 0] == pos))
        return self._encoding.token_to_chars(t)[0] == pos


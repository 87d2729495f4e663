"""Token boundaries of a byte-level BPE encoding without asking the tokenizer for offsets.

Asking the Rust backend for offsets costs about a quarter of encoding long answers, and a chat
sample's spans need only a few boundaries. For a byte-level BPE tokenizer whose encoding never
changes the text, every token is a run of the text's UTF-8 bytes, in order, nothing skipped:

    text "a中"  = bytes 61 | e4 b8 ad         ids [a] [e4 b8] [ad]
    byte length    1         2    1           cumulative byte starts 0 1 3 4

so the cumulative byte lengths of the ids (one table lookup per id) are the token starts in bytes.
A token's character offsets are then those the backend reports: the character holding its first
byte, through the character holding its last (a character split over two tokens belongs to both).

Whether a tokenizer qualifies is decided once from its ``tokenizer.json`` (:func:`byte_length_table`);
each text is still checked (its ids' byte lengths must add up to its UTF-8 length, and under an NFC
normaliser the text must already be NFC), and a text that fails is encoded with offsets instead.
"""
from __future__ import annotations

import json
import unicodedata
from typing import Optional

import numpy as np

# a vocab id that no token has: far too long for any text, so the length check always fails on it
_NO_TOKEN = np.int64(1) << 40
# pre-tokenizers that only split the text (never drop or change a character)
_SPLITTING = {"Split", "Digits", "Punctuation"}


class ByteLevelLengths:
    """Per-id UTF-8 byte lengths of a qualifying tokenizer, and whether texts must be NFC."""

    def __init__(self, lengths: np.ndarray, needs_nfc: bool):
        self.lengths, self.needs_nfc = lengths, needs_nfc

    def accepts(self, text: str) -> bool:
        """Whether the tokenizer leaves ``text`` unchanged (an NFC normaliser changes only non-NFC text)."""
        return not self.needs_nfc or text.isascii() or unicodedata.is_normalized("NFC", text)

    def encoded(self, text: str, ids: np.ndarray) -> Optional["ByteEncodedText"]:
        """``text``'s boundaries from its ids, or None when the byte lengths do not add up (the offsets path)."""
        try:
            n_bytes = len(text.encode("utf-8"))
        except UnicodeEncodeError:  # a lone surrogate: no byte-level reading of it
            return None
        bounds = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(self.lengths[ids], out=bounds[1:])
        if bounds[-1] != n_bytes:
            return None
        return ByteEncodedText(ids, text, bounds)


def byte_length_table(tokenizer_json: str) -> Optional[ByteLevelLengths]:
    """The byte length of every id when the tokenizer is byte-level BPE that never changes the text, else None.

    Qualifies: a BPE model without byte fallback whose vocab is byte-level symbols; no normaliser, or NFC;
    pre-tokenizers that only split (``Split``/``Digits``/``Punctuation`` not removing) around one ``ByteLevel``
    without a prefix space; a ``ByteLevel`` decoder; no post-processor that trims offsets; added tokens without
    ``lstrip``/``rstrip`` (which would take the spaces around them into their offsets)."""
    spec = json.loads(tokenizer_json)
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        return None
    needs_nfc = False
    normalizer = spec.get("normalizer")
    for step in _steps(normalizer, "normalizers"):
        if step.get("type") != "NFC":
            return None
        needs_nfc = True
    pre = list(_steps(spec.get("pre_tokenizer"), "pretokenizers"))
    byte_levels = [p for p in pre if p.get("type") == "ByteLevel"]
    if len(byte_levels) != 1 or byte_levels[0].get("add_prefix_space"):
        return None
    if any(p.get("type") != "ByteLevel" and (p.get("type") not in _SPLITTING or p.get("behavior") == "Removed")
           for p in pre):
        return None
    if [d.get("type") for d in _steps(spec.get("decoder"), "decoders")] != ["ByteLevel"]:
        return None
    for post in _steps(spec.get("post_processor"), "processors"):
        if post.get("type") not in ("ByteLevel", "TemplateProcessing") or post.get("trim_offsets"):
            return None

    alphabet = set(_byte_level_alphabet())
    vocab = model.get("vocab") or {}
    added = spec.get("added_tokens") or []
    size = 1 + max([*vocab.values(), *(a["id"] for a in added)], default=-1)
    lengths = np.full(size, _NO_TOKEN, dtype=np.int64)
    for token, i in vocab.items():
        if not token or not alphabet.issuperset(token):
            return None
        lengths[i] = len(token)  # one byte-level symbol per byte
    for a in added:
        content = a["content"]
        if a.get("lstrip") or a.get("rstrip") or not content:
            return None
        if needs_nfc and a.get("normalized") and not unicodedata.is_normalized("NFC", content):
            return None
        n = len(content.encode("utf-8"))
        if a["id"] in vocab.values() and lengths[a["id"]] != n:
            return None  # one id, two spellings of different lengths
        lengths[a["id"]] = n
    return ByteLevelLengths(lengths, needs_nfc)


def _steps(component: Optional[dict], key: str):
    """The steps of a tokenizer.json component (a ``Sequence`` flattened; none when it is null)."""
    if not component:
        return
    if component.get("type") == "Sequence":
        for step in component.get(key) or []:
            yield from _steps(step, key)
    else:
        yield component


def _byte_level_alphabet() -> list:
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel.alphabet()


class ByteEncodedText:
    """The :class:`~mindspeed_pack.data.tokenizer.EncodedText` interface from cumulative byte starts.

    ``bounds[i]`` is token ``i``'s first byte, ``bounds[n]`` the text's length in bytes. Character
    positions become byte positions (the identity for ASCII text); a token's characters are
    ``[floor(first byte), ceil(end byte))``, as the backend reports them."""

    __slots__ = ("ids", "_text", "_bounds", "_char_bytes")

    def __init__(self, ids: np.ndarray, text: str, bounds: np.ndarray):
        self.ids, self._text, self._bounds = ids, text, bounds
        self._char_bytes = None  # byte position of every character (and of the end), non-ASCII text only

    def _byte(self, pos: int) -> int:
        if self._text.isascii():
            return pos
        return int(self._char_positions()[pos])

    def _char_positions(self) -> np.ndarray:
        if self._char_bytes is None:
            code = np.frombuffer(self._text.encode("utf-32-le"), dtype=np.uint32)
            widths = 1 + (code >= 0x80).astype(np.int64) + (code >= 0x800) + (code >= 0x10000)
            self._char_bytes = np.zeros(len(code) + 1, dtype=np.int64)
            np.cumsum(widths, out=self._char_bytes[1:])
        return self._char_bytes

    def _char_floor(self, b):
        """The character holding byte ``b`` (``b`` itself for ASCII)."""
        if self._text.isascii():
            return b
        return np.searchsorted(self._char_positions(), b, side="right") - 1

    def _char_ceil(self, b):
        """The first character starting at or after byte ``b``."""
        if self._text.isascii():
            return b
        return np.searchsorted(self._char_positions(), b, side="left")

    @property
    def offsets(self) -> np.ndarray:
        """``[start, end)`` in characters of every token (int64, ``(n, 2)``)."""
        return np.stack([np.asarray(self._char_floor(self._bounds[:-1]), dtype=np.int64),
                         np.asarray(self._char_ceil(self._bounds[1:]), dtype=np.int64)], axis=1)

    def overlapping(self, s: int, e: int):
        """The tokens with character end ``> s`` and start ``< e``: ``(slice, first, last)`` (None, None when none)."""
        lo = int(np.searchsorted(self._bounds[1:], self._byte(s), side="right"))
        hi = int(np.searchsorted(self._bounds[:-1], self._byte(e), side="left")) - 1
        if lo > hi:
            return slice(0, 0), None, None
        return slice(lo, hi + 1), lo, hi

    def token_start(self, i: int) -> int:
        return int(self._char_floor(self._bounds[i]))

    def token_end(self, i: int) -> int:
        return int(self._char_ceil(self._bounds[i + 1]))

    def starts_token(self, pos: int) -> bool:
        """Whether a token starts at character ``pos`` (its first byte is the character's first)."""
        b = self._byte(pos)
        t = int(np.searchsorted(self._bounds[1:], b, side="right"))
        return t < len(self.ids) and int(self._bounds[t]) == b

"""Look inside one pack (or unpacked sample) of preprocessed data.

    python -m mindspeed_pack.tools.inspect_pack out/alpaca --index 3 [--png mask.png] [--context-parallel-size 2]

Prints the pack's segments (id, start, length, trained tokens), each segment decoded with its
trained spans in ``[[...]]``, then each trained span on its own line (positions, tokens, and
whether it holds reasoning or a tool call), and optionally draws the block-diagonal causal attention mask
the segment ids imply (white = may attend). ``--context-parallel-size N`` adds what each CP
rank of a training run would hold of this pack (tokens, trained targets, causal work).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

import numpy as np

IGNORE_INDEX = -100


def load_pack(prefix: str, index: int) -> dict:
    """``input_ids``, ``labels``, ``attention_mask`` of pack ``index`` (copies) and the sidecar, if any."""
    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    pack = {}
    missing = [f"{prefix}_packed_{key}_document.{ext}" for key in ("input_ids", "labels", "attention_mask")
               for ext in ("bin", "idx") if not os.path.isfile(f"{prefix}_packed_{key}_document.{ext}")]
    if missing:
        text = os.path.isfile(f"{prefix}.bin") or os.path.isfile(f"{prefix}_text_document.bin")
        raise FileNotFoundError(f"{prefix}: no packs here ({missing[0]} is missing)" + (
            "; it holds pretraining documents (P_text_document), which have no segments or labels to show"
            if text else ": pass preprocess_data.py's --output-prefix"))
    for key in ("input_ids", "labels", "attention_mask"):
        ds = IndexedDataset(f"{prefix}_packed_{key}_document")
        if not 0 <= index < len(ds):
            raise IndexError(f"--index {index} out of range: {prefix} has {len(ds)} packs")
        pack[key] = np.array(ds[index], dtype=np.int64)
    meta_path = Path(f"{prefix}_packed_meta.json")
    pack["meta"] = json.loads(meta_path.read_text()) if meta_path.exists() else None
    kto = f"{prefix}_packed_kto_labels"  # KTO couples: each segment's label (1, 0; -1 a KL partner)
    if os.path.isfile(kto + ".bin") and os.path.isfile(kto + ".idx"):
        labels = IndexedDataset(kto)  # held while its memory-mapped row is copied
        pack["kto_labels"] = np.array(labels[index], dtype=np.int64)
    return pack


def segments(attention_mask: np.ndarray) -> list[tuple[int, int, int]]:
    """``(segment_id, start, length)`` of every run of equal ids (padding has id 0)."""
    change = np.flatnonzero(np.diff(attention_mask)) + 1
    starts = np.concatenate([[0], change])
    ends = np.concatenate([change, [len(attention_mask)]])
    return [(int(attention_mask[s]), int(s), int(e - s)) for s, e in zip(starts, ends)]


def block_causal_mask(attention_mask: np.ndarray) -> np.ndarray:
    """Bool [s, s]: query i may attend key j (same non-zero segment, j <= i)."""
    seg = attention_mask
    same = (seg[:, None] == seg[None, :]) & (seg[:, None] != 0)
    return same & np.tril(np.ones((len(seg), len(seg)), dtype=bool))


def print_context_parallel_split(ids: np.ndarray, labels: np.ndarray, mask: np.ndarray, cp: int,
                                 multiple: int | None = None) -> None:
    """Per CP rank: tokens, trained targets and causal query-key pairs of this pack (padding included)."""
    import torch

    from mindspeed_pack.packing.context_parallel import attention_pairs, pad_segments, split_for_rank
    from mindspeed_pack.packing.segments import build_packed_batch

    multiple = multiple or 2 * cp
    seg = torch.from_numpy(mask)[None] if (mask != 1).any() else None  # all ones: one causal sequence
    padded = pad_segments(build_packed_batch(torch.from_numpy(ids)[None], torch.from_numpy(labels)[None], seg), multiple)
    pairs = attention_pairs(padded.cu_seqlens_padded, cp)
    print(f"context parallel {cp}: segments padded to multiples of {multiple}, {padded.tokens.shape[1]} tokens "
          f"(+{padded.tokens.shape[1] - len(ids)} CP padding); rank r holds chunks r and {2 * cp - 1}-r of each")
    for r in range(cp):
        part = split_for_rank(padded, cp, r)
        print(f"  rank {r}: {part.tokens.shape[1]} tokens, {int(part.loss_mask.sum())} trained targets, "
              f"{int(pairs[r]):,} causal query-key pairs")
    print(f"  causal work max/mean {float(pairs.max() / pairs.float().mean()):.4f}")


# text that marks a trained span as reasoning or as a tool call (Qwen, Llama, DeepSeek, GLM, gpt-oss spellings)
SPAN_KINDS = (("reasoning", ("<think>", "</think>", "<|channel|>analysis")),
              ("tool call", ("<tool_call>", "<｜tool▁call▁begin｜>", "<|python_tag|>", '{"name": ', "<|call|>")))


def trained_spans(labels: np.ndarray) -> list[tuple[int, int]]:
    """``[start, end)`` of every run of trained (labelled) positions."""
    trained = np.concatenate([[False], labels != IGNORE_INDEX, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(trained))
    return [(int(s), int(e)) for s, e in zip(edges[::2], edges[1::2])]


def span_kinds(text: str) -> list[str]:
    return [kind for kind, marks in SPAN_KINDS if any(m in text for m in marks)]


def _print_spans(tokenizer, ids: np.ndarray, labels: np.ndarray, offset: int) -> None:
    for n, (s, e) in enumerate(trained_spans(labels)):
        text = tokenizer.decode(ids[s:e].tolist()) if tokenizer is not None else ""
        kinds = ", ".join(span_kinds(text)) or "answer"
        shown = f": {text[:70]!r}{'...' if len(text) > 70 else ''}" if tokenizer is not None else ""
        print(f"    trained span {n}: positions {offset + s}-{offset + e - 1} ({e - s} tokens, {kinds}){shown}")


def _print_steps(tokenizer, ids: np.ndarray, labels: np.ndarray, offset: int) -> None:
    """Process reward data: each step tag's label is a reward token, stored unshifted at the tag itself."""
    steps, previous = np.flatnonzero(labels != IGNORE_INDEX), 0
    for n, pos in enumerate(steps):
        label = tokenizer.decode([int(labels[pos])]) if tokenizer is not None else f"id {int(labels[pos])}"
        shown = ""
        if tokenizer is not None:
            text = tokenizer.decode(ids[previous:pos].tolist()).strip()
            shown = f" after {text[-60:]!r}" if len(text) <= 60 else f" after '...{text[-57:]}'"
        print(f"    step {n + 1}: tag at position {offset + int(pos)}, label {label!r}{shown}")
        previous = int(pos) + 1


def _decode_with_spans(tokenizer, ids: np.ndarray, labels: np.ndarray) -> str:
    out, start = [], 0
    trained = labels != IGNORE_INDEX
    while start < len(ids):
        end = start
        while end < len(ids) and trained[end] == trained[start]:
            end += 1
        text = tokenizer.decode(ids[start:end].tolist())
        out.append(f"[[{text}]]" if trained[start] else text)
        start = end
    return "".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prefix", help="--output-prefix used at preprocessing")
    parser.add_argument("--index", type=int, default=0, help="pack (document) index")
    parser.add_argument("--png", default=None, help="write the attention mask as an image")
    parser.add_argument("--tokenizer", default=None, help="tokenizer dir to decode with (default: the one in the sidecar)")
    parser.add_argument("--context-parallel-size", type=int, default=1,
                        help="show each CP rank's share of the pack (zigzag per sample, as training splits it)")
    parser.add_argument("--cp-multiple", type=int, default=None,
                        help="segment padding multiple (default 2 x CP; training uses 2 x CP x TP under --sequence-parallel)")
    args = parser.parse_args(argv)
    try:
        pack = load_pack(args.prefix, args.index)
    except (IndexError, FileNotFoundError, OSError, AssertionError) as exc:  # megatron asserts the files exist
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ids, labels, mask = pack["input_ids"], pack["labels"], pack["attention_mask"]
    meta = pack["meta"] or {}
    tokenizer_path = args.tokenizer or meta.get("tokenizer_path")
    if not args.tokenizer and meta.get("extended_tokenizer"):  # the template's tokens were added: P_tokenizer/
        tokenizer_path = os.path.join(os.path.dirname(os.path.abspath(args.prefix)), meta["extended_tokenizer"]["path"])
    tokenizer = None
    if tokenizer_path and meta.get("cache_key", {}).get("arguments", {}).get("tokenizer_type") == "PretrainedFromHF":
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        except (OSError, ValueError) as exc:  # moved, or a relative path of another working directory
            print(f"warning: cannot load the tokenizer {tokenizer_path!r} the sidecar names "
                  f"({exc.__class__.__name__}); token ids only: pass --tokenizer DIR to decode", file=sys.stderr)
    layout = meta.get("layout", {})
    print(f"pack {args.index} of {args.prefix}: {len(ids)} tokens, layout {layout.get('kind', '?')}, "
          f"attention_mask {layout.get('attention_mask', '?')}")
    for seg_id, start, length in segments(mask):
        sl = slice(start, start + length)
        n_trained = int((labels[sl] != IGNORE_INDEX).sum())
        kind = "padding" if seg_id == 0 else f"segment {seg_id}"
        role = ""  # preference pairs: segments 2i+1 and 2i+2 are pair i's chosen and rejected answers
        if seg_id != 0 and layout.get("pairs"):
            role = f"  (pair {(seg_id - 1) // 2 + 1}, {'chosen' if seg_id % 2 else 'rejected'})"
        elif seg_id != 0 and "kto_labels" in pack and seg_id <= len(pack["kto_labels"]):  # KTO: sample, partner
            label = int(pack["kto_labels"][seg_id - 1])
            what = {1: "sample, desirable", 0: "sample, undesirable"}.get(label, "KL partner: another row's answer")
            role = f"  (couple {(seg_id - 1) // 2 + 1}, {what})"
        print(f"  {kind:<12} start {start:>6} length {length:>6} trained {n_trained:>6}{role}")
        if seg_id != 0 and tokenizer is not None:
            print("    " + _decode_with_spans(tokenizer, ids[sl], labels[sl]).replace("\n", "\n    "))
        if seg_id != 0:
            show = _print_steps if layout.get("step_tags") else _print_spans
            show(tokenizer, ids[sl], labels[sl], start)
    if args.context_parallel_size > 1:
        print_context_parallel_split(ids, labels, mask, args.context_parallel_size, args.cp_multiple)
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 6), dpi=100)
        ax.imshow(block_causal_mask(mask), cmap="gray", interpolation="nearest")
        ax.set_title(f"pack {args.index}: block-diagonal causal mask")
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
        fig.savefig(args.png, bbox_inches="tight")
        plt.close(fig)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except BrokenPipeError:  # piped into head: the reader is gone, nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0) from None

"""Before the first step: the data's sidecar against the run's flags.

``P_packed_meta.json`` records how preprocessing wrote the packs; a flag that disagrees would silently
train something else, so the run stops with a message naming the flag, the file and what to do:
``--neat-pack`` against the kind of ``attention_mask`` (segment ids or all ones), ``--seq-length``,
``--prompt-type``, and where plain ``--pack`` data's samples end for ``--reset-position-ids``,
``--reset-attention-mask`` and ``--per-sample-loss``: the boundaries recorded at preprocessing, else
the EOS (refused where that does not find the samples written).
"""
from __future__ import annotations

import logging
import warnings

import numpy as np

from mindspeed_pack.datasets.packed_documents import DataError

log = logging.getLogger(__name__)

def _masks_hold_segment_ids(docs, limit: int = 16) -> bool:
    """True if the first packs' attention_mask is not all ones (segment ids 1..k, 0 = padding)."""
    masks = docs.datasets["attention_mask"]
    return any(np.any(np.asarray(masks[i]) != 1) for i in range(min(len(docs), limit)))


def _recorded_prompt_type(meta: dict):
    for section in ((meta.get("cache_key") or {}).get("arguments") or {}, meta.get("arguments") or {}):
        if "prompt_type" in section:
            return section["prompt_type"], True
    return None, False


def check_data(docs, args) -> None:
    """Refuse flag/data mismatches that would silently train the wrong thing; fill
    ``args.plain_pack_samples`` (plain packs' samples are needed: the recorded ones, else those at
    ``args.pack_eos_id``) and ``args.isolate_segments``."""
    meta = docs.meta or {}
    layout = meta.get("layout") or {}
    sidecar = f"{docs.prefix}_packed_meta.json"
    has_segment_ids = layout["neat_pack"] if "neat_pack" in layout else _masks_hold_segment_ids(docs)
    if args.neat_pack and not has_segment_ids:
        raise DataError(f"--neat-pack: the attention_mask of {docs.prefix!r} holds no segment ids (written without "
                        "--neat-pack, all ones); re-run preprocess_data.py --pack --neat-pack, or drop --neat-pack")
    if has_segment_ids and not args.neat_pack:
        if layout.get("pairs") or layout.get("kto_labels"):  # even unpacked: a unit's two answers are two segments
            raise DataError(f"{docs.prefix!r} holds {'preference pairs' if layout.get('pairs') else 'KTO couples'} "
                            f"whose two answers are told apart by segment ids ({sidecar}), packed or not: pass "
                            "--neat-pack, which reads them")
        given = [f for f, on in (("--reset-attention-mask", args.reset_attention_mask),
                                 ("--reset-position-ids", args.reset_position_ids)) if on]
        # the segment ids are --neat-pack's to read; the reset flags find plain packs' samples at their EOS
        why = (f"{' and '.join(given)} find{'s' if len(given) == 1 else ''} the samples of plain --pack data (at "
               "their EOS), not segment ids" if given else "without it samples attend to each other")
        raise DataError(f"{docs.prefix!r} was written with --neat-pack (its attention_mask holds segment ids"
                        + (f", {sidecar}" if layout else "") + f"): pass --neat-pack, which reads them ({why})")
    seq = layout.get("seq_length")
    if layout.get("kind") == "packed" and seq and int(seq) != args.seq_length:
        raise DataError(f"--seq-length {args.seq_length} differs from the packs' length {seq} in {sidecar}")
    _check_prompt_type(meta, args, sidecar)
    _check_pad_multiple(layout, args, sidecar)
    # one call per prefix (--train/--valid-data-path may differ): set, never reset, what another needs
    for name in ("plain_pack_samples", "pack_eos_id", "pack_pad_id"):
        setattr(args, name, getattr(args, name, None))
    plain_pack = layout.get("kind") == "packed" and not has_segment_ids
    if plain_pack and getattr(args, "sample_pad_id", None) is None:
        # the pads that end a plain pack are padding too, though its mask is all ones: without them in the
        # metrics a row with 15% padding logged padding ratio 0 and counted the pads in tokens and tokens/s
        args.sample_pad_id = layout.get("pad_id")
    if plain_pack and (args.reset_position_ids or args.reset_attention_mask or args.per_sample_loss):
        args.plain_pack_samples = True
        if getattr(docs, "sample_lengths", None) is not None:
            where = f"at the boundaries recorded in {layout['sample_lengths']}"
        else:  # written before boundaries were recorded: MindSpeed-LLM's rule, where it finds the samples
            args.pack_eos_id, args.pack_pad_id = _sample_end_ids(layout, args, sidecar)
            _check_samples_end_at_eos(docs, args, meta, sidecar)
            where = f"at EOS id {args.pack_eos_id}"
        if args.reset_position_ids or args.reset_attention_mask:
            args.isolate_segments = True
            log.info("plain --pack data: samples found %s; attention, labels and positions are isolated per "
                     "sample", where)
    elif not layout and not has_segment_ids and (args.reset_position_ids or args.reset_attention_mask
                                                  or args.per_sample_loss):
        warnings.warn(f"{docs.prefix!r} has no sidecar ({sidecar}): each document is taken as one sample "
                      "(plain packs cannot be split at EOS without it)", stacklevel=2)


def _check_pad_multiple(layout: dict, args, sidecar: str) -> None:
    """Samples padded by ``--pad-to-multiple-of``: their pads are not real tokens (``args.sample_pad_id``);
    under context parallelism, say whether training still pads them (a multiple that does not fit)."""
    multiple = int(layout.get("pad_to_multiple_of") or 1)
    args.sample_pad_id = layout.get("pad_id") if multiple > 1 else None
    cp = args.context_parallel_size
    if cp > 1:
        from mindspeed_pack.packing.context_parallel import padding_multiple

        need = padding_multiple(cp, args.tensor_model_parallel_size, args.sequence_parallel)
        if multiple % need:
            log.info("context parallelism pads every sample to a multiple of %d at batch build (%s records "
                     "--pad-to-multiple-of %d); preprocess with --pad-to-multiple-of %d to plan packs with it",
                     need, sidecar, multiple, need)


def _check_prompt_type(meta: dict, args, sidecar: str) -> None:
    if args.prompt_type is None:
        return
    recorded, known = _recorded_prompt_type(meta)
    if not known:
        warnings.warn(f"--prompt-type {args.prompt_type}: {sidecar} does not record the template, so it "
                      "cannot be checked", stacklevel=3)
    elif recorded != args.prompt_type:
        raise DataError(f"--prompt-type {args.prompt_type}, but the data was preprocessed with --prompt-type "
                        f"{recorded} ({sidecar}): pass --prompt-type {recorded}, or re-run preprocess_data.py")


def _check_samples_end_at_eos(docs, args, meta: dict, sidecar: str) -> None:
    """Refuse the EOS rule where it does not find the samples preprocessing wrote: chat templates whose
    EOS also ends system and user turns (qwen, chatml, llama3), or multi-turn samples (an EOS per answer)."""
    from mindspeed_pack.datasets.validation import count_samples_at_eos

    written = (meta.get("statistics") or {}).get("samples_written")
    if written is None:
        return
    found = count_samples_at_eos(docs, args.pack_eos_id, args.pack_pad_id)
    if found != int(written):
        template, _ = _recorded_prompt_type(meta)
        flags = " ".join(f for f, on in (("--reset-attention-mask", args.reset_attention_mask),
                                         ("--reset-position-ids", args.reset_position_ids),
                                         ("--per-sample-loss", args.per_sample_loss)) if on)
        raise DataError(f"{flags}: {docs.prefix!r} is plain --pack data without recorded sample boundaries, and "
                        f"EOS id {args.pack_eos_id} does not end only samples: it splits the packs into {found} "
                        f"pieces where preprocessing wrote {written} samples (the template "
                        f"{template or '(not recorded)'} puts that token inside a sample too: system and user turns, "
                        f"or every answer of a multi-turn sample), so answers would train without their question. "
                        f"Re-run preprocess_data.py (it records the boundaries, {sidecar} then names them), or "
                        f"preprocess with --neat-pack, or drop {flags}")


def _sample_end_ids(layout: dict, args, sidecar: str) -> tuple:
    """(EOS id, pad id) of plain packs: the sidecar's, else the tokenizer's."""
    eos, pad = layout.get("eos_id"), layout.get("pad_id")
    if eos is None and args.tokenizer_name_or_path:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer_name_or_path, use_fast=not args.tokenizer_not_use_fast)
        eos, pad = tok.eos_token_id, tok.pad_token_id
    if eos is None:
        raise DataError(f"plain --pack data with --reset-position-ids/--reset-attention-mask/--per-sample-loss: "
                        f"samples end at EOS, but {sidecar} records no eos_id; pass --tokenizer-name-or-path")
    return int(eos), (int(pad) if pad is not None else int(eos))

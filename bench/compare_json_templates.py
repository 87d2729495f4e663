"""The JSON templates (configs/finetune/templates.json) against the official templates they stand for.

    python bench/compare_json_templates.py [--rows 260]

Renders the same conversations (the tests' generated corpus: single and multi-turn, with and
without system, whitespace edge cases, special-token strings in content, empty answers, CJK;
rows with tools or reasoning only for templates that render them) with ``--prompt-type NAME``
and with ``--prompt-type hf`` on the official template, and counts per pair: identical ids
(the JSON path ends a sample on its end-of-turn token, so the official render's trailing
separator is dropped before comparing), identical trained masks, and the first difference of
one row that differs. docs/chat_templates.md explains every difference.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# JSON template -> (official template, corpus family whose tokenizer it uses)
PAIRS = {"qwen": ("qwen2_5.jinja", "qwen2_5"), "qwen2_5": ("qwen2_5.jinja", "qwen2_5"),
         "chatml": ("qwen2_5.jinja", "qwen2_5"), "llama3": ("llama3.jinja", "llama3_1"),
         "llama3 (3.1)": ("llama3_1.jinja", "llama3_1"),
         # Qwen3's hybrid template also writes an empty <think></think> block in the last answer: the JSON qwen3 is
         # its non-thinking form, which Qwen3-Instruct-2507's template renders
         "qwen3": ("qwen3_instruct_2507.jinja", "qwen3_2507")}
NO_OFFICIAL = {"llama2": "Llama-2-chat's template is not among the vendored ones (the trl wheel does not ship it)",
               "alpaca": "a prompt format, not a model's chat template", "default": "a generic format of this project",
               "empty": "no markup at all"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=260)
    args = parser.parse_args(argv)
    import numpy as np

    from mindspeed_pack.data import toy
    from mindspeed_pack.data.errors import RowError
    from mindspeed_pack.data.handlers import SHAREGPT, SampleEncoder, resolve_map_keys
    from mindspeed_pack.data.templates import get_template
    from mindspeed_pack.data.tokenizer import TokenizerSpec, load_tokenizer
    from mindspeed_pack.datasets.preprocess import EncoderConfig
    from tests import chat_corpus

    tmp = Path(tempfile.mkdtemp())
    base = toy.build_toy_tokenizer(tmp / "toy")
    keys, _ = resolve_map_keys(SHAREGPT, None)
    rows = [r for r in (chat_corpus.as_sharegpt(r) for r in chat_corpus.corpus(args.rows)) if r is not None]
    print(f"{len(rows)} conversations without reasoning (of {args.rows})")
    print(f"{'json template':<14} {'official':<26} {'rows':>5} {'same ids':>9} {'same mask':>10}  first difference")
    for name, (official, family) in PAIRS.items():
        tok_dir = tmp / family
        if not tok_dir.exists():
            chat_corpus.build_tokenizer(base, tok_dir, family)
        tok = load_tokenizer(TokenizerSpec("PretrainedFromHF", str(tok_dir)))
        hf = EncoderConfig(SHAREGPT, TokenizerSpec("PretrainedFromHF", str(tok_dir)), "hf", None, keys, None, False,
                           chat_template=str(chat_corpus.TEMPLATES / official)).build()
        js = SampleEncoder(SHAREGPT, tok, get_template(name.split()[0]), keys, None, False)
        n = same_ids = same_mask = 0
        first = ""
        for i, row in enumerate(rows):
            try:
                official_samples = hf.encode_chat_row(row, f"row {i}")
                sample, _, _ = js.encode_row(row, f"row {i}")
            except RowError:
                continue
            if len(official_samples) != 1 or sample is None:
                continue
            (ids, trained), (o_ids, o_trained) = sample, official_samples[0]
            if len(o_ids) == len(ids) + 1:  # the official trailing separator
                o_ids, o_trained = o_ids[:-1], o_trained[:-1]
            n += 1
            ok = np.array_equal(ids, o_ids)
            same_ids += ok
            same_mask += ok and np.array_equal(trained, o_trained)
            if not ok and not first:
                a, b = tok.decode(ids), tok.decode(o_ids)
                at = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
                first = f"row {i} at char {at}: json {a[at:at + 40]!r} vs official {b[at:at + 40]!r}"
        print(f"{name:<14} {official:<26} {n:>5} {same_ids:>9} {same_mask:>10}  {first}")
    for name, why in NO_OFFICIAL.items():
        print(f"{name:<14} {'-':<26} {'':>5} {'':>9} {'':>10}  {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

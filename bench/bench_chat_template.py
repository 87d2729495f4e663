"""``--prompt-type hf`` (the model's own Jinja template) against the JSON-template path and TRL's tokenization.

    python bench/bench_chat_template.py [--rows 4000] [--repeats 5]

Same rows for all of them (generated ShareGPT conversations, 1-3 turns, a system prompt), the
toy tokenizer with Qwen2.5's official chat template, one process:

1. **json**: ``SampleEncoder.encode_rows`` with ``--prompt-type qwen2_5`` (chunks of 1000 rows,
   one ``encode_batch`` per chunk), what ``preprocess_data.py`` runs per worker;
2. **hf**: the same with ``--prompt-type hf`` (renders every generation-prompt and full prefix,
   checks prefixes, encodes the samples with offsets in one batch per chunk);
3. **trl**: what TRL's SFT does per conversation for an assistant-only loss: transformers'
   ``apply_chat_template(tokenize=True, return_assistant_tokens_mask=True)`` with the
   ``{% generation %}``-marked Qwen2.5 template (trl's ``qwen2_5_training.jinja``), one row at
   a time as ``datasets.map`` calls it (without datasets' own overhead, which only adds to it).

and, as a floor, **tokenize**: the hf samples' texts through the same tokenizer in one batch, no
template, no spans: the tokenization every path does, so trl/tokenize is about the most that
trl/hf could ever reach.

The paths run round-robin (json, hf, trl, tokenize, json, ...) so that a busy machine slows them
alike; each one's best wall and best CPU time are kept. Prints seconds, rows/s and the two ratios:
hf/json (target <= 1.5) and trl/hf (target >= 2), both from wall and from CPU time.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TEMPLATES = ROOT / "tests" / "fixtures" / "chat_templates"


def _best_round_robin(paths: dict, repeats: int) -> dict:
    """Best (wall, cpu) seconds of each path, the paths run in turn ``repeats`` times."""
    best = {name: [float("inf"), float("inf")] for name in paths}
    for _ in range(repeats):
        for name, fn in paths.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            best[name] = [min(best[name][0], wall), min(best[name][1], cpu)]
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    from mindspeed_pack.data import toy
    from mindspeed_pack.data.handlers import SHAREGPT, resolve_map_keys
    from mindspeed_pack.data.preprocess import EncoderConfig
    from mindspeed_pack.data.tokenizer import TokenizerSpec

    tmp = Path(tempfile.mkdtemp())
    tok = AutoTokenizer.from_pretrained(str(toy.build_toy_tokenizer(tmp / "toy")))
    tok.chat_template = (TEMPLATES / "qwen2_5.jinja").read_text()
    tok.save_pretrained(str(tmp / "tok"))
    rows = toy.generate_sharegpt(args.rows, seed=3, turns=(1, 3))
    chunks = [[(f"row {i}", r) for i, r in enumerate(rows[s:s + 1000], s)] for s in range(0, len(rows), 1000)]
    keys, _ = resolve_map_keys(SHAREGPT, None)
    spec = TokenizerSpec("PretrainedFromHF", str(tmp / "tok"))
    json_enc = EncoderConfig(SHAREGPT, spec, "qwen2_5", None, keys, None, False).build()
    hf_enc = EncoderConfig(SHAREGPT, spec, "hf", None, keys, None, False).build()
    training = (TEMPLATES / "qwen2_5_training.jinja").read_text()
    conversations = []
    for r in rows:
        msgs = [{"role": "system", "content": r["system"]}] + [
            {"role": "user" if m["from"] == "human" else "assistant", "content": m["value"]} for m in r["conversations"]]
        conversations.append(msgs)

    counts = {}

    def run(encoder, name):
        def go():
            counts[name] = sum(int(encoder.encode_rows(c).lengths.size) for c in chunks)
        return go

    def trl():
        for msgs in conversations:
            tok.apply_chat_template(msgs, chat_template=training, tokenize=True, return_dict=True,
                                    return_assistant_tokens_mask=True)

    texts = []
    for c in chunks:
        for where, row in c:
            plan, _ = hf_enc.plan_chat_row(row, where, texts)

    def tokenize():
        for s in range(0, len(texts), 1000):
            hf_enc.tokenizer.encode_batch(texts[s:s + 1000])

    results = _best_round_robin({"json": run(json_enc, "json"), "hf": run(hf_enc, "hf"), "trl": trl,
                                 "tokenize": tokenize}, args.repeats)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{args.rows} conversations, samples: json {counts['json']}, hf {counts['hf']}; load average {load:.1f}")
    print(f"{'path':<8} {'wall s':>8} {'cpu s':>8} {'rows/s':>9}")
    for name, (wall, cpu) in results.items():
        print(f"{name:<8} {wall:>8.3f} {cpu:>8.3f} {args.rows / wall:>9.0f}")
    (jw, jc), (hw, hc), (tw, tc), (kw, kc) = (results[k] for k in ("json", "hf", "trl", "tokenize"))
    print(f"hf / json: {hw / jw:.2f}x wall, {hc / jc:.2f}x cpu (target <= 1.5)")
    print(f"trl / hf:  {tw / hw:.2f}x wall, {tc / hc:.2f}x cpu (target >= 2)")
    print(f"trl / tokenize: {tw / kw:.2f}x wall, {tc / kc:.2f}x cpu (the most trl / hf can reach)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``--prompt-type hf`` (the model's own Jinja template) against the JSON-template path and TRL's SFT pipeline.

    python bench/bench_chat_template.py [--rows 4000] [--repeats 5] [--pipeline-rows 4000] [--pipeline-data toy|prose]

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
alike; each one's best wall and best CPU time are kept. Prints seconds, rows/s and the ratios
hf/json (target <= 1.5) and trl/hf, both from wall and from CPU time. That "trl" row is only a lower
bound of what TRL costs; the issue's trl target (>= 2x) is measured end to end by the pipeline case:

**pipeline** (``--pipeline-rows``, default 4000 conversations; 0 skips it): the same rows, written as
one JSONL file of OpenAI ``messages``, to packed rows of ``--seq-length`` tokens, one process each,
each in a fresh child process that imports its libraries and loads the tokenizer before its clock:

* **trl**: ``SFTTrainer._prepare_dataset`` itself, as ``SFTTrainer(...)`` runs it for a
  conversational dataset with ``SFTConfig(assistant_only_loss=True, packing=True,
  packing_strategy="bfd", max_length=--seq-length)`` and ``dataset_num_proc`` unset (one
  process): ``datasets.load_dataset("json")`` then its ``Dataset.map`` steps (``apply_chat_template``
  with ``return_assistant_tokens_mask`` and trl's ``get_training_chat_template`` copy of the
  template, labels) and ``pack_dataset`` (BFD). The trainer object is made without a model
  (``object.__new__``, the three attributes ``_prepare_dataset`` reads set as ``__init__`` sets
  them); a fresh datasets cache per run. Skipped, with a note, when trl is not installed;
* **ours**: ``preprocess_data.py --prompt-type hf --pack --neat-pack --workers 1`` (its ``main``,
  in-process in the child; time = the sidecar's ``elapsed_seconds``: read, render, tokenize, spans,
  pack, write the indexed datasets; loading the tokenizer is inside it).

It prints each one's seconds, rows/s and tokens/s (tokens: the real tokens of the packs) and
trl_pipeline/ours.
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
sys.path.insert(0, str(ROOT / "bench"))
TEMPLATES = ROOT / "tests" / "fixtures" / "chat_templates"
OPENAI_KEYS = '{"messages": "messages", "role": "role", "content": "content", "user": "user", "assistant": "assistant"}'

_TRL_PIPELINE = r"""
import json, resource, sys, time, warnings
warnings.filterwarnings("ignore")
import datasets, transformers
from trl import SFTConfig, SFTTrainer
from trl.chat_template_utils import get_training_chat_template, has_generation_markers
datasets.disable_progress_bars()
tokenizer_dir, data, seq_length, work = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
args = SFTConfig(output_dir=work, assistant_only_loss=True, packing=True, packing_strategy="bfd",
                 max_length=seq_length, report_to="none", use_cpu=True, bf16=False)
trainer = object.__new__(SFTTrainer)  # its data preparation without a model: what __init__ sets for it
trainer._tokenizer = tok
trainer.chat_template = None if has_generation_markers(tok.chat_template) else get_training_chat_template(tok)
trainer.completion_only_loss = bool(args.completion_only_loss)  # messages rows: no prompt/completion
def cpu():
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime
c0, t0 = cpu(), time.perf_counter()
ds = datasets.load_dataset("json", data_files=data, split="train", cache_dir=work + "/datasets_cache")
ds = trainer._prepare_dataset(ds, tok, args, True, None, "train")
packs = len(ds)
seconds, cpu_s = time.perf_counter() - t0, cpu() - c0
tokens = sum(sum(x) for x in ds["seq_lengths"])
trained = sum(sum(1 for t in x if t != -100) for x in ds["labels"])
print("RESULT " + json.dumps({"seconds": seconds, "cpu_s": cpu_s, "packs": packs, "tokens": tokens, "trained": trained,
                             "template": "trl training copy" if trainer.chat_template else "tokenizer's own"}))
"""


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


def _openai_messages(row: dict) -> list:
    return [{"role": "system", "content": row["system"]}] + [
        {"role": "user" if m["from"] == "human" else "assistant", "content": m["value"]} for m in row["conversations"]]


def prose_conversations(n: int, seed: int, max_words: int = 200) -> list:
    """Conversations of 1-3 turns of English prose (bench_preprocess's rows: short questions, answers of
    Pareto-distributed length up to ``max_words`` words), a system prompt first."""
    import random

    from bench_preprocess import SYSTEM, english_words, generate_rows

    rng = random.Random(seed)
    turns = generate_rows(3 * n, seed, english_words(), max_words)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": SYSTEM}]
        for _ in range(rng.randint(1, 3)):
            t = next(turns)
            messages += [{"role": "user", "content": f"{t['instruction']}\n{t['input']}" if t["input"] else t["instruction"]},
                         {"role": "assistant", "content": t["output"]}]
        out.append(messages)
    return out


def pipeline(tmp: Path, args) -> None:
    """Rows in, packed rows of ``--seq-length`` out: TRL's SFT data preparation against ``preprocess_data.py``,
    alternately ``--pipeline-repeats`` times, the best wall and the best CPU time of each kept."""
    from bench_preprocess import _child, has_trl, run_ours, write_jsonl

    from mindspeed_pack.data import toy

    if args.pipeline_data == "toy":
        conversations = (_openai_messages(r) for r in toy.generate_sharegpt(args.pipeline_rows, seed=5, turns=(1, 3)))
    else:
        conversations = prose_conversations(args.pipeline_rows, seed=5)
    data = write_jsonl(tmp / "messages.jsonl", ({"messages": m} for m in conversations))
    print(f"pipeline: {args.pipeline_rows} {args.pipeline_data} conversations ({data.stat().st_size / 2**20:.1f} MiB of "
          f"JSONL) -> packs of {args.seq_length} tokens, one process each, best of {args.pipeline_repeats}", flush=True)
    trl_installed = has_trl()
    best = {}
    for i in range(args.pipeline_repeats):
        runs = {"ours": run_ours(tmp / "tok", data, tmp / "ours", args.seq_length, workers=1,
                                 handler=("--handler-name", "SharegptStyleInstructionHandler", "--prompt-type", "hf",
                                          "--map-keys", OPENAI_KEYS))}
        runs["ours"].update(runs["ours"].pop("stats"))
        if trl_installed:  # a fresh datasets cache each time
            runs["trl"] = _child(_TRL_PIPELINE, tmp / "tok", data, args.seq_length, tmp / f"trl{i}")
        for name, r in runs.items():
            b = best.setdefault(name, r)
            b["seconds"], b["cpu_s"] = min(b["seconds"], r["seconds"]), min(b["cpu_s"], r["cpu_s"])
    line = f"{'':<2}{{:<34}} {{:>7.2f}} s {{:>7.2f}} s cpu {{:>7.0f}} rows/s {{:>8.0f}} tokens/s  {{}}"
    ours = best["ours"]
    print(line.format("ours (preprocess_data.py)", ours["seconds"], ours["cpu_s"], args.pipeline_rows / ours["seconds"],
                      ours["tokens"] / ours["seconds"], f"{ours['packs']} packs, {ours['tokens']} tokens, "
                      f"{ours['samples_written']} samples, {ours['trained_tokens']} trained"))
    if not trl_installed:
        print("  trl pipeline: skipped (trl and datasets are not installed: pip install trl; never a dependency of "
              "the project)")
        return
    trl = best["trl"]
    print(line.format("trl (SFTTrainer._prepare_dataset)", trl["seconds"], trl["cpu_s"],
                      args.pipeline_rows / trl["seconds"], trl["tokens"] / trl["seconds"],
                      f"{trl['packs']} packs, {trl['tokens']} tokens, {trl['trained']} trained; template: "
                      f"{trl['template']}"))
    print(f"trl_pipeline / ours: {trl['seconds'] / ours['seconds']:.2f}x wall, {trl['cpu_s'] / ours['cpu_s']:.2f}x cpu "
          "(target >= 2)", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pipeline-rows", type=int, default=4000,
                        help="conversations of the end-to-end case against TRL's pipeline (0: skip it)")
    parser.add_argument("--pipeline-repeats", type=int, default=3, help="runs of each side in the end-to-end case")
    parser.add_argument("--pipeline-data", choices=("toy", "prose"), default="toy",
                        help="conversations of the end-to-end case: the toy word tasks of the rows above (~70 tokens "
                             "each), or English prose with a heavy tail of long answers (bench_preprocess.py's rows)")
    parser.add_argument("--seq-length", type=int, default=4096, help="pack length of the end-to-end case")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    from mindspeed_pack.data import toy
    from mindspeed_pack.data.handlers import SHAREGPT, resolve_map_keys
    from mindspeed_pack.data.tokenizer import TokenizerSpec
    from mindspeed_pack.datasets.preprocess import EncoderConfig

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
    conversations = [_openai_messages(r) for r in rows]

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

    if args.pipeline_rows:
        pipeline(tmp, args)
    results = _best_round_robin({"json": run(json_enc, "json"), "hf": run(hf_enc, "hf"), "trl": trl,
                                 "tokenize": tokenize}, args.repeats)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{args.rows} conversations, samples: json {counts['json']}, hf {counts['hf']}; load average {load:.1f}")
    print(f"{'path':<8} {'wall s':>8} {'cpu s':>8} {'rows/s':>9}")
    for name, (wall, cpu) in results.items():
        print(f"{name:<8} {wall:>8.3f} {cpu:>8.3f} {args.rows / wall:>9.0f}")
    (jw, jc), (hw, hc), (tw, tc), (kw, kc) = (results[k] for k in ("json", "hf", "trl", "tokenize"))
    print(f"hf / json: {hw / jw:.2f}x wall, {hc / jc:.2f}x cpu (target <= 1.5)")
    print(f"trl / hf:  {tw / hw:.2f}x wall, {tc / hc:.2f}x cpu (trl's per-row tokenization only, a lower bound of its "
          "pipeline; the >= 2 target is trl_pipeline / ours above)")
    print(f"trl / tokenize: {tw / kw:.2f}x wall, {tc / kc:.2f}x cpu (the most trl / hf can reach)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

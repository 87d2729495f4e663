"""Preprocessing a corpus with a few huge rows: wall time, CPU and peak memory.

    python bench/bench_long_rows.py [--rows 2000] [--huge-rows 2] [--huge-words 1000000] [--seq-length 2048]

Real instruction corpora have a long tail that ends in a handful of rows of megabytes (a pasted log,
a book, a base64 blob). Every row is tokenised whole before ``--seq-length`` cuts it (the cut needs
each turn's full length, LLaMA-Factory's budget rule), so such a row costs its full tokenisation.
This times ``preprocess_data.py --pack --neat-pack`` (one worker, the toy BPE tokenizer) on
``--rows`` short Alpaca rows plus ``--huge-rows`` rows of ``--huge-words`` words each, in a fresh
process: elapsed and encode seconds from the sidecar, CPU seconds and peak RSS of the child.
"""
from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mindspeed_pack.data import toy  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--huge-rows", type=int, default=2)
    p.add_argument("--huge-words", type=int, default=1_000_000)
    p.add_argument("--seq-length", type=int, default=2048)
    args = p.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tok = toy.build_toy_tokenizer(tmp / "tok")
        rows = toy.generate_alpaca(args.rows, seed=0)
        for i in range(args.huge_rows):
            text = " ".join(rng.choice(toy.WORDS) for _ in range(args.huge_words))
            rows.insert(rng.randrange(len(rows) + 1), {"instruction": "Summarise.", "input": text, "output": "ok"}
                        if i % 2 == 0 else {"instruction": "Write at length.", "input": "", "output": text})
        data = toy.write_dataset(tmp / "data.jsonl", rows)
        cmd = [sys.executable, str(ROOT / "preprocess_data.py"), "--input", str(data), "--tokenizer-name-or-path",
               str(tok), "--output-prefix", str(tmp / "out" / "p"), "--prompt-type", "qwen", "--seq-length",
               str(args.seq_length), "--pack", "--neat-pack", "--log-interval", "0"]
        t0 = time.time()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        wall = time.time() - t0
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        stats = json.loads((tmp / "out" / "p_packed_meta.json").read_text())["statistics"]
        megabytes = data.stat().st_size / 1e6
    print(f"rows {args.rows} + {args.huge_rows} huge ({args.huge_words} words, {megabytes:.0f} MB "
          f"file): wall {wall:.1f}s, encode {stats['encode_seconds']:.1f}s, cpu {usage.ru_utime + usage.ru_stime:.1f}s, "
          f"peak RSS {usage.ru_maxrss / 1024:.0f} MiB; samples {stats['samples_written']}, truncated "
          f"{stats['truncated']}")


if __name__ == "__main__":
    main()

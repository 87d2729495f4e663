"""Deterministic demo assets: a tiny Qwen-style tokenizer and learnable instruction data.

Nothing here touches the network. The data are simple word tasks (reverse, sort, repeat,
count, first/last word, upper-case) over a small vocabulary, so a tiny model can learn them
in a few hundred steps; list lengths follow a heavy-ish tail (most short, a few long) so
packing has something real to do. Everything is a pure function of ``seed``.

CLI::

    python -m mindspeed_pack.data.toy --out DIR --samples 2000
    # DIR/tokenizer/  DIR/alpaca.jsonl  DIR/sharegpt.jsonl
"""
from __future__ import annotations

import argparse
import csv
import json
import random
from pathlib import Path

WORDS = (
    "red blue green black white pink gray gold "
    "cat dog fox owl bee cow pig hen ant bat "
    "one two three four five six seven eight nine ten "
    "sun moon star rain snow wind tree leaf rock sand "
    "apple pear plum lime kiwi fig"
).split()
NUMBER_WORDS = "zero one two three four five six seven eight nine ten".split()

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]

SYSTEM_PROMPTS = ["You are a helpful assistant.", "You answer word puzzles tersely.", "Follow the instruction exactly."]


def _list_length(rng: random.Random, max_words: int) -> int:
    """Heavy-ish tail: mostly 2-10 words, ~10% up to ``max_words``."""
    if rng.random() < 0.1:
        return rng.randint(10, max_words)
    return min(max_words, 2 + int(rng.expovariate(1 / 3.0)))


def _task(rng: random.Random, max_words: int) -> tuple[str, str, str]:
    """One (instruction, input, output) word task."""
    words = [rng.choice(WORDS) for _ in range(_list_length(rng, max_words))]
    text = " ".join(words)
    kind = rng.randrange(7)
    if kind == 0:
        return "Reverse the words.", text, " ".join(reversed(words))
    if kind == 1:
        return "Sort the words alphabetically.", text, " ".join(sorted(words))
    if kind == 2:
        return "Repeat the words twice.", text, f"{text} {text}"
    if kind == 3:
        n = len(words[:10])
        return "Count the words.", " ".join(words[:10]), NUMBER_WORDS[n]
    if kind == 4:
        return "Say the first word.", text, words[0]
    if kind == 5:
        return "Say the last word.", text, words[-1]
    return "Write the words in upper case.", text, text.upper()


def generate_alpaca(n: int, seed: int = 0, *, max_words: int = 120, with_system: bool = False) -> list[dict]:
    """``n`` Alpaca rows ``{"instruction", "input", "output"[, "system"]}``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        instruction, query, answer = _task(rng, max_words)
        row = {"instruction": instruction, "input": query, "output": answer}
        if with_system:
            row["system"] = rng.choice(SYSTEM_PROMPTS)
        rows.append(row)
    return rows


def generate_sharegpt(n: int, seed: int = 0, *, turns: tuple[int, int] = (1, 3), max_words: int = 60,
                      with_system: bool = True) -> list[dict]:
    """``n`` ShareGPT rows ``{"conversations": [{"from", "value"}...], "system"}``.

    ``turns`` is the (min, max) number of human/gpt exchanges per conversation.
    """
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        messages = []
        for _ in range(rng.randint(*turns)):
            instruction, query, answer = _task(rng, max_words)
            messages.append({"from": "human", "value": f"{instruction}\n{query}"})
            messages.append({"from": "gpt", "value": answer})
        row = {"conversations": messages}
        if with_system:
            row["system"] = rng.choice(SYSTEM_PROMPTS)
        rows.append(row)
    return rows


def generate_preference(n: int, seed: int = 0, *, max_words: int = 40, sharegpt: bool = False) -> list[dict]:
    """``n`` preference rows with a learnable rule: the chosen answer is the task's answer in lower case,
    the rejected one the same words upper-cased. Alpaca ranking rows ``{"instruction", "input", "chosen",
    "rejected"}``, or ShareGPT ones ``{"conversations", "chosen": {"from": "gpt", ...}, "rejected"}``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        instruction, query, answer = _task(rng, max_words)
        chosen, rejected = answer.lower(), answer.upper()
        if sharegpt:
            rows.append({"conversations": [{"from": "human", "value": f"{instruction}\n{query}"}],
                         "chosen": {"from": "gpt", "value": chosen}, "rejected": {"from": "gpt", "value": rejected}})
        else:
            rows.append({"instruction": instruction, "input": query, "chosen": chosen, "rejected": rejected})
    return rows


def generate_pretrain_text(n: int, seed: int = 0, *, max_words: int = 200) -> list[dict]:
    """``n`` plain documents ``{"text"}`` for the pretraining handler."""
    rng = random.Random(seed)
    return [{"text": " ".join(rng.choice(WORDS) for _ in range(_list_length(rng, max_words)))} for _ in range(n)]


def write_dataset(path, rows: list[dict]) -> Path:
    """Write rows in the format the extension names: .jsonl, .json, .parquet, .arrow, .csv, .txt.

    CSV and TXT hold flat rows only (TXT: the ``text`` field, one row per line). Parquet, Arrow and CSV take
    the columns of every row (a ``system`` only some rows have is null, or empty in CSV, elsewhere), as
    pandas and HF ``datasets`` write them; pyarrow's ``from_pylist`` alone took the first row's keys and
    silently left the others out.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ext = path.suffix.lower()
    columns = list(dict.fromkeys(key for row in rows for key in row))  # every row's keys, in first-seen order
    if ext == ".jsonl":
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    elif ext == ".json":
        with open(path, "w", encoding="utf-8") as f:
            json.dump(rows, f, ensure_ascii=False, indent=1)
    elif ext in (".parquet", ".arrow"):
        import pyarrow as pa

        table = pa.Table.from_pylist([{key: row.get(key) for key in columns} for row in rows])
        if ext == ".parquet":
            import pyarrow.parquet as pq

            pq.write_table(table, path, row_group_size=1000)
        else:
            with pa.ipc.new_stream(path, table.schema) as writer:  # HF datasets' .arrow layout
                writer.write_table(table, max_chunksize=1000)
    elif ext == ".csv":
        with open(path, "w", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)
    elif ext == ".txt":
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(row["text"].replace("\n", " ") + "\n")
    else:
        raise ValueError(f"write_dataset: unsupported extension {ext!r} in {path}")
    return path


def _corpus(seed: int) -> list[str]:
    rows = generate_alpaca(400, seed) + generate_alpaca(100, seed + 1, with_system=True)
    texts = [f"{r['instruction']}\n{r['input']}\n{r['output']}" for r in rows]
    texts += SYSTEM_PROMPTS + ["system\n", "user\n", "assistant\n", "tool\n"]
    return texts


def build_toy_tokenizer(out_dir, *, vocab_size: int = 1000, seed: int = 0) -> Path:
    """Train a byte-level BPE on the toy corpus and save it as an HF fast tokenizer.

    Special tokens follow Qwen: ``<|endoftext|>`` is the pad, ``<|im_end|>`` the EOS,
    ``<|im_start|>`` opens a turn. Loads offline with ``AutoTokenizer.from_pretrained``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        model_max_length=32768,
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return out_dir


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--samples", type=int, default=2000, help="rows per dataset")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--format", default="jsonl", choices=["jsonl", "json", "parquet", "arrow", "csv"])
    args = parser.parse_args(argv)
    out = Path(args.out)
    tok = build_toy_tokenizer(out / "tokenizer", seed=args.seed)
    alpaca = write_dataset(out / f"alpaca.{args.format}", generate_alpaca(args.samples, args.seed))
    written = [tok, alpaca]
    if args.format != "csv":  # nested conversations do not fit CSV
        written.append(write_dataset(out / f"sharegpt.{args.format}", generate_sharegpt(args.samples, args.seed + 1)))
    for p in written:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

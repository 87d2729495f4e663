"""Cost of the pre-training data checks (mindspeed_pack/datasets/validation.py) vs reading the files.

Writes a packed --neat-pack dataset (``--packs`` packs of ``--seq-length`` tokens), then times
``validate_packed_documents`` against a baseline measured in the same run: reading the
three ``.bin`` files once with numpy (the least any full check must do). Both are timed
warm (page cache), best of ``--repeats``.

    python bench/bench_validation.py --packs 2000 --seq-length 4096
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--packs", type=int, default=2000)
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()

    from mindspeed_pack.datasets.packed_dataset import PackedDocuments
    from mindspeed_pack.datasets.validation import validate_packed_documents
    from tests.data_utils import write_packed_instruction_dataset

    with tempfile.TemporaryDirectory() as d:
        prefix = write_packed_instruction_dataset(os.path.join(d, "bench"), num_packs=a.packs,
                                                  seq_length=a.seq_length, meta=True)
        docs = PackedDocuments(prefix)
        args = types.SimpleNamespace(seq_length=a.seq_length, neat_pack=True, isolate_segments=True,
                                     padded_vocab_size=256)
        bins = [f"{prefix}_packed_{k}_document.bin" for k in ("input_ids", "attention_mask", "labels")]
        tokens = a.packs * a.seq_length

        def read_all():
            for b in bins:
                np.fromfile(b, dtype=np.int32).max()

        def best(fn):
            times = []
            for _ in range(a.repeats):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return min(times)

        read_all()  # warm the page cache
        base = best(read_all)
        check = best(lambda: validate_packed_documents(docs, args))
        print(f"{'':28}{'seconds':>10}{'Mtokens/s':>12}")
        print(f"{'read 3 .bin files (numpy)':28}{base:10.3f}{tokens / base / 1e6:12.1f}")
        print(f"{'validate_packed_documents':28}{check:10.3f}{tokens / check / 1e6:12.1f}")
        print(f"{a.packs} packs x {a.seq_length} tokens ({3 * tokens * 4 / 2**20:.0f} MiB): "
              f"validation / plain read = {check / base:.1f}x")


if __name__ == "__main__":
    main()

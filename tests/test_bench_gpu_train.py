"""bench/bench_gpu_train.py keeps running where the suite runs (a CPU, the tiny shape): both sides train the
same packs and every figure the GPU table needs is produced (no timing is asserted)."""
import importlib.util
from pathlib import Path

import pytest


@pytest.mark.slow
def test_gpu_train_bench_runs_both_sides_at_the_tiny_shape(tmp_path):
    path = Path(__file__).resolve().parents[1] / "bench" / "bench_gpu_train.py"
    spec = importlib.util.spec_from_file_location("bench_gpu_train", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = bench.main(["--shape", "tiny", "--seq-length", "256", "--global-batch", "2", "--warmup", "1",
                          "--steps", "1", "--json", str(tmp_path / "out.json")])
    for side in ("ours", "transformers"):
        r = results[side]
        assert r["tokens/s"] > 0 and r["tokens"] > 0 and r["launches/step"] > 0 and r["peak memory GiB"] > 0
    # identical packs: both sides count the same real tokens per step
    assert results["ours"]["tokens"] == results["transformers"]["tokens"]
    assert results["ratio"] > 0 and (tmp_path / "out.json").exists()

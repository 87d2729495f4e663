"""Guarantees of the run-comparison tool: what users rely on to validate a new setup."""
from __future__ import annotations

import json
import math
import re

import pytest

from mindspeed_pack.tools.compare_runs import compact_steps, compare, main
from mindspeed_pack.tools.run_metrics import RunMetricsError, load_all_splits, load_run

# --------------------------------------------------------------------------- helpers


def loss_at(step: int) -> float:
    return 6.0 * math.exp(-step / 40.0) + 2.0 + 0.01 * math.sin(step)


def make_records(steps, scale_from=None, factor=1.0, valid_every=0):
    """Train records (and valid records every ``valid_every`` steps) of a synthetic run."""
    records = []
    for step in steps:
        loss = loss_at(step) * (factor if scale_from is not None and step >= scale_from else 1.0)
        records.append({
            "iteration": step, "split": "train", "lm loss": loss, "lr": 1e-4 * min(1.0, step / 10),
            "grad norm": 1.0 + 1.0 / step, "tokens": 4096, "tokens/s": 1234.5,
            "padding ratio": 0.02, "samples per pack": 3.1,
        })
        if valid_every and step % valid_every == 0:
            records.append({"iteration": step, "split": "valid", "lm loss": loss_at(step) - 0.1})
    return records


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def train_line(record, total=300):
    return (
        f" [2026-11-21 14:00:01] iteration {record['iteration']:8d}/{total:8d} |"
        f" consumed samples: {record['iteration'] * 8:12d} | elapsed time per iteration (ms): 512.3 |"
        f" learning rate: {record['lr']:.6E} | global batch size:     8 | lm loss: {record['lm loss']:.6E} |"
        f" loss scale: 1.0 | grad norm: {record['grad norm']:.3f} | number of skipped iterations:   0 |"
        f" number of nan iterations:   0 |\n"
    )


def valid_line(record):
    loss = record["lm loss"]
    return (
        "-" * 60 + "\n"
        f" validation loss at iteration {record['iteration']} | lm loss value: {loss:.6E} |"
        f" lm loss PPL: {math.exp(loss):.6E} | \n" + "-" * 60 + "\n"
    )


def write_log(path, records):
    lines = ["using world size: 1\n", "------------------------ arguments ------------------------\n",
             "  seq_length ...................................... 4096\n"]
    for r in records:
        lines.append(valid_line(r) if r["split"] == "valid" else train_line(r))
    path.write_text("".join(lines))
    return path


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def last_line(text):
    return text.strip().splitlines()[-1]


# --------------------------------------------------------------------------- verdicts


def test_identical_runs_have_zero_difference_and_exit_0(tmp_path, capsys):
    a = write_jsonl(tmp_path / "a.jsonl", make_records(range(1, 51)))
    b = write_jsonl(tmp_path / "b.jsonl", make_records(range(1, 51)))
    report = compare(load_run(a), load_run(b), ["lm loss", "grad norm"])
    assert report.passed
    for metric in report.metrics:
        assert len(metric.steps) == 50
        assert metric.max_rel_err == 0.0 and metric.mean_rel_err == 0.0
        assert all(s.abs_err == 0.0 for s in metric.steps)
    code, out, _ = run_cli(capsys, a, b, "--metrics", "lm loss,grad norm")
    assert code == 0
    assert last_line(out).startswith("PASS")


def test_divergence_from_step_k_exits_1_and_names_step_k(tmp_path, capsys):
    k = 37
    a = write_jsonl(tmp_path / "a.jsonl", make_records(range(1, 101)))
    b = write_jsonl(tmp_path / "b.jsonl", make_records(range(1, 101), scale_from=k, factor=1.05))
    report = compare(load_run(a), load_run(b), ["lm loss"], tolerance=0.02)
    assert not report.passed
    metric = report.metrics[0]
    assert metric.first_over_step == k
    assert metric.over_steps == list(range(k, 101))
    assert metric.max_rel_err == pytest.approx(0.05 / 1.05)

    code, out, _ = run_cli(capsys, a, b, "--tolerance", "0.02")
    assert code == 1
    assert "'lm loss'" in last_line(out) and f"iteration {k}" in last_line(out)
    # by how much, in the relative terms of the threshold (the last line said only where)
    a_k, b_k = loss_at(k), loss_at(k) * 1.05
    words = f"(rel err {0.05 / 1.05:.3e} > 0.02: A {a_k:.8g}, B {b_k:.8g})"
    assert f"'lm loss' first over tolerance at iteration {k} {words}" in last_line(out), last_line(out)
    assert f"first at iteration {k} {words}: {k}-100" in out
    assert re.search(rf"^\s+{k}\s.*> tol$", out, re.MULTILINE), "the diverging row is marked"
    assert not re.search(rf"^\s+{k - 1}\s.*> tol$", out, re.MULTILINE)
    # the same runs pass under a looser tolerance: the tolerance is what decides
    code, _, _ = run_cli(capsys, a, b, "--tolerance", "0.06")
    assert code == 0


def test_only_the_failing_metric_is_named(tmp_path, capsys):
    a = write_jsonl(tmp_path / "a.jsonl", make_records(range(1, 21)))
    records = make_records(range(1, 21))
    records[11]["grad norm"] *= 2  # iteration 12
    b = write_jsonl(tmp_path / "b.jsonl", records)
    code, out, _ = run_cli(capsys, a, b, "--metrics", "lm loss,grad norm")
    assert code == 1
    assert "'grad norm' first over tolerance at iteration 12" in last_line(out)
    assert "'lm loss'" not in last_line(out)


def test_atol_absorbs_differences_near_zero(tmp_path, capsys):
    a = write_jsonl(tmp_path / "a.jsonl", [{"iteration": 1, "lr": 0.0}, {"iteration": 2, "lr": 1e-5}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"iteration": 1, "lr": 1e-12}, {"iteration": 2, "lr": 1e-5}])
    assert run_cli(capsys, a, b, "--metrics", "lr")[0] == 1  # relative error at 0 is 1.0
    assert run_cli(capsys, a, b, "--metrics", "lr", "--atol", "1e-10")[0] == 0


def test_nan_in_one_run_fails_nan_in_both_agrees(tmp_path, capsys):
    base = [{"iteration": i, "lm loss": 3.0} for i in range(1, 6)]
    a = write_jsonl(tmp_path / "a.jsonl", base)
    b_records = [dict(r) for r in base]
    b_records[2]["lm loss"] = math.nan  # iteration 3; json writes NaN
    b = write_jsonl(tmp_path / "b.jsonl", b_records)
    code, out, _ = run_cli(capsys, a, b)
    assert code == 1 and "iteration 3 (NaN/inf in B only: A 3, B nan)" in last_line(out), last_line(out)

    both = write_jsonl(tmp_path / "both.jsonl", b_records)
    code, out, _ = run_cli(capsys, b, both)
    assert code == 0
    assert "NaN/inf in both runs (counted as agreement) at: 3" in out


# --------------------------------------------------------------------------- alignment


def test_missing_steps_are_aligned_and_reported(tmp_path, capsys):
    a = write_jsonl(tmp_path / "a.jsonl", make_records(range(1, 61)))
    b_steps = [s for s in range(1, 66) if s not in (10, 11, 12, 40)]
    b = write_jsonl(tmp_path / "b.jsonl", make_records(b_steps))
    report = compare(load_run(a), load_run(b))
    metric = report.metrics[0]
    assert [s.iteration for s in metric.steps] == [s for s in range(1, 61) if s not in (10, 11, 12, 40)]
    assert metric.missing_in_b == [10, 11, 12, 40]
    assert metric.missing_in_a == [61, 62, 63, 64, 65]
    assert report.passed  # missing steps are reported, not failed
    code, out, _ = run_cli(capsys, a, b)
    assert code == 0
    assert "missing in B, only in A (4 steps): 10-12, 40" in out
    assert "missing in A, only in B (5 steps): 61-65" in out
    # the verdict says so too: a candidate cut short at step 60 of 65 printed a bare 'PASS' as its last line
    assert last_line(out).endswith("(not compared: iterations 10-12, 40 only in A; iterations 61-65 only in B)")


def test_out_of_order_and_repeated_steps_last_record_wins(tmp_path, capsys):
    records = make_records([3, 1, 2, 5, 4])
    # a resumed run re-logs iterations 4 and 5; the re-logged record replaces the old one whole
    records.append({"iteration": 5, "split": "train", "lm loss": 9.5})
    records.append({"iteration": 4, "split": "train", "lm loss": 8.5, "grad norm": 0.5})
    run = load_run(write_jsonl(tmp_path / "run.jsonl", records))
    assert list(run["lm loss"]) == [1, 2, 3, 4, 5]
    assert run["lm loss"][5] == 9.5 and run["lm loss"][4] == 8.5
    assert run["grad norm"][4] == 0.5
    assert 5 not in run["grad norm"], "fields of the replaced record must not leak into the new one"
    assert run["lm loss"][3] == loss_at(3)

    log_records = make_records([1, 2, 3])
    relogged = dict(log_records[1], **{"lm loss": 7.25})
    log = write_log(tmp_path / "run.log", log_records + [relogged])
    assert load_run(log)["lm loss"] == {1: pytest.approx(loss_at(1)), 2: 7.25, 3: pytest.approx(loss_at(3))}

    # the comparison says which steps a run logged twice and which record it took (it took the last silently)
    _, _, err = run_cli(capsys, write_jsonl(tmp_path / "a.jsonl", make_records(range(1, 6))), tmp_path / "run.jsonl")
    assert (f"note: B ({tmp_path / 'run.jsonl'}) logs iterations 4-5 more than once (a resumed or restarted run "
            "re-logs the steps after its checkpoint): the last record of each is compared") in err, err
    _, _, err = run_cli(capsys, log, log, "--metrics", "lm loss")
    assert "note: A (" in err and "note: B (" in err and "logs iteration 2 more than once" in err, err


# --------------------------------------------------------------------------- reading


def test_megatron_style_log_lines_are_parsed_generically(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(
        "> building train, validation, and test datasets ...\n"
        " [2026-11-21 14:00:01] iteration       10/     300 | consumed samples:           80 |"
        " elapsed time per iteration (ms): 512.3 | learning rate: 9.999999E-05 | global batch size:     8 |"
        " lm loss: 5.123456E+00 | loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 |"
        " number of nan iterations:   0 |\n"
        "[rank0]:  [2026-11-21 14:00:02] iteration       20/     300 | throughput per GPU (TFLOP/s/GPU): 12.5 |"
        " lm loss: nan | my custom metric: -3 | note: warm |\n"
        "-----------------------------------------------------------------\n"
        " validation loss at iteration 20 | lm loss value: 4.123456E+00 | lm loss PPL: 6.18E+01 | \n"
        " validation loss at iteration 30 on validation set | lm loss value: 4.0E+00 | \n"
        " validation loss at the end of training for test data | lm loss value: 3.9E+00 |\n"
    )
    splits = load_all_splits(log)
    train, valid = splits["train"], splits["valid"]
    assert train["lm loss"][10] == 5.123456
    assert math.isnan(train["lm loss"][20])
    assert train["lr"] == {10: 9.999999e-05}  # "learning rate" -> "lr"
    assert train["consumed samples"] == {10: 80.0}
    assert train["elapsed time per iteration (ms)"] == {10: 512.3}
    assert train["grad norm"] == {10: 1.234}
    assert train["number of nan iterations"] == {10: 0.0}
    assert train["throughput per GPU (TFLOP/s/GPU)"] == {20: 12.5}
    assert train["my custom metric"] == {20: -3.0}
    assert "note" not in train  # non-numeric fields are not metrics
    assert valid["lm loss"] == {20: 4.123456, 30: 4.0}  # "lm loss value" -> valid "lm loss"
    assert valid["lm loss PPL"] == {20: 61.8}
    # the end of training's evaluation names no iteration: it is the last one trained (20), split test-end
    assert set(splits) == {"train", "valid", "test-end"} and splits["test-end"]["lm loss"] == {20: 3.9}
    assert load_run(log, split="valid") == valid


def test_jsonl_and_log_of_the_same_run_give_the_same_values(tmp_path, capsys):
    records = make_records(range(1, 41), valid_every=10)
    jsonl = write_jsonl(tmp_path / "metrics.jsonl", records)
    log = write_log(tmp_path / "train.log", records)
    for split in ("train", "valid"):
        from_jsonl, from_log = load_run(jsonl, split), load_run(log, split)
        for metric in from_log.keys() & from_jsonl.keys():
            assert from_log[metric].keys() == from_jsonl[metric].keys()
            for step, value in from_jsonl[metric].items():
                # the log prints 7 significant digits (grad norm: 3 decimals)
                assert from_log[metric][step] == pytest.approx(value, rel=1e-6, abs=5e-4)
    assert {"lm loss", "lr", "grad norm"} <= load_run(log).keys()
    code, _, _ = run_cli(capsys, jsonl, log, "--metrics", "lm loss,lr", "--tolerance", "1e-6")
    assert code == 0
    code, _, _ = run_cli(capsys, jsonl, log, "--split", "valid", "--tolerance", "1e-6")
    assert code == 0


def test_format_is_detected_by_content_not_extension(tmp_path):
    records = make_records(range(1, 6))
    jsonl_named_log = write_jsonl(tmp_path / "metrics.log", records)
    log_named_txt = write_log(tmp_path / "console.txt", records)
    assert load_run(jsonl_named_log)["lm loss"] == {r["iteration"]: r["lm loss"] for r in records}
    assert load_run(log_named_txt)["lm loss"][5] == pytest.approx(loss_at(5), rel=1e-6)


def test_run_directory_prefers_jsonl_over_log(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    write_jsonl(run / "metrics.jsonl", make_records(range(1, 11)))
    write_log(run / "train.log", make_records(range(1, 3)))
    assert list(load_run(run)["lm loss"]) == list(range(1, 11))
    two_logs = tmp_path / "two"
    two_logs.mkdir()
    write_log(two_logs / "a.log", make_records([1]))
    write_log(two_logs / "b.log", make_records([1]))
    code, _, err = run_cli(capsys, run, two_logs)
    assert code == 2 and str(two_logs) in err and "a.log" in err and "b.log" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run_cli(capsys, run, empty)
    assert code == 2 and str(empty) in err


# --------------------------------------------------------------------------- input errors


def test_malformed_json_line_exits_2_naming_file_and_line(tmp_path, capsys):
    good = write_jsonl(tmp_path / "good.jsonl", make_records(range(1, 4)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"iteration": 1, "lm loss": 3.0}) + "\n\n"
                   + '{"iteration": 2, "lm loss": 3.0\n')
    code, _, err = run_cli(capsys, good, bad)
    assert code == 2 and f"{bad}:3" in err and "malformed JSON" in err
    with pytest.raises(RunMetricsError, match=re.escape(f"{bad}:3")):
        load_run(bad)

    no_iteration = tmp_path / "no_iteration.jsonl"
    no_iteration.write_text('{"iteration": 1, "lm loss": 3.0}\n{"iteration": "2", "lm loss": 3.0}\n')
    code, _, err = run_cli(capsys, good, no_iteration)
    assert code == 2 and f"{no_iteration}:2" in err and "'iteration'" in err


@pytest.mark.parametrize("content", ["", "hello\nno metrics here | at all\n"])
def test_file_without_records_exits_2(tmp_path, capsys, content):
    good = write_jsonl(tmp_path / "good.jsonl", make_records(range(1, 4)))
    empty = tmp_path / "empty.log"
    empty.write_text(content)
    code, _, err = run_cli(capsys, good, empty)
    assert code == 2 and str(empty) in err


def test_missing_file_exits_2(tmp_path, capsys):
    good = write_jsonl(tmp_path / "good.jsonl", make_records(range(1, 4)))
    code, _, err = run_cli(capsys, good, tmp_path / "nope.jsonl")
    assert code == 2 and "nope.jsonl" in err


def test_absent_metric_exits_2_naming_the_run(tmp_path, capsys):
    a = write_jsonl(tmp_path / "a.jsonl", make_records(range(1, 4)))
    b = write_jsonl(tmp_path / "b.jsonl", [{"iteration": i, "lm loss": 1.0} for i in range(1, 4)])
    code, _, err = run_cli(capsys, a, b, "--metrics", "lm loss,grad norm")
    assert code == 2 and str(b) in err and "'grad norm'" in err
    code, _, err = run_cli(capsys, a, b, "--split", "valid")
    assert code == 2 and str(a) in err and "'valid'" in err


def test_no_common_steps_exits_2_naming_both_files(tmp_path, capsys):
    a = write_jsonl(tmp_path / "a.jsonl", make_records(range(1, 11)))
    b = write_jsonl(tmp_path / "b.jsonl", make_records(range(11, 21)))
    code, _, err = run_cli(capsys, a, b)
    assert code == 2 and str(a) in err and str(b) in err and "no common iteration" in err
    assert "1-10" in err and "11-20" in err


@pytest.mark.parametrize("argv", [["--tolerance", "-1"], ["--tolerance", "nan"], ["--metrics", " , "],
                                  ["--max-rows", "-3"], []])
def test_usage_errors_exit_2(tmp_path, capsys, argv):
    a = write_jsonl(tmp_path / "a.jsonl", make_records(range(1, 4)))
    runs = [a, a] if argv else [a]  # [] = a missing positional argument
    assert run_cli(capsys, *runs, *argv)[0] == 2


# --------------------------------------------------------------------------- outputs


def test_long_table_keeps_first_last_and_over_tolerance_rows(tmp_path, capsys):
    a = write_jsonl(tmp_path / "a.jsonl", make_records(range(1, 1001)))
    records = make_records(range(1, 1001))
    records[499]["lm loss"] *= 1.5  # a single spike at iteration 500
    b = write_jsonl(tmp_path / "b.jsonl", records)
    code, out, _ = run_cli(capsys, a, b, "--max-rows", "10")
    assert code == 1 and "iteration 500" in last_line(out)
    table = out[out.index("== lm loss =="):out.index("\nsummary")]
    rows = [int(m) for m in re.findall(r"^\s+(\d+)\s", table, re.MULTILINE)]
    assert rows == [1, 2, 3, 4, 5, 500, 996, 997, 998, 999, 1000]
    assert "(494 rows not shown)" in out
    assert run_cli(capsys, a, b, "--max-rows", "0")[1].count("\n") > 1000


def test_plot_is_a_valid_png_and_json_round_trips(tmp_path, capsys):
    import matplotlib.image

    a = write_jsonl(tmp_path / "a.jsonl", make_records(range(1, 31)))
    records = make_records(range(1, 31), scale_from=20, factor=1.1)
    records[3]["lm loss"] = math.nan
    b = write_jsonl(tmp_path / "b.jsonl", records)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    png, report_json = out_dir / "diff.png", out_dir / "diff.json"
    code, _, _ = run_cli(capsys, a, b, "--metrics", "lm loss,grad norm", "--plot", png, "--json", report_json)
    assert code == 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    data = json.loads(report_json.read_text())
    assert data["passed"] is False
    loss = data["metrics"][0]
    assert loss["metric"] == "lm loss" and loss["first_over_step"] == 4 and loss["over_steps"][1] == 20
    assert loss["steps"][3]["b"] == "NaN" and loss["steps"][3]["rel_err"] == "Infinity"
    assert sorted(p.name for p in out_dir.iterdir()) == ["diff.json", "diff.png"]  # no temp files left

    code, _, err = run_cli(capsys, a, b, "--plot", tmp_path / "no_such_dir" / "x.png")
    assert code == 2 and "x.png" in err


def test_plot_legend_tells_runs_in_directories_of_the_same_layout_apart(tmp_path, capsys, monkeypatch):
    """runs/tp1/metrics.jsonl against runs/tp2/metrics.jsonl (docs/precision_comparison.md's layout) was drawn as
    "A: metrics.jsonl" and "B: metrics.jsonl": the legend named neither run."""
    from matplotlib.figure import Figure

    for run in ("tp1", "tp2"):
        (tmp_path / run).mkdir()
        write_jsonl(tmp_path / run / "metrics.jsonl", make_records(range(1, 5)))
    figures = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (figures.append(self), save(self, *a, **k))[1])
    code, _, _ = run_cli(capsys, tmp_path / "tp1", tmp_path / "tp2", "--plot", tmp_path / "diff.png")
    assert code == 0
    labels = [t.get_text() for t in figures[0].axes[0].get_legend().get_texts()]
    assert labels == ["A: tp1/metrics.jsonl", "B: tp2/metrics.jsonl"]


def test_compact_steps_lists_ranges_and_strides():
    assert compact_steps([1, 2, 3, 4, 7, 10, 20, 30]) == "1-4, 7, 10-30 every 10"
    assert compact_steps([5]) == "5" and compact_steps([]) == "none"
    assert compact_steps(list(range(0, 100, 2)) + list(range(200, 220))) == "0-98 every 2, 200-219"


def test_reads_what_the_trainer_writes(tmp_path, capsys):
    """The trainer's MetricsLogger output (console and --metrics-file) reads back identically."""
    from types import SimpleNamespace

    from mindspeed_pack.training.metrics import MetricsLogger

    metrics_file = tmp_path / "run" / "metrics.jsonl"
    args = SimpleNamespace(train_iters=12, log_interval=1, metrics_file=str(metrics_file), tensorboard_dir=None)
    logger = MetricsLogger(args, enabled=True)
    capsys.readouterr()
    for step in range(1, 13):
        logger.step({
            "iteration": step, "split": "train", "lm loss": loss_at(step), "lr": 1e-4 * step / 12,
            "grad norm": 1.0 + 1.0 / step, "tokens": 4000 + step, "tokens/s": 1234.5, "padding ratio": 0.02,
            "samples per pack": 3.1, "step time (ms)": 512.3, "consumed samples": 8 * step,
            "global batch size": 8, "skipped": 0, "loss scale": 2.0 ** (20 - step // 4),
        })
        if step % 4 == 0:
            logger.validation(step, loss_at(step) - 0.1, tokens=1000)
    logger.validation(12, 2.5, tokens=1000, label="the end of training for val data")
    logger.validation(12, 2.7, tokens=1000, split="test", label="the end of training for test data")
    logger.close()
    log = tmp_path / "console.log"
    log.write_text(capsys.readouterr().out)

    from_jsonl, from_log = load_all_splits(metrics_file), load_all_splits(log)
    assert from_jsonl["train"]["lm loss"] == {s: loss_at(s) for s in range(1, 13)}
    assert from_jsonl["valid"]["lm loss"] == {s: loss_at(s) - 0.1 for s in (4, 8, 12)}
    # the console prints lm loss, lr and grad norm with 7 significant digits (grad norm had 4 decimals: a log
    # compared with its own metrics file at 1e-5 failed); the end-of-training evaluations read back too (the log
    # reader dropped them: they name no iteration)
    for split, metric, digits in [("train", "lm loss", 1e-6), ("train", "lr", 1e-6), ("train", "grad norm", 1e-6),
                                  ("train", "loss scale", 0.0), ("valid", "lm loss", 1e-6),
                                  ("valid-end", "lm loss", 1e-6), ("test-end", "lm loss", 1e-6)]:
        assert from_log[split][metric] == pytest.approx(from_jsonl[split][metric], rel=digits), metric
    code, _, _ = run_cli(capsys, metrics_file.parent, log, "--metrics", "lm loss,lr", "--tolerance", "1e-6")
    assert code == 0


def test_the_end_of_training_evaluation_keeps_the_interval_one(tmp_path):
    """Both evaluate the last iteration: the end's replaced the interval's, which was then never compared."""
    path = tmp_path / "m.jsonl"
    records = [{"iteration": 2, "split": "valid", "lm loss": 3.0}, {"iteration": 4, "split": "valid", "lm loss": 2.0},
               {"iteration": 4, "split": "valid", "lm loss": 2.5, "label": "the end of training for val data"},
               {"iteration": 4, "split": "test", "lm loss": 2.7, "label": "the end of training for test data"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert load_run(path, split="valid")["lm loss"] == {2: 3.0, 4: 2.0}
    assert load_run(path, split="valid-end")["lm loss"] == {4: 2.5}
    assert load_run(path, split="test-end")["lm loss"] == {4: 2.7}


def test_run_summary_rates_tokens_over_time_and_names_what_it_counts(tmp_path):
    """tokens/s is the steps' tokens over their time (not the mean of per-step rates: a slow step weighed as much as
    a fast one), the first step left out; the token total is named for what the file counts (prompts included,
    padding not; it was called "trained tokens"); a console log, which holds no token counts, reports none."""
    from mindspeed_pack.tools.run_summary import summarise

    records = make_records(range(1, 4))
    for r, ms in zip(records, (900.0, 1000.0, 3000.0)):
        r["step time (ms)"], r["tokens/s"] = ms, r["tokens"] / (ms / 1000.0)
    summary = summarise(str(write_jsonl(tmp_path / "m.jsonl", records)))
    assert summary["tokens/s"] == pytest.approx(2 * 4096 / 4.0)  # steps 2-3: 8192 tokens in 4 s (mean of rates: 2731)
    assert summary["tokens (not padding)"] == 3 * 4096 and "trained tokens" not in summary
    assert "tokens (not padding)" not in summarise(str(write_log(tmp_path / "log.txt", make_records(range(1, 4)))))


def test_run_summary_weighs_each_step_by_the_tokens_it_ran(tmp_path):
    """Online packing runs 1 or 2 rows a step: the plain mean of the steps' padding ratios (0.25) and samples per
    pack (6) was not the run's (1024 of 3072 tokens padding: 1/3; 16 samples in 3 rows)."""
    from mindspeed_pack.tools.run_summary import summarise

    records = make_records(range(1, 3))
    records[0].update({"tokens": 1024, "padding ratio": 0.0, "samples per pack": 8.0})  # one row of 1024
    records[1].update({"tokens": 1024, "padding ratio": 0.5, "samples per pack": 4.0})  # two rows, half padding
    summary = summarise(str(write_jsonl(tmp_path / "m.jsonl", records)))
    assert summary["padding ratio"] == pytest.approx(1 / 3) and summary["samples per pack"] == pytest.approx(16 / 3)


def test_a_metrics_file_against_a_log_of_interval_means_is_warned(tmp_path, capsys):
    """Steps against means over --log-interval steps can pass or fail on that alone: the tool says so."""
    every_step = write_jsonl(tmp_path / "m.jsonl", make_records(range(1, 13)))
    log = write_log(tmp_path / "log.txt", make_records(range(4, 13, 4)))
    code, _, err = run_cli(capsys, every_step, log)
    assert "warning: " in err and "logs every step and" in err and "every 4 steps: a console log's values are " \
        "means over --log-interval steps" in err
    _, _, err = run_cli(capsys, every_step, every_step)
    assert "warning" not in err


def test_a_log_whose_last_window_is_cut_short_is_still_warned(tmp_path, capsys):
    """--train-iters 5 at --log-interval 2 logs iterations 2, 4 and 5 (the last a mean of 1 step): the gaps 2 and 1
    tied and the log was taken for one logged every step, so a metrics file against it passed without the warning."""
    every_step = write_jsonl(tmp_path / "m.jsonl", make_records(range(1, 23)))
    for steps in ([2, 4, 5], [2, 3], [22]):  # --train-iters 5 and 3 at --log-interval 2; 22 at the default 100
        log = write_log(tmp_path / "log.txt", make_records(steps))
        cut = steps[-1] - (steps[-2] if len(steps) > 1 else 0)  # the last window's steps, as the trainer prints them
        log.write_text(log.read_text()[:-1] + f" iterations in mean: {cut} |\n")
        _, _, err = run_cli(capsys, every_step, log)
        assert "warning: " in err and "logs every step and" in err and "a console log's values are means" in err, \
            (steps, err)


def test_a_log_of_one_full_window_and_a_cut_one_is_named_by_its_interval(tmp_path, capsys):
    """--train-iters 6 at --log-interval 4 logs 4 and 6 (the last a mean of 2 steps): the warning called it a log
    of "every 2 steps"."""
    every_step = write_jsonl(tmp_path / "m.jsonl", make_records(range(1, 7)))
    log = write_log(tmp_path / "log.txt", make_records([4, 6]))
    log.write_text(log.read_text()[:-1] + " iterations in mean: 2 |\n")
    _, _, err = run_cli(capsys, every_step, log)
    assert "logs every step and" in err and "log.txt every 4 steps: a console log's values" in err, err


def test_a_console_window_cut_short_says_how_many_steps_its_means_hold(capsys):
    """A resume off a --log-interval boundary prints a window of fewer steps (iteration 10 after a resume at 8,
    interval 5): the line says so, where it silently looked like a full window's means."""
    from types import SimpleNamespace

    from mindspeed_pack.training.metrics import MetricsLogger

    logger = MetricsLogger(SimpleNamespace(train_iters=15, log_interval=5, metrics_file=None, tensorboard_dir=None),
                           enabled=True, start_iteration=8)
    for step in range(9, 16):
        logger.step({"iteration": step, "split": "train", "lm loss": 2.0, "lr": 1e-4, "grad norm": 1.0,
                     "tokens": 100, "step time (ms)": 10.0, "consumed samples": step, "global batch size": 1,
                     "skipped": 0})
    lines = [line for line in capsys.readouterr().out.splitlines() if " iteration " in line]
    assert len(lines) == 2 and "iterations in mean: 2 |" in lines[0] and "iterations in mean" not in lines[1]


def test_a_window_cut_short_by_an_early_exit_is_printed_when_the_logger_closes(capsys):
    """--exit-interval 3 at --log-interval 2 stopped after iteration 3 with no console line for it: the resumed log
    went from iteration 2 to 4, and a comparison of console logs never saw step 3."""
    from types import SimpleNamespace

    from mindspeed_pack.training.metrics import MetricsLogger

    logger = MetricsLogger(SimpleNamespace(train_iters=6, log_interval=2, metrics_file=None, tensorboard_dir=None),
                           enabled=True)
    for step in range(1, 4):
        logger.step({"iteration": step, "split": "train", "lm loss": float(step), "lr": 1e-4, "grad norm": 1.0,
                     "tokens": 100, "step time (ms)": 10.0, "consumed samples": step, "global batch size": 1,
                     "skipped": 0})
    logger.close()
    logger.close()  # closed twice (a failure's cleanup, then the normal one): printed once
    lines = [line for line in capsys.readouterr().out.splitlines() if " iteration " in line]
    assert len(lines) == 2 and " iteration        3/       6 |" in lines[1], lines
    assert "lm loss: 3.000000E+00 |" in lines[1] and "iterations in mean: 1 |" in lines[1]


def test_a_preference_stages_validation_line_has_no_perplexity(capsys):
    """exp of a DPO loss is no perplexity: only SFT and pretraining (a language model's NLL) print one."""
    from types import SimpleNamespace

    from mindspeed_pack.training.metrics import MetricsLogger

    for stage, shown in (("sft", True), ("dpo", False)):
        logger = MetricsLogger(SimpleNamespace(train_iters=4, log_interval=1, metrics_file=None, tensorboard_dir=None,
                                               stage=stage), enabled=True)
        logger.validation(4, 0.69, tokens=10)
        assert ("lm loss PPL" in capsys.readouterr().out) == shown, stage


def test_logs_whose_windows_were_cut_short_by_a_resume_are_warned(tmp_path, capsys):
    """Two logs of --log-interval 4, one resumed mid-window (its line at 8 holds the mean of 2 steps): the tool
    compared the means as alike and passed in silence."""
    whole = write_log(tmp_path / "a.log", make_records(range(4, 13, 4)))
    text = write_log(tmp_path / "b.log", make_records(range(4, 13, 4))).read_text()
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if " iteration        8/" in line:
            lines[i] = line.rstrip("\n") + " iterations in mean: 2 |\n"
    (tmp_path / "b.log").write_text("".join(lines))
    _, _, err = run_cli(capsys, whole, tmp_path / "b.log")
    assert "warning: at iteration 8 the two logs' values are means over different numbers of steps" in err
    _, _, err = run_cli(capsys, whole, whole)
    assert "warning" not in err


@pytest.mark.parametrize("module,command", [("compare_runs", True), ("inspect_pack", True), ("run_summary", True),
                                            ("run_metrics", False), ("host_syncs", False)])
def test_every_tools_module_answers_help(module, command, monkeypatch, capsys):
    """`python -m mindspeed_pack.tools.X --help`: a command prints its usage; a library (run_metrics, host_syncs)
    printed nothing and exited 0, as if it had done something; it now says it is no command and names those that are."""
    import runpy
    import sys
    import warnings

    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with warnings.catch_warnings():  # runpy warns that the module is already imported
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(SystemExit) as exit_:
            runpy.run_module(f"mindspeed_pack.tools.{module}", run_name="__main__")
    if command:
        assert exit_.value.code in (0, None) and "usage:" in capsys.readouterr().out
    else:
        assert "is a library, not a command" in str(exit_.value.code) and "compare_runs" in str(exit_.value.code)

"""Compare two training runs step by step: does run B reproduce run A's losses?

Typical use: the same packed job on a new cluster, a new version, another parallel layout
or another attention backend ("packed vs packed", see ``docs/precision_comparison.md``)::

    python -m mindspeed_pack.tools.compare_runs baseline/metrics.jsonl new/train.log \\
        --tolerance 0.02 --metrics "lm loss,grad norm" --plot diff.png

Each run is a metrics JSON-lines file, a Megatron-style log or a directory holding one
(see :mod:`mindspeed_pack.tools.run_metrics`). For every requested metric the runs are
aligned by iteration; a common step is **over tolerance** when::

    |a - b| > atol + tolerance * max(|a|, |b|)

i.e. the relative error ``|a - b| / max(|a|, |b|)`` exceeds ``tolerance`` when ``atol`` is
0 (give ``--atol`` for metrics that pass through zero, such as a warm-up learning rate).
Non-finite values: NaN (or an infinity) in only one run is over tolerance; the same NaN
or infinity in both runs counts as agreement -- run B reproduces run A -- and the summary
lists those steps, since a NaN loss is worth a look whatever the comparison says.
Steps present in only one run are listed but do not fail the comparison.

Exit status: 0 every metric within tolerance, 1 some metric over tolerance (the last line
names each failing metric, its first diverging iteration and its relative error there), 2 bad usage or input (the
message names the file and, for malformed JSON, the line).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple

from mindspeed_pack.runtime import stale_files
from mindspeed_pack.tools.run_metrics import (
    RunMetrics,
    RunMetricsError,
    find_metric,
    load_run,
    relogged_iterations,
    resolve_run_file,
)

__all__ = [
    "CompareError",
    "ComparisonReport",
    "MetricComparison",
    "StepDiff",
    "compare",
    "format_report",
    "load_run",
    "main",
    "plot_report",
]

DEFAULT_METRICS = ("lm loss",)
DEFAULT_TOLERANCE = 0.02
DEFAULT_MAX_ROWS = 40
# guards the relative error of two zeros; near-zero metrics need --atol, not a bigger floor
TINY = sys.float_info.min
# where a relative error of exactly 0 is drawn on the log-scale plot
PLOT_FLOOR = 1e-16


class CompareError(ValueError):
    """The runs cannot be compared (metric missing, no common step); names the runs."""


@dataclass
class StepDiff:
    """One common iteration of one metric."""

    iteration: int
    a: float
    b: float
    abs_err: float
    rel_err: float  # inf when only one side is NaN/inf
    over: bool


@dataclass
class MetricComparison:
    """One metric aligned over the two runs, with its summary."""

    metric: str
    steps: List[StepDiff]
    missing_in_a: List[int]  # iterations only run B logged
    missing_in_b: List[int]  # iterations only run A logged
    tolerance: float
    atol: float
    max_rel_err: float = field(init=False)
    max_rel_step: int = field(init=False)
    mean_rel_err: float = field(init=False)  # over steps where both values are finite
    over_steps: List[int] = field(init=False)
    both_nonfinite_steps: List[int] = field(init=False)

    def __post_init__(self) -> None:
        worst = max(self.steps, key=lambda s: s.rel_err)  # first of equal maxima
        self.max_rel_err, self.max_rel_step = worst.rel_err, worst.iteration
        finite = [s.rel_err for s in self.steps if math.isfinite(s.a) and math.isfinite(s.b)]
        self.mean_rel_err = sum(finite) / len(finite) if finite else math.nan
        self.over_steps = [s.iteration for s in self.steps if s.over]
        self.both_nonfinite_steps = [
            s.iteration for s in self.steps if not math.isfinite(s.a) and not math.isfinite(s.b)
        ]

    @property
    def passed(self) -> bool:
        return not self.over_steps

    @property
    def first_over_step(self) -> Optional[int]:
        return self.over_steps[0] if self.over_steps else None

    @property
    def first_over(self) -> Optional[StepDiff]:
        """The first step over tolerance (its values and errors), or None."""
        return next((s for s in self.steps if s.over), None)


@dataclass
class ComparisonReport:
    """Result of :func:`compare`; ``passed`` decides the exit status of the CLI."""

    name_a: str
    name_b: str
    tolerance: float
    atol: float
    metrics: List[MetricComparison]

    @property
    def passed(self) -> bool:
        return all(m.passed for m in self.metrics)

    @property
    def failures(self) -> List[MetricComparison]:
        return [m for m in self.metrics if not m.passed]

    def to_dict(self) -> dict:
        """JSON-ready: non-finite floats become the strings "NaN", "Infinity", "-Infinity"."""
        data = asdict(self)
        data["passed"] = self.passed
        for entry, metric in zip(data["metrics"], self.metrics):
            entry["passed"] = metric.passed
            entry["first_over_step"] = metric.first_over_step
        return _json_safe(data)


# --------------------------------------------------------------------------- comparing


def step_diff(iteration: int, a: float, b: float, tolerance: float, atol: float) -> StepDiff:
    """Errors of one step; see the module docstring for the rule and the NaN policy."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return StepDiff(iteration, a, b, 0.0, 0.0, False)
    if not (math.isfinite(a) and math.isfinite(b)):
        return StepDiff(iteration, a, b, abs(a - b), math.inf, True)
    abs_err = abs(a - b)
    scale = max(abs(a), abs(b))
    return StepDiff(iteration, a, b, abs_err, abs_err / max(scale, TINY), abs_err > atol + tolerance * scale)


def compare(
    run_a: RunMetrics,
    run_b: RunMetrics,
    metrics: Sequence[str] = DEFAULT_METRICS,
    tolerance: float = DEFAULT_TOLERANCE,
    atol: float = 0.0,
    names: Tuple[str, str] = ("A", "B"),
) -> ComparisonReport:
    """Align ``run_a`` and ``run_b`` (from :func:`load_run`) by iteration for each metric.

    ``names`` label the runs in messages (the CLI passes the paths). Raises
    :class:`CompareError` when a metric is absent from a run or the runs share no step.
    """
    if not metrics:
        raise CompareError("no metric to compare")
    if not (tolerance >= 0 and atol >= 0):
        raise CompareError(f"tolerance and atol must be >= 0, got {tolerance} and {atol}")
    compared = []
    for requested in metrics:
        key_a = _require_metric(run_a, requested, names[0])
        key_b = _require_metric(run_b, requested, names[1])
        values_a, values_b = run_a[key_a], run_b[key_b]
        common = sorted(values_a.keys() & values_b.keys())
        if not common:
            raise CompareError(
                f"no common iteration for '{requested}': {names[0]} has "
                f"{compact_steps(sorted(values_a))}, {names[1]} has {compact_steps(sorted(values_b))}"
            )
        compared.append(
            MetricComparison(
                metric=key_a,
                steps=[step_diff(i, values_a[i], values_b[i], tolerance, atol) for i in common],
                missing_in_a=sorted(values_b.keys() - values_a.keys()),
                missing_in_b=sorted(values_a.keys() - values_b.keys()),
                tolerance=tolerance,
                atol=atol,
            )
        )
    return ComparisonReport(names[0], names[1], tolerance, atol, compared)


def _require_metric(run: RunMetrics, requested: str, name: str) -> str:
    key = find_metric(run, requested)
    if key is None:
        available = ", ".join(sorted(run)) or "none"
        raise CompareError(f"{name}: metric '{requested}' not found (metrics in this run: {available})")
    return key


# --------------------------------------------------------------------------- reporting


def compact_steps(iterations: Sequence[int], max_groups: int = 8) -> str:
    """``[1,2,3,4,10,20,30,7]`` -> ``"1-4, 7, 10-30 every 10"``: runs of a constant stride."""
    steps = sorted(set(iterations))
    groups: List[str] = []
    i = 0
    while i < len(steps):
        j, stride = i, 0
        if i + 1 < len(steps):
            j, stride = i + 1, steps[i + 1] - steps[i]
            while j + 1 < len(steps) and steps[j + 1] - steps[j] == stride:
                j += 1
        if j - i + 1 >= 3 or (j == i + 1 and stride == 1):
            groups.append(f"{steps[i]}-{steps[j]}" + (f" every {stride}" if stride != 1 else ""))
            i = j + 1
        else:
            groups.append(str(steps[i]))
            i += 1
    if len(groups) > max_groups:
        groups = groups[:max_groups] + ["..."]
    return ", ".join(groups) if groups else "none"


def _steps(count: int) -> str:
    return f"{count} step" + ("" if count == 1 else "s")


def _fmt(value: float) -> str:
    return f"{value:.8g}"


def _fmt_err(value: float) -> str:
    return f"{value:.3e}" if math.isfinite(value) else str(value)


def _rows_to_show(steps: Sequence[StepDiff], max_rows: int) -> Tuple[List[int], int]:
    """Indices of the table rows: head, tail and over-tolerance rows; and how many over rows are cut."""
    if max_rows <= 0 or len(steps) <= max_rows:
        return list(range(len(steps))), 0
    head = (max_rows + 1) // 2
    tail = max_rows - head
    over = [i for i, s in enumerate(steps) if s.over]
    shown_over = over[:max_rows]
    rows = set(range(head)) | set(range(len(steps) - tail, len(steps))) | set(shown_over)
    hidden_over = len([i for i in over if i not in rows])
    return sorted(rows), hidden_over


def format_metric_table(comparison: MetricComparison, max_rows: int = DEFAULT_MAX_ROWS) -> List[str]:
    header = f"{'iteration':>10}  {'A':>16}  {'B':>16}  {'abs err':>10}  {'rel err':>10}"
    lines = [f"== {comparison.metric} ==", header]
    rows, hidden_over = _rows_to_show(comparison.steps, max_rows)
    previous = -1
    for index in rows:
        if index != previous + 1:
            lines.append(f"{'...':>10}  ({index - previous - 1} rows not shown)")
        s = comparison.steps[index]
        marker = "  > tol" if s.over else ""
        lines.append(
            f"{s.iteration:>10}  {_fmt(s.a):>16}  {_fmt(s.b):>16}  "
            f"{_fmt_err(s.abs_err):>10}  {_fmt_err(s.rel_err):>10}{marker}"
        )
        previous = index
    if previous != len(comparison.steps) - 1:
        lines.append(f"{'...':>10}  ({len(comparison.steps) - previous - 1} rows not shown)")
    if hidden_over:
        lines.append(f"({hidden_over} more rows over tolerance not shown; --max-rows 0 shows every row)")
    return lines


def format_metric_summary(c: MetricComparison) -> List[str]:
    verdict = "ok" if c.passed else "OVER TOLERANCE"
    lines = [
        f"{c.metric}: {verdict}; {_steps(len(c.steps))} in common, max rel err {_fmt_err(c.max_rel_err)} "
        f"at iteration {c.max_rel_step}, mean rel err {_fmt_err(c.mean_rel_err)}"
    ]
    if c.over_steps:
        lines.append(
            f"  {_steps(len(c.over_steps))} over tolerance, first at iteration {c.first_over_step} "
            f"({_first_over_words(c)}): {compact_steps(c.over_steps)}"
        )
    if c.missing_in_a:
        lines.append(f"  missing in A, only in B ({_steps(len(c.missing_in_a))}): {compact_steps(c.missing_in_a)}")
    if c.missing_in_b:
        lines.append(f"  missing in B, only in A ({_steps(len(c.missing_in_b))}): {compact_steps(c.missing_in_b)}")
    if c.both_nonfinite_steps:
        lines.append(
            f"  NaN/inf in both runs (counted as agreement) at: {compact_steps(c.both_nonfinite_steps)}"
        )
    return lines


def _first_over_words(c: MetricComparison) -> str:
    """'rel err 2.912e-02 > 0.02: A 5.9019064, B 6.0789636' for the first diverging step (the number MindSpeed-LLM's
    precision checks compare with their relative threshold), 'NaN in B only: A 5.9019064, B nan' for a non-finite one."""
    s = c.first_over
    values = f"A {_fmt(s.a)}, B {_fmt(s.b)}"
    if not math.isfinite(s.rel_err):
        side = "A" if not math.isfinite(s.a) and math.isfinite(s.b) else "B" if math.isfinite(s.a) else "both"
        return f"{'NaN/inf' if side == 'both' else f'NaN/inf in {side} only'}: {values}"
    limit = f"{c.tolerance:g}" + (f" + atol {c.atol:g}" if c.atol else "")
    return f"rel err {_fmt_err(s.rel_err)} > {limit}: {values}"


def _not_compared(report: ComparisonReport) -> str:
    """' (not compared: iterations 5-6 only in A)': steps one run lacks (a run cut short, another --train-iters), said
    on the verdict line, where a CI job or a reader of the last line sees it; they do not fail the comparison."""
    parts = []
    for side, attr in (("A", "missing_in_b"), ("B", "missing_in_a")):
        steps = sorted({i for m in report.metrics for i in getattr(m, attr)})
        if steps:
            parts.append(f"iteration{'s' if len(steps) > 1 else ''} {compact_steps(steps)} only in {side}")
    return f" (not compared: {'; '.join(parts)})" if parts else ""


def format_report(report: ComparisonReport, max_rows: int = DEFAULT_MAX_ROWS) -> str:
    """The whole text report; its last line is the verdict (PASS / FAIL ...)."""
    tol = f"tolerance {report.tolerance:g} relative" + (f", atol {report.atol:g}" if report.atol else "")
    lines = [f"A: {report.name_a}", f"B: {report.name_b}", tol, ""]
    for comparison in report.metrics:
        lines += format_metric_table(comparison, max_rows) + [""]
    lines.append("summary")
    for comparison in report.metrics:
        lines += format_metric_summary(comparison)
    if report.passed:
        names = ", ".join(m.metric for m in report.metrics)
        lines.append(f"PASS: {names} within {tol}{_not_compared(report)}")
    else:
        failing = "; ".join(
            f"'{m.metric}' first over tolerance at iteration {m.first_over_step} ({_first_over_words(m)})"
            for m in report.failures
        )
        lines.append(f"FAIL: {failing} ({tol}){_not_compared(report)}")
    return "\n".join(lines)


def plot_labels(name_a: str, name_b: str) -> Tuple[str, str]:
    """The two runs' legend labels: the shortest path tails that tell them apart (``runs/tp1/metrics.jsonl`` and
    ``runs/tp2/metrics.jsonl``, the layout the docs use, are ``tp1/metrics.jsonl`` and ``tp2/metrics.jsonl``,
    where the file names alone were the same label twice)."""
    a, b = Path(name_a).parts, Path(name_b).parts
    for n in range(1, max(len(a), len(b)) + 1):
        tail_a, tail_b = str(Path(*a[-n:])), str(Path(*b[-n:]))
        if tail_a != tail_b:
            return tail_a, tail_b
    return name_a, name_b


def plot_report(report: ComparisonReport, path: os.PathLike) -> None:
    """PNG: per metric, both curves (top) and the relative error on a log scale (bottom)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    columns = len(report.metrics)
    figure = Figure(figsize=(6.5 * columns, 6.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(2, columns, sharex="col", squeeze=False, height_ratios=[3, 2])
    label_a, label_b = plot_labels(report.name_a, report.name_b)
    for column, c in enumerate(report.metrics):
        top, bottom = axes[0][column], axes[1][column]
        steps = [s.iteration for s in c.steps]
        top.plot(steps, [s.a for s in c.steps], label=f"A: {label_a}", linewidth=1.5)
        top.plot(steps, [s.b for s in c.steps], label=f"B: {label_b}", linewidth=1, linestyle="--")
        top.set_title(c.metric)
        top.set_ylabel(c.metric)
        top.legend(loc="best", fontsize="small")
        finite = [max(s.rel_err, PLOT_FLOOR) for s in c.steps if math.isfinite(s.rel_err)]
        ceiling = max(finite + [report.tolerance, 1.0]) * 10
        bottom.semilogy(steps, [max(s.rel_err, PLOT_FLOOR) if math.isfinite(s.rel_err) else ceiling
                                for s in c.steps], linewidth=1, marker=".", markersize=3)
        nonfinite = [s.iteration for s in c.steps if not math.isfinite(s.rel_err)]
        if nonfinite:
            bottom.plot(nonfinite, [ceiling] * len(nonfinite), "rx", label="NaN/inf in one run")
        if report.tolerance > 0:
            bottom.axhline(report.tolerance, color="red", linestyle=":", label=f"tolerance {report.tolerance:g}")
        if c.first_over_step is not None:
            for ax in (top, bottom):
                ax.axvline(c.first_over_step, color="red", alpha=0.4, linewidth=1)
        bottom.set_xlabel("iteration")
        bottom.set_ylabel(f"relative error (0 drawn at {PLOT_FLOOR:g})")
        bottom.legend(loc="best", fontsize="small")
    _write_atomically(Path(path), lambda tmp: figure.savefig(tmp, format="png", dpi=100))


# --------------------------------------------------------------------------- CLI


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def _write_atomically(path: Path, write) -> None:
    """Call ``write(tmp)`` then rename: a reader never sees a half-written plot or JSON."""
    tmp = Path(stale_files.temporary_for(str(path), str(path)))
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _finite_non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def _metric_list(text: str) -> List[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected comma-separated metric names, e.g. 'lm loss,grad norm'")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mindspeed-compare-runs",
        description="Compare two training runs step by step (metrics JSON lines, Megatron-style logs, "
        "or run directories). Exit 0: within tolerance, 1: over tolerance, 2: bad input.",
    )
    parser.add_argument("run_a", help="reference run: metrics .jsonl, training log, or run directory")
    parser.add_argument("run_b", help="run to check against the reference")
    parser.add_argument("--tolerance", type=_finite_non_negative, default=DEFAULT_TOLERANCE,
                        help="relative tolerance |a-b|/max(|a|,|b|) (default %(default)s)")
    parser.add_argument("--atol", type=_finite_non_negative, default=0.0,
                        help="absolute slack added to the tolerance, for metrics near 0 (default 0)")
    parser.add_argument("--metrics", type=_metric_list, default=list(DEFAULT_METRICS),
                        help="comma-separated metric names (default 'lm loss'); 'learning rate' = 'lr'")
    parser.add_argument("--split", default="train",
                        help="'train', 'valid' (the interval evaluations) or 'valid-end' (the one at the end of "
                             "training; 'test-end' the test split's) records (default train)")
    parser.add_argument("--max-rows", type=_non_negative_int, default=DEFAULT_MAX_ROWS,
                        help="table rows per metric: first/last rows plus rows over tolerance; 0 = all "
                        "(default %(default)s)")
    parser.add_argument("--plot", type=Path, help="write a PNG: curves and relative error per metric")
    parser.add_argument("--json", type=Path, help="write the full comparison as JSON")
    return parser


def _logging_stride(run: RunMetrics) -> Optional[int]:
    """The most common gap between logged iterations (1: every step, a metrics file; K: a console log's
    ``--log-interval``, whose values are means over K steps), the gaps that end in a window cut short (its
    ``iterations in mean``: the last window, a resume) left out; without a full gap, the first full window (from
    iteration 1), else the cut windows' sizes (fewer steps than the interval: --train-iters 6 at --log-interval 4
    logs 4 and 6, the last a mean of 2, and was taken for a log of every 2 steps)."""
    steps = sorted(next(iter(run.values()), {}))
    cut = run.get("iterations in mean") or {}  # windows cut short (the last one, a resume): no full interval
    gaps = [b - a for a, b in zip(steps, steps[1:]) if b not in cut]
    if gaps:
        return max(set(gaps), key=lambda gap: (gaps.count(gap), gap))  # a tie: the longer interval
    full = [step for step in steps if step not in cut]
    if full:
        return full[0]  # the first window, from iteration 1
    means = [int(n) for n in cut.values() if n > 1]
    return max(means) if means else None


def _unlike_logging(run_a: RunMetrics, run_b: RunMetrics, names: Sequence[str]) -> Optional[str]:
    """A run logged every step against one logged every K: the values compared are single steps against means
    over K steps (they can pass or fail on that alone)."""
    a, b = _logging_stride(run_a), _logging_stride(run_b)
    if a is not None and a == b and a > 1:  # logs of one interval: a window cut short (a resume) holds fewer steps
        cut_a, cut_b = (run.get("iterations in mean") or {} for run in (run_a, run_b))
        common = set(next(iter(run_a.values()), {})) & set(next(iter(run_b.values()), {}))
        differ = sorted(i for i in common if cut_a.get(i, a) != cut_b.get(i, b))
        if differ:
            return (f"at iteration{'s' if len(differ) > 1 else ''} {compact_steps(differ)} the two logs' values are "
                    "means over different numbers of steps ('iterations in mean': a window cut short by a resume), "
                    "so they can differ on that alone; compare the metrics files (every step)")
    if a is None or b is None or a == b:
        return None
    every = {n: "every step" if n == 1 else f"every {n} steps" for n in (a, b)}
    return (f"{names[0]} logs {every[a]} and {names[1]} {every[b]}: a console log's values are means "
            "over --log-interval steps, so steps and means are compared; compare two metrics files (every step), "
            "or two logs with the same --log-interval")


def main(argv: Optional[Iterable[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(None if argv is None else list(argv))
    except SystemExit as exit_:  # argparse: 2 for usage errors, 0 for --help
        return int(exit_.code or 0)
    try:
        names = (str(resolve_run_file(args.run_a)), str(resolve_run_file(args.run_b)))
        run_a = load_run(args.run_a, split=args.split)
        run_b = load_run(args.run_b, split=args.split)
        report = compare(run_a, run_b, args.metrics, args.tolerance, args.atol, names=names)
    except (RunMetricsError, CompareError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    warning = _unlike_logging(run_a, run_b, names)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    for side, path, name in (("A", args.run_a, names[0]), ("B", args.run_b, names[1])):
        again = relogged_iterations(path, split=args.split)
        if again:  # a resumed run: say which record was taken, not just take it
            print(f"note: {side} ({name}) logs iteration{'s' if len(again) > 1 else ''} {compact_steps(again)} more "
                  "than once (a resumed or restarted run re-logs the steps after its checkpoint): the last record of "
                  "each is compared", file=sys.stderr)
    outputs = [
        (args.json, lambda: _write_atomically(
            args.json, lambda tmp: tmp.write_text(json.dumps(report.to_dict(), indent=1) + "\n"))),
        (args.plot, lambda: plot_report(report, args.plot)),
    ]
    for target, write in outputs:
        if target is None:
            continue
        try:
            write()
        except OSError as err:
            print(f"error: {target}: cannot write ({err.strerror or err})", file=sys.stderr)
            return 2
    print(format_report(report, max_rows=args.max_rows))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())

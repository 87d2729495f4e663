"""Read the per-step metrics of one training run, whatever form the run left them in.

A run is one of:

* a metrics JSON-lines file (the trainer's ``--metrics-file``): one object per logged
  step, ``{"iteration": 5, "split": "train", "lm loss": 5.12, "lr": 1e-4, ...}``;
  ``split`` defaults to ``"train"``; numeric fields are metrics, other fields (strings,
  lists, ...) are ignored and ``null`` means "not measured at this step";
* a console log in Megatron-LM / MindSpeed-LLM style, whose training lines read::

      [ts] iteration   10/  300 | consumed samples: 80 | learning rate: 9.999999E-05 | lm loss: 5.123456E+00 |

  and whose validation lines read::

      validation loss at iteration 100 | lm loss value: 4.123456E+00 | lm loss PPL: 6.18E+01 |

  every ``key: number`` pair between ``|`` separators becomes a metric, so any metric a
  trainer prints can be compared (``learning rate`` is called ``lr`` and a validation
  ``X value`` is called ``X``, the names the metrics file uses);
* a directory holding exactly one such file (a ``*.jsonl`` is preferred to a ``*.log``).

The kind of a file is decided by its content (a first non-blank line that starts with
``{`` means JSON lines), so a metrics file named ``train.log`` still reads correctly.

The evaluation at the end of training repeats the last iteration's number: its records (labelled
"the end of training ...") are the split ``valid-end`` (``test-end``), so the interval evaluation of that
iteration stays in ``valid``.

A resumed run logs some steps twice. The **last** record of a (split, iteration) wins and
replaces the earlier record as a whole: the re-logged step is the one the run continued
from, and mixing fields of two different executions of a step would describe neither.

Reading is kept apart from comparing (:mod:`mindspeed_pack.tools.compare_runs`) so other
tools (plots, regression baselines) can load runs the same way.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple, Union

PathLike = Union[str, Path]
END_SUFFIX = "-end"  # the split of the end-of-training evaluations (valid-end, test-end)
# metric name -> iteration -> value
RunMetrics = Dict[str, Dict[int, float]]
# split -> iteration -> metrics of the record that won (the last one)
_Records = Dict[str, Dict[int, Dict[str, float]]]

JSONL_SUFFIXES = (".jsonl",)
LOG_SUFFIXES = (".log",)

# Names a Megatron-style log prints -> the names our metrics file uses.
METRIC_ALIASES = {
    "learning rate": "lr",
}

# the head of a training line ends with "iteration N/ TOTAL" (the "/ TOTAL" is optional)
_TRAIN_ITERATION = re.compile(r"\biteration\s+(\d+)\s*(?:/\s*\d+)?\s*$")
_VALID_ITERATION = re.compile(r"\bvalidation loss at iteration\s+(\d+)\b")
# the end-of-training evaluations name no iteration: they evaluate the last one trained
_END_OF_TRAINING = re.compile(r"\bvalidation loss at the end of training for (val|test) data\b")


class RunMetricsError(ValueError):
    """A run could not be read; the message names the file (and line) at fault."""


def normalise_metric_name(name: str) -> str:
    """Collapse whitespace and apply :data:`METRIC_ALIASES`, so log and JSON names meet."""
    collapsed = " ".join(name.split())
    return METRIC_ALIASES.get(collapsed.lower(), collapsed)


def resolve_run_file(path: PathLike) -> Path:
    """The metrics file of a run: ``path`` itself, or the one metrics file in a directory."""
    path = Path(path)
    if not path.exists():
        raise RunMetricsError(f"{path}: no such file or directory")
    if not path.is_dir():
        return path
    for suffixes in (JSONL_SUFFIXES, LOG_SUFFIXES):
        found = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(suffixes))
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            names = ", ".join(p.name for p in found)
            raise RunMetricsError(
                f"{path}: directory holds several run files ({names}); pass one of them explicitly"
            )
    raise RunMetricsError(
        f"{path}: directory holds no metrics file (*.jsonl written by --metrics-file) "
        f"and no training log (*.log)"
    )


def detect_format(path: Path) -> str:
    """``"jsonl"`` when the first non-blank line starts with ``{``, else ``"log"``.

    Megatron-style logs never start with a JSON object; a metrics file whose first line is
    broken is still read as JSON lines, so the error names that line.
    """
    for _, line in _read_lines(path):
        text = line.strip()
        if text:
            return "jsonl" if text.startswith("{") else "log"
    raise RunMetricsError(f"{path}: file is empty")


def load_all_splits(path: PathLike) -> Dict[str, RunMetrics]:
    """Every split of a run: ``{split: {metric: {iteration: value}}}``, iterations sorted."""
    file = resolve_run_file(path)
    kind = detect_format(file)
    records = _parse_jsonl(file) if kind == "jsonl" else _parse_log(file)
    if not records:
        what = (
            "no JSON object with an integer 'iteration'"
            if kind == "jsonl"
            else "no Megatron-style 'iteration N/ M | key: value |' or "
            "'validation loss at iteration N | ...' line"
        )
        raise RunMetricsError(f"{file}: no recognised metric records ({what})")
    return {split: _by_metric(steps) for split, steps in records.items()}


def load_run(path: PathLike, split: str = "train") -> RunMetrics:
    """Metrics of one split of a run: ``{metric: {iteration: value}}``, iterations sorted.

    ``path`` is a metrics JSON-lines file, a Megatron-style log, or a directory holding
    exactly one of them. Raises :class:`RunMetricsError` naming the file (and line).
    """
    splits = load_all_splits(path)
    if split not in splits:
        found = ", ".join(sorted(splits))
        raise RunMetricsError(
            f"{resolve_run_file(path)}: no records of split '{split}' (found: {found})"
        )
    return splits[split]


def find_metric(run: RunMetrics, name: str) -> Optional[str]:
    """The key of ``run`` that ``name`` designates (exact, aliased, or case-insensitive)."""
    if name in run:
        return name
    wanted = normalise_metric_name(name)
    if wanted in run:
        return wanted
    matches = [key for key in run if key.lower() == wanted.lower()]
    return matches[0] if len(matches) == 1 else None


# --------------------------------------------------------------------------- parsing


def _read_lines(path: Path) -> Iterator[Tuple[int, str]]:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            for number, line in enumerate(handle, start=1):
                yield number, line
    except OSError as err:
        raise RunMetricsError(f"{path}: cannot read ({err.strerror or err})") from err


def _store(records: _Records, split: str, iteration: int, metrics: Dict[str, float],
           relogged: Optional[Dict[str, set]] = None) -> None:
    # last record of a (split, iteration) wins as a whole: see the module docstring
    steps = records.setdefault(split, {})
    if iteration in steps and relogged is not None:
        relogged.setdefault(split, set()).add(iteration)
    steps[iteration] = metrics


def relogged_iterations(path: PathLike, split: str = "train") -> list:
    """The iterations of ``split`` that the run's file logs more than once (a resumed or restarted run re-logs the
    steps after its checkpoint; the last record of each is the one :func:`load_run` keeps)."""
    file = resolve_run_file(path)
    relogged: Dict[str, set] = {}
    (_parse_jsonl if detect_format(file) == "jsonl" else _parse_log)(file, relogged)
    return sorted(relogged.get(split, ()))


def _parse_jsonl(path: Path, relogged: Optional[Dict[str, set]] = None) -> _Records:
    records: _Records = {}
    for number, line in _read_lines(path):
        text = line.strip()
        if not text:
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as err:
            raise RunMetricsError(f"{where}: malformed JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(obj, dict):
            raise RunMetricsError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        iteration = obj.get("iteration")
        if isinstance(iteration, float) and iteration.is_integer():
            iteration = int(iteration)
        if not isinstance(iteration, int) or isinstance(iteration, bool):
            raise RunMetricsError(f"{where}: field 'iteration' must be an integer, got {iteration!r}")
        split = obj.get("split", "train")
        if not isinstance(split, str):
            raise RunMetricsError(f"{where}: field 'split' must be a string, got {split!r}")
        if isinstance(obj.get("label"), str) and obj["label"].startswith("the end of training"):
            split += END_SUFFIX  # the end's evaluation of the last iteration: beside its interval one, not over it
        metrics: Dict[str, float] = {}
        for key, value in obj.items():
            if key in ("iteration", "split") or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)):
                metrics[normalise_metric_name(key)] = float(value)
        _store(records, split, iteration, metrics, relogged)
    return records


def _parse_number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def _parse_pairs(fields) -> Dict[str, float]:
    """``key: number`` fields -> metrics; fields without a numeric value are skipped."""
    metrics: Dict[str, float] = {}
    for field in fields:
        key, sep, value = field.rpartition(":")
        if not sep or not key.strip():
            continue
        number = _parse_number(value.strip())
        if number is not None:
            metrics[normalise_metric_name(key)] = number
    return metrics


def _evaluation_metrics(fields) -> Dict[str, float]:
    # "lm loss value" is the validation loss itself; "lm loss PPL" stays as is
    return {key[: -len(" value")] if key.endswith(" value") else key: value
            for key, value in _parse_pairs(fields).items()}


def _parse_log(path: Path, relogged: Optional[Dict[str, set]] = None) -> _Records:
    records: _Records = {}
    last_train = 0
    for _, line in _read_lines(path):
        if "|" not in line or ("iteration" not in line and "end of training" not in line):
            continue
        head, *fields = line.split("|")
        valid = _VALID_ITERATION.search(head)
        if valid:
            _store(records, "valid", int(valid.group(1)), _evaluation_metrics(fields), relogged)
            continue
        end = _END_OF_TRAINING.search(head)
        if end:
            split = ("valid" if end.group(1) == "val" else "test") + END_SUFFIX
            _store(records, split, last_train, _evaluation_metrics(fields), relogged)
            continue
        train = _TRAIN_ITERATION.search(head)
        if train:
            last_train = int(train.group(1))
            _store(records, "train", last_train, _parse_pairs(fields), relogged)
    return records


def _by_metric(steps: Dict[int, Dict[str, float]]) -> RunMetrics:
    run: RunMetrics = {}
    for iteration in sorted(steps):
        for key, value in steps[iteration].items():
            run.setdefault(key, {})[iteration] = value
    return run


if __name__ == "__main__":  # `python -m mindspeed_pack.tools.run_metrics --help` printed nothing and exited 0
    import sys

    sys.exit("mindspeed_pack.tools.run_metrics is a library, not a command: load_run() reads a run's metrics for "
             "mindspeed_pack.tools.compare_runs and run_summary, the commands to use")

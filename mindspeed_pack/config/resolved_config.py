"""The resolved configuration of a run: every flag's final value, by where it came from.

:func:`record_sources` (at the end of ``parse_args``) notes for every flag whether the user gave
it (command line or ``--config``), a Hugging Face ``--load``'s config.json or a Megatron ``--load``'s
recorded arguments set it, a fine-tuning default filled it, validation derived it from other flags, or
it kept the parser's default.
:func:`write` puts the values, grouped by that origin, in ``SAVE/run_config.yaml`` and
``METRICS.config.yaml`` (beside ``--metrics-file``) once the run is set up (model, checkpoint and data
loaded: a run that fails to start overwrites nothing): ``--config`` of that file repeats the run, since
every key is a flag; the derived and default sections are on record only (``yaml_file.RECORD_ONLY``): read
back, they are left to the parser, so they never count as given (a preprocessing default would otherwise be
checked against the data's sidecar as the user's choice). :func:`recorded` reads a section back (a resume keeps its run's fine-tuning defaults);
:func:`run_differences` compares a recorded run with this one (is ``--save`` this run's?). ``--train-iters`` derived from ``--train-epochs``
is shown as a comment, not set, so a repeat recomputes it from the data as the original did.
"""
from __future__ import annotations

import datetime
import json
import logging
import os

from mindspeed_pack.config import yaml_file
from mindspeed_pack.convert import megatron_layout as layout

log = logging.getLogger(__name__)

FILE_NAME = layout.RUN_CONFIG  # in --save
METRICS_SUFFIX = ".config.yaml"  # beside --metrics-file: METRICS (without .jsonl) + this
SECTIONS = (  # origin -> title; written in this order
    ("given", "given (command line and --config file)", False),
    ("hf", "from the Hugging Face --load directory (config.json)", False),
    ("checkpoint", "from the Megatron --load checkpoint (the model arguments it records)", False),
    ("finetune", "fine-tuning defaults (--stage sft from a Hugging Face --load, or a resume of such a run)", False),
    ("derived", f"derived from the flags above by validation {yaml_file.RECORD_ONLY}", False),
    ("default", f"defaults {yaml_file.RECORD_ONLY}", False),
    ("epochs", "derived from --train-epochs and the data (shown, not set: a repeat computes them again)", True),
)
NOT_WRITTEN = ("config", "dry_run", "help")
# where a run writes, how often it reports and how long it waits: a run that differs only in these is the same run
# (run_differences; a resume from --save may change them). Every other flag defines the run: model, data, schedule.
NOT_DEFINING = ("save", "save_hf", "save_interval", "no_save_optim", "no_save_rng", "no_load_optim", "no_load_rng",
                "overwrite_output_dir", "lora_merge",
                "metrics_file", "tensorboard_dir", "tensorboard_log_interval", "tensorboard_queue_size",
                "log_validation_ppl_to_tensorboard", "log_timers_to_tensorboard", "log_batch_size_to_tensorboard",
                "log_learning_rate_to_tensorboard", "log_loss_scale_to_tensorboard", "log_interval", "log_throughput", "peak_tflops", "eval_interval",
                "eval_iters", "exit_interval", "exit_duration_in_mins", "exit_signal_handler",
                "distributed_timeout_minutes",
                "data_cache_path", "workers", "overwrite_cache")


def record_sources(parser, args, given: set, from_hf: set, finetune: set, from_checkpoint: set = frozenset()) -> None:
    """``args.flag_sources`` = {dest: [flag name, origin]} for every flag of ``parser``."""
    sources = {}
    for action in parser._actions:
        if action.dest in NOT_WRITTEN or not any(o.startswith("--") for o in action.option_strings):
            continue
        dest = action.dest
        if dest in given:
            origin = "given"
        elif dest in finetune:
            origin = "finetune"
        elif dest in from_hf:
            origin = "hf"
        elif dest in from_checkpoint:
            origin = "checkpoint"
        elif getattr(args, dest, None) != action.default:
            origin = "derived"
        else:
            origin = "default"
        sources[dest] = [yaml_file.flag_name(action), origin]
    args.flag_sources = sources


def mark(args, dest: str, origin: str) -> None:
    """Record that ``dest`` now comes from ``origin`` (e.g. ``epochs``)."""
    if dest in getattr(args, "flag_sources", {}):
        args.flag_sources[dest][1] = origin


def _value(args, dest):
    if dest.endswith("data_path") and getattr(args, f"raw_{dest}", None):
        return getattr(args, f"raw_{dest}")  # what the user gave; the packs are a cache of it
    return getattr(args, dest, None)


def json_flag_value(value):
    """A JSON flag's value as the JSON it says: a config file's mapping (``map-keys: {prompt: q}``, passed on as
    ``'{"prompt": "q"}'``) and the same JSON typed on a command line (``'{"prompt":"q"}'``) are one value."""
    if isinstance(value, str) and value.startswith(("{", "[")):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


# what may differ between the nodes of one job: where the logging rank writes, a node's own cache and workers
PER_NODE = ("metrics_file", "tensorboard_dir", "data_cache_path", "workers")


def flag_values(args) -> dict:
    """{flag name: value} of every flag the nodes of one job must share (all but :data:`PER_NODE`)."""
    return {name: json_flag_value(_value(args, dest)) for dest, (name, _) in getattr(args, "flag_sources", {}).items()
            if dest not in PER_NODE}


def text(args, script: str) -> str:
    """The resolved configuration as YAML (see the module docstring)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    launcher = f"torchrun --nproc-per-node ... (world size {world}) " if world > 1 else ""
    header = (f"{script}: resolved configuration of the run started "
              f"{datetime.datetime.now().isoformat(timespec='seconds')}: every flag's final value.\n"
              f"Repeat the run with: {launcher}{script} --config THIS_FILE")
    by_origin = {origin: [] for origin, _, _ in SECTIONS}
    for dest, (name, origin) in getattr(args, "flag_sources", {}).items():
        by_origin[origin].append((name, _value(args, dest), None))
    note = getattr(args, "epochs_note", None)
    by_origin["epochs"] = [(name, value, note if name == "train-iters" else None)
                           for name, value, _ in by_origin["epochs"]]
    return yaml_file.render([(title, by_origin[origin], shown) for origin, title, shown in SECTIONS], header)


def paths(args) -> list:
    out = []
    if args.save and not args.skip_train:  # an evaluation saves nothing: the training run's file stays
        out.append(os.path.join(args.save, FILE_NAME))
    if args.metrics_file:
        out.append(os.path.splitext(args.metrics_file)[0] + METRICS_SUFFIX)
    return out


def write(args, script: str) -> list:
    """Write the resolved configuration beside the checkpoints and the metrics (rank 0); returns the paths."""
    if int(os.environ.get("RANK", "0")) != 0 or not getattr(args, "flag_sources", None):
        return []
    written = paths(args)
    if written:
        content = text(args, script)
        for path in written:
            yaml_file.write(path, content)
        log.info("resolved configuration: %s (repeat the run with --config %s)", ", ".join(written), written[0])
    return written


def _sections(text: str, where: str) -> dict:
    """{origin: {dest: value}} of a resolved configuration's text (a shown-only section's lines are comments)."""
    import yaml

    origins = {f"# --- {title}": origin for origin, title, _ in SECTIONS}
    lines, origin = {}, None
    for line in text.splitlines(keepends=True):
        if line.startswith("# --- "):
            origin = origins.get(line.strip())
        elif origin and line.strip() and not line.startswith("#"):
            lines.setdefault(origin, []).append(line)
    out = {}
    for origin, block in lines.items():
        try:
            values = yaml.safe_load("".join(block)) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"{where}: unreadable ({e})") from None
        out[origin] = {key.replace("-", "_"): value for key, value in values.items()}
    return out


def _read(save_dir: str):
    """{origin: {dest: value}} of ``save_dir``'s resolved configuration; None without one (ValueError: unreadable)."""
    path = os.path.join(save_dir, FILE_NAME)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return _sections(f.read(), path)


def recorded(save_dir: str, origin: str) -> dict:
    """{dest: value} of the ``origin`` section of ``save_dir``'s resolved configuration ({} without one)."""
    try:
        sections = _read(save_dir) or {}
    except ValueError as e:
        log.warning("%s; its %s are not reused", e, dict((o, t) for o, t, _ in SECTIONS)[origin])
        return {}
    return sections.get(origin, {})


def _show(value) -> str:
    if value is None:
        return "(not set)"
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def run_differences(args, save_dir: str):
    """How this run differs from the run ``save_dir``'s resolved configuration records: ``["--flag a here, b
    there", ...]`` over the flags that define a run (all but :data:`NOT_DEFINING`), ``[]`` for the same run,
    None when there is no record. Both sides are compared as written (YAML), so a value reads back alike."""
    try:
        theirs = _read(save_dir)
    except ValueError:
        return None
    if theirs is None:
        return None
    mine = _sections(text(args, ""), "this run")
    theirs = {k: v for section in theirs.values() for k, v in section.items()}
    mine = {k: v for section in mine.values() for k, v in section.items()}
    names = {dest: name for dest, (name, _) in getattr(args, "flag_sources", {}).items()}
    # a record written by a resume of the run from its own --save (--load SAVE --save SAVE) names SAVE, not where
    # the run started (its HF directory), and a resume that loads SAVE itself does not start where it started:
    # where it loads from is then no difference
    skip = set(NOT_DEFINING)
    if any(side.get(source) is not None and side.get(source) == side.get("save")
           for side in (theirs, mine) for source in ("load", "lora_load")):  # LoRA: its adapters' --lora-load SAVE
        skip |= {"load", "load_format", "finetune", "lora_load"}
    return [f"--{names.get(dest, dest)} {_show(value)} here, {_show(theirs[dest])} there"
            for dest, value in mine.items()
            if dest in theirs and dest not in skip and json_flag_value(value) != json_flag_value(theirs[dest])]

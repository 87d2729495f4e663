"""``--config run.yaml``: a YAML file is another way to give the same flags, to the same parser.

Keys are long flag names, spelled as on the command line or with underscores (``seq-length:
4096`` or ``seq_length: 4096``); values are what the flag takes::

    seq-length: 4096          # --seq-length 4096
    neat-pack: true           # a switch: true gives it, false (or null) leaves it out
    data-path: [out/sft]      # a multi-value flag: a list (or one value)
    map-keys: {prompt: q}     # a JSON flag: a mapping or list, passed as JSON
    lr: 1e-5                  # null leaves the flag at its default

The file becomes command-line tokens placed *before* the real command line, so one argparse
parser reads both: a flag given on the command line wins (argparse keeps the last value), and
everything after parsing sees the file's flags as flags the user gave (a Hugging Face
``--load`` checks them against config.json, defaults fill only what neither gave). A switch the
file turns on cannot be turned off from the command line. Paths are relative to the working
directory, as on the command line.

Every key and value is checked before parsing: an unknown key, a value of the wrong type, a key
given twice is one :class:`ConfigError` naming the file, the line, the key and the flag (the
closest valid flag for an unknown key).
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
from typing import Iterable, List, Optional

from mindspeed_pack.runtime import error_scope, stale_files

FLAG = "--config"


class ConfigError(ValueError):
    """A config file that cannot be read, or a key or value the parser would not take."""


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(FLAG, default=None, metavar="FILE.yaml",
                        help="read flags from a YAML file (keys: long flag names; lists for multi-value flags); "
                             "flags on the command line override it")


def _normalise(name: str) -> str:
    return name.lstrip("-").replace("_", "-")


def long_flags(parser: argparse.ArgumentParser) -> dict:
    """{normalised long flag name: action} of every flag a config file may set."""
    out = {}
    for action in parser._actions:
        if action.dest in ("help", "config") or action.help == argparse.SUPPRESS:
            continue
        for option in action.option_strings:
            if option.startswith("--"):
                out[_normalise(option)] = action
    return out


def flag_name(action: argparse.Action) -> str:
    """The name a config file writes for ``action``: its first long option, without the dashes."""
    return next(o for o in action.option_strings if o.startswith("--"))[2:]


# ---------------------------------------------------------------------------- reading
# A section of a file a run wrote (the resolved configuration) whose values are on record only: read back with
# --config, they are left to the parser, which derives them again, so they never count as the user's choices
# (e.g. a preprocessing default checked against the data's sidecar). Its title line ends with this.
RECORD_ONLY = "(on record: --config leaves these to the parser)"


def _record_only_lines(text: str) -> set:
    """Line numbers (1-based) inside the sections whose ``# --- TITLE`` ends with :data:`RECORD_ONLY`."""
    out, inside = set(), False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("# --- "):
            inside = line.rstrip().endswith(RECORD_ONLY)
        elif inside:
            out.add(number)
    return out


def read(path: str) -> List[tuple]:
    """``[(key, value, line)]`` of a config file's top-level mapping, in file order (keys of record-only
    sections left out)."""
    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"{FLAG} {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        _refuse_aliases(text, path)
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        values = yaml.safe_load(text)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte offset {e.start})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        raise ConfigError(f"{path}: {where}not valid YAML ({getattr(e, 'problem', None) or e})") from None
    if root is None:
        return []
    if not isinstance(root, yaml.MappingNode):
        raise ConfigError(f"{path}: line {root.start_mark.line + 1}: the file must be a mapping of flag names to "
                          "values (e.g. 'seq-length: 4096')")
    out, seen, record_only = [], {}, _record_only_lines(text)
    for key_node, _ in root.value:
        line = key_node.start_mark.line + 1
        plain = isinstance(key_node, yaml.ScalarNode) and key_node.tag == "tag:yaml.org,2002:str"
        key = key_node.value if plain else None
        if not key:
            raise ConfigError(f"{path}: line {line}: keys are flag names (e.g. seq-length), got "
                              f"{getattr(key_node, 'value', key_node)!r}")
        if _normalise(key) in seen:
            raise ConfigError(f"{path}: line {line}: {key} is given twice (first on line {seen[_normalise(key)]})")
        seen[_normalise(key)] = line
        if line not in record_only:
            out.append((key, values[key], line))
    return out


def _refuse_aliases(text: str, path: str) -> None:
    """A flag's value is never a reference to another: aliases are refused before anything is expanded, so a
    nested-anchor "billion laughs" value costs nothing (expanded, it would take gigabytes)."""
    import yaml

    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.AliasEvent):
            raise ConfigError(f"{path}: line {event.start_mark.line + 1}: YAML aliases (*{event.anchor}) are not "
                              "allowed in a config file: write the value out")


_KINDS = {int: "an integer", float: "a number", None: "text"}


def _kind(action: argparse.Action) -> str:
    if action.choices is not None:
        return "one of " + ", ".join(map(str, action.choices))
    return _KINDS.get(action.type, "a valid value")


def _check_value(text: str, action: argparse.Action, where: str) -> None:
    """What argparse would do with ``text``, with the error naming the file and line."""
    value = text
    if callable(action.type):
        try:
            value = action.type(text)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
            detail = f" ({e})" if isinstance(e, argparse.ArgumentTypeError) else ""
            raise ConfigError(f"{where}: expected {_kind(action)}, got {text!r}{detail}") from None
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{where}: expected {_kind(action)}, got {text!r}")


def _as_text(value, action: argparse.Action, where: str) -> str:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected {_kind(action)}, got {str(value).lower()}")
    if isinstance(value, (dict, list)) and action.type in (int, float):
        raise ConfigError(f"{where}: expected one value ({_kind(action)}), got a {type(value).__name__}")
    text = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    _check_value(text, action, where)
    return text


def tokens_for(key: str, value, action: argparse.Action, where: str) -> List[str]:
    """The command-line tokens that give ``key: value`` (empty: leave the flag at its default)."""
    option = "--" + key if ("--" + key) in action.option_strings else "--" + flag_name(action)
    if value is None:
        return []
    if action.nargs == 0:  # a switch
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: a switch takes true or false, got {value!r}")
        if value:
            return [option]
        negative = [o for o in action.option_strings if o.startswith("--no-") and o != option]
        return [negative[0]] if isinstance(action, argparse.BooleanOptionalAction) and negative else []
    if action.nargs in ("*", "+") or isinstance(action.nargs, int):
        items = value if isinstance(value, list) else [value]
        if action.nargs == "+" and not items:
            raise ConfigError(f"{where}: give at least one value")
        if isinstance(action.nargs, int) and len(items) != action.nargs:
            raise ConfigError(f"{where}: give {action.nargs} values, got {len(items)}")
        return [option, *(_as_text(v, action, where) for v in items)]
    return [f"{option}={_as_text(value, action, where)}"]


def config_tokens(parser: argparse.ArgumentParser, path: str) -> List[str]:
    """The command-line tokens of config file ``path`` for ``parser``."""
    flags = long_flags(parser)
    out = []
    for key, value, line in read(path):
        name = _normalise(key)
        where = f"{path}: line {line}: {key}"
        if name == "config":
            raise ConfigError(f"{where}: config files do not include other config files")
        action = flags.get(name)
        if action is None:
            close = difflib.get_close_matches(name, list(flags), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]} (--{close[0]})?" if close else "; see --help for the flags"
            raise ConfigError(f"{path}: line {line}: unknown key {key!r}, not a flag of this script{hint}")
        out += tokens_for(name, value, action, f"{where} (--{name})")
    return out


def config_path(argv: Iterable[str]) -> Optional[str]:
    """The ``--config`` file of ``argv`` (None without one)."""
    found = []
    argv = list(argv)
    for i, token in enumerate(argv):
        if token == FLAG:
            if i + 1 >= len(argv):
                raise ConfigError(f"{FLAG} needs a file name")
            found.append(argv[i + 1])
        elif token.startswith(FLAG + "="):
            found.append(token.split("=", 1)[1])
    if len(found) > 1:
        raise ConfigError(f"{FLAG} given {len(found)} times ({', '.join(found)}): give one file")
    return found[0] if found else None


# flags that say the same thing two ways (refused together): one on the command line overrides the other in the file
ALTERNATIVES = (("--train-epochs", "--train-iters"), ("--lr-warmup-fraction", "--lr-warmup-iters"),
                ("--train-samples", "--train-iters"), ("--train-samples", "--train-epochs"),
                ("--lr-warmup-fraction", "--lr-warmup-samples"))


def _without(tokens: List[str], flag: str) -> List[str]:
    """``tokens`` without ``flag`` and its values (the tokens up to the next flag)."""
    out, skipping = [], False
    for token in tokens:
        if token.startswith("--"):
            skipping = token == flag or token.startswith(flag + "=")
        if not skipping:
            out.append(token)
    return out


def expand_argv(parser: argparse.ArgumentParser, argv: Iterable[str]) -> List[str]:
    """``argv`` with its ``--config`` file's flags in front (the command line then overrides them, an
    :data:`ALTERNATIVES` flag too: ``--train-iters`` on the command line drops the file's ``--train-epochs``)."""
    argv = list(argv)
    path = config_path(argv)
    if path is None:
        return argv
    tokens = config_tokens(parser, path)
    given = {token.split("=", 1)[0] for token in argv if token.startswith("--")}
    for pair in ALTERNATIVES:
        for mine, theirs in (pair, pair[::-1]):
            if mine in given and theirs not in given:
                tokens = _without(tokens, theirs)
    return tokens + argv


def parse(parser: argparse.ArgumentParser, argv=None) -> tuple:
    """(namespace, expanded argv): ``parser.parse_args`` with the ``--config`` layer; a config error is
    one ``PROG: error: ...`` line and exit 2 (without argparse's usage text)."""
    import sys

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        expanded = expand_argv(parser, argv)
    except ConfigError as e:  # the file: each node reads its own copy (runtime.error_scope)
        parser.exit(2, f"{parser.prog}: error: {e}\n" if error_scope.prints_here("node") else None)
    if config_path(argv) is not None:  # the file gave flags: a refusal of them may differ per node
        parser.refusal_scope = "node"
    return parser.parse_args(expanded), expanded


# ---------------------------------------------------------------------------- writing
def _plain(value):
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def render(sections: List[tuple], header: str = "") -> str:
    """YAML text of ``[(title, [(key, value, comment)], shown_only)]``: one ``key: value`` line per flag
    after a ``# --- title`` line; a ``shown_only`` section's lines are comments (read, not set)."""
    import yaml

    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for title, entries, shown_only in sections:
        if not entries:
            continue
        lines += ["", f"# --- {title}"]
        for key, value, comment in entries:
            text = yaml.safe_dump({key: _plain(value)}, default_flow_style=True, width=10**6,
                                  sort_keys=False).strip()[1:-1]  # {key: value} -> key: value
            lines.append(("# " if shown_only else "") + text + (f"  # {comment}" if comment else ""))
    return "\n".join(lines) + "\n"


def write(path: str, text: str) -> None:
    """``text`` to ``path``, replaced whole (a reader never sees half a file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = stale_files.temporary_for(path, path)
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)

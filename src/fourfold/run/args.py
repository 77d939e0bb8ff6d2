"""Flags and TOML into a :class:`~fourfold.config.Config`: defaults, then a ``--config`` file, then the flags
given (a resumed run's model settings left out come from its checkpoint, between the defaults and the file).
Every value is checked as strictly from the file as from a flag, and an unknown key or flag is refused with the
nearest valid name.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from fourfold.config import MODEL_HELP, SECTIONS, Config, to_toml
from fourfold.data.tokenizers import absolute_spec
from fourfold.run.resume import take_checkpoint_model
from fourfold.torchrun import is_worker

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["add_flags", "check_value", "from_namespace", "load", "make_parser", "parse_args", "without_flags",
           "without_section_flags"]


def _nearest(name: str, valid: typing.Iterable[str]) -> str:
    match = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.5)
    return f" Did you mean {match[0]!r}?" if match else f" Valid: {', '.join(sorted(valid))}."


def load(path: str | Path) -> dict[str, dict[str, Any]]:
    """Read a TOML file into ``{section: {key: value}}``, refusing unknown sections and keys."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"config {path} cannot be read: {e.strerror or e}. Pass --config with a TOML file's "
                         "path.") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config {path} is not valid TOML: {e}.") from None
    _moved_from_train(data, path)
    for section, values in data.items():
        if not isinstance(values, dict):  # a key above every table
            home = _SECTION_OF.get(section)
            hint = f" Put it under [{home}]." if home else _nearest(section, _SECTION_OF)
            raise ValueError(f"{section} = {values!r} in {path} is outside any table; every key sits under "
                             f"{', '.join(f'[{s}]' for s in list(SECTIONS)[:-1])} or [{list(SECTIONS)[-1]}].{hint}")
        if section not in SECTIONS:
            raise ValueError(f"unknown section [{section}] in {path}.{_nearest(section, SECTIONS)}")
        known = {f.name for f in dataclasses.fields(SECTIONS[section])}
        for key in values:
            if key not in known:
                home = _SECTION_OF.get(key)
                hint = f" It belongs under [{home}]." if home else _nearest(key, known)
                raise ValueError(f"unknown key {key!r} in [{section}] of {path}.{hint}")
    return data


def _moved_from_train(data: dict[str, Any], path: str | Path) -> None:
    """A file written before the sections (its data, parallel, optim, checkpoint and output settings under
    [train]) still loads: each key is moved to its table, with one note naming the tables."""
    train = data.get("train")
    if not isinstance(train, dict):
        return
    moved = {k: _SECTION_OF[k] for k in train if k in _ONCE_IN_TRAIN}
    if not moved:
        return
    for key, home in moved.items():
        table = data.setdefault(home, {})
        if not isinstance(table, dict):
            return  # a key named like a table: load() refuses it with its own words
        if key in table:
            raise ValueError(f"{key} is set twice in {path}, under [train] and [{home}]. Keep the one under "
                             f"[{home}].")
        table[key] = train.pop(key)
    if is_worker():  # a rank of a launched run: its launcher said it already
        return
    by_table: dict[str, list[str]] = {}
    for key, home in moved.items():
        by_table.setdefault(home, []).append(key)
    where = "; ".join(f"{', '.join(keys)} under [{home}]" for home, keys in by_table.items())
    print(f"fourfold: note: settings in [train] of {path} belong in tables of their own now: {where}; read from "
          "there (move them to silence this note).", file=sys.stderr)


_ONCE_IN_TRAIN = {f.name for section in ("data", "parallel", "optim", "checkpoint", "output")
                  for f in dataclasses.fields(SECTIONS[section])}
"""The keys [train] held before the sections of their own (2026-11-29)."""

_SECTION_OF = {f.name: section for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
"""Every key's table, for a key placed outside it."""


def _flag_type(tp: Any) -> tuple[Any, list[str] | None]:
    """(converter, choices) for a field type: int, float, str, bool, Literal[...], X | None, a tuple (comma
    separated: ``--boundaries 1,3``)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple:
        return (lambda s: tuple(int(x) if x.strip().lstrip("-").isdigit() else x.strip() for x in s.split(","))), None
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)][0]
        conv, choices = _flag_type(inner)
        return (lambda s: None if s.lower() == "none" else conv(s)), choices
    if typing.get_origin(tp) is Literal:
        return str, [str(a) for a in args]
    return tp, None


def _metavar(name: str, tp: Any) -> str:
    if name in ("out", "data", "config"):
        return "PATH"
    text = str(tp)
    return "N" if "int" in text else "X" if "float" in text else "TEXT"


def add_flags(parser: argparse.ArgumentParser, sections: typing.Iterable[str] = SECTIONS) -> None:
    """Add one flag per config field; a flag left out keeps the file's (or default) value."""
    for section in sections:
        cls = SECTIONS[section]
        hints = typing.get_type_hints(cls)
        group = parser.add_argument_group(f"{section} ([{section}] in --config)")
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            text = f.metadata.get("help") or MODEL_HELP.get(f.name, "")
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            if "default" not in text:
                text = f"{text} (default: {default})"
            dest = f"{section}.{f.name}"
            if hints[f.name] is bool:
                group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction,
                                   default=argparse.SUPPRESS, help=text)
                continue
            conv, choices = _flag_type(hints[f.name])
            group.add_argument(flag, dest=dest, type=conv, choices=choices, default=argparse.SUPPRESS,
                               metavar=None if choices else _metavar(f.name, hints[f.name]), help=text)


def from_namespace(ns: argparse.Namespace, file: str | Path | None = None) -> Config:
    """Defaults, then (with ``resume``) the checkpoint's model settings, then ``file``'s values, then the flags
    present in ``ns``."""
    values: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    if file is not None:
        for section, table in load(file).items():
            hints = typing.get_type_hints(SECTIONS[section])
            for key, value in table.items():  # each checked, a value a flag replaces included
                check_value(key, value, hints[key], file)
            values[section].update(table)
    for dest, value in vars(ns).items():
        if "." in dest:
            section, key = dest.split(".", 1)
            values[section][key] = value
    if values["checkpoint"].get("resume") is not None:
        take_checkpoint_model(values)  # before the values are checked: they are the checkpoint's too
    for section, table in values.items():
        hints = typing.get_type_hints(SECTIONS[section])
        for key, value in table.items():
            table[key] = check_value(f"{key}", value, hints[key], file)
    t, d = values["train"], values["data"]
    _from_directory(t, d)
    # recorded so, a resume (or an export) from elsewhere finds the files
    for key in ("model_config", "init_from"):
        if t.get(key) is not None:
            t[key] = os.path.abspath(t[key])
    if d.get("tokenizer") is not None:
        d["tokenizer"] = absolute_spec(d["tokenizer"])
    try:
        parts = {s: SECTIONS[s](**values[s]) for s in SECTIONS}
        return Config(**parts)
    except TypeError as e:  # a wrongly typed value in the file
        raise ValueError(f"bad value in {file or 'flags'}: {e}") from None
    except ValueError as e:  # a value out of range: say where the values came from
        if file is None:
            raise
        raise ValueError(f"--config {file} (or a flag): {e}") from None


def _from_directory(t: dict[str, Any], d: dict[str, Any]) -> None:
    """With ``--init-from`` a Hugging Face directory, what it says of itself stands for the flags not given: its
    family for ``--model`` (its config.json's model_type) and, for text, its ``tokenizer.json`` for
    ``--tokenizer`` (the weights learnt its ids, not bytes). A flag given (or a TOML value) keeps its value, and
    is checked against the directory by the config."""
    start = t.get("init_from")
    if start is None or not os.path.isdir(start):
        return
    from fourfold.data import is_token_file
    from fourfold.models.hf import FAMILIES
    from fourfold.models.weights import hf_directory

    kind = (hf_directory(start) or {}).get("model_type")
    if "model" not in t and kind in FAMILIES:
        t["model"] = kind
    own = Path(start) / "tokenizer.json"
    if "tokenizer" not in d and own.is_file() and (d.get("data") is None or not is_token_file(d["data"])):
        d["tokenizer"] = str(own)


def check_value(name: str, value: Any, tp: Any, file: str | Path | None = None) -> Any:
    """``value`` as field ``name`` of type ``tp`` takes it (an int where a float goes), or a ValueError saying
    what was expected, what was given, and where: TOML values are checked as strictly as flags."""
    where = f" in {file}" if file is not None else ""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        if value is None:
            return None
        return check_value(name, value, next(a for a in args if a is not type(None)), file)
    if typing.get_origin(tp) is tuple:  # a TOML list, or a flag's tuple: of ints and texts
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, (int, str)) and not isinstance(v, bool)
                                                           for v in value):
            raise ValueError(f"{name} must be a list of block indices or names, got {value!r}{where}.")
        return tuple(value)
    if typing.get_origin(tp) is Literal:
        if value not in args:
            raise ValueError(f"{name} must be one of {', '.join(map(str, args))}, got {value!r}{where}.")
        return value
    kinds = {bool: "true or false", int: "an integer", float: "a number", str: "text"}
    ok = (isinstance(value, bool) if tp is bool else
          isinstance(value, int) and not isinstance(value, bool) if tp is int else
          isinstance(value, (int, float)) and not isinstance(value, bool) if tp is float else
          isinstance(value, tp))
    if not ok:
        raise ValueError(f"{name} must be {kinds.get(tp, tp.__name__)}, got {value!r} "
                         f"({type(value).__name__}){where}.")
    if tp is float:
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}{where}.")
        return float(value)
    return value


class _Parser(argparse.ArgumentParser):
    """argparse that refuses unknown flags with the nearest valid one (and takes no abbreviations)."""

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        ns, unknown = self.parse_known_args(args, namespace)
        if unknown:
            flag = unknown[0].split("=", 1)[0]
            valid = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
            hint = _nearest(flag, valid) if flag.startswith("-") else ""
            self.error(f"unknown flag {flag!r}.{hint}")
        return ns


def make_parser(prog: str, description: str, **kwargs: Any) -> argparse.ArgumentParser:
    return _Parser(prog=prog, description=description, allow_abbrev=False,
                   formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)


def without_section_flags(argv: list[str], section: str) -> list[str]:
    """``argv`` minus the flags of one section (``--nproc 2`` and ``--nproc=2`` forms)."""
    return without_flags(argv, {"--" + f.name.replace("_", "-") for f in dataclasses.fields(SECTIONS[section])})


def without_flags(argv: list[str], flags: typing.Collection[str]) -> list[str]:
    """``argv`` minus ``flags``, each taking a value (``--nproc 2`` and ``--nproc=2`` forms)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif arg.split("=", 1)[0] not in flags:
            kept.append(arg)
    return kept


TRAIN_EXAMPLES = """examples:
  fourfold train --steps 3 --dtype float64 --out runs/first      one process, exact arithmetic
  fourfold train --nproc 2 --steps 50 --out runs/dp2             2 data-parallel ranks (torchrun)
  fourfold train --config run.toml --lr 1e-3                     defaults < file < flags
  torchrun --nproc-per-node 2 --rdzv-backend fourfold-loopback --rdzv-endpoint 127.0.0.1:0 \\
      -m fourfold.train --steps 50                                launched by hand (loopback only)

outputs in --out: run.json, metrics.jsonl (one line per step), trace.json (open in
https://ui.perfetto.dev), trace-rank<r>.jsonl, model.pt. An earlier run there is kept unless --overwrite.
"""


def parse_args(argv: list[str] | None = None, prog: str = "fourfold train") -> Config:
    """Parse ``fourfold train``'s flags (``--config FILE`` first, then every field) into a :class:`Config`."""
    parser = make_parser(prog, "Train a model (TinyGPT, GPT-2, Llama or your own: --model) on one process or "
                         "--nproc N ranks.",
                         usage=f"{prog} [--config FILE] [--FLAG VALUE ...]", epilog=TRAIN_EXAMPLES)
    parser.add_argument("--config", metavar="FILE", help="TOML file with [model], [data], [parallel], [optim], "
                        "[train], [checkpoint], [output], [launch] tables")
    parser.add_argument("--print-config", action="store_true", help="print the effective configuration (defaults < "
                        "--config < flags) as TOML that --config reads back to the same run, and exit")
    add_flags(parser)
    ns = parser.parse_args(argv)
    try:
        cfg = from_namespace(ns, ns.config)
    except (ValueError, OSError) as e:
        parser.error(str(e))
        raise  # unreachable: error() exits
    if ns.print_config:
        print(to_toml(cfg), end="")
        raise SystemExit(0)
    return cfg

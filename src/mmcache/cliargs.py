"""Argument types of the ``mmcache`` command (each value checked while parsing), the
data-source options (``--format``, ``--columns``, ``--image-root``) its commands share,
and the two forms their results print in (:func:`print_json`, :func:`table`).

A bad value stops the command before any work, on one line that names the flag
and the value: ``mmcache warm: error: argument --workers: must be an integer >= 0,
got '-1' (see mmcache warm --help)``.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

__all__ = [
    "Parser",
    "add_data_options",
    "budget",
    "data_options",
    "duration",
    "fraction",
    "glue_dash_values",
    "int_at_least",
    "parse_budget",
    "print_json",
    "size",
    "size_of",
    "table",
]


class Parser(argparse.ArgumentParser):
    """argparse, with errors on one line (the usage is one ``--help`` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def _library_parse(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """A units.py parser as an argparse type: its message, and the value, on error."""

    def wrapped(text: str) -> Any:
        from mmcache.errors import ConfigError

        if text.strip().startswith("-"):
            raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
        try:
            return parse(text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return wrapped


def size(text: str) -> int:
    from mmcache.units import parse_size

    return int(_library_parse(parse_size)(text))


def size_of(flag: str) -> Callable[[str], int]:
    """:func:`size` for the option ``flag``: its errors name the flag the user typed
    (``--max-size must be at most 2**62 bytes``), never the library's parameter."""

    def parse(text: str) -> int:
        from mmcache.units import parse_size

        return int(_library_parse(lambda t: parse_size(t, name=flag))(text))

    parse.__name__ = "size"  # argparse says "invalid size value" for other errors
    return parse


def duration(text: str) -> float:
    from mmcache.units import parse_duration

    return float(_library_parse(parse_duration)(text))


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value >= 0.0):
        raise argparse.ArgumentTypeError(
            f"must be a fraction >= 0 of the preprocessed data (e.g. 0.5), got {text!r}"
        )
    return value


def budget(text: str) -> str:
    """``"50%"`` or an IEC size; checked now, resolved once the data size is known."""
    from mmcache.errors import ConfigError

    try:
        parse_budget(text, 0, name="--budget")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(f"{exc}") from None
    return text


def glue_dash_values(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``--disk -1GiB`` -> ``--disk=-1GiB``.

    argparse takes a value starting with ``-`` (other than a plain negative
    number) for an option and answers "expected one argument"; glued to its flag,
    the value reaches its type, whose message says what is wrong with it.
    """
    takes_value: set[str] = set()
    flags: set[str] = set()
    parsers = [parser]
    while parsers:
        p = parsers.pop()
        for action in p._actions:
            flags.update(action.option_strings)
            if action.option_strings and action.nargs is None:
                takes_value.update(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
    out: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            out.extend(args[i:])
            break
        following = args[i + 1] if i + 1 < len(args) else None
        if (
            arg in takes_value
            and following is not None
            and following.startswith("-")
            and following not in flags
            and following.split("=", 1)[0] not in flags
        ):
            out.append(f"{arg}={following}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def parse_budget(text: str, data_bytes: int, *, name: str = "budget") -> int:
    """``"50%"`` of the preprocessed data, or an IEC size (``"2GiB"``); errors name ``name``."""
    from mmcache.errors import ConfigError
    from mmcache.units import parse_size

    text = text.strip()
    if text.endswith("%"):
        try:
            fraction = float(text[:-1]) / 100.0
        except ValueError as exc:
            raise ConfigError(f"cannot parse budget {text!r}: use e.g. 50% or 2GiB") from exc
        if not (math.isfinite(fraction) and fraction >= 0.0):
            raise ConfigError(f"budget must be >= 0%, got {text!r}")
        return int(data_bytes * fraction)
    if text.startswith("-"):
        raise ConfigError(f"budget must be >= 0, got {text!r}")
    return parse_size(text, name=name)


def data_options(args: argparse.Namespace) -> dict[str, Any]:
    """``format=``, ``columns=`` and ``image_root=`` of mmcache.open_source from the options."""
    from mmcache.errors import ConfigError

    out: dict[str, Any] = {"format": args.format}
    if args.image_root:
        out["image_root"] = args.image_root
    if args.columns:
        columns: dict[str, str | None] = {}
        for part in args.columns.split(","):
            role, sep, name = part.partition("=")
            if not sep or not role.strip():
                raise ConfigError(f"--columns takes role=name,... (id, image, text), got {part!r}")
            columns[role.strip()] = name.strip() or None
        out["columns"] = columns
    return out


def add_data_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--format",
        default="auto",
        help="jsonl, llava, parquet, hf, coco... (default: sniffed from the path)",
    )
    p.add_argument(
        "--columns", help="Parquet/HF column names: id=key,image=jpg,text=caption (text= for none)"
    )
    p.add_argument("--image-root", help="COCO: the images' folder (default: the JSON's folder)")


def add_pipeline_options(p: argparse.ArgumentParser) -> None:
    """``--pipeline`` (the training script's) or the default one's ``--size``,
    ``--max-length`` and ``--tokenizer`` (``mmcache warm`` and ``inspect``)."""
    p.add_argument(
        "--pipeline",
        help="module:function (or file.py:function) returning the training script's "
        "mmcache.Pipeline, instead of the default one (--size, --max-length, --tokenizer)",
    )
    p.add_argument("--size", type=int_at_least(1), help="image side in px (default 224)")
    p.add_argument("--max-length", type=int_at_least(1), help="tokens (default 32)")
    p.add_argument("--tokenizer", help="tokenizer.json (default: the built-in offline one)")


def print_json(data: Any) -> None:
    """Print ``data`` as indented JSON with sorted keys (``--json``); what JSON cannot
    hold (a path, a dtype) as its ``str``."""
    print(json.dumps(data, indent=2, sort_keys=True, default=str))


def table(rows: list[list[str]], header: list[str]) -> str:
    """``rows`` under ``header`` as right-aligned columns, a dashed rule between."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    lines = ["  ".join(str(h).rjust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)

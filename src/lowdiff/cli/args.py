"""Argument types and checks shared by the subcommands."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from lowdiff.errors import InvalidArgumentError
from lowdiff.format.atomic import nearest_existing


def int_at_least(low: int, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
    return value


def non_negative_int(text: str) -> int:
    return int_at_least(0, text)


def positive_int(text: str) -> int:
    return int_at_least(1, text)


def method_list(text: str | None) -> list[str] | None:
    """``--methods A,B``: the names given (None: the command's default).

    Raises:
        ValueError: the value names no method.
    """
    if text is None:
        return None
    methods = [m.strip() for m in text.split(",") if m.strip()]
    if not methods:
        raise InvalidArgumentError("--methods: give at least one method")
    return methods


def output_dir(path: Path, option: str = "--out") -> Path:
    """Check now, before any work, that the output folder ``path`` can be made or written
    (nothing is made yet): a file in its place or on its way, or a folder that cannot be
    written, is an error at once, not after the run whose results it was to hold."""
    if path.exists():
        if not path.is_dir():
            raise InvalidArgumentError(f"{option} {path}: exists and is not a folder")
        if not os.access(path, os.W_OK | os.X_OK):
            raise InvalidArgumentError(f"{option} {path}: cannot be written")
        return path
    parent = nearest_existing(path.parent)
    if not parent.is_dir():
        raise InvalidArgumentError(f"{option} {path}: cannot be made ({parent} is not a folder)")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InvalidArgumentError(f"{option} {path}: cannot be made ({parent} cannot be written)")
    return path


def output_file(path: Path, option: str) -> Path:
    """Check now that the file ``path`` can be written once the work is done: its
    folder is made, and it is not a folder itself."""
    if path.is_dir():
        raise InvalidArgumentError(f"{option} {path}: is a folder, not a file")
    output_dir(path.parent, f"{option} {path}: its folder")
    return path


def fmt_bytes(n: float | None) -> str:
    """``1536 -> "1.5 KiB"``; None -> ``"n/a"``."""
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


class DeprecatedFlag(argparse.Action):
    """A flag of lowdiff 0.1 that still works for one release: it stores into the new
    flag's destination and says on stderr which flag replaces it.

    Example:
        >>> p.add_argument("--out-dir", action=DeprecatedFlag, new="--out", dest="out")  # doctest: +SKIP
    """

    def __init__(self, option_strings: list[str], dest: str, new: str, **kwargs: Any) -> None:
        self.new = new
        kwargs.setdefault("help", argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)

    def __call__(
        self, parser: Any, namespace: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        print(f"lowdiff: warning: {option} is deprecated; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)

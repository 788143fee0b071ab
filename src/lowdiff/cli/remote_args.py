"""Directory arguments of the CLI: a local directory or a remote tier's URL."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lowdiff.errors import InvalidArgumentError


@contextlib.contextmanager
def local_copy(args: argparse.Namespace, *, everything: bool) -> Iterator[list[str]]:
    """``args.directory`` as a local directory: a URL of a remote tier (``remote=``) is
    downloaded into a temporary one first (every committed object with ``everything``,
    else the newest chain), removed afterwards. Yields what the download left out as
    damaged (each named)."""
    from lowdiff.remote import fetch, is_url

    where = str(args.directory)
    args.shown = where  # what the user named: the URL, not the download's temp directory
    args.local_root = None
    if not is_url(where):
        args.directory = Path(where)
        yield []
        return
    with tempfile.TemporaryDirectory(prefix="lowdiff-remote-") as tmp:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the damaged objects are reported by the caller
            got = fetch(where, tmp, remote_options(args.remote_option), everything=everything)
        args.directory = args.local_root = Path(tmp)
        print(
            f"remote tier {where}: {len(got.files)} committed object(s) downloaded", file=sys.stderr
        )
        for why in got.damaged:
            print(f"warning: remote tier: left out {why}", file=sys.stderr)
        yield got.damaged


def remote_options(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` items as fsspec options (a VALUE that parses as JSON is taken so)."""
    out: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise InvalidArgumentError(f"--remote-option must be KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def named(args: argparse.Namespace, text: object) -> str:
    """``text`` (a path, or a message naming paths) as the user knows it: a file of a
    remote tier's download is named by its URL, not by the temporary directory that
    held it while the command ran."""
    out = str(text)
    root = getattr(args, "local_root", None)
    if root is not None:
        out = out.replace(str(root), str(args.shown).rstrip("/"))
    return out

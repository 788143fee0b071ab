"""Atomic publication of files: write a temp file, fsync it, rename it, fsync the directory.

A reader never sees a partial file under its final name: until the rename, the data
lives under a ``.tmp-`` name that recovery ignores and a new session deletes.

Fault-injection hook points (``before_fsync``, ``before_rename``, ``after_rename``) let
tests stop or kill a writer at a precise point; they cost one dict lookup when unused.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

TMP_PREFIX = ".tmp-"

_HOOKS: dict[str, Callable[[Path], None]] = {}


def set_fault_hook(point: str, fn: Callable[[Path], None] | None) -> None:
    """Install (or with ``None`` remove) a test hook at ``point``."""
    if point not in {"before_fsync", "before_rename", "after_rename"}:
        raise ValueError(f"unknown fault hook point {point!r}")
    if fn is None:
        _HOOKS.pop(point, None)
    else:
        _HOOKS[point] = fn


def _hook(point: str, path: Path) -> None:
    fn = _HOOKS.get(point)
    if fn is not None:
        fn(path)


def fsync_dir(path: Path) -> None:
    """fsync a directory so that a rename inside it is durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str | Path) -> Iterator[BinaryIO]:
    """Open a temp file next to ``path``; on clean exit publish it atomically as ``path``.

    On an exception the temp file is removed and ``path`` is untouched.

    Example:
        >>> with atomic_open(tmp / "x.bin") as f:  # doctest: +SKIP
        ...     f.write(b"data")
    """
    path = Path(path)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    f = open(tmp, "w+b")  # noqa: SIM115 -- closed below on every path
    try:
        yield f
        f.flush()
        _hook("before_fsync", tmp)
        os.fsync(f.fileno())
        f.close()
        _hook("before_rename", tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
        _hook("after_rename", path)
    except BaseException:
        f.close()
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Publish ``data`` as ``path`` atomically."""
    with atomic_open(path) as f:
        f.write(data)


def remove_stale_temps(directory: Path) -> list[Path]:
    """Delete temp files that an interrupted writer left behind; returns what was removed."""
    removed = []
    if directory.is_dir():
        for p in directory.iterdir():
            if p.name.startswith(TMP_PREFIX) and p.is_file():
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                    removed.append(p)
    return removed

"""Atomic publication of files: write a temp file, fsync it, rename it, fsync the directory.

A reader never sees a partial file under its final name: until the rename, the data
lives under a ``.tmp-`` name that recovery ignores and a new session deletes.

Fault-injection hook points (``before_write``, ``before_fsync``, ``before_rename``,
``after_rename``, ``retention`` just after retention deletes a file, and for the remote
tier ``before_upload``, ``upload_chunk`` after each chunk sent, ``before_commit`` between
a complete data object and its commit object) let tests stop,
kill or fail a writer at a precise point; they cost one dict lookup when unused. A test
installs them in its own process with :func:`set_fault_hook`, or in a checkpointing
process it is about to start through the ``LOWDIFF_TEST_HOOKS`` environment variable (read
once, when this module is imported; see :data:`HOOKS_ENV`). Both are for tests only.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from lowdiff.errors import InvalidArgumentError

TMP_PREFIX = ".tmp-"

FAULT_POINTS = (
    "before_write", "before_fsync", "before_rename", "after_rename", "retention",
    "before_upload", "upload_chunk", "before_commit",
)  # fmt: skip
HOOKS_ENV = "LOWDIFF_TEST_HOOKS"
"""``module:function`` that installs fault hooks in this process (read at import, and
again in a background process once it has the trainer's environment): the test suite
and ``lowdiff torture`` (``lowdiff_lab.faults:install_env_faults``) set it. Unset in
normal use: nothing is imported."""
PARENT_ENV = "LOWDIFF_PARENT_PID"
"""Set by the trainer for each background process it starts: its own pid."""

_HOOKS: dict[str, Callable[[Path], None]] = {}


def set_fault_hook(point: str, fn: Callable[[Path], None] | None) -> None:
    """Install (or with ``None`` remove) a test hook at ``point``."""
    if point not in FAULT_POINTS:
        raise InvalidArgumentError(f"unknown fault hook point {point!r}; expected one of {FAULT_POINTS}")
    if fn is None:
        _HOOKS.pop(point, None)
    else:
        _HOOKS[point] = fn


def replace_hooks(hooks: dict[str, Callable[[Path], None]]) -> None:
    """Replace every installed hook by ``hooks`` (point -> function)."""
    bad = set(hooks) - set(FAULT_POINTS)
    if bad:
        raise InvalidArgumentError(f"unknown fault hook point {sorted(bad)[0]!r}; expected one of {FAULT_POINTS}")
    _HOOKS.clear()
    _HOOKS.update(hooks)


def fault_point(point: str, path: Path) -> None:
    """Run the hook installed at ``point`` (a test's), if any, for ``path``."""
    fn = _HOOKS.get(point)
    if fn is not None:
        fn(path)


def install_env_hooks() -> None:
    """Run the installer ``LOWDIFF_TEST_HOOKS`` names, if any (see :data:`HOOKS_ENV`)."""
    spec = os.environ.get(HOOKS_ENV)
    if not spec:
        _HOOKS.clear()
        return
    module, _, fn = spec.partition(":")
    getattr(importlib.import_module(module), fn or "install_env_faults")()


def parent_pid() -> int:
    """The process that started this one: the trainer of a background process (named by
    ``LOWDIFF_PARENT_PID``, since a fork server stands between them), else the parent."""
    return int(os.environ.get(PARENT_ENV) or os.getppid())


install_env_hooks()


def nearest_existing(path: Path) -> Path:
    """``path`` itself when it exists, else its nearest ancestor that does: where a file
    or folder to be made at ``path`` would be made from."""
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


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
        fault_point("before_write", tmp)
        yield f
        f.flush()
        fault_point("before_fsync", tmp)
        os.fsync(f.fileno())
        f.close()
        fault_point("before_rename", tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
        fault_point("after_rename", path)
    except BaseException as e:
        f.close()
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        if isinstance(e, OSError) and e.errno is not None and e.filename != str(path):
            # name the file being published, not the temp file (or no file at all)
            raise type(e)(e.errno, e.strerror, str(path)) from e
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

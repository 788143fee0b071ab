"""Atomic publication of files: write a temp file, fsync it, rename it, fsync the directory.

A reader never sees a partial file under its final name: until the rename, the data
lives under a ``.tmp-`` name that recovery ignores and a new session deletes.

Fault-injection hook points (``before_write``, ``before_fsync``, ``before_rename``,
``after_rename``, ``retention`` just after retention deletes a file, and for the remote
tier ``before_upload``, ``upload_chunk`` after each chunk sent, ``before_commit`` between
a complete data object and its commit object) let tests stop,
kill or fail a writer at a precise point; they cost one dict lookup when unused. A test
installs them in its own process with :func:`set_fault_hook`, or in a checkpointing
process it is about to start through the ``LOWDIFF_FAULTS`` environment variable (read
once, when this module is imported; see :func:`parse_faults`). Both are for tests only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

TMP_PREFIX = ".tmp-"

FAULT_POINTS = (
    "before_write", "before_fsync", "before_rename", "after_rename", "retention",
    "before_upload", "upload_chunk", "before_commit",
)  # fmt: skip
FAULT_KINDS = ("records", "full", "manifest", "any")
FAULT_ACTIONS = ("kill-self", "kill-parent", "kill-both", "enospc", "eio", "slow")
FAULT_ENV = "LOWDIFF_FAULTS"
PARENT_ENV = "LOWDIFF_PARENT_PID"
"""Set by the trainer for each background process it starts: its own pid."""
SLOW_ENV = "LOWDIFF_FAULT_SLOW_S"
"""Seconds the ``slow`` action sleeps (a disk that stalls; default 2)."""
MARK_ENV = "LOWDIFF_FAULT_MARK"
"""A file the ``slow`` action creates before it sleeps: a test knows the process is
inside the stalled step (and can act while it is there)."""

_HOOKS: dict[str, Callable[[Path], None]] = {}


def set_fault_hook(point: str, fn: Callable[[Path], None] | None) -> None:
    """Install (or with ``None`` remove) a test hook at ``point``."""
    if point not in FAULT_POINTS:
        raise ValueError(f"unknown fault hook point {point!r}; expected one of {FAULT_POINTS}")
    if fn is None:
        _HOOKS.pop(point, None)
    else:
        _HOOKS[point] = fn


def _hook(point: str, path: Path) -> None:
    fn = _HOOKS.get(point)
    if fn is not None:
        fn(path)


def file_kind(path: Path) -> str:
    """``"records"``, ``"full"`` or ``"manifest"`` for lowdiff's files, else ``"other"``."""
    name = path.name
    if name == "lowdiff.json" or name.startswith(f"{TMP_PREFIX}lowdiff.json"):
        return "manifest"
    if path.parent.name in ("records", "full"):
        return path.parent.name
    return "other"


class _Fault:
    """Fires ``action`` at the ``nth`` time ``point`` is reached for a file of ``kind``."""

    def __init__(self, point: str, kind: str, nth: int, action: str) -> None:
        self.point, self.kind, self.nth, self.action = point, kind, nth, action
        self.seen = 0

    def __call__(self, path: Path) -> None:
        if self.kind != "any" and file_kind(path) != self.kind:
            return
        self.seen += 1
        if self.seen != self.nth:
            return
        if self.action in ("kill-parent", "kill-both"):
            os.kill(parent_pid(), signal.SIGKILL)
        if self.action in ("kill-self", "kill-both"):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.action == "slow":
            mark = os.environ.get(MARK_ENV)
            if mark:
                Path(mark).touch()
            time.sleep(float(os.environ.get(SLOW_ENV, "2")))
        if self.action in ("enospc", "eio"):
            code = errno.ENOSPC if self.action == "enospc" else errno.EIO
            raise OSError(code, os.strerror(code), str(path))


def parse_faults(spec: str) -> dict[str, Callable[[Path], None]]:
    """Parse ``"point:kind:nth:action[,...]"`` into hooks (one per point).

    ``point`` is one of :data:`FAULT_POINTS`, ``kind`` one of :data:`FAULT_KINDS`,
    ``nth`` counts matching events from 1, and ``action`` is one of :data:`FAULT_ACTIONS`:
    SIGKILL this process, its parent or both, fail with ``ENOSPC`` / ``EIO``, or stall
    (``slow``: create the file ``LOWDIFF_FAULT_MARK`` names, if set, sleep
    ``LOWDIFF_FAULT_SLOW_S`` seconds, default 2, then go on).

    Example:
        >>> sorted(parse_faults("before_rename:records:2:kill-self"))
        ['before_rename']
    """
    hooks: dict[str, Callable[[Path], None]] = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        parts = item.split(":")
        if len(parts) != 4:
            raise ValueError(f"fault {item!r} is not point:kind:nth:action")
        point, kind, nth, action = parts
        if point not in FAULT_POINTS or kind not in FAULT_KINDS or action not in FAULT_ACTIONS:
            raise ValueError(
                f"fault {item!r}: point must be one of {FAULT_POINTS}, kind one of "
                f"{FAULT_KINDS}, action one of {FAULT_ACTIONS}"
            )
        if not nth.isdigit() or int(nth) < 1:
            raise ValueError(f"fault {item!r}: nth must be a positive integer")
        hooks[point] = _Fault(point, kind, int(nth), action)
    return hooks


def install_faults(spec: str) -> None:
    """Replace every installed hook by the faults of ``spec`` (see :func:`parse_faults`)."""
    hooks = parse_faults(spec)
    _HOOKS.clear()
    _HOOKS.update(hooks)


def install_env_faults() -> None:
    """Install exactly the faults ``LOWDIFF_FAULTS`` names (none when it is unset): at
    import, and again in a background process once it has the trainer's environment
    (:func:`lowdiff.proc.spawn.run_in_env`)."""
    install_faults(os.environ.get(FAULT_ENV, ""))


def parent_pid() -> int:
    """The process that started this one: the trainer of a background process (named by
    ``LOWDIFF_PARENT_PID``, since a fork server stands between them), else the parent."""
    return int(os.environ.get(PARENT_ENV) or os.getppid())


install_env_faults()


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
        _hook("before_write", tmp)
        yield f
        f.flush()
        _hook("before_fsync", tmp)
        os.fsync(f.fileno())
        f.close()
        _hook("before_rename", tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
        _hook("after_rename", path)
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

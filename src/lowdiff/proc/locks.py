"""Directory locks: the trainer's lock on a checkpoint directory, and the writer lock
every checkpointing process (and in-memory holder) keeps for as long as it lives.

``flock`` locks go with their process, even a killed one, so a lingering zombie or a
reused pid cannot fool them.
"""

from __future__ import annotations

import fcntl
import gc
import os
import socket
import time
from pathlib import Path

from lowdiff.errors import DirectoryLockedError
from lowdiff.format import layout


def acquire_flock(path: Path, *, blocking: bool) -> int | None:
    """Take an exclusive ``flock`` on ``path``; returns the fd, or None when busy."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid={os.getpid()} host={socket.gethostname()}\n".encode())
    return fd


def lock_directory(root: Path, why: str = "") -> int:
    """Take the trainer's lock on checkpoint directory ``root`` (created if missing);
    returns its fd.

    A lock held in this very process belongs to another ``Checkpointer`` of it: one that
    was dropped without ``close()`` and not collected yet (a reference cycle) lets go once
    the garbage collector runs, so it runs once before the error.

    Raises:
        DirectoryLockedError: another trainer holds it (named by its pid and host), or a
            ``Checkpointer`` of this process still in use (close it first).
    """
    root.mkdir(parents=True, exist_ok=True)
    path = root / layout.LOCK_FILE
    fd = acquire_flock(path, blocking=False)
    if fd is None and _held_here(path):
        gc.collect()
        fd = acquire_flock(path, blocking=False)
    if fd is not None:
        return fd
    if _held_here(path):
        raise DirectoryLockedError(
            f"{root} is in use by another Checkpointer of this process (pid {os.getpid()}); "
            "close() that one first (a Checkpointer is also let go once nothing refers to it)"
        )
    raise DirectoryLockedError(f"{root} is in use by another trainer ({lock_holder(path)}){why}")


def _held_here(path: Path) -> bool:
    """Whether the lock file names this process (on this host) as its holder."""
    return lock_holder(path).split() == [f"pid={os.getpid()}", f"host={socket.gethostname()}"]


def lock_holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "unknown holder"
    except OSError:
        return "unknown holder"


def wait_for_writer(
    root: Path,
    timeout: float,
    who: str = "a checkpointing process",
    *,
    since: float | None = None,
) -> None:
    """Wait until no process holds ``DIR/.lowdiff.writer.lock``: a killed trainer's
    checkpointing process may still be writing (the lock goes with the process, even a
    killed one, so a lingering zombie pid cannot fool it).

    ``since`` (a ``time.monotonic()`` value) is when the caller's whole wait began, for
    the error to tell how long it waited in all; by default, this call's start.

    Raises:
        DirectoryLockedError: still held after ``timeout`` seconds.
    """
    path = root / layout.WRITER_LOCK_FILE
    start = time.monotonic()
    deadline = start + timeout
    while True:
        fd = acquire_flock(path, blocking=False)
        if fd is not None:
            os.close(fd)
            return
        if time.monotonic() > deadline:
            waited = time.monotonic() - (start if since is None else since)
            raise DirectoryLockedError(
                f"{who} ({lock_holder(path)}) is still writing to {root} after {waited:.0f} s"
            )
        time.sleep(0.05)

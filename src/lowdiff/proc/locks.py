"""Directory locks: the trainer's lock on a checkpoint directory, and the writer lock
every checkpointing process (and in-memory holder) keeps for as long as it lives.

``flock`` locks go with their process, even a killed one, so a lingering zombie or a
reused pid cannot fool them.
"""

from __future__ import annotations

import fcntl
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


def lock_holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "unknown holder"
    except OSError:
        return "unknown holder"


def wait_for_writer(root: Path, timeout: float, who: str = "a checkpointing process") -> None:
    """Wait until no process holds ``DIR/.lowdiff.writer.lock``: a killed trainer's
    checkpointing process may still be writing (the lock goes with the process, even a
    killed one, so a lingering zombie pid cannot fool it).

    Raises:
        DirectoryLockedError: still held after ``timeout`` seconds.
    """
    path = root / layout.WRITER_LOCK_FILE
    deadline = time.monotonic() + timeout
    while True:
        fd = acquire_flock(path, blocking=False)
        if fd is not None:
            os.close(fd)
            return
        if time.monotonic() > deadline:
            raise DirectoryLockedError(
                f"{who} ({lock_holder(path)}) is still writing to {root} after {timeout:.0f} s"
            )
        time.sleep(0.05)

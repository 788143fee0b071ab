"""Facts about this machine and its processes, through psutil (one place for all of them).

Every process function takes pids and answers for processes of this user only (the
harness never signals anyone else's), and treats a process that is gone, or that it may
not look into, as having nothing to report.
"""

from __future__ import annotations

import contextlib
import os
import time

import psutil


def total_memory_bytes() -> int:
    """Physical memory of the machine."""
    return int(psutil.virtual_memory().total)


def rss_bytes(pid: int | None = None) -> int | None:
    """Resident memory of ``pid`` (default: this process), or None if it is gone."""
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except (psutil.Error, OSError):
        return None


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (a killed process its parent has not
    reaped yet is dead for every purpose here)."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except (psutil.Error, OSError):
        return False


def _own(p: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error, OSError):
        return bool(p.uids().real == os.getuid())
    return False


def user_pids() -> list[int]:
    """Every process of this user (by real user id)."""
    return [p.pid for p in psutil.process_iter() if _own(p)]


def descendants(pid: int) -> set[int]:
    """Every live process of this user below ``pid`` in the process tree (not ``pid``),
    found through the parent links (a process re-parented away is not found)."""
    try:
        below = psutil.Process(pid).children(recursive=True)
    except (psutil.Error, OSError):
        return set()
    return {p.pid for p in below if _own(p) and alive(p.pid)}


def open_paths(pid: int) -> list[str]:
    """The regular files ``pid`` has open (resolved paths; deleted ones left out)."""
    with contextlib.suppress(psutil.Error, OSError):
        return [f.path for f in psutil.Process(pid).open_files()]
    return []


def mapped_paths(pid: int) -> list[str]:
    """The files ``pid`` has mapped into memory (shared memory segments among them)."""
    with contextlib.suppress(psutil.Error, OSError):
        return [m.path for m in psutil.Process(pid).memory_maps(grouped=True) if m.path]
    return []


def wait_gone(pids: set[int], timeout: float) -> set[int]:
    """Wait until none of ``pids`` is alive; returns those still alive at the timeout."""
    deadline = time.monotonic() + timeout
    left = {p for p in pids if alive(p)}
    while left and time.monotonic() < deadline:
        time.sleep(0.01)
        left = {p for p in left if alive(p)}
    return left


__all__ = [
    "alive",
    "descendants",
    "mapped_paths",
    "open_paths",
    "rss_bytes",
    "total_memory_bytes",
    "user_pids",
    "wait_gone",
]

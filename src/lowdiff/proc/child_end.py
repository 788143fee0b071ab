"""The background process's end of a :class:`lowdiff.proc.link.ProcessLink`.

:class:`ChildEnd` reports ready or failed, serves requests until the trainer closes the
link or dies, and drains what a dead trainer left in the pipe;
:func:`run_checkpointing_process` is the frame every checkpointing process runs in (its
own process group, one thread, a lower priority, the directory's writer lock).
:func:`pid_alive` and :func:`exits_within` tell whether a process (a trainer, a
survivor) is gone.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from lowdiff.format import layout
from lowdiff.proc.locks import acquire_flock
from lowdiff.proc.protocol import Failed, Kind, Message, Ready, decode
from lowdiff.proc.spawn import WORKER_NICE, detach_from_trainer_group


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs (one of another user counts). A zombie does not: a
    killed process whose parent is gone stays one until init reaps it, which a
    container's first process may never do."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True  # no /proc to ask: the signal check stands
    return stat.rsplit(b")", 1)[-1].split()[:1] != [b"Z"]


def exits_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` is gone, or goes within ``seconds``: a process closes its
    descriptors (its pipes report their end) a moment before it is seen dead."""
    deadline = time.monotonic() + seconds
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


class ChildEnd:
    """The background process's end of a :class:`ProcessLink`.

    :meth:`send` may be called from any thread of the process (a writer thread reports
    while the main thread serves requests); a trainer that is gone is not an error here.

    Args:
        requests, results: the connection (one duplex connection may be both).
        trainer_pid: the trainer, when it is not this process's parent (a trainer that
            took the process over: :mod:`lowdiff.proc.takeover_socket`); it is watched by its pid.
        idle: asked whenever no request came for a while; True ends :meth:`serve` as if
            the trainer were gone (the process has its own reason to stop serving).
    """

    def __init__(
        self,
        requests: Connection,
        results: Connection,
        trainer_pid: int | None = None,
        idle: Callable[[], bool] | None = None,
    ) -> None:
        self.requests = requests
        self.results = results
        self.parent = os.getppid()
        self.trainer_pid = trainer_pid
        self._idle = idle
        self._lock = threading.Lock()

    def send(self, msg: Message) -> None:
        with self._lock, contextlib.suppress(OSError):
            self.results.send(msg)

    def ready(self, info: dict[str, Any] | None = None) -> None:
        self.send(Ready(os.getpid(), info))

    def failed(self, exc: BaseException) -> None:
        """Report ``exc`` (call inside its ``except`` block)."""
        self.send(Failed.of(exc))

    def trainer_gone(self) -> bool:
        """Whether the trainer died (this process was re-parented, or the trainer that
        took it over is gone), or :attr:`idle` says to stop serving."""
        if self._idle is not None and self._idle():
            return True
        if self.trainer_pid is not None:
            return not pid_alive(self.trainer_pid)
        return os.getppid() != self.parent

    def close(self) -> None:
        for c in (self.requests, self.results):
            with contextlib.suppress(Exception):
                c.close()

    def serve(self, handle: Callable[[Message], bool], poll_s: float = 0.5) -> bool:
        """Handle requests until ``handle`` returns False (the trainer closed the link:
        returns False) or the trainer is gone (returns True)."""
        while True:
            if not self.requests.poll(poll_s):
                if self.trainer_gone():
                    return True
                continue
            try:
                msg = decode(self.requests.recv_bytes())
            except (EOFError, ConnectionError):
                # the trainer closed its end, or died with replies unread (a socket
                # then reports a reset instead of the end of the stream)
                return True
            if not handle(msg):
                return False

    def drain(self, handle: Callable[[Message], Any], kinds: Iterable[Kind]) -> None:
        """After the trainer died: handle every request of ``kinds`` still in the pipe."""
        want = set(kinds)
        while True:
            try:
                if not self.requests.poll(0):
                    return
                raw = self.requests.recv_bytes()
            except (EOFError, OSError):
                return
            try:
                # apart from recv(): a message that cannot be rebuilt (a shared tensor whose
                # owner is gone raises ConnectionRefusedError, an OSError) must not end the
                # drain as if the pipe were closed; the requests behind it still count
                msg = decode(raw)
            except Exception:  # noqa: BLE001
                continue
            if getattr(msg, "kind", None) in want:
                handle(msg)


def run_checkpointing_process(
    root: Path,
    run: Callable[[], None],
    *,
    report: Callable[[Message], None],
    finish: Callable[[], None] | None = None,
    cleanup: Callable[[], None] | None = None,
    nice: int = WORKER_NICE,
) -> None:
    """The frame every checkpointing process of a directory runs ``run`` in.

    The process takes a process group of its own (:func:`detach_from_trainer_group`),
    one intra-op thread and a lower priority (:data:`WORKER_NICE`: woken while training
    keeps every core busy, it would otherwise preempt a trainer thread, and the rest of
    that thread's OpenMP team would wait for it at the next barrier; docs/benchmarks.md,
    "The checkpointing process's priority"), then holds the directory's writer lock for
    as long as it lives (a baseline's process keeps the trainer's priority: ``nice=0``).
    An exception ends it with status 1 after ``finish()`` (the write
    in flight completes or removes its temp file) and ``report(Failed)`` (the trainer
    raises it again); ``cleanup()`` runs last in every case.
    """
    detach_from_trainer_group()
    torch.set_num_threads(1)
    if nice:
        with contextlib.suppress(OSError):
            os.nice(nice)
    lock_fd = None
    try:
        lock_fd = acquire_flock(root / layout.WRITER_LOCK_FILE, blocking=True)
        run()
    except BaseException as e:  # noqa: BLE001 -- sent back and raised in the trainer
        failed = Failed.of(e)
        if finish is not None:
            with contextlib.suppress(BaseException):
                finish()
        report(failed)
        raise SystemExit(1) from None
    finally:
        if cleanup is not None:
            cleanup()
        if lock_fd is not None:
            os.close(lock_fd)

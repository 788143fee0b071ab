"""The trainer's side of a running background process: what it sent, and whether it lives.

:class:`ProcessConn` holds the pipes of a process that is running, reads its messages
(without blocking: one ``poll(2)`` over the results pipe and the process's sentinel),
raises what it reported (:class:`~lowdiff.proc.protocol.Failed`, as
:class:`lowdiff.CheckpointWorkerError` with the child's traceback) or that it is gone, and
waits for a condition while the process makes progress. It takes over a process started
by this trainer (:meth:`ProcessConn.take_pipes`) or by one that died before it
(:meth:`ProcessConn.attach`, through :class:`RunningProcess`).

Starting the process, its handshake and the requests it is sent are
:class:`lowdiff.proc.link.ProcessLink`'s, which builds on this class.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from collections import Counter
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from lowdiff.errors import CheckpointWorkerError
from lowdiff.proc import channel, preempt
from lowdiff.proc.protocol import Failed, Kind, Message, Ready
from lowdiff.proc.spawn import exit_message


class ProcessConn:
    """The trainer's side of one running background process.

    Args:
        what: how messages name the process (``"the checkpointing process"``).
        stall_timeout: seconds a wait may see no progress of a live process.
        on_message: called with every message the process sends (but ``Failed``, which
            the connection keeps and raises, and ``Ready``).
    """

    def __init__(
        self,
        what: str,
        *,
        stall_timeout: float,
        on_message: Callable[[Message], None] | None = None,
    ) -> None:
        self.what = what
        self.stall_timeout = stall_timeout
        self.on_message = on_message
        self.proc: Any = None
        self.requests: Connection | None = None
        self.results: Connection | None = None
        self.counters: Any = None
        """The trainer's view of the shared counters (:func:`lowdiff.proc.channel.view`)."""
        self.error: CheckpointWorkerError | None = None
        self.replies: Counter[Kind] = Counter()
        self.info: dict[str, Any] | None = None
        """What the process reported with ``Ready``."""
        self._poller: Any = None
        self._sentinel = -1
        self._maybe_gone = True

    def take_pipes(
        self, proc: Any, requests: Connection, results: Connection, counters: Any = None
    ) -> None:
        """Take over a started process's pipes (``requests`` may be ``results``: duplex)."""
        self.proc, self.requests, self.results = proc, requests, results
        self.counters = None if counters is None else channel.view(counters)
        self.error = None
        self.replies = Counter()
        self._poller = select.poll()
        self._poller.register(results.fileno(), select.POLLIN)
        self._sentinel = proc.sentinel
        self._poller.register(self._sentinel, select.POLLIN)
        self._maybe_gone = False

    def attach(
        self,
        pid: int,
        conn: Connection,
        info: dict[str, Any] | None = None,
        counters: Any = None,
    ) -> None:
        """Take over a duplex connection to a running process that this one did not start,
        as a ready process (one that outlived the trainer that started it, reached through
        its socket, which has already answered ``info`` about itself).

        Its liveness is watched through a pidfd (:class:`RunningProcess`); its exit code is
        never known.

        Raises:
            ProcessLookupError: the process is gone.
        """
        self.take_pipes(RunningProcess(pid), conn, conn, counters)
        self.replies[Kind.READY] += 1
        self.info = info

    def _forget(self) -> None:
        """Let go of the process (its pipes are closed by the caller): nothing of it may be
        read, waited for or raised any more."""
        self.proc = None
        self.error = None
        self.info = None
        self.replies = Counter()
        self._poller = None
        self._sentinel = -1
        self._maybe_gone = True

    @property
    def ready(self) -> bool:
        return self.replies[Kind.READY] > 0

    # ------------------------------------------------------------------ receiving
    def poll(self) -> None:
        """Read every message waiting, without blocking (one ``poll(2)`` when none is)."""
        res = self.results
        if res is None or not self._io_ready():
            return
        with preempt.busy():
            try:
                while res.poll():
                    self._handle(res.recv())
            except (EOFError, OSError):
                pass

    def _io_ready(self) -> bool:
        events = self._poller.poll(0)
        if not events:
            return False
        if any(fd == self._sentinel for fd, _ in events):
            self._maybe_gone = True
        return True

    def _handle(self, msg: Message) -> None:
        self.replies[msg.kind] += 1
        if isinstance(msg, Failed):
            if self.error is None:
                self.error = CheckpointWorkerError(
                    f"{self.what} failed: {msg.name}: {msg.text}", msg.traceback, msg.storage
                )
        elif isinstance(msg, Ready):
            self.info = msg.info
        elif self.on_message is not None:
            self.on_message(msg)

    def check(self, force: bool = False) -> None:
        """Raise what the process reported, or that it is gone (``force``: the pipe closed)."""
        self.poll()
        if self.error is not None:
            raise self.error
        proc = self.proc
        if proc is not None and self._maybe_gone and not proc.is_alive():
            self.poll()  # an error it sent just before exiting
            if self.error is not None:
                raise self.error
            raise CheckpointWorkerError(exit_message(self.what, proc, ready=self.ready))
        if force:
            raise CheckpointWorkerError(f"{self.what} closed its connection")

    # ------------------------------------------------------------------ waiting
    def _wait(
        self,
        ready: Callable[[], bool],
        what: str,
        timeout: float | None,
        check: Callable[[], None] | None,
    ) -> None:
        """Wait until ``ready()`` while the process lives and makes progress (see
        :func:`lowdiff.proc.channel.wait_until`); ``check`` defaults to :meth:`check`."""
        channel.wait_until(
            ready,
            proc=self.proc,
            results=self.results,
            progress=self.progress,
            check=check or self.check,
            stall_timeout=self.stall_timeout,
            what=what,
            deadline=None if timeout is None else time.monotonic() + timeout,
            who=self.what,
        )

    def progress(self) -> int:
        """Grows whenever the process makes progress: its ``BEAT`` counter, or (for a
        process that keeps no counters) the messages it sent."""
        if self.counters is not None:
            return int(self.counters[channel.BEAT])
        return sum(self.replies.values())


class RunningProcess:
    """A running process that this one did not start, watched the way a
    ``multiprocessing.Process`` child is: :attr:`sentinel` (a pidfd) turns readable when
    it exits. See :meth:`ProcessConn.attach`.

    Raises:
        ProcessLookupError: the process is gone already.
    """

    exitcode: int | None = None
    """Never known: only a process's parent learns its exit status."""
    sentinel: int = -1

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.sentinel = os.pidfd_open(pid)

    def is_alive(self) -> bool:
        return not select.select([self.sentinel], [], [], 0)[0]

    def join(self, timeout: float | None = None) -> None:
        select.select([self.sentinel], [], [], timeout)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self.sentinel, signal.SIGKILL)

    def __del__(self) -> None:
        if self.sentinel >= 0:
            with contextlib.suppress(OSError):
                os.close(self.sentinel)

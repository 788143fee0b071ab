"""One link between a trainer and a background process, written once for every process.

The trainer's end is :class:`ProcessLink`: it starts the process (see
:mod:`lowdiff.proc.spawn`), waits for its :class:`~lowdiff.proc.protocol.Ready`, sends
requests, reads replies, and watches the process while it waits: a dead process is an
error at once, a live one is waited for while it makes progress (its ``BEAT`` counter,
see :mod:`lowdiff.proc.channel`), and only ``stall_timeout`` seconds without progress end
a wait. An error the process reports (:class:`~lowdiff.proc.protocol.Failed`) is raised
again in the trainer as :class:`lowdiff.CheckpointWorkerError`, with the child's traceback.
Reading the replies and watching the process are :class:`lowdiff.proc.conn.ProcessConn`'s,
which the link extends with the start, the handshake and the requests.

The process's end is :class:`lowdiff.proc.child_end.ChildEnd`: it reports ready or
failed, serves requests until the trainer closes it or dies, and drains what a dead
trainer left in the pipe.

Used by LowDiff's writer, LowDiff+'s replica and the baselines' processes.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from lowdiff.errors import CheckpointWorkerError, DurabilityWarning
from lowdiff.proc import preempt
from lowdiff.proc.conn import ProcessConn
from lowdiff.proc.protocol import Kind, Message, encode
from lowdiff.proc.spawn import forget_child, process_context, run_in_env, trainer_env

EARLY_BYTES = 32 << 10
"""Most bytes of requests written before the process is ready: half a pipe's default
capacity (64 KiB on Linux), so that writing them never blocks."""


class _Start:
    """One ``multiprocessing.Process.start()`` (run here, or on a thread of its own), with
    the pipes made for the process and what the start raised."""

    def __init__(self, proc: Any, pipes: tuple[Connection, ...], counters: Any) -> None:
        self.proc, self.pipes, self.counters = proc, pipes, counters
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self.run, name="lowdiff-process-start", daemon=True)

    def run(self) -> None:
        try:
            self.proc.start()
        except BaseException as e:  # noqa: BLE001 -- raised where the start is taken up
            self.error = e
        else:
            # lowdiff ends its processes itself (close(), or a next trainer takes one
            # over); the interpreter's exit must never wait for one (spawn.forget_child)
            forget_child(self.proc)

    def close_all(self) -> None:
        for c in self.pipes:
            with contextlib.suppress(OSError):
                c.close()


class ProcessLink(ProcessConn):
    """The trainer's end of one background process: a :class:`ProcessConn` that also
    starts the process, waits for its ``Ready`` and sends it requests.

    Args:
        what: how messages name the process (``"the checkpointing process"``).
        stall_timeout: seconds a wait may see no progress of a live process.
        start_timeout: seconds to wait for the process to report ready.
        on_message: called with every message the process sends (but ``Failed``, which
            the link keeps and raises, and ``Ready``).
    """

    def __init__(
        self,
        what: str,
        *,
        stall_timeout: float,
        start_timeout: float,
        on_message: Callable[[Message], None] | None = None,
    ) -> None:
        super().__init__(what, stall_timeout=stall_timeout, on_message=on_message)
        self.start_timeout = start_timeout
        self._await_ready = False
        self._starting: _Start | None = None
        """A start running on a thread (``start(background=True)``), not yet taken up."""
        self._early_bytes = 0
        """Bytes of early requests written before the process was ready."""

    # ------------------------------------------------------------------ start
    def start(
        self,
        target: Callable[..., None],
        args: tuple[Any, ...],
        *,
        name: str,
        counters: Any = None,
        wait: bool = True,
        background: bool = False,
    ) -> None:
        """Start ``target(*args, requests, results)`` in a new process; wait until ready.

        ``counters`` is the shared counter tensor the process writes (its ``BEAT`` tells a
        slow process from a stuck one); without it, waits watch liveness and messages only.
        ``wait=False`` waits for the process to be ready only when it is first needed: the
        first request sent or the first wait (:meth:`ensure_ready`); its start (taking its
        locks) overlaps with what the trainer does until then. ``background=True`` (with
        ``wait=False``) also asks the fork server for the process on a thread (a fork of
        the server and a few messages, some ms): until then only early requests
        (:meth:`send` with ``early=True``) go out, into the pipe the process will read.
        """
        self.launch(target, args, name=name, counters=counters, background=background)
        self._await_ready = True
        if wait:
            self.ensure_ready()

    def ensure_ready(
        self, check: Callable[[], None] | None = None, timeout: float | None = None
    ) -> None:
        """Wait until a process started with ``start(wait=False)`` is ready (at once for
        any other); ``timeout`` shortens ``start_timeout`` (a wait with a deadline)."""
        limit = self.start_timeout if timeout is None else min(self.start_timeout, timeout)
        self.finish_start(timeout=limit)
        if self._await_ready:
            self._wait(lambda: self.ready, repr(Kind.READY.value), limit, check)
            self._await_ready = False
            self._early_bytes = 0

    def launch(
        self,
        target: Callable[..., None],
        args: tuple[Any, ...],
        *,
        name: str,
        counters: Any = None,
        background: bool = False,
    ) -> None:
        """:meth:`start` without the wait: the process starts up (imports torch, takes its
        locks) while the trainer goes on, and :attr:`ready` tells when it is done; a
        caller that needs it waits with ``wait(lambda: link.ready, ...)``."""
        ctx = process_context()  # here: it may start the fork server (a fork of this process)
        self._forget_process()
        req_r, req_w = ctx.Pipe(duplex=False)
        res_r, res_w = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=run_in_env,
            args=(
                trainer_env(),
                target,
                *args,
                req_r,
                res_w,
            ),
            name=name,
            daemon=False,
        )
        start = _Start(proc, (req_r, req_w, res_r, res_w), counters)
        if background:
            self.requests = req_w  # early requests wait in the pipe for the process
            self._starting = start
            start.thread.start()
            return
        start.run()
        self._take_up(start)

    def _forget_process(self) -> None:
        """Let go of the process served before (released by its caller: a new one is
        started): nothing of it may be read, waited for or raised while the new one is
        still starting."""
        self.close_pipes()
        self._forget()

    def finish_start(self, block: bool = True, timeout: float | None = None) -> None:
        """Take up the process a thread asked the fork server for (waits for that, up to
        ``timeout``, by default ``start_timeout``; at once when none is being started).
        ``block=False`` takes it up only if the thread is done already, and otherwise
        leaves it starting."""
        start = self._starting
        if start is None or (not block and start.thread.is_alive()):
            return
        self._starting = None
        limit = self.start_timeout if timeout is None else timeout
        start.thread.join(limit)
        if start.thread.is_alive():
            start.close_all()
            self.requests = None
            raise CheckpointWorkerError(
                f"{self.what} did not start within {limit:.3g} s (the process server did "
                "not answer)"
            )
        self._take_up(start)
        self._await_ready = True  # (take_pipes() cleared it) its Ready is still to be seen

    def _take_up(self, start: _Start) -> None:
        if start.error is not None:
            # e.g. the server refusing: nothing runs, so nothing may be waited for or
            # talked to
            start.close_all()
            self.requests = None
            raise start.error
        req_r, req_w, res_r, res_w = start.pipes
        req_r.close()
        res_w.close()
        self.take_pipes(start.proc, req_w, res_r, start.counters)

    def take_pipes(
        self, proc: Any, requests: Connection, results: Connection, counters: Any = None
    ) -> None:
        """Take over a started process's pipes (see :meth:`ProcessConn.take_pipes`); its
        ``Ready`` is no longer waited for by :meth:`ensure_ready`."""
        super().take_pipes(proc, requests, results, counters)
        self._await_ready = False

    @property
    def started(self) -> bool:
        return self.proc is not None or self._starting is not None

    # ------------------------------------------------------------------ messages
    def send(self, msg: Message, early: bool = False) -> None:
        """Send a request; a closed pipe raises why the process is gone.

        ``early``: a request that may go before the process is ready (the full checkpoint
        that starts it, the records of the first steps): it waits in the pipe, as long as
        the pipe surely has room for it (:data:`EARLY_BYTES` in all), so that a process
        slow to start cannot block it. A start that has failed meanwhile raises here.
        """
        assert self.requests is not None, f"{self.what} is not started"
        with preempt.busy():
            buf = encode(msg)
            if self._starting is not None:
                self.finish_start(block=False)  # a start that failed raises here
            if not early or self._early_bytes + len(buf) > EARLY_BYTES:
                self.ensure_ready()
            elif self._starting is not None or self._await_ready:
                self._early_bytes += len(buf)
            try:
                self.requests.send_bytes(buf)
            except (BrokenPipeError, ConnectionResetError, OSError):
                self.finish_start()
                self.check(force=True)

    # ------------------------------------------------------------------ waits
    def wait(
        self,
        ready: Callable[[], bool],
        what: str,
        timeout: float | None = None,
        check: Callable[[], None] | None = None,
    ) -> None:
        """Wait until ``ready()`` while the process lives and makes progress.

        ``check`` (default :meth:`check`) runs on every wake-up and raises what the
        process reported. With ``timeout``, the wait ends there, progress or not.
        """
        assert self.started, f"{self.what} is not started"
        with preempt.busy():
            self.ensure_ready(check)
            self._wait(ready, what, timeout, check)

    def request(
        self,
        msg: Message,
        reply: Kind,
        *,
        timeout: float | None = None,
        what: str | None = None,
        check: Callable[[], None] | None = None,
    ) -> None:
        """Send ``msg`` and wait for its ``reply`` (``timeout``: the wait for the reply ends
        there; ``what`` names it in errors). A process still starting is taken up and
        ready first (within ``timeout`` too): its replies are counted from then on."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.ensure_ready(check, timeout)
        seen = self.replies[reply]
        self.send(msg)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.wait(lambda: self.replies[reply] > seen, what or repr(reply.value), left, check)

    # ------------------------------------------------------------------ the end
    def join(self) -> bool:
        """Wait for the process to exit (it was told to, or it failed and finishes what it
        was writing) as long as it makes progress; False (and a warning) if it stalls."""
        self.finish_start()
        proc = self.proc
        if proc is None:
            return True
        beat, since = self.progress(), time.monotonic()
        while proc.is_alive():
            proc.join(0.05)
            self.poll()
            b = self.progress()
            if b != beat:
                beat, since = b, time.monotonic()
            elif time.monotonic() - since > self.stall_timeout:
                warnings.warn(
                    f"lowdiff: {self.what} (pid {proc.pid}) made no progress for "
                    f"{self.stall_timeout:.0f} s after it was told to stop; leaving it running "
                    "(the next session waits for it before touching the directory)",
                    DurabilityWarning,
                    stacklevel=3,
                )
                return False
        return True

    def stop(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` (default ``start_timeout``) for the process to exit, kill
        it if it does not, and drop the pipes."""
        with contextlib.suppress(Exception):
            self.finish_start()
        proc = self.proc
        if proc is not None:
            proc.join(self.start_timeout if timeout is None else timeout)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.close_pipes()
        self.proc = None

    def close_pipes(self) -> None:
        """Drop the pipes; a process still running reads the end of its requests."""
        with contextlib.suppress(Exception):
            self.finish_start()
        for c in (self.requests, self.results):
            if c is not None:
                with contextlib.suppress(OSError):
                    c.close()
        self.requests = self.results = None

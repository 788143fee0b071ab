"""The trainer's side of one checkpointing process: its link, counters and slots.

A :class:`ProcessSession` starts LowDiff's writer or LowDiff+'s replica over the one
process link of :mod:`lowdiff.proc.link`, makes the shared record slots and progress
counters, and turns what the process reports (messages and counters) into the session's
durable step and ``ck.stats``. Every wait goes through :meth:`ProcessSession.wait`,
which raises what the process reported, or that it is gone, or that it stalled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from lowdiff.engine.core import EngineCore
from lowdiff.engine.messages import Durable, FullDone, RemoteError
from lowdiff.engine.slots import RecordSlots
from lowdiff.errors import RemoteStorageError
from lowdiff.proc import adopt, channel
from lowdiff.proc import holder as rp
from lowdiff.proc.link import ProcessLink
from lowdiff.proc.protocol import Closed, Flushed, Kind, Message, Ready, Refused

WHAT = "the checkpointing process"


def remote_stalled(url: str, timeout: float, core: EngineCore) -> str:
    """Why the remote tier is behind, for :class:`lowdiff.RemoteStorageError`."""
    why = core.remote_error or "no error reported (uploads too slow?)"
    return (
        f"the remote tier {url} made no progress for {timeout:g} s: it can recover step "
        f"{core.remote_durable}, the local tier step {core.durable}. Last failure: {why}. "
        "The local tier is not affected."
    )


@dataclasses.dataclass
class Accepted:
    """A surviving process's yes to a trainer's request to take it over: the connection,
    its ``Ready``, and the record slots and counters it made (and the staging buffer,
    when it made one), attached here."""

    conn: Connection
    reply: Ready
    segments: tuple[Any, ...]

    def give_up(self) -> None:
        """Not used after all: close the connection (the process, let go by a live
        trainer, exits once it has persisted) and this process's mappings."""
        adopt.close_quietly(self.conn)
        for shm in self.segments:
            with contextlib.suppress(Exception):
                shm.close()


def ask_to_take_over(published: dict[str, Any], request: Message, timeout: float) -> Accepted | str:
    """Ask a checkpointing process that outlived its trainer to serve this one: connect
    with what its control block ``published``, send ``request``, and wait up to ``timeout``
    seconds for its answer. Touches no session, so it may run on a thread of its own.

    Returns:
        its :class:`Accepted` answer, or why it did not accept (it did not answer, or
        refused; it then still waits for a trainer).
    """
    try:
        conn = adopt.connect(published)
    except OSError as e:
        return f"it does not answer ({e})"
    try:
        conn.send(request)
        if not conn.poll(timeout):
            raise EOFError(f"no answer within {timeout:g} s")
        reply = conn.recv()
        if isinstance(reply, Refused):
            raise EOFError(f"it refused: {reply.reason}")
        if not isinstance(reply, Ready) or not reply.info:
            raise EOFError(f"it answered {type(reply).__name__}")
        names = [str(reply.info["slots"]), str(reply.info["counters"])]
        if "staging" in reply.info:
            names.append(str(reply.info["staging"]))
        segments: list[Any] = []
        try:
            for name in names:
                segments.append(rp.attach_segment(name))
        except BaseException:
            for shm in segments:
                shm.close()
            raise
    except (EOFError, OSError, KeyError, ValueError) as e:
        adopt.close_quietly(conn)  # a process that said yes is orphaned again
        return str(e)
    if len(segments) > 2:
        # the staging buffer (its pages allocated by the process), mapped here on the
        # thread of an early request while the trainer recovers from disk, rather than
        # page by page by the first full checkpoint's copy. (The slots are not: the
        # first steps map them faster than a populate racing the trainer's resume.)
        rp.populate(segments[2])
    return Accepted(conn, reply, tuple(segments))


class EarlyAnswer:
    """:func:`ask_to_take_over` on a thread of its own: the request goes out now, and the
    answer is waited for (:meth:`result`) once the trainer needs it."""

    def __init__(self, published: dict[str, Any], request: Message, timeout: float) -> None:
        self._answer: Accepted | str = "no answer"
        self._timeout = timeout
        self._thread = threading.Thread(
            target=self._ask, args=(published, request), daemon=True, name="lowdiff-takeover"
        )
        self._thread.start()

    def _ask(self, published: dict[str, Any], request: Message) -> None:
        try:
            self._answer = ask_to_take_over(published, request, self._timeout)
        except Exception as e:  # noqa: BLE001 -- reported as why it was not taken over
            self._answer = f"asking failed: {e!r}"

    def result(self) -> Accepted | str:
        self._thread.join(self._timeout + 5.0)
        if self._thread.is_alive():
            return f"no answer within {self._timeout:g} s"
        return self._answer


class ProcessSession:
    """One checkpointing process of a session (a new one after a storage error).

    Args:
        core: the session's training objects and counters.
        start_timeout, stall_timeout: see :class:`lowdiff.Checkpointer`.
        check: raises what the process reported (the storage-error policy wraps the
            link's own check); called on every wake-up of every wait.
        tuner: the ``"auto"`` planner fed with the process's costs, or None.
    """

    def __init__(
        self,
        core: EngineCore,
        *,
        start_timeout: float,
        stall_timeout: float,
        tuner: Any = None,
    ) -> None:
        self.core = core
        self.tuner = tuner
        self.link = ProcessLink(
            WHAT,
            stall_timeout=stall_timeout,
            start_timeout=start_timeout,
            on_message=self._on_message,
        )
        self.check: Callable[[], None] = self.check_link
        """Raises what the process reported; the storage-error policy may replace it."""
        self.slots: RecordSlots | None = None
        self.counters: Any = None
        self.segments: tuple[Any, ...] = ()
        """The named shared memory of a process this trainer took over (slots, counters,
        staging buffer)."""
        self.staging: torch.Tensor | None = None
        """The staging buffer that a process this trainer took over made (and uses for
        its full checkpoints until it is sent another), or None."""
        self._records_seen = (0, 0, 0, 0)
        self._merges_seen = (0, 0)

    # ------------------------------------------------------------------ start
    def launch(self, target: Callable[..., None], cfg: Any, n_slots: int) -> None:
        """Make ``n_slots`` record slots and fresh counters and start ``target``; the
        first request or wait waits until it is ready (its start, asked of the fork server
        on a thread, overlaps with the trainer's work until then: the first full
        checkpoint is staged and sent early)."""
        if self.slots is not None:
            self.slots.release()
        self._drop_segments()
        self.slots = RecordSlots(self.core, n_slots)
        ctr = channel.new_counters()
        self.counters = channel.view(ctr)
        self._records_seen = (0, 0, 0, 0)
        self._merges_seen = (0, 0)
        self.link.start(
            target,
            (cfg, self.slots.tensor, ctr),
            name="lowdiff-checkpointing",
            counters=ctr,
            wait=False,
            background=True,
        )

    def adopt(self, published: dict[str, Any], request: Message) -> str:
        """Take over a checkpointing process that outlived its trainer
        (:mod:`lowdiff.proc.adopt`): connect with what its control block ``published``,
        send ``request`` and, when it answers ``Ready``, use the slots and counters it made.

        Returns:
            '' once the process serves this trainer; otherwise why not (the process
            did not answer, or refused), and nothing changed here.
        """
        return self.attach_accepted(ask_to_take_over(published, request, self.link.start_timeout))

    def attach_accepted(self, answer: Accepted | str) -> str:
        """Serve this trainer with the process whose ``Ready`` is ``answer`` (from
        :func:`ask_to_take_over`); a string (why it did not accept) is returned as is."""
        if isinstance(answer, str):
            return answer
        info = answer.reply.info
        assert info is not None
        n, row = int(info["n_slots"]), int(info["row_bytes"])
        if self.slots is not None:
            self.slots.release()
        self._drop_segments()
        slots_shm, ctr_shm, *stage = answer.segments
        self.slots = RecordSlots(self.core, n, rp.segment_tensor(slots_shm, n * row).view(n, row))
        self.staging = rp.segment_tensor(stage[0], int(info["staging_bytes"])) if stage else None
        ctr = torch.frombuffer(ctr_shm.buf, dtype=torch.int64, count=channel.N_COUNTERS)
        self.segments = answer.segments
        self.counters = channel.view(ctr)
        self._records_seen = (0, 0, 0, 0)
        self._merges_seen = (0, 0)
        self.link.attach(answer.reply.pid, answer.conn, info, counters=ctr)
        return ""

    @property
    def started(self) -> bool:
        return self.link.started

    @property
    def process(self) -> Any:
        """The checkpointing process (``multiprocessing.Process``), or None."""
        self.link.finish_start()
        return self.link.proc

    # ------------------------------------------------------------------ progress
    def poll(self) -> None:
        """Read what the process sent and its counters (one system call when idle)."""
        if self.link.results is None:
            return
        self.link.poll()
        self._read_counters()

    def check_link(self) -> None:
        """Read what the process reported; raise its error, or that it is gone."""
        if self.counters is not None:
            self._read_counters()
        self.link.check()

    def _on_message(self, msg: Message) -> None:
        core, stats = self.core, self.core.stats
        match msg:
            case Durable(step=step) | Flushed(durable=step) | Closed(durable=step):
                core.durable = max(core.durable, int(step))
            case RemoteError(text=text):
                core.remote_error = text
            case FullDone(nbytes=nbytes, seconds=seconds):
                stats["fulls_written"] += 1
                stats["full_bytes"] += nbytes
                stats["full_write_s"] += seconds
                if self.tuner is not None:
                    self.tuner.observe_full(nbytes, seconds)

    def _read_counters(self) -> None:
        """What the process reports through the shared counters: the durable step, and
        the record files written since the last read."""
        c, core = self.counters, self.core
        durable = int(c[channel.DURABLE]) - 1
        if durable > core.durable:
            core.durable = durable
        remote = int(c[channel.REMOTE_DURABLE]) - 1
        if remote > core.remote_durable:
            core.remote_durable = remote
        merges = int(c[channel.REPLICA_MERGES])
        if merges != self._merges_seen[0]:  # LowDiff+: steps merged, and their time
            ns = int(c[channel.REPLICA_MERGE_NS])
            core.stats["replica_merges"] += merges - self._merges_seen[0]
            core.stats["replica_merge_s"] += (ns - self._merges_seen[1]) / 1e9
            self._merges_seen = (merges, ns)
        files = int(c[channel.RECORD_FILES])
        seen = self._records_seen
        if files == seen[0]:
            return
        now = (files, int(c[channel.RECORDS]), int(c[channel.RECORD_BYTES]),
               int(c[channel.RECORD_WRITE_NS]))  # fmt: skip
        n_files, n_records, n_bytes, ns = (a - b for a, b in zip(now, seen, strict=True))
        self._records_seen = now
        stats = core.stats
        stats["record_files_written"] += n_files
        stats["records_written"] += n_records
        stats["record_bytes"] += n_bytes
        stats["record_write_s"] += ns / 1e9
        if self.tuner is not None:
            for _ in range(n_files):  # the files since the last read, as their average
                self.tuner.observe_record_file(
                    n_records / n_files, n_bytes / n_files, ns / 1e9 / n_files
                )

    # ------------------------------------------------------------------ requests and waits
    def send(self, msg: Message, early: bool = False) -> None:
        """Send a request (``early``: it may wait in the pipe for a process still
        starting, see :meth:`lowdiff.proc.link.ProcessLink.send`)."""
        self.link.send(msg, early)

    def wait(self, ready: Callable[[], bool], what: str, timeout: float | None = None) -> None:
        """Wait until ``ready()`` while the process lives and makes progress."""
        self.link.wait(ready, what, timeout, check=self.check)

    def request(self, msg: Message, reply: Kind) -> None:
        """Send ``msg`` and wait for its ``reply``."""
        self.link.request(msg, reply, check=self.check)

    def take_slot(self, what: str) -> int:
        """A free record slot (waiting while the process holds them all)."""
        assert self.slots is not None
        return self.slots.take(self.wait, self.counters, what)

    def wait_remote(self, step: int, timeout: float, url: str) -> None:
        """Wait until the remote tier can recover ``step``, while the process lives and
        its uploads make progress (``REMOTE_BEAT``) within ``timeout`` seconds; raises
        :class:`lowdiff.RemoteStorageError` naming the last failure otherwise."""
        core = self.core
        beat, since, pause = -1, time.monotonic(), 0.001
        while True:
            self.check()
            if core.remote_durable >= step:
                return
            b = self.counter(channel.REMOTE_BEAT)
            now = time.monotonic()
            if b != beat:
                beat, since = b, now
            elif now - since > timeout:
                raise RemoteStorageError(remote_stalled(url, timeout, core))
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def counter(self, index: int) -> int:
        return int(self.counters[index])

    # ------------------------------------------------------------------ the end
    def join(self) -> None:
        """Wait for the process to exit as long as it makes progress."""
        self.link.join()

    def stop(self, timeout: float | None = None) -> None:
        """Wait for a process that reported an error to exit; drop its pipes."""
        self.link.error = None
        self.link.stop(timeout)

    def release(self) -> None:
        """Drop the pipes (a process still running flushes what it has and exits) and
        unpin the slots."""
        if self.slots is not None:
            self.slots.release()
        self.link.close_pipes()
        self._drop_segments()

    def _drop_segments(self) -> None:
        self.staging = None
        for shm in self.segments:
            with contextlib.suppress(Exception):
                shm.close()  # the process unlinks them; a view still held keeps its mapping
        self.segments = ()

"""The trainer's side of one checkpointing process: its link, counters and slots.

A :class:`ProcessSession` starts LowDiff's writer or LowDiff+'s replica over the one
process link of :mod:`lowdiff.proc.link` (or attaches one taken over,
:mod:`lowdiff.engine.trainer.takeover`), makes the shared record slots and progress
counters, and turns what the process reports (messages and counters) into the session's
:class:`~lowdiff.engine.trainer.progress.Progress`. Every wait goes through
:meth:`ProcessSession.wait`, which raises what the process reported, or that it is gone,
or that it stalled.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from lowdiff.engine.trainer.progress import Progress
from lowdiff.engine.trainer.slots import RecordSlots
from lowdiff.engine.trainer.training import TrainingObjects
from lowdiff.engine.wire.messages import Durable, FullDone, RemoteError
from lowdiff.errors import RemoteStorageError
from lowdiff.proc import channel
from lowdiff.proc import holder as rp
from lowdiff.proc.link import ProcessLink
from lowdiff.proc.protocol import Closed, Flushed, Kind, Message, Ready

WHAT = "the checkpointing process"


def remote_stalled(url: str, timeout: float, progress: Progress) -> str:
    """Why the remote tier is behind, for :class:`lowdiff.RemoteStorageError`."""
    why = progress.remote_error or "no error reported (uploads too slow?)"
    return (
        f"the remote tier {url} made no progress for {timeout:g} s: it can recover step "
        f"{progress.remote_durable}, the local tier step {progress.durable}. Last failure: "
        f"{why}. The local tier is not affected."
    )


class ProcessSession:
    """One checkpointing process of a session (a new one after a storage error).

    Args:
        objects: the training objects (the slots' layout).
        progress: what the process's reports update.
        start_timeout, stall_timeout: see :class:`lowdiff.Checkpointer`.
    """

    def __init__(
        self,
        objects: TrainingObjects,
        progress: Progress,
        *,
        start_timeout: float,
        stall_timeout: float,
    ) -> None:
        self.objects, self.progress = objects, progress
        self.tuner: Any = None
        """The ``"auto"`` planner fed with the process's costs, or None."""
        self.link = ProcessLink(
            WHAT,
            stall_timeout=stall_timeout,
            start_timeout=start_timeout,
            on_message=self._on_message,
        )
        self.check: Callable[[], None] = self.check_link
        """Raises what the process reported (called on every wake-up of every wait); the
        storage-error policy replaces it with its own, which wraps :meth:`check_link`."""
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
        self.slots = RecordSlots(self.objects, n_slots)
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

    def attach_takeover(self, conn: Connection, reply: Ready, segments: tuple[Any, ...]) -> None:
        """Serve this trainer with a process taken over (its ``reply`` on ``conn``, and
        the ``segments`` it made, attached here: slots, counters, and its staging buffer
        when it made one; see :mod:`lowdiff.engine.trainer.takeover`)."""
        info = reply.info
        assert info is not None
        n, row = int(info["n_slots"]), int(info["row_bytes"])
        if self.slots is not None:
            self.slots.release()
        self._drop_segments()
        slots_shm, ctr_shm, *stage = segments
        self.slots = RecordSlots(
            self.objects, n, rp.segment_tensor(slots_shm, n * row).view(n, row)
        )
        self.staging = rp.segment_tensor(stage[0], int(info["staging_bytes"])) if stage else None
        ctr = torch.frombuffer(ctr_shm.buf, dtype=torch.int64, count=channel.N_COUNTERS)
        self.segments = segments
        self.counters = channel.view(ctr)
        self._records_seen = (0, 0, 0, 0)
        self._merges_seen = (0, 0)
        self.link.attach(reply.pid, conn, info, counters=ctr)

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
        progress, stats = self.progress, self.progress.stats
        match msg:
            case Durable(step=step) | Flushed(durable=step) | Closed(durable=step):
                progress.saw_durable(step)
            case RemoteError(text=text):
                progress.saw_remote_error(text)
            case FullDone(nbytes=nbytes, seconds=seconds):
                stats["fulls_written"] += 1
                stats["full_bytes"] += nbytes
                stats["full_write_s"] += seconds
                if self.tuner is not None:
                    self.tuner.observe_full(nbytes, seconds)

    def _read_counters(self) -> None:
        """What the process reports through the shared counters: the durable step, and
        the record files written since the last read."""
        c, progress = self.counters, self.progress
        progress.saw_durable(int(c[channel.DURABLE]) - 1)
        progress.saw_remote_durable(int(c[channel.REMOTE_DURABLE]) - 1)
        merges = int(c[channel.REPLICA_MERGES])
        if merges != self._merges_seen[0]:  # LowDiff+: steps merged, and their time
            ns = int(c[channel.REPLICA_MERGE_NS])
            progress.stats["replica_merges"] += merges - self._merges_seen[0]
            progress.stats["replica_merge_s"] += (ns - self._merges_seen[1]) / 1e9
            self._merges_seen = (merges, ns)
        files = int(c[channel.RECORD_FILES])
        seen = self._records_seen
        if files == seen[0]:
            return
        now = (files, int(c[channel.RECORDS]), int(c[channel.RECORD_BYTES]),
               int(c[channel.RECORD_WRITE_NS]))  # fmt: skip
        n_files, n_records, n_bytes, ns = (a - b for a, b in zip(now, seen, strict=True))
        self._records_seen = now
        stats = progress.stats
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
        progress = self.progress
        beat, since, pause = -1, time.monotonic(), 0.001
        while True:
            self.check()
            if progress.remote_durable >= step:
                return
            b = self.counter(channel.REMOTE_BEAT)
            now = time.monotonic()
            if b != beat:
                beat, since = b, now
            elif now - since > timeout:
                raise RemoteStorageError(remote_stalled(url, timeout, progress))
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

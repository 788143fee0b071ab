"""LowDiff's writer: the checkpointing process of ``method="lowdiff"``.

It is started by the trainer (:mod:`lowdiff.engine.trainer.writer_backend`) and talks to
it over two pipes. The call sequence:

0) (trainer) creates the shared record slots, the shared progress counters
   (:mod:`lowdiff.proc.channel`) and the pipes, starts this process.
1) (writer) takes the directory's writer lock, publishes its descriptor and control
   block (:mod:`lowdiff.engine.process.takeover`), state RUNNING.
2) (trainer, every step) waits for a free slot, writes the record row into it (from a
   device: a copy into the pinned host slot, finished before the message is sent) and
   sends :class:`~lowdiff.engine.wire.messages.Record`. (writer) copies the row into its
   batch buffer, counts the slot as consumed, and after ``batch_size`` records writes
   them as one file.
3) (trainer, every ``full_every`` steps) copies the state into the shared staging
   buffer and sends :class:`~lowdiff.engine.wire.messages.Full`; a thread of this
   process writes it while records keep flowing, then counts the staging buffer as
   released and applies retention.
4) (trainer) ``Flush`` / ``Close``: write the partial batch, wait for the full
   checkpoint in flight, answer with the durable step. ``Close`` also ends the process.
5) (trainer, ``batch_size="auto"``) ``BatchSize(b)``: write the partial batch, then
   batch ``b`` records per file.

When the trainer dies without ``close`` (its end of the pipe closes, or this process is
re-parented), the writer lets go of the trainer's standard streams (its output goes to
``DIR/.lowdiff.replica.log``), drains every record already sent, writes them and
finishes the full checkpoint in flight. Then, instead of exiting, it offers itself to
the next trainer for up to ``idle_timeout`` seconds (a takeover,
:mod:`lowdiff.engine.process.takeover`): state ORPHANED, the durable step, and the
address of its socket. A new trainer that recovered from disk to the same step sends
its ``WriterConfig``; the writer checks run, layout, record row, directory, retention,
remote tier and step, takes the new ``b``, and serves it with new record slots, counters
and a staging buffer as large as the dead trainer's, made while it waited. SIGTERM, or
``idle_timeout`` with no trainer, ends it: uploads are drained, its segments unlinked,
its descriptor removed.

Every error is sent back to the trainer with its traceback and raised there on its next
call; the full checkpoint in flight is finished (or its temp file removed) before the
error is sent and the process exits. No lock is shared with the trainer: flow control
and progress go through counters in shared memory that only this process writes, so a
process killed at any moment can never leave the other one blocked (see
:mod:`lowdiff.proc.channel`).
"""

from __future__ import annotations

import dataclasses
import signal
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from lowdiff.engine.process.remote import announce
from lowdiff.engine.process.takeover import ProcessTakeover, request_mismatch
from lowdiff.engine.wire.configs import WriterConfig
from lowdiff.engine.wire.messages import TakeoverRequest
from lowdiff.engine.writer.writer import Writer
from lowdiff.errors import LowDiffError
from lowdiff.format import layout
from lowdiff.proc import holder as rp
from lowdiff.proc.channel import DURABLE, Counters
from lowdiff.proc.child_end import ChildEnd, exits_within, run_checkpointing_process
from lowdiff.proc.protocol import Kind
from lowdiff.proc.spawn import release_trainer_stdio
from lowdiff.proc.takeover_socket import TrainerSegments

CTL_BYTES = 64 << 10
"""The writer's control block: a header and a short JSON document."""

_MATCH = ("run_id", "layout_id", "row_bytes", "keep_full", "remote")
"""What a new trainer's ``WriterConfig`` must share with the writer's."""

TRAINER_EXIT_S = 2.0
"""How long a trainer whose end of the pipes closed may take to be seen dead (it closes
them as it exits) before the writer takes it for one that let go of it and lives on."""


class WriterProcess:
    """The writer's life beyond its first trainer: a
    :class:`~lowdiff.engine.process.takeover.TakeoverHost` (see the module docstring).

    Args:
        w: the writer (:class:`~lowdiff.engine.writer.writer.Writer`).
    """

    def __init__(self, w: Any) -> None:
        self.w = w
        self.root = Path(w.cfg.root)
        self.takeover = ProcessTakeover(self.root, w.cfg.run_id, "writer", "record slots")
        self.stdio_released = False
        self.staging_bytes = 0
        """The size of the staging buffer of the trainer that died (what the next one
        stages into: the same layout)."""

    def _doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "run_id": self.w.cfg.run_id,
            "layout_id": self.w.cfg.layout_id,
            "process": "writer",
        }
        if self.takeover.listener is not None:
            doc.update(self.takeover.address())
        return doc

    def start(self) -> None:
        """Publish the control block and the descriptor (state RUNNING), when the
        writer is to wait for a next trainer at all (``idle_timeout``)."""
        cfg = self.w.cfg
        if cfg.idle_timeout <= 0:
            return
        ctl = self.takeover.publish(cfg.layout_id, CTL_BYTES)
        ctl.write(rp.STATE_RUNNING, -1, self._doc())

    def trainer_gone(self) -> None:
        """(its pipes closed) Let go of the trainer's standard streams before writing
        what it sent, when this writer is to outlive it: a launcher waiting for the end
        of the trainer's output sees the trainer end at once, not after the last batch."""
        if self.takeover.ctl is not None and not self.stdio_released:
            release_trainer_stdio(self.root / layout.REPLICA_LOG)
            self.stdio_released = True

    def orphaned(self) -> bool:
        """(everything the dead trainer sent is on disk) Offer the writer to the next
        trainer; True once one took it over, False when released or ``idle_timeout``
        passed."""
        w, takeover = self.w, self.takeover
        if takeover.ctl is None or takeover.released:
            return False
        self.trainer_gone()
        takeover.address()
        takeover.ctl.write(rp.STATE_ORPHANED, w.durable_now(), self._doc())
        if w.staging is not None:
            # the dead trainer's (its full checkpoint in flight is written): its memory
            # goes, and the spare's staging buffer of the same size takes its place
            self.staging_bytes = int(w.staging.numel())
            w.staging = None
        # the spare slots are made after ORPHANED: a next trainer recovering waits for that
        return takeover.wait(self, int(w.slots.shape[0]), w.cfg.idle_timeout)

    # ------------------------------------------------------------------ TakeoverHost
    def request_mismatch(self, msg: Any) -> str:
        durable = self.w.durable_now()
        return request_mismatch(
            msg, self.w.cfg, _MATCH, self.root, what="writer", held=durable,
            holds=f"the writer's chain ends at {durable}", slots="record slots",
        )  # fmt: skip

    def make_segments(self, n: int) -> TrainerSegments:
        cfg, name = self.w.cfg, self.takeover.segment_prefix()
        if self.staging_bytes:
            try:
                return TrainerSegments.make(name, n, cfg.row_bytes, self.staging_bytes)
            except LowDiffError:
                pass  # no room in /dev/shm for it: the new trainer makes its own, as before
        return TrainerSegments.make(name, n, cfg.row_bytes)

    def take_on(self, msg: TakeoverRequest, made: TrainerSegments) -> int:
        w, ctl = self.w, self.takeover.ctl
        assert ctl is not None
        w.cfg = dataclasses.replace(
            w.cfg,
            batch_size=msg.cfg.batch_size,
            idle_timeout=msg.cfg.idle_timeout,
            trainer_pid=msg.pid,
        )
        w.set_batch_size(msg.cfg.batch_size)
        w.staging = made.staging  # the new trainer stages into it (or sends its own)
        w.slots, w.counters = made.slots, made.counters
        durable = w.durable_now()
        w.counters.raise_to(DURABLE, durable + 1)
        announce(w.uploader, w.counters)
        ctl.write(rp.STATE_RUNNING, durable, self._doc())
        return durable

    def switch_to(self, end: ChildEnd, durable: int) -> None:
        self.w.end = end


def writer_main(
    cfg: WriterConfig,
    slots: torch.Tensor,
    counters: torch.Tensor,
    requests: Connection,
    results: Connection,
) -> None:
    """Entry point of LowDiff's writer (see
    :func:`lowdiff.proc.child_end.run_checkpointing_process` for its frame: at nice 10 it
    waits for a moment the trainer leaves a core, and its few percent of a core are still
    far below the share that priority gets; SCHED_BATCH was slower end to end)."""
    w = Writer(cfg, slots, Counters(counters), ChildEnd(requests, results))
    proc = WriterProcess(w)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer's close() decides
    signal.signal(signal.SIGTERM, proc.takeover.on_sigterm)

    def run() -> None:
        w.start_remote()
        proc.start()
        w.end.ready()
        while w.end.serve(w.handle):
            # The trainer died without close(): keep every record it managed to send,
            # then wait for the next trainer (idle_timeout) or exit.
            proc.trainer_gone()
            w.end.drain(w.handle_orphaned, (Kind.RECORD, Kind.FULL, Kind.STAGE, Kind.BATCH_SIZE))
            w.end.close()
            w.write_batch()
            w.wait_full()
            if not exits_within(w.cfg.trainer_pid, TRAINER_EXIT_S) or not proc.orphaned():
                w.drain_remote()
                return

    # an error: the full checkpoint in flight completes (or removes its temp file) before
    # the trainer learns of it, so nothing of this process is still writing by then
    run_checkpointing_process(
        Path(cfg.root), run, report=w.send, finish=w.wait_full, cleanup=proc.takeover.teardown
    )

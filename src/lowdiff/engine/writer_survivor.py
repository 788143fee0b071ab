"""LowDiff's writer after its trainer died: kept for the next trainer.

When the trainer dies, the writer (:mod:`lowdiff.engine.worker`) writes every record it
was sent and finishes the full checkpoint in flight, as before. Then, instead of
exiting, it offers itself to the next trainer on the same directory for up to
``idle_timeout`` seconds (:mod:`lowdiff.proc.adopt`):

1) (writer, from its start) a small control block ``lowdiff-<run>-ctl`` and the
   directory's descriptor (:mod:`lowdiff.proc.holder`) name it, state RUNNING; once its
   trainer is gone and everything sent is on disk: ORPHANED, the durable step, and the
   address and key of its socket. It lets go of the dead trainer's standard streams
   (its output goes to ``DIR/.lowdiff.replica.log``).
2) (new trainer) recovers from disk as always (the writer wrote what it was sent before
   it published ORPHANED), then sends :class:`~lowdiff.engine.messages.Adopt` with its
   ``WorkerConfig`` and the recovered step.
3) (writer) checks run, layout, record row, directory, retention, remote tier and step;
   makes new record slots, counters and a staging buffer as large as the dead trainer's
   in named shared memory (made while it waits, their pages allocated on a thread, so
   the new trainer's first full checkpoint does not allocate the size of the state),
   takes the new ``b``, and answers ``Ready``: it serves the new trainer from here on,
   watching it by its pid. A trainer that does not match gets ``Refused`` and why; it
   then releases the writer (SIGTERM: it exits) and starts one of its own.

SIGTERM, or ``idle_timeout`` with no trainer, ends it: uploads are drained, its segments
unlinked, its descriptor removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from lowdiff.engine.messages import Adopt
from lowdiff.engine.remote_tier import announce
from lowdiff.errors import LowDiffError
from lowdiff.format import layout
from lowdiff.proc import adopt
from lowdiff.proc import holder as rp
from lowdiff.proc.adopt import TrainerSegments
from lowdiff.proc.channel import DURABLE
from lowdiff.proc.spawn import release_trainer_stdio

CTL_BYTES = 64 << 10
"""The writer's control block: a header and a short JSON document."""

_MATCH = ("run_id", "layout_id", "row_bytes", "keep_full", "remote")
"""What a new trainer's ``WorkerConfig`` must share with the writer's."""


class WriterSurvivor:
    """The part of LowDiff's writer that outlives its trainer (see the module docstring)."""

    def __init__(self, w: Any) -> None:
        """``w``: the writer (:class:`lowdiff.engine.worker._Writer`)."""
        self.w = w
        self.root = Path(w.cfg.root)
        self.released = False
        """Set by SIGTERM: finish and exit (a flag, set from a handler)."""
        self.ctl: rp.ControlBlock | None = None
        self.listener: adopt.AdoptionListener | None = None
        self.adoptions = 0
        self.segments: adopt.TrainerSegments | None = None
        self.stdio_released = False
        self.spare: adopt.TrainerSegments | None = None
        """Slots, counters and staging buffer made while waiting, for a trainer that asks
        for as many slots as the last one had (the usual case): the takeover need not
        make them."""
        self.staging_bytes = 0
        """The size of the staging buffer of the trainer that died (what the next one
        stages into: the same layout)."""

    def on_sigterm(self, *_: Any) -> None:
        self.released = True

    def _doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "run_id": self.w.cfg.run_id,
            "layout_id": self.w.cfg.layout_id,
            "process": "writer",
        }
        if self.listener is not None:
            doc.update(self.listener.published())
        return doc

    def start(self) -> None:
        """Publish the control block and the descriptor (state RUNNING)."""
        cfg = self.w.cfg
        if cfg.idle_timeout <= 0:
            return
        name = f"lowdiff-{cfg.run_id[:16]}-ctl"
        # the descriptor first: a kill between the two leaves segments it names (the next
        # trainer removes them), never segments nothing names
        rp.write_descriptor(
            self.root,
            rp.Descriptor(
                os.getpid(),
                socket.gethostname(),
                cfg.run_id,
                name,
                cfg.layout_id,
                process="writer",
            ),
        )
        self.ctl = rp.ControlBlock(rp.create_segment(name, CTL_BYTES))
        self.ctl.write(rp.STATE_RUNNING, -1, self._doc())

    def trainer_gone(self) -> None:
        """(its pipes closed) Let go of the trainer's standard streams before writing
        what it sent, when this writer is to outlive it: a launcher waiting for the end
        of the trainer's output sees the trainer end at once, not after the last batch."""
        if self.ctl is not None and not self.stdio_released:
            release_trainer_stdio(self.root / layout.REPLICA_LOG)
            self.stdio_released = True

    def orphaned(self) -> bool:
        """(everything the dead trainer sent is on disk) Offer the writer to the next
        trainer; True once one took it over, False when released or ``idle_timeout``
        passed."""
        w = self.w
        if self.ctl is None or self.released:
            return False
        self.trainer_gone()
        if self.listener is None:
            self.listener = adopt.AdoptionListener(f"lowdiff-{w.cfg.run_id[:16]}-{os.getpid()}")
        self.ctl.write(rp.STATE_ORPHANED, w.durable_now(), self._doc())
        if w.staging is not None:
            # the dead trainer's (its full checkpoint in flight is written): its memory
            # goes, and the spare's staging buffer of the same size takes its place
            self.staging_bytes = int(w.staging.numel())
            w.staging = None
        if self.spare is None:  # after ORPHANED: a next trainer recovering waits for that
            with contextlib.suppress(Exception):  # else made at the takeover
                self.spare = self._make_segments(int(w.slots.shape[0]))
        return adopt.wait_for_trainer(
            self.listener, w.cfg.idle_timeout, lambda: self.released, self.adopt
        )

    def _mismatch(self, msg: Any) -> str:
        """Why the trainer that sent ``msg`` may not take the writer over ('' if it may)."""
        if not isinstance(msg, Adopt) or type(msg.cfg) is not type(self.w.cfg):
            return "not a request to take over a LowDiff writer"
        mine, theirs = self.w.cfg, msg.cfg
        for field in _MATCH:
            if getattr(mine, field) != getattr(theirs, field):
                return f"the new trainer's {field} differs from the writer's"
        if Path(theirs.root).resolve() != self.root.resolve():
            return f"the new trainer's directory {theirs.root} is not {self.root}"
        durable = self.w.durable_now()
        if msg.step != durable:
            return (
                f"the new trainer resumes at step {msg.step}, the writer's chain ends at {durable}"
            )
        if msg.slots < 1:
            return "the new trainer asks for no record slots"
        return ""

    def adopt(self, conn: Connection) -> bool:
        """Take on the trainer on ``conn`` if it asks to, and runs this job."""
        w, listener = self.w, self.listener
        assert listener is not None and self.ctl is not None
        msg = adopt.take_request(listener, conn, self._mismatch)
        if msg is None:
            return False
        made, self.spare = self.spare, None
        if made is None or made.n_slots != msg.slots:
            if made is not None:
                made.unlink()
            try:
                made = self._make_segments(msg.slots)
            except BaseException as e:  # noqa: BLE001 -- the trainer starts a process of its own
                adopt.refuse(conn, f"cannot make the record slots: {e}")
                return False
        old, self.segments = self.segments, made
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
        if old is not None:
            old.unlink()
        self.adoptions += 1
        self.ctl.write(rp.STATE_RUNNING, durable, self._doc())
        w.end = adopt.serve_new_trainer(
            conn, msg, dict(made.info, durable=durable, adoptions=self.adoptions),
            adopt.refusing_newcomers(listener, "writer", lambda: self.released),
        )  # fmt: skip
        return True

    def _make_segments(self, n: int) -> TrainerSegments:
        cfg = self.w.cfg
        name = f"lowdiff-{cfg.run_id[:16]}-t{self.adoptions + 1}"
        if self.staging_bytes:
            try:
                return adopt.TrainerSegments.make(name, n, cfg.row_bytes, self.staging_bytes)
            except LowDiffError:
                pass  # no room in /dev/shm for it: the new trainer makes its own, as before
        return adopt.TrainerSegments.make(name, n, cfg.row_bytes)

    def teardown(self) -> None:
        if self.listener is not None:
            self.listener.close()
        if self.ctl is not None:
            rp.unlink_and_close(self.ctl.shm)
            rp.remove_descriptor(self.root, self.w.cfg.run_id)
        for segments in (self.segments, self.spare):
            if segments is not None:
                segments.unlink()

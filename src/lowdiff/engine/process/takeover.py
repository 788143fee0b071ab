"""The process side of a takeover: a checkpointing process that outlived its trainer
serves the next trainer on the same directory.

LowDiff's writer (:mod:`lowdiff.engine.writer.main`) and LowDiff+'s replica
(:mod:`lowdiff.engine.replica.main`) run the same sequence through one
:class:`ProcessTakeover` each; what differs between them (the fields a new trainer's
configuration must share, the slots made for it, what the process takes on) is the
:class:`TakeoverHost` each implements. The trainer's side is
:mod:`lowdiff.engine.trainer.takeover`. Call sequence:

1) (process, at its start) :meth:`ProcessTakeover.publish`: the directory's descriptor
   (:mod:`lowdiff.proc.holder`) names the process and its control block, which is made
   next; the process publishes its state in it (RUNNING; the replica INIT until its
   state arrives).
2) (process, its trainer gone and everything it sent handled) the host publishes
   ORPHANED with :meth:`~ProcessTakeover.address` (the socket a new trainer connects
   to, :mod:`lowdiff.proc.takeover_socket`) and calls :meth:`~ProcessTakeover.wait`: slots for a
   trainer like the last one are made ahead, then it waits up to ``idle_timeout`` for one.
3) (new trainer) recovers the state (from disk, or out of the replica's memory),
   connects and sends :class:`~lowdiff.engine.wire.messages.TakeoverRequest`.
4) (process) :func:`request_mismatch`: the same run, layout, directory, retention and
   step, or ``Refused`` and why (that trainer then releases the process and starts one
   of its own). Otherwise the host takes on the new slots and counters
   (:meth:`TakeoverHost.take_on`), publishes RUNNING, answers ``Ready`` with their names
   and serves the new trainer as it served the first, watching it by its pid.

SIGTERM (a trainer that does not take the process over releases it) or ``idle_timeout``
ends the wait: the process persists what it holds and exits, and
:meth:`~ProcessTakeover.teardown` removes its descriptor, control block and segments.
"""

from __future__ import annotations

import contextlib
import os
import socket
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

from lowdiff.engine.wire.messages import TakeoverRequest
from lowdiff.proc import holder as rp
from lowdiff.proc import takeover_socket
from lowdiff.proc.child_end import ChildEnd
from lowdiff.proc.takeover_socket import TrainerSegments


class TakeoverHost(Protocol):
    """What a checkpointing process does in a takeover (LowDiff's writer, LowDiff+'s
    replica). Called on the process's main thread, in this order, by
    :meth:`ProcessTakeover.wait` for each trainer that connects."""

    def request_mismatch(self, msg: Any) -> str:
        """Why the trainer that sent ``msg`` may not take the process over ('' if it may;
        see :func:`request_mismatch`)."""

    def make_segments(self, n: int) -> TrainerSegments:
        """``n`` slots, counters (and what else the process makes) for a new trainer."""

    def take_on(self, msg: TakeoverRequest, made: TrainerSegments) -> int:
        """Serve the trainer of ``msg`` with ``made`` from now on (its configuration,
        its slots and counters, the remote durable step carried over), publish RUNNING;
        the durable step the trainer goes on from."""

    def switch_to(self, end: ChildEnd, durable: int) -> None:
        """Answer the new trainer, on its end of the link ``end``, from now on
        (``durable``: what it was told in ``Ready``)."""


def request_mismatch(
    msg: Any,
    mine: Any,
    fields: tuple[str, ...],
    root: Path,
    *,
    what: str,
    held: int,
    holds: str,
    slots: str,
) -> str:
    """Why ``msg`` is not a request this process (configuration ``mine``, directory
    ``root``) may accept: a ``TakeoverRequest`` of the same configuration type whose
    ``fields`` match, for the same directory, at the step ``held`` the process holds,
    asking for at least one slot. '' when it may.

    Args:
        what: the process, as in "the writer's" ("writer", "replica").
        holds: the step the process holds, said in a sentence (for the message).
        slots: the slots, as in "asks for no record slots".
    """
    if not isinstance(msg, TakeoverRequest) or type(msg.cfg) is not type(mine):
        return f"not a request to take over a {'LowDiff writer' if what == 'writer' else 'LowDiff+ replica'}"
    theirs = msg.cfg
    for field in fields:
        if getattr(mine, field) != getattr(theirs, field):
            return f"the new trainer's {field} differs from the {what}'s"
    if Path(theirs.root).resolve() != root.resolve():
        return f"the new trainer's directory {theirs.root} is not {root}"
    if msg.step != held:
        return f"the new trainer resumes at step {msg.step}, {holds}"
    if msg.slots < 1:
        return f"the new trainer asks for no {slots}"
    return ""


class ProcessTakeover:
    """One checkpointing process's part in takeovers (see the module docstring).

    Args:
        root: the checkpoint directory the process serves.
        run_id: the run it writes as (names its descriptor and segments).
        kind: ``"writer"`` or ``"replica"`` (in its descriptor and in refusals).
        slots: what its slots are called (``"record slots"``, ``"snapshot slots"``).
    """

    def __init__(self, root: Path, run_id: str, kind: str, slots: str) -> None:
        self.root, self.run_id, self.kind, self.slots = root, run_id, kind, slots
        self.released = False
        """Set by SIGTERM: finish and exit (a flag, set from a signal handler)."""
        self.ctl: rp.ControlBlock | None = None
        self.published = False
        self.listener: takeover_socket.TakeoverListener | None = None
        self.takeovers = 0
        self.segments: TrainerSegments | None = None
        """The slots and counters made for the trainer that took the process over last."""
        self.spare: TrainerSegments | None = None
        """Slots and counters made while waiting, for a trainer that asks for as many
        slots as the last one had (the usual case): the takeover need not make them."""

    def on_sigterm(self, *_: Any) -> None:
        self.released = True

    def publish(self, layout_id: str, ctl_bytes: int) -> rp.ControlBlock:
        """Write the directory's descriptor, then make the control block it names."""
        name = f"lowdiff-{self.run_id[:16]}-ctl"
        # the descriptor first: a kill between the two leaves segments it names (the next
        # trainer removes them), never segments nothing names
        self.published = True
        rp.write_descriptor(
            self.root,
            rp.Descriptor(
                os.getpid(), socket.gethostname(), self.run_id, name, layout_id,
                process=self.kind,
            ),
        )  # fmt: skip
        self.ctl = rp.ControlBlock(rp.create_segment(name, ctl_bytes))
        return self.ctl

    def address(self) -> dict[str, str]:
        """How a new trainer connects (published in the control block with ORPHANED);
        the socket is opened on the first call."""
        if self.listener is None:
            self.listener = takeover_socket.TakeoverListener(f"lowdiff-{self.run_id[:16]}-{os.getpid()}")
        return self.listener.published()

    def segment_prefix(self) -> str:
        """The names of the segments made for the next trainer."""
        return f"lowdiff-{self.run_id[:16]}-t{self.takeovers + 1}"

    def wait(self, host: TakeoverHost, n_slots: int, idle_timeout: float) -> bool:
        """(after ORPHANED is published) Wait up to ``idle_timeout`` seconds for a new
        trainer; True once one took the process over, False when released or none came.
        Slots for a trainer like the last one (``n_slots``) are made first."""
        if self.spare is None:
            with contextlib.suppress(Exception):  # else made at the takeover
                self.spare = host.make_segments(n_slots)
        assert self.listener is not None
        return takeover_socket.wait_for_trainer(
            self.listener, idle_timeout, lambda: self.released, lambda c: self._accept(host, c)
        )

    def _accept(self, host: TakeoverHost, conn: Connection) -> bool:
        """Take on the trainer on ``conn`` if it asks to, and runs this job."""
        listener = self.listener
        assert listener is not None
        msg = takeover_socket.take_request(listener, conn, host.request_mismatch)
        if msg is None:
            return False
        made, self.spare = self.spare, None
        if made is None or made.n_slots != msg.slots:
            if made is not None:
                made.unlink()
            try:
                made = host.make_segments(msg.slots)
            except BaseException as e:  # noqa: BLE001 -- the trainer starts a process of its own
                takeover_socket.refuse(conn, f"cannot make the {self.slots}: {e}")
                return False
        old, self.segments = self.segments, made
        self.takeovers += 1
        durable = host.take_on(msg, made)
        if old is not None:
            old.unlink()
        end = takeover_socket.serve_new_trainer(
            conn, msg, dict(made.info, durable=durable, takeovers=self.takeovers),
            takeover_socket.refusing_newcomers(listener, self.kind, lambda: self.released),
        )  # fmt: skip
        host.switch_to(end, durable)
        return True

    def teardown(self) -> None:
        """Close the socket, remove the control block, the descriptor and the segments."""
        if self.listener is not None:
            self.listener.close()
        if self.ctl is not None:
            rp.unlink_and_close(self.ctl.shm)
        if self.published:
            rp.remove_descriptor(self.root, self.run_id)
        for segments in (self.segments, self.spare):
            if segments is not None:
                segments.unlink()

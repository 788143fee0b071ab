"""The trainer's side of a takeover: a new trainer goes on with the checkpointing process
its predecessor left behind, instead of starting one.

A process that outlived its trainer (an *orphan*, :class:`lowdiff.proc.holder.Orphan`:
LowDiff's writer once it wrote everything it was sent, LowDiff+'s replica once it merged
every step) waits for the next trainer on the same directory; its side is
:mod:`lowdiff.engine.process.takeover`. Call sequence (one process, or every rank):

1) (trainer) finds the orphan: LowDiff+'s replica before recovering
   (:mod:`lowdiff.engine.trainer.resume_memory`: its state is copied out of its memory),
   LowDiff's writer before recovering from disk (:meth:`Takeover.find_writer`: it waits
   until the writer wrote what it was sent).
2) (trainer, one process) :meth:`Takeover.ask_early`: the
   :class:`~lowdiff.engine.wire.messages.TakeoverRequest` goes out on a thread
   (:class:`PendingTakeover`) while the state is recovered; it names the step the
   orphan holds, and is used only if the recovery reaches that step.
3) (trainer) :meth:`Takeover.take_over` waits for the answer: ``Ready`` with the names of
   the slots and counters the process made for this trainer (:class:`TakeoverAccepted`,
   attached to the session: :meth:`Takeover.go_on`), or why not (then the orphan is
   released and a process of this trainer's own is started). Under DDP every rank takes
   its own over, or none does (:meth:`Takeover.give_back` lets a process taken over go
   again).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import threading
from multiprocessing.connection import Connection
from typing import Any

from lowdiff.engine.trainer.backend import Backend
from lowdiff.engine.trainer.parts import SessionParts
from lowdiff.engine.trainer.staging import FullStager
from lowdiff.engine.wire.messages import TakeoverRequest
from lowdiff.proc import holder as rp
from lowdiff.proc import takeover_socket
from lowdiff.proc.holder import Orphan, find_orphan
from lowdiff.proc.protocol import Close, Kind, Ready, Refused
from lowdiff.proc.spawn import trainer_env
from lowdiff.recovery.replay import RecoveryStats


@dataclasses.dataclass
class TakeoverAccepted:
    """An orphan's yes to a trainer's request to take it over: the connection, its
    ``Ready``, and the record slots and counters it made (and the staging buffer, when it
    made one), attached here."""

    conn: Connection
    reply: Ready
    segments: tuple[Any, ...]

    def give_up(self) -> None:
        """Not used after all: close the connection (the process, let go by a live
        trainer, exits once it has persisted) and this process's mappings."""
        takeover_socket.close_quietly(self.conn)
        for shm in self.segments:
            with contextlib.suppress(Exception):
                shm.close()


def ask_for_takeover(
    published: dict[str, Any], request: TakeoverRequest, timeout: float
) -> TakeoverAccepted | str:
    """Ask an orphan to serve this trainer: connect with what its control block
    ``published``, send ``request``, and wait up to ``timeout`` seconds for its answer.
    Touches no session, so it may run on a thread of its own.

    Returns:
        its :class:`TakeoverAccepted` answer, or why it did not accept (it did not answer,
        or refused; it then still waits for a trainer).
    """
    try:
        conn = takeover_socket.connect(published)
    except OSError as e:
        return f"it does not answer ({e})"
    try:
        reply = _ready(conn, request, timeout)
        segments = _attach_segments(reply)
    except (EOFError, OSError, KeyError, ValueError) as e:
        takeover_socket.close_quietly(conn)  # a process that said yes is orphaned again
        return str(e)
    if len(segments) > 2:
        # the staging buffer (its pages allocated by the process), mapped here on the
        # thread of an early request while the trainer recovers from disk, rather than
        # page by page by the first full checkpoint's copy. (The slots are not: the
        # first steps map them faster than a populate racing the trainer's resume.)
        rp.populate(segments[2])
    return TakeoverAccepted(conn, reply, tuple(segments))


def _ready(conn: Connection, request: TakeoverRequest, timeout: float) -> Ready:
    """Send ``request`` on ``conn``; the process's ``Ready`` (EOFError: anything else)."""
    conn.send(request)
    if not conn.poll(timeout):
        raise EOFError(f"no answer within {timeout:g} s")
    reply = conn.recv()
    if isinstance(reply, Refused):
        raise EOFError(f"it refused: {reply.reason}")
    if not isinstance(reply, Ready) or not reply.info:
        raise EOFError(f"it answered {type(reply).__name__}")
    return reply


def _attach_segments(reply: Ready) -> list[Any]:
    """The slots, counters (and staging buffer) a ``Ready`` names, mapped here."""
    assert reply.info is not None
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
    return segments


class PendingTakeover:
    """:func:`ask_for_takeover` on a thread of its own: the request goes out now, and the
    answer is waited for (:meth:`result`) once the trainer needs it."""

    def __init__(self, published: dict[str, Any], request: TakeoverRequest, timeout: float) -> None:
        self._answer: TakeoverAccepted | str = "no answer"
        self._timeout = timeout
        self._thread = threading.Thread(
            target=self._ask, args=(published, request), daemon=True, name="lowdiff-takeover"
        )
        self._thread.start()

    def _ask(self, published: dict[str, Any], request: TakeoverRequest) -> None:
        try:
            self._answer = ask_for_takeover(published, request, self._timeout)
        except Exception as e:  # noqa: BLE001 -- reported as why it was not taken over
            self._answer = f"asking failed: {e!r}"

    def result(self) -> TakeoverAccepted | str:
        self._thread.join(self._timeout + 5.0)
        if self._thread.is_alive():
            return f"no answer within {self._timeout:g} s"
        return self._answer


class Takeover:
    """This trainer's takeovers (see the module docstring).

    Args:
        parts: the session's parts (its directory goes on as the run taken over; a
            process taken over is attached to its session).
        stager: stages into the staging buffer a process taken over made.
        backend: the process's configuration, and what it does once it serves this trainer.
    """

    def __init__(self, parts: SessionParts, stager: FullStager, backend: Backend) -> None:
        self.objects, self.progress, self.options = parts.objects, parts.progress, parts.options
        self.directory, self.session = parts.directory, parts.session
        self.stager, self.backend = stager, backend
        self.orphan: Orphan | None = None
        """The previous trainer's process, found before recovering from disk and not
        (yet) taken over; released before a process of this session starts."""
        self.miss_reason: str | None = None
        """Why the last resume did not recover from a replica in memory, or did not take
        a process over (None when it did both, or before ``resume()``)."""
        self._pending: PendingTakeover | None = None

    # ------------------------------------------------------------------ finding
    def find_writer(self) -> Orphan | None:
        """(before recovering from disk) LowDiff's writer left by the previous trainer,
        once it wrote everything it was sent; kept in :attr:`orphan`."""
        found, why = find_orphan(
            self.directory.root, self.objects.layout_id, self.options.start_timeout
        )
        self.orphan = found
        if found is None:
            self.miss_reason = why
        return found

    def release_kept(self) -> bool:
        """Release :attr:`orphan`, not taken over (it persists what it holds and exits);
        whether there was one."""
        orphan, self.orphan = self.orphan, None
        if orphan is not None:
            orphan.release_owner(self.options.start_timeout)
        return orphan is not None

    # ------------------------------------------------------------------ asking
    def request(self, found: Orphan) -> TakeoverRequest:
        """The request to take ``found`` over (this session continues its run)."""
        _, cfg, n_slots = self.backend.process(found.descriptor.run_id)
        key = bytes(multiprocessing.current_process().authkey)
        return TakeoverRequest(os.getpid(), found.step, n_slots, cfg, trainer_env(), key)

    def ask_early(self, found: Orphan | None) -> None:
        """(one process) Ask ``found`` to serve this trainer on a thread, while the state
        is recovered; its answer is waited for only by :meth:`take_over`."""
        if found is None or "address" not in found.doc or self.objects.dist is not None:
            return
        self._pending = PendingTakeover(
            found.doc, self.request(found), self.session.link.start_timeout
        )

    def drop_pending(self) -> None:
        """An early request's answer that will not be used: a process that accepted is
        let go again (it exits once it has persisted; a launch waits for it)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            answer = pending.result()
            if isinstance(answer, TakeoverAccepted):
                answer.give_up()

    # ------------------------------------------------------------------ taking over
    def take_over(self, found: Orphan, stats: RecoveryStats) -> bool:
        """Ask ``found`` (the state it serves is loaded here) to serve this trainer; True
        once it does (``stats.takeover_pid``), False (and why, in :attr:`miss_reason`) when
        it cannot: it then still waits to be released."""
        if "address" not in found.doc:
            self.miss_reason = "the process takes no new trainer"
            return False
        pending, self._pending = self._pending, None
        if pending is not None:
            answer = pending.result()
        else:
            timeout = self.session.link.start_timeout
            answer = ask_for_takeover(found.doc, self.request(found), timeout)
        found.close()
        if isinstance(answer, str):
            self.miss_reason = f"cannot take the process over: {answer}"
            return False
        self.session.attach_takeover(answer.conn, answer.reply, answer.segments)
        self.directory.continue_run(found.descriptor.run_id)  # the session goes on as its run
        stats.takeover_pid = found.descriptor.pid
        return True

    def take_over_orphan(self, stats: RecoveryStats) -> bool:
        """(after recovering from disk) Go on with :attr:`orphan` instead of starting a
        process, when it serves the recovered state's run at the recovered step. Under DDP
        every rank takes its own over, or none does (a collective call)."""
        found = self.orphan
        ok = (
            found is not None
            and found.descriptor.run_id == stats.state_run_id
            and found.step == stats.step
        )
        if not ok:
            self.drop_pending()
        ok = ok and found is not None and self.take_over(found, stats)
        ctx = self.objects.dist
        if ctx is not None and not ctx.all_min([int(ok)])[0]:
            if ok:  # another rank could not: every rank starts anew, this one too
                self.give_back(stats)
            ok = False
        if ok:
            self.orphan = None
            self.go_on()
        return ok

    def go_on(self) -> None:
        """Go on with the process taken over: it holds what it persisted, and its slots;
        the manifest stays as the previous trainer wrote it (same run, layout, retention)."""
        session = self.session
        self.progress.saw_durable(int((session.link.info or {}).get("durable", -1)))
        self.stager.reset(session.staging)
        self.progress.start()
        self.backend.started()

    def give_back(self, stats: RecoveryStats) -> None:
        """Let a process taken over go again: it persists what it holds and exits."""
        session = self.session
        with contextlib.suppress(Exception):
            session.request(Close(), Kind.CLOSED)
            session.join()
        session.release()
        stats.takeover_pid = None

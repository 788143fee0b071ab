"""The trainer's link to Gemini's holder process (:mod:`lowdiff_lab.baselines.gemini_holder`).

A trainer either spawns its directory's holder or attaches to one that outlived the
trainer that spawned it (the holder offers its checkpoint on a Unix socket named in its
control block, with a key kept there). Either way it then talks to the holder through
one :class:`~lowdiff.proc.link.ProcessLink`, which watches the holder while the trainer
waits and raises the holder's errors in the trainer.

Call sequence (trainer)::

    link = HolderLink(root, layout_id, start_timeout, on_message)
    live = link.attach()          # the holder's checkpoint to copy from, or None ...
    link.spawn(cfg)               # ... and then a new holder (a stale one is ended first)
    link.resume_at(step, disk)    # the holder drops what is newer than the resumed step
    blob = link.buffer(b, n)      # a buffer to copy a checkpoint into; then, from the
    link.hand_over(GmDone(...))   # copy thread: the checkpoint is complete
    link.wait_acked()             # before a buffer is reused
    link.flush(); link.close()
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, TypeVar

import torch

from lowdiff.errors import CheckpointWorkerError, LowDiffError
from lowdiff.format import layout
from lowdiff.proc import holder as rp
from lowdiff.proc import takeover_socket as adopt
from lowdiff.proc.link import ProcessLink
from lowdiff.proc.locks import acquire_flock, lock_holder, wait_for_writer
from lowdiff.proc.protocol import Close, Flush, Kind, Message
from lowdiff_lab.baselines.gemini_holder import holder_main
from lowdiff_lab.baselines.gemini_protocol import (
    N_BUFFERS,
    GmAck,
    GmAlloc,
    GmAlloced,
    GmAttach,
    GmAttached,
    GmDone,
    GmPeerDone,
    GmRefused,
    GmResume,
    GmResumed,
    HolderConfig,
    HolderState,
)

WHAT = "the holder process"
"""How errors name the holder."""

_Reply = TypeVar("_Reply", bound=Message)


def writer_busy(root: Path) -> bool:
    """Whether a holder holds ``DIR/.lowdiff.writer.lock`` (released when it exits, even
    when it is killed; a pid can linger as a zombie, a lock cannot)."""
    fd = acquire_flock(root / layout.WRITER_LOCK_FILE, blocking=False)
    if fd is None:
        return True
    os.close(fd)
    return False


def stop_stale_holder(root: Path, timeout: float) -> None:
    """End a holder that this session cannot use (it persists its newest checkpoint first),
    and remove the segments of one that died without cleaning up."""
    d = rp.read_descriptor(root)
    if writer_busy(root):
        if d is not None and d.host == socket.gethostname():
            holder = lock_holder(root / layout.WRITER_LOCK_FILE)
            if f"pid={d.pid} " in holder + " ":
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(d.pid, signal.SIGTERM)
        wait_for_writer(root, timeout, WHAT)
    d = rp.read_descriptor(root)
    if d is not None:
        rp.cleanup_stale(root, d)


class _Buffers:
    """The trainer's mappings of the holder's buffers (attached by name when first used)."""

    def __init__(self) -> None:
        self.names: list[str | None] = [None] * N_BUFFERS
        self.caps = [0] * N_BUFFERS
        self.shms: list[Any] = [None] * N_BUFFERS

    def reset(self, listing: tuple[tuple[str | None, int], ...]) -> None:
        for b, (name, cap) in enumerate(listing):
            self.set(b, name, int(cap))

    def set(self, b: int, name: str | None, cap: int) -> None:
        if self.names[b] == name:
            return
        self._close(b)
        if name is not None and not rp.valid_segment_name(name):
            raise LowDiffError(f"the holder named an invalid shared-memory segment {name!r}")
        self.names[b], self.caps[b] = name, cap

    def tensor(self, b: int, nbytes: int) -> torch.Tensor:
        name = self.names[b]
        assert name is not None and nbytes <= self.caps[b]
        if self.shms[b] is None:
            self.shms[b] = rp.attach_segment(name)
        return rp.segment_tensor(self.shms[b], nbytes)

    def _close(self, b: int) -> None:
        if self.shms[b] is not None:
            with contextlib.suppress(Exception):
                self.shms[b].close()  # the holder unlinks; views still alive keep it mapped
            self.shms[b] = None
        self.names[b], self.caps[b] = None, 0

    def close(self) -> None:
        for b in range(N_BUFFERS):
            self._close(b)


class HolderLink:
    """The trainer's end of its directory's holder (see the module docstring).

    Args:
        root: the checkpoint directory (of this rank).
        layout_id: the model's layout; a holder of another model is not attached.
        start_timeout: seconds to wait for the holder to start, to answer, or to make
            progress while the trainer waits for it.
        on_message: called with the holder's messages that concern durability
            (``GmPersisted``, ``Flushed``, ``Closed``).
    """

    def __init__(
        self,
        root: Path,
        layout_id: str,
        start_timeout: float,
        on_message: Callable[[Message], None],
    ) -> None:
        self.root, self.layout_id, self.start_timeout = root, layout_id, start_timeout
        self._forward = on_message
        self.link = self._new_link()
        self.bufs = _Buffers()
        self.cur, self.peer_cur = -1, -1
        """The buffers of the newest own and peer checkpoints handed over."""
        self.seq = 0
        """Checkpoints handed over (own and peer); the holder acknowledges each."""
        self.acked = 0
        self.memory_step = -1
        """The newest own checkpoint the holder has published as complete."""
        self.disk_step = -1
        """The newest step on disk, as far as this trainer knows."""
        self.pid = -1
        """The holder's pid (-1: none yet)."""
        self.miss_reason = ""
        """Why the last :meth:`attach` found no checkpoint in memory (empty when it did)."""
        self._replies: dict[Kind, Message] = {}

    def _new_link(self) -> ProcessLink:
        return ProcessLink(
            WHAT,
            stall_timeout=self.start_timeout,
            start_timeout=self.start_timeout,
            on_message=self._on_message,
        )

    @property
    def attached(self) -> bool:
        return self.link.started

    # ------------------------------------------------------------------ start
    def spawn(self, cfg: HolderConfig) -> None:
        """Start a new holder (ending a stale one first) and wait until it is ready."""
        stop_stale_holder(self.root, self.start_timeout)
        self.pid = -1  # until it reports ready
        self.link.start(holder_main, (cfg,), name="lowdiff-gemini-holder")
        self.pid = self.link.proc.pid
        self._take(HolderState.from_info(self.link.info))

    def attach(self) -> rp.LiveReplica | None:
        """Attach to this directory's holder if it offers a complete checkpoint.

        Returns the checkpoint found in memory (to copy from) with this trainer attached, so
        that the holder serves this trainer from now on; None when there is none (see
        :attr:`miss_reason`).
        """
        if rp.read_descriptor(self.root) is None or not writer_busy(self.root):
            # (a holder holds the writer lock while it lives: a killed one can linger as a
            # zombie pid, but not as a lock holder)
            self.miss_reason = "no holder process"
            return None
        live, why = rp.find_live_replica(self.root, self.layout_id, wait_s=self.start_timeout)
        if live is None:
            self.miss_reason = why
            return None
        try:
            conn = adopt.connect(live.doc)
        except OSError as e:
            live.close()
            self.miss_reason = f"the holder process does not answer ({e})"
            return None
        try:
            state = self._ask_to_attach(conn)
            self.link.attach(live.descriptor.pid, conn, state.info())
        except (OSError, EOFError) as e:
            conn.close()
            live.close()
            self.miss_reason = f"the holder process refused the new trainer ({e})"
            return None
        self.pid = live.descriptor.pid
        self._take(state)
        self.miss_reason = ""
        return live

    def _ask_to_attach(self, conn: Connection) -> HolderState:
        conn.send(GmAttach(os.getpid(), self.layout_id))
        if not conn.poll(self.start_timeout):
            raise EOFError("no answer")
        msg = conn.recv()
        if isinstance(msg, GmRefused):
            raise EOFError(msg.reason)
        if not isinstance(msg, GmAttached):
            raise EOFError(f"it answered {type(msg).__name__}")
        return msg.state

    def _take(self, state: HolderState) -> None:
        """Take the holder's view of its buffers."""
        self.bufs.reset(state.buffers)
        self.cur, self.peer_cur = state.cur, state.peer_cur
        self.disk_step = state.persisted
        self.memory_step = state.step if state.cur >= 0 else -1

    def resume_at(self, step: int, disk_step: int) -> None:
        """Tell the holder at which step the trainer goes on, and what is on disk."""
        self._take(self.request(GmResume(step, disk_step), GmResumed).state)

    # ------------------------------------------------------------------ requests
    def request(self, msg: Message, reply: type[_Reply]) -> _Reply:
        """Send ``msg`` and wait for its reply, of class ``reply``."""
        self.link.request(msg, reply.kind)
        got = self._replies.pop(reply.kind)
        assert isinstance(got, reply)
        return got

    def buffer(self, b: int, nbytes: int) -> torch.Tensor:
        """Buffer ``b`` (``nbytes`` long); the holder allocates a larger one when needed."""
        if self.bufs.names[b] is None or self.bufs.caps[b] < nbytes:
            rp.ensure_shm_space(nbytes + nbytes // 8, "an in-memory checkpoint")
            got = self.request(GmAlloc(b, nbytes), GmAlloced)
            self.bufs.set(b, got.name, got.capacity)
        return self.bufs.tensor(b, nbytes)

    def next_seq(self) -> int:
        """The number of the next checkpoint handed over."""
        self.seq += 1
        return self.seq

    def hand_over(self, msg: GmDone | GmPeerDone) -> None:
        """(copy thread) Tell the holder that a checkpoint is complete.

        The trainer's thread sends nothing while a copy is in flight, and it alone reads
        the replies: a closed pipe raises here as it is, and the trainer's thread raises
        why the holder is gone (see :meth:`check`) before the copy's error.
        """
        conn = self.link.requests
        if conn is None:
            raise CheckpointWorkerError(f"{WHAT} is not attached")
        conn.send(msg)

    def wait_acked(self) -> None:
        """Wait until the holder has taken over every checkpoint handed to it."""
        if self.attached:
            self.link.wait(
                lambda: self.acked >= self.seq,
                "the holder to take over the in-memory checkpoint",
            )

    def flush(self) -> None:
        """Have the holder persist its newest checkpoint; wait until it is on disk."""
        self.wait_acked()
        self.link.request(Flush(), Kind.FLUSHED)

    def _on_message(self, msg: Message) -> None:
        match msg:
            case GmAck(seq=seq, step=step, own=own):
                self.acked = max(self.acked, seq)
                if own:
                    self.memory_step = step
            case GmAlloced() | GmResumed():
                self._replies[msg.kind] = msg
            case _:
                self._forward(msg)

    def poll(self) -> None:
        """Read the holder's messages waiting, without blocking."""
        self.link.poll()

    def check(self) -> None:
        """Raise the holder's error, or that it is gone."""
        self.link.check()

    # ------------------------------------------------------------------ the end
    def close(self) -> None:
        """Have the holder persist its newest checkpoint and exit; wait for it. Raises
        nothing: this runs after errors too (they were raised already)."""
        link = self.link
        if link.started:
            with contextlib.suppress(CheckpointWorkerError):
                link.request(Close(), Kind.CLOSED)
            link.join()
        self.forget()
        self.bufs.close()

    def forget(self) -> None:
        """Drop the link without telling the holder (what the trainer's death does: the
        holder keeps its checkpoints for a new trainer)."""
        self.link.close_pipes()
        self.link = self._new_link()

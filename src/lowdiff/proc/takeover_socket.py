"""Taking over a background process that outlived its trainer.

A process that outlives its trainer for the next one (LowDiff's writer, LowDiff+'s
replica, Gemini's holder) listens on a socket in the abstract namespace (:class:`TakeoverListener`): the
address and a random key are published in its control block, which only the same user
can read. A new trainer connects with them (:func:`connect`), asks to take the process
over, and on success talks to it over that connection as it would over the pipes of a
process it started (:meth:`lowdiff.proc.link.ProcessLink.attach`). The process watches
the trainer that took it over by its pid (:class:`lowdiff.proc.child_end.ChildEnd`).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import torch

from lowdiff.proc import channel
from lowdiff.proc import holder as rp
from lowdiff.proc.channel import Counters
from lowdiff.proc.child_end import ChildEnd
from lowdiff.proc.protocol import Refused
from lowdiff.proc.spawn import use_env

ATTACH_WAIT_S = 5.0
"""How long a connection to the socket has to send its request to take the process over."""


class TakeoverListener:
    """The socket a surviving process listens on, with a thread that queues the
    authenticated connections.

    Args:
        address: the socket's name in the abstract namespace (unique on the host).
        authkey: the key a client must know (random by default).
    """

    def __init__(self, address: str, authkey: bytes | None = None) -> None:
        self.address = address
        self.authkey = os.urandom(32) if authkey is None else authkey
        self._listener = Listener("\0" + self.address, "AF_UNIX", authkey=self.authkey)
        self._incoming: queue.Queue[Connection] = queue.Queue()
        threading.Thread(target=self._accept, daemon=True, name="lowdiff-takeover").start()

    def published(self) -> dict[str, str]:
        """What a trainer needs to connect (for the control block)."""
        return {"address": self.address, "authkey": self.authkey.hex()}

    def _accept(self) -> None:
        while True:
            try:
                self._incoming.put(self._listener.accept())
            except (AuthenticationError, EOFError, ConnectionError):
                continue
            except OSError:
                return  # closed

    def get(self, timeout: float) -> Connection | None:
        """The next connection, or None after ``timeout`` seconds."""
        try:
            return self._incoming.get(timeout=timeout)
        except queue.Empty:
            return None

    def request(self, conn: Connection) -> Any:
        """The first message on ``conn`` (None, and the connection closed, when none
        comes within :data:`ATTACH_WAIT_S` or it cannot be read)."""
        try:
            if conn.poll(ATTACH_WAIT_S):
                return conn.recv()
        except (EOFError, OSError):
            pass
        close_quietly(conn)
        return None

    def refuse_waiting(self, reply: Any) -> None:
        """Answer ``reply`` to every connection waiting, and close them."""
        while True:
            try:
                c = self._incoming.get_nowait()
            except queue.Empty:
                return
            with contextlib.suppress(Exception):
                c.send(reply)
            close_quietly(c)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._listener.close()


def connect(published: dict[str, Any]) -> Connection:
    """Connect to a surviving process's socket, from what its control block publishes.

    Raises:
        OSError: the socket is gone or refuses the connection (the process exited, or
            the key does not match).
    """
    try:
        return Client(
            "\0" + str(published["address"]),
            "AF_UNIX",
            authkey=bytes.fromhex(str(published["authkey"])),
        )
    except (AuthenticationError, EOFError, KeyError, ValueError) as e:
        raise ConnectionRefusedError(f"cannot connect to the surviving process: {e}") from e


def close_quietly(conn: Connection) -> None:
    with contextlib.suppress(Exception):
        conn.close()


POLL_S = 0.05
"""How often a process waiting for a new trainer looks for one and for its release."""


def wait_for_trainer(
    listener: TakeoverListener,
    idle_timeout: float,
    released: Callable[[], bool],
    accept: Callable[[Connection], bool],
) -> bool:
    """(a process whose trainer died) Offer the process to the next trainer for up to
    ``idle_timeout`` seconds: True once ``accept`` took one on; False when ``released()``
    or no trainer came."""
    deadline = time.monotonic() + idle_timeout
    while not released() and time.monotonic() < deadline:
        conn = listener.get(POLL_S)
        if conn is not None and accept(conn):
            return True
    return False


def take_request(
    listener: TakeoverListener, conn: Connection, why_not: Callable[[Any], str]
) -> Any:
    """The request to take the process over on ``conn``, or None: nothing came, or
    ``why_not(request)`` named a reason (answered with ``Refused``, the connection closed)."""
    msg = listener.request(conn)
    if msg is None:
        return None
    why = why_not(msg)
    if why:
        refuse(conn, why)
        return None
    return msg


def refuse(conn: Connection, why: str) -> None:
    with contextlib.suppress(OSError):
        conn.send(Refused(why))
    close_quietly(conn)


@dataclass
class TrainerSegments:
    """The record or snapshot slots and the progress counters made in named shared memory
    for a trainer that takes a process over (the first trainer's died with it), and
    optionally a staging buffer for its full checkpoints."""

    segments: list[Any]
    slots: torch.Tensor
    counters: Counters
    info: dict[str, Any]
    """What the trainer attaches them by (for ``Ready``)."""
    staging: torch.Tensor | None = None
    """The staging buffer (``staging_bytes`` of :meth:`make`), or None."""

    @classmethod
    def make(cls, prefix: str, n: int, row_bytes: int, staging_bytes: int = 0) -> TrainerSegments:
        """``n`` slots of ``row_bytes``, the counters and, with ``staging_bytes``, a
        staging buffer of that size. Their pages are allocated from here on, on a thread
        (:func:`lowdiff.proc.holder.populate_soon`; the contents stay as they are, so a
        trainer may already write them): the trainer's first snapshot, record and full
        checkpoint then find them allocated instead of allocating and zeroing them page
        by page on its critical path."""
        made: list[Any] = []
        try:
            slots = rp.create_segment(f"{prefix}-slots", n * row_bytes)
            made.append(slots)
            ctr = rp.create_segment(f"{prefix}-ctr", channel.N_COUNTERS * 8)
            made.append(ctr)
            staging = None
            if staging_bytes > 0:
                stage = rp.create_segment(f"{prefix}-stage", staging_bytes)
                made.append(stage)
                staging = rp.segment_tensor(stage, staging_bytes)
        except BaseException:
            for shm in made:
                rp.unlink_and_close(shm)
            raise
        counters = torch.frombuffer(ctr.buf, dtype=torch.int64, count=channel.N_COUNTERS)
        counters.zero_()
        rp.populate_soon([made[0], *made[2:]])
        info: dict[str, Any] = {
            "slots": slots.name,
            "counters": ctr.name,
            "n_slots": n,
            "row_bytes": row_bytes,
        }
        if staging is not None:
            info["staging"], info["staging_bytes"] = stage.name, staging_bytes
        return cls(
            made,
            rp.segment_tensor(slots, n * row_bytes).view(n, row_bytes),
            Counters(counters),
            info,
            staging,
        )

    @property
    def n_slots(self) -> int:
        return int(self.info["n_slots"])

    def unlink(self) -> None:
        for shm in self.segments:
            rp.unlink_and_close(shm)
        self.segments = []


def refusing_newcomers(
    listener: TakeoverListener, what: str, released: Callable[[], bool]
) -> Callable[[], bool]:
    """The ``idle`` check of a process serving a trainer that took it over: answer any
    other trainer that tries to, and say whether the process was released."""

    def idle() -> bool:
        listener.refuse_waiting(Refused(f"another trainer took this {what} over"))
        return released()

    return idle


def serve_new_trainer(
    conn: Connection, request: Any, info: dict[str, Any], idle: Callable[[], bool]
) -> ChildEnd:
    """Answer ``Ready`` with ``info`` to the trainer that sent ``request`` (an
    :class:`~lowdiff.engine.messages.Adopt`) on ``conn``, after taking on its environment;
    the process's new end of the link, which watches that trainer by its pid."""
    use_env(request.env)
    if request.authkey:
        multiprocessing.current_process().authkey = request.authkey
    end = ChildEnd(conn, conn, trainer_pid=request.pid, idle=idle)
    end.ready(info)
    return end

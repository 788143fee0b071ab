"""Taking over a background process that outlived its trainer.

A process that keeps state in memory for the next trainer (LowDiff+'s replica, Gemini's
holder) listens on a socket in the abstract namespace (:class:`AdoptionListener`): the
address and a random key are published in its control block, which only the same user
can read. A new trainer connects with them (:func:`connect`), asks to take the process
over, and on success talks to it over that connection as it would over the pipes of a
process it started (:meth:`lowdiff.proc.link.ProcessLink.attach`). The process watches
the trainer that took it over by its pid (:class:`lowdiff.proc.link.ChildEnd`).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

ATTACH_WAIT_S = 5.0
"""How long a connection to the socket has to send its request to take the process over."""


class AdoptionListener:
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
        threading.Thread(target=self._accept, daemon=True, name="lowdiff-adopt").start()

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

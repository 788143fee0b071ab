"""LowDiff+'s peer copies, the replica process's side: the links to the replicas it
trades with.

In a job across nodes (:mod:`lowdiff.ddp.peers`) each replica also keeps a copy of
another node's shard, its *source*'s. Under DDP the copy's parameters and optimizer state
are updated from the averaged gradients this rank's trainer snapshots anyway; what
differs per rank (its RNG states, its model buffers, its scheduler and extra state) comes
from the source's replica, as a *part* per step. Under ``fully_shard`` the copy is a
mirror: the part is the source's whole snapshot slot (and, at the start, its whole
state).

- this replica forwards its own part of every step it receives to the replica that keeps
  its copy (its *holder*), and the holder answers with an *ack* once the copy merged it;
- it takes its source's parts on a socket of its own; a copy merges step ``t`` only with
  the source's part of it, and the replica's own shard waits for the copy, so that both
  always hold one step (:class:`lowdiff.engine.replica.main.ReplicaProcess`);
- a source whose trainer is gone says which part was its last (*end*); a source that is
  gone altogether closes the socket. Either way no step after it can be merged.

A part travels as plain bytes (names, dtypes, shapes): never as shared memory, which does
not cross a node.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import torch

from lowdiff.engine.wire.configs import PeerConfig
from lowdiff.format.dtypes import dtype_from_name, dtype_name

PackedTensors = list[tuple[str, str, tuple[int, ...], bytes]]


def pack(tensors: dict[str, torch.Tensor]) -> PackedTensors:
    """``tensors`` (on the CPU) as plain bytes."""
    out = []
    for name, t in tensors.items():
        c = t.detach().contiguous()
        out.append(
            (
                name,
                dtype_name(c.dtype),
                tuple(c.shape),
                c.view(-1).view(torch.uint8).numpy().tobytes(),
            )
        )
    return out


def unpack(items: PackedTensors) -> dict[str, torch.Tensor]:
    """The tensors :func:`pack` made."""
    out = {}
    for name, dt, shape, raw in items:
        flat = (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            if raw
            else torch.empty(0, dtype=torch.uint8)
        )
        out[name] = flat.view(dtype_from_name(dt)).reshape(shape)
    return out


@dataclass
class Part:
    """A source's per-rank state at one step: the state after the update of ``step - 1``
    (``kind`` "step": ``meta`` is the step's record document as sent) or the state a
    replica started from (``kind`` "init": ``meta`` holds JSON texts ``rng``,
    ``scheduler`` and, when there is one, ``extra``)."""

    kind: str
    step: int
    tensors: dict[str, torch.Tensor]
    meta: Any


class PeerLinks:
    """This replica's two peer links (see the module docstring).

    Args:
        cfg: the peer copy's configuration (addresses and keys).
        on_ack: called (on a thread) with each step the holder acknowledges.
        timeout: how long a start waits for the other replica to answer.
    """

    def __init__(self, cfg: PeerConfig, on_ack: Callable[[int], None], timeout: float) -> None:
        self.cfg, self.on_ack, self.timeout = cfg, on_ack, timeout
        self.listener = Listener((str(cfg.listen[0]), int(cfg.listen[1])), authkey=cfg.key)
        self._cv = threading.Condition()
        self._parts: dict[int, Part] = {}
        self.source_end: int | None = None
        """The source's last step (it said so), or None."""
        self.source_gone = False
        """The source's connection closed: no part comes any more."""
        self.source_seen = False
        self._in: Connection | None = None
        self._in_lock = threading.Lock()
        self._out: Connection | None = None
        self._out_q: queue.Queue[Any] = queue.Queue()
        self._queued = self._handled = 0
        self.holder_error: str | None = None
        """Why parts no longer reach the holder, or None."""
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="lowdiff-peer-in").start()
        threading.Thread(target=self._send, daemon=True, name="lowdiff-peer-out").start()

    # ------------------------------------------------------------------ the source
    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self.listener.accept()
            except Exception:  # noqa: BLE001 -- a failed handshake; the listener closed
                if self._closed:
                    return
                continue
            with self._in_lock:
                old, self._in = self._in, conn
            if old is not None:
                with contextlib.suppress(Exception):
                    old.close()
            with self._cv:
                self.source_seen, self.source_gone = True, False
                self._cv.notify_all()
            self._read_source(conn)

    def _read_source(self, conn: Connection) -> None:
        try:
            while True:
                msg = conn.recv()
                with self._cv:
                    if msg[0] == "part":
                        _, kind, step, tensors, meta = msg
                        self._parts[step] = Part(kind, step, unpack(tensors), meta)
                        self.source_end = None  # taken over: its new trainer goes on
                    elif msg[0] == "end":
                        self.source_end = int(msg[1])
                    self._cv.notify_all()
        except (EOFError, OSError):
            with self._cv:
                if conn is self._in:
                    self.source_gone = True
                self._cv.notify_all()

    def take_part(self, step: int, kind: str, timeout: float, *, final: bool) -> Part | None:
        """The source's part of ``step``, once it arrived; None when it never will (the
        source is gone, or, when ``final``, its trainer was gone before that step: a
        source taken over by a new trainer goes on sending, so a replica whose own
        trainer lives waits) or ``timeout`` seconds passed."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                part = self._parts.get(step)
                if part is not None and part.kind == kind:
                    for s in [s for s in self._parts if s <= step]:
                        del self._parts[s]
                    return part
                ended = final and self.source_end is not None and self.source_end < step
                if self.source_gone or ended:
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(min(left, 1.0))

    def ack(self, step: int) -> None:
        """Tell the source its copy holds ``step``."""
        with self._in_lock:
            conn = self._in
            if conn is None:
                return
            with contextlib.suppress(Exception):
                conn.send(("ack", step))

    # ------------------------------------------------------------------ the holder
    def forward(self, kind: str, step: int, tensors: dict[str, torch.Tensor], meta: Any) -> None:
        """Send this replica's part of ``step`` to the holder (in the background)."""
        self._put(("part", kind, step, pack(tensors), meta))

    def end(self, step: int) -> None:
        """Tell the holder no part after ``step`` comes (this replica's trainer is gone)."""
        self._put(("end", step))

    def _put(self, msg: Any) -> None:
        self._queued += 1
        self._out_q.put(msg)

    def _connect(self) -> Connection | None:
        cfg = self.cfg
        deadline = time.monotonic() + self.timeout
        while not self._closed:
            try:
                return Client(
                    (str(cfg.holder_address[0]), int(cfg.holder_address[1])),
                    authkey=cfg.holder_key,
                )
            except OSError as e:
                if time.monotonic() > deadline:
                    self.holder_error = (
                        f"the replica of rank {cfg.holder} (at {cfg.holder_address[0]}:"
                        f"{cfg.holder_address[1]}) did not answer within {self.timeout:g} s: {e}"
                    )
                    return None
                time.sleep(0.05)
        return None

    def _send(self) -> None:
        while True:
            msg = self._out_q.get()
            if msg is None:
                return
            try:
                self._send_one(msg)
            finally:
                self._handled += 1

    def _send_one(self, msg: Any) -> None:
        if self._out is None:
            if self.holder_error is not None:
                return
            self._out = self._connect()
            if self._out is None:
                print(f"lowdiff: peer copy: {self.holder_error}", file=sys.stderr, flush=True)
                return
            threading.Thread(
                target=self._read_acks, args=(self._out,), daemon=True, name="lowdiff-peer-ack"
            ).start()
        try:
            self._out.send(msg)
        except (OSError, ValueError) as e:
            self.holder_error = f"the connection to rank {self.cfg.holder}'s replica broke: {e}"
            with contextlib.suppress(Exception):
                self._out.close()
            self._out = None

    def _read_acks(self, conn: Connection) -> None:
        with contextlib.suppress(EOFError, OSError):
            while True:
                msg = conn.recv()
                if msg[0] == "ack":
                    self.on_ack(int(msg[1]))

    def flush(self, timeout: float) -> None:
        """Wait (up to ``timeout`` s) until everything queued for the holder was sent."""
        deadline = time.monotonic() + timeout
        while self._handled < self._queued and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        self._closed = True
        self._out_q.put(None)
        with contextlib.suppress(Exception):
            self.listener.close()
        for conn in (self._in, self._out):
            if conn is not None:
                _shut(conn)


def _shut(conn: Connection) -> None:
    """Close ``conn`` so that the other end sees it closed at once: a plain ``close()``
    leaves the socket open while a thread of this process still waits to read from it."""
    with contextlib.suppress(Exception), socket.socket(fileno=os.dup(conn.fileno())) as s:
        s.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(Exception):
        conn.close()

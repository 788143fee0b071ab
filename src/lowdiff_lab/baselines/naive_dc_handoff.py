"""The trainer's end of Naive DC's checkpointing process (:mod:`lowdiff_lab.baselines.naive_dc_writer`).

Records go to the process through shared-memory slots, one pool per kind of record (one
slot for full checkpoints, ``max_inflight`` for differentials): the trainer packs a
record into a free slot and sends its place; the process copies it out and frees the slot.
Slots are allocated (and reallocated, larger, when a record outgrows them, once every
slot is idle) here. One :class:`~lowdiff.proc.link.ProcessLink` carries the messages;
waits last as long as the process lives (a write of any size takes what it takes).
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path

import torch

from lowdiff.proc.holder import ensure_shm_space
from lowdiff.proc.link import ProcessLink
from lowdiff.proc.protocol import Close, Closed, Flush, Flushed, Kind, Message, unexpected
from lowdiff_lab.baselines.naive_dc_record import ALIGN
from lowdiff_lab.baselines.naive_dc_writer import (
    NdcFreed,
    NdcRecord,
    NdcSlots,
    NdcWritten,
    writer_main,
)

WHAT = "the checkpointing process"
"""How errors name the process."""


class Pool:
    """Shared-memory slots of one kind of record; grown (all slots idle) when too small."""

    def __init__(self, name: str, n: int) -> None:
        self.name, self.n = name, n
        self.gen = 0
        self.size = 0
        self.buffers: list[torch.Tensor] = []
        self.free: list[int] = []


class Handoff:
    """The checkpointing process seen from the trainer: slots, records out, reports in.

    Args:
        root: the checkpoint directory.
        keep_full: full checkpoints the process keeps (retention).
        start_timeout: seconds to wait for the process to start, or to exit when closed.
        max_inflight: differential slots (records handed off and not yet taken).
        stats: the checkpointer's ``stats``; ``handoff_wait_s`` and the written bytes and
            times (``{full,diff}_bytes``, ``{full,diff}_write_s``, ``bytes_written``,
            ``write_s``) are kept here.
    """

    def __init__(
        self,
        root: Path,
        keep_full: int | None,
        start_timeout: float,
        max_inflight: int,
        stats: dict[str, float],
    ) -> None:
        self.root, self.keep_full, self.start_timeout = root, keep_full, start_timeout
        self.stats = stats
        self.link = ProcessLink(
            WHAT, stall_timeout=math.inf, start_timeout=start_timeout, on_message=self._on_message
        )
        self.pools = {"full": Pool("full", 1), "diff": Pool("diff", max_inflight)}
        self.handed_off = False
        """Whether a record was handed off (the process then has something to write)."""
        self.durable = -1

    # ------------------------------------------------------------------ the process
    def start(self) -> None:
        """Spawn the process; :meth:`ensure_ready` waits for it at the first hand-off."""
        if not self.link.started:
            self.link.launch(writer_main, (str(self.root), self.keep_full), name="lowdiff-naive-dc")
            self.handed_off = False

    def ensure_ready(self) -> None:
        """Wait until the process is ready for its first hand-off."""
        self.start()
        if not self.link.ready:
            self.link.wait(lambda: self.link.ready, "'ready'", timeout=self.start_timeout)
        self.handed_off = True

    def _on_message(self, msg: Message) -> None:
        match msg:
            case NdcFreed():
                pool = self.pools[msg.pool]
                if msg.gen == pool.gen:
                    pool.free.append(msg.slot)
            case NdcWritten():
                self.stats[f"{msg.pool}_bytes"] += msg.nbytes
                self.stats[f"{msg.pool}_write_s"] += msg.seconds
                self.stats["bytes_written"] += msg.nbytes
                self.stats["write_s"] += msg.seconds
                self.durable = max(self.durable, msg.step)
            case Flushed() | Closed():
                self.durable = max(self.durable, msg.durable)
            case _:
                raise unexpected(msg)

    # ------------------------------------------------------------------ slots
    def acquire(self, name: str, nbytes: int) -> tuple[int, torch.Tensor]:
        """A free slot of pool ``name`` that holds ``nbytes``, as ``(slot, buffer)``
        (waits for the process to free one)."""
        pool = self.pools[name]
        t0 = time.perf_counter()
        if nbytes > pool.size:
            self.link.wait(lambda: len(pool.free) == len(pool.buffers), f"idle {name} slots")
            size = max(ALIGN, nbytes + nbytes // 8)  # headroom for a state that grows a little
            ensure_shm_space(size * pool.n, f"the {pool.name} hand-off slots")
            pool.buffers = []  # give the old slots back before taking new ones
            pool.buffers = [
                torch.empty(size, dtype=torch.uint8).share_memory_() for _ in range(pool.n)
            ]
            pool.gen += 1
            pool.size = size
            pool.free = list(range(pool.n))
            self.link.send(NdcSlots(pool.name, pool.gen, pool.buffers))
        self.link.wait(lambda: bool(pool.free), f"a free {name} slot")
        self.stats["handoff_wait_s"] += time.perf_counter() - t0
        slot = pool.free.pop()
        return slot, pool.buffers[slot]

    def generation(self, name: str) -> int:
        """The generation of pool ``name`` (what a record's message names)."""
        return self.pools[name].gen

    def send(self, msg: NdcRecord) -> None:
        """Hand a record packed in its slot to the process."""
        self.link.send(msg)

    # ------------------------------------------------------------------ flush and close
    def _request(self, msg: Message, reply: Kind) -> None:
        self.link.request(msg, reply)

    def flush(self) -> None:
        """Wait until every record handed off is durable."""
        if self.link.started and self.handed_off:
            self._request(Flush(), Kind.FLUSHED)

    def shutdown(self, closing: bool) -> None:
        """Stop the process: after :meth:`flush` when ``closing``; else (the checkpointer
        was dropped) the closed pipe makes it write what it was handed and exit on its
        own, and it is not waited for. A process handed nothing has nothing to write."""
        proc = self.link.proc
        if proc is not None:
            if not self.handed_off:
                proc.kill()
            elif closing and self.link.error is None and proc.is_alive():
                with contextlib.suppress(Exception):  # a failure was raised by close() already
                    self._request(Close(), Kind.CLOSED)
            self.link.close_pipes()
            if closing or not self.handed_off:
                self.link.stop(self.start_timeout)
        for pool in self.pools.values():
            pool.buffers, pool.free, pool.size = [], [], 0

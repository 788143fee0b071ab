"""Naive DC's checkpointing process, and the messages it takes and sends.

Spawned by the trainer (:class:`lowdiff.proc.link.ProcessLink`), outside the trainer's
process group, like lowdiff's own:

0) (process) takes ``DIR/.lowdiff.writer.lock``, reports :class:`~lowdiff.proc.protocol.Ready`;
1) (trainer) :class:`NdcSlots`: the shared-memory slots of a pool (``"full"`` or
   ``"diff"``), sent again, with the next generation, whenever the pool grows;
2) (trainer) :class:`NdcFull` / :class:`NdcDiff`: a record is packed in a slot. The
   process copies it out, frees the slot (:class:`NdcFreed`), ``torch.save``-s it
   atomically with its commit file (after a full checkpoint: retention) and reports
   :class:`NdcWritten`: the step is durable;
3) (trainer) :class:`~lowdiff.proc.protocol.Flush` / :class:`~lowdiff.proc.protocol.Close`:
   answered with the durable step (and, for ``Close``, the process exits).

An exception ends the process with :class:`~lowdiff.proc.protocol.Failed`, raised again in
the trainer. A trainer that dies (SIGKILL included) leaves a process that writes every
record it was handed, in order, then exits; the next ``resume()`` waits for its lock.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, ClassVar

import torch

from lowdiff.format import layout
from lowdiff.proc.child_end import ChildEnd
from lowdiff.proc.locks import acquire_flock
from lowdiff.proc.protocol import Close, Closed, Flush, Flushed, Kind, Message, unexpected
from lowdiff.proc.spawn import detach_from_trainer_group
from lowdiff_lab.baselines.files import commit_path, published, save_state
from lowdiff_lab.baselines.naive_dc_record import (
    DIFF_DIR,
    DIFF_PREFIX,
    FULL_PREFIX,
    SUFFIX,
    unpack,
)

# --------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class NdcSlots(Message):
    """trainer -> process: the slots of pool ``pool`` from now on."""

    kind: ClassVar[Kind] = Kind.NDC_SLOTS
    pool: str
    gen: int
    """Generation of the pool (grows whenever it is reallocated)."""
    buffers: list[torch.Tensor] = field(repr=False)


@dataclass(frozen=True)
class NdcRecord(Message):
    """trainer -> process: the record of ``step`` lies in slot ``slot`` of generation ``gen``."""

    pool: ClassVar[str]
    """The pool its slot belongs to, which is also how its file and statistics are named."""
    gen: int
    slot: int
    step: int
    spec: Any = field(repr=False)
    """The record, with a :class:`~lowdiff_lab.baselines.naive_dc_record.SlotRef` per tensor."""


@dataclass(frozen=True)
class NdcFull(NdcRecord):
    """A full checkpoint (the whole state)."""

    kind: ClassVar[Kind] = Kind.NDC_FULL
    pool: ClassVar[str] = "full"


@dataclass(frozen=True)
class NdcDiff(NdcRecord):
    """A differential checkpoint."""

    kind: ClassVar[Kind] = Kind.NDC_DIFF
    pool: ClassVar[str] = "diff"


@dataclass(frozen=True)
class NdcFreed(Message):
    """process -> trainer: slot ``slot`` of pool ``pool`` (generation ``gen``) is free."""

    kind: ClassVar[Kind] = Kind.NDC_FREED
    pool: str
    gen: int
    slot: int


@dataclass(frozen=True)
class NdcWritten(Message):
    """process -> trainer: the record of ``step`` is published (durable)."""

    kind: ClassVar[Kind] = Kind.NDC_WRITTEN
    pool: str
    """``"full"`` or ``"diff"``."""
    step: int
    nbytes: int
    seconds: float


# --------------------------------------------------------------------------- the process


def retain(root: Path, keep_full: int | None) -> None:
    """Keep the newest ``keep_full`` full checkpoints and the differentials after the oldest."""
    if keep_full is None:
        return
    fulls = published(root / layout.FULL_DIR, FULL_PREFIX, SUFFIX)
    if not fulls:
        return
    oldest_kept = fulls[max(0, len(fulls) - keep_full)][0]
    remove = [p for s, p in fulls if s < oldest_kept]
    remove += [p for s, p in published(root / DIFF_DIR, DIFF_PREFIX, SUFFIX) if s < oldest_kept]
    for p in remove:
        for q in (commit_path(p), p):  # the commit first: a file without one is never loaded
            with contextlib.suppress(FileNotFoundError):
                q.unlink()


class Writer:
    """The checkpointing process's state: the slots it was given and what it wrote."""

    def __init__(self, root: Path, keep_full: int | None, end: ChildEnd) -> None:
        self.root, self.keep_full, self.end = root, keep_full, end
        self.pools: dict[str, tuple[int, list[torch.Tensor]]] = {}
        self.durable = -1
        self.broken = False
        """Orphaned only: a differential was lost, so none is written before the next full."""

    def handle(self, msg: Message) -> bool:
        """Handle one request; returns False when the process should stop."""
        match msg:
            case NdcSlots():
                self.pools[msg.pool] = (msg.gen, msg.buffers)
            case NdcRecord():
                have, buffers = self.pools.get(msg.pool, (-1, []))
                if have != msg.gen:
                    raise RuntimeError(
                        f"{msg.pool} record of step {msg.step} refers to slots never received"
                    )
                record = unpack(msg.spec, buffers[msg.slot])
                self.end.send(NdcFreed(msg.pool, msg.gen, msg.slot))
                self.write(msg.pool, msg.step, record)
            case Flush():
                self.end.send(Flushed(self.durable))
            case Close():
                self.end.send(Closed(self.durable))
                return False
            case _:
                raise unexpected(msg)
        return True

    def handle_orphaned(self, msg: Message) -> bool:
        """:meth:`handle` after the trainer died: write what can be written, in order."""
        if isinstance(msg, NdcDiff) and self.broken:
            return True
        try:
            return self.handle(msg)
        except Exception:  # noqa: BLE001 -- a record whose slots died with the trainer
            if isinstance(msg, (NdcDiff, NdcSlots)):
                self.broken = True
            return True

    def write(self, pool: str, step: int, record: Any) -> None:
        """Publish the record of ``step`` (after a full checkpoint: retention)."""
        t0 = time.perf_counter()
        if pool == NdcFull.pool:
            d = self.root / layout.FULL_DIR
            d.mkdir(exist_ok=True)
            nbytes = save_state(d / f"{FULL_PREFIX}{step:012d}{SUFFIX}", record, step=step)
            retain(self.root, self.keep_full)
            self.broken = False
        else:
            d = self.root / DIFF_DIR
            d.mkdir(exist_ok=True)
            nbytes = save_state(d / f"{DIFF_PREFIX}{step:012d}{SUFFIX}", record, step=step)
        self.durable = max(self.durable, step)
        self.end.send(NdcWritten(pool, step, nbytes, time.perf_counter() - t0))


def writer_main(
    root: str, keep_full: int | None, requests: Connection, results: Connection
) -> None:
    """Entry point of the checkpointing process (spawned)."""
    detach_from_trainer_group()
    torch.set_num_threads(1)  # leave the cores to training
    end = ChildEnd(requests, results)
    w = Writer(Path(root), keep_full, end)
    lock_fd = None
    try:
        lock_fd = acquire_flock(Path(root) / layout.WRITER_LOCK_FILE, blocking=True)
        end.ready()
        if end.serve(w.handle):
            # the trainer died without close(): write every record it handed off
            end.drain(w.handle_orphaned, (Kind.NDC_SLOTS, Kind.NDC_FULL, Kind.NDC_DIFF))
    except BaseException as e:  # noqa: BLE001 -- sent back and raised in the trainer
        end.failed(e)
        raise SystemExit(1) from None
    finally:
        if lock_fd is not None:
            os.close(lock_fd)

"""The messages between a trainer and lowdiff's own checkpointing processes.

LowDiff's writer (:mod:`lowdiff.engine.writer.main`) takes :class:`Record`,
:class:`Stage`, :class:`Full`, :class:`BatchSize`, ``Flush`` and ``Close``; LowDiff+'s
replica (:mod:`lowdiff.engine.replica.main`) takes :class:`Step`, :class:`Stage`,
:class:`Init`, ``Flush`` and ``Close``. Once its trainer is gone, either takes
:class:`TakeoverRequest` from the next one (:mod:`lowdiff.engine.process.takeover`).
Both answer with the shared replies of :mod:`lowdiff.proc.protocol` and
:class:`Durable`, :class:`FullDone`, :class:`Merged`.
Most progress (slots consumed, records written, the durable step) goes through the
shared counters of :mod:`lowdiff.proc.channel` instead, with no message at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lowdiff.proc.protocol import Kind, Message, SlotMessage


@dataclass(frozen=True)
class Record(SlotMessage):
    """LowDiff: the record of step ``step`` is complete in slot ``slot``; ``meta`` is the
    record's JSON document (hyperparameters, RNG, scheduler, extra state)."""

    kind: ClassVar[Kind] = Kind.RECORD
    wire: ClassVar[bytes] = b"R"


@dataclass(frozen=True)
class Step(SlotMessage):
    """LowDiff+: the gradient snapshot of step ``step`` is complete in slot ``slot``."""

    kind: ClassVar[Kind] = Kind.STEP
    wire: ClassVar[bytes] = b"S"


@dataclass(frozen=True)
class Stage(Message):
    """The shared staging buffer that full checkpoints are copied into (sent when it is
    first made or grown)."""

    kind: ClassVar[Kind] = Kind.STAGE
    buffer: torch.Tensor


@dataclass(frozen=True)
class Full(Message):
    """LowDiff: write the full checkpoint of ``step`` from the staging buffer."""

    kind: ClassVar[Kind] = Kind.FULL
    step: int
    entries: list[Any]
    """``[name, dtype, shape, start, end]`` of each tensor in the staging buffer."""
    meta: dict[str, str]


@dataclass(frozen=True)
class Init(Full):
    """LowDiff+: (re)build the replica from the state in the staging buffer."""

    kind: ClassVar[Kind] = Kind.INIT


@dataclass(frozen=True)
class BatchSize(Message):
    """LowDiff: write the partial batch, then batch ``b`` records per file."""

    kind: ClassVar[Kind] = Kind.BATCH_SIZE
    b: int


@dataclass(frozen=True)
class Durable(Message):
    """A full checkpoint of ``step`` is on disk (the durable point of LowDiff+, and of
    LowDiff before its first record file)."""

    kind: ClassVar[Kind] = Kind.DURABLE
    step: int


@dataclass(frozen=True)
class FullDone(Message):
    """A full checkpoint was written: its size, the seconds it took, files retired."""

    kind: ClassVar[Kind] = Kind.FULL_DONE
    step: int
    nbytes: int
    seconds: float
    removed: int


@dataclass(frozen=True)
class RemoteError(Message):
    """LowDiff with ``remote=``: an attempt to upload to the remote tier failed (it is
    retried; the local tier goes on). ``text`` names the object and the error."""

    kind: ClassVar[Kind] = Kind.REMOTE_ERROR
    text: str


@dataclass(frozen=True)
class Merged(Message):
    """LowDiff+: the replica holds the initial state, at ``step`` (the merges of the
    steps after it are counted in the shared counters, ``REPLICA_MERGES``)."""

    kind: ClassVar[Kind] = Kind.MERGED
    step: int


@dataclass(frozen=True)
class TakeoverRequest(Message):
    """To a checkpointing process whose trainer died (LowDiff's writer, LowDiff+'s
    replica): this trainer takes the process over.

    The trainer has recovered the state at ``step`` (from disk, or copied out of the
    replica's memory). The process checks that ``cfg`` (a ``WriterConfig`` or
    ``ReplicaConfig``) is its own run, layout, directory and retention, and that it holds
    ``step``; it makes ``slots`` new slots and new counters in named shared memory, takes
    the trainer's environment, and answers ``Ready`` with their names (or ``Refused``,
    and why)."""

    kind: ClassVar[Kind] = Kind.TAKEOVER
    pid: int
    step: int
    slots: int
    cfg: Any
    env: dict[str, str]
    """The trainer's environment, which the process takes as its own (as a process the
    trainer starts does)."""
    authkey: bytes = b""
    """The trainer's ``multiprocessing`` key, which the process takes too: a shared tensor
    the trainer sends later (a staging buffer) is fetched from the trainer with it."""

"""The one protocol between a trainer and its background processes.

Every message is a frozen dataclass whose class names its :class:`Kind`. A process's
messages are defined next to the process (LowDiff's writer, LowDiff+'s replica, the
baselines' processes); the messages every process shares are here:

- :class:`Ready` (process -> trainer): started, holds its locks, takes requests.
- :class:`Failed` (process -> trainer): an exception ended the process; the trainer
  raises it again as :class:`lowdiff.CheckpointWorkerError` with the child's traceback.
- :class:`Flush` / :class:`Flushed` and :class:`Close` / :class:`Closed`: make what was
  handed over durable (and, for ``Close``, exit); the reply carries the durable step.
- :class:`Refused` (process -> trainer): the answer of a process that outlived its
  trainer to a new trainer that may not take it over (:mod:`lowdiff.proc.takeover_socket`).

Messages travel pickled through a ``multiprocessing`` pipe (shared-memory tensors by
handle, as ``torch.multiprocessing`` sends them), except the one sent at every training
step: a :class:`SlotMessage` (a slot is filled) travels in a fixed binary form of its own
(:func:`encode`, :func:`decode`): inside a training step, where it runs from cold caches,
about 40 µs of the trainer's time against 60 to 75 µs for a pickle.
A receiver dispatches on the message's class (``match msg: case Record(...)``) or on
``msg.kind``; an unknown message is an error, never ignored.
"""

from __future__ import annotations

import builtins
import enum
import os
import struct
import traceback
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any, ClassVar

from lowdiff.errors import ArgumentTypeError, InvalidArgumentError

STORAGE_ERRORS = frozenset(
    c.__name__
    for c in vars(builtins).values()
    if isinstance(c, type) and issubclass(c, OSError) and not issubclass(c, ConnectionError)
)
"""Names of the errors that come from the storage (a full disk, an I/O error), as opposed
to a bug or a lost process: OSError and its subclasses, except the ones a closed pipe
between two processes raises."""


class Kind(enum.Enum):
    """Every kind of message, of every background process."""

    # every process
    READY = "ready"
    FAILED = "failed"
    FLUSH = "flush"
    FLUSHED = "flushed"
    CLOSE = "close"
    CLOSED = "closed"
    REFUSED = "refused"
    # LowDiff's checkpointing process (lowdiff.engine.writer)
    RECORD = "record"
    STAGE = "stage"
    FULL = "full"
    BATCH_SIZE = "batch_size"
    DURABLE = "durable"
    FULL_DONE = "full_done"
    REMOTE_ERROR = "remote_error"
    # LowDiff+'s replica (lowdiff.engine.replica)
    STEP = "step"
    INIT = "init"
    MERGED = "merged"
    TAKEOVER = "takeover"
    # CheckFreq's persist process
    CF_STAGE = "cf_stage"
    CF_PERSIST = "cf_persist"
    CF_DONE = "cf_done"
    # Naive DC's writer
    NDC_SLOTS = "ndc_slots"
    NDC_FULL = "ndc_full"
    NDC_DIFF = "ndc_diff"
    NDC_FREED = "ndc_freed"
    NDC_WRITTEN = "ndc_written"
    # Gemini's holder
    GM_ATTACH = "gm_attach"
    GM_ATTACHED = "gm_attached"
    GM_REFUSED = "gm_refused"
    GM_ALLOC = "gm_alloc"
    GM_ALLOCED = "gm_alloced"
    GM_DONE = "gm_done"
    GM_PEER_DONE = "gm_peer_done"
    GM_ACK = "gm_ack"
    GM_RESUME = "gm_resume"
    GM_RESUMED = "gm_resumed"
    GM_PERSISTED = "gm_persisted"


@dataclass(frozen=True)
class Message:
    """Base of every message; ``kind`` names the subclass."""

    kind: ClassVar[Kind]


_SLOT_HEAD = struct.Struct("<cqq")
_SLOT_KINDS: dict[bytes, type[SlotMessage]] = {}


@dataclass(frozen=True)
class SlotMessage(Message):
    """Base of the per-step messages "the slot ``slot`` holds step ``step``" (LowDiff's
    record, LowDiff+'s gradient snapshot), with the step's JSON document ``meta``.

    A subclass names the tag byte of its wire form (``wire``, never ``b"\\x80"``, the
    first byte of every pickle :func:`encode` writes): a tag, the slot and the step as
    two little-endian int64, then ``meta`` in UTF-8.
    """

    wire: ClassVar[bytes]
    slot: int
    step: int
    meta: str

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        tag = cls.__dict__.get("wire")
        if tag is not None and (
            len(tag) != 1 or tag == b"\x80" or _SLOT_KINDS.setdefault(tag, cls) is not cls
        ):
            raise ArgumentTypeError(f"{cls.__name__}: wire tag {tag!r} is not one free byte")


def encode(msg: Message) -> bytes | memoryview:
    """The bytes of ``msg`` on a pipe: the wire form of a :class:`SlotMessage`, a pickle
    (``ForkingPickler``: shared tensors by handle) of anything else."""
    if isinstance(msg, SlotMessage):
        return _SLOT_HEAD.pack(msg.wire, msg.slot, msg.step) + msg.meta.encode()
    return ForkingPickler.dumps(msg)


def decode(raw: bytes | memoryview) -> Any:
    """The message :func:`encode` wrote (raises on bytes that are neither form)."""
    cls = _SLOT_KINDS.get(bytes(raw[:1]))
    if cls is None:
        return ForkingPickler.loads(raw)
    if len(raw) < _SLOT_HEAD.size:
        raise InvalidArgumentError(f"a {cls.__name__} message of {len(raw)} bytes is cut short")
    _, slot, step = _SLOT_HEAD.unpack_from(raw)
    return cls(slot, step, bytes(raw[_SLOT_HEAD.size :]).decode())


@dataclass(frozen=True)
class Ready(Message):
    kind: ClassVar[Kind] = Kind.READY
    pid: int = field(default_factory=os.getpid)
    info: dict[str, Any] | None = None
    """What the process reports about itself (a holder's state, say)."""


@dataclass(frozen=True)
class Failed(Message):
    kind: ClassVar[Kind] = Kind.FAILED
    name: str
    """The exception's class name."""
    text: str
    traceback: str

    @staticmethod
    def of(exc: BaseException) -> Failed:
        """The message for ``exc`` (call inside its ``except`` block: takes its traceback)."""
        return Failed(type(exc).__name__, str(exc), traceback.format_exc())

    @property
    def storage(self) -> bool:
        """Whether the error came from the storage (see :data:`STORAGE_ERRORS`)."""
        return self.name in STORAGE_ERRORS


@dataclass(frozen=True)
class Flush(Message):
    kind: ClassVar[Kind] = Kind.FLUSH


@dataclass(frozen=True)
class Flushed(Message):
    kind: ClassVar[Kind] = Kind.FLUSHED
    durable: int = -1


@dataclass(frozen=True)
class Close(Message):
    kind: ClassVar[Kind] = Kind.CLOSE


@dataclass(frozen=True)
class Closed(Message):
    kind: ClassVar[Kind] = Kind.CLOSED
    durable: int = -1


@dataclass(frozen=True)
class Refused(Message):
    """(process -> a trainer that asked to take it over) No, and why."""

    kind: ClassVar[Kind] = Kind.REFUSED
    reason: str


def unexpected(msg: Any) -> RuntimeError:
    """The error for a message its receiver does not handle."""
    kind = getattr(msg, "kind", None)
    return RuntimeError(f"unexpected message {kind.value if kind else type(msg).__name__!r}")

"""What Gemini's trainer and its holder process share: the messages, the holder's start
configuration, the buffer numbering and the names of the files.

The trainer talks to the holder through :class:`lowdiff.proc.link.ProcessLink`; the
holder answers through :class:`lowdiff.proc.child_end.ChildEnd`. Every message below is a
frozen dataclass of :mod:`lowdiff.proc.protocol`, with the shared ``Ready``, ``Failed``,
``Flush``/``Flushed`` and ``Close``/``Closed`` beside them. Requests and their replies::

    GmAttach  -> GmAttached | GmRefused   a new trainer, through the holder's socket
    GmAlloc   -> GmAlloced                (re)allocate one of the four buffers
    GmDone    -> GmAck(own=True)          a checkpoint of this rank is complete
    GmPeerDone-> GmAck(own=False)         the predecessor rank's checkpoint is complete
    GmResume  -> GmResumed                the trainer goes on from a step
    Flush     -> Flushed, Close -> Closed persist the newest checkpoint (and exit)
                 GmPersisted              (unasked) a checkpoint reached the disk
"""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from lowdiff.proc.protocol import Kind, Message

PREFIX, SUFFIX = "ckpt-", ".pt"
"""A persisted checkpoint is ``full/ckpt-<step:012d>.pt``."""
OWN = (0, 1)
"""Buffer indices of this rank's own checkpoints."""
PEER = (2, 3)
"""Buffer indices of the predecessor rank's checkpoints (DDP)."""
N_BUFFERS = 4


def checkpoint_file(full_dir: Path, step: int) -> Path:
    """The file that holds the persisted checkpoint of ``step``."""
    return full_dir / f"{PREFIX}{step:012d}{SUFFIX}"


def other_buffer(pair: tuple[int, int], cur: int) -> int:
    """The buffer of ``pair`` that does not hold the newest complete checkpoint."""
    return pair[1] if cur == pair[0] else pair[0]


@dataclass(frozen=True)
class HolderConfig:
    """How the trainer that spawns a holder sets it up (fixed for the holder's life)."""

    root: str
    run_id: str
    """Names the holder's segments and its descriptor (a fresh uuid per holder)."""
    layout_id: str
    """The model's layout: a trainer of another model is refused."""
    address: str
    """Abstract Unix socket name (without the leading NUL) new trainers attach through."""
    authkey: bytes
    full_every: int
    persist_every: int
    keep_full: int | None
    idle_timeout: float
    persisted: int
    """Newest step on disk when the holder starts (-1: none)."""
    trainer_pid: int

    @staticmethod
    def new(
        root: Path,
        layout_id: str,
        *,
        full_every: int,
        persist_every: int,
        keep_full: int | None,
        idle_timeout: float,
        persisted: int,
        trainer_pid: int,
    ) -> HolderConfig:
        """The configuration of a new holder: a fresh run id, socket name and key."""
        run_id = uuid.uuid4().hex
        return HolderConfig(
            str(root),
            run_id,
            layout_id,
            f"lowdiff-gemini-{run_id}",
            secrets.token_bytes(32),
            full_every,
            persist_every,
            keep_full,
            idle_timeout,
            persisted,
            trainer_pid,
        )


@dataclass(frozen=True)
class HolderState:
    """What the holder tells a trainer about itself when it starts, when the trainer
    attaches and when it resumes: its buffers and the checkpoints they hold."""

    run_id: str
    buffers: tuple[tuple[str | None, int], ...]
    """``(segment name or None, capacity in bytes)`` of each of the four buffers."""
    cur: int
    """The buffer of the newest complete own checkpoint (-1: none)."""
    step: int
    """That checkpoint's step (-1: none)."""
    peer_cur: int
    """The buffer of the predecessor's newest complete checkpoint (-1: none)."""
    persisted: int
    """Newest step on disk (-1: none)."""

    def info(self) -> dict[str, Any]:
        """The form that ``Ready`` carries."""
        return {"gemini": self}

    @staticmethod
    def from_info(info: dict[str, Any] | None) -> HolderState:
        state = None if info is None else info.get("gemini")
        if not isinstance(state, HolderState):
            raise RuntimeError(f"the holder process reported {info!r}, not its state")
        return state


@dataclass(frozen=True)
class GmAttach(Message):
    """(new trainer -> holder, through the holder's socket) Serve this trainer from now on."""

    kind: ClassVar[Kind] = Kind.GM_ATTACH
    pid: int
    """The trainer's pid: the holder watches it (an attached trainer is not its parent)."""
    layout_id: str


@dataclass(frozen=True)
class GmAttached(Message):
    """The holder serves the trainer that asked to attach."""

    kind: ClassVar[Kind] = Kind.GM_ATTACHED
    state: HolderState


@dataclass(frozen=True)
class GmRefused(Message):
    """The holder does not serve the trainer that asked to attach."""

    kind: ClassVar[Kind] = Kind.GM_REFUSED
    reason: str


@dataclass(frozen=True)
class GmAlloc(Message):
    """Give buffer ``buffer`` at least ``nbytes`` (a new segment; the old one is dropped)."""

    kind: ClassVar[Kind] = Kind.GM_ALLOC
    buffer: int
    nbytes: int


@dataclass(frozen=True)
class GmAlloced(Message):
    """Buffer ``buffer`` is now segment ``name`` of ``capacity`` bytes."""

    kind: ClassVar[Kind] = Kind.GM_ALLOCED
    buffer: int
    name: str
    capacity: int


@dataclass(frozen=True)
class GmDone(Message):
    """The copy of this rank's checkpoint of ``step`` into ``buffer`` is complete."""

    kind: ClassVar[Kind] = Kind.GM_DONE
    seq: int
    """Numbers the checkpoints handed over (own and peer), for :class:`GmAck`."""
    buffer: int
    step: int
    entries: list[list[Any]]
    """Where each tensor lies in the buffer (:func:`lowdiff.proc.holder.entries_to_json`)."""
    meta: dict[str, str]
    """The checkpoint's metadata, in the form a full checkpoint's metadata takes."""


@dataclass(frozen=True)
class GmPeerDone(Message):
    """(DDP) Rank ``rank``'s checkpoint of ``step`` arrived complete in ``buffer``."""

    kind: ClassVar[Kind] = Kind.GM_PEER_DONE
    seq: int
    buffer: int
    step: int
    rank: int
    entries: list[list[Any]]
    meta: dict[str, str]


@dataclass(frozen=True)
class GmAck(Message):
    """The holder published checkpoint ``seq`` (of ``step``) as complete."""

    kind: ClassVar[Kind] = Kind.GM_ACK
    seq: int
    step: int
    own: bool
    """This rank's checkpoint (True) or the predecessor's copy (False)."""


@dataclass(frozen=True)
class GmResume(Message):
    """The trainer goes on from ``step``; the disk holds ``disk_step``. A newer checkpoint
    in the holder belongs to a timeline that was given up, and is dropped."""

    kind: ClassVar[Kind] = Kind.GM_RESUME
    step: int
    disk_step: int


@dataclass(frozen=True)
class GmResumed(Message):
    """The holder's state once it has taken :class:`GmResume` into account."""

    kind: ClassVar[Kind] = Kind.GM_RESUMED
    state: HolderState


@dataclass(frozen=True)
class GmPersisted(Message):
    """The checkpoint of ``step`` is on disk (``nbytes`` written in ``seconds``)."""

    kind: ClassVar[Kind] = Kind.GM_PERSISTED
    step: int
    nbytes: int
    seconds: float

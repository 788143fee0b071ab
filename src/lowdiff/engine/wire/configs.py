"""The configurations a checkpointing process is started (or taken over) with.

The trainer builds them (:mod:`lowdiff.engine.trainer.writer_backend`,
:mod:`lowdiff.engine.trainer.replica_backend`) and sends them with the process's start, or
inside a :class:`~lowdiff.engine.wire.messages.TakeoverRequest`; the process reads them
(:mod:`lowdiff.engine.writer`, :mod:`lowdiff.engine.replica`). Plain frozen dataclasses:
they are pickled across the boundary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from lowdiff.ddp.context import rank_dir
from lowdiff.plan import DEFAULT_MTBF_S


@dataclass(frozen=True)
class RemoteSettings:
    """``remote=``, ``remote_options``, ``remote_bandwidth`` and ``remote_timeout`` of
    :class:`lowdiff.Checkpointer`, as a checkpointing process takes them."""

    url: str
    options: dict[str, Any] | None = None
    bandwidth: float | None = None
    timeout: float = 60.0
    """Seconds ``Close`` waits for uploads that make no progress before it answers."""
    tier: str = ""
    """Under DDP: the shard directory's folder in the job directory (``url`` is the
    job's remote tier; see :class:`lowdiff.remote.uploader.Uploader`)."""
    publishes: tuple[str, ...] = ()
    """Under DDP: the job's folders whose manifest this rank publishes (rank 0's)."""
    siblings: tuple[str, ...] = ()
    """Under DDP: the folders of every shard of this generation (remote retention)."""

    def for_shard(self, job: Path, shard: Path, rank: int, world_size: int) -> RemoteSettings:
        """These settings for rank ``rank``'s shard directory ``shard`` of the job in
        ``job``: the job directory's layout, mirrored under ``url``. Rank 0 publishes the
        job's manifest and its generation's, as it writes them locally."""
        tier = PurePosixPath(shard.relative_to(job).as_posix())
        gen = "" if tier.parent == PurePosixPath(".") else tier.parent.as_posix()
        siblings = tuple(rank_dir(Path(gen), r).as_posix() for r in range(world_size))
        publishes = tuple(dict.fromkeys(("", gen))) if rank == 0 else ()
        return dataclasses.replace(
            self, tier=tier.as_posix(), publishes=publishes, siblings=siblings
        )


@dataclass(frozen=True)
class WriterConfig:
    """What LowDiff's writer (:mod:`lowdiff.engine.writer.main`) is started with."""

    root: str
    batch_size: int
    keep_full: int | None
    row_bytes: int
    layout_id: str
    run_id: str
    follows: str | None = None
    """The run that produced the state this session resumed from (``RecoveryStats.
    state_run_id``): the ``follows`` of its first record file. None for a fresh session
    (its first records follow its own step-0 full checkpoint) or an unknown run."""
    remote: RemoteSettings | None = None
    """The remote tier (``remote=``), or None: no upload thread."""
    idle_timeout: float = 0.0
    """Seconds the writer waits for a new trainer after its trainer died
    (:mod:`lowdiff.engine.process.takeover`); 0: it exits once it wrote what it was sent."""
    trainer_pid: int = 0
    """The trainer served: a trainer that let go of the writer and lives on (a
    Checkpointer dropped without ``close()``) is not waited for."""


@dataclass(frozen=True)
class PeerConfig:
    """LowDiff+'s peer copies (:mod:`lowdiff.ddp.peers`), as a replica takes them: the
    shard it copies, and how it reaches the replicas it trades with."""

    source: int
    """The rank whose shard this replica also keeps a copy of."""
    shard: list[int]
    """That shard's optimizer indices."""
    layout: dict[str, Any]
    """That shard's record layout (its own replica's)."""
    slot_layout: dict[str, Any]
    """The snapshot slots' layout: under DDP the gradients of this rank's shard and of the
    source's; a mirror's, the source's own."""
    listen: tuple[str, int]
    """The address this replica takes the source's connection on."""
    key: bytes
    """The key that connection authenticates with."""
    holder: int
    """The rank whose replica keeps the copy of this replica's shard."""
    holder_address: tuple[str, int]
    holder_key: bytes
    timeout: float = 120.0
    """Seconds a replica waits for the other replicas' answers and parts."""
    mirror: bool = False
    """Under ``fully_shard``: no rank holds another's gradients, so the copy mirrors the
    source's replica, fed with its snapshot slots (sent whole, as the source's part),
    and starts from the source's own state (``layout`` and ``shard`` come with it)."""


@dataclass(frozen=True)
class ReplicaConfig:
    """What LowDiff+'s replica (:mod:`lowdiff.engine.replica.main`) is started with."""

    root: str
    run_id: str
    layout: dict[str, Any]
    optimizer: str
    persist_every: int | str
    keep_full: int | None
    idle_timeout: float
    threads: int
    shard: list[int] | None = None
    """Under DDP: the optimizer indices this replica holds (its optimizer numbers them 0..n-1)."""
    remote: RemoteSettings | None = None
    """The remote tier its persisted full checkpoints are uploaded to (``remote=``)."""
    mtbf: float = DEFAULT_MTBF_S
    """Seconds between failures that ``persist_every="auto"`` plans for (``mtbf=``)."""
    peer: PeerConfig | None = None
    """In a job across nodes: the peer copy this replica keeps, or None."""

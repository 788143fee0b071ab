"""Full checkpoints written by a checkpointing process, and retention.

Run by both of lowdiff's checkpointing processes: LowDiff's writer
(:mod:`lowdiff.engine.writer`) writes the full checkpoints its trainer stages, LowDiff+'s
replica (:mod:`lowdiff.engine.replica`) persists snapshots of itself
(:class:`lowdiff.engine.replica.replica.Persister`). One full checkpoint is written at a
time, on a thread; retention runs after each one.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lowdiff.ddp.context import rank_dir
from lowdiff.engine.wire.messages import Durable, FullDone
from lowdiff.errors import CorruptCheckpointError
from lowdiff.format import layout, sfile
from lowdiff.format.atomic import fault_point
from lowdiff.proc.protocol import Message


def retention(
    root: Path, keep_full: int | None, protect: Callable[[], set[Path]] | None = None
) -> list[Path]:
    """Delete the full checkpoints and records that no recovery can need any more.

    Runs in the checkpointing process after each full checkpoint it publishes, on its own
    directory ``root``. It keeps the newest ``keep_full`` full checkpoints, deletes the
    older ones, and deletes the record files that end before the oldest one kept.

    In a distributed job (``root`` is a shard ``JOB/rank-NNNNN/`` of a directory with a
    job manifest) a shard's newest full checkpoints are of no use on their own: recovery
    starts from a full checkpoint that *every* shard holds. So the oldest step kept is
    never newer than :func:`job_retention_floor`, the newest full checkpoint every shard
    holds: that one, every newer one of this shard and every record file of this shard
    that reaches it or later stay, and a crash of any rank at any moment (one still
    writing, or killed during, its next full checkpoint) leaves a full checkpoint common
    to all shards. A single-process directory is not affected.

    ``keep_full=None`` keeps everything. ``protect()`` names files to keep whatever their
    step (those the remote tier has not committed yet). Returns the deleted paths.

    Example:
        >>> retention(Path("runs/ckpt/rank-00000"), keep_full=1)  # doctest: +SKIP
        [PosixPath('runs/ckpt/rank-00000/full/full-000000000000.safetensors'), ...]
    """
    if keep_full is None:
        return []
    fulls = sorted(_full_steps(root).items())
    if len(fulls) <= keep_full:
        return []
    oldest_kept = fulls[-keep_full][0]
    floor = job_retention_floor(root)
    if floor is not None:
        oldest_kept = min(oldest_kept, floor)
    removed = [p for s, p in fulls if s < oldest_kept]
    for p in (root / layout.RECORDS_DIR).glob("rec-*.safetensors"):
        r = layout.parse_records_name(p.name)
        if r is not None and r[1] < oldest_kept:
            removed.append(p)
    if protect is not None:
        keep = protect()
        removed = [p for p in removed if p not in keep]
    for p in removed:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
        fault_point("retention", p)
    return removed


def _full_steps(root: Path) -> dict[int, Path]:
    """The full checkpoints in ``root/full/`` by step, from their names alone."""
    return {
        s: p
        for p in (root / layout.FULL_DIR).glob("full-*.safetensors")
        if (s := layout.parse_full_name(p.name)) is not None
    }


def job_world_size(shard: Path) -> int | None:
    """The world size of the distributed job ``shard`` belongs to, or None.

    ``shard`` belongs to a job when its parent holds a readable job manifest (see
    :func:`lowdiff.recovery.job.is_job_dir`) and ``shard`` is one of the job's rank
    directories.
    """
    # imported here: a process that never writes into a job does without recovery's modules
    from lowdiff.recovery.job import JOB_KIND

    job = shard.parent
    try:
        manifest = layout.read_manifest(job)
        world = int(manifest["world_size"]) if manifest.get("kind") == JOB_KIND else 0
    except (CorruptCheckpointError, KeyError, TypeError, ValueError):
        return None
    if world < 1 or shard.name not in {rank_dir(job, r).name for r in range(world)}:
        return None
    return world


def job_retention_floor(shard: Path) -> int | None:
    """The step below which retention may delete in a shard of a distributed job.

    The newest full checkpoint that every shard of the job holds, by the names in each
    shard's ``full/`` directory (a listing per shard, no file is opened). When no step is
    held by all of them yet, or a shard cannot be listed, it is 0: nothing may go. None
    when ``shard`` is not part of a distributed job (see :func:`job_world_size`).

    Why this is safe while the other shards' processes write and delete concurrently:
    every shard's files are published whole (atomic rename) in step order, and a shard
    deletes a full checkpoint only below a step it has just seen in every shard. The
    newest step ever seen in every shard is thus deleted by no shard, and stays common.
    A shard's full checkpoint that is present but damaged counts as held, as
    ``keep_full`` counts it in a single process.
    """
    world = job_world_size(shard)
    if world is None:
        return None
    common: set[int] | None = None
    for r in range(world):
        try:
            steps = set(_full_steps(rank_dir(shard.parent, r)))
        except OSError:
            return 0
        common = steps if common is None else common & steps
    return max(common) if common else 0


class FullWriter:
    """Writes one full checkpoint at a time in a background thread, then applies retention.

    ``on_released`` runs as soon as the data blob may be reused (after the write, or after
    a failure). ``announce_durable`` sends :class:`~lowdiff.engine.wire.messages.Durable`: a full checkpoint
    is the durable point of LowDiff+, while LowDiff's durable point is its newest record.
    """

    def __init__(
        self,
        root: Path,
        keep_full: int | None,
        send: Callable[[Message], None],
        *,
        announce_durable: bool = False,
        on_released: Any = None,
        progress: Any = None,
        on_written: Callable[[Path], None] | None = None,
        protect: Callable[[], set[Path]] | None = None,
    ) -> None:
        self.root, self.keep_full, self.send = root, keep_full, send
        self.announce_durable, self.on_released = announce_durable, on_released
        self.progress = progress
        self.on_written, self.protect = on_written, protect
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.persisted = -1
        self.next_auto = 0.0
        """Earliest time for the next "as often as the disk keeps up" write (at most 50 % duty)."""
        self.took = 0.0
        """Seconds the last write took (with retention), 0 before the first."""
        self.started_at = -math.inf
        """When the last write began (``time.monotonic``)."""

    @property
    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def start(
        self, step: int, entries: list[sfile.TensorEntry], blob: torch.Tensor, meta: dict[str, str]
    ) -> None:
        self.wait()
        self.started_at = time.monotonic()
        self.thread = threading.Thread(
            target=self._write, args=(step, entries, blob, meta), daemon=True
        )
        self.thread.start()

    def _write(
        self, step: int, entries: list[sfile.TensorEntry], blob: torch.Tensor, meta: dict[str, str]
    ) -> None:
        released = False
        try:
            t0 = time.perf_counter()
            path = layout.full_path(self.root, step)
            nbytes = sfile.write(
                path,
                entries,
                blob,
                meta,
                progress=self.progress,
                direct=True,  # from the shared staging buffer, bypassing the page cache
            )
            released = True
            if self.on_released is not None:
                self.on_released()
            if self.on_written is not None:
                self.on_written(path)
            removed = retention(self.root, self.keep_full, self.protect)
            took = time.perf_counter() - t0
            self.took = took
            self.next_auto = time.monotonic() + took
            self.persisted = max(self.persisted, step)
            if self.announce_durable:
                self.send(Durable(step))
            self.send(FullDone(step, nbytes, took, len(removed)))
        except BaseException as e:  # noqa: BLE001 -- raised in the owner's thread by wait()
            self.error = e
            if not released and self.on_released is not None:
                self.on_released()

    def wait(self) -> None:
        """Wait for the write in flight; raise if it failed."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            # the original exception (an OSError stays an OSError), with the writer
            # thread's frames in its traceback
            err, self.error = self.error, None
            raise err

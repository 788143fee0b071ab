"""The checkpoint directory of a session: its lock, its manifest, its cleanup.

:class:`CheckpointDir` is this rank's directory (under DDP a shard directory
``JOB/[gen-G/]rank-NNNNN/`` of the job directory), locked for the session, and the run
this session writes it as. Only the methods that write (``"lowdiff"``, ``"lowdiff+"``)
have one.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from pathlib import Path
from typing import Any

from lowdiff.ddp.context import DistContext
from lowdiff.engine.wire.configs import RemoteSettings
from lowdiff.errors import CheckpointMismatchError, LowDiffError
from lowdiff.format import layout
from lowdiff.format.atomic import remove_stale_temps
from lowdiff.proc.holder import forget_released, release_orphan
from lowdiff.proc.locks import lock_directory, wait_for_writer
from lowdiff.recovery.job import generations, is_job_dir, rank_root
from lowdiff.recovery.quarantine import quarantine_beyond
from lowdiff.recovery.replay import RecoveryStats
from lowdiff.recovery.scan import check_directory, is_empty_dir


class CheckpointDir:
    """Check and lock the checkpoint directory (this rank's shard directory under DDP).

    Args:
        directory: the directory given (the job directory under DDP).
        dist: the DDP context, or None in a single process.
    """

    def __init__(self, directory: str | os.PathLike[str], dist: DistContext | None) -> None:
        self.dist = dist
        self.root = Path(directory)
        self.job_root: Path | None = None
        if dist is not None:
            self.job_root = self.root
            check_directory(self.job_root)
            # the newest generation's shard at this world size, else the next generation's
            self.root = rank_root(self.job_root, dist.rank, dist.world_size)
        elif is_job_dir(self.root):
            raise CheckpointMismatchError(
                f"{self.root} is a distributed job's directory: continue it under "
                "torchrun (any number of ranks, 1 included), or read a step of it "
                "with lowdiff.restore() / lowdiff export"
            )
        self.lock_fd: int | None = _lock(
            self.root, "; two trainers cannot write to one checkpoint directory"
        )
        self.run_id = uuid.uuid4().hex
        """The run this session writes as (a process it took over: that process's run)."""

    def continue_run(self, run_id: str) -> None:
        """Write as ``run_id`` from now on (a process of that run was taken over)."""
        self.run_id = run_id

    def remote_settings(self, remote: RemoteSettings | None) -> RemoteSettings | None:
        """The remote tier as this rank's checkpointing process takes it (under DDP:
        placed at this shard's folder of the job), or None."""
        if remote is None or self.dist is None:
            return remote
        assert self.job_root is not None
        return remote.for_shard(self.job_root, self.root, self.dist.rank, self.dist.world_size)

    def switch_root(self, root: Path) -> None:
        """Under DDP: make ``root`` this rank's shard directory (locked) instead of the one
        chosen at construction."""
        if root == self.root:
            return
        fd = _lock(root)
        self.release_lock()
        self.root, self.lock_fd = root, fd

    def release_lock(self) -> None:
        if self.lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.lock_fd)
            self.lock_fd = None

    def wait_for_previous_writer(self, timeout: float, since: float | None = None) -> None:
        """A killed trainer's checkpointing process may still be flushing: wait for it.
        One that waits for a new trainer (and is not taken over) is released first: it
        exits once it has persisted what it holds. The whole wait, from ``since`` (a
        ``time.monotonic()`` value; by default now), lasts at most ``timeout`` seconds."""
        start = time.monotonic() if since is None else since

        def left() -> float:
            return max(0.0, start + timeout - time.monotonic())

        released = release_orphan(self.root, left())
        wait_for_writer(self.root, left(), since=start)
        forget_released(self.root, released)

    def job_holds_checkpoints(self) -> bool:
        """(all ranks, under DDP) Whether any rank finds a checkpoint in the job: in a
        shard directory of any generation, or in its own shard directory."""
        assert self.dist is not None and self.job_root is not None
        held = any(not is_empty_dir(d) for g in generations(self.job_root) for d in g.shard_dirs())
        return bool(self.dist.all_max([int(held or not is_empty_dir(self.root))])[0])

    def remove_stale_temps(self) -> None:
        """Delete temp files a killed writer left in this directory (never published files)."""
        for d in (self.root, self.root / layout.FULL_DIR, self.root / layout.RECORDS_DIR):
            remove_stale_temps(d)

    def quarantine_beyond(self, stats: RecoveryStats) -> None:
        """Move files that are damaged or lie past the recovered step out of the chain."""
        quarantine_beyond(self.root, stats, self.run_id)

    def make_dirs(self) -> None:
        (self.root / layout.FULL_DIR).mkdir(exist_ok=True)
        (self.root / layout.RECORDS_DIR).mkdir(exist_ok=True)

    def write_manifest(self, body: dict[str, Any]) -> None:
        """Publish the manifest of this session, before any file of it: ``runs`` lists
        every run that wrote into the directory, this one last, so that a reader refuses a
        file of any other run (copied from elsewhere). A directory whose manifest predates
        the list gets none (what its older files came from is unknown)."""
        runs = self._runs_before()
        if runs is not None:
            body["runs"] = [*(r for r in runs if r != self.run_id), self.run_id]
        layout.write_manifest(self.root, body)

    def _runs_before(self) -> list[str] | None:
        """The runs the directory's manifest lists ([] when it has none to list: a new
        directory, or one without a checkpoint file yet); None when they are unknown."""
        if is_empty_dir(self.root):
            return []
        try:
            runs = layout.read_manifest(self.root).get("runs")
        except LowDiffError:
            return None
        return [str(r) for r in runs] if isinstance(runs, list) else None

    def read_manifest(self) -> dict[str, Any]:
        return layout.read_manifest(self.root)


def _lock(root: Path, why: str = "") -> int:
    check_directory(root)
    return lock_directory(root, why)

"""The trainer's side of the remote tier (``remote=``): waiting for it, and its errors.

:func:`wait_remote` is ``Checkpointer.flush(remote=True)`` after the flush;
:func:`check_closed` runs at the end of ``close()``. Both raise :class:`lowdiff.RemoteStorageError` when this rank's
uploads stalled or, under DDP, when the job's remote durable step is behind the job's
durable step (another rank's stalled: its own error names the failure).
"""

from __future__ import annotations

from lowdiff.engine.trainer.progress import Progress
from lowdiff.engine.trainer.session import ProcessSession, remote_stalled
from lowdiff.errors import RemoteStorageError
from lowdiff.proc import channel


def _job_behind(url: str, remote: int, durable: int, why: str) -> RemoteStorageError:
    return RemoteStorageError(
        f"the remote tier {url} can recover step {remote} of the job, the local tier step "
        f"{durable}: {why}"
    )


def wait_remote(
    session: ProcessSession | None, progress: Progress, url: str, timeout: float
) -> int:
    """(after a flush) Wait until the remote tier can recover the durable step.

    Waits as long as uploads make progress within ``timeout`` seconds; then raises
    :class:`lowdiff.RemoteStorageError` (the local tier is not affected). Under DDP a
    collective call: each rank waits for its own shard's uploads, then the ranks
    exchange their remote durable steps (every rank takes part, even one whose wait
    failed), and each raises when its own wait failed or when the job's remote durable
    step is behind the job's durable step (another rank's failed).

    Args:
        session: the checkpointing process, or None when nothing runs (checkpointing
            not started, closed, or suspended): the remote durable step as it stands.

    Returns:
        The newest step the remote tier can recover (under DDP: every shard's).
    """
    if session is None:
        return progress.remote_durable_step()
    failed: RemoteStorageError | None = None
    try:
        session.wait_remote(progress.durable, timeout, url)
    except RemoteStorageError as e:
        if progress.job is None:
            raise
        failed = e
    if progress.job is None:
        return progress.remote_durable
    job_durable, job_remote = progress.job.now(*progress.figures())
    if failed is not None:
        raise failed
    if job_remote < job_durable:
        raise _job_behind(
            url, job_remote, job_durable,
            f"another rank's uploads made no progress for {timeout:g} s (its own error names "
            "the failure)",
        )  # fmt: skip
    return job_remote


def stats(session: ProcessSession | None, progress: Progress) -> dict[str, float]:
    """The remote tier's part of ``Checkpointer.stats`` (empty before the process runs)."""
    if session is None or session.counters is None:
        return {}
    c = session.counter
    return {
        "remote_durable_step": progress.remote_durable_step(),
        "remote_files": c(channel.REMOTE_FILES),
        "remote_bytes": c(channel.REMOTE_BYTES),
        "remote_upload_s": c(channel.REMOTE_NS) / 1e9,
        "remote_errors": c(channel.REMOTE_ERRORS),
    }


def check_closed(progress: Progress, url: str, timeout: float, settled: bool) -> None:
    """After ``close()``: raise when this rank's remote tier is behind its local one, or
    (under DDP, once the final exchange ``settled``) the job's is behind the job's."""
    if progress.remote_durable < progress.durable:
        raise RemoteStorageError(remote_stalled(url, timeout, progress))
    job = progress.job
    if settled and job is not None and job.values[1] < job.values[0]:
        raise _job_behind(
            url, job.values[1], job.values[0],
            "another rank's uploads stalled (its own close() names the failure)",
        )  # fmt: skip

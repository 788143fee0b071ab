"""The trainer's side of the remote tier (``remote=``): waiting for it, and its errors.

:func:`flush_remote` is ``Checkpointer.flush(remote=True)``; :func:`check_closed` runs at
the end of ``close()``. Both raise :class:`lowdiff.RemoteStorageError` when this rank's
uploads stalled or, under DDP, when the job's remote durable step is behind the job's
durable step (another rank's stalled: its own error names the failure).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lowdiff.engine.session import remote_stalled
from lowdiff.errors import InvalidArgumentError, RemoteStorageError
from lowdiff.proc import channel

if TYPE_CHECKING:
    from lowdiff.engine.base import EngineStrategy


def _job_behind(url: str, remote: int, durable: int, why: str) -> RemoteStorageError:
    return RemoteStorageError(
        f"the remote tier {url} can recover step {remote} of the job, the local tier step "
        f"{durable}: {why}"
    )


def flush_remote(s: EngineStrategy) -> int:
    """``s.flush()``, then wait until the remote tier can recover the durable step.

    Waits as long as uploads make progress within ``remote_timeout`` seconds; then
    raises :class:`lowdiff.RemoteStorageError` (the local tier is not affected). Under
    DDP a collective call: each rank waits for its own shard's uploads, then the ranks
    exchange their remote durable steps (every rank takes part, even one whose wait
    failed), and each raises when its own wait failed or when the job's remote durable
    step is behind the job's durable step (another rank's failed).

    Returns:
        The newest step the remote tier can recover (under DDP: every shard's).
    """
    url, timeout = s.options.remote, s.options.remote_timeout
    if url is None:
        raise InvalidArgumentError("flush(remote=True) needs remote=... (no remote tier is configured)")
    s.flush()
    core, session = s.core, s.session
    if session is None or not core.started or core.closed or s.policy.suspended:
        return core.remote_durable_step()
    failed: RemoteStorageError | None = None
    try:
        session.wait_remote(core.durable, timeout, url)
    except RemoteStorageError as e:
        if core.job is None:
            raise
        failed = e
    if core.job is None:
        return core.remote_durable
    job_durable, job_remote = core.job.now(*core.figures())
    if failed is not None:
        raise failed
    if job_remote < job_durable:
        raise _job_behind(
            url, job_remote, job_durable,
            f"another rank's uploads made no progress for {timeout:g} s (its own error names "
            "the failure)",
        )  # fmt: skip
    return job_remote


def stats(s: EngineStrategy) -> dict[str, float]:
    """The remote tier's part of ``Checkpointer.stats`` (empty before the process runs)."""
    session = s.session
    if session is None or session.counters is None:
        return {}
    c = session.counter
    return {
        "remote_durable_step": s.core.remote_durable_step(),
        "remote_files": c(channel.REMOTE_FILES),
        "remote_bytes": c(channel.REMOTE_BYTES),
        "remote_upload_s": c(channel.REMOTE_NS) / 1e9,
        "remote_errors": c(channel.REMOTE_ERRORS),
    }


def check_closed(s: EngineStrategy, settled: bool) -> None:
    """After ``close()``: raise when this rank's remote tier is behind its local one, or
    (under DDP, once the final exchange ``settled``) the job's is behind the job's."""
    core, url = s.core, s.options.remote
    assert url is not None
    if core.remote_durable < core.durable:
        raise RemoteStorageError(remote_stalled(url, s.options.remote_timeout, core))
    if settled and core.job is not None and core.job.values[1] < core.job.values[0]:
        raise _job_behind(
            url, core.job.values[1], core.job.values[0],
            "another rank's uploads stalled (its own close() names the failure)",
        )  # fmt: skip

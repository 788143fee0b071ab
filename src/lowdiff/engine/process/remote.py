"""The remote tier in a checkpointing process: its upload thread.

LowDiff's writer (:mod:`lowdiff.engine.writer`) and LowDiff+'s replica
(:mod:`lowdiff.engine.replica`) each run one :class:`lowdiff.remote.uploader.Uploader`
when the session has ``remote=``
(:class:`~lowdiff.engine.wire.configs.RemoteSettings`). It reports through the
process's shared counters (``REMOTE_*`` of :mod:`lowdiff.proc.channel`) and sends
:class:`~lowdiff.engine.wire.messages.RemoteError` for each failed attempt, to whichever
trainer the process serves at that moment.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from lowdiff.engine.wire.configs import RemoteSettings
from lowdiff.engine.wire.messages import RemoteError
from lowdiff.proc.channel import (
    BEAT,
    REMOTE_BEAT,
    REMOTE_BYTES,
    REMOTE_DURABLE,
    REMOTE_ERRORS,
    REMOTE_FILES,
    REMOTE_NS,
    Counters,
)
from lowdiff.proc.protocol import Message
from lowdiff.remote.uploader import Uploader


def start_uploader(
    root: Path,
    remote: RemoteSettings,
    keep_full: int | None,
    counters: Callable[[], Counters],
    send: Callable[[Message], None],
) -> Uploader:
    """Start the upload thread of the checkpoint directory ``root`` (the process holds
    its writer lock: the thread cleans the remote first). ``counters()`` are the shared
    counters of the trainer served now (LowDiff+ makes new ones for a trainer that takes
    the process over: :func:`announce` then carries the remote durable step over)."""
    counted = [0, 0, 0.0]  # files, bytes, seconds already added to the counters
    up: Uploader | None = None

    def progress() -> None:
        c = counters()
        c.add(REMOTE_BEAT)
        if up is not None and up.uploaded != counted[0]:
            c.add(REMOTE_FILES, up.uploaded - int(counted[0]))
            c.add(REMOTE_BYTES, up.uploaded_bytes - int(counted[1]))
            c.add(REMOTE_NS, int((up.upload_s - counted[2]) * 1e9))
            counted[:] = [up.uploaded, up.uploaded_bytes, up.upload_s]

    def error(text: str) -> None:
        counters().add(REMOTE_ERRORS)
        send(RemoteError(text))

    up = Uploader(
        root,
        remote.url,
        remote.options,
        keep_full=keep_full,
        bandwidth=remote.bandwidth,
        on_durable=lambda step: counters().raise_to(REMOTE_DURABLE, step + 1),
        on_progress=progress,
        on_error=error,
        tier=remote.tier,
        publishes=remote.publishes,
        siblings=remote.siblings,
    )
    up.start()
    return up


def announce(up: Uploader | None, counters: Counters) -> None:
    """Carry the remote durable step over to new counters."""
    if up is not None and up.durable >= 0:
        counters.raise_to(REMOTE_DURABLE, up.durable + 1)


def drain(
    up: Uploader | None, remote: RemoteSettings | None, counters: Callable[[], Counters]
) -> None:
    """Wait for the uploads (at ``Close``, or before an orphaned process exits) as long
    as they make progress within ``remote.timeout``; the trainer's wait sees ``BEAT``."""
    if up is not None and remote is not None:
        up.drain(remote.timeout, beat=lambda: counters().add(BEAT))

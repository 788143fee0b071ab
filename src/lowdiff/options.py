"""Option groups of :class:`lowdiff.Checkpointer`: small frozen objects that check
themselves when they are made.

- :class:`ReplicaOptions`: LowDiff+'s CPU replica (how far it may lag, how often it is
  persisted, how many threads update it).
- :class:`RemoteOptions`: the remote tier (an fsspec URL and how to reach it).
- :class:`Timeouts`: how long lowdiff waits for its background processes, and on
  SIGTERM.

A bad value is an :class:`lowdiff.InvalidArgumentError` (a ``ValueError``) or an
:class:`lowdiff.ArgumentTypeError` (a ``TypeError``) that names the option.

Example:
    >>> import lowdiff
    >>> lowdiff.ReplicaOptions(max_lag=4).max_lag
    4
    >>> lowdiff.RemoteOptions("s3://bucket/run", timeout=30).timeout
    30.0
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from lowdiff.errors import ArgumentTypeError, InvalidArgumentError

AUTO: Literal["auto"] = "auto"


def check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int >= ``minimum``, or a clear error naming it."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_int_or_auto(name: str, value: Any) -> int | str:
    """An int >= 1 or ``"auto"``."""
    if isinstance(value, str):
        if value != AUTO:
            raise InvalidArgumentError(f"{name} must be an int >= 1 or 'auto', got {value!r}")
        return value
    return check_int(name, value, 1)


def check_seconds(name: str, value: Any, *, zero: bool = False) -> float:
    """A number of seconds, > 0 (``zero``: >= 0)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if not ok or not (value >= 0 if zero else value > 0):
        bound = ">= 0" if zero else "> 0"
        raise InvalidArgumentError(f"{name} must be a number of seconds {bound}, got {value!r}")
    return float(value)


def _set(obj: object, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


@dataclasses.dataclass(frozen=True)
class ReplicaOptions:
    """LowDiff+'s CPU replica (``method="lowdiff+"``).

    Args:
        max_lag: how many steps the replica may trail the trainer before ``step()``
            waits; also the number of gradient snapshot buffers (at least 2 with
            :func:`lowdiff.attach`).
        persist_every: persist the replica every this many steps, or ``"auto"``: at the
            Young–Daly interval ``sqrt(2 C M)`` seconds (C the time one persist took, M
            the MTBF, ``mtbf=``), writing at most half the time; under DDP every
            ``full_every`` steps, the same steps on every rank.
        threads: parallel shards of the replica's update (whole tensors, balanced by
            size, one thread each; the same bits as one thread).
        peer_copies: in a job across several nodes, also keep a copy of another node's
            shard in this rank's replica (under DDP updated from the averaged gradient
            every rank already holds; under ``fully_shard`` a mirror fed with that rank's
            snapshot slots), so that the job resumes from memory when a whole node is lost
            (docs/guides/failures.md). ``"auto"`` (the default): on when the job spans
            more than one node (``WORLD_SIZE > LOCAL_WORLD_SIZE``); ``False``: off;
            ``True``: required (an error where it cannot apply).
        peer_address: the address this node's replicas listen on for their peers. By
            default ``LOWDIFF_PEER_ADDR``, else this host's address on the route to
            ``MASTER_ADDR`` (the interface the job's own traffic takes).
    """

    max_lag: int = 2
    persist_every: int | Literal["auto"] = AUTO
    threads: int = 1
    peer_copies: bool | Literal["auto"] = AUTO
    peer_address: str | None = None

    def __post_init__(self) -> None:
        check_int("ReplicaOptions.max_lag", self.max_lag, 1)
        if self.persist_every != AUTO:
            check_int("ReplicaOptions.persist_every", self.persist_every, 1)
        check_int("ReplicaOptions.threads", self.threads, 1)
        if self.peer_copies != AUTO and not isinstance(self.peer_copies, bool):
            raise ArgumentTypeError(
                f"ReplicaOptions.peer_copies must be True, False or 'auto', got {self.peer_copies!r}"
            )
        if self.peer_address is not None and (
            not isinstance(self.peer_address, str) or not self.peer_address
        ):
            raise ArgumentTypeError(
                f"ReplicaOptions.peer_address must be a host name or address, got {self.peer_address!r}"
            )


@dataclasses.dataclass(frozen=True)
class RemoteOptions:
    """The remote tier: every record file and full checkpoint is also uploaded there.

    Args:
        url: any fsspec URL (``"s3://bucket/run"``, ``"gcs://..."``,
            ``"file:///mnt/shared/run"``). Under DDP each rank uploads its own shard
            directory to the same relative folder under it.
        storage_options: keyword arguments for the fsspec file system (credentials,
            ``endpoint_url``, ``client_kwargs``, ...), passed through unchanged.
        bandwidth: upload cap in bytes per second; None: no cap.
        timeout: seconds ``flush(remote=True)`` and ``close()`` wait for uploads that
            make no progress before they raise :class:`lowdiff.RemoteStorageError`.
    """

    url: str
    storage_options: dict[str, Any] | None = None
    bandwidth: float | None = None
    timeout: float = 60.0

    def __post_init__(self) -> None:
        if not isinstance(self.url, str):
            raise ArgumentTypeError(
                f"remote must be an fsspec URL (str), got {type(self.url).__name__}"
            )
        if "://" not in self.url or self.url.endswith("://"):
            raise InvalidArgumentError(
                "remote must be an fsspec URL such as 's3://bucket/prefix' or "
                f"'file:///mnt/shared/run', got {self.url!r}"
            )
        so = self.storage_options
        if so is not None and not isinstance(so, dict):
            raise ArgumentTypeError(
                f"RemoteOptions.storage_options must be a dict of fsspec options, got {type(so).__name__}"
            )
        bw = self.bandwidth
        if bw is not None:
            if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not bw > 0:
                raise InvalidArgumentError(
                    f"RemoteOptions.bandwidth must be bytes per second > 0 or None, got {bw!r}"
                )
            _set(self, "bandwidth", float(bw))
        _set(self, "timeout", check_seconds("RemoteOptions.timeout", self.timeout))

    @classmethod
    def of(cls, remote: RemoteOptions | str | None) -> RemoteOptions | None:
        """``remote=`` as given to ``Checkpointer``: a URL, the options, or None."""
        if remote is None or isinstance(remote, RemoteOptions):
            return remote
        if isinstance(remote, str):
            return cls(remote)
        raise ArgumentTypeError(
            f"remote must be an fsspec URL (str) or lowdiff.RemoteOptions, got {type(remote).__name__}"
        )


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """How long lowdiff waits, in seconds.

    Args:
        start: for the checkpointing process to start, or for a previous session's
            checkpointing process to finish writing.
        stall: for a live checkpointing process that makes no progress (writes nothing,
            handles nothing) before the trainer raises :class:`lowdiff.CheckpointWorkerError`.
            A process still writing is waited for as long as it makes progress; a dead
            one raises at once.
        idle: how long the checkpointing process of a trainer that died waits for the
            next trainer on the same directory to take it over before it persists what
            it holds and exits (0: it exits at once).
        sigterm: on SIGTERM, wait up to this long until every step whose ``step()``
            returned is durable, then go on as SIGTERM would have (exit status -15, or
            the handler set before). None leaves SIGTERM alone.
    """

    start: float = 120.0
    stall: float = 300.0
    idle: float = 300.0
    sigterm: float | None = 30.0

    def __post_init__(self) -> None:
        _set(self, "start", check_seconds("Timeouts.start", self.start))
        _set(self, "stall", check_seconds("Timeouts.stall", self.stall))
        _set(self, "idle", check_seconds("Timeouts.idle", self.idle, zero=True))
        if self.sigterm is not None:
            _set(self, "sigterm", check_seconds("Timeouts.sigterm", self.sigterm))


__all__ = ["ReplicaOptions", "RemoteOptions", "Timeouts"]

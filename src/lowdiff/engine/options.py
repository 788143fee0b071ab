"""The options of lowdiff's own strategies, as one dataclass that validates itself.

:class:`EngineOptions` checks every value on construction (a bad one is a ``TypeError``
or ``ValueError`` that names the option); :meth:`EngineOptions.check_for` adds the rules
that depend on the strategy and on whether training runs under DDP. An unknown option is
a ``TypeError`` naming it, as for any dataclass.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lowdiff.compressors.base import Compressor
from lowdiff.engine.wire.configs import RemoteSettings
from lowdiff.errors import ArgumentTypeError, InvalidArgumentError, UnsupportedSetupError
from lowdiff.options import AUTO, check_int, check_int_or_auto, check_seconds

STORAGE_ERROR_POLICIES = ("raise", "warn")


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Options of strategies ``"lowdiff"``, ``"lowdiff+"`` and ``"none"``; each is
    documented at :class:`lowdiff.Checkpointer`."""

    compressor: Compressor | None = None
    full_every: int | str = 30
    batch_size: int | str = 3
    keep_full: int | None = 2
    max_inflight: int | None = None
    start_timeout: float = 120.0
    stall_timeout: float = 300.0
    max_lag: int = 2
    persist_every: int | str = AUTO
    idle_timeout: float = 300.0
    replica_threads: int = 1
    peer_copies: bool | str = AUTO
    peer_address: str | None = None
    on_storage_error: str = "raise"
    mtbf: float | None = None
    sigterm_timeout: float | None = 30.0
    remote: str | None = None
    remote_options: dict[str, Any] | None = None
    remote_bandwidth: float | None = None
    remote_timeout: float = 60.0

    def __post_init__(self) -> None:
        self._check_remote()
        if self.on_storage_error not in STORAGE_ERROR_POLICIES:
            raise InvalidArgumentError(
                f"on_storage_error must be one of {', '.join(map(repr, STORAGE_ERROR_POLICIES))}, "
                f"got {self.on_storage_error!r}"
            )
        if self.compressor is not None and not isinstance(self.compressor, Compressor):
            raise ArgumentTypeError(
                f"compressor must be a lowdiff.Compressor, got {type(self.compressor).__name__}"
            )
        check_int_or_auto("full_every", self.full_every)
        check_int_or_auto("batch_size", self.batch_size)
        if self.keep_full is not None:
            check_int("keep_full", self.keep_full, 1)
        if self.max_inflight is not None:
            check_int("max_inflight", self.max_inflight, 1)
        self._set("start_timeout", check_seconds("start_timeout", self.start_timeout))
        self._set("stall_timeout", check_seconds("stall_timeout", self.stall_timeout))
        if self.sigterm_timeout is not None:
            self._set("sigterm_timeout", check_seconds("sigterm_timeout", self.sigterm_timeout))

    def remote_settings(self) -> RemoteSettings | None:
        """The remote tier as a checkpointing process takes it, or None."""
        if self.remote is None:
            return None
        return RemoteSettings(
            self.remote, self.remote_options, self.remote_bandwidth, self.remote_timeout
        )

    def _check_remote(self) -> None:
        if self.remote is not None:
            if not isinstance(self.remote, str):
                raise ArgumentTypeError(
                    f"remote must be an fsspec URL (str), got {type(self.remote).__name__}"
                )
            if "://" not in self.remote or self.remote.endswith("://"):
                raise InvalidArgumentError(
                    f"remote must be an fsspec URL such as 's3://bucket/prefix' or "
                    f"'file:///mnt/shared/run', got {self.remote!r}"
                )
        if self.remote_options is not None:
            if not isinstance(self.remote_options, dict):
                raise ArgumentTypeError(
                    f"remote_options must be a dict of fsspec options, got {type(self.remote_options).__name__}"
                )
            if self.remote is None:
                raise InvalidArgumentError("remote_options is given without remote=")
        bw = self.remote_bandwidth
        if bw is not None:
            if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not bw > 0:
                raise InvalidArgumentError(
                    f"remote_bandwidth must be bytes per second > 0 or None, got {bw!r}"
                )
            self._set("remote_bandwidth", float(bw))
        self._set("remote_timeout", check_seconds("remote_timeout", self.remote_timeout))
        idle = self.idle_timeout
        if isinstance(idle, bool) or not isinstance(idle, (int, float)) or idle < 0:
            raise InvalidArgumentError(
                f"idle_timeout must be a number of seconds >= 0, got {idle!r}"
            )
        self._set("idle_timeout", float(idle))

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    @property
    def auto(self) -> list[str]:
        """The options set to ``"auto"`` among ``full_every`` and ``batch_size``."""
        return [k for k in ("full_every", "batch_size") if getattr(self, k) == AUTO]

    def check_for(
        self,
        strategy: str,
        *,
        ddp: bool,
        replica: bool = False,
        can_suspend: bool = False,
        sharded: bool = False,
    ) -> None:
        """The rules that depend on the strategy and on DDP.

        Args:
            strategy: the strategy's name (for the messages).
            ddp: whether the model is wrapped in DistributedDataParallel (or sharded).
            sharded: whether the model is sharded with ``fully_shard`` (FSDP2).
            replica: whether the strategy keeps a CPU replica (LowDiff+): it takes no
                compressor and no ``"auto"``, and its own options are checked.
            can_suspend: whether the strategy can train on without checkpointing after a
                storage error (``on_storage_error="warn"``).
        """
        if self.on_storage_error == "warn" and not can_suspend:
            raise InvalidArgumentError(
                f"on_storage_error='warn' is supported by method 'lowdiff' only, got {strategy!r}"
            )
        if replica:
            self._check_replica()
        if self.remote is not None and strategy not in ("lowdiff", "lowdiff+"):
            raise InvalidArgumentError(
                "remote= is supported by methods 'lowdiff' and 'lowdiff+', got method "
                f"{strategy!r}"
            )
        if self.remote is not None and sharded:
            # refused rather than running without the remote tier the caller asked for
            raise UnsupportedSetupError(
                "remote= is not supported under fully_shard (FSDP2) yet: a new node's resume "
                "of a fully_shard job does not download its shards; use it under DDP or in "
                "a single process"
            )
        if ddp and self.on_storage_error == "warn":
            raise InvalidArgumentError(
                "on_storage_error='warn' is not supported under DistributedDataParallel: every "
                "rank would have to suspend and retry checkpointing together; use 'raise' (the "
                "job stops, and a restart resumes from the newest step every shard holds)"
            )
        auto = self.auto
        if auto and replica:
            raise InvalidArgumentError(
                f"{auto[0]}='auto' is supported by method 'lowdiff' only, got method {strategy!r}"
            )
        if auto and ddp:
            raise InvalidArgumentError(
                f"{auto[0]}='auto' is not supported under DistributedDataParallel yet (every rank "
                "must use the same f and b); pass integers"
            )

    def _check_replica(self) -> None:
        if self.compressor is not None:
            raise InvalidArgumentError(
                "method 'lowdiff+' is for training without compression; pass compressor=None"
            )
        check_int("max_lag", self.max_lag, 1)
        if self.persist_every != AUTO:
            check_int("persist_every", self.persist_every, 1)
        check_int("replica_threads", self.replica_threads, 1)

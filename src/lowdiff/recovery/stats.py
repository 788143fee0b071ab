"""What a recovery reports: :class:`RecoveryStats`, filled by every step of a recovery
(the full state's load, :mod:`lowdiff.recovery.full_state`; the records' replay,
:mod:`lowdiff.recovery.replay`) and returned by every entry point."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RecoveryStats:
    """What a recovery did and how long each part took (seconds)."""

    full_step: int
    step: int
    records_replayed: int = 0
    read_s: float = 0.0
    decode_s: float = 0.0
    replay_s: float = 0.0
    total_s: float = 0.0
    records_s: float = 0.0
    """Wall time of the records' replay alone (their reading, decoding and optimizer
    steps, which overlap), without the full checkpoint's load."""
    bytes_read: int = 0
    files_read: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """Damaged files, and record files of another trajectory, passed over: (path, reason)."""
    source: str = "disk"
    shard_sources: dict[int, str] = field(default_factory=dict)
    """A distributed job recovered from memory: where each rank's shard came from, by rank:
    ``"memory"`` (that rank's replica) or ``"peer memory (rank R)"`` (the copy rank R's
    replica keeps of it, when its own replica was lost with its node). Empty otherwise."""
    extra: Any = None
    """The extra state (``extra_state=``) of the recovered step, as saved (a JSON tree),
    or None when none was saved; applied by ``resume()`` / ``restore(extra_state=...)``."""
    state_run_id: str | None = None
    """The run that produced the recovered state: the ``run_id`` of the last record file
    replayed, or of the full checkpoint when no record was (None: not recorded, or
    recovered from memory). A session that resumes from this state names it as the
    ``follows`` of its first record file."""
    takeover_pid: int | None = None
    """The checkpointing process that outlived the crashed trainer and that this trainer
    took over (its pid: LowDiff's writer, LowDiff+'s replica), or None when a new process
    was started."""

    @property
    def adopted_pid(self) -> int | None:
        """Deprecated: :attr:`takeover_pid`."""
        warnings.warn(
            "RecoveryStats.adopted_pid is deprecated; use takeover_pid", DeprecationWarning, 2
        )
        return self.takeover_pid

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

"""Where a session stands: the step, the durable steps, the counters, and (f, b).

:class:`Progress` is written by the step pipeline (the step), by the checkpointing
process's reports (:mod:`lowdiff.engine.trainer.session`: the durable steps, the
counters) and by resume (the recovered state), each through its own methods or counters;
it is read by the public API (``ck.step_count``, ``ck.durable_step``,
``ck.acknowledged_step``, ``ck.stats``).
:class:`Cadence` is the (f, b) in use, changed only by the ``"auto"`` planner.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from lowdiff.ddp.context import JobMin
from lowdiff.plan import START_B, START_F
from lowdiff.recovery.replay import RecoveryStats
from lowdiff.state import capture as st

STAT_KEYS = (
    "steps", "slot_wait_s", "full_wait_s", "full_copy_s", "fulls_requested", "fulls_written",
    "full_bytes", "full_write_s", "record_send_s", "ack_wait_s", "lag_wait_s",
    "snapshot_finish_s", "record_files_written", "records_written", "record_bytes",
    "record_write_s", "replica_merges", "replica_merge_s",
)  # fmt: skip
"""The counters of ``ck.stats`` that the training process keeps (see
:attr:`lowdiff.Checkpointer.stats`)."""


@dataclasses.dataclass
class Cadence:
    """A full checkpoint every ``full_every`` steps (f), ``batch_size`` records per file
    (b); ``configured`` as the options said (``"auto"`` stays ``"auto"``)."""

    full_every: int
    batch_size: int
    configured: dict[str, int | str]

    @classmethod
    def of(cls, full_every: int | str, batch_size: int | str) -> Cadence:
        """The start: the options' values, or the planner's first (f, b) for ``"auto"``."""
        return cls(
            START_F if isinstance(full_every, str) else full_every,
            START_B if isinstance(batch_size, str) else batch_size,
            {"full_every": full_every, "batch_size": batch_size},
        )

    def set(self, f: int, b: int) -> None:
        self.full_every, self.batch_size = f, b


class Progress:
    """The session's step, durable steps and counters (see the module docstring).

    Args:
        job: under DDP, the job-wide minima of :meth:`figures` (local, remote); else None.
    """

    def __init__(self, job: JobMin | None) -> None:
        self.job = job
        self.step = 0
        """Optimizer updates done so far (the step the live state is at)."""
        self.started = False
        self.closed = False
        self.durable = -1
        """Newest step this rank's checkpointing process made durable (-1: none)."""
        self.acknowledged = -1
        """Newest step handed to this rank's checkpointing process with its data in host
        memory (-1: none)."""
        self.remote_durable = -1
        """Newest step the remote tier can recover (-1: none, or no remote tier)."""
        self.remote_error: str | None = None
        """The last failed upload attempt the checkpointing process reported."""
        self.last_full = 0
        """Step of the newest full checkpoint (``"auto"`` schedules the next one from it)."""
        self.recovery_stats: RecoveryStats | None = None
        self.recovered_extra: tuple[int, Any] | None = None
        """(step, extra-state tree) of the last recovery (see :meth:`extra_at`)."""
        self.stats: dict[str, float] = dict.fromkeys(STAT_KEYS, 0.0)

    def start(self) -> None:
        """Checkpointing (or, without it, training) has started: no ``resume()`` now."""
        self.started = True

    def close(self) -> None:
        """``close()`` began: no step from here on."""
        self.closed = True

    def advance(self, t: int) -> None:
        """Update ``t`` is done: the state is at ``t + 1``."""
        self.step = t + 1
        self.stats["steps"] += 1

    def full_staged(self, step: int) -> None:
        """The state at ``step`` was staged as a full checkpoint."""
        self.last_full = step

    def acknowledge(self, step: int) -> None:
        """Step ``step`` was handed to the checkpointing process (its record, or a full
        checkpoint of it, is in shared host memory and the message naming it is sent)."""
        self.acknowledged = max(self.acknowledged, int(step))

    def saw_remote_error(self, text: str) -> None:
        """An upload to the remote tier failed (it is retried)."""
        self.remote_error = text

    def saw_durable(self, step: int) -> None:
        """The checkpointing process made ``step`` durable."""
        self.durable = max(self.durable, int(step))

    def saw_remote_durable(self, step: int) -> None:
        """The remote tier can recover ``step``."""
        self.remote_durable = max(self.remote_durable, int(step))

    def recovered(self, stats: RecoveryStats, durable: bool) -> None:
        """The state of ``stats`` is loaded: take its step (and, when ``durable``, its
        durability: it came from disk)."""
        self.recovery_stats = stats
        self.recovered_extra = (stats.step, stats.extra)
        self.step = stats.step
        self.durable = stats.step if durable else -1
        self.acknowledged = stats.step  # on disk, or in the replica in memory
        if durable and self.job is not None:
            # the ranks resumed at one agreed step from their shards' files: the job's
            # durable step is that one before the first exchange says so
            self.job.at_least(0, stats.step)
        self.last_full = stats.full_step

    def extra_at(self, step: int, extra: dict[str, Any]) -> tuple[Any, bool]:
        """The extra state a checkpoint of ``step`` saves, and whether it was taken from
        the objects ``extra`` now (False: it is the recovered step's, as recovered).

        At the recovered step, before any update, the state is the recovered one; an
        object may apply a loaded state only later (Lightning's fit loop restores its
        loader's position when iteration resumes), so its ``state_dict()`` would not say
        so yet."""
        recovered = self.recovered_extra
        if recovered is not None and recovered[0] == step == self.step and extra:
            tree = recovered[1] or {}
            return {n: copy.deepcopy(tree[n]) for n in extra}, False
        return st.capture_extra(extra), True

    def figures(self) -> tuple[int, int]:
        """This rank's durable steps: the local tier's and the remote tier's (what the
        ranks exchange under DDP)."""
        return self.durable, self.remote_durable

    def durable_step(self) -> int:
        """This rank's durable step, or under DDP the job's (every shard has it)."""
        return self.durable if self.job is None else min(self.durable, self.job.values[0])

    def acknowledged_step(self) -> int:
        """This rank's acknowledged step: the newest one a crash of the trainer loses
        nothing up to (at least the durable step)."""
        return max(self.acknowledged, self.durable)

    def remote_durable_step(self) -> int:
        """This rank's remote durable step, or under DDP the job's: the newest step every
        shard's remote tier can recover (the same minimum as :meth:`durable_step`)."""
        if self.job is None:
            return self.remote_durable
        return min(self.remote_durable, self.job.values[1])

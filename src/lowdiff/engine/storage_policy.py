"""What a storage error of the checkpointing process does (``on_storage_error``).

``"raise"``: the error is raised in the trainer at its next call. ``"warn"`` (LowDiff
only): the failed process is dropped and training goes on without checkpointing; a
:class:`lowdiff.DurabilityWarning` says how many steps are not durable, and a new
process is started with a full checkpoint at the next multiple of ``full_every``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from lowdiff.engine.core import EngineCore
from lowdiff.engine.session import ProcessSession
from lowdiff.errors import CheckpointWorkerError, DurabilityWarning, LowDiffError


class CheckpointingSuspended(Exception):
    """Internal: a storage error under ``on_storage_error="warn"`` stopped checkpointing."""


class StoragePolicy:
    """Applies ``on_storage_error`` to one session's checkpointing processes.

    Args:
        policy: ``"raise"`` or ``"warn"``.
        core: the session's counters (for the warning).
        full_every: the current f (the retry's step is its next multiple).
    """

    def __init__(self, policy: str, core: EngineCore, full_every: Callable[[], int]) -> None:
        self.policy = policy
        self.core = core
        self.full_every = full_every
        self.suspended: str | None = None
        """Under "warn": why checkpointing is suspended after a storage error."""
        self.session: ProcessSession | None = None

    def watch(self, session: ProcessSession) -> None:
        """Apply the policy to the errors ``session``'s process reports."""
        self.session = session
        session.check = self.check

    def check(self) -> None:
        """Raise what the process reported; under "warn" a storage error suspends
        checkpointing instead (:class:`CheckpointingSuspended`)."""
        if self.suspended is not None:
            raise CheckpointingSuspended
        assert self.session is not None
        try:
            self.session.check_link()
        except CheckpointWorkerError as err:
            if self.policy == "warn" and err.storage:
                self._suspend(err)
            raise

    def _suspend(self, err: CheckpointWorkerError) -> None:
        """Drop the failed checkpointing process, train on."""
        assert self.session is not None
        self.suspended = str(err).split("\n", 1)[0]
        self.session.stop()
        self.warn_not_durable("a storage error")
        raise CheckpointingSuspended

    def warn_not_durable(self, where: str) -> None:
        core = self.core
        lost = core.step - core.durable if core.durable >= 0 else core.step
        f = self.full_every()
        retry = -(-(core.step + 1) // f) * f
        warnings.warn(
            f"lowdiff: checkpointing to {core.root} is suspended ({where}): {self.suspended}; "
            f"{lost} step(s) are not durable (newest durable step {core.durable}, training is at "
            f"step {core.step})"
            + ("" if core.closed else f"; lowdiff retries with a full checkpoint at step {retry}"),
            DurabilityWarning,
            stacklevel=4,
        )

    def retry(self, prepare: Callable[[], None], restart: Callable[[], None]) -> None:
        """After a storage error: ``prepare()`` readies the directory (the failed process
        has exited), ``restart()`` starts a new checkpointing process with a full
        checkpoint; if either fails, checkpointing stays suspended."""
        try:
            prepare()
            self.suspended = None
            restart()
        except (OSError, LowDiffError) as e:
            if self.suspended is None:
                self.suspended = f"restarting the checkpointing process failed: {e}"
                if self.session is not None:
                    self.session.stop()
                self.warn_not_durable("a storage error")
            raise CheckpointingSuspended from None

"""What a storage error of the checkpointing process does (``on_storage_error``).

``"raise"``: the error is raised in the trainer at its next call. ``"warn"`` (LowDiff
only): the failed process is dropped and training goes on without checkpointing; a
:class:`lowdiff.DurabilityWarning` says how many steps are not durable, and a new
process is started with a full checkpoint at the next multiple of ``full_every``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from lowdiff.engine.trainer.directory import CheckpointDir
from lowdiff.engine.trainer.progress import Cadence, Progress
from lowdiff.engine.trainer.session import ProcessSession
from lowdiff.errors import CheckpointWorkerError, DurabilityWarning, LowDiffError


class CheckpointingSuspended(Exception):
    """Internal: a storage error under ``on_storage_error="warn"`` stopped checkpointing."""


class StoragePolicy:
    """Applies ``on_storage_error`` to one session's checkpointing processes.

    Args:
        policy: ``"raise"`` or ``"warn"``.
        progress: the session's steps (for the warning).
        cadence: the (f, b) in use (a retry starts at the next multiple of f).
    """

    def __init__(self, policy: str, progress: Progress, cadence: Cadence) -> None:
        self.policy = policy
        self.progress, self.cadence = progress, cadence
        self.suspended: str | None = None
        """Under "warn": why checkpointing is suspended after a storage error."""
        self.session: ProcessSession | None = None
        self.directory: CheckpointDir | None = None

    def watch(self, session: ProcessSession, directory: CheckpointDir) -> None:
        """Apply the policy to the errors ``session``'s process reports (in ``directory``)."""
        self.session, self.directory = session, directory
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
        p = self.progress
        lost = p.step - p.durable if p.durable >= 0 else p.step
        f = self.cadence.full_every
        root = None if self.directory is None else self.directory.root
        retry = -(-(p.step + 1) // f) * f
        warnings.warn(
            f"lowdiff: checkpointing to {root} is suspended ({where}): {self.suspended}; "
            f"{lost} step(s) are not durable (newest durable step {p.durable}, training is at "
            f"step {p.step})"
            + ("" if p.closed else f"; lowdiff retries with a full checkpoint at step {retry}"),
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

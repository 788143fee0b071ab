"""The parts of a checkpointing session on the training process, as one bundle.

Each part has one owner and one job: the training objects and their layout
(:class:`~lowdiff.engine.trainer.training.TrainingObjects`), the step and durable steps
(:class:`~lowdiff.engine.trainer.progress.Progress`), f and b
(:class:`~lowdiff.engine.trainer.progress.Cadence`), the options, the checkpoint directory
(:class:`~lowdiff.engine.trainer.directory.CheckpointDir`) and the link to the
checkpointing process (:class:`~lowdiff.engine.trainer.session.ProcessSession`). The
backends, the starter and the takeover read them through :class:`SessionParts`.
"""

from __future__ import annotations

import dataclasses

from lowdiff.engine.options import EngineOptions
from lowdiff.engine.trainer.directory import CheckpointDir
from lowdiff.engine.trainer.progress import Cadence, Progress
from lowdiff.engine.trainer.session import ProcessSession
from lowdiff.engine.trainer.training import TrainingObjects


@dataclasses.dataclass(frozen=True)
class SessionParts:
    """The parts of one checkpointing session (see the module docstring)."""

    objects: TrainingObjects
    progress: Progress
    cadence: Cadence
    options: EngineOptions
    directory: CheckpointDir
    session: ProcessSession

    def unpack(
        self,
    ) -> tuple[TrainingObjects, Progress, Cadence, EngineOptions, CheckpointDir, ProcessSession]:
        """The parts in field order (for ``a, b, ... = parts.unpack()``)."""
        return (self.objects, self.progress, self.cadence, self.options, self.directory,
                self.session)  # fmt: skip

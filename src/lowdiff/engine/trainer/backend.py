"""The contracts between lowdiff's one trainer-side strategy and what varies by method.

:class:`lowdiff.engine.trainer.strategy.EngineStrategy` is the strategy of all three of
lowdiff's methods. What differs between them is behind two protocols:

- a :class:`GradientSource` takes each step's gradients as the optimizer applies them:
  compressed in place (``"lowdiff"``, ``"compression-only"``:
  :class:`~lowdiff.engine.trainer.gradients.CompressedGradients`) or snapshotted layer by
  layer during backward (``"lowdiff+"``:
  :class:`~lowdiff.engine.trainer.replica_backend.SnapshotGradients`);
- a :class:`Backend` is the checkpointing process a method feeds, as the trainer sees
  it: LowDiff's writer (:class:`~lowdiff.engine.trainer.writer_backend.WriterBackend`) or
  LowDiff+'s replica (:class:`~lowdiff.engine.trainer.replica_backend.ReplicaBackend`).
  ``"compression-only"`` has none.

A backend holds no state of the strategy's: the training objects, the progress, the
directory and the session are handed to it, and the procedures that use it (resume,
:mod:`lowdiff.engine.trainer.start`; the step, :mod:`lowdiff.engine.trainer.pipeline`)
read its attributes and call its methods. Call sequence (trainer; every rank):

0) ``check_optimizer(optimizer)`` (on the class, before anything is built).
1) ``Backend(...)`` once the directory is locked and the session made.
2) ``process(run_id)``: the process to start, or the configuration a process taken over
   is sent (``run_id``: that process's run); ``started()`` once it serves this trainer
   (started, or taken over).
3) every step: ``take_slot(t, grads)``: the slot the step's record goes in.
4) ``check_attach()`` before :func:`lowdiff.attach` drives the strategy; ``release()``
   when the strategy lets go of everything (close, or dropped).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import torch

from lowdiff.ddp.hooks import LowDiffHookState
from lowdiff.engine.trainer.parts import SessionParts
from lowdiff.engine.wire.messages import Full
from lowdiff.proc.protocol import SlotMessage
from lowdiff.strategy import StepGrads


class GradientSource(Protocol):
    """Takes each step's gradients as the optimizer will apply them."""

    hook_state: LowDiffHookState | None
    """Under DDP with compression: lowdiff's communication hook (its wire statistics)."""

    def take(self, t: int) -> StepGrads:
        """The gradients of update ``t`` (called before ``optimizer.step()``)."""


class Backend(Protocol):
    """The checkpointing process of a method, as the trainer sees it (see the module
    docstring for the call sequence)."""

    kind: ClassVar[str]
    """``"writer"`` or ``"replica"``."""
    keeps_replica: ClassVar[bool]
    """The process keeps the whole state in memory (LowDiff+): its own options apply, a
    resume first looks for it in memory, and a process continuing a recovered state is
    seeded with it (:attr:`resume_message`)."""
    trains_compressed: ClassVar[bool]
    """Training applies compressed gradients (LowDiff), else it is left unchanged."""
    can_suspend: ClassVar[bool]
    """Training can go on without checkpointing after a storage error
    (``on_storage_error="warn"``)."""
    closes_when_dropped: ClassVar[bool]
    """The process exits when a live trainer lets go of it (a Checkpointer dropped
    without ``close()``), and waits for a next trainer only once its trainer is dead
    (LowDiff's writer); LowDiff+'s replica keeps the state in memory either way."""
    sends_fulls: ClassVar[bool]
    """The trainer stages a full checkpoint every f steps (LowDiff); otherwise only the
    first message is staged, and the staging buffer goes once the process took it."""
    first_message: ClassVar[type[Full]]
    """What the state that starts a new process is sent as (``Full``, ``Init``)."""
    resume_message: ClassVar[type[Full] | None]
    """What a process continuing a recovered state is sent first (None: nothing, it
    continues the chain on disk)."""
    slot_message: ClassVar[type[SlotMessage]]
    """What a step's slot is handed over as (``Record``, ``Step``)."""

    def __init__(self, parts: SessionParts, gradients: GradientSource) -> None:
        """The parts of the session the backend reads (none of them is its own)."""

    @staticmethod
    def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
        """Refuse an optimizer the process cannot run."""

    def prepare_launch(self) -> None:
        """A new process is about to start (under DDP on every rank at once: it may run
        collectives)."""

    def process(self, run_id: str) -> tuple[Callable[..., None], Any, int]:
        """The process to start for run ``run_id``: (entry point, its config, slots)."""

    def started(self) -> None:
        """The process serves this trainer now (started, or taken over)."""

    def take_slot(self, t: int, grads: StepGrads) -> int:
        """The slot the record of step ``t`` goes in (filled with ``grads`` next)."""

    def check_attach(self) -> None:
        """Refuse :func:`lowdiff.attach` when the process cannot be driven by hooks."""

    def release(self) -> None:
        """Let go of what the backend holds (idempotent)."""

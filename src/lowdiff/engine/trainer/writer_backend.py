"""LowDiff's writer as the trainer sees it: the :class:`~lowdiff.engine.trainer.backend.Backend`
of ``method="lowdiff"``.

Each step's compressed (under DDP: merged) gradient goes into a shared record slot with
the step's buffers, RNG states, hyperparameters and extra state; the writer
(:mod:`lowdiff.engine.writer.main`) writes the records in batches of b, and a full
checkpoint every f steps. Recovery replays the records through the optimizer. After a
trainer crash, the next trainer recovers from disk and takes the writer over once it
wrote everything it was sent.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from lowdiff.engine.trainer.backend import GradientSource
from lowdiff.engine.trainer.parts import SessionParts
from lowdiff.engine.wire.configs import WriterConfig
from lowdiff.engine.wire.messages import Full, Record
from lowdiff.engine.writer.main import writer_main
from lowdiff.proc.protocol import SlotMessage
from lowdiff.strategy import StepGrads


class WriterBackend:
    """LowDiff's writer (see the module docstring)."""

    kind: ClassVar[str] = "writer"
    keeps_replica: ClassVar[bool] = False
    trains_compressed: ClassVar[bool] = True
    can_suspend: ClassVar[bool] = True
    closes_when_dropped: ClassVar[bool] = True
    sends_fulls: ClassVar[bool] = True
    first_message: ClassVar[type[Full]] = Full
    resume_message: ClassVar[type[Full] | None] = None
    slot_message: ClassVar[type[SlotMessage]] = Record

    def __init__(self, parts: SessionParts, gradients: GradientSource) -> None:
        (self.objects, self.progress, self.cadence, self.options, self.directory,
         self.session) = parts.unpack()  # fmt: skip

    @staticmethod
    def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
        """Any optimizer: the writer never runs it."""

    def prepare_launch(self) -> None:
        """Nothing to prepare."""

    def process(self, run_id: str) -> tuple[Callable[..., None], Any, int]:
        objects, opts = self.objects, self.options
        assert objects.layout is not None
        stats = self.progress.recovery_stats
        cfg = WriterConfig(
            str(self.directory.root),
            self.cadence.batch_size,
            opts.keep_full,
            objects.layout.row_bytes,
            objects.layout_id,
            run_id,
            # lineage: the first record file follows the recovered state's run
            follows=None if stats is None else stats.state_run_id,
            remote=self.directory.remote_settings(opts.remote_settings()),
            idle_timeout=opts.idle_timeout,
            trainer_pid=os.getpid(),
        )
        return writer_main, cfg, opts.max_inflight or 2 * self.cadence.batch_size + 2

    def started(self) -> None:
        """Nothing to do: the record slots are the session's."""

    def take_slot(self, t: int, grads: StepGrads) -> int:
        """A free record slot (waiting while the writer holds them all)."""
        t0 = time.perf_counter()
        slot = self.session.take_slot("a free record slot")
        self.progress.stats["slot_wait_s"] += time.perf_counter() - t0
        return slot

    def check_attach(self) -> None:
        """Any loop: a step's record waits in its slot until it is handed over."""

    def release(self) -> None:
        """Nothing held beyond the session's."""

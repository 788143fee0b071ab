"""Method ``"compression-only"``: the compression of ``"lowdiff"``, and no checkpointing at all.

The baseline that lowdiff's overheads are measured against: training takes the same
compressed (under DDP: merged) gradients as with ``"lowdiff"``, and nothing is written.
"""

from __future__ import annotations

import os

from lowdiff.compressors.base import Compressor
from lowdiff.ddp.context import DistContext
from lowdiff.engine.base import EngineStrategy
from lowdiff.engine.gradients import CompressedGradients, record_compressor, training_compressor
from lowdiff.engine.options import EngineOptions
from lowdiff.errors import UsageError
from lowdiff.strategy import StepGrads


class CompressionOnlyStrategy(EngineStrategy):
    """Method ``"compression-only"`` (see the module docstring); the directory is ignored."""

    name = "compression-only"
    records_hparams = False

    def _records_compressor(self, opts: EngineOptions, dist: DistContext | None) -> Compressor:
        self._rank_compressor = training_compressor(opts.compressor)
        return record_compressor(self._rank_compressor, dist)

    def _install(self, directory: str | os.PathLike[str] | None) -> None:
        self.gradients = CompressedGradients(self.core, self._rank_compressor)

    def resume(self) -> int:
        """Nothing to restore: training starts at step 0."""
        if self.core.started:
            raise UsageError("resume() must be called once, before the first step()")
        self.core.started = True
        return 0

    def take_gradients(self, t: int) -> StepGrads:
        """The gradients of step ``t`` as the optimizer will apply them."""
        assert self.gradients is not None
        return self.gradients.take(t)

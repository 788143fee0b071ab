"""Compressed gradients as the optimizer applies them (methods ``"lowdiff"`` and ``"compression-only"``).

In one process every ``.grad`` is compressed and its decompressed form written back
(:func:`lowdiff.strategy.compress_grads`). Under DDP, lowdiff's communication hook
(:mod:`lowdiff.ddp.hooks`) compresses each rank's gradient, exchanges the sparse
payloads instead of dense buckets and merges them; the merged record of each parameter
is what every rank applies.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from lowdiff.compressors.base import Compressor
from lowdiff.compressors.merged import MergedSparse
from lowdiff.compressors.sparse import _Sparsifier
from lowdiff.ddp.context import DistContext
from lowdiff.ddp.hooks import LowDiffHookState, lowdiff_hook, record_consumed
from lowdiff.engine.trainer.progress import Progress
from lowdiff.engine.trainer.training import TrainingObjects
from lowdiff.errors import InvalidArgumentError, LowDiffError
from lowdiff.strategy import StepGrads, compress_grads


def training_compressor(compressor: Compressor | None) -> Compressor:
    """The compressor training uses (LowDiff and compression-only train with one)."""
    if compressor is None:
        raise InvalidArgumentError(
            "LowDiff trains with compressed gradients: pass compressor= (e.g. "
            "lowdiff.TopK(ratio=0.01)), or use method='lowdiff+' to leave training unchanged"
        )
    return compressor


def record_compressor(compressor: Compressor, dist: DistContext | None) -> Compressor:
    """The compressor whose records a session writes: training's own in one process,
    under DDP its merge across ranks (:class:`MergedSparse`)."""
    if dist is None:
        return compressor
    if not isinstance(compressor, _Sparsifier):
        raise InvalidArgumentError(
            f"distributed LowDiff merges sparse gradients across ranks; {type(compressor).__name__} "
            "is not a sparsifier (use TopK, ApproxTopK or RandomK)"
        )
    return MergedSparse(compressor, dist.world_size)


class CompressedGradients:
    """Takes each step's compressed gradients (the records' payloads): a
    :class:`~lowdiff.engine.trainer.backend.GradientSource`.

    Args:
        objects: the training objects (their compressor is the records' one).
        progress: the session's step (the DDP hook's).
        rank_compressor: each rank's own compressor (under DDP the hook's; the records'
            one merges them).
    """

    def __init__(
        self, objects: TrainingObjects, progress: Progress, rank_compressor: Compressor
    ) -> None:
        self.objects = objects
        self.hook_state: LowDiffHookState | None = None
        """Under DDP: lowdiff's communication hook, with its wire statistics."""
        self.sample: Callable[[dict], float] | None = None
        """The ``"auto"`` planner's: may time a decompression of the payloads."""
        if objects.dist is not None:
            self._install_hook(objects, progress, rank_compressor)

    def _install_hook(self, objects: TrainingObjects, progress: Progress, comp: Compressor) -> None:
        """Register lowdiff's DDP communication hook (before the first backward)."""
        assert objects.dist is not None
        assert isinstance(comp, _Sparsifier) and isinstance(objects.compressor, MergedSparse)
        self.hook_state = LowDiffHookState(
            objects.dist, objects.params, comp, objects.compressor, lambda: progress.step
        )
        try:
            objects.model.register_comm_hook(self.hook_state, lowdiff_hook)  # type: ignore[operator]
        except RuntimeError as e:
            raise LowDiffError(
                f"cannot install lowdiff's DDP communication hook: {e} (a model may carry only one "
                "hook, registered before the first backward; build a new DDP wrapper)"
            ) from None

    def take(self, t: int) -> StepGrads:
        """The gradients of step ``t`` as the optimizer will apply them."""
        objects = self.objects
        out = StepGrads()
        if self.hook_state is not None:
            # DDP: the hook merged the gradients during backward; whatever happened to .grad
            # since (clipping, scaling) is taken into the records
            out.payloads = self.hook_state.take(t)
            out.nograd = [info.index for info, p in objects.params if p.grad is None]
            missing = [
                info.name
                for info, p in objects.params
                if p.grad is not None and info.index not in out.payloads
            ]
            if missing:
                raise LowDiffError(
                    f"step {t}: the gradients of {', '.join(missing[:3])}"
                    f"{', ...' if len(missing) > 3 else ''} did not pass through lowdiff's DDP "
                    "hook (was backward run under no_sync(), or were gradients set by hand?)"
                )
            record_consumed(out.payloads, objects.params)
            return out
        t0 = time.perf_counter()
        out.payloads, out.nograd = compress_grads(
            objects.params, objects.numels, objects.compressor, t
        )
        out.compress_s = time.perf_counter() - t0
        if self.sample is not None:
            out.extra_s = self.sample(out.payloads)
        return out

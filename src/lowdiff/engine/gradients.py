"""Compressed gradients as the optimizer applies them (strategies ``"lowdiff"`` and ``"none"``).

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
from lowdiff.engine.core import EngineCore
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
    """Takes each step's compressed gradients (the records' payloads).

    Args:
        core: the session (its compressor is the records' one).
        rank_compressor: under DDP, each rank's own compressor (the hook's), else None.
    """

    def __init__(self, core: EngineCore, rank_compressor: Compressor | None) -> None:
        self.core = core
        self.hook_state: LowDiffHookState | None = None
        """Under DDP: lowdiff's communication hook, with its wire statistics."""
        if core.dist is not None:
            self._install_hook(core, rank_compressor)

    def _install_hook(self, core: EngineCore, comp: Compressor | None) -> None:
        """Register lowdiff's DDP communication hook (before the first backward)."""
        assert core.dist is not None
        assert isinstance(comp, _Sparsifier) and isinstance(core.compressor, MergedSparse)
        self.hook_state = LowDiffHookState(
            core.dist, core.params, comp, core.compressor, lambda: core.step
        )
        try:
            core.model.register_comm_hook(self.hook_state, lowdiff_hook)  # type: ignore[operator]
        except RuntimeError as e:
            raise LowDiffError(
                f"cannot install lowdiff's DDP communication hook: {e} (a model may carry only one "
                "hook, registered before the first backward; build a new DDP wrapper)"
            ) from None

    def take(self, t: int, sample: Callable[[dict], float] | None = None) -> StepGrads:
        """The gradients of step ``t`` as the optimizer will apply them; ``sample`` (the
        ``"auto"`` planner's) may time a decompression of the payloads."""
        core = self.core
        out = StepGrads()
        if self.hook_state is not None:
            # DDP: the hook merged the gradients during backward; whatever happened to .grad
            # since (clipping, scaling) is taken into the records
            out.payloads = self.hook_state.take(t)
            out.nograd = [info.index for info, p in core.params if p.grad is None]
            missing = [
                info.name
                for info, p in core.params
                if p.grad is not None and info.index not in out.payloads
            ]
            if missing:
                raise LowDiffError(
                    f"step {t}: the gradients of {', '.join(missing[:3])}"
                    f"{', ...' if len(missing) > 3 else ''} did not pass through lowdiff's DDP "
                    "hook (was backward run under no_sync(), or were gradients set by hand?)"
                )
            record_consumed(out.payloads, core.params)
            return out
        t0 = time.perf_counter()
        out.payloads, out.nograd = compress_grads(core.params, core.numels, core.compressor, t)
        out.compress_s = time.perf_counter() - t0
        if sample is not None:
            out.extra_s = sample(out.payloads)
        return out

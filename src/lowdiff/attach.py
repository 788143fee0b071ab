"""``lowdiff.attach``: checkpoint a training loop that calls ``optimizer.step()`` itself.

Frameworks (Hugging Face ``Trainer``, Accelerate, Lightning) and most user loops call
``optimizer.step()`` and ``scheduler.step()`` themselves. :func:`attach` drives lowdiff
from the optimizer's own step hooks instead of ``ck.step()``:

- the pre-hook (``register_step_pre_hook``) takes the gradients as the optimizer will
  apply them: compressed and decompressed in place (LowDiff), the DDP hook's merged
  records, or the finished layer-wise snapshot (LowDiff+). With ``step(closure)`` it runs
  after the closure (forward and backward) inside the step;
- the post-hook writes the step's record (buffers, RNG and ``extra_state`` as they are
  right after the update) and stages a full checkpoint when one is due;
- the hand-over to the checkpointing process is finished when the next update begins
  (or at ``flush()`` / ``close()``), after the loop stepped its LR scheduler, so the
  record carries the scheduler's state after its step.

The pipeline is the one ``ck.step()`` runs (:class:`lowdiff.strategy.Strategy`); only the
caller differs.

- With ``torch.amp.GradScaler``: a step the scaler skips (inf or NaN gradients) calls no
  ``optimizer.step()``, so it produces no record and no update; pass the scaler in
  ``extra_state`` and its state after each ``update()`` is saved with the step.
- Gradient accumulation and a scheduler stepped after ``optimizer.step()`` need nothing
  special: a step is one ``optimizer.step()``.
- ``optimizer.step(closure)`` (Lightning): the gradients are taken after the closure
  ran; the closure must return the loss.
- A crash of the trainer loses at most the last step (it is handed over when the next
  update begins).
- A framework's wrapper of the optimizer or scheduler (Accelerate's, Lightning's) is
  unwrapped: the hooks go on the optimizer whose ``step()`` updates the parameters.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

import torch

from lowdiff.checkpointer import OPTIONS, Checkpointer, Method
from lowdiff.compressors.base import Compressor
from lowdiff.engine.trainer.strategy import EngineStrategy
from lowdiff.errors import ArgumentTypeError, InvalidArgumentError, UsageError
from lowdiff.legacy import accepts_old_spellings
from lowdiff.options import RemoteOptions, ReplicaOptions, Timeouts

_ATTACHED = "_lowdiff_attached"


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` under a framework's wrapper (Accelerate's
    ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``): lowdiff's step hooks go
    on the optimizer whose ``step()`` updates the parameters."""
    seen = 0
    while not _is_plain_optimizer(optimizer) and seen < 8:
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer, seen = inner, seen + 1
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ArgumentTypeError(
            f"optimizer must be (or wrap) a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    return optimizer


def _is_plain_optimizer(optimizer: Any) -> bool:
    # AcceleratedOptimizer subclasses torch.optim.Optimizer but only forwards to .optimizer
    return isinstance(optimizer, torch.optim.Optimizer) and not hasattr(optimizer, "optimizer")


def unwrap_scheduler(scheduler: Any) -> Any:
    """The LR scheduler under Accelerate's ``AcceleratedScheduler`` (None stays None)."""
    if scheduler is None:
        return None
    inner = getattr(scheduler, "scheduler", None)
    return inner if inner is not None and hasattr(inner, "state_dict") else scheduler


@accepts_old_spellings("attach", OPTIONS)
def attach(
    directory: str | os.PathLike[str] | None,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    method: Method | str = "auto",
    compressor: Compressor | None = None,
    scheduler: Any | None = None,
    extra_state: dict[str, Any] | None = None,
    full_every: int | Literal["auto"] = 30,
    records_per_file: int | Literal["auto"] = 3,
    keep_full: int | None = 2,
    max_inflight: int | None = None,
    on_storage_error: Literal["raise", "warn"] = "raise",
    mtbf: float | None = None,
    replica: ReplicaOptions | None = None,
    remote: RemoteOptions | str | None = None,
    timeouts: Timeouts | None = None,
    method_options: Mapping[str, Any] | None = None,
) -> Checkpointer:
    """Checkpoint every ``optimizer.step()`` of an unmodified training loop.

    Takes the arguments of :class:`lowdiff.Checkpointer` (lowdiff's own methods). Call
    ``ck.resume()`` before training and ``ck.close()`` at the end; in between the loop
    stays as it is, ``scaler.step(optimizer)`` and ``scheduler.step()`` included (see
    the module docstring for what is taken when).

    Example:
        >>> ck = lowdiff.attach("runs/ckpt", model, optimizer, scheduler=scheduler)  # doctest: +SKIP
        >>> start = ck.resume()  # doctest: +SKIP

    Raises:
        UsageError: lowdiff is already attached to this optimizer.
        InvalidArgumentError: a registered method (the baselines), or a bad option (as
            for ``Checkpointer``).
    """
    options: dict[str, Any] = dict(
        method=method, compressor=compressor, scheduler=scheduler, extra_state=extra_state,
        full_every=full_every, records_per_file=records_per_file, keep_full=keep_full,
        max_inflight=max_inflight, on_storage_error=on_storage_error, mtbf=mtbf,
        replica=replica, remote=remote, timeouts=timeouts, method_options=method_options,
    )  # fmt: skip
    optimizer = unwrap_optimizer(optimizer)
    options["scheduler"] = unwrap_scheduler(scheduler)
    if getattr(optimizer, _ATTACHED, None) is not None:
        raise UsageError(
            f"lowdiff is already attached to this optimizer (directory {getattr(optimizer, _ATTACHED)}); "
            "close() that Checkpointer first"
        )
    return _drive_by_hooks(Checkpointer(directory, model, optimizer, **options), directory)


def _drive_by_hooks(ck: Checkpointer, directory: Any) -> Checkpointer:
    """Hand ``ck``'s steps to its optimizer's hooks (closed again if that fails)."""
    impl = ck.strategy_impl
    if not isinstance(impl, EngineStrategy):
        ck.close()
        raise InvalidArgumentError(
            f"attach() drives lowdiff's own methods ('lowdiff', 'lowdiff+', 'compression-only'), "
            f"not {ck.method!r}; use ck.step() for a registered method"
        )
    try:
        impl.attach_to_optimizer()
    except BaseException:
        ck.close()
        raise
    optimizer = impl.optimizer
    setattr(optimizer, _ATTACHED, str(directory))
    impl.on_close(lambda: _detach(optimizer))
    return ck


def own_strategy(ck: Checkpointer) -> EngineStrategy:
    """The method object of ``ck`` when it is one of lowdiff's own, typed as such
    (internal: for tests and tools; its attributes are not a stable API).

    Raises:
        TypeError: ``ck`` runs a baseline.
    """
    impl = ck.strategy_impl
    if not isinstance(impl, EngineStrategy):
        raise ArgumentTypeError(f"not a lowdiff strategy: {ck.strategy!r}")
    return impl


def _detach(optimizer: torch.optim.Optimizer) -> None:
    if hasattr(optimizer, _ATTACHED):
        delattr(optimizer, _ATTACHED)

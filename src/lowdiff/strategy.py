"""The contract of a checkpointing strategy, and the one step pipeline they all run.

A strategy (a *method*) decides what a checkpoint is and how it gets to disk: lowdiff's
own (:class:`lowdiff.engine.trainer.strategy.EngineStrategy`, with LowDiff's writer or
LowDiff+'s replica as its backend) and any method registered with
:func:`lowdiff.register_method` (the baselines of ``lowdiff_lab``) are peers under this
contract. Users reach every one through :class:`lowdiff.Checkpointer`, which validates
the arguments, picks the method by name and hands every call to it.

Call sequence (every call on the training process; under DDP on every rank, in the same
order, since some of them are collective)::

    s = StrategyClass(model, optimizer, directory, **options)
        # validates its options, takes the directory lock
    start = s.resume()
        # restores the newest recoverable state (or prepares an empty directory) and
        # starts the strategy's background work; under DDP the ranks agree on one step
    for each training step (Strategy.step(), the pipeline below; the user has run
    forward and backward):
        t = s.begin_step()                 # starts implicitly on the first step, raises
                                           # what background work reported (an error,
                                           # a lost process)
        s.before_update(t)                 # wait for what must finish before the state
                                           # changes (CheckFreq's snapshot in flight)
        grads = s.take_gradients(t)        # the gradients as the optimizer will apply
                                           # them: compressed and decompressed in place,
                                           # the DDP hook's merged records, LowDiff+'s
                                           # layer-wise snapshots
        hp = s.hparams()                   # if s.records_hparams: the update's
                                           # hyperparameters, before the scheduler moves
        optimizer.step(); scheduler.step()
        s.after_update(t, grads, hp, update_s)
                                           # the state is at t + 1 now: hand the step's
                                           # record over, checkpoint when due, apply the
                                           # storage-error policy; under DDP exchange the
                                           # durable step with the other ranks
    s.flush()   # everything taken so far is durable (collective under DDP)
    s.close()   # flush, stop background work, release the directory

lowdiff's work on the training process shows in ``torch.profiler`` traces as the ranges
``lowdiff.take_gradients``, ``lowdiff.after_update`` and (with :func:`lowdiff.attach`)
``lowdiff.handover``.

A strategy's background work (a checkpointing process, a writer thread, a holder of
in-memory copies) never runs the optimizer: the training process's ``optimizer.step()``
above is the only update, so what a strategy records is exactly what training applied.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import os
import time
from typing import Any

import torch
from torch.profiler import record_function

from lowdiff.compressors.base import Compressor
from lowdiff.errors import InvalidArgumentError, UsageError
from lowdiff.state import capture as st


def compress_grads(
    params: list[tuple[st.ParamInfo, torch.nn.Parameter]],
    numels: list[int],
    compressor: Compressor,
    t: int,
) -> tuple[dict[int, dict[str, torch.Tensor]], list[int]]:
    """Compress every ``.grad`` and write its decompressed form back (what training applies).

    Returns:
        The payloads by parameter index, and the indices of parameters without a gradient.
    """
    payloads: dict[int, dict[str, torch.Tensor]] = {}
    nograd: list[int] = []
    with torch.no_grad():
        for (info, p), numel in zip(params, numels, strict=True):
            g = p.grad
            if g is None:
                nograd.append(info.index)
                continue
            if g.is_sparse:
                raise InvalidArgumentError(st.sparse_gradient_error(info.name))
            flat = g.detach().contiguous().view(-1)
            payload = compressor.compress(flat, info.index, t)
            if flat.data_ptr() == g.data_ptr():
                # in place: no dense temporary per parameter per step
                compressor.decompress_into(payload, flat)
            else:
                g.copy_(compressor.decompress(payload, numel, flat.dtype).view_as(g))
            payloads[info.index] = payload
    return payloads, nograd


@dataclasses.dataclass
class StepGrads:
    """What :meth:`Strategy.take_gradients` hands to :meth:`Strategy.after_update`."""

    payloads: dict[int, dict[str, torch.Tensor]] = dataclasses.field(default_factory=dict)
    """Record payloads by parameter index (compressed training)."""
    nograd: list[int] = dataclasses.field(default_factory=list)
    """Indices of parameters without a gradient this step."""
    slot: int = -1
    """The snapshot slot holding the gradients (LowDiff+)."""
    scale: tuple[str, float, list[int]] | None = None
    """LowDiff+: (dtype name, factor, indices) when the slot holds the gradients, but
    those of the listed optimizer indices, as they were before
    :meth:`Strategy.clip_grad_norm_` multiplied them by that factor."""
    extra_s: float = 0.0
    """Time spent profiling (counted as checkpointing work, not training)."""
    compress_s: float = 0.0
    """Time spent compressing the gradients on the training process (compressed
    training's own work, which training without checkpoints does too)."""


PIPELINE_STAGES = (
    "begin", "take_gradients", "compress", "hparams", "update", "after_update", "steps"
)  # fmt: skip
"""Keys of :attr:`Strategy.pipeline_s`."""


@dataclasses.dataclass(frozen=True)
class StepTimings:
    """Seconds the training process spent in each stage of ``step()``, summed over a
    session (:attr:`lowdiff.Checkpointer.timings`).

    Attributes:
        begin: starting the step (raising what background work reported, waiting for
            what must finish before the update).
        take_gradients: taking the gradients as the optimizer applies them, of which
            ``compress``: compressing them (compressed training does that anyway).
        hparams: taking the update's hyperparameters.
        update: ``optimizer.step()`` and ``scheduler.step()``.
        after_update: handing the step over, checkpointing when due.
        steps: steps timed.
    """

    begin: float = 0.0
    take_gradients: float = 0.0
    compress: float = 0.0
    hparams: float = 0.0
    update: float = 0.0
    after_update: float = 0.0
    steps: int = 0

    @classmethod
    def of(cls, times: dict[str, float]) -> StepTimings:
        """From :attr:`Strategy.pipeline_s`."""
        t = times
        return cls(
            t["begin"], t["take_gradients"], t["compress"], t["hparams"], t["update"],
            t["after_update"], int(t["steps"]),
        )  # fmt: skip

    @property
    def overhead_s(self) -> float:
        """lowdiff's own seconds on the training process: every stage except
        compression and the update itself."""
        return self.begin + self.take_gradients - self.compress + self.hparams + self.after_update


def trainer_overhead_s(times: dict[str, float]) -> float:
    """A strategy's own seconds on the training process in :attr:`Strategy.pipeline_s`
    (:attr:`StepTimings.overhead_s`)."""
    return StepTimings.of(times).overhead_s


class Strategy(abc.ABC):
    """One checkpointing strategy (see the module docstring for the call sequence).

    Subclasses set :attr:`name`, keep ``model``, ``optimizer`` and ``scheduler`` as
    attributes, and implement the stages; :meth:`step` is the pipeline and is not
    overridden.
    """

    name: str = ""
    """The strategy's name (``strategy=`` of :class:`lowdiff.Checkpointer`)."""
    driven_by_hooks: bool = False
    """Driven by the optimizer's own ``step()`` (:func:`lowdiff.attach`), not by :meth:`step`."""
    records_hparams: bool = False
    """Whether :meth:`after_update` needs the update's hyperparameters."""

    @property
    def is_closed(self) -> bool:
        """Whether ``close()`` ran (a closed strategy neither resumes nor steps again)."""
        return False

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any | None
    recovery_stats: Any = None
    """:class:`lowdiff.RecoveryStats` of the last :meth:`resume`, or None."""

    @abc.abstractmethod
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        directory: str | os.PathLike[str] | None,
        **options: Any,
    ) -> None:
        """Validate the options and take the directory lock (nothing is started yet)."""

    # ------------------------------------------------------------------ the pipeline
    def step(self, metric: float | None = None) -> None:
        """Run one training update through the strategy (the pipeline of the module docstring).

        Args:
            metric: passed to ``scheduler.step(metric)`` (for ReduceLROnPlateau).
        """
        if self.driven_by_hooks:
            if self.is_closed:
                raise UsageError("step() after close()")
            raise UsageError(
                "lowdiff is attached to the optimizer: call optimizer.step() (and your "
                "scheduler's step()) as usual, not ck.step()"
            )
        t, grads, hp = self.prepare_update()
        t0 = time.perf_counter()
        self.optimizer.step()
        if self.scheduler is not None:
            if metric is None:
                self.scheduler.step()
            else:
                self.scheduler.step(metric)
        self.finish_update(t, grads, hp, time.perf_counter() - t0)

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """Clip the gradients of the optimizer's parameters by their total norm, as
        ``torch.nn.utils.clip_grad_norm_`` over those parameters does; the total norm."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return torch.nn.utils.clip_grad_norm_(
            params, max_norm, norm_type, error_if_nonfinite, foreach
        )

    def prepare_update(self) -> tuple[int, StepGrads, Any]:
        """The pipeline up to the update: ``begin_step``, ``before_update``,
        ``take_gradients`` and the hyperparameters; (t, grads, hp). Shared by :meth:`step`
        and the optimizer hooks of :func:`lowdiff.attach`; timed per stage into
        :attr:`pipeline_s`."""
        clock = time.perf_counter
        with record_function("lowdiff.take_gradients"):
            t0 = clock()
            t = self.begin_step()
            self.before_update(t)
            t1 = clock()
            grads = self.take_gradients(t)
            t2 = clock()
            hp = self.hparams() if self.records_hparams else None
            t3 = clock()
        times = self.pipeline_s
        times["begin"] += t1 - t0
        times["take_gradients"] += t2 - t1
        times["compress"] += grads.compress_s
        times["hparams"] += t3 - t2
        return t, grads, hp

    def finish_update(self, t: int, grads: StepGrads, hp: Any, update_s: float) -> None:
        """The pipeline after the update (``after_update``), timed into :attr:`pipeline_s`."""
        t0 = time.perf_counter()
        with record_function("lowdiff.after_update"):
            self.after_update(t, grads, hp, update_s)
        times = self.pipeline_s
        times["update"] += update_s
        times["after_update"] += time.perf_counter() - t0
        times["steps"] += 1

    @property
    def pipeline_s(self) -> dict[str, float]:
        """Seconds this process spent in each stage of the pipeline, summed over steps.

        Keys: ``begin`` (``begin_step`` + ``before_update``), ``take_gradients`` (of which
        ``compress``: compressing the gradients, which compressed training does anyway),
        ``hparams``, ``update`` (``optimizer.step()`` and ``scheduler.step()``),
        ``after_update``, and ``steps``. The strategy's own cost on the training process
        is :func:`trainer_overhead_s` of this dict.
        """
        times = self.__dict__.get("_pipeline_s")
        if times is None:
            times = self.__dict__["_pipeline_s"] = dict.fromkeys(PIPELINE_STAGES, 0.0)
        return times

    # ------------------------------------------------------------------ stages
    def hparams(self) -> Any:
        """The update's hyperparameters, taken before ``optimizer.step()`` (called only
        when :attr:`records_hparams`); passed to :meth:`after_update` as ``hp``. By
        default :func:`lowdiff.state.capture.capture_hparams`; a strategy may return them
        in the form it stores them."""
        return st.capture_hparams(self.optimizer)

    @abc.abstractmethod
    def resume(self) -> int:
        """Restore the newest recoverable state, or prepare an empty directory; the step."""

    @abc.abstractmethod
    def begin_step(self) -> int:
        """Start if not started, raise what background work reported; the step ``t``."""

    def before_update(self, t: int) -> None:  # noqa: B027 -- optional stage
        """Wait for whatever must finish before update ``t`` changes the state."""

    @abc.abstractmethod
    def take_gradients(self, t: int) -> StepGrads:
        """The gradients of update ``t`` as the optimizer will apply them."""

    @abc.abstractmethod
    def after_update(self, t: int, grads: StepGrads, hp: Any, update_s: float) -> None:
        """Update ``t`` is done (the state is at ``t + 1``): record it, checkpoint when due."""

    @abc.abstractmethod
    def flush(self) -> int:
        """Wait until everything taken so far is durable; the newest durable step."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flush, stop background work and release the directory (idempotent)."""

    # ------------------------------------------------------------------ state
    @property
    @abc.abstractmethod
    def step_count(self) -> int:
        """Optimizer updates done so far."""

    @property
    @abc.abstractmethod
    def durable_step(self) -> int:
        """Newest step recoverable from disk (-1 before the first write)."""

    @property
    def acknowledged_step(self) -> int:
        """Newest step a crash of the training process loses nothing up to: its data is
        in host memory, handed to the background work (by default :attr:`durable_step`)."""
        return self.durable_step

    @property
    @abc.abstractmethod
    def stats(self) -> dict[str, float]:
        """Counters and timings of this session."""

    @property
    def plan_history(self) -> list[dict[str, Any]]:
        """The (f, b) plans of ``"auto"`` (empty for strategies without one)."""
        return []

    @property
    def remote_durable_step(self) -> int:
        """Newest step recoverable from the remote tier (-1: none, or no ``remote=``)."""
        return -1

    def flush_remote(self) -> int:
        """Flush, then wait until the remote tier holds every durable step; that step."""
        raise InvalidArgumentError(
            f"flush(remote=True) needs remote=..., which method {self.name!r} does not take"
        )

    def __enter__(self) -> Strategy:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            with contextlib.suppress(Exception):
                self.close()

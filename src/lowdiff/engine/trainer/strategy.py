"""The one trainer-side strategy of lowdiff's methods, and the three methods.

:class:`EngineStrategy` implements :class:`lowdiff.strategy.Strategy` for
``"lowdiff"``, ``"lowdiff+"`` and ``"compression-only"``. It owns the parts of a session,
each with one job: the training objects (:mod:`~lowdiff.engine.trainer.training`), the
progress (:mod:`~lowdiff.engine.trainer.progress`), the directory
(:mod:`~lowdiff.engine.trainer.directory`), the gradient source, and, for the methods that
write, the session with its checkpointing process and a
:class:`~lowdiff.engine.trainer.backend.Backend` (LowDiff's writer, LowDiff+'s replica).
One step's path is :mod:`~lowdiff.engine.trainer.pipeline`; resume starts at
:mod:`~lowdiff.engine.trainer.resume`, the end at :mod:`~lowdiff.engine.trainer.ending`.
The methods differ only by their backend (:attr:`EngineStrategy.backend_type`); nothing
here branches on a method's name.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import weakref
from collections.abc import Callable
from multiprocessing import util as mp_util
from pathlib import Path
from typing import Any, ClassVar

import torch

from lowdiff.compressors.base import NoCompression
from lowdiff.ddp.context import JobMin
from lowdiff.ddp.context import detect as detect_dist
from lowdiff.ddp.hooks import LowDiffHookState
from lowdiff.ddp.peers import resolve_peer_copies
from lowdiff.engine.options import EngineOptions
from lowdiff.engine.trainer import remote_wait
from lowdiff.engine.trainer.autotune import AutoPlan
from lowdiff.engine.trainer.backend import Backend, GradientSource
from lowdiff.engine.trainer.directory import CheckpointDir
from lowdiff.engine.trainer.ending import SessionEnd
from lowdiff.engine.trainer.gradients import (
    CompressedGradients,
    record_compressor,
    training_compressor,
)
from lowdiff.engine.trainer.handover import Handover, OptimizerHooks
from lowdiff.engine.trainer.parts import SessionParts
from lowdiff.engine.trainer.pipeline import StepPipeline
from lowdiff.engine.trainer.progress import Cadence, Progress
from lowdiff.engine.trainer.replica_backend import ReplicaBackend, SnapshotGradients
from lowdiff.engine.trainer.resume import resume, start_implicit
from lowdiff.engine.trainer.session import ProcessSession
from lowdiff.engine.trainer.snapshot import GradSnapshotter
from lowdiff.engine.trainer.staging import FullStager
from lowdiff.engine.trainer.start import Starter
from lowdiff.engine.trainer.storage_policy import StoragePolicy
from lowdiff.engine.trainer.training import TrainingObjects
from lowdiff.engine.trainer.writer_backend import WriterBackend
from lowdiff.errors import InvalidArgumentError, UsageError
from lowdiff.proc import channel, preempt
from lowdiff.proc.holder import orphan_waits
from lowdiff.proc.spawn import warm_up
from lowdiff.remote.store import preload
from lowdiff.state import capture as st
from lowdiff.state.sharded import refuse_sharded
from lowdiff.strategy import StepGrads, Strategy


class EngineStrategy(Strategy):
    """lowdiff's own methods (see the module docstring); built by
    :class:`lowdiff.Checkpointer`, whose arguments these are."""

    backend_type: ClassVar[type[Backend] | None] = None
    """The checkpointing process the method feeds (None: it writes nothing)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        directory: str | os.PathLike[str] | None,
        *,
        scheduler: Any | None = None,
        extra_state: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        extra = _checked(model, optimizer, scheduler, extra_state, self.name)
        self.options = opts = EngineOptions(**options)
        dist, kind = detect_dist(model), self.backend_type
        opts.check_for(
            self.name,
            ddp=dist is not None,
            replica=kind is not None and kind.keeps_replica,
            can_suspend=kind is not None and kind.can_suspend,
            sharded=dist is not None and dist.sharded,
        )
        if kind is not None:
            kind.check_optimizer(optimizer)
            if directory is None:
                raise InvalidArgumentError(
                    f"method {self.name!r} needs a checkpoint directory, got None"
                )
        compressed = kind is None or kind.trains_compressed
        rank = training_compressor(opts.compressor) if compressed else NoCompression()
        records = record_compressor(rank, dist) if compressed else rank
        self.objects = TrainingObjects(self.name, model, optimizer, scheduler, records, dist, extra)
        if kind is not None and kind.keeps_replica and dist is not None:
            self.objects.keep_peer_copy(
                resolve_peer_copies(opts.peer_copies, dist.rank, dist.world_size)
            )
        self.progress = Progress(None if dist is None else JobMin(dist, width=2))
        self.cadence = Cadence.of(opts.full_every, opts.batch_size)
        self.gradients: GradientSource = (
            CompressedGradients(self.objects, self.progress, rank)
            if compressed
            else SnapshotGradients(self.objects, self.progress, opts.max_lag)
        )
        self.handover = Handover(extra)
        self.hooks = OptimizerHooks(self, self.handover)
        self.directory: CheckpointDir | None = None
        self.policy = StoragePolicy(opts.on_storage_error, self.progress, self.cadence)
        self.starter = s = (
            None if kind is None or directory is None else self._open(kind, directory)
        )
        self.pipeline = StepPipeline(
            self.objects, self.progress, self.cadence, self.gradients, self.handover,
            self.policy, self.progress.start if s is None else functools.partial(start_implicit, s),
            s,
        )  # fmt: skip
        self.ending = SessionEnd(
            self.objects, self.progress, opts, self.handover, self.hooks, self.policy,
            self.pipeline, self.starter,
        )  # fmt: skip
        if self.starter is not None:
            self._plan_auto(self.starter)
            ref = weakref.ref(self)
            atexit.register(_close_at_exit, ref)
            # a trainer that is itself a multiprocessing child (torch.multiprocessing.spawn,
            # a forking launcher) never runs atexit handlers: it runs multiprocessing's
            # exit finalizers, before it joins its own children (the checkpointing process)
            mp_util.Finalize(None, _close_at_exit, args=(ref,), exitpriority=10)
            if opts.sigterm_timeout is not None:
                preempt.register(self, opts.sigterm_timeout)

    def _open(self, kind: type[Backend], directory: str | os.PathLike[str]) -> Starter:
        """Lock the directory, lay out the records, and make the session and its backend."""
        opts, objects = self.options, self.objects
        self.directory = d = CheckpointDir(directory, objects.dist)
        objects.lay_out()
        if opts.remote is not None:
            preload(opts.remote)  # before the process server is forked from here
        if not orphan_waits(d.root):
            warm_up()  # the process server starts while the trainer resumes
        session = ProcessSession(
            objects, self.progress, start_timeout=opts.start_timeout,
            stall_timeout=opts.stall_timeout,
        )  # fmt: skip
        self.policy.watch(session, d)
        stager = FullStager(objects, self.progress, d, self.handover)
        parts = SessionParts(objects, self.progress, self.cadence, opts, d, session)
        return Starter(parts, stager, kind(parts, self.gradients))

    def _plan_auto(self, s: Starter) -> None:
        """With ``full_every`` or ``batch_size`` ``"auto"``: the planner, fed by every part."""
        auto = self.options.auto
        if not auto:
            return
        plan = AutoPlan(
            self.objects, self.progress, self.cadence, s.directory.root, self.options.mtbf,
            tune_f="full_every" in auto, tune_b="batch_size" in auto, send=s.session.send,
        )  # fmt: skip
        s.session.tuner = plan.tuner
        s.stager.observe_copy = plan.tuner.observe_full_copy
        if isinstance(self.gradients, CompressedGradients):
            self.gradients.sample = plan.sample_decompress
        self.pipeline.autoplan = plan

    # ------------------------------------------------------------------ the parts
    model = property(lambda self: self.objects.model)  # type: ignore[assignment]
    optimizer = property(lambda self: self.objects.optimizer)  # type: ignore[assignment]
    scheduler = property(lambda self: self.objects.scheduler)  # type: ignore[assignment]
    compressor = property(lambda self: self.objects.compressor, doc="The records' compressor.")
    params = property(lambda self: self.objects.params, doc="The optimized parameters.")
    full_every = property(lambda self: self.cadence.full_every, doc="f in use.")
    batch_size = property(lambda self: self.cadence.batch_size, doc="b in use.")
    autoplan = property(lambda self: self.pipeline.autoplan, doc="The ``auto`` planner.")
    session = property(lambda self: None if self.starter is None else self.starter.session)
    stager = property(lambda self: None if self.starter is None else self.starter.stager)
    backend = property(lambda self: None if self.starter is None else self.starter.backend)

    @property
    def root(self) -> Path | None:
        """This rank's checkpoint directory (a shard directory under DDP), or None."""
        return None if self.directory is None else self.directory.root

    @property
    def ddp_hook_state(self) -> LowDiffHookState | None:
        """Under DDP with compression: lowdiff's communication hook, else None."""
        return self.gradients.hook_state

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """Clip as torch does; under LowDiff+ the snapshot carries the factor (see
        :meth:`lowdiff.Checkpointer.clip_grad_norm_`)."""
        g = self.gradients
        if isinstance(g, SnapshotGradients):
            total = g.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite, foreach)
            if total is not None:
                return total
        return super().clip_grad_norm_(max_norm, norm_type, error_if_nonfinite, foreach)

    @property
    def snapshotter(self) -> GradSnapshotter | None:
        """LowDiff+'s layer-wise gradient snapshotter of the running process, or None."""
        g = self.gradients
        return g.snapshotter if isinstance(g, SnapshotGradients) else None

    @property
    def worker_process(self) -> Any:
        """The checkpointing process (``multiprocessing.Process``), or None."""
        return None if self.session is None else self.session.process

    @property
    def memory_miss_reason(self) -> str | None:
        """Why ``resume()`` did not recover from a replica in memory, or did not take a
        process over (None when it did both, or before ``resume()``)."""
        return None if self.starter is None else self.starter.takeover.miss_reason

    @property
    def slots_pinned(self) -> bool:
        """Whether the record or snapshot slots are page-locked (a GPU copies into them
        asynchronously; False on CPU training)."""
        slots = None if self.session is None else self.session.slots
        return bool(slots is not None and slots.pinned)

    # ------------------------------------------------------------------ state
    recovery_stats = property(lambda self: self.progress.recovery_stats)  # type: ignore[assignment]
    is_closed = property(lambda self: self.progress.closed)  # type: ignore[assignment]
    step_count = property(lambda self: self.progress.step)  # type: ignore[assignment]

    @property
    def durable_step(self) -> int:
        """Newest step recoverable from disk (see :attr:`lowdiff.Checkpointer.durable_step`;
        under DDP every shard's, as of the previous ``step()``)."""
        self.pipeline.poll()
        return self.progress.durable_step()

    @property
    def acknowledged_step(self) -> int:
        """Newest step handed to the checkpointing process with its data in host memory
        (see :attr:`lowdiff.Checkpointer.acknowledged_step`; this rank's). With LowDiff+'s
        peer copies, a step is acknowledged once the other node's copy holds it too."""
        self.pipeline.poll()
        progress, s = self.progress, self.starter
        if self.objects.peer is None or s is None or s.session.counters is None:
            return progress.acknowledged_step()
        copied = s.session.counter(channel.PEER_ACKED) - 1
        return max(min(progress.acknowledged, copied), progress.durable)

    @property
    def remote_durable_step(self) -> int:
        """Newest step the remote tier can recover (see
        :attr:`lowdiff.Checkpointer.remote_durable_step`)."""
        self.pipeline.poll()
        return self.progress.remote_durable_step()

    @property
    def stats(self) -> dict[str, float]:
        """Counters and timings of this session (see :attr:`lowdiff.Checkpointer.stats`)."""
        self.pipeline.poll()
        layout = self.objects.layout
        out = dict(
            self.progress.stats,
            durable_step=self.durable_step,
            record_row_bytes=0 if layout is None else layout.row_bytes,
            full_every=self.full_every,
            records_per_file=self.batch_size,
            slots_pinned=float(self.slots_pinned),
        )
        if self.options.remote is not None:
            out.update(remote_wait.stats(self.session, self.progress))
        snap = self.snapshotter
        if snap is not None:  # LowDiff+: the gradients' copies to host memory
            out.update(
                gradient_copies=snap.stats.gradient_copies, clip_scaled_steps=snap.stats.scaled
            )
        hook = self.ddp_hook_state
        if hook is not None:  # DDP: bytes of lowdiff's gradient exchange
            out.update(hook.wire.as_dict())
        return out

    @property
    def plan_history(self) -> list[dict[str, Any]]:
        """With ``"auto"``: every (f, b) this session used."""
        plan = self.autoplan
        return [] if plan is None else [dict(e) for e in plan.tuner.history]

    def set_plan(self, f: int, b: int, reason: str = "forced") -> None:
        """Switch to (f, b) now, as the ``"auto"`` planner does (for tests and tools)."""
        if self.autoplan is None:
            raise UsageError("(f, b) can change only with full_every or batch_size 'auto'")
        self.autoplan.set_plan(f, b, reason)

    # ------------------------------------------------------------------ the pipeline
    def resume(self) -> int:
        """Restore the newest recoverable state, or prepare an empty directory; the step
        (see :meth:`lowdiff.Checkpointer.resume`)."""
        if self.progress.started:
            raise UsageError("resume() must be called once, before the first step()")
        if self.starter is None:
            self.progress.start()  # nothing to restore: training starts at step 0
            return 0
        return resume(self.starter)

    def begin_step(self) -> int:
        return self.pipeline.begin_step()

    def check_groups(self) -> None:
        """Refuse an optimizer that gained a parameter group since construction."""
        self.objects.check_groups()

    def take_gradients(self, t: int) -> StepGrads:
        return self.pipeline.take_gradients(t)

    def hparams(self) -> str:
        return self.pipeline.hparams()

    def after_update(self, t: int, grads: StepGrads, hp: str | None, update_s: float) -> None:
        self.pipeline.after_update(t, grads, hp, update_s)

    # ------------------------------------------------------------------ the end
    def flush(self) -> int:
        """Write what waits for a full batch, wait until it is durable; the durable step
        (under DDP a collective call)."""
        return self.ending.flush()

    def flush_remote(self) -> int:
        """:meth:`flush`, then wait for the remote tier
        (:func:`lowdiff.engine.trainer.remote_wait.wait_remote`)."""
        if self.options.remote is None:
            raise InvalidArgumentError(
                "flush(remote=True) needs remote=... (no remote tier is configured)"
            )
        return self.ending.flush_remote()

    def close(self) -> None:
        """Flush everything, wait until it is durable and stop the checkpointing process
        (see :meth:`lowdiff.Checkpointer.close`)."""
        self.ending.close(self._release)

    def let_go(self) -> None:
        """After a failure on a rank of a distributed job: let go as a rank that dies
        does, without stopping the checkpointing process. The optimizer's hooks come off,
        the steps whose copies are in flight are sent, the pipes close without a
        ``Close``; the process writes (LowDiff) or merges and persists (LowDiff+) what it
        was handed and waits ``Timeouts(idle=...)`` for the restarted rank, which takes
        it over. In one process this is :meth:`close`."""
        if self.is_closed:
            return
        self.hooks.detach()
        for fn in self.ending.on_close:  # attach()'s own: the optimizer may be attached again
            fn()
        self.ending.close_at_exit(self.close, self._release)

    def preempt(self, deadline: float) -> None:
        """On SIGTERM: make every acknowledged step durable by ``deadline``."""
        self.ending.preempt(deadline)

    def _release(self) -> None:
        """Give back what the session holds (pipes, pinned memory, the directory lock)."""
        preempt.unregister(self)
        if "ending" in self.__dict__:
            self.ending.release()
        elif (d := self.__dict__.get("directory")) is not None:  # a construction that failed
            d.release_lock()

    def __del__(self) -> None:
        # Dropped without close(): closing the pipe makes the checkpointing process flush
        # what it received and exit, and the directory lock is given back.
        with contextlib.suppress(Exception):
            self._release()

    # ------------------------------------------------------------------ lowdiff.attach
    def attach_to_optimizer(self) -> None:
        """Drive this strategy from ``optimizer.step()`` (see :func:`lowdiff.attach`)."""
        if self.backend is not None:
            self.backend.check_attach()
        self.hooks.attach(self.objects.optimizer)
        self.driven_by_hooks = True

    def on_close(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` when this strategy is closed (before it flushes)."""
        self.ending.on_close.append(fn)

    def capture_after_update(self, name: str) -> None:
        """See :meth:`lowdiff.Checkpointer.capture_after_update`."""
        self.handover.capture_after_update(name)

    def recapture(self, name: str) -> None:
        """See :meth:`lowdiff.Checkpointer.recapture`."""
        self.handover.recapture(name)

    def retake(self, name: str) -> None:
        """See :meth:`lowdiff.Checkpointer.retake`."""
        self.handover.retake(name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(root={self.root}, step={self.progress.step})"


def _checked(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
    extra_state: dict[str, Any] | None,
    name: str,
) -> dict[str, Any]:
    """Refuse training objects lowdiff's methods cannot checkpoint; the extra state."""
    st.check_training_objects(model, optimizer, scheduler)
    refuse_sharded(model, optimizer, name)
    st.refuse_lbfgs(optimizer)
    extra = st.check_extra_state(extra_state)
    # each state_dict() once, now: an object that cannot give its state (or whose state
    # cannot be saved) is named here, before anything is started or written
    st.capture_extra(extra)
    return extra


def _close_at_exit(ref: weakref.ref[EngineStrategy]) -> None:
    """Interpreter exit without close(): flush what is pending so nothing is lost."""
    s = ref()
    if s is not None:
        s.ending.close_at_exit(s.close, s._release)


class LowDiffStrategy(EngineStrategy):
    """Method ``"lowdiff"``: per-iteration checkpointing that logs the compressed gradient
    every update applies (:mod:`lowdiff.engine.trainer.writer_backend`)."""

    name = "lowdiff"
    records_hparams = True
    backend_type = WriterBackend


class LowDiffPlusStrategy(EngineStrategy):
    """Method ``"lowdiff+"``: training without compression, a CPU replica that survives
    a crash (:mod:`lowdiff.engine.trainer.replica_backend`)."""

    name = "lowdiff+"
    records_hparams = True
    backend_type = ReplicaBackend


class CompressionOnlyStrategy(EngineStrategy):
    """Method ``"compression-only"``: the compression of ``"lowdiff"`` and no
    checkpointing at all (the baseline lowdiff's overheads are measured against); the
    directory is ignored."""

    name = "compression-only"
    records_hparams = False
    backend_type = None

"""What lowdiff's own strategies share: the public API over their composed parts.

:class:`EngineStrategy` implements the :class:`lowdiff.strategy.Strategy` contract for
``"lowdiff"``, ``"lowdiff+"`` and ``"none"`` by delegating to the parts each one
composes: an :class:`~lowdiff.engine.core.EngineCore` (training objects, counters,
directory), a :class:`~lowdiff.engine.handover.Handover` and
:class:`~lowdiff.engine.handover.OptimizerHooks` (``lowdiff.attach``), and, for the two
that checkpoint, a :class:`~lowdiff.engine.session.ProcessSession` with its
:class:`~lowdiff.engine.storage_policy.StoragePolicy`. What differs between them (their
compressor, how they take gradients, what they hand over, how they resume) is each
peer's own code (:mod:`lowdiff.engine.lowdiff`, :mod:`lowdiff.engine.lowdiff_plus`,
:mod:`lowdiff.engine.none`); nothing here branches on a strategy.
"""

from __future__ import annotations

import abc
import atexit
import contextlib
import os
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch

from lowdiff.compressors.base import Compressor
from lowdiff.ddp.context import DistContext
from lowdiff.ddp.context import detect as detect_dist
from lowdiff.ddp.hooks import LowDiffHookState
from lowdiff.engine import remote_wait
from lowdiff.engine.autotune import AutoPlan
from lowdiff.engine.core import EngineCore
from lowdiff.engine.gradients import CompressedGradients
from lowdiff.engine.handover import Handover, OptimizerHooks
from lowdiff.engine.options import EngineOptions
from lowdiff.engine.remote_tier import RemoteSettings
from lowdiff.engine.session import ProcessSession
from lowdiff.engine.storage_policy import CheckpointingSuspended, StoragePolicy
from lowdiff.errors import UsageError
from lowdiff.plan import START_B, START_F
from lowdiff.proc.protocol import Close, Flush, Kind
from lowdiff.recovery.replay import RecoveryStats
from lowdiff.state import capture as st
from lowdiff.state.sharded import refuse_sharded
from lowdiff.strategy import StepGrads, Strategy


class EngineStrategy(Strategy):
    """The shared API of lowdiff's own strategies (built by :class:`lowdiff.Checkpointer`,
    whose arguments these are)."""

    name = ""
    gradients: CompressedGradients | None = None
    """How the strategy takes compressed gradients (``"lowdiff"``, ``"none"``)."""
    keeps_replica: ClassVar[bool] = False
    """Whether the strategy keeps a CPU replica (LowDiff+: its own options apply)."""
    can_suspend: ClassVar[bool] = False
    """Whether training can go on without checkpointing after a storage error
    (``on_storage_error="warn"``: LowDiff)."""

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
        st.check_training_objects(model, optimizer, scheduler)
        refuse_sharded(model, optimizer, self.name)
        st.refuse_lbfgs(optimizer)
        extra = st.check_extra_state(extra_state)
        # each state_dict() once, now: an object that cannot give its state (or whose state
        # cannot be saved) is named here, before anything is started or written
        st.capture_extra(extra)
        self.options = opts = EngineOptions(**options)
        dist = detect_dist(model)
        opts.check_for(
            self.name,
            ddp=dist is not None,
            replica=self.keeps_replica,
            can_suspend=self.can_suspend,
            sharded=dist is not None and dist.sharded,
        )
        self._check_optimizer(optimizer)
        compressor = self._records_compressor(opts, dist)
        self.core = core = EngineCore(
            self.name, model, optimizer, scheduler, compressor, dist, extra
        )
        core.configured = {"full_every": opts.full_every, "batch_size": opts.batch_size}
        core.full_every = START_F if isinstance(opts.full_every, str) else opts.full_every
        core.batch_size = START_B if isinstance(opts.batch_size, str) else opts.batch_size
        self.handover = Handover(extra)
        self.hooks = OptimizerHooks(self, self.handover)
        self._on_close: list[Callable[[], None]] = []
        self.session: ProcessSession | None = None
        self.policy = StoragePolicy(opts.on_storage_error, core, lambda: core.full_every)
        self.autoplan: AutoPlan | None = None
        self._install(directory)

    def remote_settings(self) -> RemoteSettings | None:
        """The remote tier as this rank's checkpointing process takes it (under DDP:
        placed at this shard's folder of the job), or None."""
        remote, core = self.options.remote_settings(), self.core
        if remote is None or core.dist is None:
            return remote
        assert core.job_root is not None and core.root is not None
        return remote.for_shard(core.job_root, core.root, core.dist.rank, core.dist.world_size)

    # ------------------------------------------------------------------ for the peers
    def _check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:  # noqa: B027
        """Refuse an optimizer the strategy cannot run (LowDiff+'s replica)."""

    @abc.abstractmethod
    def _records_compressor(self, opts: EngineOptions, dist: DistContext | None) -> Compressor:
        """The compressor of the records (and of training, for LowDiff and ``"none"``)."""

    @abc.abstractmethod
    def _install(self, directory: str | os.PathLike[str] | None) -> None:
        """Set up the peer's own parts: its DDP hook, its directory."""

    def _emit(self, t: int, grads: StepGrads, hp: str) -> None:  # noqa: B027
        """Hand step ``t`` over (strategies that record)."""

    def _start_implicit(self) -> None:
        """Start on the first ``step()`` without ``resume()``."""
        self.core.started = True

    def _close_session(self) -> None:  # noqa: B027
        """Make what was handed over durable and stop the checkpointing process."""

    def _release(self) -> None:
        """Give back what the session holds (pipes, pinned memory, the directory lock)."""
        if self.session is not None:
            self.session.release()
        self.core.release_lock()

    # ------------------------------------------------------------------ state
    @property
    def model(self) -> torch.nn.Module:  # type: ignore[override]
        return self.core.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:  # type: ignore[override]
        return self.core.optimizer

    @property
    def scheduler(self) -> Any | None:  # type: ignore[override]
        return self.core.scheduler

    @property
    def compressor(self) -> Compressor:
        """The compressor of the records."""
        return self.core.compressor

    @property
    def root(self) -> Path | None:
        """This rank's checkpoint directory (a shard directory under DDP); None for ``"none"``."""
        return self.core.root

    @property
    def full_every(self) -> int:
        """f in use (``"auto"`` changes it)."""
        return self.core.full_every

    @property
    def batch_size(self) -> int:
        """b in use (``"auto"`` changes it)."""
        return self.core.batch_size

    @property
    def params(self) -> list[tuple[st.ParamInfo, torch.nn.Parameter]]:
        """The optimized parameters, in the optimizer's order."""
        return self.core.params

    @property
    def ddp_hook_state(self) -> LowDiffHookState | None:
        """Under DDP with compression (``"lowdiff"``, ``"none"``): lowdiff's communication
        hook (the merged payloads of the step, the wire statistics); otherwise None."""
        return None if self.gradients is None else self.gradients.hook_state

    @property
    def worker_process(self) -> Any:
        """The checkpointing process (``multiprocessing.Process``), or None."""
        return None if self.session is None else self.session.process

    @property
    def recovery_stats(self) -> RecoveryStats | None:  # type: ignore[override]
        return self.core.recovery_stats

    @property
    def is_closed(self) -> bool:
        return self.core.closed

    @property
    def step_count(self) -> int:
        """Optimizer updates done so far (the step the live state is at)."""
        return self.core.step

    @property
    def durable_step(self) -> int:
        """Newest step whose state is recoverable from disk (-1 before the first write).

        Under DDP: the newest step that every rank's shard has made durable, as of the
        previous ``step()`` (the ranks exchange it in the background once per step, so it
        may trail this rank's own progress by a step; it never runs ahead of any shard).
        ``flush()`` and ``close()``, called by every rank, bring it up to the job's last step.
        """
        self._poll()
        return self.core.durable_step()

    @property
    def remote_durable_step(self) -> int:
        """Newest step the remote tier (``remote=``) can recover: a committed full
        checkpoint and committed record files reaching it; -1 before the first such
        chain, and always without ``remote=``.

        Under DDP: the newest step that every rank's shard has committed remotely,
        exchanged with :attr:`durable_step` in the same background all-reduce (so it may
        trail by a step as well). ``flush(remote=True)`` and ``close()``, called by every
        rank, bring it up to the job's last step.
        """
        self._poll()
        return self.core.remote_durable_step()

    @property
    def slots_pinned(self) -> bool:
        """Whether the record (LowDiff) or snapshot (LowDiff+) slots are page-locked, so
        that a GPU copies into them asynchronously (False on CPU training)."""
        slots = None if self.session is None else self.session.slots
        return bool(slots is not None and slots.pinned)

    @property
    def stats(self) -> dict[str, float]:
        """Counters and timings of this session (see :attr:`lowdiff.Checkpointer.stats`)."""
        self._poll()
        core = self.core
        out = dict(
            core.stats,
            durable_step=self.durable_step,
            record_row_bytes=0 if core.layout is None else core.layout.row_bytes,
            full_every=core.full_every,
            batch_size=core.batch_size,
            slots_pinned=float(self.slots_pinned),
        )
        if self.options.remote is not None:
            out.update(remote_wait.stats(self))
        hook = self.ddp_hook_state
        if hook is not None:  # DDP: bytes of lowdiff's gradient exchange
            out.update(hook.wire.as_dict())
        return out

    @property
    def plan_history(self) -> list[dict[str, Any]]:
        """With ``"auto"``: every (f, b) this session used (see :attr:`lowdiff.Checkpointer.plan_history`)."""
        return [] if self.autoplan is None else [dict(e) for e in self.autoplan.tuner.history]

    def set_plan(self, f: int, b: int, reason: str = "forced") -> None:
        """Switch to (f, b) now, as the ``"auto"`` planner does (for tests and tools)."""
        if self.autoplan is None:
            raise UsageError("(f, b) can change only with full_every or batch_size 'auto'")
        self.autoplan.set_plan(f, b, reason)

    def _poll(self) -> None:
        if self.session is not None:
            self.session.poll()

    # ------------------------------------------------------------------ the pipeline
    def begin_step(self) -> int:
        core = self.core
        if core.closed:
            raise UsageError("step() after close()")
        self.check_groups()
        if not core.started:
            self._start_implicit()
        if self.session is not None:
            with contextlib.suppress(CheckpointingSuspended):
                self.session.check()
        t = core.step
        if self.autoplan is not None:
            self.autoplan.begin_step(t)
        return t

    def check_groups(self) -> None:
        """Refuse an optimizer that gained a parameter group since construction."""
        self.core.check_groups()

    def hparams(self) -> str:
        """The update's hyperparameters as the JSON text a record holds (groups that did
        not change since the previous step are not encoded again)."""
        return self.core.hp_text(self.core.optimizer)

    def after_update(self, t: int, grads: StepGrads, hp: str | None, update_s: float) -> None:
        t0 = time.perf_counter()
        plan = self.autoplan
        if plan is not None:
            plan.observe_update(update_s)  # stands for the replay of one record
        self.core.step = t + 1
        self.core.stats["steps"] += 1
        if hp is not None:
            self._emit(t, grads, hp)
        if plan is not None:
            plan.checkpointing_done(t0, grads.extra_s)

    def refresh_job_durable(self) -> None:
        """Under DDP: exchange this shard's durable step with the other ranks (in the
        background; every rank calls this at the end of every step)."""
        if self.core.job is not None:
            self._poll()
            self.core.job.refresh(*self.core.figures())

    # ------------------------------------------------------------------ flush and close
    def flush(self) -> int:
        """Write the records waiting for a full batch and wait until they are durable.

        Under DDP this is a collective call (every rank calls it at the same point): it
        returns the newest step that every shard has made durable.
        """
        core, session = self.core, self.session
        if session is None or not core.started or core.closed:
            return self.durable_step
        try:
            self.handover.finish()
            if self.policy.suspended is None:
                session.request(Flush(), Kind.FLUSHED)
        except CheckpointingSuspended:
            pass
        if self.policy.suspended is not None:
            self.policy.warn_not_durable("flush()")
        if core.job is not None:
            return core.job.now(*core.figures())[0]
        return core.durable

    def flush_remote(self) -> int:
        """:meth:`flush`, then wait for the remote tier
        (:func:`lowdiff.engine.remote_wait.flush_remote`)."""
        return remote_wait.flush_remote(self)

    def close(self) -> None:
        """Flush everything, wait until it is durable and stop the checkpointing process.

        With ``remote=``: the checkpointing process also waits for its uploads (as long
        as they make progress within ``remote_timeout``); when the remote tier is then
        behind the local one, :class:`lowdiff.RemoteStorageError` is raised after
        everything is released (the local tier holds every step either way). Under DDP
        every rank closes: the ranks exchange both durable steps once more, so that
        :attr:`durable_step` and :attr:`remote_durable_step` say the job's final figures,
        and a rank raises when its own uploads stalled or the job's remote durable step
        is behind the job's durable step.
        """
        core = self.core
        if core.closed:
            return
        self.hooks.detach()
        for fn in self._on_close:
            fn()
        core.closed = self.handover.closed = True
        closed = settled = failed = False
        try:
            if core.started and core.groups_changed():
                # a step handed over late (attach) would be sent with the new group's
                # hyperparameters and optimizer state: it is not saved
                self.handover.discard()
            if core.started:
                self.handover.finish()  # steps driven by the optimizer's hooks
            self._close_session()
            closed = self.policy.suspended is None
            if self.options.remote is not None and self.session is not None and closed:
                self._poll()  # the remote durable step the process reached before it closed
        except CheckpointingSuspended:
            pass
        except BaseException:
            # the process failed, or made no progress for stall_timeout: it is not waited
            # for a second time (it finishes what it was writing and exits once its pipes
            # close; the next session waits for it before touching the directory)
            failed = True
            raise
        finally:
            if core.job is not None:
                if closed:
                    # every step of this shard is durable now: exchange that once more, so
                    # that durable_step says the job's final step (settle() gives up on a
                    # rank that never closes, and durable_step keeps the older value); a
                    # peer that died fails the exchange (a framework closes on the error
                    # its death raised): this rank's shard is durable all the same
                    with contextlib.suppress(RuntimeError):
                        core.job.refresh(*core.figures())
                settled = core.job.settle() and closed
            if self.session is not None and not failed:
                self.session.join()
            self._release()
        if self.policy.suspended is not None:
            self.policy.warn_not_durable("close()")
        elif closed and self.options.remote is not None:
            remote_wait.check_closed(self, settled)

    def _request_close(self) -> None:
        """Tell the checkpointing process to close, and wait for its answer."""
        session = self.session
        if session is not None and session.started and self.policy.suspended is None:
            session.request(Close(), Kind.CLOSED)

    def _register_exit(self) -> None:
        """Flush at interpreter exit if the trainer never closed (see :meth:`_close_at_exit`)."""
        atexit.register(_close_at_exit, weakref.ref(self))

    def _close_at_exit(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __del__(self) -> None:
        # Dropped without close(): closing the pipe makes the checkpointing process flush
        # what it received and exit, and the directory lock is given back.
        with contextlib.suppress(Exception):
            self._release()

    # ------------------------------------------------------------------ lowdiff.attach
    def attach_to_optimizer(self) -> None:
        """Drive this strategy from ``optimizer.step()`` (see :func:`lowdiff.attach`)."""
        self.hooks.attach(self.core.optimizer)
        self.driven_by_hooks = True

    def on_close(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` when this strategy is closed (before it flushes)."""
        self._on_close.append(fn)

    def capture_after_update(self, name: str) -> None:
        """Driven by the optimizer's hooks: take ``extra_state[name]`` for each step when
        :meth:`recapture` is next called after its update, instead of right after the
        update. For state the loop changes after ``optimizer.step()`` returned and that
        belongs to the step: a ``GradScaler`` after ``update()`` (done automatically), a
        framework's global step or epoch counters.
        """
        self.handover.capture_after_update(name)

    def recapture(self, name: str) -> None:
        """Take ``extra_state[name]`` now for the steps waiting for it (see
        :meth:`capture_after_update`): each step takes it once, at the first call after
        its update (a later call belongs to later steps)."""
        self.handover.recapture(name)

    def retake(self, name: str) -> None:
        """Driven by the optimizer's hooks: take ``extra_state[name]`` again now for
        every step not handed over yet (a step is handed over when the next update
        begins), replacing what was taken for it. For state a framework changes between
        the step's update and the next one, after :meth:`recapture` took it: an
        evaluation, a log or a save of the step. The last call before the hand-over wins.
        """
        self.handover.retake(name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(root={self.core.root}, step={self.core.step})"


def _close_at_exit(ref: weakref.ref[EngineStrategy]) -> None:
    """Interpreter exit without close(): flush what is pending so nothing is lost."""
    strategy = ref()
    if strategy is not None:
        strategy._close_at_exit()

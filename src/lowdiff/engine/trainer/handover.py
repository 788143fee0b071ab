"""Driving a strategy from the optimizer's own ``step()`` (see :func:`lowdiff.attach`).

:class:`Handover` sends a step to the checkpointing process now (``ck.step()``: the
scheduler has stepped) or, driven by the optimizer's hooks, once the user's scheduler has
stepped: when the next update begins, or at ``flush()`` / ``close()``; a send whose data
a device still copies to host memory then waits for that copy among
:attr:`Handover.copies` (:mod:`lowdiff.engine.trainer.pending`). It also takes
``extra_state`` entries that belong to a step but change after its update (a
``GradScaler`` after ``update()``, a framework's counters, what a framework does
between two updates: an evaluation, a log).

:class:`OptimizerHooks` registers the optimizer's step pre- and post-hooks and runs the
strategy's pipeline (:meth:`lowdiff.strategy.Strategy.prepare_update` and
:meth:`~lowdiff.strategy.Strategy.finish_update`) from them.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import record_function

from lowdiff.engine.trainer.pending import PendingSends
from lowdiff.errors import InvalidArgumentError, LowDiffError, UsageError
from lowdiff.proc import preempt
from lowdiff.recovery.replay import replaying
from lowdiff.state import capture as st
from lowdiff.strategy import StepGrads, Strategy


class Handover:
    """The hand-over of each step's record (and full checkpoint) to the process."""

    def __init__(self, extra: dict[str, Any]) -> None:
        self.extra = extra
        self.deferred = False
        """Driven by the optimizer's hooks: each step's hand-over is finished when the
        next update begins, after the user's scheduler stepped."""
        self.closed = False
        self._pending: list[Callable[[], None]] = []
        self._pending_extra: list[tuple[dict[str, Any], set[str]]] = []
        self.late_extra: list[str] = []
        """``extra_state`` names taken again after the update (see :meth:`capture_after_update`)."""
        self.copies = PendingSends()
        """The sends handed over whose device-to-host copy may not have ended: a send
        goes to the process once its copy did."""

    def handover(self, send: Callable[[], None], extra: dict[str, Any] | None) -> None:
        """Send now, or (deferred) when the next update begins or at flush / close."""
        if not self.deferred:
            send()
            return
        with preempt.busy():  # a SIGTERM now must find the step among the pending ones
            self._pending.append(send)
            if extra is not None:
                # until it is sent, the step's tree may still be taken again (recapture, retake)
                self._pending_extra.append((extra, set(self.late_extra)))

    def finish(self) -> None:
        """Send what waits for the scheduler's step."""
        if not self._pending:
            return
        with preempt.busy(), record_function("lowdiff.handover"):
            pending, self._pending = self._pending, []
            self._pending_extra = []
            for send in pending:
                send()

    def discard(self) -> None:
        """Drop what waits for the scheduler's step, unsent."""
        self._pending = []
        self._pending_extra = []

    def capture_after_update(self, name: str) -> None:
        """Take ``extra_state[name]`` for each step when :meth:`recapture` is next called
        after its update, instead of right after the update."""
        if name not in self.extra:
            raise InvalidArgumentError(f"extra_state has no {name!r} (it has {sorted(self.extra)})")
        if name not in self.late_extra:
            self.late_extra.append(name)

    def recapture(self, name: str) -> None:
        """Take ``extra_state[name]`` now for the steps waiting for it: each step takes
        it once, at the first call after its update (a later call belongs to later steps)."""
        self._take(name, first_only=True)

    def retake(self, name: str) -> None:
        """Take ``extra_state[name]`` again now for every step not handed over yet,
        whatever was taken for it before: for state that a framework keeps changing after
        the step's update until the next update begins (an evaluation, a log, a save).

        Unlike :meth:`recapture` (the first call after the update wins), the last call
        before the hand-over wins: call it only with state that belongs to the step
        waiting, never from inside the next step."""
        if name not in self.extra:
            raise InvalidArgumentError(f"extra_state has no {name!r} (it has {sorted(self.extra)})")
        self._take(name, first_only=False)

    def _take(self, name: str, first_only: bool) -> None:
        if self.closed:
            return
        waiting = [
            (tree, names) for tree, names in self._pending_extra if name in names or not first_only
        ]
        if not waiting:
            return
        state = st.capture_extra({name: self.extra[name]})[name]
        for tree, names in waiting:
            tree[name] = state
            names.discard(name)


class OptimizerHooks:
    """Runs ``strategy``'s pipeline from ``optimizer.step()``'s pre- and post-hooks."""

    def __init__(self, strategy: Strategy, handover: Handover) -> None:
        # weakly, except while attached (the optimizer's hooks then keep the strategy, as a
        # loop that drops the Checkpointer expects): the strategy holds these hooks, and a
        # cycle would leave the strategy, and the process group it holds, to the cyclic
        # garbage collector, which may run on the group's own worker thread and destroy the
        # group there (an abort)
        self._strategy = weakref.ref(strategy)
        self._held: Strategy | None = None
        self.handover = handover
        self._handles: list[Any] = []
        self._inflight: tuple[int, StepGrads, Any, float] | None = None

    @property
    def strategy(self) -> Strategy:
        strategy = self._strategy()
        if strategy is None:
            raise LowDiffError(
                "the Checkpointer lowdiff.attach() returned was dropped without close(): keep "
                "it until training ends, and call close()"
            )
        return strategy

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        if self._handles:
            raise UsageError("lowdiff is already attached to this optimizer")
        self.handover.deferred = True
        self._held = self.strategy
        self._handles = [
            optimizer.register_step_pre_hook(self._on_step_pre),
            optimizer.register_step_post_hook(self._on_step_post),
        ]
        for name, obj in self.handover.extra.items():
            if isinstance(obj, torch.amp.GradScaler):
                self._wrap_scaler_update(name, obj)
                self.handover.capture_after_update(name)

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._held = None

    def _wrap_scaler_update(self, name: str, scaler: torch.amp.GradScaler) -> None:
        update = scaler.update
        ref = weakref.ref(self.handover)

        def update_and_capture(*args: Any, **kwargs: Any) -> None:
            update(*args, **kwargs)
            handover = ref()
            if handover is not None:
                handover.recapture(name)

        scaler.update = update_and_capture  # type: ignore[method-assign]

    def _on_step_pre(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if replaying():
            return None  # recovery replays records through this optimizer
        if self._inflight is not None:
            self._inflight = None
            raise LowDiffError(
                "the previous optimizer.step() did not complete (it raised after lowdiff took "
                "its gradients); that update is not checkpointed, so training cannot go on from "
                "this state: resume from the checkpoint"
            )
        check = getattr(self.strategy, "check_groups", None)
        if check is not None:
            check()  # before the hand-over of the previous step, which reads the groups
        self.handover.finish()
        # args are step()'s own, the optimizer first: step(self, closure=None)
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self._begin_update()
            return None

        def closure_then_take(*a: Any, **k: Any) -> Any:
            loss = closure(*a, **k)  # forward and backward
            if loss is None:
                raise LowDiffError(
                    "the closure passed to optimizer.step() returned no loss; lowdiff takes the "
                    "gradients after the closure ran and needs it to return the loss"
                )
            self._begin_update()
            return loss

        if "closure" in kwargs:
            return args, dict(kwargs, closure=closure_then_take)
        return (args[0], closure_then_take, *args[2:]), kwargs

    def _begin_update(self) -> None:
        t, grads, hp = self.strategy.prepare_update()
        self._inflight = (t, grads, hp, time.perf_counter())

    def _on_step_post(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if replaying():
            return
        if self._inflight is None:
            return  # a closure that never ran (nothing was updated)
        t, grads, hp, t0 = self._inflight
        self._inflight = None
        self.strategy.finish_update(t, grads, hp, time.perf_counter() - t0)

"""One training step of lowdiff's methods on the trainer, top-down.

:meth:`lowdiff.strategy.Strategy.step` runs the stages in this order (under
:func:`lowdiff.attach`, the optimizer's hooks do; under DDP on every rank)::

    t = begin_step()               raise what the checkpointing process reported (an
                                   error, a lost process); send the hand-overs whose
                                   copy ended; start on the first step without
                                   resume(); the "auto" planner's step time; on a GPU,
                                   the update waits for the last full checkpoint's copy
    grads = take_gradients(t)      the gradient source: compressed in place (LowDiff,
                                   compression-only; under DDP merged by lowdiff's hook),
                                   or LowDiff+'s layer-wise snapshot, finished
    hp = hparams()                 the update's hyperparameters, as a record's JSON
    -- optimizer.step(); scheduler.step() --
    after_update(t, grads, hp)     the state is at t + 1; for the methods that record:
      [storage error suspended]      retry with a new process at the next multiple of f
      slot = backend.take_slot()     LowDiff: a free record slot; LowDiff+: the snapshot's
      fill the slot                  the compressed payloads, buffers, RNG, extra state
                                     (from a GPU: copied on a side stream, not waited for)
      hand the slot over             Record / Step, now (or, driven by the optimizer's
                                     hooks, when the next update begins); the message
                                     goes once the copy ended (lowdiff.engine.trainer.pending)
      full checkpoint when due       LowDiff: every f steps (or as "auto" plans)
      stager.ensure_taken()          the process holds the staging buffer (once per buffer)
      replan                         "auto": a new (f, b) when one is due
      refresh_job_durable()          under DDP: the job's durable step, in the background

Everything the stages use is handed to :class:`StepPipeline`; the backend (what differs
between LowDiff's writer and LowDiff+'s replica) is behind
:class:`lowdiff.engine.trainer.backend.Backend`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from lowdiff.engine.trainer.autotune import AutoPlan
from lowdiff.engine.trainer.backend import GradientSource
from lowdiff.engine.trainer.handover import Handover
from lowdiff.engine.trainer.progress import Cadence, Progress
from lowdiff.engine.trainer.start import Starter
from lowdiff.engine.trainer.storage_policy import CheckpointingSuspended, StoragePolicy
from lowdiff.engine.trainer.training import TrainingObjects
from lowdiff.engine.wire.messages import Full
from lowdiff.errors import UsageError
from lowdiff.strategy import StepGrads


class StepPipeline:
    """The stages of one step (see the module docstring).

    Args:
        objects, progress, cadence: the training objects, the session's progress, (f, b).
        gradients: takes each step's gradients.
        handover: sends a step now, or once the next update begins.
        policy: the storage-error policy.
        start: starts checkpointing on the first step without ``resume()``.
        starter: for the methods that record: the session's checkpointing (its process,
            staging and backend); None for ``"compression-only"``.
    """

    def __init__(
        self,
        objects: TrainingObjects,
        progress: Progress,
        cadence: Cadence,
        gradients: GradientSource,
        handover: Handover,
        policy: StoragePolicy,
        start: Callable[[], None],
        starter: Starter | None,
    ) -> None:
        self.objects, self.progress, self.cadence = objects, progress, cadence
        self.gradients, self.handover, self.policy = gradients, handover, policy
        self.start, self.starter = start, starter
        self.autoplan: AutoPlan | None = None
        """With ``full_every`` or ``batch_size`` ``"auto"``: the planner."""
        handover.copies.progress = progress

    # ------------------------------------------------------------------ before the update
    def begin_step(self) -> int:
        progress = self.progress
        if progress.closed:
            raise UsageError("step() after close()")
        self.objects.check_groups()
        if not progress.started:
            self.start()
        if self.starter is not None:
            with contextlib.suppress(CheckpointingSuspended):
                self.starter.session.check()
            self.send_copied()
        t = progress.step
        if self.autoplan is not None:
            self.autoplan.begin_step(t)
        if self.starter is not None:
            # after start(), which may have staged the first full checkpoint
            self.starter.stager.before_update()
        return t

    def take_gradients(self, t: int) -> StepGrads:
        return self.gradients.take(t)

    def hparams(self) -> str:
        """The update's hyperparameters as the JSON text a record holds (groups that did
        not change since the previous step are not encoded again)."""
        return self.objects.hp_text(self.objects.optimizer)

    # ------------------------------------------------------------------ after the update
    def after_update(self, t: int, grads: StepGrads, hp: str | None, update_s: float) -> None:
        t0 = time.perf_counter()
        plan = self.autoplan
        if plan is not None:
            plan.observe_update(update_s)  # stands for the replay of one record
        self.progress.advance(t)
        if hp is not None and self.starter is not None:
            self._hand_over(self.starter, t, grads, hp)
        if plan is not None:
            plan.checkpointing_done(t0, grads.extra_s)

    def _hand_over(self, s: Starter, t: int, grads: StepGrads, hp: str) -> None:
        """Hand step ``t`` over to the checkpointing process; a full checkpoint when due;
        the storage-error policy; the job-wide durable step under DDP."""
        progress = self.progress
        with contextlib.suppress(CheckpointingSuspended):
            if self.policy.suspended is not None:
                self.handover.copies.discard()  # for the process dropped
                if progress.step % self.cadence.full_every == 0:
                    self._retry_checkpointing(s)
                return
            self._hand_over_slot(s, t, grads, hp)
            if s.backend.sends_fulls and self.full_due():
                s.stager.emit(s.session, progress.step, Full)
            s.stager.ensure_taken(s.session)  # a new staging buffer outlives a crash
            if self.autoplan is not None:
                self.poll()
                self.autoplan.replan()
        self.refresh_job_durable()

    def _hand_over_slot(self, s: Starter, t: int, grads: StepGrads, hp: str) -> None:
        """Fill the slot of step ``t`` (payloads, buffers, RNG, extra state) and send it:
        from a GPU, once the slot's copy to host memory ended (at the latest
        :data:`~lowdiff.engine.trainer.pending.MAX_LAG` steps later)."""
        session, backend = s.session, s.backend
        slots, copies = session.slots, self.handover.copies
        assert slots is not None
        if not backend.sends_fulls:
            s.stager.drop_when_released(session)  # the process holds the state now
        if copies and not slots.free(session.counters):
            copies.send_all()  # a slot frees only once the process has its record
        slot = backend.take_slot(t, grads)
        t1 = time.perf_counter()
        try:
            done = slots.fill_payloads(slot, grads.payloads) if grads.payloads else None
            rng_extra, extra = slots.fill_state(slot, buffers=done is None)
        except BaseException:
            slots.give_back()
            raise
        message, nograd = backend.slot_message, grads.nograd

        def send() -> None:
            # the record's document now (after the user's scheduler stepped); sent once
            # the slot's copy ended; early: the first steps' records wait in the pipe for a
            # process still starting
            msg = message(slot, t, slots.row_meta(t, nograd, hp, rng_extra, extra, grads.scale))
            copies.submit(t + 1, done, lambda: session.send(msg, early=True))

        self.handover.handover(send, extra)
        self.progress.stats["record_send_s"] += time.perf_counter() - t1

    def full_due(self) -> bool:
        """A full checkpoint after this step: at multiples of f, or with ``"auto"`` f steps
        after the previous one (f changes there)."""
        if self.autoplan is not None:
            return self.autoplan.full_due()
        return self.progress.step % self.cadence.full_every == 0

    def _retry_checkpointing(self, s: Starter) -> None:
        """After a storage error: a new checkpointing process, starting with a full checkpoint."""

        def prepare() -> None:
            s.wait_for_previous_writer()
            s.directory.remove_stale_temps()

        self.policy.retry(prepare, lambda: s.launch(s.backend.first_message))

    # ------------------------------------------------------------------ progress
    def poll(self) -> None:
        """Read what the checkpointing process reported; send the hand-overs whose copy
        ended."""
        if self.starter is not None:
            self.starter.session.poll()
            self.send_copied()

    def send_copied(self) -> None:
        """Send the hand-overs whose device-to-host copy ended, in order (drop them while
        checkpointing is suspended: they were for the process dropped)."""
        copies = self.handover.copies
        if not copies:
            return
        if self.policy.suspended is not None:
            copies.discard()
            return
        with contextlib.suppress(CheckpointingSuspended):
            copies.poll()

    def refresh_job_durable(self) -> None:
        """Under DDP: exchange this shard's durable step with the other ranks (in the
        background; every rank calls this at the end of every step)."""
        job = self.progress.job
        if job is not None:
            self.poll()
            job.refresh(*self.progress.figures())

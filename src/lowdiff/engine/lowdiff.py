"""Strategy ``"lowdiff"``: the compressed gradient of every step is its differential checkpoint.

Each step's compressed (under DDP: merged) gradient goes into a shared record slot with
the step's buffers, RNG states, hyperparameters and extra state; the checkpointing
process (:mod:`lowdiff.engine.worker`) writes the records in batches of b, and a full
checkpoint every f steps. Recovery replays the records through the optimizer.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any, ClassVar

from lowdiff.compressors.base import Compressor
from lowdiff.ddp.context import DistContext
from lowdiff.engine.autotune import AutoPlan
from lowdiff.engine.gradients import (
    CompressedGradients,
    record_compressor,
    training_compressor,
)
from lowdiff.engine.messages import Full, Record
from lowdiff.engine.options import EngineOptions
from lowdiff.engine.resume import CheckpointingStrategy
from lowdiff.engine.storage_policy import CheckpointingSuspended
from lowdiff.engine.worker import WorkerConfig, worker_main
from lowdiff.proc.holder import Survivor, find_survivor
from lowdiff.strategy import StepGrads


class LowDiffStrategy(CheckpointingStrategy):
    """Strategy ``"lowdiff"``: per-iteration checkpointing that logs the compressed
    gradient every update applies. Built by :class:`lowdiff.Checkpointer`, whose
    arguments these are."""

    name = "lowdiff"
    can_suspend: ClassVar[bool] = True
    closes_when_dropped: ClassVar[bool] = True
    records_hparams = True

    def _records_compressor(self, opts: EngineOptions, dist: DistContext | None) -> Compressor:
        self._rank_compressor = training_compressor(opts.compressor)
        return record_compressor(self._rank_compressor, dist)

    def _install_ddp_hook(self) -> None:
        self.gradients = CompressedGradients(self.core, self._rank_compressor)

    def _install(self, directory: Any) -> None:
        super()._install(directory)
        opts = self.options
        auto = opts.auto
        if auto:
            assert self.session is not None
            self.autoplan = AutoPlan(
                self.core,
                opts.mtbf,
                tune_f="full_every" in auto,
                tune_b="batch_size" in auto,
                send=self.session.send,
            )
            self.session.tuner = self.autoplan.tuner
            self.stager.observe_copy = self.autoplan.tuner.observe_full_copy

    # ------------------------------------------------------------------ the process
    def _find_survivor(self) -> Survivor | None:
        core = self.core
        assert core.root is not None and core.layout is not None
        found, why = find_survivor(core.root, core.layout_id, self.options.start_timeout)
        if found is None:
            core.memory_miss_reason = why
        return found

    def _max_inflight(self) -> int:
        return self.options.max_inflight or 2 * self.core.batch_size + 2

    def _process(self) -> tuple[Callable[..., None], Any, int]:
        core = self.core
        assert core.root is not None and core.layout is not None
        stats = core.recovery_stats
        cfg = WorkerConfig(
            str(core.root),
            core.batch_size,
            self.options.keep_full,
            core.layout.row_bytes,
            core.layout_id,
            core.run_id,
            # lineage: the first record file follows the recovered state's run
            follows=None if stats is None else stats.state_run_id,
            remote=self.remote_settings(),
            idle_timeout=self.options.idle_timeout,
            trainer_pid=os.getpid(),
        )
        return worker_main, cfg, self._max_inflight()

    # ------------------------------------------------------------------ the step pipeline
    def take_gradients(self, t: int) -> StepGrads:
        """The gradients of step ``t`` as the optimizer will apply them."""
        plan = self.autoplan
        assert self.gradients is not None
        return self.gradients.take(t, None if plan is None else plan.sample_decompress)

    def _emit(self, t: int, grads: StepGrads, hp: str) -> None:
        """Hand step ``t`` over to the checkpointing process; a full checkpoint when due;
        the storage-error policy; the job-wide durable step under DDP."""
        core = self.core
        with contextlib.suppress(CheckpointingSuspended):
            if self.policy.suspended is not None:
                if core.step % core.full_every == 0:
                    self._retry_checkpointing()
                return
            self._emit_record(t, grads, hp)
            if self._full_due():
                self.emit_full(core.step)
            assert self.session is not None
            self.stager.ensure_taken(self.session)  # the step is acknowledged on return
            if self.autoplan is not None:
                self._poll()
                self.autoplan.replan()
        self.refresh_job_durable()

    def _full_due(self) -> bool:
        """A full checkpoint after this step: at multiples of f, or with ``"auto"`` f steps
        after the previous one (f changes there)."""
        if self.autoplan is not None:
            return self.autoplan.full_due()
        return self.core.step % self.core.full_every == 0

    def _emit_record(self, t: int, grads: StepGrads, hp: str) -> None:
        session, stats = self.session, self.core.stats
        assert session is not None and session.slots is not None
        slots = session.slots
        t0 = time.perf_counter()
        slot = session.take_slot("a free record slot")
        t1 = time.perf_counter()
        try:
            done = slots.fill_payloads(slot, grads.payloads)
            rng_extra, extra = slots.fill_state(slot)
            if done is not None:
                done.synchronize()  # the record is complete in host memory before it is sent
        except BaseException:
            slots.give_back()
            raise
        nograd = grads.nograd
        self.handover.handover(
            # early: the first steps' records wait in the pipe for a process still starting
            lambda: session.send(
                Record(slot, t, slots.row_meta(t, nograd, hp, rng_extra, extra)), early=True
            ),
            extra,
        )
        stats["slot_wait_s"] += t1 - t0
        stats["record_send_s"] += time.perf_counter() - t1

    def _retry_checkpointing(self) -> None:
        """After a storage error: a new checkpointing process, starting with a full checkpoint."""
        core = self.core

        def prepare() -> None:
            self.wait_for_previous_writer()
            core.remove_stale_temps()

        def restart() -> None:
            self.launch(Full)

        self.policy.retry(prepare, restart)

"""Strategy ``"lowdiff+"``: training without compression, a CPU replica that survives a crash.

The gradients are snapshotted layer by layer during backward into shared host slots
(:mod:`lowdiff.engine.snapshot`) and merged by the checkpointing process into a CPU
replica of the model and optimizer (:mod:`lowdiff.engine.replica_worker`), persisted in
the background. After a trainer crash the next trainer restarts from the replica in
memory. The slots are the lag buffers: ``max_lag`` of them, so the replica trails the
trainer by at most ``max_lag`` steps.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from lowdiff.compressors.base import Compressor, NoCompression
from lowdiff.ddp.context import DistContext
from lowdiff.ddp.hooks import PlusHookState, plus_hook
from lowdiff.engine.messages import Full, Init, Step
from lowdiff.engine.options import EngineOptions
from lowdiff.engine.replica_optim import optimizer_class
from lowdiff.engine.replica_process import replica_worker_main
from lowdiff.engine.replica_worker import ReplicaConfig
from lowdiff.engine.resume import CheckpointingStrategy
from lowdiff.engine.snapshot import GradSnapshotter
from lowdiff.errors import InvalidArgumentError, LowDiffError, UnsupportedSetupError
from lowdiff.format import layout
from lowdiff.options import AUTO
from lowdiff.plan import DEFAULT_MTBF_S, resolve_mtbf
from lowdiff.proc import holder as rp
from lowdiff.recovery.job import apply_sharded_state
from lowdiff.recovery.replay import RecoveryStats, apply_full_state
from lowdiff.state import capture as st
from lowdiff.strategy import StepGrads


class LowDiffPlusStrategy(CheckpointingStrategy):
    """Strategy ``"lowdiff+"`` (see the module docstring). Built by
    :class:`lowdiff.Checkpointer`, whose arguments these are."""

    name = "lowdiff+"
    keeps_replica: ClassVar[bool] = True
    initial_message: ClassVar[type[Full]] = Init
    reseeds_on_resume: ClassVar[bool] = True
    records_hparams = True

    snapshotter: GradSnapshotter | None = None
    """The layer-wise gradient snapshotter of the running process, or None."""

    def _check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer_class(st.class_path(optimizer))
        frozen = [
            (gi, pi, tuple(p.shape))
            for gi, g in enumerate(optimizer.param_groups)
            for pi, p in enumerate(g["params"])
            if not p.requires_grad
        ]
        if frozen:
            gi, pi, shape = frozen[0]
            raise UnsupportedSetupError(
                f"strategy 'lowdiff+': {len(frozen)} parameter(s) of the optimizer do not require "
                f"a gradient (frozen; the first: group {gi}, parameter {pi}, shape {list(shape)}). "
                "LowDiff+ snapshots each gradient through a hook on the parameters it is built "
                "with: leave frozen parameters out of the optimizer (e.g. "
                "Adam(p for p in model.parameters() if p.requires_grad)), or use strategy "
                "'lowdiff'"
            )

    def _records_compressor(self, opts: EngineOptions, dist: DistContext | None) -> Compressor:
        return NoCompression()

    def _install_ddp_hook(self) -> None:
        core = self.core
        if core.dist is None or core.dist.sharded:
            return  # fully_shard: the post-accumulate hooks see the reduce-scattered shard
        owned = {id(p): k for k, (_, p) in enumerate(core.shard_params())}
        hook_state = PlusHookState(core.dist, owned, _weak_method(self._on_reduced_grad, None))
        try:
            core.model.register_comm_hook(hook_state, plus_hook)  # type: ignore[operator]
        except RuntimeError as e:
            raise LowDiffError(f"cannot install lowdiff's DDP communication hook: {e}") from None

    def _on_reduced_grad(self, k: int, grad: torch.Tensor) -> None:
        snap = self.snapshotter
        if snap is not None:
            snap.on_reduced_grad(k, grad)

    # ------------------------------------------------------------------ the process
    def _process(self) -> tuple[Callable[..., None], Any, int]:
        core, opts = self.core, self.options
        assert core.root is not None and core.layout is not None
        persist_every = opts.persist_every
        if core.dist is not None and persist_every == AUTO:
            # every rank's replica must persist the same steps, so that every shard has them
            persist_every = core.full_every
        cfg = ReplicaConfig(
            str(core.root),
            core.run_id,
            core.layout.to_json(),
            st.class_path(core.optimizer),
            persist_every,
            opts.keep_full,
            opts.idle_timeout,
            opts.replica_threads,
            None if core.dist is None else list(core.shard),
            remote=self.remote_settings(),
            mtbf=resolve_mtbf(opts.mtbf)[0] if persist_every == AUTO else DEFAULT_MTBF_S,
        )
        return replica_worker_main, cfg, opts.max_lag

    def _started_process(self) -> None:
        session = self.session
        assert session is not None and session.slots is not None
        if self.snapshotter is not None:
            self.snapshotter.close()
        sharded = self.core.dist is not None and self.core.dist.sharded
        self.snapshotter = GradSnapshotter(
            self.core.shard_params(),
            session.slots.rows(),
            session.slots.views,
            # the hooks on the model's parameters must not keep a Checkpointer dropped
            # without close() alive (its directory lock, its process): a weak reference
            _weak_method(self._acquire_slot, _dropped),
            autograd_hooks=self.core.dist is None or sharded,
            compare_bytes=sharded,
        )

    def _acquire_slot(self) -> int:
        """A free snapshot slot; waits while the replica lags ``max_lag`` steps behind."""
        assert self.session is not None
        t0 = time.perf_counter()
        slot = self.session.take_slot(f"the replica to catch up (max_lag={self.options.max_lag})")
        self.core.stats["lag_wait_s"] += time.perf_counter() - t0
        return slot

    # ------------------------------------------------------------------ the step pipeline
    def take_gradients(self, t: int) -> StepGrads:
        """Finish the layer-wise snapshot of step ``t`` (gradients changed after their
        hook, e.g. by clipping, are copied again)."""
        snap, session = self.snapshotter, self.session
        assert snap is not None and session is not None and session.slots is not None
        out = StepGrads()
        t0 = time.perf_counter()
        try:
            out.slot, out.nograd = snap.finish()
        except BaseException:
            if snap.abandon() is not None:
                session.slots.give_back()
            raise
        self.core.stats["snapshot_finish_s"] += time.perf_counter() - t0
        return out

    def _emit(self, t: int, grads: StepGrads, hp: str) -> None:
        """Hand the snapshot slot of step ``t`` to the replica."""
        session = self.session
        assert session is not None and session.slots is not None
        slots = session.slots
        if self.stager.buffer is not None and self.stager.released(session):
            # the replica took the initial state: the staging copy is no longer needed
            self.stager.buffer = None
        t0 = time.perf_counter()
        rng_extra, extra = slots.fill_state(grads.slot)
        slot, nograd = grads.slot, grads.nograd
        self.handover.handover(
            # early: the first steps wait in the pipe for a replica still starting
            lambda: session.send(
                Step(slot, t, slots.row_meta(t, nograd, hp, rng_extra, extra)), early=True
            ),
            extra,
        )
        self.stager.ensure_taken(session)  # the step is acknowledged on return
        self.core.stats["record_send_s"] += time.perf_counter() - t0
        self.refresh_job_durable()

    # ------------------------------------------------------------------ resume from memory
    @property
    def memory_miss_reason(self) -> str | None:
        """Why ``resume()`` did not recover from a replica in memory, or did not take its
        process over (None when it did both, or before ``resume()``)."""
        return self.core.memory_miss_reason

    def _find_replica(self) -> tuple[Any, str]:
        core = self.core
        assert core.root is not None and core.layout is not None
        return rp.find_live_replica(core.root, core.layout_id, wait_s=self.options.start_timeout)

    def _resume_from_memory(self) -> bool:
        """Restore from a live replica left by a crashed trainer, and take its process
        over; False when there is none."""
        core = self.core
        t0 = time.perf_counter()
        live, why = self._find_replica()
        if live is None:
            core.memory_miss_reason = why
            return False
        self._ask_survivor_early(live)
        try:
            assert core.root is not None
            core.check_manifest(layout.read_manifest(core.root))
            stats = RecoveryStats(full_step=live.step, step=live.step, source="memory")
            stats.read_s = time.perf_counter() - t0
            apply_full_state(
                live.tensors(), live.doc["meta"], core.model, core.optimizer, core.scheduler,
                stats, where="replica in memory",
            )  # fmt: skip
            stats.total_s = time.perf_counter() - t0
            adopted = self._adopt(live, stats)
        except BaseException:
            self._drop_early_answer()
            live.release_owner(self.options.start_timeout)
            raise
        if adopted:
            core.adopt_recovered(stats, str(core.root), durable=False)
            self._continue_adopted(stats)
        else:
            # the old checkpointing process persists what it has not yet and exits
            live.release_owner(self.options.start_timeout)
            self._start_after_memory_recovery(stats)
        return True

    def resume_ddp_from_memory(self) -> bool:
        """Rebuild the whole state from every rank's replica shard: possible only when
        every rank finds a live replica of its shard at the same step; otherwise the
        replicas found persist what they hold and exit, and recovery reads the disk.
        Every rank then takes its replica's process over, or (when one rank cannot)
        every rank starts a new one."""
        core = self.core
        ctx = core.dist
        assert ctx is not None and core.root is not None
        # a replica left by a crashed trainer still holds the writer lock: look first
        shard_ok = (core.root / layout.MANIFEST).exists()
        if not ctx.all_min([int(shard_ok)])[0]:
            return False
        core.check_manifest(layout.read_manifest(core.root))
        t0 = time.perf_counter()
        live, why = self._find_replica()
        local = live.step if live is not None else -1
        lo, hi = ctx.all_min([local])[0], ctx.all_max([local])[0]
        if lo < 0 or lo != hi:
            core.memory_miss_reason = why if live is None else f"replica steps differ ({lo}..{hi})"
            if live is not None:
                live.release_owner(self.options.start_timeout)
            return False
        assert live is not None
        try:
            stats = RecoveryStats(full_step=lo, step=lo, source="memory")
            if ctx.sharded:  # fully_shard: each rank's replica holds all this rank restores
                stats.read_s = time.perf_counter() - t0
                apply_full_state(
                    live.tensors(), live.doc["meta"], core.model, core.optimizer,
                    core.scheduler, stats, where="replica in memory",
                )  # fmt: skip
            else:
                parts = ctx.exchange(live.tensors(), dict(live.doc["meta"]))
                stats.read_s = time.perf_counter() - t0
                apply_sharded_state(
                    parts, ctx.rank, core.model, core.optimizer, core.scheduler, stats,
                    where="replicas in memory",
                )  # fmt: skip
            stats.total_s = time.perf_counter() - t0
            adopted = self._adopt(live, stats)
        except BaseException:
            self._drop_early_answer()
            live.release_owner(self.options.start_timeout)
            raise
        if ctx.all_min([int(adopted)])[0]:
            core.adopt_recovered(stats, str(core.root), durable=False)
            ctx.barrier()
            self._continue_adopted(stats)
            return True
        if adopted:  # another rank could not: every rank starts anew, this one too
            self._give_back_adopted(stats)
        live.release_owner(self.options.start_timeout)
        self._start_after_memory_recovery(stats, barrier=ctx.barrier)
        return True

    def _start_after_memory_recovery(
        self, stats: RecoveryStats, barrier: Callable[[], None] | None = None
    ) -> None:
        """Take over from the released replica: a new checkpointing process, seeded with the state."""
        core = self.core
        core.adopt_recovered(stats, str(core.root), durable=False)
        self.wait_for_previous_writer()  # the old process persists what it holds, then exits
        core.remove_stale_temps()
        if barrier is not None:
            barrier()  # every rank's old process is gone before any rank starts anew
        core.write_manifest(self.options.keep_full)
        core.started = True
        self.launch(Init)

    # ------------------------------------------------------------------ attach and the end
    def attach_to_optimizer(self) -> None:
        if self.options.max_lag < 2:
            raise InvalidArgumentError(
                "attach() with strategy 'lowdiff+' needs max_lag >= 2 (a step is handed over "
                "when the next one begins, so two snapshot slots are in use at once)"
            )
        super().attach_to_optimizer()

    def _release(self) -> None:
        if self.snapshotter is not None:
            with contextlib.suppress(Exception):
                self.snapshotter.close()
            self.snapshotter = None
        super()._release()


def _dropped() -> Any:
    raise LowDiffError("this Checkpointer was dropped; its gradient hooks are inactive")


def _weak_method(method: Callable[..., Any], gone: Callable[[], Any] | None) -> Callable[..., Any]:
    """``method`` (a bound method) through a weak reference to its object: once the
    object is collected, a call runs ``gone()`` instead (None: does nothing)."""
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def call(*args: Any) -> Any:
        m = ref()
        if m is None:
            return None if gone is None else gone()
        return m(*args)

    return call

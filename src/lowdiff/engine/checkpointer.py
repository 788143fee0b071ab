"""lowdiff's own strategies: ``"lowdiff"``, ``"lowdiff+"`` and ``"none"``.

Users reach them through :class:`lowdiff.Checkpointer` (``strategy=...``); they implement
:class:`lowdiff.strategy.Strategy`, whose :meth:`~lowdiff.strategy.Strategy.step` is the
one step pipeline. Calls on the training process::

    s = LowDiffStrategy(model, optimizer, "runs/ckpt", ...)  # validates, takes the lock
    start = s.resume()   # recovers (or prepares an empty directory), starts the
                         # checkpointing process, writes the step-0 full checkpoint
    s.step()             # per step, after backward: take_gradients (compress ->
                         # decompress into .grad; DDP: the hook's merged records) ->
                         # optimizer.step() -> scheduler.step() -> after_update (the
                         # record to the checkpointing process; every full_every steps
                         # a full checkpoint staged in shared memory)
    s.close()            # flush, wait until durable, stop the checkpointing process

``"lowdiff"`` logs the compressed gradient of every step as a differential record;
``"lowdiff+"`` (:class:`LowDiffPlusStrategy`) snapshots uncompressed gradients layer by
layer into a CPU replica kept by the checkpointing process (see
:mod:`lowdiff.engine.snapshot` and :mod:`lowdiff.engine.replica_worker`); ``"none"``
keeps the same compression but writes nothing (the baseline without checkpointing).
Under DDP the same classes run with :mod:`lowdiff.dist` (process group, shards,
agreement on one step).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime as _dt
import json
import logging
import os
import select
import time
import uuid
import warnings
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.profiler import record_function

from lowdiff.compressors.base import Compressor, NoCompression
from lowdiff.compressors.merged import MergedSparse
from lowdiff.compressors.sparse import _Sparsifier
from lowdiff.dist.context import JobMin, assign_shards, rank_dir
from lowdiff.dist.context import detect as detect_dist
from lowdiff.dist.hooks import (
    LowDiffHookState,
    PlusHookState,
    lowdiff_hook,
    plus_hook,
    record_consumed,
)
from lowdiff.dist.shard import shard_model_tensors, shard_state_dict
from lowdiff.engine import channel
from lowdiff.engine import replica as rp
from lowdiff.engine import state as st
from lowdiff.engine.record import RecordLayout
from lowdiff.engine.replica_worker import ReplicaConfig, optimizer_class, replica_worker_main
from lowdiff.engine.snapshot import GradSnapshotter
from lowdiff.engine.spawn import exit_message, spawn_context
from lowdiff.engine.worker import (
    WorkerConfig,
    acquire_flock,
    lock_holder,
    wait_for_writer,
    worker_main,
)
from lowdiff.errors import (
    CheckpointMismatchError,
    CheckpointWorkerError,
    DirectoryLockedError,
    DurabilityWarning,
    LowDiffError,
)
from lowdiff.exporting import model_config_entry
from lowdiff.format import codec, layout
from lowdiff.format.atomic import remove_stale_temps
from lowdiff.format.dtypes import dtype_name
from lowdiff.format.sfile import FORMAT_NAME, FORMAT_VERSION, plan, view_tensors
from lowdiff.plan import AUTO, START_B, START_F, AutoTuner, resolve_mtbf
from lowdiff.recovery.quarantine import quarantine_beyond
from lowdiff.recovery.replay import (
    RecoveryStats,
    apply_full_state,
    check_compatible,
    recover,
    replaying,
)
from lowdiff.recovery.scan import check_directory, is_empty_dir
from lowdiff.strategy import (
    STORAGE_ERRORS,
    StepGrads,
    Strategy,
    check_int,
    check_int_or_auto,
    check_seconds,
    compress_grads,
)

STRATEGIES = ("lowdiff", "lowdiff+", "none")
"""lowdiff's own strategies (the baselines are in :data:`lowdiff.baselines.BASELINES`)."""
STORAGE_ERROR_POLICIES = ("raise", "warn")

_plan_log = logging.getLogger("lowdiff.plan")


class _CheckpointingSuspended(Exception):
    """Internal: a storage error under ``on_storage_error="warn"`` stopped checkpointing."""


class LowDiffStrategy(Strategy):
    """Strategies ``"lowdiff"`` and ``"none"`` (and, through :class:`LowDiffPlusStrategy`,
    ``"lowdiff+"``): per-iteration checkpointing that reuses the gradients training applies.

    Built by :class:`lowdiff.Checkpointer`, whose arguments these are.

    The arguments are those of :class:`lowdiff.Checkpointer` for these strategies.
    """

    serves: ClassVar[tuple[str, ...]] = ("lowdiff", "none")
    """The strategy names this class implements."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        directory: str | os.PathLike[str] | None,
        *,
        strategy: str = "lowdiff",
        compressor: Compressor | None = None,
        full_every: int | str = 30,
        batch_size: int | str = 3,
        scheduler: Any | None = None,
        keep_full: int | None = 2,
        max_inflight: int | None = None,
        start_timeout: float = 120.0,
        stall_timeout: float = 300.0,
        max_lag: int = 2,
        persist_every: int | str = "auto",
        idle_timeout: float = 300.0,
        replica_threads: int = 1,
        on_storage_error: str = "raise",
        mtbf: float | None = None,
        extra_state: dict[str, Any] | None = None,
    ) -> None:
        st.check_training_objects(model, optimizer, scheduler)
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(
                "LBFGS is not supported: its step() evaluates the closure several times per "
                "update, and lowdiff records the one gradient each update applies"
            )
        self._extra = st.check_extra_state(extra_state)
        self._deferred = False
        """Driven by the optimizer's hooks (:func:`lowdiff.attach`): each step's hand-over is
        finished when the next update begins, after the user's scheduler stepped."""
        self._pending: list[Callable[[], None]] = []
        self._pending_extra: list[tuple[dict[str, Any], set[str]]] = []
        self._late_extra: list[str] = []
        """``extra_state`` names taken again after the update (a GradScaler after its
        ``update()``, a framework's step counters): :meth:`capture_after_update`."""
        self._inflight: tuple[int, StepGrads, list[dict[str, Any]] | None, float] | None = None
        self._hook_handles: list[Any] = []
        self._on_close: list[Callable[[], None]] = []
        if on_storage_error not in STORAGE_ERROR_POLICIES:
            raise ValueError(
                f"on_storage_error must be one of {', '.join(map(repr, STORAGE_ERROR_POLICIES))}, "
                f"got {on_storage_error!r}"
            )
        if on_storage_error == "warn" and strategy != "lowdiff":
            raise ValueError(
                f"on_storage_error='warn' is supported by strategy 'lowdiff' only, got {strategy!r}"
            )
        self.on_storage_error = on_storage_error
        self._suspended: str | None = None
        """Under "warn": why checkpointing is suspended after a storage error."""
        if strategy not in self.serves:
            raise ValueError(
                f"{type(self).__name__} implements strategy {' and '.join(map(repr, self.serves))}, "
                f"got {strategy!r}"
            )
        self.name = strategy
        self.records_hparams = strategy != "none"
        if strategy == "lowdiff+":
            if compressor is not None:
                raise ValueError(
                    "strategy 'lowdiff+' is for training without compression; pass compressor=None"
                )
            compressor = NoCompression()
            check_int("max_lag", max_lag, 1)
            if persist_every != "auto":
                check_int("persist_every", persist_every, 1)
            if not isinstance(idle_timeout, (int, float)) or idle_timeout < 0:
                raise ValueError(
                    f"idle_timeout must be a number of seconds >= 0, got {idle_timeout!r}"
                )
            check_int("replica_threads", replica_threads, 1)
            optimizer_class(f"{type(optimizer).__module__}.{type(optimizer).__qualname__}")
        elif compressor is None:
            from lowdiff.compressors import TopK

            compressor = TopK(ratio=0.01)
        if not isinstance(compressor, Compressor):
            raise TypeError(
                f"compressor must be a lowdiff.Compressor, got {type(compressor).__name__}"
            )
        self._dist = detect_dist(model)
        if self._dist is not None and on_storage_error == "warn":
            raise ValueError(
                "on_storage_error='warn' is not supported under DistributedDataParallel: every "
                "rank would have to suspend and retry checkpointing together; use 'raise' (the "
                "job stops, and a restart resumes from the newest step every shard holds)"
            )
        self._job: JobMin | None = None if self._dist is None else JobMin(self._dist)
        self._hook_state: LowDiffHookState | None = None
        if self._dist is not None and strategy != "lowdiff+":
            if not isinstance(compressor, _Sparsifier):
                raise ValueError(
                    f"distributed LowDiff merges sparse gradients across ranks; {type(compressor).__name__} "
                    "is not a sparsifier (use TopK, ApproxTopK or RandomK)"
                )
            self._rank_compressor: Compressor = compressor
            compressor = MergedSparse(compressor, self._dist.world_size)
        self._configured = {
            "full_every": check_int_or_auto("full_every", full_every),
            "batch_size": check_int_or_auto("batch_size", batch_size),
        }
        self._tuner: AutoTuner | None = None
        auto = [k for k, v in self._configured.items() if v == AUTO]
        if auto and strategy == "lowdiff+":
            raise ValueError(
                f"{auto[0]}='auto' is supported by strategy 'lowdiff' only, got strategy 'lowdiff+'"
            )
        if auto and self._dist is not None:
            raise ValueError(
                f"{auto[0]}='auto' is not supported under DistributedDataParallel yet (every rank "
                "must use the same f and b); pass integers"
            )
        mtbf_s, self._mtbf_source = resolve_mtbf(mtbf) if auto else (0.0, "")
        cf, cb = self._configured["full_every"], self._configured["batch_size"]
        self.full_every: int = START_F if isinstance(cf, str) else cf
        self.batch_size: int = START_B if isinstance(cb, str) else cb
        self._last_full = 0
        """Step of the newest full checkpoint (``"auto"`` schedules the next one from it)."""
        self._step_t: float | None = None
        self._ck_s = 0.0
        if keep_full is not None:
            check_int("keep_full", keep_full, 1)
        if max_inflight is not None:
            check_int("max_inflight", max_inflight, 1)
        if strategy != "none" and directory is None:
            raise ValueError(f"strategy {strategy!r} needs a checkpoint directory, got None")

        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.strategy, self.compressor, self.keep_full = strategy, compressor, keep_full
        self.start_timeout = float(start_timeout)
        check_seconds("start_timeout", start_timeout)
        self.stall_timeout = check_seconds("stall_timeout", stall_timeout)
        self.max_inflight = max_inflight
        self.max_lag, self.persist_every = max_lag, persist_every
        if self._dist is not None and persist_every == "auto":
            # every rank's replica must persist the same steps, so that every shard has them
            self.persist_every = self.full_every
        self.idle_timeout, self.replica_threads = float(idle_timeout), replica_threads
        self._snap: GradSnapshotter | None = None
        self._pinned: torch.Tensor | None = None
        self._params = st.optimizer_params(model, optimizer)
        for info, p in self._params:
            if p.is_sparse:
                raise ValueError(
                    f"parameter {info.name!r} is sparse; lowdiff supports dense parameters only"
                )
        self._numels = [p.numel() for _, p in self._params]
        devices = {p.device for _, p in self._params}
        if len(devices) > 1:
            raise ValueError(
                f"all optimized parameters must be on one device, found {sorted(map(str, devices))}"
            )
        dev = next(iter(devices), torch.device("cpu"))
        self._record_device: torch.device | None = None if dev.type == "cpu" else dev
        self._buffer_names = st.buffer_names(model)
        self._buffer_refs = st.BufferRefs(model, self._buffer_names)
        self._hp_text = st.HparamsText()
        self._step = 0
        self._started = False
        self._closed = False
        self._durable = -1
        self._merged = -1
        self._run_id = uuid.uuid4().hex
        self.recovery_stats: RecoveryStats | None = None
        self._stats: dict[str, float] = {
            "steps": 0,
            "slot_wait_s": 0.0,
            "full_wait_s": 0.0,
            "full_copy_s": 0.0,
            "fulls_requested": 0,
            "fulls_written": 0,
            "full_bytes": 0,
            "full_write_s": 0.0,
            "record_send_s": 0.0,
            "lag_wait_s": 0.0,
            "snapshot_finish_s": 0.0,
            "record_files_written": 0,
            "records_written": 0,
            "record_bytes": 0,
            "record_write_s": 0.0,
            "replica_merges": 0,
            "replica_merge_s": 0.0,
        }
        self._proc: Any = None
        self._req: Connection | None = None
        self._res: Connection | None = None
        self._poller: Any = None
        """``select.poll`` on the results pipe and the process's sentinel (see _io_ready)."""
        self._sentinel_fd = -1
        self._maybe_gone = True
        """Whether the process may have exited (its sentinel fired, or no poller yet)."""
        self._worker_error: CheckpointWorkerError | None = None
        self._replies: dict[str, int] = {}
        self._filled = 0
        """Slots handed to the checkpointing process (compared with its SLOTS_DONE count)."""
        self._staged = 0
        """Full-checkpoint stagings handed over (compared with its STAGING_DONE count)."""
        self._side_stream: Any = None
        self._staging: torch.Tensor | None = None
        self._full_plan: tuple[Any, list[Any], int] | None = None
        """A full checkpoint's layout: (the tensors' names, dtypes and shapes, entries, size)."""
        self._full_dsts: tuple[Any, Any, list[torch.Tensor]] | None = None
        """The staging buffer and layout the views were made for, and the views."""
        self._lock_fd: int | None = None
        self.root: Path | None = None
        self.job_root: Path | None = None
        self._shard = [info.index for info, _ in self._params]
        self._foreign: set[str] = set()
        if self._dist is not None:
            owner = assign_shards(self._numels, self._dist.world_size)
            self._shard = [i for i, r in enumerate(owner) if r == self._dist.rank]
            self._foreign = {
                info.name for info, _ in self._params if owner[info.index] != self._dist.rank
            }
            self._install_ddp_hook()
        if strategy != "none":
            assert directory is not None
            self.root = Path(directory)
            if self._dist is not None:
                from lowdiff.dist.recovery import rank_root

                self.job_root = self.root
                check_directory(self.job_root)
                # the newest generation's shard at this world size, else the next generation's
                self.root = rank_root(self.job_root, self._dist.rank, self._dist.world_size)
            else:
                from lowdiff.dist.recovery import is_job_dir

                if is_job_dir(self.root):
                    raise CheckpointMismatchError(
                        f"{self.root} is a distributed job's directory: continue it under "
                        "torchrun (any number of ranks, 1 included), or read a step of it "
                        "with lowdiff.restore() / lowdiff export"
                    )
            check_directory(self.root)
            self.root.mkdir(parents=True, exist_ok=True)
            fd = acquire_flock(self.root / layout.LOCK_FILE, blocking=False)
            if fd is None:
                raise DirectoryLockedError(
                    f"{self.root} is in use by another trainer ({lock_holder(self.root / layout.LOCK_FILE)}); "
                    "two trainers cannot write to one checkpoint directory"
                )
            self._lock_fd = fd
            self._rng_layout = st.RngLayout()
            self._rng_capture = st.RngCapture(self._rng_layout)
            buffers = [
                (n, b.dtype, tuple(b.shape))
                for n, b in st.get_buffers(model, self._buffer_names).items()
            ]
            shard = set(self._shard)
            self.layout = RecordLayout.build(
                [i for i, _ in self._params if i.index in shard],
                compressor,
                buffers,
                self._rng_layout,
            )
            if auto and strategy == "lowdiff":
                self._tuner = AutoTuner(
                    record_bytes=self.layout.row_bytes,
                    mtbf=mtbf_s,
                    tune_f=isinstance(cf, str),
                    tune_b=isinstance(cb, str),
                    f=self.full_every,
                    b=self.batch_size,
                )
                self.full_every, self.batch_size = self._tuner.f, self._tuner.b
            ref = weakref.ref(self)
            atexit.register(_close_at_exit, ref)

    # ------------------------------------------------------------------ public API
    @property
    def step_count(self) -> int:
        """Optimizer updates done so far (the step the live state is at)."""
        return self._step

    @property
    def durable_step(self) -> int:
        """Newest step whose state is recoverable from disk (-1 before the first write).

        Under DDP: the newest step that every rank's shard has made durable, as of the
        previous ``step()`` (the ranks exchange it in the background once per step, so it
        may trail this rank's own progress by a step; it never runs ahead of any shard).
        """
        self._poll()
        return self._durable if self._job is None else min(self._durable, self._job.value)

    @property
    def stats(self) -> dict[str, float]:
        """Counters and timings of this session (stall and copy times on the training side)."""
        self._poll()
        out = dict(
            self._stats,
            durable_step=self.durable_step,
            record_row_bytes=getattr(self, "layout", None) and self.layout.row_bytes or 0,
            full_every=self.full_every,
            batch_size=self.batch_size,
        )
        if self._hook_state is not None:  # DDP: bytes of lowdiff's gradient exchange
            out.update(self._hook_state.wire.as_dict())
        return out

    @property
    def plan_history(self) -> list[dict[str, Any]]:
        """With ``"auto"``: every (f, b) this session used, oldest first.

        Each entry: ``step`` (the updates done when it took effect: records of that step
        on are batched b at a time, and the next full checkpoint is due f steps after the
        previous one), ``f``, ``b``, ``previous_f``,
        ``previous_b``, ``reason`` (``"start (profiling)"``, ``"profiled"``,
        ``"re-planned"``), ``wasted_s`` and ``previous_wasted_s`` (the model's predicted
        T_w of the new and the old pair, GPU-seconds per hour of training), ``f_c`` and
        ``inputs`` (the :class:`lowdiff.plan.CostModel` it planned with, as a dict).
        Empty without ``"auto"``.
        """
        return [] if self._tuner is None else [dict(e) for e in self._tuner.history]

    def resume(self) -> int:
        """Restore the newest recoverable state, or prepare an empty directory.

        Restores model parameters and buffers, optimizer state, scheduler state and RNG
        states. Files past the recovered step, and damaged files, are moved to
        ``DIR/quarantine/`` (never deleted). The error-feedback residuals restart at zero.

        Returns:
            The recovered step (0 for an empty directory).
        """
        if self._started:
            raise RuntimeError("resume() must be called once, before the first step()")
        if self.strategy == "none":
            self._started = True
            return 0
        assert self.root is not None
        if self._dist is not None:
            return self._resume_dist()
        if self.strategy == "lowdiff+" and self._resume_from_memory():
            return self._step
        self._wait_for_previous_writer()
        self._remove_stale_temps()
        if is_empty_dir(self.root):
            self._start_fresh()
            return 0
        manifest = layout.read_manifest(self.root)
        self._check_manifest(manifest)
        stats = recover(self.root, self.model, self.optimizer, self.scheduler)
        self._adopt_recovered(stats, self.root)
        return self._continue_recovered()

    def _adopt_recovered(self, stats: RecoveryStats, where: Path) -> None:
        """The recovered state is loaded: take its step, durability and extra state."""
        self.recovery_stats = stats
        st.apply_extra(self._extra, stats.extra, f"{where} step {stats.step}")
        self._step = stats.step
        self._durable = stats.step
        self._last_full = stats.full_step
        self.compressor.reset_state()  # error-feedback residuals restart at zero

    def _continue_recovered(self, barrier: Callable[[], None] | None = None) -> int:
        """Cut the directory back to the recovered step and start checkpointing from it
        (under DDP ``barrier`` keeps every rank from writing before every shard is cut)."""
        assert self.recovery_stats is not None
        self._quarantine_beyond(self.recovery_stats)
        if barrier is not None:
            barrier()
        self._write_manifest()
        self._launch_worker()
        self._started = True
        if self.strategy == "lowdiff+":
            self._emit_full(self._step, kind="init")
        return self._step

    def begin_step(self) -> int:
        if self._closed:
            raise RuntimeError("step() after close()")
        if not self._started:
            self._start_implicit()
        with contextlib.suppress(_CheckpointingSuspended):
            self._raise_worker_error()
        t = self._step
        tuner = self._tuner
        if tuner is not None:
            # tau: the time between two step() calls without the previous one's checkpointing
            now = time.perf_counter()
            if self._step_t is None:
                if not tuner.history:
                    tuner.force(t, self.full_every, self.batch_size, "start (profiling)")
            else:
                tuner.observe_iteration(now - self._step_t - self._ck_s)
            self._step_t = now
        return t

    def after_update(self, t: int, grads: StepGrads, hp: str | None, update_s: float) -> None:
        t0 = time.perf_counter()
        tuner = self._tuner
        if tuner is not None:
            tuner.observe_optimizer_step(update_s)  # stands for the replay of one record
        self._step = t + 1
        self._stats["steps"] += 1
        if hp is not None:
            self._emit(t, grads, hp)
        if tuner is not None:
            self._ck_s = time.perf_counter() - t0 + grads.extra_s

    def flush(self) -> int:
        """Write the records waiting for a full batch and wait until they are durable.

        Under DDP this is a collective call (every rank calls it at the same point): it
        returns the newest step that every shard has made durable.

        Returns:
            The newest durable step.
        """
        if self.strategy == "none" or not self._started or self._closed:
            return self.durable_step
        try:
            self._finish_handover()
            if self._suspended is None:
                self._send(("flush",))
                self._wait_reply("flushed")
        except _CheckpointingSuspended:
            pass
        if self._suspended is not None:
            self._warn_not_durable("flush()")
        if self._job is not None:
            return self._job.now(self._durable)
        return self._durable

    def close(self) -> None:
        """Flush everything, wait until it is durable and stop the checkpointing process."""
        if self._closed:
            return
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []
        for fn in self._on_close:
            fn()
        self._closed = True
        try:
            if self._started:
                self._finish_handover()  # steps driven by the optimizer's hooks
            if self._proc is not None and self._suspended is None:
                self._send(("close",))
                self._wait_reply("closed")
        except _CheckpointingSuspended:
            pass
        finally:
            if self._job is not None:
                self._job.settle()
            self._join_worker()
            self._release()
        if self._suspended is not None:
            self._warn_not_durable("close()")

    # ------------------------------------------------------------------ session start
    def _start_implicit(self) -> None:
        if self.strategy == "none":
            self._started = True
            return
        assert self.root is not None
        if self._dist is not None:
            from lowdiff.dist.recovery import generations

            held = any(
                not is_empty_dir(d)
                for g in generations(self.job_root or self.root)
                for d in g.shard_dirs()
            )
            if self._dist.all_max([int(held or not is_empty_dir(self.root))])[0]:
                raise LowDiffError(
                    f"{self.job_root} already holds checkpoints; call ck.resume() on every rank "
                    "before the first step() to continue from them, or use a new directory"
                )
            self._resume_dist()
            return
        self._wait_for_previous_writer()
        if not is_empty_dir(self.root):
            raise LowDiffError(
                f"{self.root} already holds checkpoints; call ck.resume() before the first step() to continue "
                "from them, or use a new directory"
            )
        self._start_fresh()

    def _start_fresh(self) -> None:
        assert self.root is not None
        (self.root / layout.FULL_DIR).mkdir(exist_ok=True)
        (self.root / layout.RECORDS_DIR).mkdir(exist_ok=True)
        self._write_manifest()
        self._launch_worker()
        self._started = True
        self._emit_full(self._step, kind="init" if self.strategy == "lowdiff+" else "full")

    def _manifest_body(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "strategy": self.strategy,
            "compressor": self.compressor.spec(),
            "optimizer": f"{type(self.optimizer).__module__}.{type(self.optimizer).__qualname__}",
            "scheduler": None
            if self.scheduler is None
            else f"{type(self.scheduler).__module__}.{type(self.scheduler).__qualname__}",
            "record_layout": self.layout.to_json(),
            "layout_id": self.layout.layout_id,
            "full_every": self._configured["full_every"],
            "batch_size": self._configured["batch_size"],
            "keep_full": self.keep_full,
            "torch": torch.__version__,
            "updated": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "run_id": self._run_id,
            **model_config_entry(self.model),  # what an "hf" export rebuilds the model from
        }

    def _write_manifest(self) -> None:
        assert self.root is not None
        layout.write_manifest(self.root, self._manifest_body())

    def _check_manifest(self, manifest: dict[str, Any]) -> None:
        if manifest.get("strategy") != self.strategy:
            raise CheckpointMismatchError(
                f"{self.root} was written by strategy {manifest.get('strategy')!r}, this Checkpointer uses {self.strategy!r}"
            )
        if manifest.get("compressor") != self.compressor.spec():
            raise CheckpointMismatchError(
                f"{self.root} was written with compressor {manifest.get('compressor')}, this Checkpointer uses "
                f"{self.compressor.spec()}; resume with the same compressor settings"
            )
        if self._dist is None:
            check_compatible(manifest, self.model, self.optimizer)
        if manifest.get("layout_id") != self.layout.layout_id:
            raise CheckpointMismatchError(
                f"{self.root}: the record layout differs (model buffers or CUDA devices changed since the "
                "checkpoint was written)"
            )
        want = (
            None
            if self.scheduler is None
            else f"{type(self.scheduler).__module__}.{type(self.scheduler).__qualname__}"
        )
        if manifest.get("scheduler") != want:
            raise CheckpointMismatchError(
                f"{self.root} was written with scheduler {manifest.get('scheduler')}, got {want}"
            )

    def _wait_for_previous_writer(self) -> None:
        """A killed trainer's checkpointing process may still be flushing: wait for it."""
        assert self.root is not None
        wait_for_writer(self.root, self.start_timeout)

    def _quarantine_beyond(self, stats: RecoveryStats) -> None:
        """Move files that are damaged or lie past the recovered step out of the chain."""
        assert self.root is not None
        quarantine_beyond(self.root, stats, self._run_id)

    # ------------------------------------------------------------------ checkpointing process
    def _launch_worker(self) -> None:
        assert self.root is not None
        ctx = spawn_context()
        n_slots = self.max_lag if self.strategy == "lowdiff+" else self._max_inflight()
        rp.ensure_shm_space(n_slots * self.layout.row_bytes, "the record slots")
        slots = torch.zeros((n_slots, self.layout.row_bytes), dtype=torch.uint8).share_memory_()
        if self._pinned is not None:
            _unpin(self._pinned)
            self._pinned = None
        if self._record_device is not None and _pin(slots):
            # a device copies records (and LowDiff+ snapshots) straight into these host
            # slots: the checkpointing process never depends on the trainer's device memory
            self._pinned = slots
        self._slots = slots
        self._slot_views = [self.layout.views(slots[i]) for i in range(n_slots)]
        self._slot_dsts = [_SlotDsts.of(self.layout, v) for v in self._slot_views]
        self._next_slot = 0
        self._filled = 0
        self._staged = 0
        self._replies = {}
        self._ctr = channel.new_counters()
        self._ctr_view = channel.view(self._ctr)
        self._records_seen = (0, 0, 0, 0)
        req_r, req_w = ctx.Pipe(duplex=False)
        res_r, res_w = ctx.Pipe(duplex=False)
        target: Any
        cfg: Any
        if self.strategy == "lowdiff+":
            target = replica_worker_main
            cfg = ReplicaConfig(
                str(self.root),
                self._run_id,
                self.layout.to_json(),
                f"{type(self.optimizer).__module__}.{type(self.optimizer).__qualname__}",
                self.persist_every,
                self.keep_full,
                self.idle_timeout,
                self.replica_threads,
                None if self._dist is None else list(self._shard),
            )
        else:
            target = worker_main
            cfg = WorkerConfig(
                str(self.root),
                self.batch_size,
                self.keep_full,
                self.layout.row_bytes,
                self.layout.layout_id,
                self._run_id,
                # lineage: the first record file follows the recovered state's run
                follows=None if self.recovery_stats is None else self.recovery_stats.state_run_id,
            )
        proc = ctx.Process(
            target=target,
            args=(cfg, slots, self._ctr, req_r, res_w),
            name="lowdiff-checkpointing",
            daemon=False,
        )
        try:
            proc.start()
        except BaseException:
            # e.g. spawn refusing to start from a script without a __main__ guard: nothing
            # runs, so close() must not wait for or talk to it
            for c in (req_r, req_w, res_r, res_w):
                c.close()
            raise
        self._proc = proc
        req_r.close()
        res_w.close()
        self._req, self._res = req_w, res_r
        self._poller = select.poll()
        self._poller.register(res_r.fileno(), select.POLLIN)
        self._sentinel_fd = self._proc.sentinel
        self._poller.register(self._sentinel_fd, select.POLLIN)
        self._maybe_gone = False
        self._wait_reply("ready", timeout=self.start_timeout)
        if self.strategy == "lowdiff+":
            if self._snap is not None:
                self._snap.close()
            self._snap = GradSnapshotter(
                self._snap_params(),
                [slots[i] for i in range(n_slots)],
                self._slot_views,
                self._acquire_slot,
                autograd_hooks=self._dist is None,
            )

    def _max_inflight(self) -> int:
        return self.max_inflight or 2 * self.batch_size + 2

    def _poll(self) -> None:
        if self._res is None:
            return
        if self._io_ready():
            try:
                while self._res.poll():
                    self._handle(self._res.recv())
            except (EOFError, OSError):
                pass
        self._read_counters()

    def _io_ready(self) -> bool:
        """One ``poll(2)`` on the results pipe and the process's sentinel: whether a
        message (or the end of the pipe) is waiting, or the process has exited. The
        steady state of a step is one system call, without ``multiprocessing``'s
        per-call selector."""
        poller = self._poller
        if poller is None:
            return True
        events = poller.poll(0)
        if not events:
            return False
        if any(fd == self._sentinel_fd for fd, _ in events):
            self._maybe_gone = True
        return True

    def _read_counters(self) -> None:
        """What the checkpointing process reports through the shared counters: the
        durable step, and the record files written since the last read."""
        c = self._ctr_view
        durable = int(c[channel.DURABLE]) - 1
        if durable > self._durable:
            self._durable = durable
        files = int(c[channel.RECORD_FILES])
        seen = self._records_seen
        if files == seen[0]:
            return
        now = (files, int(c[channel.RECORDS]), int(c[channel.RECORD_BYTES]),
               int(c[channel.RECORD_WRITE_NS]))  # fmt: skip
        n_files, n_records, n_bytes, ns = (a - b for a, b in zip(now, seen, strict=True))
        self._records_seen = now
        self._stats["record_files_written"] += n_files
        self._stats["records_written"] += n_records
        self._stats["record_bytes"] += n_bytes
        self._stats["record_write_s"] += ns / 1e9
        if self._tuner is not None:
            for _ in range(n_files):  # the files since the last read, as their average
                self._tuner.observe_record_file(
                    n_records / n_files, n_bytes / n_files, ns / 1e9 / n_files
                )

    def _handle(self, msg: tuple[Any, ...]) -> str:
        kind = msg[0]
        self._replies[kind] = self._replies.get(kind, 0) + 1
        if kind in ("durable", "flushed", "closed"):
            self._durable = max(self._durable, int(msg[1]))
        elif kind == "merged":
            self._merged = max(self._merged, int(msg[1]))
            if len(msg) > 2:  # a step merged into the replica, and the CPU time it took
                self._stats["replica_merges"] += 1
                self._stats["replica_merge_s"] += msg[2]
        elif kind == "full_done":
            self._stats["fulls_written"] += 1
            self._stats["full_bytes"] += msg[2]
            self._stats["full_write_s"] += msg[3]
            if self._tuner is not None:
                self._tuner.observe_full(msg[2], msg[3])
        elif kind == "error":
            _, name, text, tb = msg
            self._worker_error = CheckpointWorkerError(
                f"the checkpointing process failed: {name}: {text}", tb, name in STORAGE_ERRORS
            )
        return str(kind)

    def _await(self, ready: Callable[[], bool], what: str, timeout: float | None = None) -> None:
        """Wait until ``ready()`` while the checkpointing process lives and makes progress."""
        assert self._proc is not None
        channel.wait_until(
            ready,
            proc=self._proc,
            results=self._res,
            counters=self._ctr_view,
            check=self._raise_worker_error,
            stall_timeout=self.stall_timeout,
            what=what,
            deadline=None if timeout is None else time.monotonic() + timeout,
        )

    def _wait_reply(self, want: str, timeout: float | None = None) -> None:
        """Wait for the next ``want`` message (sent after the request just made)."""
        seen = self._replies.get(want, 0)
        self._await(lambda: self._replies.get(want, 0) > seen, repr(want), timeout)

    def _wait_slot(self, what: str) -> int:
        """A free record/snapshot slot (slots are consumed in order, round-robin)."""
        n = len(self._slot_views)
        ctr = self._ctr_view
        if self._filled - int(ctr[channel.SLOTS_DONE]) >= n:
            self._await(lambda: self._filled - int(ctr[channel.SLOTS_DONE]) < n, what)
        slot = self._next_slot
        self._next_slot = (slot + 1) % n
        self._filled += 1
        return slot

    def _unfill_slot(self) -> None:
        """Give back the slot taken last, never handed over."""
        self._filled -= 1
        self._next_slot = (self._next_slot - 1) % len(self._slot_views)

    def _raise_worker_error(self, force: bool = False) -> None:
        if self._suspended is not None:
            raise _CheckpointingSuspended
        self._poll()
        if self._worker_error is not None:
            err = self._worker_error
            if self.on_storage_error == "warn" and err.storage:
                self._suspend_checkpointing(err)
            raise err
        if self._proc is not None and self._maybe_gone and not self._proc.is_alive():
            self._poll()  # an error it sent just before exiting
            if self._worker_error is not None:
                self._raise_worker_error()
            raise CheckpointWorkerError(
                exit_message(
                    "the checkpointing process",
                    self._proc,
                    ready=self._replies.get("ready", 0) > 0,
                )
            )
        if force:
            raise CheckpointWorkerError("the checkpointing process closed its connection")

    def _send(self, msg: tuple[Any, ...]) -> None:
        assert self._req is not None
        try:
            self._req.send(msg)
        except (BrokenPipeError, ConnectionResetError, OSError):
            self._raise_worker_error(force=True)

    def _emit_record(
        self,
        t: int,
        payloads: dict[int, dict[str, torch.Tensor]],
        nograd: list[int],
        hp: str,
    ) -> None:
        t0 = time.perf_counter()
        slot = self._wait_slot("a free record slot")
        t1 = time.perf_counter()
        done = None
        if self._record_device is None or self._record_device.type != "cuda":
            self._copy_payloads(slot, payloads)  # synchronous device-to-host copies
        else:
            # Accelerator training: copy the payloads into the (pinned) host slot on a side
            # stream, after the compute stream's work that produced them. The record is
            # complete in host memory before it is handed over, so nothing of it depends
            # on the trainer (or its device memory) staying alive.
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(device=self._record_device)
            ready = torch.cuda.Event()
            ready.record()
            with torch.cuda.stream(self._side_stream):
                self._side_stream.wait_event(ready)
                self._copy_payloads(slot, payloads, non_blocking=self._pinned is not None)
                done = torch.cuda.Event()
                done.record(self._side_stream)
        try:
            rng_extra, extra = self._fill_row_tensors(slot)
            if done is not None:
                done.synchronize()
        except BaseException:
            self._unfill_slot()
            raise
        self._handover(
            lambda: self._send(
                ("record", slot, t, self._row_meta(t, nograd, hp, rng_extra, extra))
            ),
            extra,
        )
        self._stats["slot_wait_s"] += t1 - t0
        self._stats["record_send_s"] += time.perf_counter() - t1

    def _optimizer_state(self) -> tuple[dict[str, torch.Tensor], str]:
        """The optimizer's state tensors (this rank's shard under DDP) and its JSON."""
        if self._dist is None:
            return st.optimizer_state_tensors(self.optimizer)
        return st.optimizer_state_tensors(
            self.optimizer, shard_state_dict(self.optimizer.state_dict(), self._shard)
        )

    def _copy_payloads(
        self,
        slot: int,
        payloads: dict[int, dict[str, torch.Tensor]],
        non_blocking: bool = False,
    ) -> None:
        """Copy the step's compressed payloads into record slot ``slot``.

        Without ``non_blocking``, each run of fields that lie end to end in the row with
        one dtype (the layout groups fields by element size) is filled from one
        ``torch.cat``: two kernels for all its small tensors instead of a copy each. What
        no complete run covers (a parameter without gradient this step) goes through one
        batched copy.
        """
        dst = self._slot_dsts[slot]
        where = dst.payload
        filled: list[_Run] = []
        if not non_blocking:
            for run in dst.runs:
                srcs = run.gather(payloads)
                if srcs is not None:
                    run.fill(srcs)
                    filled.append(run)
            if len(filled) == len(dst.runs) and dst.runs_cover_all:
                return  # every field of the row was in a run
        done = {key for run in filled for key in run.keys}
        dsts: list[torch.Tensor] = []
        rest: list[torch.Tensor] = []
        for index, payload in payloads.items():
            fields = where.get(index)
            if fields is None:
                continue  # under DDP: another rank's shard
            for name, tensor in payload.items():
                if (index, name) not in done:
                    dsts.append(fields[name])
                    rest.append(tensor)
        if dsts:
            torch._foreach_copy_(dsts, rest, non_blocking=non_blocking)

    def _emit_full(self, step: int, kind: str = "full") -> None:
        self._finish_handover()  # a deferred full checkpoint still holds the staging buffer
        msd, aliases = st.model_state(self.model)
        if self._dist is not None:
            msd = shard_model_tensors(msd, self._foreign)
        otensors, ojson = self._optimizer_state()
        rng_t, rng_extra = st.capture_rng(self._rng_layout)
        tensors: dict[str, torch.Tensor] = {f"model/{k}": v for k, v in msd.items()}
        tensors.update(otensors)
        tensors.update(rng_t)
        sig = tuple((k, v.dtype, v.shape) for k, v in tensors.items())
        if self._full_plan is None or self._full_plan[0] != sig:
            # the layout changes only when the state's tensors do (optimizer state appears
            # after the first update; a parameter group is added)
            self._full_plan = (sig, *plan(sig))
        _, entries, size = self._full_plan
        t0 = time.perf_counter()
        ctr = self._ctr_view
        self._await(
            lambda: int(ctr[channel.STAGING_DONE]) >= self._staged,
            "the previous full checkpoint to release the staging buffer",
        )
        t1 = time.perf_counter()
        if self._staging is None or self._staging.numel() < size:
            # grow with slack: optimizer state appears after the first step
            rp.ensure_shm_space(size + size // 8, "staging a full checkpoint")
            self._staging = torch.empty(max(size, 1) + size // 8, dtype=torch.uint8).share_memory_()
            self._send(("stage", self._staging))
        dsts = self._full_dsts
        if dsts is None or dsts[0] is not self._staging or dsts[1] is not entries:
            views = view_tensors(entries, self._staging[:size])
            dsts = self._full_dsts = (self._staging, entries, [views[k] for k, _, _ in sig])
        with torch.no_grad():
            torch._foreach_copy_(dsts[2], list(tensors.values()))
        t2 = time.perf_counter()
        meta = {
            "kind": "full",
            "step": str(step),
            "run_id": self._run_id,
            "layout_id": self.layout.layout_id,
            "model_aliases": codec.dumps(aliases),
            "optim": ojson,
            "rng": codec.dumps(rng_extra),
        }
        extra = st.capture_extra(self._extra)
        if self._dist is not None:
            meta["shard"] = codec.dumps(self._shard)
        entries_json = [
            [e.name, dtype_name(e.dtype), list(e.shape), e.start, e.end] for e in entries
        ]
        self._staged += 1

        def send() -> None:
            if self._deferred:
                # the hyperparameters the scheduler set since the copy (the state tensors
                # are unchanged: no update ran in between)
                meta["optim"] = self._optimizer_state()[1]
            meta["scheduler"] = st.scheduler_state_json(self.scheduler)
            if extra is not None:
                meta["extra"] = _json(extra)
            self._send((kind, step, entries_json, meta))

        self._handover(send, extra)
        self._stats["fulls_requested"] += 1
        self._stats["full_wait_s"] += t1 - t0
        self._stats["full_copy_s"] += t2 - t1
        self._last_full = step
        if self._tuner is not None:
            self._tuner.observe_full_copy(t2 - t1)

    # ------------------------------------------------------------------ full_every / batch_size "auto"
    def _time_decompress(self, payloads: dict[int, dict[str, torch.Tensor]]) -> float:
        """Decompress one record's payloads again, timed (the replay's decompression)."""
        assert self._tuner is not None
        t0 = time.perf_counter()
        with torch.no_grad():
            for (info, p), numel in zip(self._params, self._numels, strict=True):
                payload = payloads.get(info.index)
                if payload is not None:
                    self.compressor.decompress(payload, numel, p.dtype)
        took = time.perf_counter() - t0
        self._tuner.observe_decompress(took)
        return took

    def _state_nbytes(self) -> int:
        """Bytes of the model and optimizer tensors now (a full checkpoint's payload)."""
        msd, _ = st.model_state(self.model)
        n = sum(v.numel() * v.element_size() for v in msd.values())
        for s in self.optimizer.state.values():
            n += sum(v.numel() * v.element_size() for v in s.values() if torch.is_tensor(v))
        return n

    def _set_plan(self, f: int, b: int, reason: str = "forced") -> None:
        """Switch to (f, b) now, as the planner does (``"auto"`` only; for tests and tools)."""
        if self._tuner is None:
            raise RuntimeError("(f, b) can change only with full_every or batch_size 'auto'")
        check_int("f", f, 1)
        check_int("b", b, 1)
        if b > f:
            raise ValueError(f"need 1 <= b <= f, got f={f}, b={b}")
        self._apply_plan(self._tuner.force(self._step, f, b, reason))

    def _apply_plan(self, entry: dict[str, Any]) -> None:
        """Use ``entry``'s (f, b): the next full checkpoint is due f steps after the last
        one; the checkpointing process writes its partial batch, then batches b records."""
        f, b = int(entry["f"]), int(entry["b"])
        if b != self.batch_size:
            self._send(("batch_size", b))
        self.full_every, self.batch_size = f, b
        m = entry.get("inputs")
        why = ""
        if m is not None:
            why = (
                f"; predicted wasted time {entry['previous_wasted_s']:.4g} -> {entry['wasted_s']:.4g} "
                f"GPU-s per hour of training (MTBF {m['mtbf']:.4g} s from {self._mtbf_source}, "
                f"tau {m['tau'] * 1e3:.3g} ms, W {m['write_bw'] / 1e6:.3g} MB/s, "
                f"latency {m['batch_latency'] * 1e3:.3g} ms, full {m['full_bytes'] / 1e6:.3g} MB, "
                f"record {m['record_bytes'] / 1e3:.3g} kB)"
            )
        _plan_log.info(
            "%s: step %d: full_every %d -> %d, batch_size %d -> %d (%s%s)",
            self.root,
            entry["step"],
            entry["previous_f"],
            f,
            entry["previous_b"],
            b,
            entry["reason"],
            why,
        )

    def _fill_row_tensors(self, slot: int) -> tuple[Any, Any]:
        """Write the step's buffers and RNG states into row ``slot``, right after the update.

        Returns the RNG bookkeeping and the extra state (``extra_state=``) of this moment.
        """
        dst = self._slot_dsts[slot]
        if dst.buffers:
            torch._foreach_copy_(dst.buffers, self._buffer_refs.tensors())
        rng_extra = self._rng_capture.into(self._slot_views[slot])
        return rng_extra, st.capture_extra(self._extra)

    def hparams(self) -> str:
        """The update's hyperparameters as the JSON text a record holds (groups that did
        not change since the previous step are not encoded again)."""
        return self._hp_text(self.optimizer)

    def _row_meta(self, t: int, nograd: list[int], hp: str, rng_extra: Any, extra: Any) -> str:
        """The record's JSON document (``codec.dumps`` of ``{"hp", "hp_after", "nograd",
        "rng", "sched", "step"}``, keys sorted); the hyperparameters after the update and
        the scheduler's state are taken now (after the scheduler stepped)."""
        sched = "null" if self.scheduler is None else codec.dumps(self.scheduler.state_dict())
        doc = (
            f'{{"hp":{hp},"hp_after":{self._hp_text(self.optimizer)},"nograd":{_json(nograd)},'
            f'"rng":{codec.dumps(rng_extra)},"sched":{sched},"step":{int(t)}}}'
        )
        return doc if extra is None else _with_extra(doc, extra)

    # ------------------------------------------------------------------ hand-over
    def _handover(self, send: Callable[[], None], extra: dict[str, Any] | None) -> None:
        """Send now (``ck.step()``: the scheduler has stepped), or, driven by the optimizer's
        hooks, once the user's scheduler has stepped: when the next update begins, or at
        ``flush()`` / ``close()``."""
        if not self._deferred:
            send()
            return
        self._pending.append(send)
        if extra is not None and self._late_extra:
            self._pending_extra.append((extra, set(self._late_extra)))

    def _finish_handover(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        self._pending_extra = []
        with record_function("lowdiff.handover"):
            for send in pending:
                send()

    def capture_after_update(self, name: str) -> None:
        """Driven by the optimizer's hooks: take ``extra_state[name]`` for each step when
        :meth:`recapture` is next called after its update, instead of right after the
        update. For state the loop changes after ``optimizer.step()`` returned and that
        belongs to the step: a ``GradScaler`` after ``update()`` (done automatically), a
        framework's global step or epoch counters.
        """
        if name not in self._extra:
            raise ValueError(f"extra_state has no {name!r} (it has {sorted(self._extra)})")
        if name not in self._late_extra:
            self._late_extra.append(name)

    def recapture(self, name: str) -> None:
        """Take ``extra_state[name]`` now for the steps waiting for it (see
        :meth:`capture_after_update`): each step takes it once, at the first call after
        its update (a later call belongs to later steps)."""
        if not self._closed:
            self._recapture_extra(name)

    def _recapture_extra(self, name: str) -> None:
        obj = self._extra[name]
        waiting = [(tree, names) for tree, names in self._pending_extra if name in names]
        if not waiting:
            return
        state = st.capture_extra({name: obj})[name]
        for tree, names in waiting:
            tree[name] = state
            names.discard(name)

    # ------------------------------------------------------------------ optimizer hooks
    def attach_to_optimizer(self) -> None:
        """Drive this strategy from ``optimizer.step()`` (see :func:`lowdiff.attach`)."""
        if self._hook_handles:
            raise RuntimeError("lowdiff is already attached to this optimizer")
        if self.name == "lowdiff+" and self.max_lag < 2:
            raise ValueError(
                "attach() with strategy 'lowdiff+' needs max_lag >= 2 (a step is handed over "
                "when the next one begins, so two snapshot slots are in use at once)"
            )
        self._deferred = True
        self.driven_by_hooks = True
        opt = self.optimizer
        self._hook_handles = [
            opt.register_step_pre_hook(self._on_step_pre),
            opt.register_step_post_hook(self._on_step_post),
        ]
        for name, obj in self._extra.items():
            if isinstance(obj, torch.amp.GradScaler):
                self._wrap_scaler_update(name, obj)
                self.capture_after_update(name)

    def _wrap_scaler_update(self, name: str, scaler: torch.amp.GradScaler) -> None:
        update = scaler.update
        ref = weakref.ref(self)

        def update_and_capture(*args: Any, **kwargs: Any) -> None:
            update(*args, **kwargs)
            me = ref()
            if me is not None and not me._closed:
                me._recapture_extra(name)

        scaler.update = update_and_capture  # type: ignore[method-assign]

    def on_close(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` when this strategy is closed (before it flushes)."""
        self._on_close.append(fn)

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
        self._finish_handover()
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
        t, grads, hp = self.prepare_update()
        self._inflight = (t, grads, hp, time.perf_counter())

    def _on_step_post(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if replaying():
            return
        if self._inflight is None:
            return  # a closure that never ran (nothing was updated)
        t, grads, hp, t0 = self._inflight
        self._inflight = None
        self.finish_update(t, grads, hp, time.perf_counter() - t0)

    # ------------------------------------------------------------------ distributed
    def _install_ddp_hook(self) -> None:
        """Register lowdiff's DDP communication hook (before the first backward)."""
        assert self._dist is not None
        if self.strategy == "lowdiff+":
            owned = {id(p): k for k, (_, p) in enumerate(self._snap_params())}
            hook_state = PlusHookState(self._dist, owned, self._on_reduced_grad)
            try:
                self.model.register_comm_hook(hook_state, plus_hook)  # type: ignore[operator]
            except RuntimeError as e:
                raise LowDiffError(
                    f"cannot install lowdiff's DDP communication hook: {e}"
                ) from None
            return
        comp = self._rank_compressor
        assert isinstance(comp, _Sparsifier) and isinstance(self.compressor, MergedSparse)
        self._hook_state = LowDiffHookState(
            self._dist, self._params, comp, self.compressor, lambda: self._step
        )
        try:
            self.model.register_comm_hook(self._hook_state, lowdiff_hook)  # type: ignore[operator]
        except RuntimeError as e:
            raise LowDiffError(
                f"cannot install lowdiff's DDP communication hook: {e} (a model may carry only one "
                "hook, registered before the first backward; build a new DDP wrapper)"
            ) from None

    def _snap_params(self) -> list[tuple[st.ParamInfo, torch.nn.Parameter]]:
        """The parameters whose gradients this rank snapshots (its shard under DDP)."""
        shard = set(self._shard)
        return [(i, p) for i, p in self._params if i.index in shard]

    def _on_reduced_grad(self, k: int, grad: torch.Tensor) -> None:
        snap = self._snap
        if snap is not None:
            snap.on_reduced_grad(k, grad)

    def _resume_dist(self) -> int:
        """Distributed resume: every rank ends at one agreed step (see lowdiff.dist.recovery).

        When the newest generation of the job has this world size and serves a step, the
        job continues in it (as always). Otherwise it reshards: the state is rebuilt from
        the newest generation that serves a step, and a new generation begins in
        ``DIR/gen-G/`` with a full checkpoint at the resumed step; the old generation's
        files are left as they are.
        """
        from lowdiff.dist.recovery import (
            generation_dir,
            generations,
            job_manifest,
            recover_generations,
        )

        ctx, job = self._dist, self.job_root
        assert ctx is not None and job is not None and self.root is not None
        gens = generations(job)
        newest = gens[-1] if gens else None
        if newest is not None and newest.strategy != self.strategy:
            raise CheckpointMismatchError(
                f"{newest.root} was written with strategy {newest.strategy!r}; this job runs "
                f"{self.strategy!r}"
            )
        in_place = (
            newest is not None
            and not newest.single
            and newest.world_size == ctx.world_size
            and self.root.parent == newest.root
        )
        if self.strategy == "lowdiff+" and in_place:
            # a replica left by a crashed trainer still holds the writer lock: look first
            shard_ok = (self.root / layout.MANIFEST).exists()
            if ctx.all_min([int(shard_ok)])[0]:
                self._check_manifest(layout.read_manifest(self.root))
                if self._resume_dist_from_memory():
                    return self._step
        self._wait_for_previous_writer()
        others = sorted({d for g in gens for d in g.shard_dirs()} - {self.root})
        for i, d in enumerate(others):
            if self.strategy == "lowdiff+" and i % ctx.world_size == ctx.rank and d.is_dir():
                # a replica left by a crashed trainer of another world size: it persists
                # what it holds and exits (its memory is of no use to this world size)
                with contextlib.suppress(Exception):
                    old_id = str(layout.read_manifest(d).get("layout_id"))
                    live, _ = rp.find_live_replica(d, old_id, wait_s=self.start_timeout)
                    if live is not None:
                        live.release_owner(self.start_timeout)
        for d in others:
            if d.is_dir():
                wait_for_writer(d, self.start_timeout)
        self._remove_stale_temps()
        ctx.barrier()  # every rank's previous checkpointing process has finished
        held = [d for g in gens for d in g.shard_dirs() if not is_empty_dir(d)]
        if ctx.all_max([int(bool(held) or not is_empty_dir(self.root))])[0] == 0:
            # nothing was ever durable: a fresh job, generation 0, at this world size
            self._switch_root(rank_dir(job, ctx.rank))
            if ctx.rank == 0:
                layout.write_manifest(job, job_manifest(ctx.world_size, self.strategy))
            ctx.barrier()
            self._start_fresh()
            return 0
        if newest is None:
            raise CheckpointMismatchError(f"{job} holds shard directories but no job manifest")
        if in_place and (self.root / layout.MANIFEST).exists():
            self._check_manifest(layout.read_manifest(self.root))
        g, stats = recover_generations(job, ctx, self.model, self.optimizer, self.scheduler)
        self._adopt_recovered(stats, g.root)
        ctx.barrier()  # every rank has read every shard before any file moves
        if in_place and g.index == newest.index:
            return self._continue_recovered(barrier=ctx.barrier)
        # reshard into a new generation; the old ones stay as they are
        gen = newest.index + 1
        # (another directory than the one locked at construction when the newest
        # generation had this world size but serves no step)
        self._switch_root(rank_dir(generation_dir(job, gen), ctx.rank))
        if ctx.rank == 0:
            layout.write_manifest(
                generation_dir(job, gen),
                job_manifest(ctx.world_size, self.strategy, generation=gen, start_step=self._step),
            )
        ctx.barrier()  # the generation exists before any rank writes in it
        self._start_fresh()
        return self._step

    def _switch_root(self, root: Path) -> None:
        """Under DDP: make ``root`` this rank's shard directory (locked) instead of the one
        chosen at construction."""
        if root == self.root:
            return
        check_directory(root)
        root.mkdir(parents=True, exist_ok=True)
        fd = acquire_flock(root / layout.LOCK_FILE, blocking=False)
        if fd is None:
            raise DirectoryLockedError(
                f"{root} is in use by another trainer ({lock_holder(root / layout.LOCK_FILE)})"
            )
        if self._lock_fd is not None:
            os.close(self._lock_fd)
        self.root, self._lock_fd = root, fd

    def _resume_dist_from_memory(self) -> bool:
        """LowDiff+ under DDP: rebuild the whole state from every rank's replica shard.

        Possible only when every rank finds a live replica of its shard at the same step;
        otherwise the replicas found persist what they hold and exit, and recovery reads
        the disk.
        """
        from lowdiff.dist.recovery import apply_sharded_state

        ctx = self._dist
        assert ctx is not None and self.root is not None
        t0 = time.perf_counter()
        live, why = rp.find_live_replica(
            self.root, self.layout.layout_id, wait_s=self.start_timeout
        )
        local = live.step if live is not None else -1
        lo, hi = ctx.all_min([local])[0], ctx.all_max([local])[0]
        if lo < 0 or lo != hi:
            self._memory_miss_reason = why if live is None else f"replica steps differ ({lo}..{hi})"
            if live is not None:
                live.release_owner(self.start_timeout)
            return False
        assert live is not None
        try:
            parts = ctx.exchange(live.tensors(), dict(live.doc["meta"]))
            stats = RecoveryStats(full_step=lo, step=lo, source="memory")
            stats.read_s = time.perf_counter() - t0
            apply_sharded_state(
                parts,
                ctx.rank,
                self.model,
                self.optimizer,
                self.scheduler,
                stats,
                where="replicas in memory",
            )
            stats.total_s = time.perf_counter() - t0
        finally:
            live.release_owner(self.start_timeout)
        self._start_after_memory_recovery(stats, barrier=ctx.barrier)
        return True

    # ------------------------------------------------------------------ lowdiff+
    def _acquire_slot(self) -> int:
        """A free snapshot slot; waits while the replica lags ``max_lag`` steps behind."""
        t0 = time.perf_counter()
        slot = self._wait_slot(f"the replica to catch up (max_lag={self.max_lag})")
        self._stats["lag_wait_s"] += time.perf_counter() - t0
        return slot

    # ------------------------------------------------------------------ the step pipeline
    def take_gradients(self, t: int) -> StepGrads:
        """The gradients of step ``t`` as the optimizer will apply them."""
        out = StepGrads()
        if self._hook_state is not None:
            # DDP: the hook merged the gradients during backward; whatever happened to .grad
            # since (clipping, scaling) is taken into the records
            out.payloads = self._hook_state.take(t)
            out.nograd = [info.index for info, p in self._params if p.grad is None]
            missing = [
                info.name
                for info, p in self._params
                if p.grad is not None and info.index not in out.payloads
            ]
            if missing:
                raise LowDiffError(
                    f"step {t}: the gradients of {', '.join(missing[:3])}"
                    f"{', ...' if len(missing) > 3 else ''} did not pass through lowdiff's DDP "
                    "hook (was backward run under no_sync(), or were gradients set by hand?)"
                )
            record_consumed(out.payloads, self._params)
        else:
            t0 = time.perf_counter()
            out.payloads, out.nograd = compress_grads(
                self._params, self._numels, self.compressor, t
            )
            out.compress_s = time.perf_counter() - t0
            if self._tuner is not None and self._tuner.wants_decompress_sample and out.payloads:
                out.extra_s = self._time_decompress(out.payloads)
        return out

    def _emit(self, t: int, grads: StepGrads, hp: str) -> None:
        """Hand step ``t`` over to the checkpointing process; a full checkpoint when due;
        the storage-error policy; the job-wide durable step under DDP."""
        with contextlib.suppress(_CheckpointingSuspended):
            if self._suspended is not None:
                if self._step % self.full_every == 0:
                    self._resume_checkpointing()
                return
            self._emit_record(t, grads.payloads, grads.nograd, hp)
            if self._full_due():
                self._emit_full(self._step)
            if self._tuner is not None:
                self._poll()
                if self._tuner.due(self._step):
                    entry = self._tuner.decide(self._step, self._state_nbytes())
                    if entry is not None:
                        self._apply_plan(entry)
        self._refresh_job_durable()

    def _full_due(self) -> bool:
        """A full checkpoint after this step: at multiples of f, or with ``"auto"`` f steps
        after the previous one (f changes there)."""
        if self._tuner is not None:
            return self._step - self._last_full >= self.full_every
        return self._step % self.full_every == 0

    def _refresh_job_durable(self) -> None:
        """Under DDP: exchange this shard's durable step with the other ranks (in the
        background; every rank calls this at the end of every step)."""
        if self._job is not None:
            self._poll()
            self._job.refresh(self._durable)

    def _resume_from_memory(self) -> bool:
        """Restore from a live replica left by a crashed trainer; False when there is none."""
        assert self.root is not None
        t0 = time.perf_counter()
        live, why = rp.find_live_replica(
            self.root, self.layout.layout_id, wait_s=self.start_timeout
        )
        if live is None:
            self._memory_miss_reason = why
            return False
        try:
            manifest = layout.read_manifest(self.root)
            self._check_manifest(manifest)
            stats = RecoveryStats(full_step=live.step, step=live.step, source="memory")
            t1 = time.perf_counter()
            stats.read_s = t1 - t0
            apply_full_state(
                live.tensors(),
                live.doc["meta"],
                self.model,
                self.optimizer,
                self.scheduler,
                stats,
                where="replica in memory",
            )
            stats.total_s = time.perf_counter() - t0
        finally:
            # the old checkpointing process persists what it has not yet and exits
            live.release_owner(self.start_timeout)
        self._start_after_memory_recovery(stats)
        return True

    def _start_after_memory_recovery(
        self, stats: RecoveryStats, barrier: Callable[[], None] | None = None
    ) -> None:
        """Take over from the released replica: a new checkpointing process, seeded with the state."""
        self.recovery_stats = stats
        st.apply_extra(self._extra, stats.extra, f"{self.root} step {stats.step}")
        self._step = stats.step
        self._durable = -1
        self._wait_for_previous_writer()  # the old process persists what it holds, then exits
        self._remove_stale_temps()
        if barrier is not None:
            barrier()  # every rank's old process is gone before any rank starts anew
        self._write_manifest()
        self._launch_worker()
        self._started = True
        self._emit_full(self._step, kind="init")

    def _remove_stale_temps(self) -> None:
        """Delete temp files a killed writer left in this directory (never published files)."""
        assert self.root is not None
        for d in (self.root, self.root / layout.FULL_DIR, self.root / layout.RECORDS_DIR):
            remove_stale_temps(d)

    # ------------------------------------------------------------------ storage errors
    def _suspend_checkpointing(self, err: CheckpointWorkerError) -> None:
        """``on_storage_error="warn"``: drop the failed checkpointing process, train on."""
        self._suspended = str(err).split("\n", 1)[0]
        self._worker_error = None
        self._stop_worker()
        self._warn_not_durable("a storage error")
        raise _CheckpointingSuspended

    def _warn_not_durable(self, where: str) -> None:
        lost = self._step - self._durable if self._durable >= 0 else self._step
        retry = -(-(self._step + 1) // self.full_every) * self.full_every
        warnings.warn(
            f"lowdiff: checkpointing to {self.root} is suspended ({where}): {self._suspended}; "
            f"{lost} step(s) are not durable (newest durable step {self._durable}, training is at "
            f"step {self._step})"
            + ("" if self._closed else f"; lowdiff retries with a full checkpoint at step {retry}"),
            DurabilityWarning,
            stacklevel=4,
        )

    def _join_worker(self) -> None:
        """Wait for the checkpointing process to exit (it has been told to, or it failed and
        is finishing what it was writing), as long as it makes progress."""
        proc = self._proc
        if proc is None:
            return
        beat, since = int(self._ctr_view[channel.BEAT]), time.monotonic()
        while proc.is_alive():
            proc.join(0.05)
            b = int(self._ctr_view[channel.BEAT])
            if b != beat:
                beat, since = b, time.monotonic()
            elif time.monotonic() - since > self.stall_timeout:
                warnings.warn(
                    f"lowdiff: the checkpointing process (pid {proc.pid}) made no progress for "
                    f"{self.stall_timeout:.0f} s after it was told to stop; leaving it running "
                    "(the next session waits for it before touching the directory)",
                    DurabilityWarning,
                    stacklevel=3,
                )
                return

    def _stop_worker(self) -> None:
        """Wait for a checkpointing process that reported an error to exit; drop its pipes."""
        if self._proc is not None:
            self._proc.join(self.start_timeout)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        for c in (self._req, self._res):
            if c is not None:
                with contextlib.suppress(OSError):
                    c.close()
        self._req = self._res = None
        self._proc = None

    def _resume_checkpointing(self) -> None:
        """After a storage error: a new checkpointing process, starting with a full checkpoint."""
        try:
            self._wait_for_previous_writer()
            assert self.root is not None
            self._remove_stale_temps()
            self._staging = None  # the new process needs the staging buffer again
            self._suspended = None
            self._launch_worker()
            self._emit_full(self._step)
        except (OSError, LowDiffError) as e:
            if self._suspended is None:
                self._suspended = f"restarting the checkpointing process failed: {e}"
                self._stop_worker()
                self._warn_not_durable("a storage error")
            raise _CheckpointingSuspended from None

    # ------------------------------------------------------------------ teardown
    def _release(self) -> None:
        if self._snap is not None:
            with contextlib.suppress(Exception):
                self._snap.close()
            self._snap = None
        if self._pinned is not None:
            _unpin(self._pinned)
            self._pinned = None
        for c in (self._req, self._res):
            if c is not None:
                with contextlib.suppress(OSError):
                    c.close()
        self._req = self._res = None
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = None

    def _close_at_exit(self) -> None:
        if self.strategy == "lowdiff+" and self._dist is not None and not self._closed:
            # A rank exiting without close() under DDP is a failed job that its launcher
            # will restart: leave the replica running (it persists its state and waits
            # idle_timeout for a restarted trainer) instead of shutting it down.
            self._closed = True
            with contextlib.suppress(Exception):
                self._release()
            return
        with contextlib.suppress(Exception):
            self.close()

    def __del__(self) -> None:
        # Dropped without close(): closing the pipe makes the checkpointing process flush
        # what it received and exit, and the directory lock is given back.
        with contextlib.suppress(Exception):
            self._release()


class LowDiffPlusStrategy(LowDiffStrategy):
    """Strategy ``"lowdiff+"``: training without compression; the gradients are
    snapshotted layer by layer during backward into shared host slots and merged by the
    checkpointing process into a CPU replica of the model and optimizer, persisted in the
    background. After a trainer crash a new trainer restarts from the replica in memory.

    The slots are the lag buffers: ``max_lag`` of them, so the replica trails the trainer
    by at most ``max_lag`` steps.
    """

    serves: ClassVar[tuple[str, ...]] = ("lowdiff+",)

    def take_gradients(self, t: int) -> StepGrads:
        """Finish the layer-wise snapshot of step ``t`` (gradients changed after their
        hook, e.g. by clipping, are copied again)."""
        assert self._snap is not None
        out = StepGrads()
        t0 = time.perf_counter()
        try:
            out.slot, out.nograd = self._snap.finish()
        except BaseException:
            if self._snap.abandon() is not None:
                self._unfill_slot()
            raise
        self._stats["snapshot_finish_s"] += time.perf_counter() - t0
        return out

    def _emit(self, t: int, grads: StepGrads, hp: str) -> None:
        """Hand the snapshot slot of step ``t`` to the replica."""
        if self._staging is not None and int(self._ctr_view[channel.STAGING_DONE]) >= self._staged:
            # the replica took the initial state: the staging copy is no longer needed
            self._staging = None
        t0 = time.perf_counter()
        rng_extra, extra = self._fill_row_tensors(grads.slot)
        slot, nograd = grads.slot, grads.nograd
        self._handover(
            lambda: self._send(("step", slot, t, self._row_meta(t, nograd, hp, rng_extra, extra))),
            extra,
        )
        self._stats["record_send_s"] += time.perf_counter() - t0
        self._refresh_job_durable()


@dataclasses.dataclass
class _SlotDsts:
    """One record slot's destination tensors, resolved once per slot."""

    payload: dict[int, dict[str, torch.Tensor]]
    """Parameter index -> compressed field -> its view in the row."""
    buffers: list[torch.Tensor]
    """The buffers' views, in the layout's order."""
    runs: list[_Run]
    """The payload fields grouped into runs that lie end to end with one dtype."""
    runs_cover_all: bool
    """Whether every payload field is in a run."""

    @staticmethod
    def of(layout: RecordLayout, views: dict[str, torch.Tensor]) -> _SlotDsts:
        payload = {info.index: layout.payload(views, k) for k, info in enumerate(layout.params)}
        runs = _Run.plan(payload)
        n_fields = sum(len(f) for f in payload.values())
        covered = sum(len(r.keys) for r in runs) == n_fields
        return _SlotDsts(payload, list(layout.buffer_values(views).values()), runs, covered)


@dataclasses.dataclass
class _Run:
    """Payload fields that lie end to end in a record row with one dtype: one view."""

    view: torch.Tensor
    """1-D, over all the fields' bytes."""
    keys: list[tuple[int, str]]
    """(parameter index, field name), in row order."""
    flatten: bool
    """Whether some field has more than one dimension (sources are flattened first)."""

    def gather(self, payloads: dict[int, dict[str, torch.Tensor]]) -> list[torch.Tensor] | None:
        """The run's sources in row order, or None if one is missing."""
        out: list[torch.Tensor] = []
        for index, name in self.keys:
            p = payloads.get(index)
            t = None if p is None else p.get(name)
            if t is None:
                return None
            out.append(t)
        if self.flatten:
            out = [t.reshape(-1) for t in out]
        return out

    def fill(self, srcs: list[torch.Tensor]) -> None:
        """Write the sources into the run. The concatenation is copied in (not written
        with ``out=``, which would resize the view if a source had another size): the
        copy checks the size, as a copy per field does."""
        self.view.copy_(torch.cat(srcs))

    @staticmethod
    def plan(payload: dict[int, dict[str, torch.Tensor]]) -> list[_Run]:
        """Runs of two or more fields (a lone field gains nothing from a cat)."""
        fields = sorted(
            (
                (t.data_ptr(), index, name, t)
                for index, f in payload.items()
                for name, t in f.items()
            ),
            key=lambda x: x[0],
        )
        groups: list[list[tuple[int, str, torch.Tensor]]] = []
        end = -1
        for ptr, index, name, t in fields:
            g = groups[-1] if groups else None
            if g is not None and ptr == end and t.dtype == g[-1][2].dtype and t.is_contiguous():
                g.append((index, name, t))
            else:
                groups.append([(index, name, t)])
            end = ptr + t.numel() * t.element_size()
        runs = []
        for g in groups:
            first = g[0][2]
            if len(g) < 2 or not first.is_contiguous():
                continue
            total = sum(t.numel() for _, _, t in g)
            view = first.as_strided((total,), (1,), first.storage_offset())
            flat = any(t.dim() != 1 for _, _, t in g)
            runs.append(_Run(view, [(i, n) for i, n, _ in g], flat))
        return runs


def _json(tree: Any) -> str:
    return json.dumps(tree, separators=(",", ":"), allow_nan=False)


def _with_extra(doc: str, tree: Any) -> str:
    """A record's JSON document with the extra-state tree (already encoded) added."""
    return f'{doc[:-1]},"extra":{_json(tree)}}}'


def _close_at_exit(ref: weakref.ref[LowDiffStrategy]) -> None:
    """Interpreter exit without close(): flush what is pending so nothing is lost."""
    ck = ref()
    if ck is not None:
        ck._close_at_exit()


def _pin(t: torch.Tensor) -> bool:
    """Page-lock shared host memory so CUDA copies into it run asynchronously.

    Returns whether the range was registered; a registered range must be given back with
    :func:`_unpin` before its memory is unmapped, or a later mapping at the same address
    cannot be registered.
    """
    try:
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    except Exception:
        return False
    if int(err) == 0:
        return True
    with contextlib.suppress(Exception):
        cudart.cudaGetLastError()  # clear it, or the next CUDA call reports it
    warnings.warn(
        "lowdiff: could not pin the snapshot buffers; copies will be synchronous",
        stacklevel=3,
    )
    return False


def _unpin(t: torch.Tensor) -> None:
    with contextlib.suppress(Exception):
        torch.cuda.synchronize()
        cudart = torch.cuda.cudart()
        if int(cudart.cudaHostUnregister(t.data_ptr())) != 0:
            cudart.cudaGetLastError()

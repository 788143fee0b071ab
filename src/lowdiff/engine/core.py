"""What every lowdiff strategy keeps on the training process.

:class:`EngineCore` holds the training objects and their layout (the optimized
parameters, this rank's shard under DDP, the record layout), the session's counters
(the step, the durable step, ``ck.stats``), and the checkpoint directory with its lock
and manifest. The strategies (:mod:`lowdiff.engine.lowdiff`,
:mod:`lowdiff.engine.lowdiff_plus`, :mod:`lowdiff.engine.none`) compose it with the
parts they need; it knows nothing of any one strategy.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime as _dt
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from lowdiff.compressors.base import Compressor
from lowdiff.ddp.context import DistContext, JobMin, assign_shards
from lowdiff.ddp.shard import shard_state_dict
from lowdiff.errors import (
    CheckpointMismatchError,
    InvalidArgumentError,
    LowDiffError,
    UnsupportedSetupError,
)
from lowdiff.format import layout
from lowdiff.format.atomic import remove_stale_temps
from lowdiff.format.sfile import FORMAT_NAME, FORMAT_VERSION
from lowdiff.proc.holder import forget_released, release_survivor
from lowdiff.proc.locks import lock_directory, wait_for_writer
from lowdiff.recovery.compat import check_compatible
from lowdiff.recovery.job import generations, is_job_dir, rank_root
from lowdiff.recovery.quarantine import quarantine_beyond
from lowdiff.recovery.replay import RecoveryStats
from lowdiff.recovery.scan import check_directory, is_empty_dir
from lowdiff.state import capture as st
from lowdiff.state.model_config import model_config_entry
from lowdiff.state.record import RecordLayout
from lowdiff.state.sharded import local

STAT_KEYS = (
    "steps", "slot_wait_s", "full_wait_s", "full_copy_s", "fulls_requested", "fulls_written",
    "full_bytes", "full_write_s", "record_send_s", "lag_wait_s", "snapshot_finish_s",
    "record_files_written", "records_written", "record_bytes", "record_write_s",
    "replica_merges", "replica_merge_s",
)  # fmt: skip
"""The counters of ``ck.stats`` that the training process keeps (see
:attr:`lowdiff.Checkpointer.stats`)."""


def dumps(tree: Any) -> str:
    """Compact JSON (no NaN), as records and manifests store it."""
    return json.dumps(tree, separators=(",", ":"), allow_nan=False)


class EngineCore:
    """The training objects, the session's counters and the checkpoint directory.

    Args:
        name: the strategy's name (written to the manifest, checked on resume).
        model, optimizer, scheduler: the training objects.
        compressor: the compressor whose records this session writes (``MergedSparse``
            under DDP).
        dist: the DDP context, or None in a single process.
        extra_state: the ``extra_state`` objects (already checked).
    """

    def __init__(
        self,
        name: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any | None,
        compressor: Compressor,
        dist: DistContext | None,
        extra_state: dict[str, Any],
    ) -> None:
        self.name = name
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.compressor = compressor
        self.dist = dist
        self.job: JobMin | None = None if dist is None else JobMin(dist, width=2)
        """Under DDP: the job-wide minima of :meth:`figures` (local, remote)."""
        self.extra = extra_state
        self.params = st.optimizer_params(model, optimizer)
        self.n_groups = len(optimizer.param_groups)
        """The optimizer's parameter groups (a group added later cannot be checkpointed)."""
        if dist is not None and dist.sharded:
            # under fully_shard a rank holds, snapshots and restores its own shard of every
            # parameter: the layout is that of the local shards
            self.params = [
                (dataclasses.replace(info, shape=tuple(local(p).shape)), p)
                for info, p in self.params
            ]
        for info, p in self.params:
            if p.is_sparse:
                raise InvalidArgumentError(
                    f"parameter {info.name!r} is sparse; lowdiff supports dense parameters only"
                )
        _refuse_sparse_gradients(model, {id(p) for _, p in self.params})
        self.numels = [local(p).numel() for _, p in self.params]
        devices = {p.device for _, p in self.params}
        if len(devices) > 1:
            raise InvalidArgumentError(
                f"all optimized parameters must be on one device, found {sorted(map(str, devices))}"
            )
        dev = next(iter(devices), torch.device("cpu"))
        self.record_device: torch.device | None = None if dev.type == "cpu" else dev
        """The device records are copied from (None: the CPU, copies are synchronous)."""
        self.buffer_names = st.buffer_names(model)
        self.buffer_refs = st.BufferRefs(model, self.buffer_names)
        self.hp_text = st.HparamsText()
        self.step = 0
        self.started = False
        self.closed = False
        self.durable = -1
        """Newest step this rank's checkpointing process made durable (-1: none)."""
        self.remote_durable = -1
        """Newest step the remote tier can recover (-1: none, or no remote tier)."""
        self.remote_error: str | None = None
        """The last failed upload attempt the checkpointing process reported."""
        self.last_full = 0
        """Step of the newest full checkpoint (``"auto"`` schedules the next one from it)."""
        self.run_id = uuid.uuid4().hex
        self.recovery_stats: RecoveryStats | None = None
        self.recovered_extra: tuple[int, Any] | None = None
        """(step, extra-state tree) of the last recovery (see :meth:`extra_at`)."""
        self.memory_miss_reason: str | None = None
        """Why LowDiff+'s last resume found no replica in memory to restart from."""
        self.stats: dict[str, float] = dict.fromkeys(STAT_KEYS, 0.0)
        self.shard = [info.index for info, _ in self.params]
        """The optimizer indices this rank checkpoints (all of them in one process)."""
        self.foreign: set[str] = set()
        """Under DDP: names of the parameters other ranks checkpoint."""
        if dist is not None and not dist.sharded:
            owner = assign_shards(self.numels, dist.world_size)
            self.shard = [i for i, r in enumerate(owner) if r == dist.rank]
            self.foreign = {info.name for info, _ in self.params if owner[info.index] != dist.rank}
        self.root: Path | None = None
        self.job_root: Path | None = None
        self.lock_fd: int | None = None
        self.rng_layout: st.RngLayout | None = None
        self.rng_capture: st.RngCapture | None = None
        self.layout: RecordLayout | None = None
        self.layout_id = ""
        """``layout.layout_id``, taken once (a hash of the layout's JSON: every full
        checkpoint names it, and the engine never changes its layout)."""
        self.configured: dict[str, int | str] = {}
        """``full_every`` and ``batch_size`` as configured (``"auto"`` stays ``"auto"``)."""
        self.full_every = 1
        """f in use: a full checkpoint every f steps (``"auto"`` changes it)."""
        self.batch_size = 1
        """b in use: records per file (``"auto"`` changes it)."""

    # ------------------------------------------------------------------ parameters
    def shard_params(self) -> list[tuple[st.ParamInfo, torch.nn.Parameter]]:
        """The parameters this rank checkpoints (its shard under DDP)."""
        shard = set(self.shard)
        return [(i, p) for i, p in self.params if i.index in shard]

    def optimizer_state(self) -> tuple[dict[str, torch.Tensor], str]:
        """The optimizer's state tensors (this rank's shard under DDP) and its JSON."""
        if self.dist is None or self.dist.sharded:
            return st.optimizer_state_tensors(self.optimizer)
        return st.optimizer_state_tensors(
            self.optimizer, shard_state_dict(self.optimizer.state_dict(), self.shard)
        )

    def groups_changed(self) -> bool:
        """Whether the optimizer gained a parameter group since construction."""
        return len(self.optimizer.param_groups) != self.n_groups

    def check_groups(self) -> None:
        """Refuse an optimizer that gained a parameter group since construction."""
        if self.groups_changed():
            groups = len(self.optimizer.param_groups)
            raise UnsupportedSetupError(
                f"the optimizer has {groups} parameter groups, {self.n_groups} when the "
                "Checkpointer was built (optimizer.add_param_group()): lowdiff's records and "
                "full checkpoints hold the parameters it was built with, so nothing from here "
                "on could be restored. Add every group before building the Checkpointer (a "
                "group may start frozen or with lr 0), or close it and start a new directory"
            )

    # ------------------------------------------------------------------ the directory
    def open_directory(self, directory: str | os.PathLike[str]) -> None:
        """Check and lock the checkpoint directory (this rank's shard directory under
        DDP), and lay out the records."""
        self.root = Path(directory)
        if self.dist is not None:
            self.job_root = self.root
            check_directory(self.job_root)
            # the newest generation's shard at this world size, else the next generation's
            self.root = rank_root(self.job_root, self.dist.rank, self.dist.world_size)
        elif is_job_dir(self.root):
            raise CheckpointMismatchError(
                f"{self.root} is a distributed job's directory: continue it under "
                "torchrun (any number of ranks, 1 included), or read a step of it "
                "with lowdiff.restore() / lowdiff export"
            )
        self.lock_fd = self._lock(
            self.root, "; two trainers cannot write to one checkpoint directory"
        )
        self.rng_layout = st.RngLayout()
        self.rng_capture = st.RngCapture(self.rng_layout)
        buffers = [
            (n, b.dtype, tuple(b.shape))
            for n, b in st.get_buffers(self.model, self.buffer_names).items()
        ]
        self.layout = RecordLayout.build(
            [info for info, _ in self.shard_params()], self.compressor, buffers, self.rng_layout
        )
        self.layout_id = self.layout.layout_id

    @staticmethod
    def _lock(root: Path, why: str = "") -> int:
        check_directory(root)
        return lock_directory(root, why)

    def switch_root(self, root: Path) -> None:
        """Under DDP: make ``root`` this rank's shard directory (locked) instead of the one
        chosen at construction."""
        if root == self.root:
            return
        fd = self._lock(root)
        self.release_lock()
        self.root, self.lock_fd = root, fd

    def release_lock(self) -> None:
        if self.lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.lock_fd)
            self.lock_fd = None

    def wait_for_previous_writer(self, timeout: float, since: float | None = None) -> None:
        """A killed trainer's checkpointing process may still be flushing: wait for it.
        One that waits for a new trainer (and is not taken over) is released first: it
        exits once it has persisted what it holds. The whole wait, from ``since`` (a
        ``time.monotonic()`` value; by default now), lasts at most ``timeout`` seconds."""
        assert self.root is not None
        start = time.monotonic() if since is None else since

        def left() -> float:
            return max(0.0, start + timeout - time.monotonic())

        released = release_survivor(self.root, left())
        wait_for_writer(self.root, left(), since=start)
        forget_released(self.root, released)

    def job_holds_checkpoints(self) -> bool:
        """(all ranks, under DDP) Whether any rank finds a checkpoint in the job: in a
        shard directory of any generation, or in its own shard directory."""
        assert self.dist is not None and self.job_root is not None and self.root is not None
        held = any(not is_empty_dir(d) for g in generations(self.job_root) for d in g.shard_dirs())
        return bool(self.dist.all_max([int(held or not is_empty_dir(self.root))])[0])

    def remove_stale_temps(self) -> None:
        """Delete temp files a killed writer left in this directory (never published files)."""
        assert self.root is not None
        for d in (self.root, self.root / layout.FULL_DIR, self.root / layout.RECORDS_DIR):
            remove_stale_temps(d)

    def quarantine_beyond(self, stats: RecoveryStats) -> None:
        """Move files that are damaged or lie past the recovered step out of the chain."""
        assert self.root is not None
        quarantine_beyond(self.root, stats, self.run_id)

    def make_dirs(self) -> None:
        assert self.root is not None
        (self.root / layout.FULL_DIR).mkdir(exist_ok=True)
        (self.root / layout.RECORDS_DIR).mkdir(exist_ok=True)

    # ------------------------------------------------------------------ the manifest
    def manifest_body(self, keep_full: int | None) -> dict[str, Any]:
        assert self.layout is not None
        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "strategy": self.name,
            "compressor": self.compressor.spec(),
            "optimizer": st.class_path(self.optimizer),
            "scheduler": None if self.scheduler is None else st.class_path(self.scheduler),
            "record_layout": self.layout.to_json(),
            "layout_id": self.layout_id,
            "full_every": self.configured["full_every"],
            "batch_size": self.configured["batch_size"],
            "keep_full": keep_full,
            "torch": torch.__version__,
            "updated": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "run_id": self.run_id,
            **model_config_entry(self.model),  # what an "hf" export rebuilds the model from
        }

    def write_manifest(self, keep_full: int | None) -> None:
        """Publish the manifest of this session, before any file of it: ``runs`` lists
        every run that wrote into the directory, this one last, so that a reader refuses a
        file of any other run (copied from elsewhere). A directory whose manifest predates
        the list gets none (what its older files came from is unknown)."""
        assert self.root is not None
        body = self.manifest_body(keep_full)
        runs = self._runs_before()
        if runs is not None:
            body["runs"] = [*(r for r in runs if r != self.run_id), self.run_id]
        layout.write_manifest(self.root, body)

    def _runs_before(self) -> list[str] | None:
        """The runs the directory's manifest lists ([] when it has none to list: a new
        directory, or one without a checkpoint file yet); None when they are unknown."""
        assert self.root is not None
        if is_empty_dir(self.root):
            return []
        try:
            runs = layout.read_manifest(self.root).get("runs")
        except LowDiffError:
            return None
        return [str(r) for r in runs] if isinstance(runs, list) else None

    def check_manifest(self, manifest: dict[str, Any]) -> None:
        """Refuse a directory written by another strategy, compressor, model, optimizer,
        record layout or scheduler."""
        assert self.layout is not None
        if manifest.get("strategy") != self.name:
            raise CheckpointMismatchError(
                f"{self.root} was written by strategy {manifest.get('strategy')!r}, this Checkpointer uses {self.name!r}"
            )
        if manifest.get("compressor") != self.compressor.spec():
            raise CheckpointMismatchError(
                f"{self.root} was written with compressor {manifest.get('compressor')}, this Checkpointer uses "
                f"{self.compressor.spec()}; resume with the same compressor settings"
            )
        if self.dist is None:
            check_compatible(manifest, self.model, self.optimizer)
        if manifest.get("layout_id") != self.layout_id:
            raise CheckpointMismatchError(
                f"{self.root}: the record layout differs (model buffers or CUDA devices changed since the "
                "checkpoint was written)"
            )
        want = None if self.scheduler is None else st.class_path(self.scheduler)
        if manifest.get("scheduler") != want:
            raise CheckpointMismatchError(
                f"{self.root} was written with scheduler {manifest.get('scheduler')}, got {want}"
            )

    # ------------------------------------------------------------------ recovered state
    def adopt_recovered(
        self, stats: RecoveryStats, where: Path | str, durable: bool = True
    ) -> None:
        """The recovered state is loaded: take its step, durability and extra state."""
        self.recovery_stats = stats
        st.apply_extra(self.extra, stats.extra, f"{where} step {stats.step}")
        self.recovered_extra = (stats.step, stats.extra)
        self.step = stats.step
        self.durable = stats.step if durable else -1
        if durable and self.job is not None:
            # the ranks resumed at one agreed step from their shards' files: the job's
            # durable step is that one before the first exchange says so
            self.job.at_least(0, stats.step)
        self.last_full = stats.full_step
        self.compressor.reset_state()  # error-feedback residuals restart at zero

    def extra_at(self, step: int) -> tuple[Any, bool]:
        """The extra state a checkpoint of ``step`` saves, and whether it was taken from
        the objects now (False: it is the recovered step's, as recovered).

        At the recovered step, before any update, the state is the recovered one; an
        object may apply a loaded state only later (Lightning's fit loop restores its
        loader's position when iteration resumes), so its ``state_dict()`` would not say
        so yet."""
        recovered = self.recovered_extra
        if recovered is not None and recovered[0] == step == self.step and self.extra:
            tree = recovered[1] or {}
            return {n: copy.deepcopy(tree[n]) for n in self.extra}, False
        return st.capture_extra(self.extra), True

    def figures(self) -> tuple[int, int]:
        """This rank's durable steps: the local tier's and the remote tier's (what the
        ranks exchange under DDP)."""
        return self.durable, self.remote_durable

    def durable_step(self) -> int:
        """This rank's durable step, or under DDP the job's (every shard has it)."""
        return self.durable if self.job is None else min(self.durable, self.job.values[0])

    def remote_durable_step(self) -> int:
        """This rank's remote durable step, or under DDP the job's: the newest step every
        shard's remote tier can recover (the same minimum as :meth:`durable_step`)."""
        if self.job is None:
            return self.remote_durable
        return min(self.remote_durable, self.job.values[1])


def _refuse_sparse_gradients(model: torch.nn.Module, optimized: set[int]) -> None:
    """Refuse, before anything is written, the modules whose optimized weight gets sparse
    gradients (``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True``); other sources
    of a sparse gradient are refused at the step that meets one."""
    for name, m in model.named_modules():
        sparse = isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse
        if sparse and id(m.weight) in optimized:
            where = f"{name}.weight" if name else "weight"
            raise InvalidArgumentError(st.sparse_gradient_error(where, f"{type(m).__name__}(sparse=True)"))

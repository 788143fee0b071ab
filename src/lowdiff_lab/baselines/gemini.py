"""``method="gemini"``: in-memory checkpoints kept by a separate process, rare persistence.

Gemini (Wang et al., SOSP'23) checkpoints into CPU memory instead of storage: the state
is copied every ``full_every`` steps into host memory that a training failure does not
take down, and a failed job restarts from that memory. Storage only serves failures that
lose the memory too, so it is written rarely.

**Holder process.** Every checkpoint directory has one *holder*: a long-lived process,
spawned by the first trainer, in a process group of its own (a launcher that kills the
trainer's group leaves it alone), holding ``DIR/.lowdiff.writer.lock``. It owns the
shared memory: a control block (the same seqlock block and ``DIR/.lowdiff.replica.json``
descriptor as LowDiff+'s replica, :mod:`lowdiff.proc.holder`) and two checkpoint
buffers (named shared-memory segments). The buffers are double-buffered: the trainer
always writes into the buffer that does not hold the newest complete checkpoint, and the
holder marks a checkpoint complete (publishes it in the control block) only when the
trainer says that the copy has finished. A copy cut short by a crash is therefore never
taken for a checkpoint, and never destroys the last complete one.

**The copy** (trainer). When a checkpoint is due after update ``s``, what forward or
backward may change (buffers such as BatchNorm statistics, the RNG states,
hyperparameters) is copied into the buffer before ``step()`` returns. Parameters and
optimizer state change only in the next optimizer update, so a background thread (one
for the session) copies them while the next forward and backward run, then hands the
checkpoint to the holder; ``step()`` waits for that copy just before the next update
(the wait counts as stall, as in CheckFreq).

**Persistence** (holder). Every ``persist_every``-th in-memory checkpoint (steps that
are multiples of ``full_every * persist_every``) is cloned out of the shared buffer and
written with :func:`~lowdiff_lab.baselines.base.save_state` by a thread of the holder, so
neither the trainer nor the next copy waits for the disk (unless a persist falls due
while the previous one is still being written: the holder then waits for it, and the
trainer's next checkpoint waits for the holder). The first checkpoint of a new
directory is persisted before ``resume()`` returns. ``flush()``/``close()`` and the
holder's exit persist the newest complete checkpoint. ``durable_step`` counts disk
only; ``stats["memory_step"]`` is the newest complete in-memory checkpoint.

**Peers** (DDP). Under ``DistributedDataParallel`` in an initialised process group,
each rank's thread also sends its completed checkpoint to rank ``(r + 1) % W`` over a
dedicated gloo group (CPU tensors, straight out of the shared buffers), and receives
rank ``r - 1``'s into two more double-buffered segments of its own holder. A rank whose
host is lost gets its state back from its successor's holder.

**Recovery** (``resume()``), newest source first:

1. memory: the holder of this directory is alive and offers a complete checkpoint (the
   trainer died, the host did not). The new trainer attaches to the holder (a Unix
   socket named in the control block, authenticated with a key kept there), copies the
   state out of shared memory, and the holder goes on serving it;
2. under DDP, the copy of this rank's state that its successor's holder keeps;
3. disk: the newest intact ``ckpt-*.pt``.

Under DDP the ranks agree on the newest step that every rank can recover from one of
these sources, and each rank takes it from the first source that has it.

A holder whose trainer died waits ``idle_timeout`` seconds for a new trainer; then it
persists its newest complete checkpoint and exits. ``close()`` persists the newest
checkpoint and stops the holder.

Call sequence::

    ck = Checkpointer(DIR, model, opt, method="gemini", full_every=1, method_options={"persist_every": 10})
    start = ck.resume()   # (trainer) memory -> peer -> disk; attaches to a live holder or
                          # spawns one; copies the recovered state into memory
    for step in range(start, total):
        ...; loss.backward()
        ck.step()         # (trainer) wait for the copy in flight -> update -> [copy
                          # buffers and RNG, start the copy thread] when a checkpoint is due
                          # (thread) parameters + optimizer state -> GmDone -> [peer send]
                          # (holder) publish as complete -> [persist every persist_every]
        opt.zero_grad()
    ck.close()            # (holder) persist the newest checkpoint, exit

Files (one directory per rank, ``DIR/rank-NNNNN/``, under DDP)::

    DIR/lowdiff.json                     manifest (strategy "gemini")
    DIR/full/ckpt-000000000120.pt        the state after 120 updates (torch.save), and
    DIR/full/ckpt-000000000120.pt.commit its xxh3-128 digest (published last)
    DIR/.lowdiff.replica.json            the live holder: pid, host, control block
    /dev/shm/lowdiff-<run>-ctl, -b<i>-<n> the holder's control block and buffers

Modules: the holder process (:mod:`~lowdiff_lab.baselines.gemini_holder`), the trainer's link
to it (:mod:`~lowdiff_lab.baselines.gemini_link`) and their messages
(:mod:`~lowdiff_lab.baselines.gemini_protocol`); the copy (:mod:`~lowdiff_lab.baselines.gemini_copy`);
the ring of ranks (:mod:`~lowdiff_lab.baselines.gemini_ring`) and recovery
(:mod:`~lowdiff_lab.baselines.gemini_resume`). This module is the strategy that composes them.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from lowdiff.compressors.base import Compressor
from lowdiff.ddp.context import DistContext, rank_dir
from lowdiff.ddp.context import detect as detect_dist
from lowdiff.errors import CheckpointMismatchError, LowDiffError
from lowdiff.format import layout
from lowdiff.format.atomic import remove_stale_temps
from lowdiff.options import check_int
from lowdiff.proc.protocol import Closed, Flushed, Message, unexpected
from lowdiff.recovery.stats import RecoveryStats
from lowdiff.state import capture as st
from lowdiff_lab.baselines.base import BaselineCheckpointer
from lowdiff_lab.baselines.gemini_copy import CopyWorker
from lowdiff_lab.baselines.gemini_link import HolderLink, stop_stale_holder
from lowdiff_lab.baselines.gemini_protocol import PREFIX, SUFFIX, GmPersisted, HolderConfig
from lowdiff_lab.baselines.gemini_resume import RingRecovery, Training
from lowdiff_lab.baselines.gemini_ring import PeerRing


@dataclass(frozen=True)
class GeminiOptions:
    """Gemini's own options (the others are every baseline's), checked on construction:
    a bad value is a ``TypeError`` or ``ValueError`` naming the option."""

    persist_every: int = 10
    """Write every this many in-memory checkpoints to disk (the steps that are multiples
    of ``full_every * persist_every``)."""
    idle_timeout: float = 300.0
    """Seconds a holder whose trainer died waits for a new trainer before it persists its
    newest checkpoint and exits."""

    def __post_init__(self) -> None:
        check_int("persist_every", self.persist_every, 1)
        idle = self.idle_timeout
        if not isinstance(idle, (int, float)) or isinstance(idle, bool):
            raise TypeError(
                f"idle_timeout must be a number of seconds, got {type(idle).__name__} {idle!r}"
            )
        if not idle >= 0:  # also rejects NaN
            raise ValueError(f"idle_timeout must be >= 0 seconds, got {idle!r}")
        object.__setattr__(self, "idle_timeout", float(idle))


def _layout_id(params: list[tuple[st.ParamInfo, torch.nn.Parameter]], extra: Any) -> str:
    """Names the model's layout: a holder keeps serving only trainers of the same one."""
    desc = [[i.name, list(i.shape), str(i.dtype)] for i, _ in params]
    return xxhash.xxh3_64_hexdigest(json.dumps([desc, extra], sort_keys=True).encode())


class GeminiCheckpointer(BaselineCheckpointer):
    """Gemini's in-memory checkpoints in a holder process (see the module docstring).

    Args:
        persist_every: write every this many in-memory checkpoints to disk (the steps
            that are multiples of ``full_every * persist_every``).
        idle_timeout: seconds a holder whose trainer died waits for a new trainer before
            it persists its newest checkpoint and exits.

    Other arguments as for :class:`~lowdiff_lab.baselines.base.BaselineCheckpointer`.

    Example:
        >>> ck = lowdiff.Checkpointer("ckpt", model, opt, method="gemini",  # doctest: +SKIP
        ...                           full_every=1, persist_every=10)
        >>> start = ck.resume()  # doctest: +SKIP
    """

    strategy = "gemini"

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        directory: str | os.PathLike[str] | None,
        *,
        compressor: Compressor | None = None,
        full_every: int = 30,
        scheduler: Any | None = None,
        keep_full: int | None = 2,
        start_timeout: float = 120.0,
        persist_every: int = 10,
        idle_timeout: float = 300.0,
    ) -> None:
        opts = GeminiOptions(persist_every, idle_timeout)
        self.persist_every, self.idle_timeout = opts.persist_every, opts.idle_timeout
        self._dist: DistContext | None = detect_dist(model)
        self._ring: PeerRing | None = None
        if self._dist is not None and directory is not None:
            if dist.get_world_size() != self._dist.world_size:
                raise ValueError(
                    "strategy 'gemini' under DDP needs the model on the default process group"
                )
            self.job_root = Path(directory)
            directory = rank_dir(self.job_root, self._dist.rank)
            self._ring = PeerRing(self._dist, float(start_timeout))
        super().__init__(
            model,
            optimizer,
            directory,
            compressor=compressor,
            full_every=full_every,
            scheduler=scheduler,
            keep_full=keep_full,
            start_timeout=start_timeout,
        )
        self._full_dir = self.root / layout.FULL_DIR
        layout_id = _layout_id(
            self._params,
            [
                st.class_path(optimizer),
                None if self._dist is None else [self._dist.rank, self._dist.world_size],
            ],
        )
        self._training = Training(model, optimizer, scheduler)
        self._holder = HolderLink(self.root, layout_id, self.start_timeout, self._on_durable)
        self._copy = CopyWorker(
            model,
            optimizer,
            scheduler,
            self._rng_layout,
            layout_id,
            self._holder,
            self._ring,
            self._stats,
        )
        self._persist_first = False
        self._stats.update(
            memory_bytes=0,
            copy_s=0.0,
            copy_wait_s=0.0,
            sync_copy_s=0.0,
            persists=0,
            peer_bytes=0,
            peer_s=0.0,
        )

    # ------------------------------------------------------------------ public additions
    @property
    def stats(self) -> dict[str, float]:
        """As for every baseline, plus ``memory_step`` (the newest complete in-memory
        checkpoint) and the copy, persist and peer counters."""
        out = super().stats
        out["memory_step"] = self._holder.memory_step
        return out

    @property
    def holder_pid(self) -> int:
        """Process id of the holder serving this trainer (-1 before ``resume()``)."""
        return self._holder.pid

    @property
    def memory_miss_reason(self) -> str:
        """Why the last ``resume()`` did not recover from memory (empty when it did)."""
        return self._holder.miss_reason

    def resume(self) -> int:
        if self._dist is None:
            return super().resume()
        if self._started:
            raise RuntimeError("resume() must be called once, before the first step()")
        return self._resume_dist()

    def _manifest_extra(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"persist_every": self.persist_every}
        if self._dist is not None:
            extra.update(rank=self._dist.rank, world_size=self._dist.world_size)
        return extra

    def _check_manifest(self, manifest: dict[str, Any]) -> None:
        super()._check_manifest(manifest)
        if self._dist is not None and (
            manifest.get("world_size") != self._dist.world_size
            or manifest.get("rank") != self._dist.rank
        ):
            raise CheckpointMismatchError(
                f"{self.root} belongs to rank {manifest.get('rank')} of {manifest.get('world_size')}; "
                f"this is rank {self._dist.rank} of {self._dist.world_size}"
            )

    # ------------------------------------------------------------------ recovery
    def _recover(self) -> int | None:
        t0 = time.perf_counter()
        live = self._holder.attach()
        if live is not None:
            try:
                step = live.step
                stats = RecoveryStats(full_step=step, step=step, source="memory")
                stats.read_s = time.perf_counter() - t0
                self._training.apply_live(live, stats)
            finally:
                live.close()
            self._holder.resume_at(step, self._holder.disk_step)
            stats.total_s = time.perf_counter() - t0
            self.recovery_stats = stats
            return step
        stop_stale_holder(self.root, self.start_timeout)
        remove_stale_temps(self._full_dir)
        found = self._recover_newest_file(self._full_dir, PREFIX, SUFFIX)
        if found is not None:
            self._holder.disk_step = found
        return found

    def _resume_dist(self) -> int:
        """Every rank ends at the newest step that every rank can recover (memory, the
        successor's copy, or disk), each from the first source that has it."""
        assert self._ring is not None
        t0 = time.perf_counter()
        remove_stale_temps(self.root)
        has_manifest = (self.root / layout.MANIFEST).exists()
        error = ""
        if has_manifest:
            try:
                self._check_manifest(layout.read_manifest(self.root))
            except LowDiffError as e:
                error = str(e)
        live = self._holder.attach() if has_manifest and not error else None
        if live is None:
            stop_stale_holder(self.root, self.start_timeout)
            remove_stale_temps(self._full_dir)
        rec = RingRecovery(self._ring, self._training, self.root, self._full_dir)
        try:
            peer = rec.held_copy(live)
            infos = rec.survey(live, peer, has_manifest, error)
            if not any(i["manifest"] for i in infos):
                self._start_fresh()
                return 0
            step, stats = rec.restore(infos, live, peer, t0)
        finally:
            if live is not None:
                live.close()
        self._holder.disk_step = rec.drop_newer(step)
        if self._holder.attached:
            self._holder.resume_at(step, self._holder.disk_step)
        if not has_manifest:
            self._write_manifest()
        stats.total_s = time.perf_counter() - t0
        self.recovery_stats = stats
        self._step = step
        self._started = True
        self._after_resume()
        return step

    def _after_resume(self) -> None:
        if not self._holder.attached:
            self._holder.spawn(
                HolderConfig.new(
                    self.root,
                    self._holder.layout_id,
                    full_every=self.full_every,
                    persist_every=self.persist_every,
                    keep_full=self.keep_full,
                    idle_timeout=self.idle_timeout,
                    persisted=self._holder.disk_step,
                    trainer_pid=os.getpid(),
                )
            )
        if self.recovery_stats is None:
            self._persist_first = True  # a fresh directory: the initial state goes to disk now
            return
        self._durable = self._holder.disk_step
        if self.recovery_stats.source != "memory" or self._dist is not None:
            # the recovered state becomes the newest in-memory checkpoint (and the peer's copy)
            self._checkpoint(self._step)
            self._copy.join()

    # ------------------------------------------------------------------ checkpoints
    def _before_update(self, t: int) -> None:
        self._copy.wait_local()

    def _checkpoint(self, step: int) -> None:
        self._copy.join()  # the previous copy, and under DDP its peer transfer
        self._holder.wait_acked()  # the holder took it over: the other buffers may be reused
        self._copy.start(step)
        if self._persist_first:
            self._persist_first = False
            self._flush()

    def _join_copy(self) -> None:
        """Wait until the copy in flight is over; raise its error."""
        self._copy.join()

    def _flush(self) -> None:
        if not self._holder.attached:
            return
        self._copy.join()
        self._holder.flush()

    def _on_durable(self, msg: Message) -> None:
        """The holder's messages about the disk."""
        match msg:
            case GmPersisted(step=step, nbytes=nbytes, seconds=seconds):
                self._durable = max(self._durable, step)
                self._stats["persists"] += 1
                self._stats["bytes_written"] += nbytes
                self._stats["write_s"] += seconds
            case Flushed(durable=durable) | Closed(durable=durable):
                self._durable = max(self._durable, durable)
            case _:
                raise unexpected(msg)

    def _poll(self) -> None:
        self._holder.poll()

    def _raise_background_error(self) -> None:
        self._copy.raise_error()
        self._holder.check()

    # ------------------------------------------------------------------ shutdown
    def _shutdown(self) -> None:
        self._copy.stop(self.start_timeout)
        self._holder.close()

    @property
    def _conn(self) -> Connection | None:
        """The connection to the holder (None when none is attached). Setting it to None
        drops the link without telling the holder, which is what the trainer's death does."""
        return self._holder.link.requests

    @_conn.setter
    def _conn(self, value: None) -> None:
        if value is not None:
            raise ValueError("the connection to the holder can only be dropped (set to None)")
        self._holder.forget()

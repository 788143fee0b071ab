"""``method="checkfreq"``: CheckFreq's two-phase checkpoint and its adaptive interval.

CheckFreq (Mohan, Phanishayee, Chidambaram, FAST'21) makes frequent checkpoints cheap by
splitting each one into two phases pipelined with training, and by choosing how often to
checkpoint from measured costs.

1. **Snapshot** (training process). When a checkpoint is due after update ``s``, the
   state after ``s`` updates is copied into a CPU buffer that is allocated once and reused
   (shared memory, so the persist process reads it without another copy; page-locked for
   a CUDA model, whose tensors are copied on a side stream). What a forward or backward
   pass may change (buffers such as BatchNorm statistics) and the RNG states are copied
   before ``step()`` returns. Parameters and optimizer state change only in the next
   optimizer update, so a background thread copies them while the next iteration's
   forward and backward run; ``step()`` waits for it just before that update (the wait
   counts as stall).
2. **Persist** (a background process, spawned once per session and fed through a pipe).
   As soon as the snapshot is complete it is handed over; the process writes it with
   ``torch.save`` straight from the shared buffer, publishes it atomically with its
   commit file, applies retention (``keep_full``) and acknowledges: the step is then
   durable. At most one
   checkpoint is in flight: a checkpoint that falls due while the previous persist is
   still running waits for it (stall).

**Interval.** ``full_every=k`` checkpoints every ``k`` steps. ``full_every="auto"`` follows
CheckFreq's policy: profile the iteration time over ``profile_steps`` iterations with no
checkpoint running, take one checkpoint and measure its cost (the extra time of the
iteration it overlaps, and the persist time), then use the smallest interval ``k`` with
``stall / (k * iteration) <= overhead_bound`` and ``k * iteration >= persist time`` (see
:func:`choose_interval`). The choice is logged (logger ``lowdiff_lab.baselines.checkfreq``)
and exposed as ``ck.interval`` and in ``ck.stats``.

Call sequence::

    ck = Checkpointer(DIR, model, opt, method="checkfreq", full_every="auto")
    start = ck.resume()   # (trainer) waits for a previous session's persist process,
                          # restores the newest checkpoint, spawns the persist process
    for step in range(start, total):
        ...; loss.backward()
        ck.step()         # (trainer) wait for the snapshot in flight -> update ->
                          # [snapshot phase 1, thread started] when a checkpoint is due
                          # (persist process) torch.save -> commit -> retention -> ack
        opt.zero_grad()
    ck.close()            # (trainer) wait for the last persist, stop the process

Files: ``DIR/full/ckpt-{step:012d}.pt`` and its ``.commit`` digest, exactly what
``method="torch-save"`` writes, so recovery is the same: the newest intact file. The
persist process holds ``DIR/.lowdiff.writer.lock``; when the trainer dies it still
writes a snapshot it was already handed, then exits, and a new session waits for it.

Parts: the snapshot (phase 1) is :class:`SnapshotStager`, here; the snapshot's layout is
:mod:`~lowdiff_lab.baselines.checkfreq_layout`; the persist process (phase 2) and its
messages are :mod:`~lowdiff_lab.baselines.checkfreq_persist`, the trainer's end of it
:mod:`~lowdiff_lab.baselines.checkfreq_link`; the interval is
:mod:`~lowdiff_lab.baselines.checkfreq_policy`.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from lowdiff.format import layout
from lowdiff.format.atomic import remove_stale_temps
from lowdiff.format.sfile import plan
from lowdiff.proc import holder as rp
from lowdiff.proc.locks import wait_for_writer
from lowdiff.proc.pinned import pin, unpin
from lowdiff_lab.baselines.base import BaselineCheckpointer
from lowdiff_lab.baselines.checkfreq_layout import Entry, Flattener
from lowdiff_lab.baselines.checkfreq_link import PersistLink
from lowdiff_lab.baselines.checkfreq_persist import CfPersist, CfStage
from lowdiff_lab.baselines.checkfreq_policy import (
    AUTO,
    CheckFreqOptions,
    IntervalPolicy,
    choose_interval,
)
from lowdiff_lab.baselines.torch_save import PREFIX, SUFFIX

__all__ = ["PREFIX", "SUFFIX", "CheckFreqCheckpointer", "choose_interval"]


# --------------------------------------------------------------------------- phase 1: the snapshot


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor], non_blocking: bool) -> None:
    """Copy ``srcs`` into ``dsts`` (one fused call; the GIL is released meanwhile)."""
    if dsts:
        with torch.no_grad():
            torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)


class _SnapshotJob:
    """Phase 1's background half: copies to finish, then the request to send."""

    def __init__(
        self,
        msg: CfPersist,
        t0: float,
        dsts: list[torch.Tensor],
        srcs: list[torch.Tensor],
        events: list[Any],
    ) -> None:
        self.msg, self.t0, self.dsts, self.srcs, self.events = msg, t0, dsts, srcs, events
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.took = 0.0


def _snapshot_loop(
    jobs: queue.SimpleQueue[_SnapshotJob | None], req: Connection, send_lock: threading.Lock
) -> None:
    """The snapshot thread: for each job, finish the copies, then hand the snapshot to the
    persist process. It shares nothing with the training thread but the job (read once
    ``done`` is set) and the request pipe (under its lock); holding no reference to the
    checkpointer lets a dropped one be collected."""
    while (job := jobs.get()) is not None:
        try:
            _copy_all(job.dsts, job.srcs, non_blocking=False)
            for ev in job.events:
                ev.synchronize()
            job.took = time.perf_counter() - job.t0
            with send_lock:
                req.send(job.msg)
        except BaseException as e:  # noqa: BLE001 -- raised in the training thread
            job.error = e
        finally:
            job.done.set()


class SnapshotStager:
    """Phase 1: the shared snapshot buffer, its layout, and the copies into it.

    What the next forward pass may change is copied before :meth:`snapshot` returns; the
    rest (parameters, optimizer state) by the snapshot thread (CUDA: on a side stream),
    which then sends the snapshot to the persist process. :meth:`join` waits for that.

    Args:
        params: the parameters the optimizer updates, which may be copied after
            ``step()`` returns (only the next update changes them).
        persist: the persist process, which gets the buffer and the snapshots.
        stats: the checkpointer's ``stats``; ``snapshot_s`` is kept here.
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        persist: PersistLink,
        stats: dict[str, float],
    ) -> None:
        self._params = params
        self._cuda = any(p.is_cuda for p in params)
        self._persist, self._stats = persist, stats
        # the shared buffer and its layout
        self._blob: torch.Tensor | None = None
        self._gen = 0
        self._pinned = False
        self._sig: tuple[Any, ...] | None = None
        self._views: list[torch.Tensor] = []
        self._entries: list[Entry] = []
        self._streams: dict[torch.device, Any] = {}
        # the snapshot thread, started once, and the job in flight
        self._thread: threading.Thread | None = None
        self._jobs: queue.SimpleQueue[_SnapshotJob | None] = queue.SimpleQueue()
        self._job: _SnapshotJob | None = None
        self._snap_sum = self._snap_n = 0.0

    def snapshot(self, step: int, state: dict[str, Any], t0: float) -> None:
        """Start the snapshot of ``state`` (taken after ``step`` updates; timed from ``t0``)."""
        fl = Flattener({p.data_ptr() for p in self._params})
        skeleton = fl.flatten(state)
        views = self._prepare(fl.leaves)
        now_dst, now_src, cpu_dst, cpu_src = [], [], [], []
        dev: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor], list[bool]]] = {}
        for t, v, deferrable in zip(fl.leaves, views, fl.deferrable, strict=True):
            if t.is_cuda:
                d = dev.setdefault(t.device, ([], [], []))
                d[0].append(v)
                d[1].append(t)
                d[2].append(deferrable)
            elif deferrable:
                cpu_dst.append(v)
                cpu_src.append(t)
            else:
                now_dst.append(v)
                now_src.append(t)
        _copy_all(now_dst, now_src, non_blocking=False)
        events = [self._launch_device_copies(device, *d) for device, d in dev.items()]
        self._start_thread()
        msg = CfPersist(self._gen, step, self._entries, skeleton)
        self._job = _SnapshotJob(msg, t0, cpu_dst, cpu_src, events)
        self._jobs.put(self._job)

    def _start_thread(self) -> None:
        if self._thread is None:
            req = self._persist.link.requests
            assert req is not None, "the persist process is not started"
            self._thread = threading.Thread(
                target=_snapshot_loop,
                args=(self._jobs, req, self._persist.send_lock),
                name="lowdiff-checkfreq-snapshot",
                daemon=True,
            )
            self._thread.start()

    def _prepare(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """Views of the snapshot buffer for ``leaves``; a larger buffer when they outgrow it."""
        sig = tuple((t.dtype, tuple(t.shape)) for t in leaves)
        if sig == self._sig:
            return self._views
        entries, size = plan((str(i), t.dtype, tuple(t.shape)) for i, t in enumerate(leaves))
        if self._blob is None or self._blob.numel() < size:
            self._stage(size + size // 8)  # slack: optimizer state may still appear
        blob = self._blob
        assert blob is not None
        by_index = {int(e.name): e for e in entries}
        self._entries = [
            (e.start, e.end, e.dtype, tuple(e.shape)) for _, e in sorted(by_index.items())
        ]
        self._views = [blob[a:b].view(dt).view(shape) for a, b, dt, shape in self._entries]
        self._sig = sig
        return self._views

    def _stage(self, size: int) -> None:
        """Allocate the shared snapshot buffer and hand it to the persist process."""
        self.drop_blob()
        rp.ensure_shm_space(size, "the checkfreq snapshot buffer")
        self._blob = torch.empty(max(size, 1), dtype=torch.uint8).share_memory_()
        if self._cuda:
            self._pinned = pin(self._blob)  # page-locked: asynchronous device copies
        self._gen += 1
        self._persist.send(CfStage(self._gen, self._blob))

    def _launch_device_copies(
        self,
        device: torch.device,
        dsts: list[torch.Tensor],
        srcs: list[torch.Tensor],
        deferrable: list[bool],
    ) -> Any:
        """Device-to-host copies on a side stream; returns the event that ends them.

        The side stream first waits for the update that produced the state. The training
        stream waits for the copies of what its next forward pass may change (buffers);
        the rest overlaps it, and the snapshot thread waits for the returned event.
        """
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        current = torch.cuda.current_stream(device)
        stream.wait_stream(current)
        now = [(d, s) for d, s, f in zip(dsts, srcs, deferrable, strict=True) if not f]
        later = [(d, s) for d, s, f in zip(dsts, srcs, deferrable, strict=True) if f]
        with torch.cuda.stream(stream):
            _copy_all([d for d, _ in now], [s for _, s in now], non_blocking=True)
            if now:
                current.wait_stream(stream)
            _copy_all([d for d, _ in later], [s for _, s in later], non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def join(self) -> BaseException | None:
        """Wait until the snapshot in flight is complete and handed over; returns the
        snapshot thread's error, if it failed."""
        job, self._job = self._job, None
        if job is None:
            return None
        job.done.wait()
        if job.error is not None:
            return job.error
        self._snap_sum += job.took
        self._snap_n += 1
        self._stats["snapshot_s"] = self._snap_sum / self._snap_n
        return None

    def stop(self, timeout: float) -> None:
        """Stop the snapshot thread (waits ``timeout`` for a job it is finishing)."""
        th, self._thread, self._job = self._thread, None, None
        if th is not None:
            self._jobs.put(None)
            th.join(timeout)

    def drop_blob(self) -> None:
        """Let go of the snapshot buffer (unpinned first)."""
        if self._pinned and self._blob is not None:
            unpin(self._blob)
        self._pinned = False
        self._blob = None
        self._sig = None
        self._views = []


# --------------------------------------------------------------------------- the strategy


class CheckFreqCheckpointer(BaselineCheckpointer):
    """CheckFreq: pipelined snapshot + background persist, adaptive interval.

    See the module docstring for the design.

    Args:
        full_every: a checkpoint every this many steps, or ``"auto"`` for CheckFreq's
            profiled interval.
        overhead_bound: with ``"auto"``, the accepted checkpointing overhead as a fraction
            of the iteration time (default 3.5 %).
        profile_steps: with ``"auto"``, iterations timed before the measuring checkpoint.
        common: the options every baseline takes (``compressor``, ``scheduler``,
            ``keep_full``, ``start_timeout``), as for
            :class:`lowdiff_lab.baselines.BaselineCheckpointer`.

    ``stats`` adds: ``interval`` (0 while ``"auto"`` measures), ``snapshot_s`` (mean time
    from a snapshot's first copy to its last), ``persist_s`` (mean persist time),
    ``iter_s`` (iteration time without checkpointing: the profiled median with
    ``"auto"``, else a running mean; 0 if never seen), ``snapshot_stall_s`` (the cost of
    the measuring checkpoint that ``"auto"`` chose with), ``snapshot_wait_s`` (updates
    waiting for their snapshot) and ``persist_wait_s`` (checkpoints waiting for the
    previous persist).

    Example:
        >>> ck = lowdiff.Checkpointer("runs/cf", model, opt, method="checkfreq",
        ...                           full_every="auto")  # doctest: +SKIP
        >>> start = ck.resume()  # doctest: +SKIP
    """

    strategy = "checkfreq"

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        directory: str | os.PathLike[str] | None,
        *,
        full_every: int | str = 30,
        overhead_bound: float = 0.035,
        profile_steps: int = 5,
        **common: Any,
    ) -> None:
        options = CheckFreqOptions(full_every, overhead_bound, profile_steps)
        self.overhead_bound, self.profile_steps = options.overhead_bound, options.profile_steps
        # read by the full_every property, which the base class sets and reads
        self._policy = IntervalPolicy(options, where=directory)
        super().__init__(
            model,
            optimizer,
            directory,
            full_every=1 if options.auto else full_every,  # type: ignore[arg-type]
            **common,
        )
        self._stats.update(
            interval=self._policy.interval or 0,
            snapshot_s=0.0,
            persist_s=0.0,
            iter_s=0.0,
            snapshot_stall_s=0.0,
            snapshot_wait_s=0.0,
            persist_wait_s=0.0,
        )
        self._persist = PersistLink(self.start_timeout, self._policy, self._stats)
        self._stager = SnapshotStager([p for _, p in self._params], self._persist, self._stats)

    # ------------------------------------------------------------------ interval
    @property  # type: ignore[override]
    def full_every(self) -> int:
        """The interval as the base class's step loop reads it (``step % full_every == 0``).

        With ``"auto"``, until the interval is chosen, only the measuring checkpoint is due.
        """
        return self._policy.full_every(self._step)

    @full_every.setter
    def full_every(self, value: int) -> None:
        self._policy.fix(value)

    @property
    def interval(self) -> int | None:
        """Steps between checkpoints; None while ``"auto"`` is still measuring."""
        return self._policy.interval

    @property
    def stats(self) -> dict[str, float]:
        """As :attr:`BaselineCheckpointer.stats`, with the entries listed in the class docstring."""
        self._stats.update(self._policy.report())
        return super().stats

    def _manifest_extra(self) -> dict[str, Any]:
        return {
            "full_every": AUTO if self._policy.auto else self._policy.interval,
            "overhead_bound": self.overhead_bound,
            "profile_steps": self.profile_steps,
        }

    def __repr__(self) -> str:
        every = AUTO if self._policy.auto else self._policy.interval
        return (
            f"{type(self).__name__}(strategy={self.strategy!r}, directory={str(self.root)!r}, "
            f"full_every={every!r}, interval={self._policy.interval}, step={self._step})"
        )

    # ------------------------------------------------------------------ hooks
    def resume(self) -> int:
        """As :meth:`BaselineCheckpointer.resume`, once a previous session's persist
        process (still writing the snapshot its killed trainer handed it) is done."""
        if not self._started:
            wait_for_writer(self.root, self.start_timeout, "a persist process")
            remove_stale_temps(self.root / layout.FULL_DIR)
        return super().resume()

    def _recover(self) -> int | None:
        return self._recover_newest_file(self.root / layout.FULL_DIR, PREFIX, SUFFIX)

    def _after_resume(self) -> None:
        (self.root / layout.FULL_DIR).mkdir(exist_ok=True)
        self._persist.start(self.root, self.keep_full)

    def _before_update(self, t: int) -> None:
        t0 = time.perf_counter()
        self._join_snapshot()
        now = time.perf_counter()
        self._stats["snapshot_wait_s"] += now - t0
        self._policy.stalled(now - t0)
        self._poll()
        self._policy.observe(now, busy=self._persist.inflight is not None)

    def _checkpoint(self, step: int) -> None:
        t0 = time.perf_counter()
        self._join_snapshot()  # only after a checkpoint with no update since (step 0)
        self._persist.wait_persisted()  # one checkpoint in flight at most
        t1 = time.perf_counter()
        self._stats["persist_wait_s"] += t1 - t0
        self._stager.snapshot(step, self._capture(step), t1)
        self._persist.inflight = step
        self._policy.checkpoint_taken(step, time.perf_counter() - t0)

    def _join_snapshot(self) -> None:
        error = self._stager.join()
        if error is not None:
            self._persist.inflight = None
            if isinstance(error, OSError):  # a broken pipe: say why the process is gone
                self._persist.link.check(force=True)
            raise error

    def _flush(self) -> None:
        self._join_snapshot()
        self._persist.wait_persisted()

    def _poll(self) -> None:
        self._persist.link.poll()
        self._durable = max(self._durable, self._persist.durable)

    def _raise_background_error(self) -> None:
        self._poll()
        self._persist.link.check()

    def _shutdown(self) -> None:
        self._stager.stop(self.start_timeout)
        self._persist.stop(self.start_timeout)
        self._stager.drop_blob()

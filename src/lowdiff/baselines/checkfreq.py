"""``strategy="checkfreq"``: CheckFreq's two-phase checkpoint and its adaptive interval.

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
:func:`choose_interval`). The choice is logged (logger ``lowdiff.baselines.checkfreq``)
and exposed as ``ck.interval`` and in ``ck.stats``.

Call sequence::

    ck = Checkpointer(model, opt, DIR, strategy="checkfreq", full_every="auto")
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
``strategy="torch-save"`` writes, so recovery is the same: the newest intact file. The
persist process holds ``DIR/.lowdiff.writer.lock``; when the trainer dies it still
writes a snapshot it was already handed, then exits, and a new session waits for it.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import logging
import math
import os
import queue
import statistics
import threading
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from lowdiff.baselines.base import BaselineCheckpointer, commit_path, published, save_state
from lowdiff.baselines.torch_save import PREFIX, SUFFIX
from lowdiff.compressors.base import Compressor
from lowdiff.engine import replica as rp
from lowdiff.engine.spawn import exit_message, spawn_context
from lowdiff.engine.worker import (
    acquire_flock,
    detach_from_trainer_group,
    drain,
    serve,
    wait_for_writer,
)
from lowdiff.errors import CheckpointWorkerError
from lowdiff.format import layout
from lowdiff.format.atomic import _hook, remove_stale_temps
from lowdiff.format.sfile import plan

log = logging.getLogger("lowdiff.baselines.checkfreq")

AUTO = "auto"


# --------------------------------------------------------------------------- the policy


def choose_interval(iter_s: float, snapshot_stall_s: float, persist_s: float, bound: float) -> int:
    """CheckFreq's checkpoint interval: the smallest ``k`` that meets both constraints.

    - overhead: ``snapshot_stall_s / (k * iter_s) <= bound`` (the training time lost to
      one checkpoint, spread over the ``k`` iterations it covers);
    - one checkpoint in flight: ``k * iter_s >= persist_s`` (a checkpoint never waits for
      the previous one to be persisted).

    Args:
        iter_s: iteration time without checkpointing (seconds, > 0).
        snapshot_stall_s: training time lost per checkpoint (seconds, >= 0).
        persist_s: time to persist one checkpoint (seconds, >= 0).
        bound: the accepted overhead, as a fraction of training time (0 < bound < 1).

    Returns:
        The interval in iterations (>= 1).

    Example:
        >>> choose_interval(0.1, 0.02, 0.35, 0.05)  # overhead needs 4, persist needs 4
        4
        >>> choose_interval(0.1, 0.0, 0.0, 0.05)
        1
    """
    for name, value in (
        ("iter_s", iter_s),
        ("snapshot_stall_s", snapshot_stall_s),
        ("persist_s", persist_s),
    ):
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if iter_s <= 0:
        raise ValueError(f"iter_s must be > 0, got {iter_s!r}")
    _check_bound(bound, "bound")
    # a relative slack so that an exact quotient (0.3 / 0.1 = 3.0000000000000004) is not
    # rounded up by floating-point error
    eps = 1e-9
    k_overhead = math.ceil(snapshot_stall_s / (bound * iter_s) * (1 - eps))
    k_persist = math.ceil(persist_s / iter_s * (1 - eps))
    return max(1, k_overhead, k_persist)


def _check_bound(bound: Any, name: str = "overhead_bound") -> float:
    if not isinstance(bound, (int, float)) or isinstance(bound, bool):
        raise TypeError(f"{name} must be a number, got {type(bound).__name__} {bound!r}")
    if not 0 < bound < 1:  # also rejects NaN
        raise ValueError(f"{name} must be in (0, 1), got {bound!r}")
    return float(bound)


# --------------------------------------------------------------------------- state layout


@dataclass(frozen=True)
class _Leaf:
    """Stands for tensor ``index`` of a snapshot in the state's skeleton."""

    index: int


class _Flattener:
    """Splits a state into its tensors and a skeleton (the rest, deep-copied).

    A tensor is *deferrable* when only the optimizer update changes it (parameters and
    optimizer state): the snapshot thread may copy it during the next forward/backward.
    Everything else (buffers, RNG states, tensors among hyperparameters) is copied
    before ``step()`` returns.

    A tensor that appears under several keys (tied weights: one parameter in two
    modules) is one leaf, so that it is copied and written once, as ``torch.save`` of
    the live state would (it stores a shared storage once).
    """

    def __init__(self, param_ptrs: set[int]) -> None:
        self.param_ptrs = param_ptrs
        self.leaves: list[torch.Tensor] = []
        self.deferrable: list[bool] = []
        self._seen: dict[tuple[Any, ...], int] = {}

    @staticmethod
    def _identity(t: torch.Tensor) -> tuple[Any, ...] | None:
        """Same identity: the same view of the same memory (None for an empty tensor)."""
        if t.numel() == 0:
            return None
        return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())

    def walk(self, obj: Any, deferrable: bool = False) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            if t.is_sparse or t.layout != torch.strided:
                raise TypeError(f"checkfreq checkpoints dense tensors only, got {t.layout}")
            defer = deferrable or (t.numel() > 0 and t.data_ptr() in self.param_ptrs)
            key = self._identity(t)
            if key is not None and key in self._seen:
                i = self._seen[key]
                # copied before step() returns if any of its uses needs that
                self.deferrable[i] = self.deferrable[i] and defer
                return _Leaf(i)
            self.leaves.append(t)
            self.deferrable.append(defer)
            if key is not None:
                self._seen[key] = len(self.leaves) - 1
            return _Leaf(len(self.leaves) - 1)
        if isinstance(obj, dict):
            out: dict[Any, Any] = OrderedDict() if isinstance(obj, OrderedDict) else {}
            for k, v in obj.items():
                out[k] = self.walk(v, deferrable)
            meta = getattr(obj, "_metadata", None)  # module versions of a state_dict
            if meta is not None:
                out._metadata = copy.deepcopy(meta)  # type: ignore[attr-defined]
            return out
        if type(obj) in (list, tuple):
            return type(obj)(self.walk(v, deferrable) for v in obj)
        return copy.deepcopy(obj)

    def flatten(self, state: dict[str, Any]) -> dict[str, Any]:
        skeleton = {}
        for key, value in state.items():
            if key == "optimizer":
                skeleton[key] = {
                    k: self.walk(v, deferrable=(k == "state")) for k, v in value.items()
                }
            else:
                skeleton[key] = self.walk(value)
        return skeleton


def _rebuild(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """Inverse of :meth:`_Flattener.flatten`, with ``tensors`` in the leaves' order."""
    if isinstance(obj, _Leaf):
        return tensors[obj.index]
    if isinstance(obj, dict):
        out: dict[Any, Any] = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for k, v in obj.items():
            out[k] = _rebuild(v, tensors)
        meta = getattr(obj, "_metadata", None)
        if meta is not None:
            out._metadata = meta  # type: ignore[attr-defined]
        return out
    if type(obj) in (list, tuple):
        return type(obj)(_rebuild(v, tensors) for v in obj)
    return obj


Entry = tuple[int, int, torch.dtype, tuple[int, ...]]
"""Where a tensor lies in the snapshot buffer: (start byte, end byte, dtype, shape)."""


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor], non_blocking: bool) -> None:
    """Copy ``srcs`` into ``dsts`` (one fused call; the GIL is released meanwhile)."""
    if dsts:
        with torch.no_grad():
            torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)


class _SnapshotJob:
    """Phase 1's background half: copies to finish, then the request to send."""

    def __init__(
        self,
        msg: tuple[Any, ...],
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


# --------------------------------------------------------------------------- persist process


@dataclass(frozen=True)
class PersistConfig:
    root: str
    keep_full: int | None


def retain_files(directory: Path, keep: int | None) -> int:
    """Delete checkpoints beyond the newest ``keep`` (commit file first); returns how many."""
    if keep is None:
        return 0
    files = published(directory, PREFIX, SUFFIX)
    doomed = files[: max(0, len(files) - keep)]
    for _, p in doomed:
        for q in (commit_path(p), p):  # without its commit file a checkpoint is never read
            with contextlib.suppress(FileNotFoundError):
                q.unlink()
        _hook("retention", p)
    return len(doomed)


class _Persister:
    """The persist process's state: the snapshot buffer it was handed, and the writes."""

    def __init__(self, cfg: PersistConfig, results: Connection) -> None:
        self.dir = Path(cfg.root) / layout.FULL_DIR
        self.keep_full = cfg.keep_full
        self.results = results
        self.gen = -1
        self.blob: torch.Tensor | None = None
        self.buf: Any = None

    def send(self, msg: tuple[Any, ...]) -> None:
        with contextlib.suppress(OSError):  # the trainer may be gone; the files still count
            self.results.send(msg)

    def tensors(self, entries: list[Entry]) -> list[torch.Tensor]:
        """Tensors over the shared buffer, each with a storage of its own (no copy), so
        that ``torch.save`` writes exactly the bytes that ``strategy="torch-save"`` does."""
        out = []
        for start, end, dtype, shape in entries:
            numel = math.prod(shape)
            if numel == 0:
                out.append(torch.empty(shape, dtype=dtype))
            else:
                assert end - start == numel * torch.empty((), dtype=dtype).element_size()
                t = torch.frombuffer(self.buf, dtype=dtype, count=numel, offset=start)
                out.append(t.view(shape))
        return out

    def handle(self, msg: tuple[Any, ...]) -> bool:
        """Handle one request; returns False when the process should stop."""
        kind = msg[0]
        if kind == "stage":
            _, self.gen, blob = msg
            self.blob = blob
            self.buf = (ctypes.c_char * blob.numel()).from_address(blob.data_ptr())
        elif kind == "persist":
            _, gen, step, entries, skeleton = msg
            if gen != self.gen:
                raise RuntimeError(
                    f"snapshot of step {step} refers to buffer {gen}, the process holds {self.gen}"
                )
            t0 = time.perf_counter()
            state = _rebuild(skeleton, self.tensors(entries))
            nbytes = save_state(self.dir / f"{PREFIX}{step:012d}{SUFFIX}", state, step=step)
            removed = retain_files(self.dir, self.keep_full)
            self.send(("done", step, nbytes, time.perf_counter() - t0, removed))
        elif kind == "close":
            self.send(("closed",))
            return False
        else:
            raise RuntimeError(f"unknown request {kind!r}")
        return True

    def handle_orphaned(self, msg: tuple[Any, ...]) -> bool:
        """:meth:`handle` after the trainer died: write what can still be written."""
        with contextlib.suppress(Exception):  # nobody is left to report an error to
            return self.handle(msg)
        return True


def persist_main(cfg: PersistConfig, requests: Connection, results: Connection) -> None:
    """Entry point of the persist process (it ends the process when done)."""
    detach_from_trainer_group()
    torch.set_num_threads(1)  # leave the cores to training
    p = _Persister(cfg, results)
    lock_fd = None
    parent = os.getppid()
    code = 0
    try:
        lock_fd = acquire_flock(Path(cfg.root) / layout.WRITER_LOCK_FILE, blocking=True)
        p.send(("ready", os.getpid()))
        if serve(requests, p.handle, parent):
            # The trainer died without close(): a snapshot it handed over is complete
            # (it is sent only once copied), so it is still written.
            drain(requests, p.handle_orphaned, ("stage", "persist"))
    except BaseException as e:  # noqa: BLE001 -- sent back and raised in the trainer
        p.send(("error", type(e).__name__, str(e), traceback.format_exc()))
        code = 1
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
    # Every file is fsynced and every answer sent: skip the interpreter's teardown (with
    # torch loaded it takes longer than a small checkpoint), which close() would wait for.
    os._exit(code)


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
        Others: as for :class:`lowdiff.baselines.BaselineCheckpointer`.

    ``stats`` adds: ``interval`` (0 while ``"auto"`` measures), ``snapshot_s`` (mean time
    from a snapshot's first copy to its last), ``persist_s`` (mean persist time),
    ``iter_s`` (iteration time without checkpointing: the profiled median with
    ``"auto"``, else a running mean; 0 if never seen), ``snapshot_stall_s`` (the cost of
    the measuring checkpoint that ``"auto"`` chose with), ``snapshot_wait_s`` (updates
    waiting for their snapshot) and ``persist_wait_s`` (checkpoints waiting for the
    previous persist).

    Example:
        >>> ck = lowdiff.Checkpointer(model, opt, "runs/cf", strategy="checkfreq",
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
        compressor: Compressor | None = None,
        full_every: int | str = 30,
        scheduler: Any | None = None,
        keep_full: int | None = 2,
        start_timeout: float = 120.0,
        overhead_bound: float = 0.035,
        profile_steps: int = 5,
    ) -> None:
        from lowdiff.strategy import check_int as _check_int

        if isinstance(full_every, str) and full_every != AUTO:
            raise ValueError(f"full_every must be an int >= 1 or {AUTO!r}, got {full_every!r}")
        self._auto = full_every == AUTO
        self.overhead_bound = _check_bound(overhead_bound)
        self.profile_steps = _check_int("profile_steps", profile_steps, 1)
        # read by the full_every property, which the base class sets and reads
        self._interval: int | None = None
        self._probe_due = False
        self._init_state()
        super().__init__(
            model,
            optimizer,
            directory,
            compressor=compressor,
            full_every=1 if self._auto else full_every,  # type: ignore[arg-type]
            scheduler=scheduler,
            keep_full=keep_full,
            start_timeout=start_timeout,
        )
        self._stats.update(
            interval=self._interval or 0,
            snapshot_s=0.0,
            persist_s=0.0,
            iter_s=0.0,
            snapshot_stall_s=0.0,
            snapshot_wait_s=0.0,
            persist_wait_s=0.0,
        )

    def _init_state(self) -> None:
        # persist process and pipes
        self._proc: Any = None
        self._ready = False  # the persist process reported ready
        self._req: Connection | None = None
        self._res: Connection | None = None
        self._send_lock = threading.Lock()
        self._error: CheckpointWorkerError | None = None
        # snapshot buffer (shared memory) and its layout
        self._blob: torch.Tensor | None = None
        self._gen = 0
        self._pinned = False
        self._sig: tuple[Any, ...] | None = None
        self._views: list[torch.Tensor] = []
        self._entries: list[Entry] = []
        self._streams: dict[torch.device, Any] = {}
        # the checkpoint in flight
        self._thread: threading.Thread | None = None  # the snapshot thread, started once
        self._jobs: queue.SimpleQueue[_SnapshotJob | None] = queue.SimpleQueue()
        self._job: _SnapshotJob | None = None
        self._inflight: int | None = None
        self._snap_sum = self._snap_n = 0.0
        self._persist_sum = self._persist_n = 0.0
        # iteration timing: an iteration runs from one _before_update to the next
        self._mark: float | None = None
        self._mark_ckpt: int | None = None
        self._mark_busy = False
        self._ckpt_stall = 0.0
        self._clean_sum = self._clean_n = 0.0
        self._profile: list[float] = []
        self._iter_s = 0.0
        self._probe_step: int | None = None
        self._probe_cost: float | None = None
        self._probe_persist: float | None = None

    # ------------------------------------------------------------------ interval
    @property  # type: ignore[override]
    def full_every(self) -> int:
        """The interval as the base class's step loop reads it (``step % full_every == 0``).

        With ``"auto"``, until the interval is chosen, only the measuring checkpoint is due.
        """
        if self._interval is not None:
            return self._interval
        s = self._step
        return s if self._probe_due and s > 0 else s + 1

    @full_every.setter
    def full_every(self, value: int) -> None:
        if not self._auto:
            self._interval = value

    @property
    def interval(self) -> int | None:
        """Steps between checkpoints; None while ``"auto"`` is still measuring."""
        return self._interval

    def _manifest_extra(self) -> dict[str, Any]:
        return {
            "full_every": AUTO if self._auto else self._interval,
            "overhead_bound": self.overhead_bound,
            "profile_steps": self.profile_steps,
        }

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(strategy={self.strategy!r}, directory={str(self.root)!r}, "
            f"full_every={AUTO if self._auto else self._interval!r}, interval={self._interval}, "
            f"step={self._step})"
        )

    def _observe_iteration(self, now: float) -> None:
        """Time the iteration that ends now, and take the next policy step for ``"auto"``."""
        if self._mark is not None:
            d = now - self._mark
            if self._mark_ckpt is not None:
                if self._mark_ckpt == self._probe_step and self._probe_cost is None:
                    # what the checkpoint cost this iteration: the stall, plus the slowdown
                    # of the forward/backward the snapshot ran beside
                    self._probe_cost = max(self._ckpt_stall, d - self._iter_s)
                    self._stats["snapshot_stall_s"] = self._probe_cost
            elif not self._mark_busy and self._inflight is None:
                self._clean_sum += d
                self._clean_n += 1
                if self._auto and self._interval is None and self._probe_step is None:
                    self._profile.append(d)
                else:
                    self._stats["iter_s"] = self._iter_s or self._clean_sum / self._clean_n
        self._mark, self._mark_ckpt, self._mark_busy = now, None, self._inflight is not None
        if not self._auto or self._interval is not None:
            return
        if self._probe_step is None:
            if len(self._profile) >= self.profile_steps:
                self._iter_s = statistics.median(self._profile)
                self._stats["iter_s"] = self._iter_s
                self._probe_due = True  # the base loop checkpoints after this update
            return
        if self._probe_cost is not None and self._probe_persist is not None:
            k = choose_interval(
                self._iter_s, self._probe_cost, self._probe_persist, self.overhead_bound
            )
            self._interval = k
            self._stats["interval"] = k
            log.info(
                "checkfreq: checkpoint every %d steps (iteration %.4f s, stall per checkpoint "
                "%.4f s, persist %.4f s, overhead bound %.1f %%) in %s",
                k,
                self._iter_s,
                self._probe_cost,
                self._probe_persist,
                100 * self.overhead_bound,
                self.root,
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
        ctx = spawn_context()
        req_r, req_w = ctx.Pipe(duplex=False)
        res_r, res_w = ctx.Pipe(duplex=False)
        self._ready = False
        self._proc = ctx.Process(
            target=persist_main,
            args=(PersistConfig(str(self.root), self.keep_full), req_r, res_w),
            name="lowdiff-checkfreq-persist",
            daemon=False,  # it finishes a persist in flight even when the trainer dies
        )
        self._proc.start()
        req_r.close()
        res_w.close()
        self._req, self._res = req_w, res_r
        deadline = time.monotonic() + self.start_timeout
        while not (self._res.poll(0.1) and self._handle(self._recv()) == "ready"):
            self._raise_background_error()
            if time.monotonic() > deadline:
                raise CheckpointWorkerError(
                    f"the persist process did not start within {self.start_timeout:.0f} s"
                )
        self._ready = True

    def _before_update(self, t: int) -> None:
        t0 = time.perf_counter()
        self._join_snapshot()
        now = time.perf_counter()
        self._stats["snapshot_wait_s"] += now - t0
        self._ckpt_stall += now - t0
        self._poll()
        self._observe_iteration(now)

    def _checkpoint(self, step: int) -> None:
        t0 = time.perf_counter()
        self._join_snapshot()  # only after a checkpoint with no update since (step 0)
        self._wait_persisted()  # one checkpoint in flight at most
        t1 = time.perf_counter()
        self._stats["persist_wait_s"] += t1 - t0
        fl = _Flattener({p.data_ptr() for _, p in self._params})
        skeleton = fl.flatten(self._capture(step))
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
        if self._thread is None:
            self._thread = threading.Thread(
                target=_snapshot_loop,
                args=(self._jobs, self._req, self._send_lock),
                name="lowdiff-checkfreq-snapshot",
                daemon=True,
            )
            self._thread.start()
        msg = ("persist", self._gen, step, self._entries, skeleton)
        self._job = _SnapshotJob(msg, t1, cpu_dst, cpu_src, events)
        self._jobs.put(self._job)
        self._inflight = step
        if self._probe_due:
            self._probe_due, self._probe_step = False, step
        self._mark_ckpt = step
        self._ckpt_stall = time.perf_counter() - t0

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
        self._drop_blob()
        rp.ensure_shm_space(size, "the checkfreq snapshot buffer")
        self._blob = torch.empty(max(size, 1), dtype=torch.uint8).share_memory_()
        if any(p.is_cuda for _, p in self._params):
            from lowdiff.engine.checkpointer import _pin

            self._pinned = _pin(self._blob)  # page-locked: asynchronous device copies
        self._gen += 1
        self._send(("stage", self._gen, self._blob))

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

    def _join_snapshot(self) -> None:
        job, self._job = self._job, None
        if job is None:
            return
        job.done.wait()
        if job.error is not None:
            self._inflight = None
            if isinstance(job.error, OSError):  # a broken pipe: say why the process is gone
                self._raise_background_error(lost=True)
            raise job.error
        self._snap_sum += job.took
        self._snap_n += 1
        self._stats["snapshot_s"] = self._snap_sum / self._snap_n

    def _wait_persisted(self) -> None:
        while self._inflight is not None:
            self._raise_background_error()
            assert self._res is not None
            try:
                if self._res.poll(0.05):
                    self._handle(self._res.recv())
            except (EOFError, OSError):
                time.sleep(0.05)  # the process is gone: is_alive() says so shortly

    def _flush(self) -> None:
        self._join_snapshot()
        self._wait_persisted()

    # ------------------------------------------------------------------ the pipes
    def _send(self, msg: tuple[Any, ...]) -> None:
        assert self._req is not None
        try:
            with self._send_lock:
                self._req.send(msg)
        except OSError:  # a broken pipe: the process is gone
            self._raise_background_error(lost=True)
            raise

    def _recv(self) -> tuple[Any, ...]:
        assert self._res is not None
        try:
            msg: tuple[Any, ...] = self._res.recv()
        except (EOFError, OSError):
            self._raise_background_error(lost=True)
            raise
        return msg

    def _poll(self) -> None:
        if self._res is None:
            return
        try:
            while self._res.poll():
                self._handle(self._res.recv())
        except (EOFError, OSError):
            pass  # the process is gone; _raise_background_error says why

    def _handle(self, msg: tuple[Any, ...]) -> str:
        kind = str(msg[0])
        if kind == "done":
            _, step, nbytes, took, _removed = msg
            self._durable = max(self._durable, step)
            if step == self._inflight:
                self._inflight = None
            if step == self._probe_step:
                self._probe_persist = took
            self._persist_sum += took
            self._persist_n += 1
            self._stats["persist_s"] = self._persist_sum / self._persist_n
            self._stats["write_s"] += took
            self._stats["bytes_written"] += nbytes
        elif kind == "error" and self._error is None:
            from lowdiff.strategy import STORAGE_ERRORS as _STORAGE_ERRORS

            _, name, text, tb = msg
            self._error = CheckpointWorkerError(
                f"the checkfreq persist process failed: {name}: {text}", tb, name in _STORAGE_ERRORS
            )
        return kind

    def _raise_background_error(self, lost: bool = False) -> None:
        self._poll()
        proc = self._proc
        if self._error is None and proc is not None and (lost or not proc.is_alive()):
            proc.join(1.0 if lost else 0)
            self._poll()  # its last words may have arrived meanwhile
            if self._error is None:
                self._error = CheckpointWorkerError(
                    exit_message("the checkfreq persist process", proc, ready=self._ready)
                )
        if self._error is not None:
            raise self._error

    # ------------------------------------------------------------------ teardown
    def _shutdown(self) -> None:
        th, self._thread, self._job = self._thread, None, None
        if th is not None:
            self._jobs.put(None)
            th.join(self.start_timeout)
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.is_alive() and self._req is not None:
                with contextlib.suppress(OSError), self._send_lock:
                    self._req.send(("close",))
            proc.join(self.start_timeout)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for c in (self._req, self._res):
            if c is not None:
                with contextlib.suppress(OSError):
                    c.close()
        self._req = self._res = None
        self._drop_blob()

    def _drop_blob(self) -> None:
        if self._pinned and self._blob is not None:
            from lowdiff.engine.checkpointer import _unpin

            _unpin(self._blob)
        self._pinned = False
        self._blob = None
        self._sig = None
        self._views = []

"""``strategy="gemini"``: in-memory checkpoints kept by a separate process, rare persistence.

Gemini (Wang et al., SOSP'23) checkpoints into CPU memory instead of storage: the state
is copied every ``full_every`` steps into host memory that a training failure does not
take down, and a failed job restarts from that memory. Storage only serves failures that
lose the memory too, so it is written rarely.

**Holder process.** Every checkpoint directory has one *holder*: a long-lived process,
spawned by the first trainer, in a process group of its own (a launcher that kills the
trainer's group leaves it alone), holding ``DIR/.lowdiff.writer.lock``. It owns the
shared memory: a control block (the same seqlock block and ``DIR/.lowdiff.replica.json``
descriptor as LowDiff+'s replica, :mod:`lowdiff.engine.replica`) and two checkpoint
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
written with :func:`~lowdiff.baselines.base.save_state` by a thread of the holder, so
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

    ck = Checkpointer(model, opt, DIR, strategy="gemini", full_every=1, persist_every=10)
    start = ck.resume()   # (trainer) memory -> peer -> disk; attaches to a live holder or
                          # spawns one; copies the recovered state into memory
    for step in range(start, total):
        ...; loss.backward()
        ck.step()         # (trainer) wait for the copy in flight -> update -> [copy
                          # buffers and RNG, start the copy thread] when a checkpoint is due
                          # (thread) parameters + optimizer state -> "done" -> [peer send]
                          # (holder) publish as complete -> [persist every persist_every]
        opt.zero_grad()
    ck.close()            # (holder) persist the newest checkpoint, exit

Files (one directory per rank, ``DIR/rank-NNNNN/``, under DDP)::

    DIR/lowdiff.json                     manifest (strategy "gemini")
    DIR/full/ckpt-000000000120.pt        the state after 120 updates (torch.save), and
    DIR/full/ckpt-000000000120.pt.commit its xxh3-128 digest (published last)
    DIR/.lowdiff.replica.json            the live holder: pid, host, control block
    /dev/shm/lowdiff-<run>-ctl, -b<i>-<n> the holder's control block and buffers
"""

from __future__ import annotations

import builtins
import contextlib
import datetime
import json
import os
import queue
import secrets
import signal
import socket
import threading
import time
import traceback
import uuid
import warnings
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from lowdiff.baselines.base import (
    BaselineCheckpointer,
    commit_path,
    load_state,
    published,
    quarantine,
    restore_state,
    save_state,
)
from lowdiff.compressors.base import Compressor
from lowdiff.dist.context import DistContext, rank_dir
from lowdiff.dist.context import detect as detect_dist
from lowdiff.engine import replica as rp
from lowdiff.engine import state as st
from lowdiff.engine.spawn import exit_message, spawn_context
from lowdiff.engine.worker import (
    acquire_flock,
    detach_from_trainer_group,
    drain,
    lock_holder,
    wait_for_writer,
)
from lowdiff.errors import (
    CheckpointMismatchError,
    CheckpointWorkerError,
    CorruptCheckpointError,
    DirectoryLockedError,
    LowDiffError,
    RecoveryError,
    RecoveryWarning,
)
from lowdiff.format import codec, layout
from lowdiff.format.atomic import remove_stale_temps
from lowdiff.format.sfile import TensorEntry, plan, view_tensors
from lowdiff.recovery.replay import RecoveryStats, apply_full_state

PREFIX, SUFFIX = "ckpt-", ".pt"
OWN = (0, 1)
"""Buffer indices of this rank's own checkpoints."""
PEER = (2, 3)
"""Buffer indices of the predecessor rank's checkpoints (DDP)."""
_POLL_S = 0.2


# --------------------------------------------------------------------------- helpers


def _other(pair: tuple[int, int], cur: int) -> int:
    """The buffer of ``pair`` that does not hold the newest complete checkpoint."""
    return pair[1] if cur == pair[0] else pair[0]


def _due(step: int, full_every: int, persist_every: int) -> bool:
    return step % full_every == 0 and (step // full_every) % persist_every == 0


def _retain(directory: Path, keep: int | None) -> None:
    if keep is None:
        return
    files = published(directory, PREFIX, SUFFIX)
    for _, p in files[: max(0, len(files) - keep)]:
        for q in (commit_path(p), p):
            with contextlib.suppress(FileNotFoundError):
                q.unlink()


def _state_from(
    tensors: dict[str, torch.Tensor], meta: dict[str, str], step: int
) -> dict[str, Any]:
    """The :func:`~lowdiff.baselines.base.capture_state` form of a checkpoint held in memory."""
    msd = {k[len("model/") :]: v for k, v in tensors.items() if k.startswith("model/")}
    for alias, canon in json.loads(meta["model_aliases"]).items():
        msd[alias] = msd[canon]
    return {
        "step": step,
        "model": msd,
        "optimizer": codec.loads(meta["optim"], lambda n: tensors[n]),
        "scheduler": codec.loads(meta["scheduler"]),
        "rng": {
            "tensors": {k: v for k, v in tensors.items() if k.startswith("rng.")},
            "extra": json.loads(meta["rng"]),
        },
    }


def _writer_busy(root: Path) -> bool:
    """Whether a holder holds ``DIR/.lowdiff.writer.lock`` (released when it exits, even
    when it is killed; a pid can linger as a zombie, a lock cannot)."""
    fd = acquire_flock(root / layout.WRITER_LOCK_FILE, blocking=False)
    if fd is None:
        return True
    os.close(fd)
    return False


def _stop_stale_holder(root: Path, timeout: float) -> None:
    """End a holder that this session cannot use (it persists its newest checkpoint first),
    and remove the segments of one that died without cleaning up."""
    d = rp.read_descriptor(root)
    if _writer_busy(root):
        if d is not None and d.host == socket.gethostname():
            holder = lock_holder(root / layout.WRITER_LOCK_FILE)
            if f"pid={d.pid} " in holder + " ":
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(d.pid, signal.SIGTERM)
        wait_for_writer(root, timeout, "the holder process")
    d = rp.read_descriptor(root)
    if d is not None:
        rp._cleanup_stale(root, d)


def _is_storage_error(name: str) -> bool:
    """Whether an exception (by name) came from the storage rather than from a bug."""
    c = getattr(builtins, name, None)
    return isinstance(c, type) and issubclass(c, OSError) and not issubclass(c, ConnectionError)


def _layout_id(params: list[tuple[st.ParamInfo, torch.nn.Parameter]], extra: Any) -> str:
    desc = [[i.name, list(i.shape), str(i.dtype)] for i, _ in params]
    return xxhash.xxh3_64_hexdigest(json.dumps([desc, extra], sort_keys=True).encode())


# --------------------------------------------------------------------------- holder process


@dataclass(frozen=True)
class _HolderConfig:
    root: str
    run_id: str
    layout_id: str
    address: str
    """Abstract Unix socket name (without the leading NUL) new trainers attach through."""
    authkey: bytes
    full_every: int
    persist_every: int
    keep_full: int | None
    idle_timeout: float
    persisted: int
    """Newest step on disk when the holder starts (-1: none)."""
    trainer_pid: int


class _Holder:
    """The holder's state: buffers, the newest complete checkpoints, the persist thread."""

    def __init__(self, cfg: _HolderConfig) -> None:
        self.cfg = cfg
        self.root = Path(cfg.root)
        self.shms: list[Any] = [None] * 4
        self.caps = [0] * 4
        self.gen = 0
        self.cur = -1
        self.step = -1
        self.entries: list[Any] = []
        self.meta: dict[str, str] = {}
        self.peer: dict[str, Any] | None = None
        self.persisted = cfg.persisted
        self.conn: Connection | None = None
        self.send_lock = threading.Lock()
        self.writer: threading.Thread | None = None
        self.write_error: BaseException | None = None
        self.released = False
        self.ctl: rp.ControlBlock | None = None
        self.listener: Listener | None = None
        self.incoming: queue.Queue[Connection] = queue.Queue()

    # -- setup and teardown -------------------------------------------------------------------
    def open(self) -> None:
        ctl_name = f"lowdiff-{self.cfg.run_id[:16]}-ctl"
        self.ctl = rp.ControlBlock(rp.create_segment(ctl_name, rp.CTL_BYTES))
        self.publish(rp.STATE_INIT)
        self.listener = Listener("\0" + self.cfg.address, "AF_UNIX", authkey=self.cfg.authkey)
        threading.Thread(target=self._accept, daemon=True).start()
        rp.write_descriptor(
            self.root,
            rp.Descriptor(
                os.getpid(), socket.gethostname(), self.cfg.run_id, ctl_name, self.cfg.layout_id
            ),
        )

    def _accept(self) -> None:
        assert self.listener is not None
        while True:
            try:
                self.incoming.put(self.listener.accept())
            except (AuthenticationError, EOFError):
                continue
            except OSError:
                return  # closed

    def close(self) -> None:
        if self.ctl is not None:
            with contextlib.suppress(Exception):
                self.ctl.set_state(rp.STATE_CLOSED)
        if self.listener is not None:
            with contextlib.suppress(Exception):
                self.listener.close()
        for shm in self.shms:
            if shm is not None:
                _unlink_and_close(shm)
        if self.ctl is not None:
            _unlink_and_close(self.ctl.shm)
        rp.remove_descriptor(self.root, self.cfg.run_id)

    # -- the control block ----------------------------------------------------------------------
    def publish(self, state: int) -> None:
        assert self.ctl is not None
        doc = {
            "run_id": self.cfg.run_id,
            "layout_id": self.cfg.layout_id,
            "address": self.cfg.address,
            "authkey": self.cfg.authkey.hex(),
            "arena": None if self.cur < 0 else self.shms[self.cur].name,
            "entries": self.entries,
            "meta": self.meta,
            "persisted": self.persisted,
            "peer": self.peer,
        }
        self.ctl.write(state, self.step, doc)

    def info(self) -> dict[str, Any]:
        return {
            "run_id": self.cfg.run_id,
            "buffers": [
                [None if s is None else s.name, c]
                for s, c in zip(self.shms, self.caps, strict=True)
            ],
            "cur": self.cur,
            "step": self.step,
            "peer_cur": -1 if self.peer is None else self.peer["buffer"],
            "persisted": self.persisted,
        }

    # -- messages -------------------------------------------------------------------------------
    def send(self, msg: tuple[Any, ...]) -> None:
        with self.send_lock:
            if self.conn is not None:
                with contextlib.suppress(OSError, ValueError):
                    self.conn.send(msg)

    def handle(self, msg: tuple[Any, ...]) -> str | None:
        """One message of the attached trainer; returns "close" when the holder should exit."""
        kind = msg[0]
        if kind == "alloc":
            _, b, nbytes = msg
            if b == self.cur or (self.peer is not None and b == self.peer["buffer"]):
                raise RuntimeError(f"buffer {b} holds a complete checkpoint; it is not reallocated")
            if self.shms[b] is not None:
                _unlink_and_close(self.shms[b])
                self.shms[b] = None
            self.gen += 1
            cap = max(1, nbytes + nbytes // 8)  # slack: optimizer state appears after step 1
            self.shms[b] = rp.create_segment(f"lowdiff-{self.cfg.run_id[:16]}-b{b}-{self.gen}", cap)
            self.caps[b] = cap
            self.send(("alloced", b, self.shms[b].name, cap))
        elif kind == "done":
            _, seq, b, step, entries, meta = msg
            self.cur, self.step, self.entries, self.meta = b, step, entries, meta
            self.publish(rp.STATE_RUNNING)
            self.send(("ack", seq, step, "own"))
            if step > self.persisted and _due(step, self.cfg.full_every, self.cfg.persist_every):
                self.persist()
        elif kind == "peer_done":
            _, seq, b, step, src, entries, meta = msg
            self.peer = {
                "buffer": b,
                "arena": self.shms[b].name,
                "step": step,
                "rank": src,
                "entries": entries,
                "meta": meta,
            }
            self.publish(rp.STATE_RUNNING)
            self.send(("ack", seq, step, "peer"))
        elif kind == "resumed":
            # the trainer continues from ``step``: a newer checkpoint held here belongs to a
            # timeline that was given up (another rank could not reach it)
            _, step, disk_step = msg
            self.persisted = disk_step
            if self.step != step:
                self.cur, self.step, self.entries, self.meta = -1, -1, [], {}
            if self.peer is not None and self.peer["step"] > step:
                self.peer = None
            self.publish(rp.STATE_RUNNING)
            self.send(("resumed", self.info()))
        elif kind in ("flush", "close"):
            self.persist(wait=True)
            self.send(("flushed" if kind == "flush" else "closed", self.persisted))
            return "close" if kind == "close" else None
        else:
            raise RuntimeError(f"unknown message {kind!r}")
        return None

    # -- persistence ----------------------------------------------------------------------------
    def wait_persist(self) -> None:
        if self.writer is not None:
            self.writer.join()
            self.writer = None
        if self.write_error is not None:
            err, self.write_error = self.write_error, None
            raise err

    def persist(self, wait: bool = False) -> None:
        """Persist the newest complete checkpoint unless the disk has it already."""
        self.wait_persist()
        if self.cur >= 0 and self.step > self.persisted:
            entries = rp.entries_from_json(self.entries)
            size = entries[-1].end if entries else 0
            src = view_tensors(entries, rp.segment_tensor(self.shms[self.cur], size))
            # a private copy: the trainer reuses the shared buffer while the file is written
            snap = {k: v.clone() for k, v in src.items()}
            del src
            self.writer = threading.Thread(
                target=self._write, args=(self.step, snap, self.meta), daemon=True
            )
            self.writer.start()
        if wait:
            self.wait_persist()

    def _write(self, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        try:
            t0 = time.perf_counter()
            d = self.root / layout.FULL_DIR
            d.mkdir(exist_ok=True)
            n = save_state(
                d / f"{PREFIX}{step:012d}{SUFFIX}", _state_from(tensors, meta, step), step=step
            )
            _retain(d, self.cfg.keep_full)
            self.persisted = max(self.persisted, step)
            self.send(("persisted", step, n, time.perf_counter() - t0))
        except BaseException as e:  # noqa: BLE001 -- raised by wait_persist()
            self.write_error = e

    # -- serving --------------------------------------------------------------------------------
    def serve(self, conn: Connection, pid: int) -> str:
        """Serve one trainer; returns "close", "gone" (it died) or "released" (SIGTERM)."""
        with self.send_lock:
            self.conn = conn
        while True:
            if self.released:
                return "released"
            try:
                if not conn.poll(_POLL_S):
                    if not rp.pid_alive(pid):
                        return "gone"
                    self._refuse_newcomers()
                    if self.write_error is not None:
                        self.wait_persist()
                    continue
                msg = conn.recv()
            except (EOFError, OSError):
                return "gone"
            if self.handle(msg) == "close":
                return "close"

    def _refuse_newcomers(self) -> None:
        while True:
            try:
                c = self.incoming.get_nowait()
            except queue.Empty:
                return
            with contextlib.suppress(Exception):
                c.send(("refused", "another trainer is attached to this holder"))
                c.close()

    def orphaned(self, conn: Connection) -> None:
        """The trainer died: take every checkpoint it finished handing over."""
        with self.send_lock:
            self.conn = None
        drain(conn, self.handle, ("done", "peer_done"))
        with contextlib.suppress(Exception):
            conn.close()

    def wait_for_trainer(self) -> tuple[Connection, int] | None:
        """Offer the checkpoint to a new trainer for ``idle_timeout`` seconds."""
        self.publish(rp.STATE_ORPHANED)
        deadline = time.monotonic() + self.cfg.idle_timeout
        while not self.released and time.monotonic() < deadline:
            try:
                c = self.incoming.get(timeout=_POLL_S)
            except queue.Empty:
                if self.write_error is not None:
                    self.wait_persist()
                continue
            try:
                if not c.poll(10.0):
                    raise EOFError
                msg = c.recv()
                if msg[0] != "attach" or msg[2] != self.cfg.layout_id:
                    c.send(("refused", "not an attach request of this model"))
                    c.close()
                    continue
                with self.send_lock:
                    self.conn = c
                self.publish(rp.STATE_RUNNING)
                c.send(("attached", self.info()))
                return c, int(msg[1])
            except (EOFError, OSError):
                with contextlib.suppress(Exception):
                    c.close()
                self.conn = None
                self.publish(rp.STATE_ORPHANED)
        return None


def _unlink_and_close(shm: Any) -> None:
    rp.unlink_segment(shm.name)
    with contextlib.suppress(Exception):
        shm.close()


def _holder_main(cfg: _HolderConfig, first: Connection) -> None:
    """Entry point of the holder process (see the module docstring)."""
    detach_from_trainer_group()
    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer's close() decides
    h = _Holder(cfg)

    def on_sigterm(*_: Any) -> None:
        h.released = True

    signal.signal(signal.SIGTERM, on_sigterm)
    lock_fd = None
    h.conn = first
    try:
        lock_fd = acquire_flock(Path(cfg.root) / layout.WRITER_LOCK_FILE, blocking=True)
        h.open()
        h.send(("ready", os.getpid(), h.info()))
        conn, pid = first, cfg.trainer_pid
        while True:
            how = h.serve(conn, pid)
            if how == "close":
                break
            if how == "gone":
                h.orphaned(conn)
            if how == "released" or h.cur < 0:
                h.persist(wait=True)
                break
            nxt = h.wait_for_trainer()
            if nxt is None:  # idle_timeout, or SIGTERM: keep the newest checkpoint on disk
                h.persist(wait=True)
                break
            conn, pid = nxt
    except BaseException as e:  # noqa: BLE001 -- sent back and raised in the trainer
        h.send(("error", type(e).__name__, str(e), traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        h.close()
        if lock_fd is not None:
            os.close(lock_fd)


# --------------------------------------------------------------------------- trainer side


class _Buffers:
    """The trainer's mappings of the holder's buffers (attached by name when first used)."""

    def __init__(self) -> None:
        self.names: list[str | None] = [None] * 4
        self.caps = [0] * 4
        self.shms: list[Any] = [None] * 4

    def reset(self, listing: list[list[Any]]) -> None:
        for b, (name, cap) in enumerate(listing):
            self.set(b, name, int(cap))

    def set(self, b: int, name: str | None, cap: int) -> None:
        if self.names[b] == name:
            return
        self._close(b)
        if name is not None and not rp.valid_segment_name(name):
            raise LowDiffError(f"the holder named an invalid shared-memory segment {name!r}")
        self.names[b], self.caps[b] = name, cap

    def tensor(self, b: int, nbytes: int) -> torch.Tensor:
        name = self.names[b]
        assert name is not None and nbytes <= self.caps[b]
        if self.shms[b] is None:
            self.shms[b] = rp.attach_segment(name)
        return rp.segment_tensor(self.shms[b], nbytes)

    def _close(self, b: int) -> None:
        if self.shms[b] is not None:
            with contextlib.suppress(Exception):
                self.shms[b].close()  # the holder unlinks; views still alive keep it mapped
            self.shms[b] = None
        self.names[b], self.caps[b] = None, 0

    def close(self) -> None:
        for b in range(4):
            self._close(b)


@dataclass
class _CopyJob:
    """One checkpoint's copy: the thread's inputs, and what it reports."""

    step: int
    seq: int
    buffer: int
    views: dict[str, torch.Tensor]
    deferred: list[tuple[str, torch.Tensor]]
    entries: list[list[Any]]
    meta: dict[str, str]
    blob: torch.Tensor
    peer: tuple[int, torch.Tensor] | None
    local: threading.Event = field(default_factory=threading.Event)
    """Set once the local copy is handed over (or failed): the next update may run."""
    done: threading.Event = field(default_factory=threading.Event)
    """Set once the job is over, peer transfer included."""
    error: BaseException | None = None
    copy_s: float = 0.0
    peer_s: float = 0.0


class GeminiCheckpointer(BaselineCheckpointer):
    """Gemini's in-memory checkpoints in a holder process (see the module docstring).

    Args:
        persist_every: write every this many in-memory checkpoints to disk (the steps
            that are multiples of ``full_every * persist_every``).
        idle_timeout: seconds a holder whose trainer died waits for a new trainer before
            it persists its newest checkpoint and exits.

    Other arguments as for :class:`~lowdiff.baselines.base.BaselineCheckpointer`.

    Example:
        >>> ck = lowdiff.Checkpointer(model, opt, "ckpt", strategy="gemini",  # doctest: +SKIP
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
        from lowdiff.strategy import check_int as _check_int

        self.persist_every = _check_int("persist_every", persist_every, 1)
        if not isinstance(idle_timeout, (int, float)) or isinstance(idle_timeout, bool):
            raise TypeError(
                f"idle_timeout must be a number of seconds, got {type(idle_timeout).__name__} "
                f"{idle_timeout!r}"
            )
        if not idle_timeout >= 0:  # also rejects NaN
            raise ValueError(f"idle_timeout must be >= 0 seconds, got {idle_timeout!r}")
        self.idle_timeout = float(idle_timeout)
        self._dist: DistContext | None = detect_dist(model)
        self._pgroup: Any = None
        if self._dist is not None and directory is not None:
            if dist.get_world_size() != self._dist.world_size:
                raise ValueError(
                    "strategy 'gemini' under DDP needs the model on the default process group"
                )
            self.job_root = Path(directory)
            directory = rank_dir(self.job_root, self._dist.rank)
            if self._dist.world_size > 1:
                # peer copies travel apart from DDP's own traffic (and on CPU, as gloo needs)
                self._pgroup = dist.new_group(backend="gloo")
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
        self._param_names = {n for n, _ in st.unwrap_model(model).named_parameters()}
        self._layout_id = _layout_id(
            self._params,
            [
                f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
                None if self._dist is None else [self._dist.rank, self._dist.world_size],
            ],
        )
        self._conn: Connection | None = None
        self._proc: Any = None
        self._holder_pid = -1
        self._bufs = _Buffers()
        self._cur, self._peer_cur = -1, -1
        self._seq = self._acked = 0
        self._job: _CopyJob | None = None
        self._jobs: queue.SimpleQueue[_CopyJob | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._plan: tuple[Any, list[TensorEntry], int, list[list[Any]]] | None = None
        self._views: list[tuple[Any, str | None, dict[str, torch.Tensor]] | None] = [None] * 4
        self._holder_error: CheckpointWorkerError | None = None
        self._gone = False
        self._memory_step = -1
        self._disk_step = -1
        self._persist_first = False
        self._send_lock = threading.Lock()
        self.memory_miss_reason = ""
        """Why the last ``resume()`` did not recover from memory (empty when it did)."""
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
        out["memory_step"] = self._memory_step
        return out

    @property
    def holder_pid(self) -> int:
        """Process id of the holder serving this trainer (-1 before ``resume()``)."""
        return self._holder_pid

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
        live = self._attach_live_holder()
        if live is not None:
            try:
                step = live.step
                stats = RecoveryStats(full_step=step, step=step, source="memory")
                stats.read_s = time.perf_counter() - t0
                apply_full_state(
                    live.tensors(),
                    live.doc["meta"],
                    self.model,
                    self.optimizer,
                    self.scheduler,
                    stats,
                    where="the in-memory checkpoint",
                )
            finally:
                live.close()
            self._continue_with_holder(step, self._disk_step)
            stats.total_s = time.perf_counter() - t0
            self.recovery_stats = stats
            return step
        _stop_stale_holder(self.root, self.start_timeout)
        remove_stale_temps(self._full_dir)
        found = self._recover_newest_file(self._full_dir, PREFIX, SUFFIX)
        if found is not None:
            self._disk_step = found
        return found

    def _attach_live_holder(self) -> rp.LiveReplica | None:
        """Attach to this directory's holder if it offers a complete checkpoint.

        Returns the checkpoint found in memory (to copy from) with this trainer attached, so
        that the holder serves this trainer from now on; None when there is none.
        """
        if rp.read_descriptor(self.root) is None or not _writer_busy(self.root):
            # (a holder holds the writer lock while it lives: a killed one can linger as a
            # zombie pid, but not as a lock holder)
            self.memory_miss_reason = "no holder process"
            return None
        live, why = rp.find_live_replica(self.root, self._layout_id, wait_s=self.start_timeout)
        if live is None:
            self.memory_miss_reason = why
            return None
        try:
            conn = Client(
                "\0" + str(live.doc["address"]),
                "AF_UNIX",
                authkey=bytes.fromhex(str(live.doc["authkey"])),
            )
        except (OSError, EOFError, AuthenticationError, KeyError, ValueError) as e:
            live.close()
            self.memory_miss_reason = f"the holder process does not answer ({e})"
            return None
        try:
            conn.send(("attach", os.getpid(), self._layout_id))
            if not conn.poll(self.start_timeout):
                raise EOFError("no answer")
            msg = conn.recv()
            if msg[0] != "attached":
                raise EOFError(msg[1])
        except (OSError, EOFError) as e:
            conn.close()
            live.close()
            self.memory_miss_reason = f"the holder process refused the new trainer ({e})"
            return None
        self._conn, self._proc, self._holder_pid = conn, None, live.descriptor.pid
        self._adopt(msg[1])
        self.memory_miss_reason = ""
        return live

    def _adopt(self, info: dict[str, Any]) -> None:
        """Take the holder's view of its buffers."""
        self._gone = False
        self._bufs.reset(info["buffers"])
        self._cur, self._peer_cur = int(info["cur"]), int(info["peer_cur"])
        self._disk_step = int(info["persisted"])
        self._memory_step = int(info["step"]) if self._cur >= 0 else -1

    def _continue_with_holder(self, step: int, disk_step: int) -> None:
        """Tell the attached holder at which step the trainer goes on, and what is on disk."""
        self._send(("resumed", step, disk_step))
        self._adopt(self._wait_for("resumed")[1])

    def _after_resume(self) -> None:
        if self._conn is None:
            self._spawn_holder()
        if self.recovery_stats is None:
            self._persist_first = True  # a fresh directory: the initial state goes to disk now
            return
        self._durable = self._disk_step
        if self.recovery_stats.source != "memory" or self._dist is not None:
            # the recovered state becomes the newest in-memory checkpoint (and the peer's copy)
            self._checkpoint(self._step)
            self._join_copy()

    def _spawn_holder(self) -> None:
        _stop_stale_holder(self.root, self.start_timeout)
        ctx = spawn_context()
        mine, theirs = ctx.Pipe(duplex=True)
        run_id = uuid.uuid4().hex
        cfg = _HolderConfig(
            str(self.root),
            run_id,
            self._layout_id,
            f"lowdiff-gemini-{run_id}",
            secrets.token_bytes(32),
            self.full_every,
            self.persist_every,
            self.keep_full,
            self.idle_timeout,
            self._disk_step,
            os.getpid(),
        )
        self._holder_pid = -1  # until it reports ready
        self._proc = ctx.Process(
            target=_holder_main, args=(cfg, theirs), name="lowdiff-gemini-holder", daemon=False
        )
        self._proc.start()
        theirs.close()
        self._conn = mine
        msg = self._wait_for("ready")
        self._holder_pid = int(msg[1])
        self._adopt(msg[2])

    # ------------------------------------------------------------------ checkpoints
    def _before_update(self, t: int) -> None:
        job = self._job
        if job is not None and not job.local.is_set():
            t0 = time.perf_counter()
            job.local.wait()
            self._stats["copy_wait_s"] += time.perf_counter() - t0
        if job is not None and job.error is not None:
            self._raise_job_error(job)

    def _checkpoint(self, step: int) -> None:
        self._join_copy()  # the previous copy, and under DDP its peer transfer
        self._wait_acked()  # the holder took it over: the other buffers may be reused
        t0 = time.perf_counter()
        msd, aliases = st.model_state(self.model)
        otensors, ojson = st.optimizer_state_tensors(self.optimizer)
        rng_t, rng_extra = st.capture_rng(self._rng_layout)
        tensors: dict[str, torch.Tensor] = {f"model/{k}": v for k, v in msd.items()}
        tensors.update(otensors)
        tensors.update(rng_t)
        # the layout changes only when the optimizer creates its state (after step 1)
        key = tuple((k, v.dtype, v.shape) for k, v in tensors.items())
        if self._plan is None or self._plan[0] != key:
            entries, size = plan((k, v.dtype, tuple(v.shape)) for k, v in tensors.items())
            self._plan = (key, entries, size, rp.entries_to_json(entries))
        pkey, entries, size, entries_json = self._plan
        b = _other(OWN, self._cur)
        blob = self._buffer(b, size)
        peer = None
        if self._pgroup is not None:
            # DDP replicas have the same layout: the predecessor's checkpoint has this size
            pb = _other(PEER, self._peer_cur)
            peer = (pb, self._buffer(pb, size))
        cached = self._views[b]
        if cached is not None and cached[0] is pkey and cached[1] == self._bufs.names[b]:
            views = cached[2]
        else:
            views = view_tensors(entries, blob)
            self._views[b] = (pkey, self._bufs.names[b], views)
        deferred: list[tuple[str, torch.Tensor]] = []
        with torch.no_grad():
            for k, v in tensors.items():
                if (k.startswith("model/") and k[len("model/") :] in self._param_names) or (
                    k.startswith("optim/state")
                ):
                    deferred.append((k, v.detach()))  # changes only in the next update
                else:
                    views[k].copy_(v.detach())
        meta = {
            "kind": "full",
            "step": str(step),
            "layout_id": self._layout_id,
            "model_aliases": codec.dumps(aliases),
            "optim": ojson,
            "scheduler": st.scheduler_state_json(self.scheduler),
            "rng": codec.dumps(rng_extra),
        }
        self._seq += 1
        job = _CopyJob(step, self._seq, b, views, deferred, entries_json, meta, blob, peer)
        if peer is not None:
            self._seq += 1
        self._cur = b
        if peer is not None:
            self._peer_cur = peer[0]
        self._job = job
        self._stats["sync_copy_s"] += time.perf_counter() - t0
        self._stats["memory_bytes"] += size
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(
                target=self._copy_loop, name="lowdiff-gemini-copy", daemon=True
            )
            self._worker.start()
        self._jobs.put(job)
        if self._persist_first:
            self._persist_first = False
            self._flush()

    def _copy_loop(self) -> None:
        """(thread) Run the copy jobs, one at a time, until None arrives."""
        while (job := self._jobs.get()) is not None:
            self._copy_main(job)

    def _copy_main(self, job: _CopyJob) -> None:
        """(thread) Parameters and optimizer state into the buffer, then hand it over."""
        try:
            t0 = time.perf_counter()
            with torch.no_grad():
                for k, v in job.deferred:
                    job.views[k].copy_(v)
            job.deferred = []
            job.copy_s = time.perf_counter() - t0
            self._send(("done", job.seq, job.buffer, job.step, job.entries, job.meta))
            job.local.set()
            if job.peer is not None:
                t1 = time.perf_counter()
                self._exchange(job)
                job.peer_s = time.perf_counter() - t1
        except BaseException as e:  # noqa: BLE001 -- raised on the trainer's next call
            job.error = e
        finally:
            job.views = {}
            job.local.set()
            job.done.set()

    def _exchange(self, job: _CopyJob) -> None:
        """(thread, DDP) Send this checkpoint to the successor, receive the predecessor's."""
        ctx = self._dist
        assert ctx is not None and job.peer is not None
        nxt, prv = (ctx.rank + 1) % ctx.world_size, (ctx.rank - 1) % ctx.world_size
        pb, pblob = job.peer
        head = json.dumps({"entries": job.entries, "meta": job.meta}).encode()
        sizes_in = torch.empty(3, dtype=torch.int64)
        self._sendrecv(
            torch.tensor([job.step, job.blob.numel(), len(head)], dtype=torch.int64),
            sizes_in,
            nxt,
            prv,
        )
        p_step, p_size, p_head = (int(v) for v in sizes_in.tolist())
        if p_step != job.step or p_size > pblob.numel():
            raise LowDiffError(
                f"rank {prv} sent the checkpoint of step {p_step} ({p_size} bytes); rank "
                f"{ctx.rank} expected step {job.step} with at most {pblob.numel()} bytes"
            )
        head_in = torch.empty(p_head, dtype=torch.uint8)
        self._sendrecv(torch.frombuffer(bytearray(head), dtype=torch.uint8), head_in, nxt, prv)
        self._sendrecv(job.blob, pblob[:p_size], nxt, prv)
        doc = json.loads(bytes(head_in.numpy()))
        self._send(("peer_done", job.seq + 1, pb, job.step, prv, doc["entries"], doc["meta"]))
        self._stats["peer_bytes"] += job.blob.numel()

    def _sendrecv(self, out: torch.Tensor, into: torch.Tensor, dst: int, src: int) -> None:
        timeout = datetime.timedelta(seconds=self.start_timeout)
        works = [
            dist.isend(out, dst, group=self._pgroup),
            dist.irecv(into, src, group=self._pgroup),
        ]
        for w in works:
            if w is not None:
                w.wait(timeout)

    def _join_copy(self) -> None:
        job = self._job
        if job is None:
            return
        job.done.wait()
        self._stats["copy_s"] += job.copy_s
        self._stats["peer_s"] += job.peer_s
        job.copy_s = job.peer_s = 0.0
        if job.error is not None:
            self._raise_job_error(job)

    def _raise_job_error(self, job: _CopyJob) -> None:
        err, job.error = job.error, None
        self._job = None
        raise CheckpointWorkerError(
            f"the in-memory checkpoint of step {job.step} failed: {type(err).__name__}: {err}",
            "".join(traceback.format_exception(err)) if err is not None else "",
        ) from err

    def _buffer(self, b: int, nbytes: int) -> torch.Tensor:
        """Buffer ``b`` (``nbytes`` long); the holder allocates a larger one when needed."""
        if self._bufs.names[b] is None or self._bufs.caps[b] < nbytes:
            rp.ensure_shm_space(nbytes + nbytes // 8, "an in-memory checkpoint")
            self._send(("alloc", b, nbytes))
            _, _, name, cap = self._wait_for("alloced")
            self._bufs.set(b, name, int(cap))
        return self._bufs.tensor(b, nbytes)

    def _flush(self) -> None:
        if self._conn is None:
            return
        self._join_copy()
        self._wait_acked()
        self._send(("flush",))
        self._wait_for("flushed")

    # ------------------------------------------------------------------ talking to the holder
    def _send(self, msg: tuple[Any, ...]) -> None:
        conn = self._conn
        if conn is None:
            raise CheckpointWorkerError("the holder process is not attached")
        try:
            with self._send_lock:
                conn.send(msg)
        except (OSError, ValueError):
            self._lost_holder()

    def _handle(self, msg: tuple[Any, ...]) -> str:
        kind = str(msg[0])
        if kind == "ack":
            _, seq, step, which = msg
            self._acked = max(self._acked, int(seq))
            if which == "own":
                self._memory_step = int(step)
        elif kind in ("flushed", "closed"):
            self._durable = max(self._durable, int(msg[1]))
        elif kind == "persisted":
            _, step, nbytes, took = msg
            self._durable = max(self._durable, int(step))
            self._stats["persists"] += 1
            self._stats["bytes_written"] += nbytes
            self._stats["write_s"] += took
        elif kind == "error":
            _, name, text, tb = msg
            self._holder_error = CheckpointWorkerError(
                f"the holder process failed: {name}: {text}", tb, _is_storage_error(name)
            )
        return kind

    def _poll(self) -> None:
        conn = self._conn
        if conn is None:
            return
        try:
            while conn.poll():
                self._handle(conn.recv())
        except (EOFError, OSError):
            self._gone = True

    def _holder_alive(self) -> bool:
        if self._proc is not None:
            return bool(self._proc.is_alive())
        return _writer_busy(self.root)

    def _lost_holder(self) -> None:
        self._poll()
        if self._holder_error is not None:
            raise self._holder_error
        if self._holder_pid < 0 and self._proc is not None:  # it never reported ready
            proc = self._proc
            proc.join(1.0)
            raise CheckpointWorkerError(exit_message("the holder process", proc, ready=False))
        raise CheckpointWorkerError(
            f"the holder process of {self.root} (pid {self._holder_pid}) exited unexpectedly"
        )

    def _wait_for(self, want: str) -> tuple[Any, ...]:
        conn = self._conn
        assert conn is not None
        deadline = time.monotonic() + self.start_timeout
        while True:
            msg: tuple[Any, ...] | None = None
            try:
                if conn.poll(0.1):
                    msg = conn.recv()
            except (EOFError, OSError):
                self._lost_holder()
            if msg is not None:
                if self._handle(msg) == want:
                    return msg
                if self._holder_error is not None:
                    raise self._holder_error
            elif not self._holder_alive():
                self._lost_holder()
            if time.monotonic() > deadline:
                raise CheckpointWorkerError(
                    f"the holder process did not answer {want!r} within {self.start_timeout:.0f} s"
                )

    def _wait_acked(self) -> None:
        """Wait until the holder has taken over every checkpoint handed to it."""
        if self._conn is None:
            return
        deadline = time.monotonic() + self.start_timeout
        while self._acked < self._seq:
            try:
                if self._conn.poll(0.1):
                    self._handle(self._conn.recv())
                elif not self._holder_alive():
                    self._lost_holder()
            except (EOFError, OSError):
                self._lost_holder()
            if self._holder_error is not None:
                raise self._holder_error
            if time.monotonic() > deadline:
                raise CheckpointWorkerError(
                    f"the holder process did not take over the in-memory checkpoint within "
                    f"{self.start_timeout:.0f} s"
                )

    def _raise_background_error(self) -> None:
        self._poll()
        job = self._job
        if job is not None and job.local.is_set() and job.error is not None:
            self._raise_job_error(job)
        if self._holder_error is not None:
            raise self._holder_error
        if self._conn is not None and (
            self._gone or (self._proc is not None and not self._proc.is_alive())
        ):
            self._lost_holder()

    # ------------------------------------------------------------------ shutdown
    def _shutdown(self) -> None:
        job, self._job = self._job, None
        if job is not None:
            job.done.wait(self.start_timeout)
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join(self.start_timeout)
            self._worker = None
        self._views = [None] * 4
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                with self._send_lock:
                    conn.send(("close",))
                deadline = time.monotonic() + self.start_timeout
                while time.monotonic() < deadline:
                    if conn.poll(0.1):
                        if self._handle(conn.recv()) in ("closed", "error"):
                            break
                    elif not self._holder_alive():
                        break
            except (EOFError, OSError, ValueError):
                pass  # the holder is gone already
            with contextlib.suppress(OSError):
                conn.close()
            if self._proc is not None:
                self._proc.join(self.start_timeout)
            else:
                with contextlib.suppress(DirectoryLockedError):
                    wait_for_writer(self.root, self.start_timeout, "the holder process")
        self._proc = None
        self._bufs.close()

    # ------------------------------------------------------------------ DDP recovery
    def _gather(self, obj: Any) -> list[Any]:
        ctx = self._dist
        assert ctx is not None
        if self._pgroup is None:
            return [obj]
        out: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(out, obj, group=self._pgroup)
        return out

    def _resume_dist(self) -> int:
        """Every rank ends at the newest step that every rank can recover (memory, the
        successor's copy, or disk), each from the first source that has it."""
        ctx = self._dist
        assert ctx is not None
        t0 = time.perf_counter()
        prv = (ctx.rank - 1) % ctx.world_size
        remove_stale_temps(self.root)
        has_manifest = (self.root / layout.MANIFEST).exists()
        error = ""
        if has_manifest:
            try:
                self._check_manifest(layout.read_manifest(self.root))
            except LowDiffError as e:
                error = str(e)
        live = self._attach_live_holder() if has_manifest and not error else None
        if live is None:
            _stop_stale_holder(self.root, self.start_timeout)
            remove_stale_temps(self._full_dir)
        peer = live.doc.get("peer") if live is not None else None
        if peer is not None and peer.get("rank") != prv:
            peer = None
        own = live.step if live is not None else -1
        infos = self._gather(
            {
                "own": own,
                "held": -1 if peer is None else int(peer["step"]),
                "disk": [s for s, _ in published(self._full_dir, PREFIX, SUFFIX)],
                "manifest": has_manifest,
                "error": error,
            }
        )
        try:
            errors = [f"rank {r}: {i['error']}" for r, i in enumerate(infos) if i["error"]]
            if errors:
                raise CheckpointMismatchError("; ".join(errors))
            if not any(i["manifest"] for i in infos):
                self._start_fresh()
                return 0
            step, stats = self._restore_agreed(infos, live, peer, t0)
        finally:
            if live is not None:
                live.close()
        for s, p in published(self._full_dir, PREFIX, SUFFIX):
            if s > step:  # written on a timeline that was given up
                quarantine(self.root, p)
        self._disk_step = max(
            [s for s, _ in published(self._full_dir, PREFIX, SUFFIX) if s <= step], default=-1
        )
        if self._conn is not None:
            self._continue_with_holder(step, self._disk_step)
        if not has_manifest:
            self._write_manifest()
        stats.total_s = time.perf_counter() - t0
        self.recovery_stats = stats
        self._step = step
        self._started = True
        self._after_resume()
        return step

    def _restore_agreed(
        self,
        infos: list[dict[str, Any]],
        live: rp.LiveReplica | None,
        peer: dict[str, Any] | None,
        t0: float,
    ) -> tuple[int, RecoveryStats]:
        ctx = self._dist
        assert ctx is not None
        w, me = ctx.world_size, ctx.rank
        bad: list[set[int]] = [set() for _ in range(w)]
        while True:
            avail = [
                ({infos[r]["own"], infos[(r + 1) % w]["held"], *infos[r]["disk"]} - {-1}) - bad[r]
                for r in range(w)
            ]
            common = set.intersection(*avail)
            if not common:
                raise RecoveryError(
                    "no step can be recovered on every rank: "
                    + "; ".join(f"rank {r} has {sorted(a)}" for r, a in enumerate(avail))
                )
            step = max(common)
            sources = [
                "memory"
                if infos[r]["own"] == step
                else "peer"
                if infos[(r + 1) % w]["held"] == step
                else "disk"
                for r in range(w)
            ]
            stats = RecoveryStats(full_step=step, step=step, source=sources[me])
            received = self._transfer_held(sources, peer, stats)
            stats.read_s += time.perf_counter() - t0
            failed: str | None = None
            fatal: BaseException | None = None
            try:
                if sources[me] == "memory":
                    assert live is not None
                    apply_full_state(
                        live.tensors(),
                        live.doc["meta"],
                        self.model,
                        self.optimizer,
                        self.scheduler,
                        stats,
                        where="the in-memory checkpoint",
                    )
                elif sources[me] == "peer":
                    assert received is not None
                    apply_full_state(
                        received[0],
                        received[1],
                        self.model,
                        self.optimizer,
                        self.scheduler,
                        stats,
                        where=f"the copy held by rank {(me + 1) % w}",
                    )
                else:
                    self._restore_file(step, stats)
            except CorruptCheckpointError as e:
                warnings.warn(
                    f"recovery passed over {e.path}: {e.reason}", RecoveryWarning, stacklevel=4
                )
                quarantine(self.root, e.path)
                failed = "damaged"
            except Exception as e:  # noqa: BLE001 -- every rank must learn of it, not hang
                fatal, failed = e, f"{type(e).__name__}: {e}"
            fails = self._gather(failed)
            if fatal is not None:
                raise fatal
            errors = [f"rank {r}: {f}" for r, f in enumerate(fails) if f not in (None, "damaged")]
            if errors:
                raise RecoveryError("recovery failed on another rank: " + "; ".join(errors))
            if not any(fails):
                return step, stats
            for r, f in enumerate(fails):
                if f:
                    bad[r].add(step)

    def _restore_file(self, step: int, stats: RecoveryStats) -> None:
        path = self._full_dir / f"{PREFIX}{step:012d}{SUFFIX}"
        state = load_state(path, stats)
        if not isinstance(state, dict) or state.get("step") != step:
            raise CorruptCheckpointError(path, "its contents do not match its name")
        t0 = time.perf_counter()
        restore_state(state, self.model, self.optimizer, self.scheduler, where=path.name)
        stats.replay_s += time.perf_counter() - t0

    def _transfer_held(
        self, sources: list[str], peer: dict[str, Any] | None, stats: RecoveryStats
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
        """Send the copy this rank holds to its predecessor, receive this rank's own copy
        from the successor, where the agreed sources say so."""
        ctx = self._dist
        assert ctx is not None
        w, me = ctx.world_size, ctx.rank
        nxt, prv = (me + 1) % w, (me - 1) % w
        send, recv = sources[prv] == "peer", sources[me] == "peer"
        if not (send or recv):
            return None
        shm = None
        timeout = datetime.timedelta(seconds=self.start_timeout)

        def exchange(out: torch.Tensor | None, into: torch.Tensor | None) -> None:
            works = []
            if out is not None:
                works.append(dist.isend(out, prv, group=self._pgroup))
            if into is not None:
                works.append(dist.irecv(into, nxt, group=self._pgroup))
            for wk in works:
                if wk is not None:
                    wk.wait(timeout)

        try:
            blob = head = None
            if send:
                assert peer is not None
                shm = rp.attach_segment(str(peer["arena"]))
                entries = rp.entries_from_json(peer["entries"])
                blob = rp.segment_tensor(shm, entries[-1].end if entries else 0)
                raw = json.dumps({"entries": peer["entries"], "meta": peer["meta"]}).encode()
                head = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            sizes = torch.empty(2, dtype=torch.int64) if recv else None
            exchange(
                None
                if blob is None or head is None
                else torch.tensor([blob.numel(), head.numel()]),
                sizes,
            )
            n_blob, n_head = (0, 0) if sizes is None else (int(v) for v in sizes.tolist())
            head_in = torch.empty(n_head, dtype=torch.uint8) if recv else None
            exchange(head, head_in)
            blob_in = torch.empty(n_blob, dtype=torch.uint8) if recv else None
            exchange(blob, blob_in)
            del blob
        finally:
            if shm is not None:
                with contextlib.suppress(Exception):
                    shm.close()
        if head_in is None or blob_in is None:
            return None
        doc = json.loads(bytes(head_in.numpy()))
        stats.bytes_read += n_blob
        return view_tensors(rp.entries_from_json(doc["entries"]), blob_in), doc["meta"]

"""Gemini's holder process: it keeps a directory's in-memory checkpoints and persists them.

One holder per checkpoint directory, spawned by the first trainer (:func:`holder_main`),
in a process group of its own, holding ``DIR/.lowdiff.writer.lock`` while it lives. It
owns the shared memory: a control block (the seqlock block and ``DIR/.lowdiff.replica.json``
descriptor of :mod:`lowdiff.proc.holder`) and four checkpoint buffers, two for this
rank's checkpoints and two for the predecessor rank's under DDP (see
:mod:`lowdiff_lab.baselines.gemini_protocol` for the numbering). A checkpoint is published
as complete in the control block only once the trainer says its copy has finished.

What the holder does, in order (``H`` is the holder, ``T`` a trainer)::

    H  take the writer lock, create the control block, listen on its socket -> Ready
    T  GmAlloc / GmDone / GmPeerDone / GmResume / Flush ...   H  answers each
       every persist_every-th checkpoint: H clones it out of the buffer and a thread
       of H writes it (save_state), then H sends GmPersisted
    T  Close                      H  persists the newest checkpoint -> Closed, exits
    T  dies                       H  takes what T handed over, publishes ORPHANED and
                                     waits idle_timeout for a new trainer (GmAttach
                                     through the socket); none: persists, exits
    SIGTERM                       H  persists the newest checkpoint, exits
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from lowdiff.format import codec, layout
from lowdiff.format.sfile import view_tensors
from lowdiff.proc import holder as rp
from lowdiff.proc.child_end import ChildEnd, run_checkpointing_process
from lowdiff.proc.protocol import Close, Closed, Flush, Flushed, Kind, Message, unexpected
from lowdiff.proc.spawn import release_trainer_stdio
from lowdiff.proc.takeover_socket import TakeoverListener
from lowdiff_lab.baselines.base import commit_path, published, save_state
from lowdiff_lab.baselines.gemini_protocol import (
    N_BUFFERS,
    PREFIX,
    SUFFIX,
    GmAck,
    GmAlloc,
    GmAlloced,
    GmAttach,
    GmAttached,
    GmDone,
    GmPeerDone,
    GmPersisted,
    GmRefused,
    GmResume,
    GmResumed,
    HolderConfig,
    HolderState,
    checkpoint_file,
)

_POLL_S = 0.2
"""How often an idle holder looks at its trainer, its persist thread and newcomers."""


def _due(step: int, full_every: int, persist_every: int) -> bool:
    """Whether the in-memory checkpoint of ``step`` is one that goes to disk."""
    return step % full_every == 0 and (step // full_every) % persist_every == 0


def _retain(directory: Path, keep: int | None) -> None:
    """Delete the persisted checkpoints beyond the newest ``keep`` (the holder's own copy
    of the trainer's retention rule, which it applies after each file it writes)."""
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
    """The :func:`~lowdiff_lab.baselines.base.capture_state` form of a checkpoint held in memory."""
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


class _Holder:
    """The holder's state: buffers, the newest complete checkpoints, the persist thread."""

    def __init__(self, cfg: HolderConfig) -> None:
        self.cfg = cfg
        self.root = Path(cfg.root)
        self.shms: list[Any] = [None] * N_BUFFERS
        self.caps = [0] * N_BUFFERS
        self.gen = 0
        """Numbers the segments, so that a reallocated buffer gets a new name."""
        self.cur = -1
        self.step = -1
        self.entries: list[Any] = []
        self.meta: dict[str, str] = {}
        self.peer: dict[str, Any] | None = None
        """The predecessor's newest complete checkpoint (DDP), as the control block shows it."""
        self.persisted = cfg.persisted
        self.end: ChildEnd | None = None
        """The attached trainer (None while orphaned)."""
        self.writer: threading.Thread | None = None
        self.write_error: BaseException | None = None
        self.released = False
        """Set by SIGTERM: persist the newest checkpoint and exit."""
        self.closed = False
        """Set by the trainer's ``Close``."""
        self.ctl: rp.ControlBlock | None = None
        self.listener: TakeoverListener | None = None

    # -- setup and teardown -------------------------------------------------------------------
    def open(self) -> None:
        ctl_name = f"lowdiff-{self.cfg.run_id[:16]}-ctl"
        # the descriptor first: a kill between the two leaves segments it names (the next
        # trainer removes them), never segments nothing names
        rp.write_descriptor(
            self.root,
            rp.Descriptor(
                os.getpid(),
                socket.gethostname(),
                self.cfg.run_id,
                ctl_name,
                self.cfg.layout_id,
                process="holder",
            ),
        )
        self.ctl = rp.ControlBlock(rp.create_segment(ctl_name, rp.CTL_BYTES))
        self.publish(rp.STATE_INIT)
        self.listener = TakeoverListener(self.cfg.address, self.cfg.authkey)

    def close(self) -> None:
        if self.ctl is not None:
            with contextlib.suppress(Exception):
                self.ctl.set_state(rp.STATE_CLOSED)
        if self.listener is not None:
            with contextlib.suppress(Exception):
                self.listener.close()
        for shm in self.shms:
            if shm is not None:
                rp.unlink_and_close(shm)
        if self.ctl is not None:
            rp.unlink_and_close(self.ctl.shm)
        rp.remove_descriptor(self.root, self.cfg.run_id)

    def release(self, *_: Any) -> None:
        """(SIGTERM handler) Stop serving: persist the newest checkpoint and exit."""
        self.released = True

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

    def state(self) -> HolderState:
        return HolderState(
            run_id=self.cfg.run_id,
            buffers=tuple(
                (None if s is None else s.name, c)
                for s, c in zip(self.shms, self.caps, strict=True)
            ),
            cur=self.cur,
            step=self.step,
            peer_cur=-1 if self.peer is None else self.peer["buffer"],
            persisted=self.persisted,
        )

    # -- requests -------------------------------------------------------------------------------
    def send(self, msg: Message) -> None:
        """To the attached trainer, if there is one (the persist thread sends too)."""
        end = self.end
        if end is not None:
            end.send(msg)

    def handle(self, msg: Message) -> bool:
        """One request of the attached trainer (or one a dead trainer left in the pipe);
        False once serving ends: the trainer closed the holder, or it was released."""
        match msg:
            case GmAlloc(buffer=b, nbytes=nbytes):
                self._alloc(b, nbytes)
            case GmDone():
                self._done(msg)
            case GmPeerDone():
                self._peer_done(msg)
            case GmResume(step=step, disk_step=disk_step):
                self._resume(step, disk_step)
            case Flush():
                self.persist(wait=True)
                self.send(Flushed(self.persisted))
            case Close():
                self.persist(wait=True)
                self.closed = True
                self.send(Closed(self.persisted))
            case _:
                raise unexpected(msg)
        return not (self.closed or self.released)

    def _alloc(self, b: int, nbytes: int) -> None:
        if b == self.cur or (self.peer is not None and b == self.peer["buffer"]):
            raise RuntimeError(f"buffer {b} holds a complete checkpoint; it is not reallocated")
        if self.shms[b] is not None:
            rp.unlink_and_close(self.shms[b])
            self.shms[b] = None
        self.gen += 1
        cap = max(1, nbytes + nbytes // 8)  # slack: optimizer state appears after step 1
        self.shms[b] = rp.create_segment(f"lowdiff-{self.cfg.run_id[:16]}-b{b}-{self.gen}", cap)
        self.caps[b] = cap
        self.send(GmAlloced(b, self.shms[b].name, cap))

    def _done(self, msg: GmDone) -> None:
        self.cur, self.step, self.entries, self.meta = msg.buffer, msg.step, msg.entries, msg.meta
        self.publish(rp.STATE_RUNNING)
        self.send(GmAck(msg.seq, msg.step, own=True))
        if msg.step > self.persisted and _due(
            msg.step, self.cfg.full_every, self.cfg.persist_every
        ):
            self.persist()

    def _peer_done(self, msg: GmPeerDone) -> None:
        self.peer = {
            "buffer": msg.buffer,
            "arena": self.shms[msg.buffer].name,
            "step": msg.step,
            "rank": msg.rank,
            "entries": msg.entries,
            "meta": msg.meta,
        }
        self.publish(rp.STATE_RUNNING)
        self.send(GmAck(msg.seq, msg.step, own=False))

    def _resume(self, step: int, disk_step: int) -> None:
        # the trainer continues from ``step``: a newer checkpoint held here belongs to a
        # timeline that was given up (another rank could not reach it)
        self.persisted = disk_step
        if self.step != step:
            self.cur, self.step, self.entries, self.meta = -1, -1, [], {}
        if self.peer is not None and self.peer["step"] > step:
            self.peer = None
        self.publish(rp.STATE_RUNNING)
        self.send(GmResumed(self.state()))

    # -- persistence ----------------------------------------------------------------------------
    def wait_persist(self) -> None:
        """Wait for the file being written; raise what writing it failed with."""
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
        """(thread) Write one checkpoint file, apply retention, tell the trainer."""
        try:
            t0 = time.perf_counter()
            d = self.root / layout.FULL_DIR
            d.mkdir(exist_ok=True)
            n = save_state(checkpoint_file(d, step), _state_from(tensors, meta, step), step=step)
            _retain(d, self.cfg.keep_full)
            self.persisted = max(self.persisted, step)
            self.send(GmPersisted(step, n, time.perf_counter() - t0))
        except BaseException as e:  # noqa: BLE001 -- raised by wait_persist()
            self.write_error = e

    # -- trainers -------------------------------------------------------------------------------
    def run(self, first: ChildEnd) -> None:
        """Serve trainers until one closes the holder, it is released, or no trainer
        comes for ``idle_timeout`` seconds after the last one died."""
        end: ChildEnd | None = first
        while end is not None:
            self.end = end
            try:
                gone = end.serve(self.handle, _POLL_S)
            except ConnectionError:
                gone = True  # a socket reset by a trainer that died with replies unread
            if self.closed:
                return
            if gone:
                self.orphaned(end)
            if self.released or self.cur < 0:
                break
            end = self.wait_for_trainer()
        # released, idle_timeout, or nothing in memory: keep the newest checkpoint on disk
        self.persist(wait=True)

    def idle(self) -> bool:
        """(serving, no request for a while) Refuse trainers that try to attach meanwhile,
        raise what the persist thread failed with; True once the holder is released."""
        self._refuse_newcomers()
        if self.write_error is not None:
            self.wait_persist()
        return self.released

    def _refuse_newcomers(self) -> None:
        assert self.listener is not None
        self.listener.refuse_waiting(GmRefused("another trainer is attached to this holder"))

    def orphaned(self, end: ChildEnd) -> None:
        """The trainer died: take every checkpoint it finished handing over."""
        self.end = None
        end.drain(self.handle, (Kind.GM_DONE, Kind.GM_PEER_DONE))
        end.close()
        # a launcher capturing the dead trainer's output must see it end now
        release_trainer_stdio(self.root / layout.REPLICA_LOG)

    def wait_for_trainer(self) -> ChildEnd | None:
        """Offer the checkpoint to a new trainer for ``idle_timeout`` seconds (None: none
        came, or the holder was released)."""
        self.publish(rp.STATE_ORPHANED)
        deadline = time.monotonic() + self.cfg.idle_timeout
        while not self.released and time.monotonic() < deadline:
            assert self.listener is not None
            c = self.listener.get(timeout=_POLL_S)
            if c is None:
                if self.write_error is not None:
                    self.wait_persist()
                continue
            end = self._attach(c)
            if end is not None:
                return end
        return None

    def _attach(self, c: Connection) -> ChildEnd | None:
        """Serve the trainer on ``c`` if it asks to attach with this model."""
        assert self.listener is not None
        msg = self.listener.request(c)
        if msg is None:
            return None
        try:
            if not isinstance(msg, GmAttach) or msg.layout_id != self.cfg.layout_id:
                c.send(GmRefused("not an attach request of this model"))
                c.close()
                return None
            end = ChildEnd(c, c, msg.pid, self.idle)
            self.end = end
            self.publish(rp.STATE_RUNNING)
            c.send(GmAttached(self.state()))
            return end
        except (EOFError, OSError):
            with contextlib.suppress(Exception):
                c.close()
            self.end = None
            self.publish(rp.STATE_ORPHANED)
            return None


def holder_main(cfg: HolderConfig, requests: Connection, results: Connection) -> None:
    """Entry point of the holder process (see the module docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer's close() decides
    h = _Holder(cfg)
    signal.signal(signal.SIGTERM, h.release)
    first = ChildEnd(requests, results, cfg.trainer_pid, h.idle)
    h.end = first

    def run() -> None:
        h.open()
        first.ready(h.state().info())
        h.run(first)

    def report(msg: Message) -> None:
        if h.end is not None:
            h.end.send(msg)

    run_checkpointing_process(Path(cfg.root), run, report=report, cleanup=h.close, nice=0)

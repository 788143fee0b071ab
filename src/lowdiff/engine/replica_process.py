"""The checkpointing process of ``strategy="lowdiff+"``: a CPU replica, merged every step.

Call sequence:

0) (trainer) starts this process with the shared snapshot slots and two pipes.
1) (checkpointing) takes the writer lock, creates the control block, publishes the
   replica descriptor.
2) (trainer, once per session) stages its whole state and sends
   :class:`~lowdiff.engine.messages.Init`; the
   replica is built from it in a named shared-memory arena and persisted right away.
3) (trainer, every step) fills a slot with the step's gradients (snapshotted layer by
   layer during backward), buffers and RNG states and sends
   :class:`~lowdiff.engine.messages.Step`.
   (checkpointing) applies the same optimizer update to the replica (PyTorch's own CPU
   kernels: the optimizer class and its foreach/fused flags are the trainer's), copies
   buffers and RNG, publishes the new metadata in the control block, frees the slot,
   and starts a background persist when one is due.
4) (trainer) ``Flush`` / ``Close``: persist the current step and answer with it.

When the trainer dies, the process merges every step it received completely, marks
the replica ORPHANED, persists it, and waits up to ``idle_timeout`` for a new trainer on
its socket (:mod:`lowdiff.proc.adopt`; the address is in the control block):

5) (new trainer) copies the state from the arena, connects and sends
   :class:`~lowdiff.engine.messages.Adopt`.
   (checkpointing) checks that the trainer runs the same job (run, layout, directory,
   optimizer, shard, retention, step), makes new snapshot slots and counters in named
   shared memory and answers ``Ready`` with their names: from here on it serves the new
   trainer as it served the first (3 and 4), and watches it by its pid. A trainer that
   does not match gets ``Refused`` and why.

A trainer that copied the replica but does not take the process over sends SIGTERM;
so does the end of ``idle_timeout``: the process then persists what it holds, unlinks
its segments and exits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from lowdiff.engine.messages import Adopt, Durable, Init, Merged, Stage, Step
from lowdiff.engine.remote_tier import announce, drain, start_uploader
from lowdiff.engine.replica_optim import optimizer_class
from lowdiff.engine.replica_worker import Persister, Replica, ReplicaConfig
from lowdiff.format import codec, layout
from lowdiff.plan import young_daly_s
from lowdiff.proc import adopt
from lowdiff.proc import holder as rp
from lowdiff.proc.adopt import AdoptionListener, TrainerSegments
from lowdiff.proc.channel import (
    BEAT,
    REPLICA_MERGE_NS,
    REPLICA_MERGES,
    SLOTS_DONE,
    STAGES_TAKEN,
    STAGING_DONE,
    Counters,
)
from lowdiff.proc.child_end import ChildEnd, run_checkpointing_process
from lowdiff.proc.protocol import (
    Close,
    Closed,
    Flush,
    Flushed,
    Kind,
    Message,
    unexpected,
)
from lowdiff.proc.spawn import release_trainer_stdio
from lowdiff.remote.uploader import Uploader
from lowdiff.state.record import RecordLayout


def _warm_up(optimizer_path: str) -> None:
    """Run the optimizer once on a scratch tensor: its first step imports and initialises
    machinery that would otherwise stall the first merge (and so the trainer)."""
    with contextlib.suppress(Exception):
        p = torch.nn.Parameter(torch.zeros(8))
        p.grad = torch.zeros(8)
        optimizer_class(optimizer_path)([p]).step()  # type: ignore[call-arg]


class ReplicaProcess:
    """The replica process's main loop: requests in, merges and persists out; after a
    trainer's death, the next trainer taken on (see the module docstring)."""

    def __init__(self, cfg: ReplicaConfig, slots: torch.Tensor, ctr: Counters, end: ChildEnd):
        self.cfg, self.slots, self.ctr, self.end = cfg, slots, ctr, end
        self.root = Path(cfg.root)
        self.released = False
        """Set by SIGTERM: persist what is held and exit (a flag, set from a handler)."""
        self.rep: Replica | None = None
        self.persister: Persister | None = None
        self.uploader: Uploader | None = None
        self.staging: torch.Tensor | None = None
        self.ctl_shm: Any = None
        self.listener: AdoptionListener | None = None
        self.adoptions = 0
        self.segments: adopt.TrainerSegments | None = None
        """The slots and counters made for the trainer that took the process over."""
        self.spare: adopt.TrainerSegments | None = None
        """Slots and counters made while waiting, for a trainer that asks for as many
        slots as the last one had (the usual case): the takeover need not make them."""

    def on_sigterm(self, *_: Any) -> None:
        self.released = True

    def start(self) -> None:
        """Create the control block, publish the descriptor, build the (empty) replica."""
        cfg = self.cfg
        layout_id = RecordLayout.from_json(cfg.layout).layout_id
        ctl_name = f"lowdiff-{cfg.run_id[:16]}-ctl"
        # the descriptor first: a kill between the two leaves segments it names (the next
        # trainer removes them), never segments nothing names
        rp.write_descriptor(
            self.root,
            rp.Descriptor(
                os.getpid(),
                socket.gethostname(),
                cfg.run_id,
                ctl_name,
                layout_id,
                process="replica",
            ),
        )
        self.ctl_shm = rp.create_segment(ctl_name, rp.CTL_BYTES)
        ctl = rp.ControlBlock(self.ctl_shm)
        ctl.write(rp.STATE_INIT, -1, {"run_id": cfg.run_id, "layout_id": layout_id})
        _warm_up(cfg.optimizer)
        self.rep = Replica(cfg, ctl)
        remote = cfg.remote is not None
        self.persister = Persister(
            self.root,
            cfg.keep_full,
            lambda msg: self.end.send(msg),  # to whichever trainer is served now
            progress=lambda _n: self.ctr.add(BEAT),
            on_written=self.upload if remote else None,
            protect=self.not_uploaded if remote else None,
        )
        if cfg.remote is not None:
            self.uploader = start_uploader(
                self.root, cfg.remote, cfg.keep_full, lambda: self.ctr, lambda m: self.end.send(m)
            )

    def upload(self, path: Path) -> None:
        if self.uploader is not None:
            self.uploader.submit(path)

    def not_uploaded(self) -> set[Path]:
        """Files local retention must keep (every file until the upload thread runs)."""
        if self.uploader is None:
            return set((self.root / layout.FULL_DIR).glob("*"))
        return self.uploader.protected()

    def drain_remote(self) -> None:
        drain(self.uploader, self.cfg.remote, lambda: self.ctr)

    def maybe_persist(self) -> None:
        rep, persister = self.rep, self.persister
        assert rep is not None and persister is not None
        if persister.error is not None:
            persister.wait()
        persist_every = self.cfg.persist_every
        if persist_every == "auto":
            # the Young–Daly interval, a persist's time taken as its cost, and never
            # writing more than half of the time
            due = persister.started_at + young_daly_s(persister.took, self.cfg.mtbf)
            if not persister.busy and time.monotonic() >= max(persister.next_auto, due):
                persister.snapshot(rep)
        elif isinstance(persist_every, int) and rep.step % persist_every == 0:
            persister.snapshot(rep)

    def handle(self, msg: Message) -> bool:
        """Handle one request; False when the process should stop."""
        rep, persister = self.rep, self.persister
        assert rep is not None and persister is not None
        match msg:
            case Step(slot=slot, step=step, meta=meta):
                t0 = time.perf_counter_ns()
                rep.merge(self.slots[slot], step, codec.loads(meta))
                self.ctr.add(REPLICA_MERGE_NS, time.perf_counter_ns() - t0)
                self.ctr.add(REPLICA_MERGES)
                self.ctr.add(SLOTS_DONE)
                self.ctr.add(BEAT)
                self.maybe_persist()
            case Stage(buffer=buffer):
                self.ctr.add(STAGES_TAKEN)
                self.staging = buffer
            case Init(step=step, entries=entries, meta=meta):
                assert self.staging is not None
                rep.init_from(self.staging, step, entries, meta)
                self.staging = None  # the replica holds the state now: unmap the staging copy
                self.ctr.add(STAGING_DONE)
                self.ctr.add(BEAT)
                self.end.send(Merged(rep.step))
                persister.snapshot(rep)
            case Flush() | Close():
                persister.wait()
                if persister.persisted < rep.step:
                    persister.snapshot(rep)
                    persister.wait()
                if isinstance(msg, Close):
                    self.drain_remote()
                    self.end.send(Closed(persister.persisted))
                    return False
                self.end.send(Flushed(persister.persisted))
            case _:
                raise unexpected(msg)
        return True

    def serve(self) -> None:
        """Serve the trainer that started the process, then every trainer that takes it
        over, until one closes it or none comes within ``idle_timeout``."""
        while self.end.serve(self.handle):  # True: the trainer is gone
            if not self.orphaned():
                return

    def orphaned(self) -> bool:
        """The trainer died: merge every step that arrived completely, then offer the
        replica to a new trainer. True once one took the process over; False when it was
        released or ``idle_timeout`` passed (what it holds is persisted)."""
        rep, persister = self.rep, self.persister
        assert rep is not None and persister is not None
        # the trainer's streams first: a launcher waiting for the end of its output sees
        # it end at once, not after the last steps are merged
        release_trainer_stdio(self.root / layout.REPLICA_LOG)
        self.end.drain(self.handle, (Kind.STEP, Kind.STAGE, Kind.INIT))
        self.end.close()
        if rep.opt is None:
            return False
        if self.listener is None:
            self.listener = AdoptionListener(f"lowdiff-{self.cfg.run_id[:16]}-{os.getpid()}")
            rep.adoption = self.listener.published()
        rep.publish(rp.STATE_ORPHANED)
        if persister.persisted < rep.step:
            persister.snapshot(rep)
        if self.spare is None:  # before the listener answers: a next trainer waits for it
            with contextlib.suppress(Exception):  # else made at the takeover
                self.spare = self._make_segments(int(self.slots.shape[0]))
        adopted = adopt.wait_for_trainer(
            self.listener, self.cfg.idle_timeout, lambda: self.released, self.adopt
        )
        if not adopted:
            persister.wait()
            self.drain_remote()
        return adopted

    def adopt(self, conn: Connection) -> bool:
        """Take on the trainer on ``conn`` if it asks to, and runs this job."""
        rep, persister, listener = self.rep, self.persister, self.listener
        assert rep is not None and persister is not None and listener is not None
        msg = adopt.take_request(listener, conn, self._mismatch)
        if msg is None:
            return False
        try:
            info = self._new_slots(msg.slots)
        except BaseException as e:  # noqa: BLE001 -- the trainer starts a process of its own
            adopt.refuse(conn, f"cannot make the snapshot slots: {e}")
            return False
        self.cfg = dataclasses.replace(
            self.cfg,
            persist_every=msg.cfg.persist_every,
            idle_timeout=msg.cfg.idle_timeout,
            mtbf=msg.cfg.mtbf,
        )
        self.adoptions += 1
        rep.publish(rp.STATE_RUNNING)
        durable = persister.persisted
        self.end = adopt.serve_new_trainer(  # the persist thread reports to it from here on
            conn, msg, dict(info, durable=durable, adoptions=self.adoptions),
            adopt.refusing_newcomers(listener, "replica", lambda: self.released),
        )  # fmt: skip
        if persister.persisted > durable:  # finished in between: reported to nobody
            self.end.send(Durable(persister.persisted))
        return True

    def _mismatch(self, msg: Any) -> str:
        """Why the trainer that sent ``msg`` may not take this process over ('' if it may)."""
        rep = self.rep
        assert rep is not None
        if not isinstance(msg, Adopt) or not isinstance(msg.cfg, ReplicaConfig):
            return "not a request to take over a LowDiff+ replica"
        mine, theirs = self.cfg, msg.cfg
        for field in ("run_id", "layout", "optimizer", "shard", "keep_full", "threads", "remote"):
            if getattr(mine, field) != getattr(theirs, field):
                return f"the new trainer's {field} differs from the replica's"
        if Path(theirs.root).resolve() != self.root.resolve():
            return f"the new trainer's directory {theirs.root} is not {self.root}"
        if msg.step != rep.step:
            return f"the new trainer resumes at step {msg.step}, the replica is at {rep.step}"
        if msg.slots < 1:
            return "the new trainer asks for no snapshot slots"
        return ""

    def _new_slots(self, n: int) -> dict[str, Any]:
        """Snapshot slots and counters for a new trainer, in named shared memory."""
        rep = self.rep
        assert rep is not None
        made, self.spare = self.spare, None
        if made is None or made.n_slots != n:
            if made is not None:
                made.unlink()
            made = self._make_segments(n)
        old, self.segments = self.segments, made
        rep.forget_slots()
        self.slots, self.ctr = made.slots, made.counters
        announce(self.uploader, self.ctr)
        if old is not None:
            old.unlink()
        return made.info

    def _make_segments(self, n: int) -> TrainerSegments:
        rep = self.rep
        assert rep is not None
        prefix = f"lowdiff-{self.cfg.run_id[:16]}-t{self.adoptions + 1}"
        return adopt.TrainerSegments.make(prefix, n, rep.rl.row_bytes)

    def teardown(self) -> None:
        if self.listener is not None:
            self.listener.close()
        if self.rep is not None:
            with contextlib.suppress(Exception):
                self.rep.ctl.set_state(rp.STATE_CLOSED)
            self.rep.close()
        if self.ctl_shm is not None:
            rp.unlink_and_close(self.ctl_shm)
        for segments in (self.segments, self.spare):
            if segments is not None:
                segments.unlink()
        rp.remove_descriptor(self.root, self.cfg.run_id)


def replica_worker_main(
    cfg: ReplicaConfig,
    slots: torch.Tensor,
    counters: torch.Tensor,
    requests: Connection,
    results: Connection,
) -> None:
    """Entry point of the LowDiff+ checkpointing process (one intra-op thread: the
    ``replica_threads`` shards are stepped by one thread each, and intra-op threads on top
    of them would oversubscribe the cores)."""
    end = ChildEnd(requests, results)
    proc = ReplicaProcess(cfg, slots, Counters(counters), end)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer's close() decides
    signal.signal(signal.SIGTERM, proc.on_sigterm)

    def run() -> None:
        proc.start()
        end.ready()
        proc.serve()

    def finish() -> None:  # the persist in flight completes (or cleans up) first
        if proc.persister is not None:
            proc.persister.wait()

    run_checkpointing_process(
        proc.root, run, report=lambda m: proc.end.send(m), finish=finish, cleanup=proc.teardown
    )

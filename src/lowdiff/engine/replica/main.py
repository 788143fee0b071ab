"""LowDiff+'s replica: the checkpointing process of ``method="lowdiff+"``, a CPU replica
merged every step.

Call sequence:

0) (trainer) starts this process with the shared snapshot slots and two pipes.
1) (checkpointing) takes the writer lock, creates the control block, publishes the
   replica descriptor.
2) (trainer, once per session) stages its whole state and sends
   :class:`~lowdiff.engine.wire.messages.Init`; the
   replica is built from it in a named shared-memory arena and persisted right away.
3) (trainer, every step) fills a slot with the step's gradients (snapshotted layer by
   layer during backward), buffers and RNG states and sends
   :class:`~lowdiff.engine.wire.messages.Step`.
   (checkpointing) applies the same optimizer update to the replica (PyTorch's own CPU
   kernels: the optimizer class and its foreach/fused flags are the trainer's), copies
   buffers and RNG, publishes the new metadata in the control block, frees the slot,
   and starts a background persist when one is due.
4) (trainer) ``Flush`` / ``Close``: persist the current step and answer with it.

When the trainer dies, the process merges every step it received completely, marks
the replica ORPHANED, persists it, and waits up to ``idle_timeout`` for a new trainer on
its socket (a takeover, :mod:`lowdiff.engine.process.takeover`; the address is in the
control block):

5) (new trainer) copies the state from the arena, connects and sends
   :class:`~lowdiff.engine.wire.messages.TakeoverRequest`.
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
import signal
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from lowdiff.engine.process.remote import announce, drain, start_uploader
from lowdiff.engine.process.takeover import ProcessTakeover, request_mismatch
from lowdiff.engine.replica.copy import PeerCopy, source_of
from lowdiff.engine.replica.optim import optimizer_class
from lowdiff.engine.replica.replica import Persister, Replica, staged_tensors
from lowdiff.engine.wire.configs import ReplicaConfig
from lowdiff.engine.wire.messages import Durable, Init, Merged, Stage, Step, TakeoverRequest
from lowdiff.format import codec, layout
from lowdiff.plan import young_daly_s
from lowdiff.proc import holder as rp
from lowdiff.proc.channel import (
    BEAT,
    PEER_ACKED,
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
from lowdiff.proc.takeover_socket import TrainerSegments
from lowdiff.remote.uploader import Uploader
from lowdiff.state.record import RecordLayout

_MATCH = ("run_id", "layout", "optimizer", "shard", "keep_full", "threads", "remote")
"""What a new trainer's ``ReplicaConfig`` must share with the replica's."""


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
        self.takeover = ProcessTakeover(self.root, cfg.run_id, "replica", "snapshot slots")
        self.rep: Replica | None = None
        self.persister: Persister | None = None
        self.uploader: Uploader | None = None
        self.staging: torch.Tensor | None = None
        self.copy: PeerCopy | None = None
        """The copy of another node's shard (:mod:`lowdiff.engine.replica.copy`), or None."""
        self.acked = -1
        """The newest step the holder said its copy of this shard holds."""
        self.pending: list[tuple[int, int, dict[str, Any]]] = []
        """Steps received and not merged: (slot, step, meta) (see :meth:`merge_step`)."""
        self.stuck = False
        """A step could not be merged (its source's part never came): no later one is."""
        self.draining = False
        self.orphan = False
        """The trainer is gone (until a new one takes the process over)."""

    def start(self) -> None:
        """Publish the descriptor and the control block, build the (empty) replica."""
        cfg = self.cfg
        layout_id = RecordLayout.from_json(cfg.layout).layout_id
        ctl = self.takeover.publish(layout_id, rp.CTL_BYTES)
        ctl.write(rp.STATE_INIT, -1, {"run_id": cfg.run_id, "layout_id": layout_id})
        _warm_up(cfg.optimizer)
        self.rep = Replica(cfg, ctl)
        if cfg.peer is not None:
            self.copy = PeerCopy(cfg, self._acked)
            self.rep.head = self.copy.head
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

    def _acked(self, step: int) -> None:
        """(a thread) The holder's copy of this shard holds ``step``."""
        self.acked = max(self.acked, step)
        self.ctr.raise_to(PEER_ACKED, self.acked + 1)

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
                if self.copy is not None:  # this shard's part goes to its holder at once
                    self.copy.forward(step, self.slots[slot], rep, meta)
                self.pending.append((slot, step, codec.loads(meta)))
                if not self.draining:
                    self.merge_pending()
            case Stage(buffer=buffer):
                self.ctr.add(STAGES_TAKEN)
                self.staging = buffer
            case Init(step=step, entries=entries, meta=meta):
                assert self.staging is not None
                rep.init_from(self.staging, step, entries, meta)
                if self.copy is not None:
                    self.copy.start(step, staged_tensors(self.staging, entries), meta, rep)
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
                    if self.copy is not None:
                        self.copy.end(rep.step)
                    self.drain_remote()
                    self.end.send(Closed(persister.persisted))
                    return False
                self.end.send(Flushed(persister.persisted))
            case _:
                raise unexpected(msg)
        return True

    def merge_pending(self) -> None:
        """Merge the steps received, in order. With a peer copy, a step is merged (into
        this shard and into the copy together) only with its source's part: one that
        never comes leaves it and every later step unmerged, so that this replica's shard
        and its copy always hold the same step."""
        rep, copy = self.rep, self.copy
        assert rep is not None
        while self.pending and not self.stuck:
            slot, step, meta = self.pending[0]
            row = self.slots[slot]
            part = None if copy is None else copy.take(step, final=self.orphan)
            if copy is not None and part is None:
                self.stuck = True
                print(
                    f"lowdiff: peer copy: {copy.why_not(step)}; this replica stays at step "
                    f"{rep.step}",
                    file=sys.stderr, flush=True,
                )  # fmt: skip
                return
            self.pending.pop(0)
            t0 = time.perf_counter_ns()  # the merge's own time, not the wait for the part
            rep.merge(row, step, meta)
            if copy is not None and part is not None:
                copy.merge(row, step, meta, part)
            self.ctr.add(REPLICA_MERGE_NS, time.perf_counter_ns() - t0)
            self.ctr.add(REPLICA_MERGES)
            self.ctr.add(SLOTS_DONE)
            self.ctr.add(BEAT)
            self.maybe_persist()

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
        # the steps in the pipe are received (their parts forwarded) before any is
        # merged, and the holder hears which was the last: no replica waits on another
        # that waits on it
        self.draining = self.orphan = True
        self.end.drain(self.handle, (Kind.STEP, Kind.STAGE, Kind.INIT))
        self.draining = False
        self.end.close()
        if self.copy is not None:
            self.copy.end(rep.step + len(self.pending))
        self.merge_pending()
        if rep.opt is None:
            return False
        rep.takeover_address = self.takeover.address()
        if self.copy is not None:
            self.copy.publish_orphaned()
        rep.publish(rp.STATE_ORPHANED)
        if persister.persisted < rep.step:
            persister.snapshot(rep)
        # the spare slots are made before the socket answers: a next trainer waits for them
        taken = self.takeover.wait(self, int(self.slots.shape[0]), self.cfg.idle_timeout)
        if not taken:
            persister.wait()
            self.drain_remote()
        return taken

    # ------------------------------------------------------------------ TakeoverHost
    def request_mismatch(self, msg: Any) -> str:
        rep = self.rep
        assert rep is not None
        why = request_mismatch(
            msg, self.cfg, _MATCH, self.root, what="replica", held=rep.step,
            holds=f"the replica is at {rep.step}", slots="snapshot slots",
        )  # fmt: skip
        if not why and source_of(msg.cfg) != source_of(self.cfg):
            why = "the new trainer's peer copies differ from the replica's"
        return why

    def make_segments(self, n: int) -> TrainerSegments:
        rep = self.rep
        assert rep is not None
        return TrainerSegments.make(self.takeover.segment_prefix(), n, rep.slot_rl.row_bytes)

    def take_on(self, msg: TakeoverRequest, made: TrainerSegments) -> int:
        rep, persister = self.rep, self.persister
        assert rep is not None and persister is not None
        rep.forget_slots()
        if self.copy is not None:
            self.copy.forget_slots()
        self.pending.clear()  # a step never merged is not the new trainer's
        self.stuck = self.orphan = False
        self.slots, self.ctr = made.slots, made.counters
        if self.acked >= 0:
            self.ctr.raise_to(PEER_ACKED, self.acked + 1)
        announce(self.uploader, self.ctr)
        self.cfg = dataclasses.replace(
            self.cfg,
            persist_every=msg.cfg.persist_every,
            idle_timeout=msg.cfg.idle_timeout,
            mtbf=msg.cfg.mtbf,
        )
        rep.publish(rp.STATE_RUNNING)
        return persister.persisted

    def switch_to(self, end: ChildEnd, durable: int) -> None:
        self.end = end  # the persist thread reports to it from here on
        assert self.persister is not None
        if self.persister.persisted > durable:  # finished in between: reported to nobody
            self.end.send(Durable(self.persister.persisted))

    def teardown(self) -> None:
        if self.rep is not None:
            with contextlib.suppress(Exception):
                self.rep.ctl.set_state(rp.STATE_CLOSED)
            self.rep.close()
        if self.copy is not None:
            self.copy.close()
        self.takeover.teardown()


def replica_main(
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
    signal.signal(signal.SIGTERM, proc.takeover.on_sigterm)

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

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
from lowdiff.engine.replica.optim import optimizer_class
from lowdiff.engine.replica.peer import Part, PeerLinks
from lowdiff.engine.replica.replica import Persister, Replica, staged_tensors
from lowdiff.engine.wire.configs import ReplicaConfig
from lowdiff.engine.wire.messages import Durable, Init, Merged, Stage, Step, TakeoverRequest
from lowdiff.errors import LowDiffError
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
        self.links: PeerLinks | None = None
        """With a peer copy: the links to the source and the holder (:mod:`.peer`)."""
        self.copy: Replica | None = None
        """With a peer copy: the copy of the source's shard."""
        self.copy_ctl: rp.ControlBlock | None = None
        self.mirror_row: torch.Tensor | None = None
        """A mirror's slot: the source's slot of each step is copied in."""
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
            self.links = PeerLinks(cfg.peer, self._acked, cfg.peer.timeout)
            name = f"lowdiff-{cfg.run_id[:16]}-pctl"
            self.copy_ctl = rp.ControlBlock(rp.create_segment(name, rp.CTL_BYTES))
            self.copy_ctl.write(rp.STATE_INIT, -1, {"run_id": cfg.run_id})
            if not cfg.peer.mirror:  # a mirror's layout comes with the source's state
                self.copy = self._new_copy(cfg.peer.layout, cfg.peer.shard)
            self.rep.head = {"peer": {"rank": cfg.peer.source, "ctl": name}}
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
                if self.links is not None:
                    # this shard's part goes to its holder as soon as it arrives (a
                    # mirror's: the whole slot)
                    row = self.slots[slot]
                    sent = {"row": row} if self.links.cfg.mirror else rep.per_rank_state(row)
                    self.links.forward("step", step + 1, sent, meta)
                self.pending.append((slot, step, codec.loads(meta)))
                if not self.draining:
                    self.merge_pending()
            case Stage(buffer=buffer):
                self.ctr.add(STAGES_TAKEN)
                self.staging = buffer
            case Init(step=step, entries=entries, meta=meta):
                assert self.staging is not None
                rep.init_from(self.staging, step, entries, meta)
                if self.links is not None:
                    self.init_copy(step, entries, meta)
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
                    if self.links is not None:
                        self.links.end(rep.step)
                    self.drain_remote()
                    self.end.send(Closed(persister.persisted))
                    return False
                self.end.send(Flushed(persister.persisted))
            case _:
                raise unexpected(msg)
        return True

    def _new_copy(self, layout_json: dict[str, Any], shard: list[int] | None) -> Replica:
        cfg = self.cfg
        assert cfg.peer is not None and self.copy_ctl is not None
        copy_cfg = dataclasses.replace(cfg, layout=layout_json, shard=shard)
        if cfg.peer.mirror:  # fed with the source's slots, laid out as its own
            copy_cfg = dataclasses.replace(
                copy_cfg, peer=dataclasses.replace(cfg.peer, slot_layout=layout_json)
            )
        return Replica(copy_cfg, self.copy_ctl, name="p")

    def init_copy(self, step: int, entries: list[Any], meta: dict[str, str]) -> None:
        """Send this shard's part of the state ``Init`` holds to the holder, and build the
        peer copy from the source's part and the source's shard this trainer staged (a
        mirror: from the source's whole state, its part)."""
        links, rep = self.links, self.rep
        assert links is not None and rep is not None and self.staging is not None
        staged = staged_tensors(self.staging, entries)
        if links.cfg.mirror:
            whole = {k: v for k, v in staged.items() if not k.startswith("peer/")}
            links.forward("init", step, whole, {**meta, "layout": self.cfg.layout})
        else:
            own = {k: meta[k] for k in ("rng", "scheduler", "extra") if k in meta}
            links.forward("init", step, rep.per_rank_state(), own)
        part = links.take_part(step, "init", links.timeout, final=False)
        if part is None:
            raise LowDiffError(
                f"peer copy: the replica of rank {links.cfg.source} sent no state within "
                f"{links.timeout:g} s (it listens at its node's ReplicaOptions.peer_address "
                "or LOWDIFF_PEER_ADDR; ReplicaOptions(peer_copies=False) turns peer copies off)"
            )
        if links.cfg.mirror:
            layout_json = part.meta.pop("layout")
            shard = codec.loads(part.meta["shard"]) if "shard" in part.meta else None
            self.copy = self._new_copy(layout_json, shard)
            self.mirror_row = torch.zeros(self.copy.slot_rl.row_bytes, dtype=torch.uint8)
            self.copy.init_from_tensors(part.tensors, step, part.meta)
        else:
            assert self.copy is not None
            tensors = {
                k.removeprefix("peer/"): v for k, v in staged.items() if k.startswith("peer/")
            }
            tensors.update(part.tensors)
            self.copy.init_from_tensors(
                tensors,
                step,
                {"optim": meta["peer_optim"], "model_aliases": meta["model_aliases"], **part.meta},
            )
        links.ack(step)

    def merge_pending(self) -> None:
        """Merge the steps received, in order. With a peer copy, a step is merged (into
        this shard and into the copy together) only with its source's part: one that
        never comes leaves it and every later step unmerged, so that this replica's shard
        and its copy always hold the same step."""
        rep, links = self.rep, self.links
        assert rep is not None
        while self.pending and not self.stuck:
            slot, step, meta = self.pending[0]
            row = self.slots[slot]
            part: Part | None = None
            if links is not None:
                part = links.take_part(step + 1, "step", links.timeout, final=self.orphan)
                if part is None:
                    self.stuck = True
                    why = "is gone" if links.source_gone else "sent none"
                    print(
                        f"lowdiff: peer copy: rank {links.cfg.source}'s replica {why} for step "
                        f"{step}; this replica stays at step {rep.step}",
                        file=sys.stderr, flush=True,
                    )  # fmt: skip
                    return
            self.pending.pop(0)
            t0 = time.perf_counter_ns()  # the merge's own time, not the wait for the part
            rep.merge(row, step, meta)
            if part is not None:
                assert self.copy is not None and links is not None
                if links.cfg.mirror:  # the source's own slot, and its own document
                    mirror = self.mirror_row
                    assert mirror is not None
                    mirror.copy_(part.tensors["row"])
                    self.copy.merge(mirror, step, codec.loads(part.meta))
                else:
                    source = codec.loads(part.meta)
                    self.copy.merge(row, step, _source_meta(meta, source), part.tensors)
                links.ack(self.copy.step)
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
        if self.links is not None:
            self.links.end(rep.step + len(self.pending))
        self.merge_pending()
        if rep.opt is None:
            return False
        rep.takeover_address = self.takeover.address()
        if self.copy is not None and self.copy.opt is not None:
            self.copy.publish(rp.STATE_ORPHANED)
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
        if not why and _copy_of(msg.cfg) != _copy_of(self.cfg):
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
        if self.links is not None:
            self.links.flush(5.0)
            self.links.close()
        if self.copy is not None:
            self.copy.close()
        if self.copy_ctl is not None:
            rp.unlink_and_close(self.copy_ctl.shm)
        self.takeover.teardown()


def _copy_of(cfg: ReplicaConfig) -> int | None:
    """The rank whose shard a replica of ``cfg`` keeps a copy of (None: none)."""
    return None if cfg.peer is None else cfg.peer.source


def _source_meta(own: dict[str, Any], source: dict[str, Any]) -> dict[str, Any]:
    """A step's document for the peer copy: the update's (every rank's: hyperparameters,
    gradients without a value, the clip's factor) from this trainer's, the per-rank state
    after it (scheduler, RNG, extra state) from the source's."""
    out = {k: v for k, v in own.items() if k != "extra"}
    out.update({k: source[k] for k in ("sched", "rng", "extra") if k in source})
    return out


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

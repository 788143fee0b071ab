"""The peer copy a LowDiff+ replica keeps of another node's shard (its *source*'s), and
how it is started, fed and published; the links it is fed through are
:mod:`lowdiff.engine.replica.peer`'s.

Under DDP the copy is a :class:`~lowdiff.engine.replica.replica.Replica` of the source's
shard, started from the source's parameters and optimizer state this rank's trainer
staged, and stepped with the gradients this rank's trainer snapshots anyway; the source's
part of each step is its per-rank state. Under ``fully_shard`` it is a mirror: started
from the source's whole state, stepped with the source's own snapshot slots.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lowdiff.engine.replica.peer import Part, PeerLinks
from lowdiff.engine.replica.replica import Replica
from lowdiff.engine.wire.configs import ReplicaConfig
from lowdiff.errors import LowDiffError
from lowdiff.format import codec
from lowdiff.proc import holder as rp


class PeerCopy:
    """One replica process's peer copy (see the module docstring).

    Args:
        cfg: the replica's configuration (``cfg.peer`` set).
        on_ack: called (on a thread) with each step the holder's copy of this replica's
            shard holds.
    """

    def __init__(self, cfg: ReplicaConfig, on_ack: Any) -> None:
        peer = cfg.peer
        assert peer is not None
        self.cfg, self.mirror = cfg, peer.mirror
        self.links = PeerLinks(peer, on_ack, peer.timeout)
        name = f"lowdiff-{cfg.run_id[:16]}-pctl"
        self.ctl = rp.ControlBlock(rp.create_segment(name, rp.CTL_BYTES))
        self.ctl.write(rp.STATE_INIT, -1, {"run_id": cfg.run_id})
        self.head = {"peer": {"rank": peer.source, "ctl": name}}
        """What the replica's own control block says of the copy (a new trainer finds it)."""
        self.replica: Replica | None = None
        if not self.mirror:  # a mirror's layout comes with the source's state
            self.replica = self._new(peer.layout, peer.shard)
        self._row: torch.Tensor | None = None
        """A mirror's slot: the source's slot of each step is copied in."""

    def _new(self, layout_json: dict[str, Any], shard: list[int] | None) -> Replica:
        cfg = self.cfg
        assert cfg.peer is not None
        copy_cfg = dataclasses.replace(cfg, layout=layout_json, shard=shard)
        if self.mirror:  # fed with the source's slots, laid out as its own
            copy_cfg = dataclasses.replace(
                copy_cfg, peer=dataclasses.replace(cfg.peer, slot_layout=layout_json)
            )
        return Replica(copy_cfg, self.ctl, name="p")

    # ------------------------------------------------------------------ this shard's part
    def forward(self, step: int, row: torch.Tensor, rep: Replica, meta: Any) -> None:
        """Send this replica's part of ``step`` (received in the slot ``row``, with the
        document ``meta``) to the holder: its per-rank state, a mirror's whole slot."""
        sent = {"row": row} if self.mirror else rep.per_rank_state(row)
        self.links.forward("step", step + 1, sent, meta)

    def end(self, step: int) -> None:
        """Tell the holder no part after ``step`` comes."""
        self.links.end(step)

    # ------------------------------------------------------------------ the copy
    def start(
        self, step: int, staged: dict[str, torch.Tensor], meta: dict[str, str], rep: Replica
    ) -> None:
        """(``Init``) Send this shard's part of the state the trainer staged to the
        holder, and build the copy from the source's part and what this trainer staged of
        the source's shard (a mirror: from the source's whole state, its part)."""
        links = self.links
        if self.mirror:
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
        if self.mirror:
            layout_json = part.meta.pop("layout")
            shard = codec.loads(part.meta["shard"]) if "shard" in part.meta else None
            self.replica = self._new(layout_json, shard)
            self._row = torch.zeros(self.replica.slot_rl.row_bytes, dtype=torch.uint8)
            self.replica.init_from_tensors(part.tensors, step, part.meta)
        else:
            assert self.replica is not None
            tensors = {
                k.removeprefix("peer/"): v for k, v in staged.items() if k.startswith("peer/")
            }
            tensors.update(part.tensors)
            optim = {"optim": meta["peer_optim"], "model_aliases": meta["model_aliases"]}
            self.replica.init_from_tensors(tensors, step, {**optim, **part.meta})
        links.ack(step)

    def take(self, step: int, final: bool) -> Part | None:
        """The source's part of ``step``'s update, once it arrived; None when it never
        will (see :meth:`PeerLinks.take_part`)."""
        return self.links.take_part(step + 1, "step", self.links.timeout, final=final)

    def why_not(self, step: int) -> str:
        """Why the source's part of ``step`` did not come (for the log)."""
        why = "is gone" if self.links.source_gone else "sent none"
        return f"rank {self.links.cfg.source}'s replica {why} for step {step}"

    def merge(self, row: torch.Tensor, step: int, meta: dict[str, Any], part: Part) -> None:
        """Apply ``step`` to the copy (this trainer's slot ``row`` and document ``meta``,
        the source's ``part``), and tell the source that its copy holds it."""
        copy = self.replica
        assert copy is not None
        if self.mirror:  # the source's own slot, and its own document
            assert self._row is not None
            self._row.copy_(part.tensors["row"])
            copy.merge(self._row, step, codec.loads(part.meta))
        else:
            copy.merge(row, step, _source_meta(meta, codec.loads(part.meta)), part.tensors)
        self.links.ack(copy.step)

    def publish_orphaned(self) -> None:
        """Offer the copy to a new trainer (before the replica's own publication)."""
        if self.replica is not None and self.replica.opt is not None:
            self.replica.publish(rp.STATE_ORPHANED)

    def forget_slots(self) -> None:
        if self.replica is not None:
            self.replica.forget_slots()

    def close(self) -> None:
        """Send what is queued, close the links, free the copy and its control block."""
        self.links.flush(5.0)
        self.links.close()
        if self.replica is not None:
            self.replica.close()
        rp.unlink_and_close(self.ctl.shm)


def source_of(cfg: ReplicaConfig) -> int | None:
    """The rank whose shard a replica of ``cfg`` keeps a copy of (None: none)."""
    return None if cfg.peer is None else cfg.peer.source


def _source_meta(own: dict[str, Any], source: dict[str, Any]) -> dict[str, Any]:
    """A step's document for the copy under DDP: the update's (every rank's:
    hyperparameters, gradients without a value, the clip's factor) from this trainer's,
    the per-rank state after it (scheduler, RNG, extra state) from the source's."""
    out = {k: v for k, v in own.items() if k != "extra"}
    out.update({k: source[k] for k in ("sched", "rng", "extra") if k in source})
    return out

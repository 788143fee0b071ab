"""Gemini's recovery sources, and the agreement of the ranks under DDP.

A state is recovered from, newest source first:

1. memory: the holder of this directory is alive and offers a complete checkpoint;
2. under DDP, the copy of this rank's state that its successor's holder keeps;
3. disk: the newest intact ``ckpt-*.pt``.

Under DDP (:class:`RingRecovery`) the ranks agree on the newest step that every rank can
recover from one of these sources, and each rank takes it from the first source that has
it; a damaged file on any rank takes that step out of the running, and the ranks agree
again.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lowdiff.errors import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    RecoveryError,
    RecoveryWarning,
)
from lowdiff.proc import holder as rp
from lowdiff.recovery.full_state import apply_full_state
from lowdiff.recovery.stats import RecoveryStats
from lowdiff_lab.baselines.base import load_state, published, quarantine, restore_state
from lowdiff_lab.baselines.gemini_protocol import PREFIX, SUFFIX, checkpoint_file
from lowdiff_lab.baselines.gemini_ring import PeerRing

_DAMAGED = "damaged"
"""What a rank reports when its source turned out damaged (the ranks agree again)."""


@dataclass(frozen=True)
class Training:
    """The live objects a recovered state goes into."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any | None

    def apply(
        self,
        tensors: dict[str, torch.Tensor],
        meta: dict[str, str],
        stats: RecoveryStats,
        where: str,
    ) -> None:
        """Load a checkpoint held in memory (its tensors and metadata)."""
        apply_full_state(
            tensors, meta, self.model, self.optimizer, self.scheduler, stats, where=where
        )

    def apply_live(self, live: rp.LiveReplica, stats: RecoveryStats) -> None:
        """Load the checkpoint a live holder offers."""
        self.apply(live.tensors(), live.doc["meta"], stats, "the in-memory checkpoint")

    def restore_file(self, full_dir: Path, step: int, stats: RecoveryStats) -> None:
        """Load the persisted checkpoint of ``step``.

        Raises:
            CorruptCheckpointError: the file is missing, damaged, or of another step.
        """
        path = checkpoint_file(full_dir, step)
        state = load_state(path, stats)
        if not isinstance(state, dict) or state.get("step") != step:
            raise CorruptCheckpointError(path, "its contents do not match its name")
        t0 = time.perf_counter()
        restore_state(state, self.model, self.optimizer, self.scheduler, where=path.name)
        stats.replay_s += time.perf_counter() - t0


class RingRecovery:
    """Recovery of one rank under DDP, in step with the others.

    Call sequence (every rank)::

        infos = rec.survey(live, peer, has_manifest, error)   # all-gather what each has
        step, stats = rec.restore(infos, live, peer, t0)      # agree, restore, re-agree
        disk_step = rec.drop_newer(step)                      # files of a lost timeline

    Args:
        ring: this rank's place in the ring.
        training: where the state goes.
        root, full_dir: this rank's directory and its ``full/``.
    """

    def __init__(self, ring: PeerRing, training: Training, root: Path, full_dir: Path) -> None:
        self.ring, self.training = ring, training
        self.root, self.full_dir = root, full_dir

    def held_copy(self, live: rp.LiveReplica | None) -> dict[str, Any] | None:
        """The copy of the predecessor's checkpoint that this rank's live holder keeps."""
        peer = live.doc.get("peer") if live is not None else None
        if peer is not None and peer.get("rank") != self.ring.prev:
            return None
        return peer

    def survey(
        self,
        live: rp.LiveReplica | None,
        peer: dict[str, Any] | None,
        has_manifest: bool,
        error: str,
    ) -> list[dict[str, Any]]:
        """What every rank can recover from (in memory, kept for its predecessor, on disk).

        Raises:
            CheckpointMismatchError: a rank's directory is not this training's.
        """
        infos = self.ring.gather(
            {
                "own": live.step if live is not None else -1,
                "held": -1 if peer is None else int(peer["step"]),
                "disk": [s for s, _ in published(self.full_dir, PREFIX, SUFFIX)],
                "manifest": has_manifest,
                "error": error,
            }
        )
        errors = [f"rank {r}: {i['error']}" for r, i in enumerate(infos) if i["error"]]
        if errors:
            raise CheckpointMismatchError("; ".join(errors))
        return infos

    def restore(
        self,
        infos: list[dict[str, Any]],
        live: rp.LiveReplica | None,
        peer: dict[str, Any] | None,
        t0: float,
    ) -> tuple[int, RecoveryStats]:
        """Restore the newest step every rank can recover; returns it with the stats."""
        w = self.ring.world_size
        bad: list[set[int]] = [set() for _ in range(w)]
        while True:
            step, sources = self._agree(infos, bad)
            stats = RecoveryStats(full_step=step, step=step, source=sources[self.ring.rank])
            received = self._return_copies(sources, peer, stats)
            stats.read_s += time.perf_counter() - t0
            failed: str | None = None
            fatal: BaseException | None = None
            try:
                self._restore_from(sources[self.ring.rank], step, live, received, stats)
            except CorruptCheckpointError as e:
                warnings.warn(
                    f"recovery passed over {e.path}: {e.reason}", RecoveryWarning, stacklevel=4
                )
                quarantine(self.root, e.path)
                failed = _DAMAGED
            except Exception as e:  # noqa: BLE001 -- every rank must learn of it, not hang
                fatal, failed = e, f"{type(e).__name__}: {e}"
            fails = self.ring.gather(failed)
            if fatal is not None:
                raise fatal
            errors = [f"rank {r}: {f}" for r, f in enumerate(fails) if f not in (None, _DAMAGED)]
            if errors:
                raise RecoveryError("recovery failed on another rank: " + "; ".join(errors))
            if not any(fails):
                return step, stats
            for r, f in enumerate(fails):
                if f:
                    bad[r].add(step)

    def _agree(self, infos: list[dict[str, Any]], bad: list[set[int]]) -> tuple[int, list[str]]:
        """The newest step every rank can recover, and each rank's source of it."""
        w = self.ring.world_size
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
        return step, sources

    def _return_copies(
        self, sources: list[str], peer: dict[str, Any] | None, stats: RecoveryStats
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
        """Send the copy this rank keeps to its predecessor, receive this rank's own copy
        from the successor, where the agreed sources say so."""
        send, recv = sources[self.ring.prev] == "peer", sources[self.ring.rank] == "peer"
        if not (send or recv):
            return None
        if send:
            assert peer is not None
        got = self.ring.return_copies(peer if send else None, recv)
        if got is None:
            return None
        tensors, meta, nbytes = got
        stats.bytes_read += nbytes
        return tensors, meta

    def _restore_from(
        self,
        source: str,
        step: int,
        live: rp.LiveReplica | None,
        received: tuple[dict[str, torch.Tensor], dict[str, str]] | None,
        stats: RecoveryStats,
    ) -> None:
        if source == "memory":
            assert live is not None
            self.training.apply_live(live, stats)
        elif source == "peer":
            assert received is not None
            self.training.apply(
                received[0], received[1], stats, f"the copy held by rank {self.ring.next}"
            )
        else:
            self.training.restore_file(self.full_dir, step, stats)

    def drop_newer(self, step: int) -> int:
        """Quarantine the files newer than ``step`` (written on a timeline that was given
        up); returns the newest step left on disk (-1: none)."""
        for s, p in published(self.full_dir, PREFIX, SUFFIX):
            if s > step:
                quarantine(self.root, p)
        return max(
            [s for s, _ in published(self.full_dir, PREFIX, SUFFIX) if s <= step], default=-1
        )

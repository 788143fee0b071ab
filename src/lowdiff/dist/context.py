"""The process group a Checkpointer runs in, shard assignment, and cross-rank agreement."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

RANK_DIR = "rank-{rank:05d}"


def rank_dir(root: Path, rank: int) -> Path:
    """Where rank ``rank`` of a distributed job keeps its shard."""
    return root / RANK_DIR.format(rank=rank)


def assign_shards(numels: Sequence[int], world_size: int) -> list[int]:
    """Owner rank of each parameter: balanced by element count, deterministic.

    Largest parameters first, each to the rank with the fewest elements so far (ties:
    the lowest rank; equal sizes: the lower parameter index). Every rank computes the
    same list from the same model.

    Example:
        >>> assign_shards([10, 1, 6, 5], 2)
        [0, 1, 1, 1]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    load = [0] * world_size
    owner = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += numels[i]
    return owner


@dataclass
class DistContext:
    """Rank, world size and process group of a distributed Checkpointer."""

    rank: int
    world_size: int
    group: Any
    device: torch.device
    """Where collective tensors live (CPU for gloo, the current GPU for NCCL)."""

    def _t(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int64, device=self.device)

    def all_min(self, values: Sequence[int]) -> list[int]:
        t = self._t(values)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return [int(v) for v in t.tolist()]

    def all_max(self, values: Sequence[int]) -> list[int]:
        t = self._t(values)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in t.tolist()]

    def agree(self, value: int, what: str) -> int:
        """Check that every rank holds the same ``value``; raise naming ``what`` otherwise."""
        lo, hi = self.all_min([value])[0], self.all_max([value])[0]
        if lo != hi:
            from lowdiff.errors import RecoveryError

            raise RecoveryError(
                f"the ranks disagree on {what}: values range from {lo} to {hi} (this is rank "
                f"{self.rank} with {value})"
            )
        return value

    def barrier(self) -> None:
        # an all-reduce, not dist.barrier(): NCCL's barrier needs a device guess
        self.all_min([0])

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group, device=self.device)
        return box[0]


def detect(model: torch.nn.Module) -> DistContext | None:
    """A :class:`DistContext` when ``model`` is DDP-wrapped in an initialised group, else None.

    Raises:
        ValueError: ``model`` is DDP-wrapped but no process group is initialised.
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "the model is wrapped in DistributedDataParallel but no process group is initialised; "
            "call torch.distributed.init_process_group() first"
        )
    group = getattr(model, "process_group", None) or dist.group.WORLD
    backend = dist.get_backend(group)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else torch.device("cpu")
    )
    return DistContext(
        dist.get_rank(group), dist.get_world_size(group), group, device
    )

"""The process group a Checkpointer runs in, shard assignment, and cross-rank agreement."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lowdiff.errors import InvalidArgumentError

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
        raise InvalidArgumentError(f"world_size must be >= 1, got {world_size}")
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
    sharded: bool = False
    """The model is sharded with ``fully_shard`` (FSDP2): each rank holds, checkpoints and
    restores its own shard of every parameter, instead of one shard of DDP's replicas."""

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

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (small, picklable), on every rank."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def exchange(
        self, tensors: dict[str, torch.Tensor], meta: dict[str, str]
    ) -> list[tuple[dict[str, torch.Tensor], dict[str, str]]]:
        """Every rank's ``(tensors, meta)``, on every rank (broadcasts of raw bytes, no pickle)."""
        return self.gather_parts(list(range(self.world_size)), {self.rank: (tensors, meta)})

    def gather_parts(
        self,
        sources: Sequence[int],
        mine: dict[int, tuple[dict[str, torch.Tensor], dict[str, str]]],
    ) -> list[tuple[dict[str, torch.Tensor], dict[str, str]]]:
        """Part ``i`` of ``len(sources)``, on every rank, from rank ``sources[i]``, which
        holds it in ``mine[i]`` (broadcasts of raw bytes, no pickle)."""
        from lowdiff.format.dtypes import dtype_from_name, dtype_name
        from lowdiff.format.sfile import TensorEntry, plan, view_tensors

        out = []
        for i, src in enumerate(sources):
            if src == self.rank:
                tensors, meta = mine[i]
                entries, size = plan((k, v.dtype, tuple(v.shape)) for k, v in tensors.items())
                head = json.dumps(
                    {
                        "entries": [
                            [e.name, dtype_name(e.dtype), list(e.shape), e.start, e.end]
                            for e in entries
                        ],
                        "meta": meta,
                    }
                ).encode()
                sizes = self._t([len(head), size])
            else:
                sizes = self._t([0, 0])
            dist.broadcast(sizes, src=src, group=self.group)
            n_head, n_data = (int(v) for v in sizes.tolist())
            head_t = torch.empty(n_head, dtype=torch.uint8, device=self.device)
            data = torch.empty(n_data, dtype=torch.uint8, device=self.device)
            if src == self.rank:
                head_t.copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
                views = view_tensors(entries, data)
                for k, v in tensors.items():
                    views[k].copy_(v)
            dist.broadcast(head_t, src=src, group=self.group)
            dist.broadcast(data, src=src, group=self.group)
            doc = json.loads(bytes(head_t.cpu().tolist()).decode())
            ents = [
                TensorEntry(
                    str(n), dtype_from_name(dt), tuple(int(x) for x in shape), int(a), int(b)
                )
                for n, dt, shape, a, b in doc["entries"]
            ]
            got = view_tensors(ents, data.cpu())
            out.append(({k: v.clone() for k, v in got.items()}, dict(doc["meta"])))
        return out


class JobMin:
    """The minimum over the job of per-rank, non-decreasing values (durable steps).

    Each rank holds ``width`` figures (the local tier's durable step, the remote tier's);
    one all-reduce carries them all. :meth:`refresh` is called by every rank at the same
    point of every step: it collects the previous step's all-reduce (long done by then)
    and starts the next one in the background, so the job-wide values cost no wait.
    :attr:`values` are therefore the minima as of the previous step: never more than any
    rank has, at most a step behind. :meth:`now` is a blocking all-reduce for collective
    calls (``flush()``).
    """

    def __init__(self, ctx: DistContext, width: int = 1) -> None:
        self.ctx = ctx
        self.values = [-1] * width
        self._t: torch.Tensor | None = None
        self._work: Any = None

    @property
    def value(self) -> int:
        """The first figure (the local tier's durable step)."""
        return self.values[0]

    def _take(self, got: Sequence[int]) -> None:
        self.values = [max(a, int(b)) for a, b in zip(self.values, got, strict=True)]

    def at_least(self, index: int, value: int) -> None:
        """What every rank knows without an exchange: figure ``index`` is at least
        ``value`` (every rank resumed from its shard's files of that step)."""
        self.values[index] = max(self.values[index], value)

    def _collect(self) -> None:
        if self._work is not None:
            self._work.wait()
            assert self._t is not None
            self._take(self._t.tolist())
            self._work = self._t = None

    def refresh(self, *local: int) -> None:
        try:
            self._collect()
        except RuntimeError:
            # the previous exchange failed: a peer died before it took part. The values
            # stay as they were (they never run ahead of any rank), and the trainer learns
            # of the death from its own next collective (DDP's), not from this bookkeeping
            self._work = self._t = None
        self._t = self.ctx._t(local)
        self._work = dist.all_reduce(
            self._t, op=dist.ReduceOp.MIN, group=self.ctx.group, async_op=True
        )

    def now(self, *local: int) -> list[int]:
        self._collect()
        self._take(self.ctx.all_min(local))
        return list(self.values)

    def settle(self, timeout: float = 5.0) -> bool:
        """Collect the all-reduce in flight if it completes within ``timeout`` seconds
        (at close: a peer that died, before or while taking part, must not hang or fail
        this rank; :attr:`values` then stay what they were). Returns whether it did."""
        import time

        deadline = time.monotonic() + timeout
        while self._work is not None and time.monotonic() < deadline:
            if self._work.is_completed():
                try:
                    self._collect()
                except RuntimeError:  # the exchange failed (a peer died): keep the values
                    self._work = self._t = None
                    return False
                return True
            time.sleep(0.01)
        done = self._work is None
        self._work = self._t = None
        return done


def detect(model: torch.nn.Module) -> DistContext | None:
    """A :class:`DistContext` when ``model`` is DDP-wrapped in an initialised group, or
    sharded with ``fully_shard`` (``sharded``), else None.

    Raises:
        ValueError: ``model`` is DDP-wrapped but no process group is initialised.
    """
    from torch.nn.parallel import DistributedDataParallel

    from lowdiff.state.sharded import fsdp2_group

    sharded_over = fsdp2_group(model)
    if sharded_over is not None:
        return _context(sharded_over, sharded=True)
    if not isinstance(model, DistributedDataParallel):
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise InvalidArgumentError(
            "the model is wrapped in DistributedDataParallel but no process group is initialised; "
            "call torch.distributed.init_process_group() first"
        )
    return _context(getattr(model, "process_group", None) or dist.group.WORLD)


def _context(group: Any, sharded: bool = False) -> DistContext:
    backend = dist.get_backend(group)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else torch.device("cpu")
    )
    return DistContext(
        dist.get_rank(group), dist.get_world_size(group), group, device, sharded=sharded
    )

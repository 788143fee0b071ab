"""Layer-wise gradient snapshots for ``strategy="lowdiff+"``.

As soon as a parameter's gradient is final in backward (its
``register_post_accumulate_grad_hook`` fires), its copy into the step's pre-allocated
host slot starts, while backward goes on for the earlier layers:

- on CPU the slot is shared memory and the copies run on one background thread (PyTorch
  copies release the GIL), in hook order;
- on CUDA the slot memory is pinned, and copies are issued ``non_blocking`` on a side
  stream after an event recorded on the compute stream; ``record_stream`` keeps the
  gradient's memory from being reused before the copy is done.

Small gradients that sit next to each other in the slot are grouped into blocks of
about ``block_bytes`` and copied when the whole block is ready (on CUDA: packed on the
device and moved with one transfer); large gradients are copied in ``chunk_bytes``
chunks. Call sequence:

0) ``GradSnapshotter(...)`` registers the hooks.
1) (autograd, per parameter) ``_on_grad``: the first hook of a step takes a free slot
   (waiting if the replica lags ``max_lag`` steps behind: the bounded lag).
2) ``finish()`` in ``Checkpointer.step()`` before ``optimizer.step()``: waits for every
   copy of the step, re-copies gradients that changed after their hook (gradient
   clipping, detected by the tensors' version counters) or that had no hook (set by
   hand), and returns the slot and the parameters without gradient.
3) ``close()`` removes the hooks.

The distributed version plugs in at ``_on_grad``: a DDP communication hook calls it per
bucket once the bucket's allreduce is done.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from lowdiff.engine.state import ParamInfo


@dataclass
class _Block:
    members: list[int]  # positions in the parameter list
    start: int  # byte offset in the row
    end: int
    ready: int = 0
    chunked: bool = False


@dataclass
class SnapshotStats:
    steps: int = 0
    slot_wait_s: float = 0.0
    finish_wait_s: float = 0.0
    recopied: int = 0
    """Gradients copied again at step() because they changed after their hook."""
    late: int = 0
    """Gradients that had no hook call (set outside backward)."""
    extra: dict[str, float] = field(default_factory=dict)


def plan_blocks(offsets: list[tuple[int, int]], block_bytes: int) -> list[_Block]:
    """Group parameters (given as (start, end) byte ranges in row order) into blocks."""
    order = sorted(range(len(offsets)), key=lambda k: offsets[k][0])
    blocks: list[_Block] = []
    for k in order:
        a, b = offsets[k]
        if b - a > block_bytes:
            blocks.append(_Block([k], a, b, chunked=True))
            continue
        last = blocks[-1] if blocks else None
        if (
            last is not None
            and not last.chunked
            and last.end == a
            and b - last.start <= block_bytes
        ):
            last.members.append(k)
            last.end = b
        else:
            blocks.append(_Block([k], a, b))
    return blocks


class GradSnapshotter:
    """Snapshots every optimized parameter's gradient into a host slot during backward."""

    def __init__(
        self,
        params: list[tuple[ParamInfo, torch.nn.Parameter]],
        slot_rows: list[torch.Tensor],
        row_views: list[dict[str, torch.Tensor]],
        acquire_slot: Callable[[], int],
        *,
        block_bytes: int = 1 << 20,
        chunk_bytes: int = 8 << 20,
        autograd_hooks: bool = True,
    ) -> None:
        self.params = params
        self.rows = slot_rows
        self.row_views = row_views
        self.acquire_slot = acquire_slot
        self.chunk_bytes = chunk_bytes
        self.stats = SnapshotStats()
        first = row_views[0]
        base = slot_rows[0].data_ptr()
        offsets = []
        for info, _ in params:
            v = first[f"g{info.index}.values"]
            start = v.data_ptr() - base
            offsets.append((start, start + v.numel() * v.element_size()))
        self.blocks = plan_blocks(offsets, block_bytes)
        self.block_of = [0] * len(params)
        for bi, b in enumerate(self.blocks):
            for k in b.members:
                self.block_of[k] = bi
        dev = params[0][1].device if params else torch.device("cpu")
        self.cuda = dev.type == "cuda"
        self.stream = torch.cuda.Stream(device=dev) if self.cuda else None
        self.pool = (
            None
            if self.cuda
            else ThreadPoolExecutor(max_workers=1, thread_name_prefix="lowdiff-snapshot")
        )
        self.lock = threading.Lock()
        self._reset()
        # under DDP the communication hook feeds on_reduced_grad() instead: the gradient
        # an autograd hook sees is not yet averaged over the ranks
        self.handles = (
            [p.register_post_accumulate_grad_hook(self._hook(k)) for k, (_, p) in enumerate(params)]
            if autograd_hooks
            else []
        )

    def _reset(self) -> None:
        self.slot: int | None = None
        self.seen: list[tuple[torch.Tensor, int] | None] = [None] * len(self.params)
        self.futures: list[Future[Any]] = []
        self.events: list[Any] = []
        for b in self.blocks:
            b.ready = 0

    def _hook(self, k: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            self._on_grad(k)

        return hook

    def _take_slot(self) -> int:
        if self.slot is None:
            t0 = time.perf_counter()
            self.slot = self.acquire_slot()
            self.stats.slot_wait_s += time.perf_counter() - t0
        return self.slot

    def on_reduced_grad(self, k: int, grad: torch.Tensor) -> None:
        """DDP: the averaged gradient ``k`` (a view into its bucket) is ready; may run on any thread."""
        with self.lock:
            self._on_grad(k, grad)

    def _on_grad(self, k: int, grad: torch.Tensor | None = None) -> None:
        """Gradient ``k`` is final for this backward: copy its block once complete."""
        if grad is None:
            grad = self.params[k][1].grad
        if grad is None:
            return
        slot = self._take_slot()
        first_time = self.seen[k] is None
        self.seen[k] = (grad, grad._version)
        b = self.blocks[self.block_of[k]]
        if first_time:
            b.ready += 1
            if b.ready < len(b.members):
                return
        elif b.ready < len(b.members):
            return  # accumulation over micro-batches: the block is copied once complete
        self._copy_block(b, slot)

    def _dst(self, slot: int, k: int) -> torch.Tensor:
        info = self.params[k][0]
        return self.row_views[slot][f"g{info.index}.values"]

    def _copy_block(self, b: _Block, slot: int) -> None:
        grads = []
        for k in b.members:
            entry = self.seen[k]
            assert entry is not None
            grads.append(entry[0])
        if self.cuda:
            self._copy_block_cuda(b, slot, grads)
        else:
            assert self.pool is not None
            self.futures.append(
                self.pool.submit(self._copy_cpu, [self._dst(slot, k) for k in b.members], grads)
            )

    def _copy_cpu(self, dsts: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        for dst, g in zip(dsts, grads, strict=True):
            src = g.detach().reshape(-1)
            n = dst.numel()
            step = max(1, self.chunk_bytes // max(1, dst.element_size()))
            for i in range(0, n, step):
                dst[i : i + step].copy_(src[i : i + step])

    def _copy_block_cuda(self, b: _Block, slot: int, grads: list[torch.Tensor]) -> None:
        assert self.stream is not None
        compute = torch.cuda.current_stream(grads[0].device)
        ready = torch.cuda.Event()
        ready.record(compute)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            for g in grads:
                g.record_stream(self.stream)  # keep the memory until the copy is done
            if len(grads) > 1:
                packed = torch.cat([g.detach().reshape(-1) for g in grads])
                region = self.rows[slot][b.start : b.end].view(packed.dtype)
                region.copy_(packed, non_blocking=True)
            else:
                self._copy_cpu_like(self._dst(slot, b.members[0]), grads[0])
            done = torch.cuda.Event()
            done.record(self.stream)
            self.events.append(done)

    def _copy_cpu_like(self, dst: torch.Tensor, g: torch.Tensor) -> None:
        src = g.detach().reshape(-1)
        step = max(1, self.chunk_bytes // max(1, dst.element_size()))
        for i in range(0, dst.numel(), step):
            dst[i : i + step].copy_(src[i : i + step], non_blocking=True)

    def finish(self) -> tuple[int, list[int]]:
        """Complete the step's snapshot; returns (slot, optimizer indices without gradient)."""
        t0 = time.perf_counter()
        for f in self.futures:
            f.result()
        for e in self.events:
            e.synchronize()
        self.stats.finish_wait_s += time.perf_counter() - t0
        slot = self._take_slot()
        for b in self.blocks:
            if 0 < b.ready < len(b.members):
                # some members had no gradient this step, so the block never became
                # complete: copy the members that did get one
                for k in b.members:
                    seen = self.seen[k]
                    if seen is not None:
                        self._dst(slot, k).copy_(seen[0].detach().reshape(-1))
        nograd: list[int] = []
        for k, (info, p) in enumerate(self.params):
            g = p.grad
            if g is None:
                nograd.append(info.index)
                continue
            seen = self.seen[k]
            if seen is not None and seen[0] is not g:
                # DDP copied the bucket into .grad: the snapshot holds if the bucket is
                # unchanged since and .grad still equals it (clipping changes .grad only)
                same = seen[1] == seen[0]._version and torch.equal(seen[0].view_as(g), g)
                if same:
                    continue
                seen = (seen[0], -1)
            if seen is None or seen[0] is not g or seen[1] != g._version:
                # changed after its hook (e.g. clipping), or set outside backward
                if seen is None:
                    self.stats.late += 1
                else:
                    self.stats.recopied += 1
                dst = self._dst(slot, k)
                dst.copy_(g.detach().reshape(-1))
        self.stats.steps += 1
        self._reset()
        return slot, nograd

    def abandon(self) -> int | None:
        """Forget a half-taken step (after an error); returns the slot it held, if any."""
        for f in self.futures:
            f.exception()
        slot = self.slot
        self._reset()
        return slot

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        if self.pool is not None:
            self.pool.shutdown(wait=True)

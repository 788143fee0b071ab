"""Layer-wise gradient snapshots for ``method="lowdiff+"`` (their plan:
:mod:`lowdiff.engine.trainer.snapshot_plan`).

As soon as a parameter's gradient is final in backward (its
``register_post_accumulate_grad_hook`` fires), its copy into the step's pre-allocated
host slot starts, while backward goes on for the earlier layers:

- on CPU the slot is shared memory and each block is one ``torch._foreach_copy_`` into
  destination views built once per slot. Where the copy runs is ``copy_mode``:
  ``"inline"`` copies the block in the hook, on the thread running backward, with
  PyTorch's intra-op threads, while the gradients are still in cache; ``"thread"`` hands
  it to one background thread (PyTorch copies release the GIL) in hook order, with
  large gradients cut into pieces small enough to be copied by that thread alone
  (``SERIAL_ELEMS``). ``"auto"`` (the default) takes ``"thread"`` only when a core is
  left over by PyTorch's intra-op threads (:func:`cpu_copy_mode`): otherwise backward
  already keeps every core busy, a copy thread can only take its cores in turn, and
  the inline copy moves the same bytes at memcpy speed in less time;
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

The distributed version plugs in at ``_on_grad``: a DDP communication hook calls
``on_reduced_grad`` per bucket once the bucket's allreduce is done, with the averaged
gradient as a view into the bucket. DDP then copies the bucket into ``.grad`` (unless
``gradient_as_bucket_view`` makes ``.grad`` that very memory). ``finish()`` tells from
version counters alone, without reading any gradient, that ``.grad`` still holds the
bytes the hook copied:

- the bucket view's counter has not moved since the hook, and ``.grad`` is the tensor
  it was at the hook;
- if ``.grad`` is the bucket's memory, its counter has not moved either;
- otherwise the parameter was accumulated on this rank during the step (a bare
  post-accumulate hook notes that), so DDP copied the bucket into ``.grad``, exactly
  once: its counter is one past its value at the hook.

A counter further on means a change after the hook (clipping, scaling): re-copied.
What the counters cannot settle (a parameter this rank did not use, under
``find_unused_parameters``: DDP leaves the ``.grad`` of one no rank used as it was, and
creates the ``.grad`` of one only other ranks used) is compared with the bucket byte for
byte, all such gradients in one comparison, and re-copied where they differ.

Under ``fully_shard`` (FSDP2) each rank snapshots its own shard: the post-accumulate hook
fires once the reduce-scatter has left the rank's gradient shard in ``.grad`` (a
``DTensor``), whose local tensor is copied. In-place ops on a ``DTensor`` (gradient
clipping's scaling) run on the local tensor beneath autograd and move no version counter,
so ``finish()`` (``compare_bytes``) compares every snapshotted gradient with its slot copy,
all in one comparison, and re-copies those that differ.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from lowdiff.engine.trainer.snapshot_plan import (
    CHANGED,
    UNSURE,
    Block,
    ClipRecord,
    CpuCopies,
    SnapshotStats,
    no_grad_thread,
    plan_blocks,
    row_offsets,
    same_bytes,
    verdict,
)
from lowdiff.errors import InvalidArgumentError
from lowdiff.state.capture import ParamInfo, sparse_gradient_error
from lowdiff.state.sharded import local

COPY_MODES = ("auto", "inline", "thread")
"""Where CPU gradient copies run during backward (module docstring)."""


def cpu_copy_mode(mode: str = "auto") -> str:
    """``"inline"`` or ``"thread"``: ``mode`` itself, or for ``"auto"``, ``"thread"`` only
    when this process may run on more cores than PyTorch's intra-op threads use.

    Raises:
        ValueError: If ``mode`` is not one of :data:`COPY_MODES`.
    """
    if mode not in COPY_MODES:
        raise InvalidArgumentError(f"copy_mode must be one of {COPY_MODES}, got {mode!r}")
    if mode != "auto":
        return mode
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return "thread" if cores > torch.get_num_threads() else "inline"


class GradSnapshotter:
    """Snapshots every optimized parameter's gradient into a host slot during backward."""

    def __init__(
        self,
        params: list[tuple[ParamInfo, torch.nn.Parameter]],
        slot_rows: list[torch.Tensor],
        row_views: Sequence[dict[str, torch.Tensor]],
        acquire_slot: Callable[[], int],
        *,
        block_bytes: int = 1 << 20,
        chunk_bytes: int = 8 << 20,
        autograd_hooks: bool = True,
        copy_mode: str = "auto",
        compare_bytes: bool = False,
    ) -> None:
        self.params = params
        self.rows = slot_rows
        self.row_views = row_views
        self.acquire_slot = acquire_slot
        self.chunk_bytes = chunk_bytes
        self.stats = SnapshotStats()
        self.blocks = plan_blocks(row_offsets(params, slot_rows, row_views), block_bytes)
        self.block_of = [0] * len(params)
        for bi, b in enumerate(self.blocks):
            for k in b.members:
                self.block_of[k] = bi
        dev = params[0][1].device if params else torch.device("cpu")
        self.cuda = dev.type == "cuda"
        # Per slot and parameter, the destination shaped as the parameter, so a gradient
        # of any strides lands in its logical (row-major) order
        self.dsts = [
            [views[f"g{info.index}.values"].view(info.shape) for info, _ in params]
            for views in row_views
        ]
        self.compare_bytes = compare_bytes
        """Settle at finish() by comparing bytes, not version counters (module docstring)."""
        self.copy_mode = "cuda" if self.cuda else cpu_copy_mode(copy_mode)
        """``"cuda"``, or on CPU ``"inline"`` / ``"thread"`` (module docstring)."""
        self.cpu = CpuCopies() if self.cuda else CpuCopies.plan(self.blocks, self.dsts, chunk_bytes)
        self.owner = threading.get_ident()
        """The thread that runs backward (CPU autograd runs it on the calling thread)."""
        self.stream = torch.cuda.Stream(device=dev) if self.cuda else None
        self.pool = (
            None
            if self.copy_mode != "thread"
            else ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="lowdiff-snapshot", initializer=no_grad_thread
            )
        )
        self.lock = threading.Lock()
        self.can_defer = autograd_hooks
        self.deferred = False
        """This step's copies wait for finish() (see SnapshotStats.deferred)."""
        self.last_scale: tuple[str, float, list[int]] | None = None
        """(dtype name, factor, optimizer indices to leave as they are): how the replica
        multiplies the gradients in the slot of the step finished last (a clip made
        through :meth:`record_scaling`), or None."""
        self._reset()
        # Under DDP the communication hook feeds on_reduced_grad() instead: the gradient an
        # autograd hook sees is not yet averaged over the ranks. A bare hook still notes
        # which parameters this rank accumulated, which finish() needs (module docstring).
        on_acc = self._hook if autograd_hooks else self._mark
        self.handles = [
            p.register_post_accumulate_grad_hook(on_acc(k)) for k, (_, p) in enumerate(params)
        ]

    def _reset(self) -> None:
        self.slot: int | None = None
        self.seen: list[tuple[torch.Tensor, int] | None] = [None] * len(self.params)
        # DDP: .grad and its version counter when the hook handed over the bucket view
        self.grad_at: list[tuple[torch.Tensor | None, int] | None] = [None] * len(self.params)
        self.used = [False] * len(self.params)
        self.futures: list[Future[Any]] = []
        self.events: list[Any] = []
        for b in self.blocks:
            b.ready = 0
        self.clip: ClipRecord | None = None
        """The step's clip made through :meth:`record_scaling`, or None."""
        self.clip_broken = False
        """A second clip in one step: no single factor describes the change."""

    def _hook(self, k: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            self._on_grad(k)

        return hook

    def _mark(self, k: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            self.used[k] = True

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
            g = self.params[k][1].grad
            self.grad_at[k] = (g, -1 if g is None else g._version)
            self._on_grad(k, grad)

    def _on_grad(self, k: int, grad: torch.Tensor | None = None) -> None:
        """Gradient ``k`` is final for this backward: copy its block once complete."""
        if grad is None:
            grad = self._grad(k)
        if grad is None:
            return
        if grad.is_sparse:
            raise InvalidArgumentError(sparse_gradient_error(self.params[k][0].name))
        if self.deferred:
            # finish() copies every gradient (and takes the slot); what it needs of the
            # hook is the gradient and its version, to see whether it still changes
            self.seen[k] = (grad, grad._version)
            return
        slot = self._take_slot()
        first_time = self.seen[k] is None
        self.seen[k] = (grad, grad._version)
        bi = self.block_of[k]
        b = self.blocks[bi]
        if first_time:
            b.ready += 1
            if b.ready < len(b.members):
                return
        elif b.ready < len(b.members):
            return  # accumulation over micro-batches: the block is copied once complete
        self._copy_block(bi, b, slot)

    def _grad(self, k: int) -> torch.Tensor | None:
        """``.grad`` of parameter ``k``: under ``fully_shard`` this rank's shard of it."""
        g = self.params[k][1].grad
        return None if g is None else local(g)

    def _dst(self, slot: int, k: int) -> torch.Tensor:
        info = self.params[k][0]
        return self.row_views[slot][f"g{info.index}.values"]

    def _copy_block(self, bi: int, b: Block, slot: int) -> None:
        seen = self.seen
        grads = [seen[k][0] for k in b.members]  # type: ignore[index]
        if self.cuda:
            self._copy_block_cuda(b, slot, grads)
            return
        nbytes = b.end - b.start
        cpu = self.cpu
        if self.pool is not None:
            args = (cpu.block_dsts[slot][bi], grads, cpu.pieces[bi], nbytes)
            self.futures.append(self.pool.submit(self._copy_cpu, *args))
            return
        with torch.no_grad():  # under create_graph=True the gradients require grad
            if threading.get_ident() == self.owner:
                self._copy_cpu(cpu.whole_dsts[slot][bi], grads, None, nbytes)
            else:
                # a DDP communication hook's callback, on the process group's thread while
                # backward goes on: pieces its thread copies alone, no OpenMP team of its
                # own beside backward's
                self._copy_cpu(cpu.block_dsts[slot][bi], grads, cpu.pieces[bi], nbytes)

    def _copy_cpu(
        self,
        dsts: list[torch.Tensor],
        grads: list[torch.Tensor],
        cuts: list[int] | None,
        nbytes: int,
    ) -> None:
        """One block in one foreach copy. Inline on the trainer's thread: every gradient
        whole. On any other thread: the small gradients whole, the others in pieces small
        enough to run on that thread alone (see SERIAL_ELEMS)."""
        t0 = time.perf_counter()
        if cuts is None:
            srcs: list[torch.Tensor] = grads
        else:
            srcs = []
            for g, n in zip(grads, cuts, strict=True):
                if n:
                    # a view when contiguous; a strided gradient is read in logical order
                    srcs.extend(g.reshape(-1).split(n))
                else:
                    srcs.append(g)
        torch._foreach_copy_(dsts, srcs)
        self.stats.gradient_copies += len(grads)
        self.stats.copy_s += time.perf_counter() - t0
        self.stats.copy_bytes += nbytes

    def _copy_block_cuda(self, b: Block, slot: int, grads: list[torch.Tensor]) -> None:
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
        self.stats.gradient_copies += len(grads)

    def _copy_cpu_like(self, dst: torch.Tensor, g: torch.Tensor) -> None:
        src = g.detach().reshape(-1)
        step = max(1, self.chunk_bytes // max(1, dst.element_size()))
        for i in range(0, dst.numel(), step):
            dst[i : i + step].copy_(src[i : i + step], non_blocking=True)

    def finish(self) -> tuple[int, list[int]]:
        """Complete the step's snapshot; returns (slot, optimizer indices without gradient).
        :attr:`last_scale` says what the replica multiplies the slot by."""
        t0 = time.perf_counter()
        for f in self.futures:
            f.result()
        for e in self.events:
            e.synchronize()
        self.stats.finish_wait_s += time.perf_counter() - t0
        slot = self._take_slot()
        dsts = self.dsts[slot]
        kept = self._kept()
        scale = None
        if kept is not None and not self.deferred and any(kept.values()):
            nograd, scale = self._finish_scaled(dsts, kept)
            self.stats.scaled += 1
        else:
            nograd = self._finish_copies(dsts)
        if self.can_defer and kept is not None and all(kept.values()):
            # the clip was the only change. Where the copies run beside backward (CUDA,
            # a copy thread) they stay there and the factor travels; inline they cost
            # training the same after the clip, and spare the replica the multiplication
            self.deferred = self.copy_mode == "inline"
        self.stats.steps += 1
        self._reset()
        self.last_scale = scale
        return slot, nograd

    def _finish_copies(self, dsts: list[torch.Tensor]) -> list[int]:
        """Copy what the hooks did not, or what changed after them; the indices without
        gradient. Decides whether the next step's copies wait for finish()."""
        deferred = self.deferred
        if not deferred:
            self._copy_incomplete_blocks(dsts)
        nograd: list[int] = []
        unsure: list[int] = []
        again: list[tuple[torch.Tensor, torch.Tensor]] = []
        hooked = changed = 0
        for k, (info, _) in enumerate(self.params):
            g = self._grad(k)
            if g is None:
                nograd.append(info.index)
                continue
            seen = self.seen[k]
            if seen is None:
                self.stats.late += 1  # set outside backward
            else:
                hooked += 1
                v = (
                    UNSURE
                    if self.compare_bytes
                    else verdict(g, seen, self.grad_at[k], self.used[k])
                )
                changed += v == CHANGED
                if not deferred:
                    if v != CHANGED:
                        if v == UNSURE:
                            unsure.append(k)
                        continue
                    self.stats.recopied += 1  # changed after its hook (e.g. clipping)
            again.append((dsts[k], g.detach()))
        self._copy_again(again)
        if unsure:  # what the counters could not settle, compared byte for byte
            refs = [dsts[k] if self.compare_bytes else self.seen[k][0] for k in unsure]  # type: ignore[index]
            grads = [self._grad(k) for k in unsure]
            n = _recopy_changed(refs, grads, [dsts[k] for k in unsure], self.stats)  # type: ignore[arg-type]
            changed = n if self.compare_bytes else changed
        if self.can_defer:
            self.stats.deferred += deferred
            # every gradient changed after its hook: next step, copy them here only
            self.deferred = hooked > 0 and changed == hooked
        return nograd

    def _finish_scaled(
        self, dsts: list[torch.Tensor], kept: dict[int, bool]
    ) -> tuple[list[int], tuple[str, float, list[int]]]:
        """After a clip through :meth:`record_scaling`: the slot keeps the gradients the
        clip was the only change to, which the replica multiplies by its factor; the
        others are copied now, as they are, and listed as not to be multiplied."""
        nograd: list[int] = []
        again: list[tuple[torch.Tensor, torch.Tensor]] = []
        unscaled: list[int] = []
        for k, (info, _) in enumerate(self.params):
            g = self._grad(k)
            if g is None:
                nograd.append(info.index)
                continue
            if kept[k]:
                continue
            if self.seen[k] is None:
                self.stats.late += 1
            else:
                self.stats.recopied += 1
            again.append((dsts[k], g.detach()))
            unscaled.append(info.index)
        self._copy_again(again)
        assert self.clip is not None
        dtype, factor = self.clip.spec
        return nograd, (dtype, factor, unscaled)

    def record_scaling(self, multiply: Callable[[], None], spec: tuple[str, float]) -> None:
        """Run ``multiply`` (a clip's in-place multiplication of every gradient by one
        factor, ``spec`` = (dtype name, factor)) so that :meth:`finish` can keep the
        copies made during backward and carry the factor instead of copying again.

        The copies still in flight finish first (on CUDA the compute stream waits for
        the copy stream), so none of them reads a clipped gradient. The version
        counters then tell at ``finish()`` whether the clip was the only change since
        (:class:`~lowdiff.engine.trainer.snapshot_plan.ClipRecord`).
        """
        if self.pool is not None:
            for f in self.futures:
                f.result()
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        if self.clip is not None or self.clip_broken:
            # a second clip: no single factor describes both
            self.clip_broken = True
            self.clip = None
            multiply()
            return
        grads = [self._grad(k) for k in range(len(self.params))]
        self.clip = ClipRecord.around(multiply, spec, grads, self.seen, self.grad_at, self.used)

    def _kept(self) -> dict[int, bool] | None:
        """After a clip through :meth:`record_scaling`: per parameter with a gradient,
        whether the slot holds what the replica is to multiply by the clip's factor (a
        block copied during backward counts only when copied whole). None without
        such a clip (or after two)."""
        if self.clip is None or self.clip_broken:
            return None
        blocks, of = self.blocks, self.block_of
        return self.clip.kept(
            [self._grad(k) for k in range(len(self.params))],
            self.seen,
            lambda k: self.deferred or blocks[of[k]].ready == len(blocks[of[k]].members),
        )

    def _copy_incomplete_blocks(self, dsts: list[torch.Tensor]) -> None:
        """Blocks some members of which had no gradient this step never became complete:
        copy the members that did get one."""
        for b in self.blocks:
            if 0 < b.ready < len(b.members):
                for k in b.members:
                    seen = self.seen[k]
                    if seen is not None:
                        dsts[k].copy_(seen[0].detach())
                        self.stats.gradient_copies += 1

    def _copy_again(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy (destination, gradient) ``pairs`` at ``finish()``."""
        if pairs and not self.cuda:
            # one batched copy: gradient clipping scales every gradient after backward
            dsts, srcs = zip(*pairs, strict=True)
            torch._foreach_copy_(list(dsts), list(srcs))
        else:  # device to pinned host memory: a copy each, as the CUDA path always did
            for d, g in pairs:
                d.copy_(g)
        self.stats.gradient_copies += len(pairs)

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


def _recopy_changed(
    refs: list[torch.Tensor],
    grads: list[torch.Tensor],
    dsts: list[torch.Tensor],
    stats: SnapshotStats,
) -> int:
    """Compare ``grads`` with ``refs`` (what the hooks copied, or the slot's copies), all
    in one comparison; copy the gradients that differ into ``dsts``; how many did."""
    stats.compared += len(grads)
    if same_bytes(refs, grads):
        return 0
    changed = 0
    for r, g, d in zip(refs, grads, dsts, strict=True):
        if not same_bytes([r], [g]):
            changed += 1
            d.copy_(g.detach())
    stats.recopied += changed
    stats.gradient_copies += changed
    return changed

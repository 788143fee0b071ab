"""Layer-wise gradient snapshots for ``strategy="lowdiff+"``.

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
from dataclasses import dataclass, field
from typing import Any

import torch

from lowdiff.errors import InvalidArgumentError
from lowdiff.state.capture import ParamInfo, sparse_gradient_error
from lowdiff.state.sharded import local


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
    compared: int = 0
    """DDP: gradients the version counters could not settle, compared by value at step()."""
    deferred: int = 0
    """Steps whose gradients were all copied at step() instead of during backward,
    because every one of them had changed after its hook the step before (gradient
    clipping, or a ``GradScaler``'s unscaling, changes them all): copying them during
    backward too would be wasted (on CUDA: a second transfer of every gradient to host
    memory)."""
    copy_s: float = 0.0
    """CPU: time spent in the block copies made during backward (inline: on the thread
    running backward; ``"thread"``: the copy thread's busy time in its tasks)."""
    copy_bytes: int = 0
    """CPU: gradient bytes those block copies wrote."""
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


def _same_bytes(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    """Whether two lists of tensors hold the same bytes, in one comparison for all.

    Bytes, not values: ``-0.0`` and ``0.0`` differ, and a NaN equals its own bits.
    """
    if [(t.shape, t.dtype) for t in a] != [(t.shape, t.dtype) for t in b]:
        return False

    def flat(ts: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in ts])

    return torch.equal(flat(a), flat(b))


def _no_grad_thread() -> None:
    # the copy thread never records autograd history, whatever the gradients require
    torch.set_grad_enabled(False)


SERIAL_ELEMS = 32768
"""Most elements one copy of the CPU copy thread moves: at ATen's grain size
(``at::internal::GRAIN_SIZE``) or below, a copy runs on the calling thread alone. A larger
one would start an OpenMP team of its own, which competes with backward's team for the
same cores and waits for its slowest thread; on a loaded machine that costs more than the
copy itself."""

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


# finish()'s verdicts on one gradient that had a hook
_SAME, _CHANGED, _UNSURE = 0, 1, 2


def _row_offsets(
    params: list[tuple[ParamInfo, torch.nn.Parameter]],
    slot_rows: list[torch.Tensor],
    row_views: Sequence[dict[str, torch.Tensor]],
) -> list[tuple[int, int]]:
    """Each parameter's gradient field as a byte range of a slot row."""
    first, base = row_views[0], slot_rows[0].data_ptr()
    offsets = []
    for info, _ in params:
        v = first[f"g{info.index}.values"]
        start = v.data_ptr() - base
        offsets.append((start, start + v.numel() * v.element_size()))
    return offsets


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
        self.blocks = plan_blocks(_row_offsets(params, slot_rows, row_views), block_bytes)
        self.block_of = [0] * len(params)
        for bi, b in enumerate(self.blocks):
            for k in b.members:
                self.block_of[k] = bi
        dev = params[0][1].device if params else torch.device("cpu")
        self.cuda = dev.type == "cuda"
        # Per slot and parameter, the destination shaped as the parameter, so a gradient
        # of any strides lands in its logical (row-major) order. On CPU, per block, how
        # each member is cut (0: copied whole, else elements per piece) and, per slot, the
        # destinations of the block's one foreach copy, pieces included.
        self.dsts = [
            [views[f"g{info.index}.values"].view(info.shape) for info, _ in params]
            for views in row_views
        ]
        self.compare_bytes = compare_bytes
        """Settle at finish() by comparing bytes, not version counters (module docstring)."""
        self.copy_mode = "cuda" if self.cuda else cpu_copy_mode(copy_mode)
        """``"cuda"``, or on CPU ``"inline"`` / ``"thread"`` (module docstring)."""
        # Per block, how a copy by a thread other than the trainer's cuts each member
        # (0: whole), and per slot the destinations of the block's foreach copy: cut that
        # way (block_dsts), and whole (whole_dsts, inline copies on the trainer's thread).
        self.pieces: list[list[int] | None] = []
        self.block_dsts: list[list[list[torch.Tensor]]] = []
        self.whole_dsts: list[list[list[torch.Tensor]]] = []
        self.owner = threading.get_ident()
        """The thread that runs backward (CPU autograd runs it on the calling thread)."""
        if not self.cuda:
            self._plan_cpu_copies()
        self.stream = torch.cuda.Stream(device=dev) if self.cuda else None
        self.pool = (
            None
            if self.copy_mode != "thread"
            else ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="lowdiff-snapshot", initializer=_no_grad_thread
            )
        )
        self.lock = threading.Lock()
        self.can_defer = autograd_hooks
        self.deferred = False
        """This step's copies wait for finish() (see SnapshotStats.deferred)."""
        self._reset()
        # Under DDP the communication hook feeds on_reduced_grad() instead: the gradient an
        # autograd hook sees is not yet averaged over the ranks. A bare hook still notes
        # which parameters this rank accumulated, which finish() needs (module docstring).
        on_acc = self._hook if autograd_hooks else self._mark
        self.handles = [
            p.register_post_accumulate_grad_hook(on_acc(k)) for k, (_, p) in enumerate(params)
        ]

    def _plan_cpu_copies(self) -> None:
        """On CPU: how each block's members are cut, and each slot's destinations."""
        for b in self.blocks:
            cuts = [self._piece_elems(b, self.dsts[0][k]) for k in b.members]
            self.pieces.append(cuts if any(cuts) else None)
        self.block_dsts = [
            [self._plan_block_dsts(d, b, c) for b, c in zip(self.blocks, self.pieces, strict=True)]
            for d in self.dsts
        ]
        self.whole_dsts = [[[d[k] for k in b.members] for b in self.blocks] for d in self.dsts]

    def _chunk_elems(self, t: torch.Tensor) -> int:
        return max(1, self.chunk_bytes // max(1, t.element_size()))

    def _piece_elems(self, b: _Block, dst: torch.Tensor) -> int:
        n = SERIAL_ELEMS
        if b.chunked:
            n = min(n, self._chunk_elems(dst))
        return n if dst.numel() > n else 0

    def _plan_block_dsts(
        self, dsts: list[torch.Tensor], b: _Block, cuts: list[int] | None
    ) -> list[torch.Tensor]:
        if cuts is None:
            return [dsts[k] for k in b.members]
        out: list[torch.Tensor] = []
        for k, n in zip(b.members, cuts, strict=True):
            if n:
                out.extend(dsts[k].view(-1).split(n))
            else:
                out.append(dsts[k])
        return out

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

    def _copy_block(self, bi: int, b: _Block, slot: int) -> None:
        seen = self.seen
        grads = [seen[k][0] for k in b.members]  # type: ignore[index]
        if self.cuda:
            self._copy_block_cuda(b, slot, grads)
            return
        nbytes = b.end - b.start
        if self.pool is not None:
            args = (self.block_dsts[slot][bi], grads, self.pieces[bi], nbytes)
            self.futures.append(self.pool.submit(self._copy_cpu, *args))
            return
        with torch.no_grad():  # under create_graph=True the gradients require grad
            if threading.get_ident() == self.owner:
                self._copy_cpu(self.whole_dsts[slot][bi], grads, None, nbytes)
            else:
                # a DDP communication hook's callback, on the process group's thread while
                # backward goes on: pieces its thread copies alone, no OpenMP team of its
                # own beside backward's
                self._copy_cpu(self.block_dsts[slot][bi], grads, self.pieces[bi], nbytes)

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
        self.stats.copy_s += time.perf_counter() - t0
        self.stats.copy_bytes += nbytes

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

    def _verdict(self, k: int, g: torch.Tensor, seen: tuple[torch.Tensor, int]) -> int:
        """Whether the slot still holds ``.grad`` (``g``) of parameter ``k``, by counters."""
        snapped, version = seen
        if snapped is g:
            return _SAME if g._version == version else _CHANGED
        at = self.grad_at[k]
        if at is None:
            return _CHANGED  # not DDP: .grad was replaced by another tensor after its hook
        if snapped._version != version:
            return _CHANGED  # the bucket was written after the copy
        before, v0 = at
        if g is not before:
            return _UNSURE  # .grad was created after the hook (by DDP, or by hand)
        if (
            g.data_ptr() == snapped.data_ptr()
            and g.dtype == snapped.dtype
            and g.shape == snapped.shape
            and g.stride() == snapped.stride()
        ):
            return _SAME if g._version == v0 else _CHANGED  # .grad is the bucket view
        if not self.used[k]:
            return _UNSURE  # DDP copies into .grad only if some rank used the parameter
        if g._version == v0 + 1:
            return _SAME  # DDP's one copy from the bucket, nothing since
        return _CHANGED if g._version > v0 + 1 else _UNSURE

    def finish(self) -> tuple[int, list[int]]:
        """Complete the step's snapshot; returns (slot, optimizer indices without gradient)."""
        t0 = time.perf_counter()
        for f in self.futures:
            f.result()
        for e in self.events:
            e.synchronize()
        self.stats.finish_wait_s += time.perf_counter() - t0
        slot = self._take_slot()
        dsts = self.dsts[slot]
        deferred = self.deferred
        for b in self.blocks:
            if not deferred and 0 < b.ready < len(b.members):
                # some members had no gradient this step, so the block never became
                # complete: copy the members that did get one
                for k in b.members:
                    seen = self.seen[k]
                    if seen is not None:
                        dsts[k].copy_(seen[0].detach())
        nograd: list[int] = []
        unsure: list[int] = []
        again_dst: list[torch.Tensor] = []
        again_src: list[torch.Tensor] = []
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
                verdict = _UNSURE if self.compare_bytes else self._verdict(k, g, seen)
                changed += verdict == _CHANGED
                if not deferred:
                    if verdict == _SAME:
                        continue
                    if verdict == _UNSURE:
                        unsure.append(k)
                        continue
                    self.stats.recopied += 1  # changed after its hook (e.g. clipping)
            again_dst.append(dsts[k])
            again_src.append(g.detach())
        if again_dst and not self.cuda:
            # one batched copy: gradient clipping scales every gradient after backward
            torch._foreach_copy_(again_dst, again_src)
        else:  # device to pinned host memory: a copy each, as the CUDA path always did
            for d, g in zip(again_dst, again_src, strict=True):
                d.copy_(g)
        if unsure and self.compare_bytes:
            changed = self._settle_against(unsure, dsts)
        elif unsure:
            self._settle(unsure, dsts)
        if self.can_defer:
            self.stats.deferred += deferred
            # every gradient changed after its hook: next step, copy them here only
            self.deferred = hooked > 0 and changed == hooked
        self.stats.steps += 1
        self._reset()
        return slot, nograd

    def _settle(self, ks: list[int], dsts: list[torch.Tensor]) -> None:
        """Compare the gradients the counters could not settle; re-copy those that differ."""
        self.stats.compared += len(ks)
        snapped = [self.seen[k][0] for k in ks]  # type: ignore[index]
        grads = [self._grad(k) for k in ks]
        if _same_bytes(snapped, grads):  # type: ignore[arg-type]
            return
        for k, s, g in zip(ks, snapped, grads, strict=True):
            assert g is not None
            if not _same_bytes([s], [g]):
                self.stats.recopied += 1
                dsts[k].copy_(g.detach())

    def _settle_against(self, ks: list[int], dsts: list[torch.Tensor]) -> int:
        """Compare gradients ``ks`` with their slot copies; re-copy those that differ, and
        return how many did."""
        self.stats.compared += len(ks)
        grads = [self._grad(k) for k in ks]
        copies = [dsts[k] for k in ks]
        if _same_bytes(copies, grads):  # type: ignore[arg-type]
            return 0
        changed = 0
        for d, g in zip(copies, grads, strict=True):
            assert g is not None
            if not _same_bytes([d], [g]):
                changed += 1
                d.copy_(g.detach())
        self.stats.recopied += changed
        return changed

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

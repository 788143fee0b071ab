"""The trainer's training state is left out of the process server's fork.

lowdiff's process server is a fork of the trainer (:mod:`lowdiff.proc.server`). A fork
shares every private page copy on write: the next write of the trainer to each page
faults, and the kernel copies the page, while the server keeps the original. For the
tensors the trainer writes at every step on the CPU (parameters, gradients, buffers,
optimizer state), that made the first step after the fork copy the whole state page by
page (a 50M-parameter model with AdamW on 2 cores: 0.4 to 1.4 s more than a steady
step), and left the server, and every process it forks, holding a copy of it. The
fork itself copied the page tables of all of it.

The server never reads those tensors (a process it starts receives what it needs
through shared memory), so the pages that lie wholly inside the storage of such a tensor
are left out of the fork:

- before the fork, the trainer marks them ``madvise(MADV_DONTFORK)``: the fork copies
  no page table entry for them, and the trainer's pages stay its own (no fault, no copy
  when it writes them);
- right after the fork, the trainer marks them ``MADV_DOFORK`` again: a later fork (a
  ``DataLoader`` worker's, the user's own) shares them as usual;
- in the server, those addresses are mapped again to fresh anonymous memory
  (``MAP_FIXED``), so nothing there is left unmapped: the server's copies of the
  trainer's tensor objects read zeros, and take no memory.

Registered through :func:`keep_out` by every :class:`lowdiff.Checkpointer` (weakly: the
registration does not keep a model alive). ``LOWDIFF_FORK_STATE=share`` in the trainer's
environment shares the state with the server as any other memory (the default is
``leave-out``). Best effort: storages in shared memory or
pinned memory, and tensors that are not plain CPU tensors, are left as they are; a
``madvise`` the kernel refuses ends the marking there, and the fork takes the rest as
before. Only a fork taken on the trainer's main thread leaves anything out (another
thread's fork may run while the main thread frees and reuses that memory). Linux only.
"""

from __future__ import annotations

import contextlib
import mmap
import sys
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from lowdiff.proc import env_choice, libc

ENV = "LOWDIFF_FORK_STATE"
"""``leave-out`` (the default) or ``share``: whether the training state is left out of the
process server's fork."""

CHOICES = ("leave-out", "share")

MADV_DONTFORK = 10
MADV_DOFORK = 11
PAGE = mmap.PAGESIZE

MIN_RANGE = 16 * PAGE
"""Ranges shorter than this are not left out: they cost a fault or two each, and every
range splits a mapping of the trainer for the time of the fork."""

MAX_RANGES = 2048
"""At most this many ranges (the longest) are left out: each adds up to two mappings to
the trainer's address space for the time of the fork (``vm.max_map_count``)."""

_owners: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()


def choice() -> str:
    """:data:`ENV`'s value in this process (ValueError if it is none of :data:`CHOICES`)."""
    return env_choice(ENV, CHOICES)


def keep_out(*owners: torch.nn.Module | torch.optim.Optimizer) -> None:
    """Leave the CPU tensors of ``owners`` (a model: its parameters, their gradients and
    its buffers; an optimizer: its state) out of the next fork of the process server."""
    with _lock:
        for o in owners:
            with contextlib.suppress(TypeError):
                _owners.add(o)


def _tensors(owner: Any) -> Iterator[torch.Tensor]:
    if isinstance(owner, torch.nn.Module):
        for p in owner.parameters():
            yield p
            if p.grad is not None:
                yield p.grad
        yield from owner.buffers()
    elif isinstance(owner, torch.optim.Optimizer):
        for state in owner.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    yield v


def _span(t: torch.Tensor, pinned_possible: bool) -> tuple[int, int] | None:
    """The pages wholly inside ``t``'s storage, as ``(start, end)`` addresses."""
    t = getattr(t, "_local_tensor", t)  # a DTensor (FSDP2): this rank's shard
    try:
        if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized:
            return None
        s = t.untyped_storage()
        n, ptr = s.nbytes(), s.data_ptr()
        if n < MIN_RANGE or not ptr or s.is_shared():
            return None
        if pinned_possible and s.is_pinned():  # the CUDA driver manages these pages
            return None
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None  # a tensor subclass without a plain storage
    start = -(-ptr // PAGE) * PAGE
    end = (ptr + n) // PAGE * PAGE
    return (start, end) if end - start >= MIN_RANGE else None


def ranges(tensors: Iterable[torch.Tensor] | None = None) -> list[tuple[int, int]]:
    """The page ranges to leave out of a fork: of ``tensors``, or else of every
    registered owner's; sorted, without overlaps, at most :data:`MAX_RANGES`."""
    if tensors is None:
        with _lock:
            owners = list(_owners)
        tensors = (t for o in owners for t in _tensors(o))
    # no pinned memory exists before CUDA is initialized, and asking would initialize it
    pinned_possible = torch.cuda.is_initialized()
    spans = sorted({sp for t in tensors if (sp := _span(t, pinned_possible)) is not None})
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:  # one storage seen twice (tied weights)
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    if len(merged) > MAX_RANGES:
        merged = sorted(sorted(merged, key=lambda r: r[0] - r[1])[:MAX_RANGES])
    return merged


def leave_out() -> list[tuple[int, int]]:
    """In the trainer, right before the server's fork: mark the registered owners' pages
    ``MADV_DONTFORK``; the ranges marked (empty where nothing is left out)."""
    if not sys.platform.startswith("linux") or choice() == "share":
        return []
    if threading.current_thread() is not threading.main_thread():
        return []
    try:
        lib, todo = libc(), ranges()
    except OSError:
        return []
    done = []
    for start, end in todo:
        if lib.madvise(start, end - start, MADV_DONTFORK):
            break  # refused (too many mappings, an unusual mapping): the rest is shared
        done.append((start, end))
    return done


def give_back(done: list[tuple[int, int]]) -> None:
    """In the trainer, right after the fork: undo :func:`leave_out`."""
    if done:
        lib = libc()
        for start, end in done:
            lib.madvise(start, end - start, MADV_DOFORK)


def fill(done: list[tuple[int, int]]) -> None:
    """In the server, first thing after the fork: map fresh anonymous memory where the
    pages left out would have been."""
    if not done:
        return
    lib = libc()
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x10  # MAP_FIXED
    flags |= getattr(mmap, "MAP_NORESERVE", 0)
    for start, end in done:
        lib.mmap(start, end - start, prot, flags, -1, 0)

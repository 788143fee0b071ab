"""Naive DC's records: their files, their place in a hand-off slot, and their arithmetic.

Shared by the trainer (which packs records into shared-memory slots and keeps its base
copy with :func:`add_sparse`), the checkpointing process (which unpacks them) and
recovery (which applies differentials with the same :func:`add_sparse`, so that it
rebuilds the trainer's base bit for bit).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

DIFF_DIR = "diffs"
FULL_PREFIX, DIFF_PREFIX, SUFFIX = "ckpt-", "diff-", ".pt"
DIFF_KIND = "naive-dc-diff"
"""``kind`` of a differential file, so that a file of another kind is never applied."""

ALIGN = 64
"""Byte alignment of every tensor in a hand-off slot (any dtype can be viewed there)."""


# --------------------------------------------------------------------------- records in slots


@dataclass(frozen=True)
class SlotRef:
    """Where one tensor of a record lies in a hand-off slot (a flat uint8 tensor)."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def view(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


def _copy_into(view: torch.Tensor, src: torch.Tensor) -> None:
    view.copy_(src)


class Packer:
    """Lays a record's tensors out in one slot: plan first (sizes), then fill.

    Planning before filling lets a record be sized before a slot is taken, and lets
    dense differences be computed straight into the slot (no temporary per tensor).
    """

    def __init__(self) -> None:
        self.nbytes = 0
        self._fills: list[tuple[SlotRef, Callable[[torch.Tensor], Any]]] = []

    def reserve(
        self, dtype: torch.dtype, shape: tuple[int, ...], fill: Callable[[torch.Tensor], Any]
    ) -> SlotRef:
        """Room for one tensor; ``fill(view)`` writes it at :meth:`fill`."""
        offset = -(-self.nbytes // ALIGN) * ALIGN
        ref = SlotRef(offset, dtype, tuple(shape))
        self.nbytes = offset + ref.nbytes
        self._fills.append((ref, fill))
        return ref

    def put(self, t: torch.Tensor) -> SlotRef:
        """Room for a copy of ``t``."""
        src = t.detach()
        return self.reserve(src.dtype, tuple(src.shape), partial(_copy_into, src=src))

    def walk(self, obj: Any) -> Any:
        """``obj`` with every tensor replaced by its :class:`SlotRef` (copied at :meth:`fill`)."""
        if isinstance(obj, torch.Tensor):
            return self.put(obj)
        if isinstance(obj, dict):
            return {k: self.walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.walk(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(self.walk(v) for v in obj)
        return obj

    def fill(self, buf: torch.Tensor) -> None:
        """Write every planned tensor into the slot ``buf``."""
        for ref, fill in self._fills:
            fill(ref.view(buf))


def unpack(obj: Any, buf: torch.Tensor) -> Any:
    """A record from its slot, every tensor copied out (each into storage of its own)."""
    if isinstance(obj, SlotRef):
        return obj.view(buf).clone()
    if isinstance(obj, dict):
        return {k: unpack(v, buf) for k, v in obj.items()}
    if isinstance(obj, list):
        return [unpack(v, buf) for v in obj]
    if isinstance(obj, tuple):
        return tuple(unpack(v, buf) for v in obj)
    return obj


# --------------------------------------------------------------------------- arithmetic


def add_sparse(t: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> None:
    """``t.view(-1)[indices] += values`` (unique int64 indices), one rounding per entry.

    The trainer's base copy and recovery both go through this function, so they reach
    bit-identical states.
    """
    flat = t.view(-1) if t.is_contiguous() else t.reshape(-1)  # a copy when not contiguous
    flat.index_copy_(0, indices, flat.index_select(0, indices).add_(values))
    if not t.is_contiguous():
        t.copy_(flat.view(t.shape))


def sub_into(view: torch.Tensor, new: torch.Tensor, base: torch.Tensor) -> None:
    """``view = new - base`` with ``base`` on the CPU and ``new`` on its own device."""
    if new.device.type == "cpu":
        torch.sub(new, base, out=view)
    else:
        view.copy_(new - base.to(new.device, non_blocking=True))


def update_dense(base: torch.Tensor, delta: SlotRef, buf: torch.Tensor) -> None:
    """Move the base on by a dense difference packed in ``buf``."""
    base.add_(delta.view(buf))


def update_sparse(base: torch.Tensor, values: SlotRef, indices: SlotRef, buf: torch.Tensor) -> None:
    """Move the base on by a top-k difference packed in ``buf``."""
    add_sparse(base, values.view(buf), indices.view(buf).long())

"""How a CheckFreq snapshot travels: a skeleton of the state plus one flat buffer of tensors.

The trainer splits the state into its tensors and a *skeleton* (everything else, with a
:class:`Leaf` where each tensor was; :class:`Flattener`), copies the tensors into the
shared snapshot buffer at the places an :data:`Entry` names, and sends the skeleton and
the entries to the persist process, which puts the tensors back (:func:`rebuild`) and
writes the state exactly as ``torch.save`` of the live state would.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

Entry = tuple[int, int, torch.dtype, tuple[int, ...]]
"""Where a tensor lies in the snapshot buffer: (start byte, end byte, dtype, shape)."""


@dataclass(frozen=True)
class Leaf:
    """Stands for tensor ``index`` of a snapshot in the state's skeleton."""

    index: int


class Flattener:
    """Splits a state into its tensors and a skeleton (the rest, deep-copied).

    A tensor is *deferrable* when only the optimizer update changes it (parameters and
    optimizer state): the snapshot thread may copy it during the next forward/backward.
    Everything else (buffers, RNG states, tensors among hyperparameters) is copied
    before ``step()`` returns.

    A tensor that appears under several keys (tied weights: one parameter in two
    modules) is one leaf, so that it is copied and written once, as ``torch.save`` of
    the live state would (it stores a shared storage once).
    """

    def __init__(self, param_ptrs: set[int]) -> None:
        self.param_ptrs = param_ptrs
        self.leaves: list[torch.Tensor] = []
        self.deferrable: list[bool] = []
        self._seen: dict[tuple[Any, ...], int] = {}

    @staticmethod
    def _identity(t: torch.Tensor) -> tuple[Any, ...] | None:
        """Same identity: the same view of the same memory (None for an empty tensor)."""
        if t.numel() == 0:
            return None
        return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())

    def _leaf(self, obj: torch.Tensor, deferrable: bool) -> Leaf:
        t = obj.detach()
        if t.is_sparse or t.layout != torch.strided:
            raise TypeError(f"checkfreq checkpoints dense tensors only, got {t.layout}")
        defer = deferrable or (t.numel() > 0 and t.data_ptr() in self.param_ptrs)
        key = self._identity(t)
        if key is not None and key in self._seen:
            i = self._seen[key]
            # copied before step() returns if any of its uses needs that
            self.deferrable[i] = self.deferrable[i] and defer
            return Leaf(i)
        self.leaves.append(t)
        self.deferrable.append(defer)
        if key is not None:
            self._seen[key] = len(self.leaves) - 1
        return Leaf(len(self.leaves) - 1)

    def walk(self, obj: Any, deferrable: bool = False) -> Any:
        """``obj`` with every tensor replaced by its :class:`Leaf` (the rest deep-copied)."""
        if isinstance(obj, torch.Tensor):
            return self._leaf(obj, deferrable)
        if isinstance(obj, dict):
            out: dict[Any, Any] = OrderedDict() if isinstance(obj, OrderedDict) else {}
            for k, v in obj.items():
                out[k] = self.walk(v, deferrable)
            meta = getattr(obj, "_metadata", None)  # module versions of a state_dict
            if meta is not None:
                out._metadata = copy.deepcopy(meta)  # type: ignore[attr-defined]
            return out
        if type(obj) in (list, tuple):
            return type(obj)(self.walk(v, deferrable) for v in obj)
        return copy.deepcopy(obj)

    def flatten(self, state: dict[str, Any]) -> dict[str, Any]:
        """The skeleton of ``state``; its tensors are then in :attr:`leaves`."""
        skeleton = {}
        for key, value in state.items():
            if key == "optimizer":
                skeleton[key] = {
                    k: self.walk(v, deferrable=(k == "state")) for k, v in value.items()
                }
            else:
                skeleton[key] = self.walk(value)
        return skeleton


def rebuild(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """Inverse of :meth:`Flattener.flatten`, with ``tensors`` in the leaves' order."""
    if isinstance(obj, Leaf):
        return tensors[obj.index]
    if isinstance(obj, dict):
        out: dict[Any, Any] = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for k, v in obj.items():
            out[k] = rebuild(v, tensors)
        meta = getattr(obj, "_metadata", None)
        if meta is not None:
            out._metadata = meta  # type: ignore[attr-defined]
        return out
    if type(obj) in (list, tuple):
        return type(obj)(rebuild(v, tensors) for v in obj)
    return obj

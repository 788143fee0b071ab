"""The record format of a sparse gradient merged across data-parallel ranks.

Under DDP each rank sparsifies its own gradient (with its own error feedback), the
ranks all-gather their (values, indices) pairs, and every rank merges them into the
averaged sparse gradient: the contributions are scattered into a dense buffer one rank
at a time in rank order (duplicate indices summed, always in the same order, so every
rank computes the same bits) and divided by the world size. The record of the step is
that merged gradient as (values, indices, count): the union of the ranks' indices in
ascending order and the merged values read back from the dense result. Decompressing it
rebuilds the dense gradient bit for bit, which is what makes replay exact.

The union holds at most ``world_size * k`` entries, so the payload is sized for that and
``count`` says how many are in use; the rest is zero padding.

Example:
    >>> import torch
    >>> from lowdiff.compressors import TopK
    >>> m = MergedSparse(TopK(0.5, error_feedback=False), world_size=2)
    >>> dense = merge_sparse([(torch.tensor([1.0, 2.0]), torch.tensor([0, 3])),
    ...                       (torch.tensor([4.0, 6.0]), torch.tensor([3, 1]))], 4, 2)
    >>> dense
    tensor([0.5000, 3.0000, 0.0000, 3.0000])
    >>> m.decompress(m.compress(dense, key=0, step=0), 4, torch.float32)
    tensor([0.5000, 3.0000, 0.0000, 3.0000])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lowdiff.compressors.base import (
    Compressor,
    FieldSpec,
    check_flat_grad,
    check_payload,
    compressor_from_spec,
    index_dtype_for,
    register,
)
from lowdiff.compressors.sparse import _Sparsifier
from lowdiff.errors import InvalidArgumentError

__all__ = ["MergedSparse", "merge_sparse"]


def merge_sparse(
    parts: Sequence[tuple[torch.Tensor, torch.Tensor]], numel: int, world_size: int
) -> torch.Tensor:
    """Average sparse contributions ``[(values, indices), ...]`` (one per rank) into a dense tensor.

    Each rank's indices are unique, so each ``index_add_`` is order-free; the ranks are
    added one after another in list order, so duplicates across ranks are summed in the
    same order on every rank and every device.
    """
    if not parts:
        raise InvalidArgumentError("merge_sparse needs at least one contribution")
    values0 = parts[0][0]
    out = torch.zeros(numel, dtype=values0.dtype, device=values0.device)
    for values, indices in parts:
        out.index_add_(0, indices.long(), values)
    return out.div_(world_size)


@register
class MergedSparse(Compressor):
    """Record layout of a sparsifier's output merged over ``world_size`` ranks.

    ``compress`` encodes a merged dense gradient by the union of the ranks' indices
    (``support``); without one it keeps the non-zero entries. It does not sparsify: the
    per-rank sparsifier (``inner``) does that before the all-gather.

    Args:
        inner: the per-rank sparsifier (TopK, ApproxTopK or RandomK), or its ``spec()``.
        world_size: number of data-parallel ranks.
    """

    kind = "merged-sparse"

    def __init__(self, inner: Compressor | Mapping[str, Any], world_size: int) -> None:
        if not isinstance(inner, Compressor):
            inner = compressor_from_spec(inner)
        if not isinstance(inner, _Sparsifier):
            raise InvalidArgumentError(
                f"distributed LowDiff merges sparse gradients; {type(inner).__name__} is not a "
                "sparsifier (use TopK, ApproxTopK or RandomK)"
            )
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise InvalidArgumentError(f"world_size must be an int >= 1, got {world_size!r}")
        self.inner: _Sparsifier = inner
        self.world_size = world_size

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "inner": self.inner.spec(), "world_size": self.world_size}

    def capacity(self, numel: int) -> int:
        return min(numel, self.world_size * self.inner.k_for(numel))

    def fields(self, numel: int, dtype: torch.dtype) -> list[FieldSpec]:
        cap = self.capacity(numel)
        return [
            FieldSpec("values", dtype, cap),
            FieldSpec("indices", index_dtype_for(numel), cap),
            FieldSpec("count", torch.int64, 1),
        ]

    def compress(
        self, grad: torch.Tensor, key: int, step: int, support: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        check_flat_grad(type(self).__name__, grad)
        numel = grad.numel()
        cap = self.capacity(numel)
        if support is None:
            idx = grad.nonzero().view(-1)
        else:
            mask = torch.zeros(numel, dtype=torch.bool, device=grad.device)
            mask[support.long()] = True
            idx = mask.nonzero().view(-1)
        n = idx.numel()
        if n > cap:
            raise InvalidArgumentError(
                f"MergedSparse: {n} entries do not fit the record's {cap} (world_size "
                f"{self.world_size} x k {self.inner.k_for(numel)})"
            )
        values = torch.zeros(cap, dtype=grad.dtype, device=grad.device)
        indices = torch.zeros(cap, dtype=index_dtype_for(numel), device=grad.device)
        values[:n] = grad.index_select(0, idx)
        indices[:n] = idx.to(indices.dtype)
        count = torch.full((1,), n, dtype=torch.int64, device=grad.device)
        return {"values": values, "indices": indices, "count": count}

    def decompress(
        self, payload: Mapping[str, torch.Tensor], numel: int, dtype: torch.dtype
    ) -> torch.Tensor:
        check_payload(type(self).__name__, payload, self.fields(numel, dtype))
        n = int(payload["count"][0])
        cap = self.capacity(numel)
        if not 0 <= n <= cap:
            raise InvalidArgumentError(f"MergedSparse: count {n} outside 0..{cap}")
        values = payload["values"][:n]
        indices = payload["indices"][:n].long()
        if n and (int(indices.min()) < 0 or int(indices.max()) >= numel):
            raise InvalidArgumentError(f"MergedSparse: an index lies outside 0..{numel - 1}")
        out = torch.zeros(numel, dtype=dtype, device=values.device)
        out.index_put_((indices,), values)
        return out

    def reset_state(self) -> None:
        self.inner.reset_state()

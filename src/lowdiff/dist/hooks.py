"""DDP communication hooks of distributed LowDiff and LowDiff+.

``lowdiff_hook`` (LowDiff), per bucket, on every rank:

1) compress each parameter's slice of the bucket with the rank's own sparsifier (error
   feedback residuals are per rank), keyed by the parameter's optimizer index and the
   step, exactly as in single-process training;
2) all-gather the values and the indices (two asynchronous collectives);
3) when both arrive, merge them into the averaged sparse gradient
   (:func:`~lowdiff.compressors.merged.merge_sparse`, identical bits on every rank),
   write it into the bucket (DDP copies the bucket into ``.grad``) and keep its record
   payload for ``Checkpointer.step()``.

``plus_hook`` (LowDiff+) runs the usual averaging all-reduce and, as soon as a bucket's
result is ready, hands the averaged slices of the parameters this rank owns to the
gradient snapshotter: layer-wise reuse at bucket granularity.
"""

# No ``from __future__ import annotations`` here: DDP checks the hooks' annotations
# against the real ``dist.GradBucket`` and ``torch.futures.Future`` objects.

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lowdiff.compressors.merged import MergedSparse, merge_sparse
from lowdiff.compressors.sparse import _Sparsifier
from lowdiff.dist.context import DistContext
from lowdiff.engine.state import ParamInfo
from lowdiff.errors import LowDiffError


class LowDiffHookState:
    """What ``lowdiff_hook`` needs, and the merged payloads it leaves for ``step()``."""

    def __init__(
        self,
        ctx: DistContext,
        params: list[tuple[ParamInfo, torch.nn.Parameter]],
        compressor: _Sparsifier,
        merged: MergedSparse,
        step_fn: Callable[[], int],
    ) -> None:
        self.ctx = ctx
        self.index = {id(p): info.index for info, p in params}
        self.compressor, self.merged, self.step_fn = compressor, merged, step_fn
        self.lock = threading.Lock()
        self.payloads: dict[int, dict[str, torch.Tensor]] = {}
        self.step: int | None = None
        self.calls = 0

    def take(self, step: int) -> dict[int, dict[str, torch.Tensor]]:
        """The merged payloads of ``step`` (by optimizer index), emptied for the next step."""
        with self.lock:
            if self.payloads and self.step != step:
                raise RuntimeError(
                    f"lowdiff: the DDP hook merged gradients for step {self.step}, step() is at {step}"
                )
            out, self.payloads, self.step = self.payloads, {}, None
        return out

    def put(self, step: int, index: int, payload: dict[str, torch.Tensor]) -> None:
        with self.lock:
            self.step = step
            self.payloads[index] = payload


def lowdiff_hook(
    state: LowDiffHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Sparsify, all-gather and merge one bucket (see the module docstring)."""
    step = state.step_fn()
    params = bucket.parameters()
    grads = bucket.gradients()
    comp, world, group = state.compressor, state.ctx.world_size, state.ctx.group
    keys, spans, vals, idxs = [], [], [], []
    off = 0
    # indices travel as int32 unless a tensor is too large for it (every rank decides the
    # same: the bucket's tensors are the same everywhere)
    idx_dtype = torch.int32 if max(g.numel() for g in grads) < 2**31 else torch.int64
    with torch.no_grad():
        for p, g in zip(params, grads, strict=True):
            key = state.index.get(id(p))
            if key is None:
                raise RuntimeError(
                    "lowdiff: a DDP bucket holds a parameter the optimizer does not update; "
                    "optimize every trainable parameter of the model"
                )
            payload = comp.compress(g.detach().reshape(-1).contiguous(), key, step)
            k = payload["values"].numel()
            keys.append(key)
            spans.append((off, off + k))
            vals.append(payload["values"])
            idxs.append(payload["indices"].to(idx_dtype))
            off += k
        v_local = torch.cat(vals)
        i_local = torch.cat(idxs)
    v_all = [torch.empty_like(v_local) for _ in range(world)]
    i_all = [torch.empty_like(i_local) for _ in range(world)]
    fv = dist.all_gather(v_all, v_local, group=group, async_op=True).get_future()  # type: ignore[union-attr]
    fi = dist.all_gather(i_all, i_local, group=group, async_op=True).get_future()  # type: ignore[union-attr]

    def merge(done: Any) -> torch.Tensor:
        for f in done.value():
            f.value()  # raises if a peer failed: never merge half-received buffers
        with torch.no_grad():
            for key, (a, b), g in zip(keys, spans, grads, strict=True):
                numel = g.numel()
                parts = [(v_all[r][a:b], i_all[r][a:b]) for r in range(world)]
                dense = merge_sparse(parts, numel, world)
                support = torch.cat([i_all[r][a:b] for r in range(world)])
                state.put(step, key, state.merged.compress(dense, key, step, support=support))
                g.copy_(dense.view_as(g))
        state.calls += 1
        return bucket.buffer()

    return torch.futures.collect_all([fv, fi]).then(merge)


def record_consumed(
    payloads: dict[int, dict[str, torch.Tensor]],
    params: list[tuple[ParamInfo, torch.nn.Parameter]],
) -> None:
    """Make each merged payload hold exactly the gradient the optimizer is about to apply.

    Between the hook and ``step()`` the user may change ``.grad``: gradient clipping, a
    constant scale, any edit of the merged entries. The record keeps the hook's support
    (the merged indices) and takes its values from ``.grad`` as it is now, so replay
    applies the same bits. An edit that makes an entry outside the support non-zero
    cannot be recorded in the merged layout and is refused, naming the parameter.
    """
    with torch.no_grad():
        for info, p in params:
            payload = payloads.get(info.index)
            g = p.grad
            if payload is None or g is None:
                continue
            n = int(payload["count"][0])
            flat = g.detach().reshape(-1)
            idx = payload["indices"][:n].long()
            vals = flat.index_select(0, idx)
            if int(torch.count_nonzero(flat)) != int(torch.count_nonzero(vals)):
                raise LowDiffError(
                    f"the gradient of {info.name!r} changed outside the entries lowdiff's DDP "
                    "hook merged (between backward and ck.step()); lowdiff records a scaled or "
                    "clipped gradient exactly, but not new non-zero entries: apply such "
                    "changes before the gradients are synchronised"
                )
            payload["values"][:n].copy_(vals)


class PlusHookState:
    """What ``plus_hook`` needs: where each owned parameter goes in the snapshotter."""

    def __init__(
        self,
        ctx: DistContext,
        owned: dict[int, int],
        on_grad: Callable[[int, torch.Tensor], None],
    ) -> None:
        self.ctx = ctx
        self.owned = owned  # id(param) -> position in the snapshotter's parameter list
        self.on_grad = on_grad


def plus_hook(state: PlusHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average one bucket with an all-reduce, then snapshot the owned parameters' slices."""
    buf = bucket.buffer()
    buf.div_(state.ctx.world_size)
    fut = dist.all_reduce(buf, group=state.ctx.group, async_op=True).get_future()  # type: ignore[union-attr]
    params = bucket.parameters()
    grads = bucket.gradients()

    def snap(f: Any) -> torch.Tensor:
        out = f.value()[0]
        for p, g in zip(params, grads, strict=True):
            k = state.owned.get(id(p))
            if k is not None:
                state.on_grad(k, g)
        return out

    return fut.then(snap)

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

On the wire the values keep the gradient's own dtype (a bf16 or fp16 gradient is never
upcast) and each parameter's indices take the narrowest integer dtype that holds its
largest index (:func:`wire_index_dtype`), sent as raw bytes (:class:`IndexLayout`). The
bytes this rank hands to the collectives are counted per step in
:attr:`LowDiffHookState.wire` (:class:`WireStats`), next to the bytes of the buckets a
dense all-reduce would have reduced.

``plus_hook`` (LowDiff+) runs the usual averaging all-reduce and, as soon as a bucket's
result is ready, hands the averaged slices of the parameters this rank owns to the
gradient snapshotter: layer-wise reuse at bucket granularity.

The callbacks both hooks chain to the collectives run on the process group's own
worker thread, and that thread drops them after they return. They hold their hook
state only weakly: a callback that held it strongly could be the last owner of the
state, and through it of the process group, once the trainer has destroyed the group
and its model; the group's destructor would then run on its own worker thread and
abort the process when it joins that thread.
"""

# No ``from __future__ import annotations`` here: DDP checks the hooks' annotations
# against the real ``dist.GradBucket`` and ``torch.futures.Future`` objects.

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lowdiff.compressors.base import index_dtype_for
from lowdiff.compressors.merged import MergedSparse, merge_sparse
from lowdiff.compressors.sparse import _Sparsifier
from lowdiff.ddp.context import DistContext
from lowdiff.errors import InvalidArgumentError, LowDiffError, UsageError
from lowdiff.state.capture import ParamInfo


def wire_index_dtype(numel: int) -> torch.dtype:
    """The integer dtype in which the exchange sends the indices of a ``numel``-element tensor.

    The narrowest that holds index ``numel - 1``: ``uint8`` up to 256 elements, ``uint16``
    up to 2**16, ``int32`` up to 2**31, else ``int64``. It depends on ``numel`` alone, which
    every rank knows for every parameter of a bucket, so all ranks pick the same.

    Example:
        >>> wire_index_dtype(256), wire_index_dtype(257), wire_index_dtype(1 << 20)
        (torch.uint8, torch.uint16, torch.int32)
    """
    return torch.uint8 if numel <= 1 << 8 else index_dtype_for(numel)


class IndexLayout:
    """Where each tensor's indices lie in the bytes one rank all-gathers for a bucket.

    Tensor ``j`` sends its ``ks[j]`` indices as :func:`wire_index_dtype` of ``numels[j]``.
    Neither gloo nor NCCL all-gathers 16-bit integers, so the indices travel as one
    ``uint8`` buffer and are viewed back on receipt. The widest dtypes come first: each
    tensor's bytes then start at a multiple of its element size, so the received buffer
    views back as that dtype without a copy.

    Example:
        >>> lay = IndexLayout([300, 10], [2, 1])
        >>> data = lay.pack([torch.tensor([299, 7]), torch.tensor([9])])
        >>> data.dtype, data.numel(), lay.unpack(data, 0), lay.unpack(data, 1)
        (torch.uint8, 5, tensor([299,   7], dtype=torch.uint16), tensor([9], dtype=torch.uint8))
    """

    def __init__(self, numels: list[int], ks: list[int]) -> None:
        if len(numels) != len(ks):
            raise InvalidArgumentError(f"IndexLayout: {len(numels)} numels but {len(ks)} counts")
        self.dtypes = [wire_index_dtype(n) for n in numels]
        self.spans: list[tuple[int, int]] = [(0, 0)] * len(numels)
        off = 0
        for j in sorted(range(len(numels)), key=lambda j: (-self.dtypes[j].itemsize, j)):
            end = off + ks[j] * self.dtypes[j].itemsize
            self.spans[j] = (off, end)
            off = end
        self.nbytes = off

    def pack(self, indices: list[torch.Tensor]) -> torch.Tensor:
        """One ``uint8`` buffer holding every tensor's indices in its wire dtype."""
        device = indices[0].device if indices else torch.device("cpu")
        out = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        for (a, b), dt, idx in zip(self.spans, self.dtypes, indices, strict=True):
            # a value conversion, exact: every index is below the tensor's numel
            out[a:b].view(dt).copy_(idx)
        return out

    def unpack(self, data: torch.Tensor, j: int) -> torch.Tensor:
        """Tensor ``j``'s indices in a received buffer (a view, in the wire dtype)."""
        a, b = self.spans[j]
        return data[a:b].view(self.dtypes[j])


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class WireStats:
    """Bytes this rank hands to the exchange's collectives, per step and in total.

    Counted in ``lowdiff_hook`` from the tensors it passes to the all-gathers (their
    ``nbytes``: this rank's values and index bytes, every bucket), next to ``dense``: the
    bytes of the bucket buffers that DDP's default all-reduce would have reduced (numel x
    element size). Each rank counts its own contribution; what a collective algorithm then
    moves (a ring all-gather sends ``world_size - 1`` contributions per rank, a ring
    all-reduce ``2 (world_size - 1) / world_size`` payloads) is for the reader to apply.
    The per-step figures are those of the newest step that ran the hook.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.steps = 0
        self.value_bytes = 0
        self.index_bytes = 0
        self.dense_bytes = 0
        self.step: int | None = None
        self.step_value_bytes = 0
        self.step_index_bytes = 0
        self.step_dense_bytes = 0
        self.step_buckets = 0
        self.step_index_dtypes: set[str] = set()
        self.step_value_dtypes: set[str] = set()

    def add(
        self,
        step: int,
        value_bytes: int,
        index_bytes: int,
        dense_bytes: int,
        index_dtypes: list[torch.dtype],
        value_dtype: torch.dtype,
    ) -> None:
        """Count one bucket of ``step``."""
        with self._lock:
            if step != self.step:
                self.step, self.steps = step, self.steps + 1
                self.step_value_bytes = self.step_index_bytes = self.step_dense_bytes = 0
                self.step_buckets = 0
                self.step_index_dtypes, self.step_value_dtypes = set(), set()
            self.value_bytes += value_bytes
            self.index_bytes += index_bytes
            self.dense_bytes += dense_bytes
            self.step_value_bytes += value_bytes
            self.step_index_bytes += index_bytes
            self.step_dense_bytes += dense_bytes
            self.step_buckets += 1
            self.step_index_dtypes.update(_dtype_name(d) for d in index_dtypes)
            self.step_value_dtypes.add(_dtype_name(value_dtype))

    def as_dict(self) -> dict[str, Any]:
        """The figures as a flat dict (``wire_*`` keys; dtypes as comma-separated names).

        Example:
            >>> w = WireStats()
            >>> w.add(0, 40, 10, 400, [torch.uint8], torch.float32)
            >>> w.as_dict()["wire_step_bytes"], w.as_dict()["wire_index_dtypes"]
            (50, 'uint8')
        """
        with self._lock:
            total = self.value_bytes + self.index_bytes
            return {
                "wire_steps": self.steps,
                "wire_bytes": total,
                "wire_value_bytes": self.value_bytes,
                "wire_index_bytes": self.index_bytes,
                "wire_dense_bytes": self.dense_bytes,
                "wire_bytes_per_step": total / self.steps if self.steps else 0.0,
                "wire_step": -1 if self.step is None else self.step,
                "wire_step_bytes": self.step_value_bytes + self.step_index_bytes,
                "wire_step_value_bytes": self.step_value_bytes,
                "wire_step_index_bytes": self.step_index_bytes,
                "wire_step_dense_bytes": self.step_dense_bytes,
                "wire_step_buckets": self.step_buckets,
                "wire_index_dtypes": ",".join(sorted(self.step_index_dtypes, key=_dtype_order)),
                "wire_value_dtypes": ",".join(sorted(self.step_value_dtypes)),
            }


def _dtype_order(name: str) -> tuple[int, str]:
    return (getattr(torch, name).itemsize, name)


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
        self.wire = WireStats()
        """Bytes this rank passed to the exchange's collectives (see :class:`WireStats`)."""

    def take(self, step: int) -> dict[int, dict[str, torch.Tensor]]:
        """The merged payloads of ``step`` (by optimizer index), emptied for the next step."""
        with self.lock:
            if self.payloads and self.step != step:
                raise UsageError(
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
    buf = bucket.buffer()
    comp, world, group = state.compressor, state.ctx.world_size, state.ctx.group
    keys, spans, vals, idxs, numels = [], [], [], [], []
    off = 0
    with torch.no_grad():
        for p, g in zip(params, grads, strict=True):
            key = state.index.get(id(p))
            if key is None:
                raise UsageError(
                    "lowdiff: a DDP bucket holds a parameter the optimizer does not update; "
                    "optimize every trainable parameter of the model"
                )
            payload = comp.compress(g.detach().reshape(-1).contiguous(), key, step)
            k = payload["values"].numel()
            keys.append(key)
            spans.append((off, off + k))
            vals.append(payload["values"])
            idxs.append(payload["indices"])
            numels.append(g.numel())
            off += k
        # DDP buckets hold one dtype, so the values go out in the gradient's own dtype
        v_local = torch.cat(vals)
        assert v_local.dtype == buf.dtype, (v_local.dtype, buf.dtype)
        # every rank lays the indices out the same: the bucket's tensors, and so their
        # numels and k, are the same everywhere
        lay = IndexLayout(numels, [b - a for a, b in spans])
        i_local = lay.pack(idxs)
    state.wire.add(step, v_local.nbytes, i_local.nbytes, buf.nbytes, lay.dtypes, v_local.dtype)
    v_all = [torch.empty_like(v_local) for _ in range(world)]
    i_all = [torch.empty_like(i_local) for _ in range(world)]
    fv = dist.all_gather(v_all, v_local, group=group, async_op=True).get_future()  # type: ignore[union-attr]
    fi = dist.all_gather(i_all, i_local, group=group, async_op=True).get_future()  # type: ignore[union-attr]

    owner = weakref.ref(state)  # weak: see the module docstring

    def merge(done: Any) -> torch.Tensor:
        for f in done.value():
            f.value()  # raises if a peer failed: never merge half-received buffers
        state = owner()
        if state is None:  # the model and its hook are gone: nobody takes the payloads
            return buf
        with torch.no_grad():
            for j, (key, (a, b), g) in enumerate(zip(keys, spans, grads, strict=True)):
                parts = [(v_all[r][a:b], lay.unpack(i_all[r], j)) for r in range(world)]
                dense = merge_sparse(parts, g.numel(), world)
                support = torch.cat([i for _, i in parts])
                state.put(step, key, state.merged.compress(dense, key, step, support=support))
                g.copy_(dense.view_as(g))
        state.calls += 1
        return buf

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
    # the snapshotter's position of each owned slice, found now: the callback holds no
    # parameter (their hooks lead to the state) and its state only weakly (module docstring)
    owned = [
        (k, g)
        for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True)
        if (k := state.owned.get(id(p))) is not None
    ]
    owner = weakref.ref(state)

    def snap(f: Any) -> torch.Tensor:
        out = f.value()[0]
        state = owner()
        if state is None:  # the model and its hook are gone
            return out
        for k, g in owned:
            state.on_grad(k, g)
        return out

    return fut.then(snap)

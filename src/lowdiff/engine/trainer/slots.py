"""The record slots: shared host rows the trainer fills and the checkpointing process reads.

Slots are used round-robin and consumed in order; the trainer counts the slots it filled
and the checkpointing process counts the ones it consumed (``SLOTS_DONE``, see
:mod:`lowdiff.proc.channel`), so a free slot needs no message. LowDiff writes a step's
compressed payloads into a slot; LowDiff+ snapshots the gradients into one during
backward (:mod:`lowdiff.engine.trainer.snapshot`). Both add the buffers and RNG states right
after the update, and the record's JSON document (:meth:`RecordSlots.row_meta`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, overload

import torch

from lowdiff.engine.trainer.pending import DeviceToHost, fresh_copies
from lowdiff.engine.trainer.training import TrainingObjects, dumps
from lowdiff.errors import InvalidArgumentError
from lowdiff.format import codec
from lowdiff.proc import channel
from lowdiff.proc import holder as rp
from lowdiff.proc.pinned import pin, unpin
from lowdiff.state import capture as st
from lowdiff.state.record import RecordLayout


class RecordSlots:
    """``n`` record rows in shared memory (page-locked when records come from a GPU).

    Args:
        objects: the training objects and their record layout.
        n: the number of slots.
        tensor: shared memory for them, ``(n, row_bytes)`` bytes, made by the process
            (one that a new trainer took over); by default new shared memory.
    """

    def __init__(
        self, objects: TrainingObjects, n: int, tensor: torch.Tensor | None = None
    ) -> None:
        assert objects.snapshot_layout is not None
        self.objects = objects
        self.layout: RecordLayout = objects.snapshot_layout
        if tensor is None:
            rp.ensure_shm_space(n * self.layout.row_bytes, "the record slots")
            tensor = torch.zeros((n, self.layout.row_bytes), dtype=torch.uint8).share_memory_()
        if tuple(tensor.shape) != (n, self.layout.row_bytes):
            raise InvalidArgumentError(
                f"record slots of shape {tuple(tensor.shape)}, expected {(n, self.layout.row_bytes)}"
            )
        self.tensor = tensor
        self.pinned = objects.record_device is not None and pin(self.tensor)
        """Whether a device copies records straight into these slots (asynchronously):
        the checkpointing process never depends on the trainer's device memory."""
        self.views: PerSlot[dict[str, torch.Tensor]] = PerSlot(
            n, lambda i: self.layout.views(self.tensor[i])
        )
        self.dsts: PerSlot[_SlotDsts] = PerSlot(
            n, lambda i: _SlotDsts.of(self.layout, self.views[i])
        )
        self.next = 0
        self.filled = 0
        """Slots handed to the checkpointing process (compared with its SLOTS_DONE)."""
        self._to_host: DeviceToHost | None = None
        self._sched_text = codec.DumpsMemo()
        self._rng_text = codec.DumpsMemo()

    def __len__(self) -> int:
        return len(self.views)

    def rows(self) -> list[torch.Tensor]:
        return [self.tensor[i] for i in range(len(self.views))]

    def take(
        self, wait: Callable[[Callable[[], bool], str], None], counters: Any, what: str
    ) -> int:
        """A free slot: waits (through ``wait(ready, what)``) while all are in use."""
        n = len(self.views)
        if self.filled - int(counters[channel.SLOTS_DONE]) >= n:
            wait(lambda: self.filled - int(counters[channel.SLOTS_DONE]) < n, what)
        slot = self.next
        self.next = (slot + 1) % n
        self.filled += 1
        return slot

    def free(self, counters: Any) -> bool:
        """Whether a slot is free now (:meth:`take` would not wait)."""
        return self.filled - int(counters[channel.SLOTS_DONE]) < len(self.views)

    def give_back(self) -> None:
        """Give back the slot taken last, never handed over."""
        self.filled -= 1
        self.next = (self.next - 1) % len(self.views)

    def release(self) -> None:
        if self.pinned:
            unpin(self.tensor)
            self.pinned = False

    # ------------------------------------------------------------------ filling a row
    def fill_payloads(self, slot: int, payloads: dict[int, dict[str, torch.Tensor]]) -> Any:
        """Copy the step's compressed payloads into ``slot``: synchronously from the CPU
        (returns None); from a CUDA device, with the step's buffers, on a side stream
        after the compute stream's work that made them (returns the event of the copy's
        end: the record may be handed over only once it completed, see
        :mod:`lowdiff.engine.trainer.pending`; :meth:`fill_state` then leaves the
        buffers alone).

        The side stream reads only memory made for the copy on the compute stream: each
        run's concatenation, and a copy of every other payload field and of the buffers.
        The next step may free the payloads and change the buffers (a forward pass) while
        the copy runs; the copy's own sources are kept until it ends (``record_stream``).
        """
        dev = self.objects.record_device
        if dev is None or dev.type != "cuda":
            self._copy_payloads(slot, payloads)
            return None
        if self._to_host is None:
            self._to_host = DeviceToHost(dev)
        dsts, srcs = self._device_sources(slot, payloads)
        return self._to_host.copy(dsts, srcs, non_blocking=self.pinned)

    def _copy_payloads(self, slot: int, payloads: dict[int, dict[str, torch.Tensor]]) -> None:
        """Each run of fields that lie end to end in the row with one dtype (the layout
        groups fields by element size) is filled from one ``torch.cat``: two kernels for
        all its small tensors instead of a copy each. What no complete run covers (a
        parameter without gradient this step) goes through one batched copy."""
        dst = self.dsts[slot]
        filled: list[_Run] = []
        for run in dst.runs:
            srcs = run.gather(payloads)
            if srcs is not None:
                run.fill(srcs)
                filled.append(run)
        if len(filled) == len(dst.runs) and dst.runs_cover_all:
            return  # every field of the row was in a run
        dsts, rest = _rest(dst, filled, payloads)
        if dsts:
            torch._foreach_copy_(dsts, rest)

    def _device_sources(
        self, slot: int, payloads: dict[int, dict[str, torch.Tensor]]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The row's destinations and, on the device, new memory holding what goes there:
        each complete run's concatenation, a copy of every other field and of the buffers."""
        dst = self.dsts[slot]
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        filled: list[_Run] = []
        for run in dst.runs:
            got = run.gather(payloads)
            if got is not None:
                dsts.append(run.view)
                srcs.append(torch.cat(got))
                filled.append(run)
        rest_dsts, rest = _rest(dst, filled, payloads)
        dsts += rest_dsts
        srcs += fresh_copies(rest)
        if dst.buffers:
            dsts += dst.buffers
            srcs += fresh_copies(self.objects.buffer_refs.tensors())
        return dsts, srcs

    def fill_state(self, slot: int, buffers: bool = True) -> tuple[Any, Any]:
        """Write the step's buffers (unless ``buffers`` is False: the device copies them,
        see :meth:`fill_payloads`) and RNG states into ``slot``, right after the update.

        Returns the RNG bookkeeping and the extra state (``extra_state=``) of this moment.
        """
        objects = self.objects
        assert objects.rng_capture is not None
        dst = self.dsts[slot]
        if buffers and dst.buffers:
            torch._foreach_copy_(dst.buffers, objects.buffer_refs.tensors())
        rng_extra = objects.rng_capture.into(self.views[slot])
        return rng_extra, st.capture_extra(objects.extra)

    def row_meta(
        self,
        t: int,
        nograd: list[int],
        hp: str,
        rng_extra: Any,
        extra: Any,
        scale: tuple[str, float, list[int]] | None = None,
    ) -> str:
        """The record's JSON document (``codec.dumps`` of ``{"hp", "hp_after", "nograd",
        "rng", "sched", "step"}``, keys sorted, and ``"scale"`` when LowDiff+ carries a
        clip's factor); the hyperparameters after the update and the scheduler's state
        are taken now (after the scheduler stepped)."""
        objects = self.objects
        sched = (
            "null"
            if objects.scheduler is None
            else self._sched_text(objects.scheduler.state_dict())
        )
        scaled = "" if scale is None else f'"scale":{dumps(list(scale))},'
        doc = (
            f'{{"hp":{hp},"hp_after":{objects.hp_text(objects.optimizer)},"nograd":{dumps(nograd)},'
            f'"rng":{self._rng_text(rng_extra)},"sched":{sched},{scaled}"step":{int(t)}}}'
        )
        # the extra-state tree (already encoded) goes last, before the closing brace
        return doc if extra is None else f'{doc[:-1]},"extra":{dumps(extra)}}}'


def _rest(
    dst: _SlotDsts, filled: list[_Run], payloads: dict[int, dict[str, torch.Tensor]]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The payload fields no run in ``filled`` covers: their views in the row, and the
    payload tensors."""
    done = {key for run in filled for key in run.keys}
    dsts: list[torch.Tensor] = []
    rest: list[torch.Tensor] = []
    for index, payload in payloads.items():
        fields = dst.payload.get(index)
        if fields is None:
            continue  # under DDP: another rank's shard
        for name, tensor in payload.items():
            if (index, name) not in done:
                dsts.append(fields[name])
                rest.append(tensor)
    return dsts, rest


T = TypeVar("T")


class PerSlot(Sequence[T]):
    """One item per slot, made the first time that slot is used: a restart needs the
    first slot at once, not all of them (views of a row cost a few hundred µs each)."""

    def __init__(self, n: int, make: Callable[[int], T]) -> None:
        self._items: list[T | None] = [None] * n
        self._make = make

    def __len__(self) -> int:
        return len(self._items)

    @overload
    def __getitem__(self, i: int) -> T: ...
    @overload
    def __getitem__(self, i: slice) -> list[T]: ...
    def __getitem__(self, i: int | slice) -> T | list[T]:
        if isinstance(i, slice):
            return [self[k] for k in range(len(self._items))[i]]
        item = self._items[i]
        if item is None:
            item = self._items[i] = self._make(i % len(self._items))
        return item


@dataclasses.dataclass
class _SlotDsts:
    """One record slot's destination tensors, resolved once per slot."""

    payload: dict[int, dict[str, torch.Tensor]]
    """Parameter index -> compressed field -> its view in the row."""
    buffers: list[torch.Tensor]
    """The buffers' views, in the layout's order."""
    runs: list[_Run]
    """The payload fields grouped into runs that lie end to end with one dtype."""
    runs_cover_all: bool
    """Whether every payload field is in a run."""

    @staticmethod
    def of(layout: RecordLayout, views: dict[str, torch.Tensor]) -> _SlotDsts:
        payload = {info.index: layout.payload(views, k) for k, info in enumerate(layout.params)}
        runs = _Run.plan(payload)
        n_fields = sum(len(f) for f in payload.values())
        covered = sum(len(r.keys) for r in runs) == n_fields
        return _SlotDsts(payload, list(layout.buffer_values(views).values()), runs, covered)


@dataclasses.dataclass
class _Run:
    """Payload fields that lie end to end in a record row with one dtype: one view."""

    view: torch.Tensor
    """1-D, over all the fields' bytes."""
    keys: list[tuple[int, str]]
    """(parameter index, field name), in row order."""
    flatten: bool
    """Whether some field has more than one dimension (sources are flattened first)."""

    def gather(self, payloads: dict[int, dict[str, torch.Tensor]]) -> list[torch.Tensor] | None:
        """The run's sources in row order, or None if one is missing."""
        out: list[torch.Tensor] = []
        for index, name in self.keys:
            p = payloads.get(index)
            t = None if p is None else p.get(name)
            if t is None:
                return None
            out.append(t)
        if self.flatten:
            out = [t.reshape(-1) for t in out]
        return out

    def fill(self, srcs: list[torch.Tensor]) -> None:
        """Write the sources into the run. The concatenation is copied in (not written
        with ``out=``, which would resize the view if a source had another size): the
        copy checks the size, as a copy per field does."""
        self.view.copy_(torch.cat(srcs))

    @staticmethod
    def plan(payload: dict[int, dict[str, torch.Tensor]]) -> list[_Run]:
        """Runs of two or more fields (a lone field gains nothing from a cat)."""
        fields = sorted(
            (
                (t.data_ptr(), index, name, t)
                for index, f in payload.items()
                for name, t in f.items()
            ),
            key=lambda x: x[0],
        )
        groups: list[list[tuple[int, str, torch.Tensor]]] = []
        end = -1
        for ptr, index, name, t in fields:
            g = groups[-1] if groups else None
            if g is not None and ptr == end and t.dtype == g[-1][2].dtype and t.is_contiguous():
                g.append((index, name, t))
            else:
                groups.append([(index, name, t)])
            end = ptr + t.numel() * t.element_size()
        runs = []
        for g in groups:
            first = g[0][2]
            if len(g) < 2 or not first.is_contiguous():
                continue
            total = sum(t.numel() for _, _, t in g)
            view = first.as_strided((total,), (1,), first.storage_offset())
            flat = any(t.dim() != 1 for _, _, t in g)
            runs.append(_Run(view, [(i, n) for i, n, _ in g], flat))
        return runs

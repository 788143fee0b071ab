"""The plan of LowDiff+'s layer-wise gradient snapshots (see
:mod:`lowdiff.engine.trainer.snapshot`): which gradients are copied together, how a copy
is cut, and how ``finish()`` tells from version counters whether a slot still holds a
gradient."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from lowdiff.state.capture import ParamInfo


@dataclass
class Block:
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
    gradient_copies: int = 0
    """Gradients copied to a slot, during backward and at step(), every copy counted."""
    scaled: int = 0
    """Steps whose slot kept the gradients as copied during backward, with the factor
    of a clip made through ``ck.clip_grad_norm_`` carried to the replica instead of a
    second copy."""
    extra: dict[str, float] = field(default_factory=dict)


def plan_blocks(offsets: list[tuple[int, int]], block_bytes: int) -> list[Block]:
    """Group parameters (given as (start, end) byte ranges in row order) into blocks."""
    order = sorted(range(len(offsets)), key=lambda k: offsets[k][0])
    blocks: list[Block] = []
    for k in order:
        a, b = offsets[k]
        if b - a > block_bytes:
            blocks.append(Block([k], a, b, chunked=True))
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
            blocks.append(Block([k], a, b))
    return blocks


def same_bytes(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    """Whether two lists of tensors hold the same bytes, in one comparison for all.

    Bytes, not values: ``-0.0`` and ``0.0`` differ, and a NaN equals its own bits.
    """
    if [(t.shape, t.dtype) for t in a] != [(t.shape, t.dtype) for t in b]:
        return False

    def flat(ts: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in ts])

    return torch.equal(flat(a), flat(b))


def no_grad_thread() -> None:
    # the copy thread never records autograd history, whatever the gradients require
    torch.set_grad_enabled(False)


SERIAL_ELEMS = 32768
"""Most elements one copy of the CPU copy thread moves: at ATen's grain size
(``at::internal::GRAIN_SIZE``) or below, a copy runs on the calling thread alone. A larger
one would start an OpenMP team of its own, which competes with backward's team for the
same cores and waits for its slowest thread; on a loaded machine that costs more than the
copy itself."""

SAME, CHANGED, UNSURE = 0, 1, 2
"""``finish()``'s verdicts on one gradient that had a hook (:func:`verdict`)."""


def row_offsets(
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


def piece_elems(b: Block, dst: torch.Tensor, chunk_bytes: int) -> int:
    """How a copy by a thread other than the trainer's cuts ``dst`` (0: whole)."""
    n = SERIAL_ELEMS
    if b.chunked:
        n = min(n, max(1, chunk_bytes // max(1, dst.element_size())))
    return n if dst.numel() > n else 0


def block_dsts(dsts: list[torch.Tensor], b: Block, cuts: list[int] | None) -> list[torch.Tensor]:
    """A block's destinations in one slot, cut as ``cuts`` says (None: every one whole)."""
    if cuts is None:
        return [dsts[k] for k in b.members]
    out: list[torch.Tensor] = []
    for k, n in zip(b.members, cuts, strict=True):
        if n:
            out.extend(dsts[k].view(-1).split(n))
        else:
            out.append(dsts[k])
    return out


@dataclass
class CpuCopies:
    """On CPU: per block, how a copy by a thread other than the trainer's cuts each member
    (None: none is cut), and per slot the destinations of each block's foreach copy: cut
    that way (``block_dsts``), and whole (``whole_dsts``, inline copies on the trainer's
    thread)."""

    pieces: list[list[int] | None] = field(default_factory=list)
    block_dsts: list[list[list[torch.Tensor]]] = field(default_factory=list)
    whole_dsts: list[list[list[torch.Tensor]]] = field(default_factory=list)

    @classmethod
    def plan(
        cls, blocks: list[Block], dsts: list[list[torch.Tensor]], chunk_bytes: int
    ) -> CpuCopies:
        """The copies of ``blocks`` into every slot's destinations ``dsts``."""
        out = cls()
        for b in blocks:
            cuts = [piece_elems(b, dsts[0][k], chunk_bytes) for k in b.members]
            out.pieces.append(cuts if any(cuts) else None)
        out.block_dsts = [
            [block_dsts(d, b, c) for b, c in zip(blocks, out.pieces, strict=True)] for d in dsts
        ]
        out.whole_dsts = [[[d[k] for k in b.members] for b in blocks] for d in dsts]
        return out


def verdict(
    g: torch.Tensor,
    seen: tuple[torch.Tensor, int],
    grad_at: tuple[torch.Tensor | None, int] | None,
    used: bool,
) -> int:
    """Whether the slot still holds ``.grad`` (``g``) of a parameter, by version counters
    alone (:data:`SAME`, :data:`CHANGED` or :data:`UNSURE`): ``seen`` is what its hook
    copied and the version then; under DDP ``grad_at`` is ``.grad`` and its version when
    the hook handed over the bucket view, and ``used`` whether this rank accumulated it."""
    snapped, version = seen
    if snapped is g:
        return SAME if g._version == version else CHANGED
    if grad_at is None:
        return CHANGED  # not DDP: .grad was replaced by another tensor after its hook
    if snapped._version != version:
        return CHANGED  # the bucket was written after the copy
    before, v0 = grad_at
    if g is not before:
        return UNSURE  # .grad was created after the hook (by DDP, or by hand)
    if (
        g.data_ptr() == snapped.data_ptr()
        and g.dtype == snapped.dtype
        and g.shape == snapped.shape
        and g.stride() == snapped.stride()
    ):
        return SAME if g._version == v0 else CHANGED  # .grad is the bucket view
    if not used:
        return UNSURE  # DDP copies into .grad only if some rank used the parameter
    if g._version == v0 + 1:
        return SAME  # DDP's one copy from the bucket, nothing since
    return CHANGED if g._version > v0 + 1 else UNSURE


class ClipRecord:
    """A clip's in-place multiplication of the gradients by one factor, as the
    snapshot saw it (:meth:`lowdiff.engine.trainer.snapshot.GradSnapshotter.record_scaling`).

    Per parameter: its gradient, the verdict on the slot's copy just before the clip
    (:func:`verdict`), and the version counters of the gradient and of the tensor its
    hook copied just after the clip. At ``finish()`` a gradient whose slot copy was
    :data:`SAME` before the clip, and whose counters have not moved since, is in the slot
    as the clip found it: the replica multiplies it by ``spec``'s factor.
    """

    def __init__(
        self,
        spec: tuple[str, float],
        entries: list[tuple[torch.Tensor, int, int, int] | None],
    ) -> None:
        self.spec = spec
        """(dtype name, factor)."""
        self.entries = entries

    @classmethod
    def around(
        cls,
        multiply: Callable[[], None],
        spec: tuple[str, float],
        grads: list[torch.Tensor | None],
        seen: list[tuple[torch.Tensor, int] | None],
        grad_at: list[tuple[torch.Tensor | None, int] | None],
        used: list[bool],
    ) -> ClipRecord:
        """Judge every snapshotted gradient, run ``multiply``, note the counters."""
        before: list[tuple[torch.Tensor, int] | None] = []
        for g, s, at, u in zip(grads, seen, grad_at, used, strict=True):
            before.append(None if g is None or s is None else (g, verdict(g, s, at, u)))
        multiply()
        entries: list[tuple[torch.Tensor, int, int, int] | None] = []
        for b, s in zip(before, seen, strict=True):
            if b is None or s is None:
                entries.append(None)
            else:
                entries.append((b[0], b[1], b[0]._version, s[0]._version))
        return cls(spec, entries)

    def kept(
        self,
        grads: list[torch.Tensor | None],
        seen: list[tuple[torch.Tensor, int] | None],
        copied_whole: Callable[[int], bool],
    ) -> dict[int, bool]:
        """Per parameter with a gradient: whether its slot copy is to be multiplied."""
        out: dict[int, bool] = {}
        for k, (g, e, s) in enumerate(zip(grads, self.entries, seen, strict=True)):
            if g is None:
                continue
            out[k] = (
                e is not None
                and s is not None
                and e[1] == SAME
                and g is e[0]
                and g._version == e[2]
                and s[0]._version == e[3]
                and copied_whole(k)
            )
        return out

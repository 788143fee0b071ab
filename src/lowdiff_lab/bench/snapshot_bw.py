"""LowDiff+ gradient snapshot copies against this machine's memcpy bandwidth.

:func:`snapshot_bandwidth_bench` trains a workload on the CPU with the LowDiff+ gradient
snapshotter (:class:`lowdiff.engine.trainer.snapshot.GradSnapshotter`) attached, exactly as
``method="lowdiff+"`` attaches it: autograd hooks, shared-memory slots laid out by the
record layout, the default block and chunk sizes. No checkpointing process is started;
the slots are handed back round-robin.

Two figures are compared, measured alternately in the same process with the same torch
thread count:

- **memcpy**: ``dst.copy_(src)`` of one contiguous tensor holding as many bytes as the
  model's gradients into a shared-memory tensor of the same size (``memcpy_gbps``), and
  the same bytes copied as one ``copy_`` per parameter tensor into per-parameter views of
  a shared-memory buffer (``memcpy_split_gbps``), which shows the per-tensor cost; and,
  for reference, the contiguous copy by one thread (``memcpy_one_thread_gbps``: pieces of
  at most ATen's grain size, which no OpenMP team shares), the way the snapshotter's
  copy thread moves large gradients;
- **snapshot**: gradient bytes the snapshotter's block copies wrote during a training
  step, divided by the time spent in those copies (``SnapshotStats.copy_bytes /
  SnapshotStats.copy_s``, summed over the step's blocks). Under ``copy_mode="inline"``
  (the default on a machine whose cores PyTorch's intra-op threads all use) a block is
  copied in its hook, on the thread running backward, with the intra-op threads; under
  ``"thread"`` it is the background copy thread's busy time in its tasks, which run
  concurrently with backward, so that time includes whatever backward's compute takes
  from the copies. It counts neither ``finish()``'s wait nor the hooks' bookkeeping.

The gradients are separate tensors and the snapshot makes one copy per tensor, so
``snapshot_over_split`` (against a ``copy_`` per tensor of the same sizes) shows how
much of the gap to one contiguous copy is the number of tensors: a model with many small
tensors cannot reach the contiguous figure by any copy that keeps them apart.

Every step ends with a check that the slot holds the step's gradients bit for bit.

Example:
    >>> rows = snapshot_bandwidth_bench(workload="gpt2-tiny", repeats=1, steps=2)
    >>> rows[0]["identical"]
    True
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lowdiff.compressors import NoCompression
from lowdiff.engine.trainer.snapshot import GradSnapshotter
from lowdiff.engine.trainer.snapshot_plan import SERIAL_ELEMS
from lowdiff.state.capture import RngLayout, optimizer_params
from lowdiff.state.record import RecordLayout
from lowdiff_lab.workloads.zoo import build_workload

SNAPSHOT_TARGET = 0.70
"""Issue target: snapshot copies at 70% or more of this machine's memcpy bandwidth."""

DEFINITION = (
    "snapshot_gbps: gradient bytes written by the snapshotter's block copies during "
    "backward, over the time spent in those copies (SnapshotStats.copy_bytes / copy_s, per "
    "step, median over steps; copy_mode says where they ran); memcpy_gbps: the same number "
    "of bytes as one contiguous dst.copy_(src) into shared memory (median); "
    "memcpy_split_gbps: the same bytes as one copy_ per parameter tensor; "
    "memcpy_one_thread_gbps: the contiguous copy in pieces of at most 32768 elements (one "
    "thread); same process, same torch thread count, alternating with the training steps"
)
"""What the row's figures measure (stored in every row)."""

N_SLOTS = 2
"""Snapshot slots, as ``max_lag=2`` gives them."""


def _gbps(nbytes: int, seconds: float) -> float:
    """Gigabytes per second (infinite when the clock saw no time pass)."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes end to end (their own dtype when they share one)."""
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) == 1:
        return torch.cat([t.detach().reshape(-1) for t in tensors])
    return torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in tensors])


def _timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` took."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class _Rig:
    """A workload with the snapshotter attached as ``method="lowdiff+"`` attaches it,
    its slots handed back round-robin (no checkpointing process takes them)."""

    def __init__(self, workload: str, copy_mode: str) -> None:
        self.workload = build_workload(workload, seed=0)
        opt = torch.optim.SGD(self.workload.model.parameters(), lr=0.0)
        self.params = optimizer_params(self.workload.model, opt)
        layout = RecordLayout.build([i for i, _ in self.params], NoCompression(), [], RngLayout())
        slots = torch.zeros((N_SLOTS, layout.row_bytes), dtype=torch.uint8).share_memory_()
        self.views = [layout.views(slots[s]) for s in range(N_SLOTS)]
        self.handed = 0
        self.identical = True
        """Every slot held its step's gradients bit for bit, so far."""
        self.snap = GradSnapshotter(
            self.params, [slots[s] for s in range(N_SLOTS)], self.views, self._acquire,
            copy_mode=copy_mode,
        )  # fmt: skip

    def _acquire(self) -> int:
        """The next slot, round-robin (nothing else holds one)."""
        slot = self.handed % N_SLOTS
        self.handed += 1
        return slot

    def train_step(self, step: int) -> tuple[int, float]:
        """One forward and backward with the snapshot taken, checked against the
        gradients; the bytes the block copies wrote and the seconds they took."""
        c0, b0 = self.snap.stats.copy_s, self.snap.stats.copy_bytes
        self.workload.model.zero_grad(set_to_none=True)
        self.workload.forward_backward(step)
        slot, nograd = self.snap.finish()
        for info, p in self.params:
            if info.index in nograd or p.grad is None:
                continue
            got = self.views[slot][f"g{info.index}.values"]
            self.identical = self.identical and torch.equal(got, p.grad.reshape(-1))
        return self.snap.stats.copy_bytes - b0, self.snap.stats.copy_s - c0

    def close(self) -> None:
        """Stop the snapshotter (its hooks and copy thread)."""
        self.snap.close()


class _Copies:
    """The gradients' bytes, copied into shared memory three ways: one contiguous
    ``copy_``, one ``copy_`` per tensor, and by one thread in pieces of at most
    :data:`~lowdiff.engine.trainer.snapshot_plan.SERIAL_ELEMS` elements."""

    def __init__(self, grads: list[torch.Tensor]) -> None:
        self.grads = grads
        self.nbytes = sum(g.numel() * g.element_size() for g in grads)
        self.src = _flat(grads)
        self.dst = torch.empty_like(self.src).share_memory_()
        self.split_dst = torch.empty_like(self.src).share_memory_()
        self.split_views: list[torch.Tensor] = []
        off = 0
        for g in grads:
            n = g.numel() * g.element_size() // self.src.element_size()
            self.split_views.append(self.split_dst[off : off + n].view(g.dtype).view(g.shape))
            off += n
        self.one_dst = list(torch.empty_like(self.src).share_memory_().split(SERIAL_ELEMS))
        self.one_src = list(self.src.split(SERIAL_ELEMS))

    def contiguous(self) -> None:
        """The gradients' bytes as one contiguous ``copy_``."""
        self.dst.copy_(self.src)

    def per_tensor(self) -> None:
        """The same bytes as one ``copy_`` per gradient tensor."""
        for d, g in zip(self.split_views, self.grads, strict=True):
            d.copy_(g)

    def one_thread(self) -> None:
        """The same bytes in pieces no OpenMP team shares (one thread)."""
        torch._foreach_copy_(self.one_dst, self.one_src)

    def identical(self) -> bool:
        """Every copy holds the source's bits."""
        return (
            torch.equal(self.dst, self.src)
            and torch.equal(self.split_dst, self.src)
            and torch.equal(torch.cat(self.one_dst), self.src)
        )


@dataclass
class _Samples:
    """Per training step: the snapshot's bytes and bandwidth, and each memcpy's seconds."""

    copy_bytes: list[int] = field(default_factory=list)
    snapshot_gbps: list[float] = field(default_factory=list)
    memcpy_s: list[float] = field(default_factory=list)
    split_s: list[float] = field(default_factory=list)
    one_s: list[float] = field(default_factory=list)


def snapshot_bandwidth_bench(
    *,
    workload: str = "gpt2-demo",
    repeats: int = 5,
    steps: int = 5,
    copy_mode: str = "auto",
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Measure the snapshotter's copy bandwidth against a plain memcpy, side by side.

    Args:
        workload: A :func:`lowdiff_lab.workloads.zoo.build_workload` name (built with
            ``seed=0`` on the CPU).
        repeats: Rounds; each round runs ``steps`` training steps, each followed by one
            contiguous and one per-tensor memcpy of the gradients' size.
        steps: Training steps per round (after one untimed step).
        copy_mode: The snapshotter's ``copy_mode`` (``"auto"``: what ``method="lowdiff+"``
            uses on this machine).
        progress: Called with a short status text per round.

    Returns:
        One row: ``memcpy_gbps``, ``memcpy_split_gbps``, ``memcpy_one_thread_gbps`` and
        ``snapshot_gbps`` (medians), ``snapshot_over_memcpy`` (the target's ratio),
        ``snapshot_over_split``, ``snapshot_over_one_thread``, ``target`` (:data:`SNAPSHOT_TARGET`), ``met``,
        ``copy_mode`` (where the copies ran: ``"inline"`` or ``"thread"``),
        ``identical`` (every slot held its step's gradients bit for bit),
        ``definition`` (:data:`DEFINITION`) and the case (workload, bytes, tensors,
        blocks, threads).

    Raises:
        ValueError: If ``repeats`` or ``steps`` is below 1.

    Example:
        >>> row = snapshot_bandwidth_bench(workload="gpt2-tiny", repeats=1, steps=2)[0]
        >>> row["snapshot_over_memcpy"] > 0
        True
    """
    if repeats < 1 or steps < 1:
        raise ValueError(f"repeats and steps must be at least 1, got {repeats} and {steps}")
    say = progress or (lambda _m: None)
    say(f"snapshot bandwidth: building {workload}")
    rig = _Rig(workload, copy_mode)
    try:
        rig.train_step(0)  # untimed: first-touch of the slots, allocator warm-up
        copies = _Copies([p.grad.detach().clone() for _, p in rig.params if p.grad is not None])
        samples = _Samples()
        step = 1
        for r in range(repeats):
            say(f"snapshot bandwidth: {workload} round {r + 1}/{repeats}")
            for _ in range(steps):
                nb, cs = rig.train_step(step)
                step += 1
                samples.copy_bytes.append(nb)
                samples.snapshot_gbps.append(_gbps(nb, cs))
                samples.memcpy_s.append(_timed(copies.contiguous))
                samples.split_s.append(_timed(copies.per_tensor))
                samples.one_s.append(_timed(copies.one_thread))
        identical = rig.identical and copies.identical()
        blocks = rig.snap.blocks
    finally:
        rig.close()
    case = {
        "workload": workload,
        "grad_bytes": copies.nbytes,
        "tensors": len(copies.grads),
        "blocks": len(blocks),
        "chunked_blocks": sum(b.chunked for b in blocks),
        "identical": identical,
        "copy_mode": rig.snap.copy_mode,
        "repeats": repeats,
        "steps": steps,
    }
    return [_row(case, copies.nbytes, samples)]


def _row(case: dict[str, Any], nbytes: int, samples: _Samples) -> dict[str, Any]:
    """The bench's row: the medians, their ratios and the target, after the case."""
    memcpy = _gbps(nbytes, statistics.median(samples.memcpy_s))
    split = _gbps(nbytes, statistics.median(samples.split_s))
    one = _gbps(nbytes, statistics.median(samples.one_s))
    snapshot = statistics.median(samples.snapshot_gbps)
    ratio = snapshot / memcpy
    return {
        "workload": case["workload"],
        "grad_bytes": case["grad_bytes"],
        "tensors": case["tensors"],
        "blocks": case["blocks"],
        "chunked_blocks": case["chunked_blocks"],
        "copy_bytes_per_step": statistics.median(samples.copy_bytes),
        "memcpy_gbps": memcpy,
        "memcpy_split_gbps": split,
        "memcpy_one_thread_gbps": one,
        "snapshot_gbps": snapshot,
        "snapshot_over_memcpy": ratio,
        "snapshot_over_split": snapshot / split,
        "snapshot_over_one_thread": snapshot / one,
        "target": SNAPSHOT_TARGET,
        "met": ratio >= SNAPSHOT_TARGET,
        "identical": case["identical"],
        "copy_mode": case["copy_mode"],
        "snapshot_gbps_per_step": samples.snapshot_gbps,
        "repeats": case["repeats"],
        "steps": case["steps"],
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "definition": DEFINITION,
    }


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    out = [
        "| workload | copies | gradients | tensors | memcpy | memcpy per tensor | memcpy, one thread "
        "| snapshot copies | snapshot / memcpy | target | same bits |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['workload']} | {r['copy_mode']} | {r['grad_bytes'] / 1e6:.1f} MB | {r['tensors']} "
            f"| {r['memcpy_gbps']:.2f} GB/s | {r['memcpy_split_gbps']:.2f} GB/s "
            f"| {r['memcpy_one_thread_gbps']:.2f} GB/s "
            f"| {r['snapshot_gbps']:.2f} GB/s | {r['snapshot_over_memcpy']:.2f} "
            f"| ≥ {r['target']:.2f} {'(met)' if r['met'] else '(not met)'} "
            f"| {'yes' if r['identical'] else 'NO'} |"
        )
    return "\n".join(out)

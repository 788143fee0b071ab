"""LowDiff+ gradient snapshot copies against this machine's memcpy bandwidth.

:func:`snapshot_bandwidth_bench` trains a workload on the CPU with the LowDiff+ gradient
snapshotter (:class:`lowdiff.engine.snapshot.GradSnapshotter`) attached, exactly as
``strategy="lowdiff+"`` attaches it: autograd hooks, shared-memory slots laid out by the
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
from typing import Any

import torch

from lowdiff.compressors import NoCompression
from lowdiff.engine.record import RecordLayout
from lowdiff.engine.snapshot import _SERIAL_ELEMS, GradSnapshotter
from lowdiff.engine.state import RngLayout, optimizer_params

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
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes end to end (their own dtype when they share one)."""
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) == 1:
        return torch.cat([t.detach().reshape(-1) for t in tensors])
    return torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in tensors])


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


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
        workload: A :func:`lowdiff.workloads.zoo.build_workload` name (built with
            ``seed=0`` on the CPU).
        repeats: Rounds; each round runs ``steps`` training steps, each followed by one
            contiguous and one per-tensor memcpy of the gradients' size.
        steps: Training steps per round (after one untimed step).
        copy_mode: The snapshotter's ``copy_mode`` (``"auto"``: what ``strategy="lowdiff+"``
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
    from lowdiff.workloads.zoo import build_workload

    say = progress or (lambda _m: None)
    say(f"snapshot bandwidth: building {workload}")
    w = build_workload(workload, seed=0)
    opt = torch.optim.SGD(w.model.parameters(), lr=0.0)
    params = optimizer_params(w.model, opt)
    layout = RecordLayout.build([i for i, _ in params], NoCompression(), [], RngLayout())
    slots = torch.zeros((N_SLOTS, layout.row_bytes), dtype=torch.uint8).share_memory_()
    views = [layout.views(slots[s]) for s in range(N_SLOTS)]
    taken: list[int] = []

    def acquire() -> int:
        taken.append(len(taken) % N_SLOTS)
        return taken[-1]

    snap = GradSnapshotter(
        params, [slots[s] for s in range(N_SLOTS)], views, acquire, copy_mode=copy_mode
    )
    mode = snap.copy_mode
    identical = True
    snap_gbps: list[float] = []
    copy_bytes: list[int] = []
    try:

        def train_step(step: int) -> tuple[int, float]:
            nonlocal identical
            c0, b0 = snap.stats.copy_s, snap.stats.copy_bytes
            w.model.zero_grad(set_to_none=True)
            w.forward_backward(step)
            slot, nograd = snap.finish()
            for info, p in params:
                if info.index in nograd or p.grad is None:
                    continue
                got = views[slot][f"g{info.index}.values"]
                identical = identical and torch.equal(got, p.grad.reshape(-1))
            return snap.stats.copy_bytes - b0, snap.stats.copy_s - c0

        train_step(0)  # untimed: first-touch of the slots, allocator warm-up
        grads = [p.grad.detach().clone() for _, p in params if p.grad is not None]
        nbytes = sum(g.numel() * g.element_size() for g in grads)
        src = _flat(grads)
        dst = torch.empty_like(src).share_memory_()
        split_dst = torch.empty_like(src).share_memory_()
        split_views: list[torch.Tensor] = []
        off = 0
        for g in grads:
            n = g.numel() * g.element_size() // src.element_size()
            split_views.append(split_dst[off : off + n].view(g.dtype).view(g.shape))
            off += n

        def split_copy() -> None:
            for d, g in zip(split_views, grads, strict=True):
                d.copy_(g)

        one_dst = list(torch.empty_like(src).share_memory_().split(_SERIAL_ELEMS))
        one_src = list(src.split(_SERIAL_ELEMS))

        memcpy_s: list[float] = []
        split_s: list[float] = []
        one_s: list[float] = []
        step = 1
        for r in range(repeats):
            say(f"snapshot bandwidth: {workload} round {r + 1}/{repeats}")
            for _ in range(steps):
                nb, cs = train_step(step)
                step += 1
                copy_bytes.append(nb)
                snap_gbps.append(_gbps(nb, cs))
                memcpy_s.append(_timed(lambda: dst.copy_(src)))
                split_s.append(_timed(split_copy))
                one_s.append(_timed(lambda: torch._foreach_copy_(one_dst, one_src)))
        identical = (
            identical
            and torch.equal(dst, src)
            and torch.equal(split_dst, src)
            and torch.equal(torch.cat(one_dst), src)
        )
        n_blocks = len(snap.blocks)
        n_chunked = sum(b.chunked for b in snap.blocks)
    finally:
        snap.close()
    memcpy = _gbps(nbytes, statistics.median(memcpy_s))
    split = _gbps(nbytes, statistics.median(split_s))
    one = _gbps(nbytes, statistics.median(one_s))
    snapshot = statistics.median(snap_gbps)
    ratio = snapshot / memcpy
    return [
        {
            "workload": workload,
            "grad_bytes": nbytes,
            "tensors": len(grads),
            "blocks": n_blocks,
            "chunked_blocks": n_chunked,
            "copy_bytes_per_step": statistics.median(copy_bytes),
            "memcpy_gbps": memcpy,
            "memcpy_split_gbps": split,
            "memcpy_one_thread_gbps": one,
            "snapshot_gbps": snapshot,
            "snapshot_over_memcpy": ratio,
            "snapshot_over_split": snapshot / split,
            "snapshot_over_one_thread": snapshot / one,
            "target": SNAPSHOT_TARGET,
            "met": ratio >= SNAPSHOT_TARGET,
            "identical": identical,
            "copy_mode": mode,
            "snapshot_gbps_per_step": snap_gbps,
            "repeats": repeats,
            "steps": steps,
            "torch_threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "definition": DEFINITION,
        }
    ]


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

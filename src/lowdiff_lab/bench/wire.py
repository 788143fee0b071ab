"""Bytes on the wire per step: lowdiff's sparse DDP exchange against a dense all-reduce.

:func:`ddp_wire_bench` runs a real ``world_size``-rank DDP job on gloo (spawned
processes on this machine) in which every rank trains a zoo workload through
``lowdiff.Checkpointer`` with ``method="lowdiff"`` and a top-k compressor, and reads,
after every step, the bytes its communication hook passed to the collectives
(:class:`lowdiff.ddp.hooks.WireStats`: the ``nbytes`` of the tensors handed to the
all-gathers, not a formula). Per rank and step:

- ``lowdiff_bytes`` (measured): this rank's contribution to the all-gathers, values plus
  indices over every bucket. A ring all-gather sends ``world_size - 1`` contributions per
  rank: ``lowdiff_ring_bytes = (n - 1) * lowdiff_bytes``.
- ``dense_payload_bytes``: what DDP's default all-reduce reduces, the gradients' numel x
  element size. A ring all-reduce sends ``2 (n - 1) / n`` payloads per rank:
  ``dense_ring_bytes = 2 (n - 1) / n * dense_payload_bytes``.
- ``lowdiff_over_dense = lowdiff_ring_bytes / dense_ring_bytes`` (bytes each rank sends
  under the ring algorithms) and ``lowdiff_over_dense_payload = lowdiff_bytes /
  dense_payload_bytes``. The all-gather's cost grows with ``n`` where the all-reduce's
  does not, so at a fixed ratio the sparse exchange stops paying near
  ``lowdiff_over_dense_payload = 2 / n``.

Example:
    >>> rows = ddp_wire_bench(workload="gpt2-tiny", steps=2)  # doctest: +SKIP
    >>> rows[0]["lowdiff_over_dense"] < 0.05, rows[0]["index_dtypes"]  # doctest: +SKIP
    (True, 'uint8,uint16')
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import lowdiff
from lowdiff.attach import own_strategy
from lowdiff_lab.workloads.zoo import build_workload, workload_names

RUN_TIMEOUT_S = 300.0
"""Seconds the ranks get before the bench stops them and raises."""


def _rank_main(
    rank: int,
    world_size: int,
    work: str,
    workload: str,
    ratio: float,
    steps: int,
) -> None:
    """One rank: train ``steps`` steps under lowdiff's hook, write this rank's rows."""
    # the ranks share the machine's cores: one thread each, as the DDP tests run
    torch.set_num_threads(1)
    root = Path(work)
    dist.init_process_group(
        "gloo", init_method=f"file://{root / 'store'}", rank=rank, world_size=world_size
    )
    try:
        w = build_workload(workload, seed=0)
        model = DDP(w.model)
        w.model = model  # the workload's loss then runs the forward pass through DDP
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        grads = [p for p in model.parameters() if p.requires_grad]
        dense_payload = sum(p.numel() * p.element_size() for p in grads)
        rows: list[dict[str, Any]] = []
        with lowdiff.Checkpointer(
            root / "ck", model, opt, compressor=lowdiff.TopK(ratio=ratio)
        ) as ck:
            ck.resume()
            hook = own_strategy(ck).ddp_hook_state
            if hook is None:
                raise RuntimeError("the lowdiff strategy registered no DDP communication hook")
            for step in range(steps):
                opt.zero_grad(set_to_none=True)
                w.loss(w.batch(step * world_size + rank)).backward()
                ck.step()
                wire = hook.wire.as_dict()
                if wire["wire_step"] != step:
                    raise RuntimeError(f"the hook counted step {wire['wire_step']}, not {step}")
                sent = int(wire["wire_step_bytes"])
                ring = (world_size - 1) * sent
                dense_ring = 2 * (world_size - 1) / world_size * dense_payload
                rows.append(
                    {
                        "experiment": "wire",
                        "workload": workload,
                        "world_size": world_size,
                        "rank": rank,
                        "step": step,
                        "ratio": ratio,
                        "params": sum(p.numel() for p in grads),
                        "buckets": int(wire["wire_step_buckets"]),
                        "lowdiff_bytes": sent,
                        "lowdiff_value_bytes": int(wire["wire_step_value_bytes"]),
                        "lowdiff_index_bytes": int(wire["wire_step_index_bytes"]),
                        "lowdiff_ring_bytes": ring,
                        "dense_payload_bytes": dense_payload,
                        "dense_bucket_bytes": int(wire["wire_step_dense_bytes"]),
                        "dense_ring_bytes": dense_ring,
                        "lowdiff_over_dense": ring / dense_ring if dense_ring else 0.0,
                        "lowdiff_over_dense_payload": sent / dense_payload,
                        "index_dtypes": wire["wire_index_dtypes"],
                        "value_dtype": wire["wire_value_dtypes"],
                        "backend": "gloo",
                        "torch": torch.__version__,
                    }
                )
        (root / f"rows-rank{rank}.json").write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def ddp_wire_bench(
    *,
    workload: str = "gpt2-demo",
    world_size: int = 2,
    ratio: float = 0.01,
    steps: int = 3,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Bytes per step of lowdiff's DDP exchange against a dense all-reduce (module docstring).

    Args:
        workload: a workload of :func:`lowdiff_lab.workloads.zoo.build_workload`.
        world_size: DDP ranks, each a process on this machine (gloo).
        ratio: the top-k ratio of the compressor.
        steps: training steps per rank.
        progress: called with a short status text as work goes on.

    Returns:
        One flat dict per rank and step, ordered by step, then rank.

    Raises:
        ValueError: a bad argument (named with its value).
        RuntimeError: the ranks did not finish within :data:`RUN_TIMEOUT_S`.

    Example:
        >>> rows = ddp_wire_bench(workload="gpt2-tiny", steps=2)  # doctest: +SKIP
        >>> {r["value_dtype"] for r in rows}  # doctest: +SKIP
        {'float32'}
    """
    if workload not in workload_names():
        raise ValueError(f"workload must be one of {workload_names()}, got {workload!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio <= 1:
        raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
    say = progress or (lambda _m: None)
    with tempfile.TemporaryDirectory(prefix="lowdiff-wire-") as tmp:
        say(f"wire: {world_size} gloo ranks, {workload}, top-k {ratio}, {steps} steps")
        # non-daemonic ranks: each Checkpointer starts a checkpointing process of its own
        ctx = mp.start_processes(
            _rank_main,
            args=(world_size, tmp, workload, float(ratio), steps),
            nprocs=world_size,
            join=False,
            daemon=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not ctx.join(timeout=1.0):  # raises, with the rank's traceback, if one failed
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                for p in ctx.processes:
                    p.join(10)
                raise RuntimeError(
                    f"ddp_wire_bench: the ranks did not finish within {RUN_TIMEOUT_S:.0f} s"
                )
        rows = [
            row
            for r in range(world_size)
            for row in json.loads(Path(tmp, f"rows-rank{r}.json").read_text())
        ]
    rows.sort(key=lambda row: (row["step"], row["rank"]))
    for row in rows:
        if row["rank"] == 0:
            say(
                f"wire step {row['step']}: lowdiff {row['lowdiff_bytes']} B vs dense "
                f"{row['dense_payload_bytes']} B per rank (ring ratio "
                f"{row['lowdiff_over_dense']:.4f}; indices {row['index_dtypes']}, values "
                f"{row['value_dtype']})"
            )
    return rows

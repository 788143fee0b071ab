"""Run a function as the ranks of a job: one spawned process per rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.multiprocessing as tmp


def run_ranks(
    target: Callable[..., None], world: int, *args: Any, timeout: float = 120
) -> list[int | None]:
    """``target(rank, *args)`` in ``world`` spawned processes; their exit codes (a process
    still running after ``timeout`` seconds is killed)."""
    ctx = tmp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]

"""Run a function as the ranks of a job: one process per rank, forked from the tests' warm
Python (``tests/launch.py``) rather than spawned (a new interpreter that imports torch)."""

from __future__ import annotations

import base64
import datetime
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tests import launch

# the child: unpickle (target, args) from argv and call it, as a spawned Process would
_CALL = (
    "import base64, pickle, sys\n"
    "fn, args = pickle.loads(base64.b64decode(sys.argv[1]))\n"
    "fn(*args)\n"
)


def run_ranks(
    target: Callable[..., None], world: int, *args: Any, timeout: float = 120
) -> list[int | None]:
    """``target(rank, *args)`` in ``world`` processes; their exit codes (a process still
    running after ``timeout`` seconds is killed, and its code is that of the kill).
    ``target`` and ``args`` must pickle (a module-level function, paths, strings)."""
    # the target's module as pytest named it: under the tests' directory
    tests = Path(__file__).resolve().parents[1]
    env = launch.env()
    env["PYTHONPATH"] = os.pathsep.join([str(tests), str(tests.parent), env["PYTHONPATH"]])
    procs = [
        launch.popen(
            [
                sys.executable,
                "-c",
                _CALL,
                base64.b64encode(pickle.dumps((target, (r, *args)))).decode(),
            ],
            env=env,
        )
        for r in range(world)
    ]
    codes: list[int | None] = []
    for p in procs:
        try:
            codes.append(p.wait(timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return codes


def join_group(rank: int, world: int, store: Path) -> None:
    """In a rank: one torch thread, and the gloo group of ``world`` ranks met through the
    file ``store`` (60 s timeout, so a rank that died fails the others fast)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )

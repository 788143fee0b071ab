"""A tiny DDP job for :mod:`lowdiff_lab.torture.nodes`: one rank per node, a 2-layer MLP on gloo.

``python node_job.py --out OUT --steps N [--sleep S] [--helper]`` under ``torchrun`` whose
agent has ``NODE_NAME`` (the node's name) and ``NODE_DIR`` (the node's local directory) in
its environment. Every attempt of every rank writes ``OUT/{node}-a{restart}.log``
(``TORCHELASTIC_RESTART_COUNT`` of its agent), line by line with ``O_APPEND`` writes:

- ``start node=A rank=0 world=2 restart=0 pid=123`` when its process group is up;
- ``step S`` after each of its steps (``S`` = 1..N);
- ``done S`` when it reached the last step.

Every rank appends ``PID STARTTIME`` of itself to ``OUT/pids-{node}.txt``; with
``--helper`` it also leaves one process behind (as a checkpointing or data-loading
process may outlive it) in a session of its own, re-parented away from the rank (a
double fork), and lists it there too: the processes of a lost node that
:meth:`lowdiff_lab.torture.nodes.Node.lose` finds only through that file. The job restarts from step 0 on
every attempt (no checkpoint).
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

HELPER = """
import os, sys, time
pid = os.fork()
if pid:  # lists the process it leaves behind (PID STARTTIME), and exits
    start = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19]
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(fd, f"{pid} {start}\\n".encode())
    os._exit(0)
while True:
    time.sleep(60)
"""
"""A process left behind: in a session of its own, no longer the rank's child (its parent
exited), so only the pid file tells the node's processes from others."""


def start_ticks(pid: int) -> int:
    """The start time of ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[19])


def append(path: Path, line: str, stamp: bool = True) -> None:
    """Append one line (with `` t=`` the wall-clock time) in one ``O_APPEND`` write: it
    survives a SIGKILL right after."""
    if stamp:
        line += f" t={time.time():.3f}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--sleep", type=float, default=0.2, help="seconds per step")
    p.add_argument("--gloo-timeout", type=float, default=30.0)
    p.add_argument("--helper", action="store_true")
    a = p.parse_args()

    node = os.environ["NODE_NAME"]
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = a.out / f"{node}-a{restart}.log"
    pids = a.out / f"pids-{node}.txt"
    append(pids, f"{os.getpid()} {start_ticks(os.getpid())}", stamp=False)
    if a.helper:
        subprocess.run(
            [sys.executable, "-c", HELPER, str(pids)],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=60,
            check=True,
        )
    append(log, f"launch node={node} restart={restart} pid={os.getpid()}")
    local = Path(os.environ["NODE_DIR"])
    (local / f"rank-scratch-a{restart}").write_text("the node's local state\n")

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.gloo_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    append(log, f"start node={node} rank={rank} world={world} restart={restart} pid={os.getpid()}")

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)
    step = 0
    try:
        for step in range(1, a.steps + 1):
            x = torch.randn(4, 8, generator=gen)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()  # the gradients' allreduce: fails when a peer vanished
            opt.step()
            append(log, f"step {step}")
            time.sleep(a.sleep)
        dist.barrier()
    except Exception as e:
        # when the collective failed (the peer's node was lost): the agent restarts us
        append(log, f"error step={step} {type(e).__name__}")
        raise
    append(log, f"done {a.steps}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A whole node of a 2-node torchrun job lost mid-run and replaced (:mod:`lowdiff_lab.torture.nodes`).

Nodes A and B (one elastic agent and one gloo rank each, c10d rendezvous on 127.0.0.1)
train :mod:`tests.ddp.node_job`; mid-run node B is lost (its agent, its rank and the
process the rank started in a session of its own are SIGKILLed, its local directory is
deleted). A's collective fails as its peer vanishes, A's agent restarts its rank in a new
rendezvous round, node C joins that round as B's replacement, and the job trains to the
end on A and C (from step 0: no checkpoint here).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lowdiff_lab.torture.nodes import Job, closure, running

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

JOB = Path(__file__).with_name("node_job.py")
STEPS = 20
SLEEP = 0.2
KILL_AFTER = 4
"""B is lost once it logged this step (of ``STEPS``)."""
GLOO_TIMEOUT = 30


def attempts(out: Path) -> dict[str, dict[str, Any]]:
    """Every attempt's log (``{node}-a{restart}``): its ``start`` fields, its last
    ``step``, ``done``/``error`` and the time of each event."""
    got: dict[str, dict[str, Any]] = {}
    for f in sorted(out.glob("*-a*.log")):
        rec: dict[str, Any] = {"step": 0}
        for line in f.read_text().splitlines():
            event, *fields = line.split() or [""]
            kv = dict(x.split("=", 1) for x in fields if "=" in x)
            if "t" not in kv:  # a line being written (each ends with its time)
                continue
            rec[f"t_{event}"] = float(kv["t"])
            if event == "start":
                rec.update({k: kv[k] for k in ("node", "rank", "world", "restart", "pid")})
            elif event == "step":
                rec["step"] = int(fields[0])
            elif event == "done":
                rec["done"] = int(fields[0])
            elif event == "error":
                rec["error"] = line
        got[f.stem] = rec
    return got


def last_step(out: Path, node: str) -> int:
    return max(
        (int(r["step"]) for k, r in attempts(out).items() if k.startswith(f"{node}-a")), default=0
    )


def wait_for(cond: Callable[[], bool], timeout: float, what: str, job: Job) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        exited = [n.name for n in job.nodes.values() if n.proc.poll() is not None]
        if time.monotonic() > deadline or exited:
            tails = "\n".join(f"--- {n.name}:\n{n.tail(3000)}" for n in job.nodes.values())
            raise AssertionError(f"{what}: not after {timeout} s (exited: {exited})\n{tails}")
        time.sleep(0.02)


@pytest.fixture
def job(tmp_path) -> Iterator[Job]:
    out = tmp_path / "out"
    out.mkdir()
    args = ["--out", str(out), "--steps", str(STEPS), "--sleep", str(SLEEP)]
    args += ["--gloo-timeout", str(GLOO_TIMEOUT), "--helper"]
    with Job(JOB, args, tmp_path, out=out, max_restarts=1) as j:
        yield j
    assert j.running() == set()  # the job's close left nothing of any node running


@pytest.mark.timeout(120)
def test_lose_a_node_mid_run_and_replace_it(job: Job) -> None:
    out = job.out
    a = job.start("A")
    b = job.start("B")
    wait_for(lambda: last_step(out, "B") >= KILL_AFTER, 45, f"B at step {KILL_AFTER}", job)
    b_files = set(b.workdir.iterdir())
    listed = {int(ln.split()[0]) for ln in (out / "pids-B.txt").read_text().splitlines()}
    assert len(listed) == 2  # its rank, and the helper it left in a session of its own
    worker = int(attempts(out)["B-a0"]["pid"])
    (helper,) = listed - {worker}
    # the helper is out of reach of the agent's process tree and sessions: only the
    # pid file finds it
    assert worker in closure([b.pid]) and helper not in closure([b.pid])

    killed = b.lose()
    # nothing of B runs, and its local state is gone
    assert b.proc.returncode == -9
    assert b.processes() == set()
    assert not b.workdir.exists() and b_files
    assert {b.pid, worker, helper} <= killed.keys()
    first = attempts(out)["B-a0"]
    # the kill landed mid-run: B's last step is its last one before the kill
    at_kill = last_step(out, "B")
    assert KILL_AFTER <= at_kill < STEPS and "done" not in first
    assert a.proc.poll() is None

    c = job.start("C")
    assert a.wait(60) == 0, a.tail()
    assert c.wait(60) == 0, c.tail()

    got = attempts(out)
    assert sorted(got) == ["A-a0", "A-a1", "B-a0", "C-a0"], got
    fields = {k: (r["node"], r["rank"], r["world"], r["restart"]) for k, r in got.items()}
    assert fields == {
        "A-a0": ("A", "0", "2", "0"),
        "B-a0": ("B", "1", "2", "0"),
        "A-a1": ("A", "0", "2", "1"),  # A's agent restarted its rank after the failure
        "C-a0": ("C", "1", "2", "0"),  # the replacement's agent: its first attempt
    }
    # A's rank noticed the loss through its collective (not its gloo timeout)
    assert "error" in got["A-a0"] and "done" not in got["A-a0"]
    lost = b.lost
    assert lost is not None
    detect = float(got["A-a0"]["t_error"]) - lost
    assert detect < GLOO_TIMEOUT / 2, detect
    # the job finished on A and C
    assert got["A-a1"]["done"] == got["C-a0"]["done"] == STEPS
    assert got["B-a0"]["step"] == at_kill
    # still nothing of B
    assert b.processes() == set()
    assert not any(running(pid, start) for pid, start in b.killed.items())
    new_round = float(got["A-a1"]["t_start"]) - lost
    finished = float(got["A-a1"]["t_done"]) - lost
    print(
        f"B lost at step {at_kill}/{STEPS}; after the loss: A's collective failed at "
        f"+{detect:.2f} s, A and C rejoined at +{new_round:.2f} s, done at +{finished:.2f} s"
    )

"""SIGTERM (preemption): the trainer makes every acknowledged step durable before it
exits, with SIGTERM's own exit status.

A scheduler that reclaims a node sends SIGTERM and, once the trainer has exited (or the
grace period is over), kills whatever is left: the test kills the checkpointing process
the moment the trainer is gone, so only what the trainer itself saw durable counts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from tests import launch

import lowdiff
from lowdiff.proc import holder as rp

from .test_sigkill_recovery import SCRIPT, _env

pytestmark = [pytest.mark.multiprocess]


def _pid_gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while rp.pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not rp.pid_alive(pid)


@pytest.mark.parametrize(
    "strategy,opts",
    [
        ("lowdiff", {"batch_size": 16, "full_every": 100}),
        ("lowdiff+", {"persist_every": 1000, "idle_timeout": 60}),
        ("lowdiff", {"batch_size": 16, "full_every": 100, "attach": True}),
        ("lowdiff", {"batch_size": 16, "full_every": 100, "own_sigterm_exit": 7}),
    ],
    ids=["lowdiff", "lowdiff+", "lowdiff-attach", "lowdiff-own-handler"],
)
def test_sigterm_makes_every_acknowledged_step_durable_before_the_exit(
    tmp_path, strategy, opts
) -> None:
    ckdir = tmp_path / "ck"
    cfg = {"dir": str(ckdir), "steps": 200, "strategy": strategy, "sleep": 0.02,
           "print_durable": True, **opts}  # fmt: skip
    proc = launch.popen(
        [sys.executable, str(SCRIPT), json.dumps(cfg)], stdout=subprocess.PIPE, text=True,
        env=_env(),
    )  # fmt: skip
    assert proc.stdout is not None
    worker, last, behind = -1, 0, 0
    try:
        for line in proc.stdout:
            parts = line.split()
            if parts[0] == "process":
                worker = int(parts[1])
            elif parts[0] == "step":
                last, durable = int(parts[1]), int(parts[3])
                if last >= 12 and durable < last and worker > 0:
                    behind = last - durable
                    proc.send_signal(signal.SIGTERM)
                    break
        own = []
        for line in proc.stdout:  # steps acknowledged before the handler ran
            if line.startswith("step "):
                last = int(line.split()[1])
            elif line.startswith("own handler"):
                own.append(line.split()[2:])
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # the node goes: whatever the trainer left running dies with it
    with contextlib.suppress(ProcessLookupError):
        os.kill(worker, signal.SIGKILL)
    assert _pid_gone(worker)
    assert behind > 0, "SIGTERM arrived when every step was durable already"
    if "own_sigterm_exit" in opts:
        # the job's own handler ran after lowdiff's, with the signal and its frame, and
        # ended the job its own way
        assert own == [[str(int(signal.SIGTERM)), "True"]], own
        assert code == opts["own_sigterm_exit"], code
    else:
        assert not own
        assert code == -signal.SIGTERM, code
    info = lowdiff.inspect_dir(ckdir)
    assert info.recoverable is not None and info.recoverable[1] >= last, (info.recoverable, last)
    rp.remove_stale_replica(ckdir)  # what the killed replica left in /dev/shm (LowDiff+)


CHECK_HANDLER = """
import os, signal, sys, torch, lowdiff
calls = []
def mine(signum, frame):
    calls.append(signum)
case = sys.argv[1]
if case == "own":
    signal.signal(signal.SIGTERM, mine)
elif case == "ignored":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
model = torch.nn.Linear(2, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
opts = {"sigterm_timeout": None} if case == "none" else {}
ck = lowdiff.Checkpointer(model, opt, sys.argv[2], compressor=lowdiff.TopK(0.5),
                          batch_size=100, **opts)
ck.resume()
h = signal.getsignal(signal.SIGTERM)
print("dfl" if h == signal.SIG_DFL else "own" if h is mine else h.__module__)
if case in ("own", "ignored"):
    # the process goes on after each SIGTERM (its handler returns, or it ignores
    # SIGTERM), and every SIGTERM makes the steps acknowledged so far durable first
    for k in range(2):
        model(torch.ones(2)).sum().backward()
        ck.step()
        opt.zero_grad()
        before = ck.durable_step  # batch_size=100: not this step yet (the step-0 full maybe)
        os.kill(os.getpid(), signal.SIGTERM)
        print(before < ck.durable_step, ck.durable_step, len(calls))
ck.close()
"""


@pytest.mark.parametrize(
    "case,want",
    [
        ("none", ["dfl"]),
        ("default", ["lowdiff.proc.preempt"]),
        ("own", ["lowdiff.proc.preempt", "True", "1", "1", "True", "2", "2"]),
        ("ignored", ["lowdiff.proc.preempt", "True", "1", "0", "True", "2", "0"]),
    ],
)
def test_who_handles_sigterm(tmp_path, case, want) -> None:
    """lowdiff handles SIGTERM by default and not with ``sigterm_timeout=None``; a
    handler the process set itself is kept and called after lowdiff made the
    acknowledged steps durable (SIGTERM ignored: the process goes on), for every SIGTERM."""
    r = launch.run(
        [sys.executable, "-c", CHECK_HANDLER, case, str(tmp_path / "ck")],
        capture_output=True, text=True, timeout=120, env=_env(),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == want


STALLED = """
import os, signal, sys, time, torch, lowdiff
signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the job goes on after SIGTERM
model = torch.nn.Linear(2, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ck = lowdiff.Checkpointer(model, opt, sys.argv[1], compressor=lowdiff.TopK(0.5),
                          batch_size=100, sigterm_timeout=1.0, stall_timeout=60)
ck.resume()
model(torch.ones(2)).sum().backward()
ck.step()
opt.zero_grad()
worker = lowdiff.own_strategy(ck).worker_process.pid
os.kill(worker, signal.SIGSTOP)  # it cannot flush: the grace period runs out
t0 = time.monotonic()
os.kill(os.getpid(), signal.SIGTERM)
print("waited", round(time.monotonic() - t0), "durable", ck.durable_step, flush=True)
os.kill(worker, signal.SIGKILL)
"""


def test_a_grace_period_that_runs_out_is_said_on_standard_error(tmp_path) -> None:
    r = launch.run(
        [sys.executable, "-c", STALLED, str(tmp_path / "ck")],
        capture_output=True, text=True, timeout=120, env=_env(),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[:2] == ["waited", "1"], r.stdout  # sigterm_timeout, then on
    assert int(r.stdout.split()[3]) < 1, r.stdout  # step 1 was not made durable
    assert "lowdiff: on SIGTERM, the steps acknowledged since" in r.stderr, r.stderr

"""The training job the crash harness kills: ``python -m lowdiff_lab.torture.job CONFIG_JSON``.

It runs one *session* per plan, in order, on ``BASE/chain-N``: build the model, resume
(this is the recovery after the previous kill), dump the recovered state, train, and let
the plan's fault fire. A plan that kills only the checkpointing process ends its session
with the ``CheckpointWorkerError`` the trainer gets; the next session starts in this
same process. A plan that kills this process ends the job; the harness starts a new
one at the next plan. When a chain reaches its last step it is closed and the next
session starts a new chain. ``cfg["strategy"]`` is ``"lowdiff"`` (default) or
``"lowdiff+"``; a LowDiff+ replica whose trainer was killed waits in memory for the next
session, which resumes from it.

Every line it prints is a fact the harness checks:

- ``plan I`` / ``chain N``: a session or a chain begins;
- ``resumed S SOURCE PATH``: recovery gave step ``S`` from ``SOURCE`` (``disk``,
  ``memory`` for a LowDiff+ replica, ``fresh`` for an empty directory); the state is in
  ``PATH``;
- ``durable D``: ``ck.durable_step`` said ``D``, i.e. step ``D`` was acknowledged durable;
- ``step N``: ``ck.step()`` returned, the record (LowDiff) or the gradients (LowDiff+) of
  step ``N - 1`` were handed off;
- ``adopted PID``: the session took over the replica process ``PID`` that outlived the
  killed trainer (LowDiff+);
- ``refused``: the session is of another job (``plan["foreign"]``: another ``keep_full``)
  and found a survivor, which refused it;
- ``worker_error MESSAGE``: the trainer got the error of a killed checkpointing process;
- ``completed``: the chain reached its last step without the plan's fault firing;
- ``recovery_failed MESSAGE``: resume raised.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import safetensors.torch

from lowdiff.attach import own_strategy
from lowdiff.errors import CheckpointWorkerError
from lowdiff.state.capture import state_tensors
from lowdiff_lab import faults
from lowdiff_lab.torture import workload


def _kill_later(delay: float, targets: list[int]) -> None:
    def fire() -> None:
        time.sleep(delay)
        for pid in targets:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    threading.Thread(target=fire, daemon=True).start()


def _out(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def session(cfg: dict[str, Any], plan: dict[str, Any], directory: Path, rng: random.Random) -> str:
    """Run one session; returns "fired" or "completed" (or never returns: killed)."""
    spec = plan.get("spec", "")
    trainer_side = plan["how"] == "hook" and ":manifest:" in spec
    if plan["how"] == "hook" and not trainer_side:
        os.environ[faults.FAULT_ENV] = spec  # read by the checkpointing process it starts
    else:
        os.environ.pop(faults.FAULT_ENV, None)
    faults.install_faults(spec if trainer_side else "")
    if plan["how"] == "time" and plan.get("phase") == "startup":
        _kill_later(plan["delay"], [os.getpid()])
    if cfg.get("strategy", "lowdiff") == "lowdiff+":
        kw = {"keep_full": workload.KEEP_FULL + 1} if plan.get("foreign") else {}
        ck, model, opt, sched = workload.plus_checkpointer(directory, **kw)
    else:
        ck, model, opt, sched = workload.checkpointer(directory)
    try:
        start = ck.resume()
    except Exception as e:  # noqa: BLE001 -- reported to the harness, which fails the run
        _out(f"recovery_failed {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        raise SystemExit(4) from None
    faults.install_faults("")
    dump = Path(cfg["dump_dir"]) / f"resume-{uuid.uuid4().hex[:12]}.safetensors"
    safetensors.torch.save_file(
        {k: v.contiguous().clone() for k, v in state_tensors(model, opt, sched).items()},
        str(dump),
    )
    rs = ck.recovery_stats
    source = rs.source if rs is not None else "fresh"
    _out(f"resumed {start} {source} {dump}")
    if rs is not None and rs.takeover_pid is not None:
        _out(f"adopted {rs.takeover_pid}")
    reason = getattr(own_strategy(ck), "memory_miss_reason", None) if plan.get("foreign") else None
    if reason and "refused" in reason:
        _out("refused")
    durable = ck.durable_step
    _out(f"durable {durable}")
    if plan["how"] == "check":
        ck.close()
        return "completed"
    if plan["how"] == "time" and plan.get("phase") != "startup":
        proc = own_strategy(ck).worker_process
        worker = proc.pid if proc is not None else None
        pids = [worker] if plan["target"] != "trainer" else []
        if plan["target"] != "worker":
            pids.append(os.getpid())
        _kill_later(plan["delay"], [p for p in pids if p is not None])
    try:
        for step in range(start, cfg["n_steps"]):
            workload.loss_at(model, step).backward()
            ck.step()
            opt.zero_grad()
            _out(f"step {step + 1}")
            if rng.random() < 0.05:
                ck.flush()
            d = ck.durable_step
            if d > durable:
                durable = d
                _out(f"durable {d}")
            time.sleep(cfg["sleep"])
        ck.close()
    except CheckpointWorkerError as e:
        _out(f"worker_error {str(e).splitlines()[0]}")
        with contextlib.suppress(Exception):  # the error was reported above
            ck.close()
        return "fired"
    d = ck.durable_step
    if d > durable:
        _out(f"durable {d}")
    _out("completed")
    return "completed"


def _private_stdout() -> None:
    """Print the lines for the harness on a descriptor no child inherits.

    LowDiff's writer and LowDiff+'s replica stay alive after their trainer was killed (up
    to ``idle_timeout``) for the next trainer; holding the harness's pipe open, it would keep the harness waiting
    for the end of this job's output, and the replica would time out unused.
    """
    sys.stdout.flush()
    private = os.dup(1)  # not inheritable
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    sys.stdout = os.fdopen(private, "w", buffering=1)


def main(cfg: dict[str, Any]) -> None:
    import torch

    _private_stdout()  # LowDiff's writer and LowDiff+'s replica outlive a killed trainer

    torch.set_num_threads(1)
    rng = random.Random(cfg["seed"] * 7919 + cfg["start_plan"])
    chain = cfg["chain"]
    plans = cfg["plans"]
    for i in range(cfg["start_plan"], len(plans)):
        _out(f"plan {i}")
        directory = Path(cfg["base"]) / f"chain-{chain}"
        if session(cfg, plans[i], directory, rng) == "completed" and plans[i]["how"] != "check":
            chain += 1
            _out(f"chain {chain}")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))

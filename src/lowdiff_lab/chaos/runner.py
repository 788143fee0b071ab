"""The jobs of a chaos run: each one through :func:`~lowdiff_lab.chaos.supervisor.supervise`,
the reference jobs that time the failure-free training, and a job's result row.

Call sequence (the supervising process)::

    runner = Runner(settings, workdir, launcher, progress)
    runner.references(0, uncompressed)      # the reference jobs that open block 0
    tau = runner.tau(True)                  # step time of the compressed references
    result = runner.run(job, schedule)      # one job through its failures
    t_ff, startup = runner.t_ff(True, 0)    # the references around block 0
    row = job_row(result, account(result.attempts, t_ff, startup), schedule, extra)
"""

from __future__ import annotations

import math
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowdiff_lab.chaos.accounting import Accounting, account
from lowdiff_lab.chaos.launch import Launcher
from lowdiff_lab.chaos.schedule import FailureSchedule
from lowdiff_lab.chaos.settings import ChaosSettings
from lowdiff_lab.chaos.supervisor import Job, JobResult, supervise


@dataclass
class Reference:
    """One reference job (strategy ``"none"``): training without checkpoints."""

    compressed: bool
    """Trained with the run's gradient compression (else uncompressed, as LowDiff+)."""
    block: int
    """The block of jobs it opens (and the one before it closes)."""
    result: JobResult
    acc: Accounting


class Runner:
    """Runs the jobs of one chaos run and keeps its reference jobs.

    Args:
        s: The run's settings.
        workdir: Where each job's directory goes.
        launcher: Starts the training processes.
        progress: Called with one line of progress at a time.
    """

    def __init__(
        self,
        s: ChaosSettings,
        workdir: Path,
        launcher: Launcher,
        progress: Callable[[str], None],
    ) -> None:
        self.s = s
        self.workdir = workdir
        self.launcher = launcher
        self.progress = progress
        self.refs: list[Reference] = []
        self.jobs_run = 0

    def run(self, job: Job, schedule: FailureSchedule | None) -> JobResult:
        """Run ``job`` through the failures of ``schedule`` (None: none)."""
        self.jobs_run += 1
        t0 = time.monotonic()
        last = [0]

        def on_event(name: str, ev: dict[str, Any]) -> None:
            if ev.get("event") == "step" and int(ev["step"]) % 25 == 0 and ev["step"] != last[0]:
                last[0] = int(ev["step"])
                self.progress(f"{name}: step {ev['step']}/{self.s.steps}")

        res = supervise(job, schedule, self.launcher, self.workdir, on_event=on_event)
        if not self.s.keep:
            shutil.rmtree(self.workdir / job.name / "ckpt", ignore_errors=True)
        self.progress(
            f"{job.name}: {len(res.attempts) - 1} failure(s), {time.monotonic() - t0:.1f} s"
        )
        return res

    def references(self, block: int, uncompressed: bool) -> None:
        """The reference jobs that open ``block`` (and close the one before)."""
        for compressed in (True, False) if uncompressed else (True,):
            cfg = self.s.base_config()
            cfg["strategy"] = "none"
            if not compressed:
                cfg["compressor"] = {"kind": "none"}
            name = f"ref-{'compressed' if compressed else 'uncompressed'}-{block}"
            res = self.run(Job(name, cfg), None)
            self.refs.append(Reference(compressed, block, res, account(res.attempts, 0.0)))

    def refs_of(self, compressed: bool, block: int | None = None) -> list[Reference]:
        """The references of one setting: all, or those that open and close ``block``."""
        return [
            r
            for r in self.refs
            if r.compressed == compressed and (block is None or r.block in (block, block + 1))
        ]

    def t_ff(self, compressed: bool, block: int | None = None) -> tuple[float, float]:
        """``T_ff`` and its startup: the mean of the references that open and close
        ``block`` (the machine's load drifts; these ran nearest to it), or with ``block``
        None the median of all."""
        rs = self.refs_of(compressed, block)
        agg = statistics.median if block is None else statistics.mean
        return agg(r.acc.total_s for r in rs), agg(r.acc.startup_s for r in rs)

    def tau(self, compressed: bool) -> float:
        """The step time ``tau``: the median step of every reference of the setting."""
        return statistics.median(dt for r in self.refs_of(compressed) for dt in step_dts(r.result))


def step_dts(res: JobResult) -> list[float]:
    """The step times of a job's first attempt (the first from its ``resumed`` event)."""
    a = res.attempts[0]
    ts = [a.resumed_t, *(t for _, t in a.steps)]
    return [y - x for x, y in zip(ts, ts[1:], strict=False)]


def sig(x: float, digits: int = 3) -> float:
    """``x`` rounded to ``digits`` significant digits (an MTBF as the report shows it)."""
    if x == 0:
        return 0.0
    return round(x, -math.floor(math.log10(abs(x))) + digits - 1)


def job_row(
    res: JobResult, acc: Accounting, schedule: FailureSchedule, extra: dict[str, Any]
) -> dict[str, Any]:
    """The result row of one job: ``extra``, where its time went, its kills and losses."""
    st = res.result.get("ck_stats") or {}
    return {
        **extra,
        "job": res.name,
        "mtbf_s": schedule.mtbf_s,
        **acc.as_dict(),
        "failures_scheduled": len(schedule.points),
        "failures_not_injected": res.not_injected,
        "kills": res.kills,
        "leftovers_killed": res.leftovers_killed,
        "final_loss": res.result.get("final_loss"),
        "eval_loss": res.result.get("eval_loss"),
        "ck_stats": st,
    }


__all__ = ["Reference", "Runner", "job_row", "sig", "step_dts"]

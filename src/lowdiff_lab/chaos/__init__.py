"""Failure injection and wasted time: ``lowdiff chaos``.

A supervisor runs a real training job (:mod:`lowdiff_lab.workloads.train`) as child
processes, kills it at exponentially distributed points of its progress for a given MTBF
(a *software* failure kills the training process; a *hardware* failure kills it with its
checkpointing processes and removes their shared memory), restarts it until it is done,
and splits the time of the run into steady-state overhead, lost work and recovery.

- :mod:`.schedule`: seeded failure schedules;
- :mod:`.procs`: finding, freezing and killing a job's processes, its shared memory;
- :mod:`.launch`: starting training processes (fresh, or forked from :mod:`lowdiff_lab.prefork`);
- :mod:`.supervisor`: one job through its failures;
- :mod:`.accounting`: where the time went;
- :mod:`.costs`: LowDiff's measured costs as the inputs of :mod:`lowdiff.plan`;
- :mod:`.settings`: the compared methods, the run's settings, each job's config;
- :mod:`.runner`: the jobs of a run, its reference jobs, a job's result row;
- :mod:`.run`: the comparison and the GPU-count simulation; :mod:`.grid`: the (f, b) grid;
- :mod:`.report`: JSON lines, Markdown, PNG.

Example:
    >>> from lowdiff_lab.chaos import ChaosSettings, run_chaos
    >>> files = run_chaos(ChaosSettings(quick=True), out=Path("chaos"))  # doctest: +SKIP
"""

from __future__ import annotations

from lowdiff_lab.chaos.accounting import Accounting, Attempt, account
from lowdiff_lab.chaos.launch import ChaosError
from lowdiff_lab.chaos.run import run_chaos
from lowdiff_lab.chaos.schedule import FailurePoint, FailureSchedule, failure_schedule
from lowdiff_lab.chaos.settings import ChaosSettings
from lowdiff_lab.chaos.supervisor import Job, JobResult, supervise

__all__ = [
    "Accounting",
    "Attempt",
    "ChaosError",
    "ChaosSettings",
    "FailurePoint",
    "FailureSchedule",
    "Job",
    "JobResult",
    "account",
    "failure_schedule",
    "run_chaos",
    "supervise",
]

"""Profiles and the entry point of ``lowdiff torture``."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lowdiff_lab.torture import crash, workload
from lowdiff_lab.torture.corrupt import run_corruption
from lowdiff_lab.torture.fuzz import run_fuzz
from lowdiff_lab.torture.report import TortureReport
from lowdiff_lab.torture.storage import run_storage


@dataclass(frozen=True)
class Profile:
    """How much of each kind of torture to run."""

    kills: int
    """Kill plans (each one SIGKILLs a trainer, a checkpointing process or both)."""
    flips: int
    """Byte flips per file of the corruption sweep."""
    cuts: int
    """Truncations per file of the corruption sweep."""
    storage: int
    """Storage-fault scenarios."""
    fuzz: int
    """Fuzzed reader inputs."""
    strategies: tuple[str, ...] = crash.STRATEGIES
    """Strategies the kill plans drive; with both, LowDiff+ gets a third of the plans."""

    def __post_init__(self) -> None:
        for name in ("kills", "flips", "cuts", "storage", "fuzz"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        crash.split_kills(self.kills, self.strategies)  # raises on an unknown strategy


QUICK = Profile(kills=9, flips=6, cuts=3, storage=3, fuzz=2000)
# 160 LowDiff plans and 80 LowDiff+ plans; a few do not fire before their chain ends
FULL = Profile(kills=240, flips=64, cuts=24, storage=12, fuzz=50000)


def run_torture(
    profile: Profile = QUICK,
    *,
    out: str | Path | None = None,
    seed: int = 0,
    jobs: int = 1,
    log: Callable[[str], None] | None = None,
) -> TortureReport:
    """Run every part of the torture suite and return its figures.

    Args:
        profile: how much to run (:data:`QUICK` or :data:`FULL`, or your own).
        out: working directory (kept); default: a temporary one, removed afterwards.
        seed: seeds the kill plans, the corruption offsets and the fuzzer.
        jobs: kill chains run side by side (each a trainer and its checkpointing process).
        log: called with a line after each part.

    Example:
        >>> report = run_torture(QUICK)  # doctest: +SKIP
        >>> print(report.format_text())  # doctest: +SKIP
    """
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be an int >= 1, got {jobs!r}")
    t0 = time.monotonic()
    tmp = None if out is not None else tempfile.mkdtemp(prefix="lowdiff-torture-")
    work = Path(out if out is not None else tmp)  # type: ignore[arg-type]
    work.mkdir(parents=True, exist_ok=True)
    report = TortureReport()
    try:
        ref = workload.reference(crash.N_STEPS)
        if profile.fuzz:
            run_fuzz(report, inputs=profile.fuzz, seed=seed, log=log)
        if profile.flips or profile.cuts:
            run_corruption(
                work,
                report,
                flips=profile.flips,
                cuts=profile.cuts,
                seed=seed,
                reference=ref,
                log=log,
            )
        if profile.storage:
            run_storage(work, report, scenarios=profile.storage, reference=ref, log=log)
        if profile.kills:
            crash.run_crash(
                work,
                profile.kills,
                report,
                seed=seed,
                jobs=jobs,
                reference=ref,
                strategies=profile.strategies,
                log=log,
            )
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    report.wall_s = time.monotonic() - t0
    return report

"""``lowdiff bench``: LowDiff, LowDiff+ and the baselines side by side, after the paper.

Example:
    >>> from lowdiff_lab.bench import run_bench  # doctest: +SKIP
    >>> files = run_bench(["overhead"], quick=True, out=Path("results"))  # doctest: +SKIP
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lowdiff_lab.bench import report
from lowdiff_lab.bench.context import QUICK_PROFILE, Context, Profile
from lowdiff_lab.bench.core import BenchSettings, build_workload, machine_info
from lowdiff_lab.bench.experiments import DEFAULT_EXPERIMENTS, EXPERIMENTS, OWN_WORKLOADS, RUNNERS

QUICK_WORKLOAD = "gpt2-s-tiny"
METHODS = ("lowdiff", "lowdiff+", "torch-save", "checkfreq", "gemini", "naive-dc", "dcp-async")
"""The strategies ``lowdiff bench`` compares (``--methods`` picks a subset)."""
FULL_WORKLOAD = "gpt2-s"


def run_bench(
    experiments: list[str],
    *,
    out: Path,
    quick: bool = False,
    settings: BenchSettings | None = None,
    profile: Profile | None = None,
    progress: Callable[[str], None] | None = None,
    methods: list[str] | None = None,
) -> dict[str, Path]:
    """Run experiments and write the report; returns the files written.

    Args:
        experiments: Names from :data:`EXPERIMENTS` (in that order they run).
        out: Output folder (created).
        quick: The quick profile (tiny workload, few sizes) when no settings are given.
        settings: What to train and how long; default: the quick or full profile's.
        profile: Experiment sizes; default: the quick or full profile.
        progress: Called with a short status text as work goes on.
        methods: Strategies to compare (default: all); training without checkpoints
            always runs, as the reference.
    """
    unknown = [e for e in experiments if e not in EXPERIMENTS]
    if unknown:
        raise ValueError(f"unknown experiment(s) {unknown}; known: {list(EXPERIMENTS)}")
    if settings is None:
        settings = (
            BenchSettings(QUICK_WORKLOAD, iters=20, repeats=7)
            if quick
            else BenchSettings(FULL_WORKLOAD, iters=20, repeats=5)
        )
    if profile is None:
        profile = QUICK_PROFILE if quick else Profile()
    Path(settings.workdir).mkdir(parents=True, exist_ok=True)
    if methods is not None:
        bad = sorted(set(methods) - set(METHODS))
        if bad:
            raise ValueError(f"unknown method(s) {bad}; known: {list(METHODS)}")
    say = progress or (lambda _m: None)
    machine = machine_info(settings.device)  # the environment this process started with
    ctx = Context(settings, profile, say, methods=None if methods is None else frozenset(methods))
    # (the settings' workload is built only where an experiment trains it)
    own = all(e in OWN_WORKLOADS for e in experiments)
    n_params = None if own else build_workload(settings).n_params
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    ordered = [e for e in EXPERIMENTS if e in experiments]
    for i, name in enumerate(ordered):
        ctx.progress = _prefixed(say, f"[{i + 1}/{len(ordered)} {name}]")
        rows += RUNNERS[name](ctx)
    run = {
        "machine": machine,
        "background_env": {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY")},
        "settings": settings.as_dict(),
        "profile": asdict(profile),
        "experiments": ordered,
        "quick": quick,
        "methods": sorted(methods) if methods is not None else list(METHODS),
        "n_params": n_params,
        "wall_s": time.perf_counter() - t0,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return report.write(out, run, rows)


def _prefixed(say: Callable[[str], None], prefix: str) -> Callable[[str], None]:
    """``say`` with ``prefix`` before every message (the experiment's place in the run)."""
    return lambda m: say(f"{prefix} {m}")


__all__ = ["DEFAULT_EXPERIMENTS", "EXPERIMENTS", "METHODS", "BenchSettings", "Profile", "run_bench"]

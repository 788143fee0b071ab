"""Exp. 8 of a chaos run (``--grid``): LowDiff over a grid of ``(f, b)`` under one failure
schedule, each cell's measured wasted time next to the one the paper's model predicts
from the costs measured by the same jobs.

Call sequence (inside :func:`lowdiff_lab.chaos.run.run_chaos`, after the first references)::

    run_grid(settings, runner, rows, info, tau, t_ff0, say)   # appends grid rows
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lowdiff.plan import optimize, wasted_time
from lowdiff_lab.chaos.accounting import account
from lowdiff_lab.chaos.costs import cost_model, measured_costs
from lowdiff_lab.chaos.runner import Runner, job_row, sig
from lowdiff_lab.chaos.schedule import FailureSchedule, failure_schedule
from lowdiff_lab.chaos.settings import ChaosSettings, method_config, parse_method
from lowdiff_lab.chaos.supervisor import Job, JobResult


def run_grid(
    s: ChaosSettings,
    r: Runner,
    rows: list[dict[str, Any]],
    info: dict[str, Any],
    tau: float,
    t_ff0: float,
    say: Callable[[str], None],
) -> None:
    """Run every cell of the grid and append its rows (``grid``, ``grid-summary``).

    Args:
        s: The run's settings (``grid_f``, ``grid_b``, ``grid_mtbf``, ``block``).
        r: The runner; a pair of references opens every ``s.block`` cells.
        rows: The run's result rows (appended to).
        info: The run's facts (MTBF and schedule added).
        tau: Step time of the references.
        t_ff0: Failure-free time of the first references (the default MTBF is half of it).
        say: Progress lines.
    """
    assert s.steps is not None and s.grid_f is not None and s.grid_b is not None
    mtbf = s.grid_mtbf if s.grid_mtbf is not None else sig(t_ff0 / 2)
    sch = failure_schedule(mtbf, s.steps * tau, seed=s.seed, tau_s=tau)
    info["grid_mtbf_s"] = mtbf
    info["schedules"] = [sch.as_dict()]
    rows.append({"experiment": "schedule", **sch.as_dict()})
    cells = [(f, b) for f in sorted(set(s.grid_f)) for b in sorted(set(s.grid_b)) if b <= f]
    say(f"grid: {len(cells)} cells, MTBF {mtbf:g} s, {len(sch.points)} failure(s) scheduled")
    meth = parse_method("lowdiff")
    done: list[tuple[int, int, JobResult]] = []
    for i, (f, b) in enumerate(cells):
        if i and i % s.block == 0:
            r.references(i // s.block, False)
        cfg = method_config(meth, s, (f, b))
        job = Job(f"grid-f{f}-b{b}", cfg, env={"LOWDIFF_MTBF": repr(float(mtbf))})
        done.append((f, b, r.run(job, sch)))
    r.references(-(-len(cells) // s.block), False)
    costs = measured_costs([res for _, _, res in done])
    info["lowdiff_costs"] = costs
    _grid_rows(s, r, rows, tau, sch, done, costs)


def _grid_rows(
    s: ChaosSettings,
    r: Runner,
    rows: list[dict[str, Any]],
    tau: float,
    sch: FailureSchedule,
    done: list[tuple[int, int, JobResult]],
    costs: dict[str, Any],
) -> None:
    """Each cell's row with the model's prediction, then the summary: where the model's
    ``(f*, b*)`` ranks among the measured cells."""
    ref_total, _ = r.t_ff(True)
    failures = len(sch.points)
    # the model at the failures the jobs actually met (the same for every cell): the
    # predictions are then comparable with the measurements cell by cell
    m_eff = ref_total / failures if failures else sch.mtbf_s
    model = cost_model(costs, tau=tau, total_time=ref_total, mtbf=m_eff)
    nominal = cost_model(costs, tau=tau, total_time=ref_total, mtbf=sch.mtbf_s)
    cell_rows = []
    for i, (f, b, res) in enumerate(done):
        acc = account(res.attempts, *r.t_ff(True, i // s.block))
        row = job_row(res, acc, sch, {"experiment": "grid", "method": "LowDiff", "f": f, "b": b})
        row["model_wasted_s"] = wasted_time(model, f, b)
        cell_rows.append(row)
    rows += cell_rows

    def rank_of(key: str, cell: tuple[int, int]) -> int:
        order = sorted(cell_rows, key=lambda x: x[key])
        return 1 + [(x["f"], x["b"]) for x in order].index(cell)

    best = min(cell_rows, key=lambda x: x["model_wasted_s"])
    star = (best["f"], best["b"])
    free = optimize(nominal)
    rows.append(
        {
            "experiment": "grid-summary",
            "mtbf_s": sch.mtbf_s,
            "failures": failures,
            "model_mtbf_s": m_eff,
            "cost_model": model.as_dict(),
            "f_star": star[0],
            "b_star": star[1],
            "cells": len(cell_rows),
            "rank_core": rank_of("core_wasted_s", star),
            "rank_wasted": rank_of("wasted_s", star),
            "measured_best_core": _best(cell_rows, "core_wasted_s"),
            "measured_best_wasted": _best(cell_rows, "wasted_s"),
            "unconstrained_plan": {"f": free.f, "b": free.b, "wasted_s": free.wasted_s},
        }
    )


def _best(cells: list[dict[str, Any]], key: str) -> list[int]:
    c = min(cells, key=lambda x: x[key])
    return [c["f"], c["b"]]


__all__ = ["run_grid"]

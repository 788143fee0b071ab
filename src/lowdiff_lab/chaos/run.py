"""``lowdiff chaos``: every strategy trained through the same failures; where the time went.

Call sequence (the supervising process; every training job is a process of its own)::

    settings = ChaosSettings(quick=True)          # validates every option
    files = run_chaos(settings, out=Path("chaos"))  # results.jsonl, report.md, PNGs

What a run does:

1. starts the launcher (by default a fork server that imports torch once, see
   :mod:`lowdiff_lab.chaos.launch`);
2. runs the reference jobs: strategy ``"none"`` (compressed training, no checkpoint; the
   reference of LowDiff and the baselines) and, when LowDiff+ is compared, the same
   training uncompressed. Their failure-free time ``T_ff`` and step time ``tau`` come from
   here; one reference of each is run again before each block of jobs, and ``T_ff`` is the
   median over them (:class:`lowdiff_lab.chaos.runner.Runner`);
3. picks the MTBFs (``--mtbf``, or ``T_ff`` divided by the expected failure counts, 1, 2
   and 4 by default: the paper's 2 h, 1 h, 0.5 h ratio) and, per MTBF, one seeded failure
   schedule shared by every method (:mod:`lowdiff_lab.chaos.schedule`);
4. runs every method through its schedule (:func:`lowdiff_lab.chaos.supervisor.supervise`) and
   splits its time (:func:`lowdiff_lab.chaos.accounting.account`): the comparison of the
   paper's Exp. 3 (wasted time) and Exp. 11 (effective training time ratio);
5. with ``grid``: LowDiff over a grid of ``(f, b)`` under one schedule, against the
   wasted time the paper's model predicts from the costs measured in the same jobs
   (Exp. 8, :mod:`lowdiff_lab.chaos.grid`);
6. Exp. 12 (more GPUs) is a *simulation*: each method's measured costs (steady overhead,
   cost per failure) under the system MTBF of N GPUs (``M_8 * 8 / N``, ``M_8`` the
   largest MTBF of the run).

How LowDiff's ``(f, b)`` and each baseline's interval are chosen:
:mod:`lowdiff_lab.chaos.settings`.
"""

from __future__ import annotations

import math
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lowdiff.plan import Plan, optimize
from lowdiff_lab.bench.core import machine_info
from lowdiff_lab.chaos import report
from lowdiff_lab.chaos.accounting import account
from lowdiff_lab.chaos.costs import cost_model, measured_costs
from lowdiff_lab.chaos.grid import run_grid
from lowdiff_lab.chaos.launch import ChaosError, child_env, make_launcher
from lowdiff_lab.chaos.runner import Runner, job_row, sig, step_dts
from lowdiff_lab.chaos.schedule import FailurePoint, FailureSchedule, failure_schedule
from lowdiff_lab.chaos.settings import (
    YOUNG_DALY,
    YOUNG_DALY_STRATEGIES,
    ChaosSettings,
    Method,
    method_config,
    parse_method,
    young_daly_interval,
)
from lowdiff_lab.chaos.supervisor import Job, JobResult


def run_chaos(
    s: ChaosSettings, out: Path, progress: Callable[[str], None] | None = None
) -> dict[str, Path]:
    """Run the comparison (or, with ``s.grid``, the grid) and write the report into ``out``.

    Returns:
        The files written, by name (``results``, ``report``, one per figure).

    Raises:
        ChaosError: a training job failed or hung (its logs are kept and named).
    """
    say = progress or (lambda _m: None)
    t0 = time.monotonic()
    own_workdir = s.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="lowdiff-chaos-")) if own_workdir else Path(s.workdir)  # type: ignore[arg-type]
    workdir.mkdir(parents=True, exist_ok=True)
    say(f"working in {workdir}")
    rows: list[dict[str, Any]] = []
    ok = False
    try:
        launcher = make_launcher(s.launcher, child_env(s.threads), workdir)
        try:
            r = Runner(s, workdir, launcher, say)
            uncompressed = any(m.uncompressed for m in s.parsed_methods) and not s.grid
            r.references(0, uncompressed)
            tau = r.tau(True)
            t_ff0, _ = r.t_ff(True)
            info: dict[str, Any] = {
                "launcher": s.launcher,
                "cold_start_s": launcher.preload_s,
                "tau_s": tau,
            }
            if s.grid:
                run_grid(s, r, rows, info, tau, t_ff0, say)
            else:
                _compare(s, r, rows, info, tau, t_ff0, uncompressed, say)
        finally:
            launcher.close()
        _reference_rows(r, rows, info)
        run = {
            "machine": machine_info("cpu"),
            "settings": s.describe(),
            "lowdiff_config": s.lowdiff,
            "info": info,
            "wall_s": time.monotonic() - t0,
            "jobs": r.jobs_run,
            "workdir": str(workdir) if s.keep else None,
        }
        files = report.write(out, run, rows)
        ok = True
        return files
    finally:
        if own_workdir and not s.keep and ok:
            shutil.rmtree(workdir, ignore_errors=True)
        elif not ok:
            say(f"logs kept in {workdir}")


def _reference_rows(r: Runner, rows: list[dict[str, Any]], info: dict[str, Any]) -> None:
    """A row per reference job, and ``T_ff`` of each setting into ``info``."""
    for ref in r.refs:
        rows.append(
            {
                "experiment": "reference",
                "setting": "compressed" if ref.compressed else "uncompressed",
                "job": ref.result.name,
                "total_s": ref.acc.total_s,
                "startup_s": ref.acc.startup_s,
                "median_step_s": statistics.median(step_dts(ref.result)),
            }
        )
    for compressed in (True, False):
        if r.refs_of(compressed):
            setting = "compressed" if compressed else "uncompressed"
            info[f"t_ff_{setting}_s"] = r.t_ff(compressed)[0]


# --------------------------------------------------------------------------- Exp. 3, 11, 12


def _compare(
    s: ChaosSettings,
    r: Runner,
    rows: list[dict[str, Any]],
    info: dict[str, Any],
    tau: float,
    t_ff0: float,
    uncompressed: bool,
    say: Callable[[str], None],
) -> None:
    """Every method through the schedule of every MTBF (Exp. 3 and 11), then Exp. 12.

    Each MTBF is a block of jobs, opened and closed by reference jobs; its rows are
    accounted against the references around it.
    """
    schedules = _schedules(s, rows, info, tau, t_ff0)
    mtbfs = list(schedules)
    fb, profiled = _lowdiff_fb(s, r, rows, info, tau, mtbfs)
    intervals = _baseline_intervals(s, r, rows, info, tau, mtbfs)
    jobs: list[tuple[Method, int, int, float, dict[str, Any], JobResult]] = []
    block = 0
    for rnd in range(s.rounds):
        prefix = f"r{rnd}-" if s.rounds > 1 else ""
        for g, m in enumerate(mtbfs):
            if block > 0:
                r.references(block, uncompressed)
            where = f"round {rnd + 1}/{s.rounds}, " if s.rounds > 1 else ""
            say(f"{where}MTBF {m:g} s: {len(schedules[m].points)} failure(s) scheduled")
            for meth in s.parsed_methods:
                cfg = method_config(meth, s, fb.get(m), intervals.get((meth.strategy, m)))
                job = Job(
                    f"{prefix}mtbf{g}-{_safe_name(meth.key)}",
                    cfg,
                    kind=meth.kind,
                    env={"LOWDIFF_MTBF": repr(float(m))},
                )
                jobs.append((meth, rnd, block, m, cfg, r.run(job, schedules[m])))
            block += 1
    r.references(block, uncompressed)

    method_rows = [
        _method_row(s, r, meth, rnd, blk, cfg, res, schedules[m])
        for meth, rnd, blk, m, cfg, res in jobs
    ]
    rows += method_rows
    if method_rows:
        rows += simulate_gpus(method_rows, s.sim_gpus, mtbfs[0])
    lowdiff_jobs = [res for meth, *_, res in jobs if meth.strategy == "lowdiff"]
    if lowdiff_jobs or profiled:
        info.setdefault("lowdiff_costs", measured_costs(profiled + lowdiff_jobs))


def _schedules(
    s: ChaosSettings,
    rows: list[dict[str, Any]],
    info: dict[str, Any],
    tau: float,
    t_ff0: float,
) -> dict[float, FailureSchedule]:
    """One failure schedule per MTBF, largest MTBF first (given, or ``T_ff`` over each
    expected failure count)."""
    mtbfs = list(s.mtbfs) if s.mtbfs is not None else [sig(t_ff0 / k) for k in s.expected_failures]
    mtbfs = sorted(mtbfs, reverse=True)
    assert s.steps is not None
    horizon = s.steps * tau
    schedules = {m: failure_schedule(m, horizon, seed=s.seed, tau_s=tau) for m in mtbfs}
    info["mtbfs_s"] = mtbfs
    info["schedules"] = [sch.as_dict() for sch in schedules.values()]
    for sch in schedules.values():
        rows.append({"experiment": "schedule", **sch.as_dict()})
    return schedules


def _lowdiff_fb(
    s: ChaosSettings,
    r: Runner,
    rows: list[dict[str, Any]],
    info: dict[str, Any],
    tau: float,
    mtbfs: list[float],
) -> tuple[dict[float, tuple[int, int] | str], list[JobResult]]:
    """LowDiff's ``(f, b)`` per MTBF (``"auto"``, fixed, or the model's plan on the costs
    of a profiling job), and the profiling jobs run for it."""
    if not any(m.strategy == "lowdiff" for m in s.parsed_methods):
        return {}, []
    if s.lowdiff == "auto":
        return dict.fromkeys(mtbfs, "auto"), []
    if s.fixed_fb is not None:
        return dict.fromkeys(mtbfs, s.fixed_fb), []
    prof = _profile_lowdiff(s, r, tau)
    costs = measured_costs([prof])
    t_ff = r.t_ff(True)[0]
    fb: dict[float, tuple[int, int] | str] = {}
    for m in mtbfs:
        plan = lowdiff_plan(costs, tau, t_ff, m)
        fb[m] = (plan.f, plan.b)
        rows.append(
            {
                "experiment": "lowdiff-plan",
                "mtbf_s": m,
                "source": "model (costs of the profiling job)",
                **plan.as_dict(),
            }
        )
    info["lowdiff_costs"] = costs
    return fb, [prof]


def _baseline_intervals(
    s: ChaosSettings,
    r: Runner,
    rows: list[dict[str, Any]],
    info: dict[str, Any],
    tau: float,
    mtbfs: list[float],
) -> dict[tuple[str, float], int]:
    """The Young–Daly interval of torch.save and DCP async per MTBF, from the checkpoint
    cost each one's profiling job measured (empty when ``interval`` is fixed)."""
    yd = {x.strategy for x in s.parsed_methods} & set(YOUNG_DALY_STRATEGIES)
    if s.interval != YOUNG_DALY or not yd:
        return {}
    costs: dict[str, float] = {}
    for strategy in sorted(yd):
        st = _profile_baseline(s, r, strategy).result.get("ck_stats") or {}
        n = float(st.get("checkpoints") or 0.0)
        if n < 1:
            raise ChaosError(f"the profiling job of {strategy} took no checkpoint")
        costs[strategy] = float(st.get("stall_s") or 0.0) / n
    intervals: dict[tuple[str, float], int] = {}
    for m in mtbfs:
        for strategy, c in costs.items():
            k = young_daly_interval(c, m, tau)
            intervals[(strategy, m)] = k
            rows.append(
                {
                    "experiment": "baseline-interval",
                    "strategy": strategy,
                    "policy": YOUNG_DALY,
                    "checkpoint_cost_s": c,
                    "mtbf_s": m,
                    "tau_s": tau,
                    "interval": k,
                }
            )
    info["young_daly_costs_s"] = costs
    return intervals


def _method_row(
    s: ChaosSettings,
    r: Runner,
    meth: Method,
    rnd: int,
    block: int,
    cfg: dict[str, Any],
    res: JobResult,
    schedule: FailureSchedule,
) -> dict[str, Any]:
    """The ``wasted`` row of one method's job (of round ``rnd``), accounted against the
    references of its block."""
    ref_total, ref_startup = r.t_ff(not meth.uncompressed, block)
    acc = account(res.attempts, ref_total, ref_startup)
    st = res.result.get("ck_stats") or {}
    extra = {
        "experiment": "wasted",
        "round": rnd,
        "method": meth.label,
        "key": meth.key,
        "strategy": meth.strategy,
        "failure_kind": meth.kind,
        "uncompressed": meth.uncompressed,
        "full_every": cfg.get("full_every"),
        "batch_size_records": cfg.get("batch_size_records") if meth.strategy == "lowdiff" else None,
        "strategy_options": cfg.get("strategy_options", {}),
        "interval_policy": _policy(meth.strategy, s),
        "chosen_full_every": st.get("full_every"),
        "chosen_batch_size": st.get("batch_size"),
    }
    return job_row(res, acc, schedule, extra)


def _policy(strategy: str, s: ChaosSettings) -> str:
    """How the method's checkpoint interval was chosen (said in the report)."""
    if strategy == "lowdiff":
        return f"(f, b): {s.lowdiff}"
    if strategy == "lowdiff+":
        return "persist auto"
    if strategy == "checkfreq":
        return "CheckFreq's own (auto)"
    if strategy in YOUNG_DALY_STRATEGIES:
        return "Young–Daly" if s.interval == YOUNG_DALY else "fixed"
    return "fixed"


def _profile_baseline(s: ChaosSettings, r: Runner, strategy: str) -> JobResult:
    """A failure-free job of ``strategy`` checkpointing every ``persist_interval`` steps
    (few enough that a background save never waits for the previous one): the training
    time one checkpoint costs is its ``stall_s`` per checkpoint."""
    m = parse_method(strategy)
    cfg = method_config(m, s, None, s.persist_interval)
    assert s.steps is not None
    cfg["steps"] = min(s.steps, 4 * s.persist_interval)
    return r.run(Job(f"profile-{strategy}", cfg), None)


def _profile_lowdiff(s: ChaosSettings, r: Runner, tau: float) -> JobResult:
    """A LowDiff job at (f, b) = (10, 2) with one hardware failure mid-way between two
    full checkpoints: its write and recovery costs feed the model."""
    m = parse_method("lowdiff")
    cfg = method_config(m, s, (10, 2))
    assert s.steps is not None
    step = min(max(15, s.steps // 2 + 5), s.steps - 2)
    sch = FailureSchedule(
        mtbf_s=float("inf"),
        seed=s.seed,
        horizon_s=s.steps * tau,
        tau_s=tau,
        points=(FailurePoint(0, step * tau, step, 0.5),),
    )
    return r.run(Job("profile-lowdiff", cfg, kind="hardware"), sch)


def _safe_name(text: str) -> str:
    text = text.replace("+", "plus").replace(":", "-")
    return "".join(c if c.isalnum() or c == "-" else "_" for c in text)


def lowdiff_plan(
    costs: dict[str, Any],
    tau: float,
    t_ff: float,
    mtbf: float,
    f_values: Sequence[int] | None = None,
) -> Plan:
    """:func:`lowdiff.plan.optimize` over the model built from measured costs."""
    return optimize(cost_model(costs, tau=tau, total_time=t_ff, mtbf=mtbf), f_values=f_values)


def simulate_gpus(
    rows: list[dict[str, Any]], gpus: Sequence[int], base_mtbf: float
) -> list[dict[str, Any]]:
    """Exp. 12 as a simulation from each method's measured costs (see the module docstring).

    Per method, over its jobs of every MTBF: the steady overhead ``o`` (seconds per second
    of failure-free training), the startup overhead ``u`` and the cost of one failure
    ``c`` (lost work plus recovery). With ``N`` GPUs the system MTBF is
    ``M_N = base_mtbf * gpus[0] / N`` and a job of failure-free length ``T`` takes
    ``T (1 + o) + u + (T / M_N) c``; the effective ratio is ``T`` over that.
    """
    out = []
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for method in methods:
        rs = [r for r in rows if r["method"] == method]
        t = statistics.mean(r["reference_s"] for r in rs)
        o = statistics.mean(r["overhead_s"] for r in rs) / t
        u = statistics.mean(r["startup_overhead_s"] for r in rs)
        n_fail = sum(r["failures"] for r in rs)
        c = sum(r["lost_work_s"] + r["recovery_s"] for r in rs) / n_fail if n_fail else 0.0
        for n in gpus:
            m_n = base_mtbf * gpus[0] / n
            total = t * (1 + o) + u + (t / m_n) * c
            measured = [
                r["effective_ratio"] for r in rs if math.isclose(r["mtbf_s"], m_n, rel_tol=0.01)
            ]
            out.append(
                {
                    "experiment": "scale-gpus",
                    "simulation": True,
                    "method": method,
                    "n_gpus": n,
                    "system_mtbf_s": m_n,
                    "steady_overhead_per_s": o,
                    "startup_overhead_s": u,
                    "cost_per_failure_s": c,
                    "failure_free_s": t,
                    "expected_failures": t / m_n,
                    "effective_ratio": t / total,
                    "measured_effective_ratio": statistics.median(measured) if measured else None,
                }
            )
    return out


__all__ = ["lowdiff_plan", "run_chaos", "simulate_gpus"]

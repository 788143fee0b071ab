"""The node-loss series of ``lowdiff torture --nodes N``: a whole node of a 2-node job lost.

Each loss is one job of :mod:`lowdiff_lab.torture.ddp_job` on two "nodes"
(:mod:`lowdiff_lab.torture.nodes`: one torchrun agent and one gloo rank each, c10d
rendezvous on 127.0.0.1) sharing one checkpoint directory. Once rank 1 has logged its
step ``k`` (drawn from the seed), node B is lost: its agent, its trainer and its
checkpointing process are SIGKILLed and its local directory deleted. Node C joins as its
replacement (rank 1), and the job trains to its end. Checked for every loss:

- the loss landed mid-run (rank 1 reached step ``k`` and not the last step);
- both ranks of the restarted attempt resumed at one step, at or after the newest step
  the job was told durable (no acknowledged step lost);
- the resumed and final states equal the uninterrupted reference's (``torch.equal``);
- afterwards nothing of the job runs and no lowdiff segment is left in ``/dev/shm``.

Example:
    >>> r = run_node_losses("/tmp/node-losses", losses=2, seed=1)  # doctest: +SKIP
    >>> r.kills, r.wrong_states, r.lost_acknowledged, r.leaked  # doctest: +SKIP
    (2, 0, 0, 0)
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

from lowdiff_lab.prefork import PreforkServer
from lowdiff_lab.torture import ddp_job
from lowdiff_lab.torture.ddp import (
    STEPS,
    _common,
    _read_log,
    check_acknowledged,
    check_states,
    run_series,
)
from lowdiff_lab.torture.nodes import Job
from lowdiff_lab.torture.report import TortureReport

STEP_SLEEP = 0.25
"""Seconds each step sleeps, so that the loss lands inside the run."""
TIMEOUT_S = 180.0
"""Bound on each wait of a loss (the run to step ``k``, the end of the job)."""
SHM = Path("/dev/shm")


def plan_losses(losses: int, seed: int, strategy: str = "lowdiff") -> list[tuple[str, int]]:
    """(strategy, step after which node B is lost) per loss; ``"both"`` alternates."""
    if strategy not in ("lowdiff", "lowdiff+", "both"):
        raise ValueError(f"strategy must be lowdiff, lowdiff+ or both, got {strategy!r}")
    rng = random.Random(seed)
    methods = ("lowdiff", "lowdiff+") if strategy == "both" else (strategy,)
    return [(methods[i % len(methods)], rng.randint(2, STEPS - 3)) for i in range(losses)]


def _segments() -> set[str]:
    return {p.name for p in SHM.glob("lowdiff-*")} if SHM.is_dir() else set()


def _wait(cond: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _lose_node(out: Path, strategy: str, k: int) -> tuple[str | None, list[int]]:
    """Run the job of one loss in ``out.parent``; (what went wrong, or None; the pids of
    the job still running after its end)."""
    args = [
        "--dir", str(out.parent / "ck"), "--out", str(out), *_common(strategy),
        "--log-durable", str(out / "durable"), "--step-sleep", str(STEP_SLEEP),
    ]  # fmt: skip
    with Job(Path(ddp_job.__file__), args, out.parent, out=out, max_restarts=1) as job:
        a, b = job.start("A"), job.start("B")
        if not _wait(
            lambda: (
                _read_log(out / "durable-rank1.txt").last_step >= k or b.proc.poll() is not None
            ),
            TIMEOUT_S,
        ):
            return f"rank 1 did not reach step {k} in {TIMEOUT_S:.0f} s", []
        if b.proc.poll() is not None:
            return f"node B ended before step {k} (exit {b.proc.returncode})", []
        b.lose()
        # C is a new agent: its first attempt counts as restart 0 too. B's log goes aside
        (out / "durable-rank1.txt").rename(out / "durable-rank1-B.txt")
        c = job.start("C")
        codes = [n.wait(TIMEOUT_S) for n in (a, c)]
        _wait(lambda: not job.running(), 10.0)  # the checkpointing processes' ends
        left = sorted(job.running())
    if codes != [0, 0]:
        return f"nodes A and C exited {codes}", left
    return None, left


def _check_loss(report: TortureReport, i: int, strategy: str, k: int, work: Path, ref: Path) -> str:
    """Run loss ``i`` and add its figures to ``report``; a line for the log."""
    out = work / f"loss-{i:03d}" / "out"
    out.mkdir(parents=True, exist_ok=True)
    name = f"node loss {i} ({strategy}, after step {k})"
    before = _segments()
    error, left = _lose_node(out, strategy, k)
    leaked = sorted(_segments() - before)
    if left or leaked:
        report.leaked += len(left) + len(leaked)
        report.fail(f"{name}: left behind: processes {left}, segments {leaked}")
    if error is not None:
        report.fail(f"{name}: {error} (see {out.parent})")
        return f"{name}: {error}"
    a, b, c = (_read_log(out / f) for f in ("durable-rank0.txt", "durable-rank1-B.txt",
                                            "durable-rank1.txt"))  # fmt: skip
    report.kills += 1
    report.kills_by_target["node"] += 1
    report.kills_by_strategy[strategy] += 1
    report.recoveries += 1
    lost_at = b.last_step
    if not k <= lost_at < STEPS:
        report.fail(f"{name}: the loss did not land mid-run (rank 1 at step {lost_at})")
    resumes = {a.resumes.get(1), c.resumes.get(0)}  # A restarted; C's first attempt
    if len(resumes) != 1 or None in resumes:
        report.recoveries_by_source[f"{strategy} failed"] += 1
        report.fail(f"{name}: the ranks did not resume at one step ({a.resumes}, {c.resumes})")
        return f"{name}: no agreed resume"
    resumed, source = resumes.pop()  # type: ignore[misc]
    report.recoveries_by_source[f"{strategy} {source}"] += 1
    acked = max(a.durable, b.durable)  # what the job was told before the loss
    check_acknowledged(report, name, out, resumed, acked)
    exact = check_states(report, name, strategy, ref, out, resumed)
    report.recoveries_ok += exact
    return (
        f"{name}: lost at step {lost_at}, acknowledged {acked}, resumed at {resumed} from "
        f"{source}, {'states exact' if exact else 'WRONG STATE'}"
    )


def run_node_losses(
    workdir: str | Path,
    losses: int,
    seed: int = 0,
    strategy: str = "lowdiff",
    log: Callable[[str], None] | None = None,
    server: PreforkServer | None = None,
) -> TortureReport:
    """Lose node B of a 2-node job ``losses`` times and check every recovery.

    One uninterrupted reference run per strategy, then one job per loss (see the module
    docstring for what is checked); every run's directory is kept under ``workdir``
    (``reference-{strategy}/``, ``loss-{i}/``: ``ck/`` the checkpoints, ``out/`` the
    states and durable logs, ``logs/`` each node's agent log).

    Args:
        workdir: where the runs go (created; kept).
        losses: how many node losses to run.
        seed: seeds the step of every loss.
        strategy: ``"lowdiff"``, ``"lowdiff+"`` or ``"both"`` (alternating).
        log: called with one line per loss.
        server: the fork server the reference runs' agents start from (default: one of
            its own for the run).

    Returns:
        The figures: losses (``kills``, target ``node``), recoveries by source, wrong
        states, acknowledged steps lost and what was left behind (``leaked``).
    """
    plans = plan_losses(losses, seed, strategy)

    def check(
        report: TortureReport, i: int, plan: tuple[str, int], work: Path, ref: Path, _: object
    ) -> str:
        return _check_loss(report, i, plan[0], plan[1], work, ref)

    return run_series(workdir, plans, lambda plan: plan[0], check, log, server)

"""The 2-rank DDP kill series of ``lowdiff torture --ddp N``, and the torchrun launcher.

Each kill is one job of :mod:`lowdiff_lab.torture.ddp_job` (2 gloo ranks under ``torchrun
--max-restarts 1``) in which one rank SIGKILLs itself at a seeded step that is neither a
full-checkpoint step nor a record-file boundary, either before its forward pass or between
its backward pass (the ranks' gradients already merged by the comm hook) and ``ck.step()``;
in some kills its checkpointing process dies first (a machine failure). torchrun tears
down the other rank and restarts the job, which resumes at one agreed step and trains to
the end. Then, for every kill:

1. the kill landed (the job wrote ``killed`` just before the SIGKILL);
2. the restarted job resumed (both ranks at the same step);
3. no acknowledged step was lost: the resumed step is at least the newest job-wide
   ``ck.durable_step`` any rank logged before the kill (the job appends it with
   ``O_APPEND`` writes after every step, so the log survives the SIGKILL); after a
   trainer-only kill, it is also at least the step every rank had handed off;
4. no wrong state: on every rank the resumed state equals an uninterrupted reference run
   at that step, and the final state equals the reference's final state (bit for bit:
   :func:`lowdiff.state.capture.diff_states`).

Example:
    >>> report = run_ddp_kills("/tmp/ddp", kills=4, seed=0)  # doctest: +SKIP
    >>> print(report.format_text())  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from lowdiff.state.capture import diff_states
from lowdiff_lab.prefork import PreforkServer
from lowdiff_lab.torture.report import TortureReport

T = TypeVar("T")

JOB_MODULE = "lowdiff_lab.torture.ddp_job"
"""The job torchrun starts when no script is given (run as a module)."""
AGENT_PRELOAD = (
    "torch._dynamo",
    "torch.distributed.run",
    "lowdiff_lab.torture.ddp_agent",
    JOB_MODULE,
)
"""What the fork server of the agents imports (see :mod:`lowdiff_lab.prefork`)."""

STEPS = 16
FULL_EVERY = 6
BATCH_SIZE = 3
KILL_STEPS = tuple(s for s in range(1, STEPS) if s % BATCH_SIZE and s % FULL_EVERY)
"""Kill steps that are neither a full checkpoint nor the end of a record file."""
KILL_POINTS = ("before-forward", "after-backward")
STRATEGIES = ("lowdiff", "lowdiff+")
WORKER_KILL_SHARE = 0.25
"""Share of the kills that take the rank's checkpointing process down too."""
RUN_TIMEOUT_S = 300.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(
    *args: str,
    restarts: int = 0,
    timeout: float = RUN_TIMEOUT_S,
    script: Path | None = None,
    check: bool = True,
    agent: str = "fork",
    server: PreforkServer | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a 2-rank job under torchrun on this machine.

    Args:
        args: the job's own arguments.
        restarts: ``--max-restarts`` (restarts of the whole job after a rank fails).
        timeout: seconds before the job is stopped (SIGTERM, then SIGKILL of its session).
        script: the training script; default: :mod:`lowdiff_lab.torture.ddp_job` as a module.
        check: raise ``AssertionError`` (with the output's tail) unless torchrun exits 0.
        agent: ``"fork"``: torch's elastic agent with ranks forked from it
            (:mod:`lowdiff_lab.torture.ddp_agent`, the same rendezvous, environment and
            restarts without an interpreter start per rank); ``"exec"``: the real
            ``python -m torch.distributed.run``.
        server: Start the agent as a fork of this server (see :mod:`lowdiff_lab.prefork`)
            instead of a new interpreter.

    Returns:
        The finished process, with its stdout and stderr.
    """
    target = ["--module", JOB_MODULE] if script is None else [str(script)]
    if agent not in ("fork", "exec"):
        raise ValueError(f"agent must be 'fork' or 'exec', got {agent!r}")
    launcher = "lowdiff_lab.torture.ddp_agent" if agent == "fork" else "torch.distributed.run"
    cmd = [
        sys.executable,
        "-m",
        launcher,
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{_free_port()}",
        "--max-restarts",
        str(restarts),
        "--monitor-interval",
        "0.5",
        *target,
        *args,
    ]
    # a restarted round must not read the previous round's addresses from a shared store
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    start = subprocess.Popen if server is None else server.popen
    proc = start(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM first: torchrun then stops its ranks (each in a session of its own)
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        raise AssertionError(
            f"torchrun timed out after {timeout} s:\n{out[-4000:]}\n{err[-8000:]}"
        ) from None
    code = proc.wait()
    p = subprocess.CompletedProcess(cmd, code, out, err)
    if check:
        assert p.returncode == 0, (
            f"torchrun failed ({p.returncode}); the agent's account:\n{agent_account(p.stderr)}\n"
            f"stdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-8000:]}"
        )
    return p


def agent_account(stderr: str) -> str:
    """The lines of torchrun's own output that say which worker ended how (its exit
    codes, signals and restarts, and its closing failure summary), ahead of the workers'
    tracebacks that a failed job's output is mostly made of."""
    keep = (
        "exitcode",
        "restart",
        "Signal",
        "closing signal",
        "FAILED",
        "rank ",
        "Root Cause",
        "Error",
    )
    lines = [
        ln
        for ln in stderr.splitlines()
        if not ln.startswith("[rank") and any(k in ln for k in keep)
    ]
    return "\n".join(lines[-40:]) or "(none)"


@dataclass(frozen=True)
class DdpKill:
    """One kill of the series."""

    strategy: str
    rank: int
    """The rank that kills itself."""
    step: int
    """The step it dies in (the state it reached is this step)."""
    point: str
    """``before-forward`` or ``after-backward`` (gradients merged, ``ck.step()`` not run)."""
    worker: bool
    """Its checkpointing process is SIGKILLed first (a machine failure)."""

    @property
    def target(self) -> str:
        return "trainer+worker" if self.worker else "trainer"

    @property
    def marker(self) -> str:
        """What the job writes to ``killed`` when this kill lands."""
        return f"{self.step} {self.point}" + (" worker" if self.worker else "")


def plan_kills(kills: int, seed: int, strategy: str = "lowdiff") -> list[DdpKill]:
    """The seeded kills of a series (``method="both"`` alternates LowDiff and LowDiff+)."""
    if strategy not in (*STRATEGIES, "both"):
        raise ValueError(f"strategy must be one of {(*STRATEGIES, 'both')}, got {strategy!r}")
    if not isinstance(kills, int) or isinstance(kills, bool) or kills < 0:
        raise ValueError(f"kills must be an int >= 0, got {kills!r}")
    rng = random.Random(seed)
    plans = []
    for i in range(kills):
        plans.append(
            DdpKill(
                strategy=STRATEGIES[i % 2] if strategy == "both" else strategy,
                rank=rng.randrange(2),
                step=rng.choice(KILL_STEPS),
                point=rng.choice(KILL_POINTS),
                worker=rng.random() < WORKER_KILL_SHARE,
            )
        )
    return plans


def _common(strategy: str) -> list[str]:
    return [
        "--strategy",
        strategy,
        "--steps",
        str(STEPS),
        "--full-every",
        str(FULL_EVERY),
        "--batch-size",
        str(BATCH_SIZE),
    ]


def _load(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def _reference(work: Path, strategy: str, server: PreforkServer) -> Path:
    """An uninterrupted run that saves every rank's state after every step."""
    out = work / f"reference-{strategy}"
    out.mkdir(parents=True, exist_ok=True)
    steps = ",".join(str(s) for s in range(1, STEPS + 1))
    p = torchrun(
        "--dir", str(out / "ck"), "--out", str(out), *_common(strategy), "--save-steps", steps,
        server=server,
    )  # fmt: skip
    (out / "torchrun.log").write_text(p.stdout + p.stderr)
    return out


def _ref_state(ref: Path, step: int, rank: int) -> Path:
    return ref / (f"resumed-0-rank{rank}.pt" if step == 0 else f"state-{step}-rank{rank}.pt")


@dataclass
class _Rounds:
    """What one rank's durable log says about the first attempt and the restart."""

    resumes: dict[int, tuple[int, str]]
    """torchrun restart count -> (resumed step, source)."""
    last_step: int
    """The newest step whose ``ck.step()`` returned in the first attempt (-1: none)."""
    durable: int
    """The newest job-wide durable step this rank was told in the first attempt."""


def _read_log(path: Path) -> _Rounds:
    rounds = _Rounds({}, -1, -1)
    restart = -1
    if not path.exists():
        return rounds
    for line in path.read_text().splitlines():
        f = line.split()
        if f and f[0] == "resume":
            restart = int(f[3])
            rounds.resumes[restart] = (int(f[1]), f[2])
        elif len(f) == 2 and restart == 0:
            rounds.last_step = max(rounds.last_step, int(f[0]))
            rounds.durable = max(rounds.durable, int(f[1]))
    return rounds


def _check_kill(
    report: TortureReport, i: int, k: DdpKill, work: Path, ref: Path, server: PreforkServer
) -> str:
    """Run kill ``i`` and add its figures to ``report``; a line for the log."""
    out = work / f"kill-{i:03d}" / "out"
    out.mkdir(parents=True, exist_ok=True)
    name = f"kill {i} ({k.strategy}, rank {k.rank}, step {k.step}, {k.point}, {k.target})"
    try:
        p = torchrun(*_kill_args(k, out.parent), restarts=1, check=False, server=server)
    except AssertionError as e:  # timed out
        (out / "torchrun.log").write_text(str(e))
        report.fail(f"{name}: {str(e).splitlines()[0]} (see {out / 'torchrun.log'})")
        return f"{name}: timed out"
    (out / "torchrun.log").write_text(p.stdout + p.stderr)
    killed = out / "killed"
    if not killed.exists() or killed.read_text() != k.marker:
        marker = killed.read_text() if killed.exists() else "no kill"
        report.fail(f"{name}: the kill did not land ({marker!r}; see {out / 'torchrun.log'})")
        return f"{name}: the kill did not land"
    report.kills += 1
    report.kills_by_point[k.point] += 1
    report.kills_by_target[k.target] += 1
    report.kills_by_strategy[k.strategy] += 1
    logs = [_read_log(out / f"durable-rank{r}.txt") for r in (0, 1)]
    resumes = {lg.resumes.get(1) for lg in logs}
    report.recoveries += 1
    if len(resumes) != 1 or None in resumes:
        report.recoveries_by_source[f"{k.strategy} failed"] += 1
        report.fail(
            f"{name}: the restarted job did not resume on both ranks at one step "
            f"({[lg.resumes for lg in logs]}; torchrun exit {p.returncode}; see {out})"
        )
        return f"{name}: no agreed resume"
    resumed, source = resumes.pop()  # type: ignore[misc]
    report.recoveries_by_source[f"{k.strategy} {source}"] += 1
    report.adoptions += _taken_over(out)
    acked = max(lg.durable for lg in logs)
    handed = logs[k.rank].last_step
    _check_steps(report, name, k, out, resumed, acked, handed)
    exact = check_states(report, name, k.strategy, ref, out, resumed)
    if exact and p.returncode != 0:
        report.fail(f"{name}: torchrun exit {p.returncode} (see {out / 'torchrun.log'})")
    elif exact:
        report.recoveries_ok += 1
    return (
        f"{name}: acknowledged {acked}, handed off {handed}, resumed at {resumed} from "
        f"{source}, {'states exact' if exact else 'WRONG STATE'}"
    )


def _taken_over(out: Path) -> int:
    """How many ranks of the restarted attempt took over the checkpointing process that
    outlived their killed attempt (the job's ``process-rank*`` files: ``"{own} {adopted}"``)."""
    n = 0
    for f in out.glob("process-rank*-*.txt"):
        fields = f.read_text().split()
        if len(fields) == 2 and int(fields[1]) > 0:
            n += 1
    return n


def _kill_args(k: DdpKill, run: Path) -> list[str]:
    """The job's arguments for kill ``k``, its checkpoints in ``run/ck``, the rest in ``run/out``."""
    out = run / "out"
    args = [
        "--dir",
        str(run / "ck"),
        "--out",
        str(out),
        *_common(k.strategy),
        "--kill-rank",
        str(k.rank),
        "--kill-at",
        str(k.step),
        "--kill-point",
        k.point,
        "--log-durable",
        str(out / "durable"),
    ]
    if k.worker:
        args.append("--kill-worker")
    return args


def _check_steps(
    report: TortureReport,
    name: str,
    k: DdpKill,
    out: Path,
    resumed: int,
    acked: int,
    handed: int,
) -> None:
    """The promises about steps: the killed rank died in its step, no acknowledged step was
    lost, and after a trainer-only kill no handed-off step either."""
    if handed != k.step:
        report.fail(f"{name}: the killed rank's last step was {handed}, not {k.step} (see {out})")
    check_acknowledged(report, name, out, resumed, acked)
    if not k.worker and resumed < handed:
        report.lost_handed_off += 1
        report.fail(
            f"{name}: trainer-only kill resumed at {resumed}, but every rank had handed off "
            f"step {handed} ({out})"
        )


def check_acknowledged(
    report: TortureReport, name: str, out: Path, resumed: int, acked: int
) -> None:
    """No acknowledged step lost: the resumed step is at least ``acked``."""
    report.margin(resumed, acked)
    if resumed < acked:
        report.lost_acknowledged += 1
        report.lost_acknowledged_steps += acked - resumed
        report.fail(f"{name}: resumed at {resumed}, but step {acked} was acknowledged ({out})")


def check_states(
    report: TortureReport, name: str, strategy: str, ref: Path, out: Path, resumed: int
) -> bool:
    """No wrong state (every rank's resumed and final state is the reference's); whether
    they were all exact."""
    wrong = _wrong_states(ref, out, resumed)
    if wrong:
        report.wrong_states += 1
        report.wrong_states_by_strategy[strategy] += 1
        report.fail(f"{name}: wrong state: {'; '.join(wrong)} ({out})")
    return not wrong


def run_series(
    workdir: str | Path,
    plans: Sequence[T],
    strategy_of: Callable[[T], str],
    check: Callable[[TortureReport, int, T, Path, Path, PreforkServer], str],
    log: Callable[[str], None] | None,
    server: PreforkServer | None,
) -> TortureReport:
    """Run a series of 2-rank jobs: one uninterrupted reference run per strategy (under
    ``workdir/reference-{strategy}/``), then ``check(report, i, plan, workdir, reference,
    server)`` per plan, which runs it and adds its figures; a line of each to ``log``."""
    t0 = time.monotonic()
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    report = TortureReport()
    with contextlib.ExitStack() as stack:
        if server is None:
            server = stack.enter_context(PreforkServer(AGENT_PRELOAD))
        strategies = sorted({strategy_of(p) for p in plans})
        refs = {s: _reference(work, s, server) for s in strategies}
        for i, plan in enumerate(plans):
            line = check(report, i, plan, work, refs[strategy_of(plan)], server)
            if log is not None:
                log(line)
    report.wall_s = time.monotonic() - t0
    return report


def _wrong_states(ref: Path, out: Path, resumed: int) -> list[str]:
    """Every rank's resumed and final state against the reference's (empty: all exact)."""
    wrong = []
    for r in (0, 1):
        pairs = [
            (_ref_state(ref, resumed, r), out / f"resumed-{resumed}-rank{r}.pt"),
            (ref / f"final-rank{r}.pt", out / f"final-rank{r}.pt"),
        ]
        for want, got in pairs:
            if not got.exists():
                wrong.append(f"rank {r}: {got.name} missing")
                continue
            d = diff_states(_load(want), _load(got))
            if d:
                wrong.append(f"rank {r}: {got.name} differs in {len(d)} entries ({d[0]})")
    return wrong


def run_ddp_kills(
    workdir: str | Path,
    kills: int,
    seed: int = 0,
    strategy: str = "lowdiff",
    log: Callable[[str], None] | None = None,
    server: PreforkServer | None = None,
) -> TortureReport:
    """Kill one rank of a 2-rank DDP job ``kills`` times and check every recovery.

    One uninterrupted reference run per strategy, then one job per kill (see the module
    docstring for what is checked). Every run's directory is kept under ``workdir``:
    ``reference-{strategy}/`` and ``kill-{i}/`` (``ck/`` the checkpoints, ``out/`` the
    states, the durable logs ``durable-rank{r}.txt`` and ``torchrun.log``).

    Args:
        workdir: where the runs go (created; kept).
        kills: how many kill jobs to run.
        seed: seeds the rank, step, kill point and target of every kill.
        strategy: ``"lowdiff"``, ``"lowdiff+"`` or ``"both"`` (alternating).
        log: called with one line per kill.
        server: The fork server each job's agent is started from (default: one of its
            own for the run; see :mod:`lowdiff_lab.prefork`).

    Returns:
        The figures: kills (by point, target and strategy), recoveries (by source),
        wrong states, acknowledged steps lost and the recovered-minus-acknowledged margin.

    Example:
        >>> r = run_ddp_kills("/tmp/ddp-kills", kills=2, seed=1)  # doctest: +SKIP
        >>> r.kills, r.wrong_states, r.lost_acknowledged  # doctest: +SKIP
        (2, 0, 0)
    """
    plans = plan_kills(kills, seed, strategy)
    return run_series(workdir, plans, lambda k: k.strategy, _check_kill, log, server)

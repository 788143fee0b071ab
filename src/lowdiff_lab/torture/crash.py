"""Crash-point torture: SIGKILL the trainer, the checkpointing process or both, recover.

A *plan* says what to kill and when: at a random time, or at a hook point inside a
write (before the fsync, between the fsync and the rename, after the rename, while a
full checkpoint is written, while retention deletes files, while the trainer rewrites
the manifest during resume). :mod:`lowdiff_lab.torture.job` runs the plans one session
each; this module starts it, restarts it after each kill of the trainer, and checks
every recovery against the uninterrupted reference trajectory:

1. recovery succeeds;
2. the recovered step is at least the newest step the trainer was told was durable
   (``ck.durable_step``, printed by the job before it was killed): the *acknowledged*
   step. After a kill of the trainer alone, the surviving checkpointing process writes
   everything it was handed, so the recovered step is also at least the last step whose
   ``ck.step()`` returned;
3. the recovered state is bit-identical (``torch.equal`` on every tensor) to the
   reference at that step.

Both strategies are driven. LowDiff (``method="lowdiff"``) writes record files and full
checkpoints. LowDiff+ (``method="lowdiff+"``) keeps a replica in its checkpointing
process and persists it as full checkpoints only, so its plans use the full-checkpoint and
retention hook points; after a kill of the trainer alone the replica survives in memory
and the next ``resume()`` restores from it (``ck.recovery_stats.source == "memory"``),
otherwise from the newest persisted full checkpoint. Its reference is the uncompressed
trajectory (:func:`lowdiff_lab.torture.workload.reference` with ``plus=True``).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

import lowdiff
from lowdiff.format import layout
from lowdiff.proc import holder as rp
from lowdiff.state.capture import diff_states
from lowdiff_lab.prefork import PreforkServer
from lowdiff_lab.torture.report import TortureReport

# (point, kind, largest nth): where a write can be interrupted
HOOK_POINTS: list[tuple[str, str, int]] = [
    ("before_fsync", "records", 3),
    ("before_rename", "records", 3),
    ("after_rename", "records", 2),
    ("before_write", "full", 2),
    ("before_fsync", "full", 2),
    ("before_rename", "full", 2),
    ("after_rename", "full", 2),
    ("retention", "any", 4),
]
# LowDiff+ writes full checkpoints only (no record files)
PLUS_HOOK_POINTS: list[tuple[str, str, int]] = [
    (point, kind, most) for point, kind, most in HOOK_POINTS if kind != "records"
]
STRATEGIES = ("lowdiff", "lowdiff+")
ACTIONS = {"worker": "kill-self", "trainer": "kill-parent", "both": "kill-both"}
N_STEPS = 240
JOB_PRELOAD = ("lowdiff_lab.torture.job",)
"""What the fork server of the jobs imports (see :mod:`lowdiff_lab.prefork`)."""
STEP_SLEEP = 0.004


def make_plans(n: int, seed: int, strategy: str = "lowdiff") -> list[dict[str, Any]]:
    """``n`` kill plans for ``strategy``: targets, hook points and random times, mixed by ``seed``."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    rng = random.Random(seed)
    points = HOOK_POINTS if strategy == "lowdiff" else PLUS_HOOK_POINTS
    plans: list[dict[str, Any]] = []
    for i in range(n):
        target = ("worker", "trainer", "both")[i % 3]
        if i % 10 == 9:
            # the trainer rewrites the manifest during resume
            plans.append(
                {
                    "target": "trainer",
                    "how": "hook",
                    "spec": "before_rename:manifest:1:kill-self",
                    "point": "before_rename:manifest",
                }
            )
        elif rng.random() < 0.6:
            point, kind, most = rng.choice(points)
            nth = rng.randint(1, most)
            plans.append(
                {
                    "target": target,
                    "how": "hook",
                    "spec": f"{point}:{kind}:{nth}:{ACTIONS[target]}",
                    "point": f"{point}:{kind}",
                }
            )
        else:
            startup = target != "worker" and rng.random() < 0.2
            plans.append(
                {
                    "target": target,
                    "how": "time",
                    "phase": "startup" if startup else "training",
                    "delay": rng.uniform(0.0, 1.5 if startup else 0.8),
                    "point": "random time (startup)" if startup else "random time",
                }
            )
    if strategy == "lowdiff+":
        # now and then the next session is another job (another keep_full): a survivor of
        # the killed trainer refuses it, persists and exits
        for i in range(3, len(plans), 7):
            plans[i]["foreign"] = True
    plans.append({"target": "none", "how": "check", "point": "final check"})
    return plans


class _Chain:
    def __init__(self) -> None:
        self.acked = -1
        self.handed = -1
        self.expect_handed = -1
        self.killed = ""


class CrashHarness:
    """Runs kill plans in ``workdir`` and adds the figures to ``report``."""

    def __init__(
        self,
        workdir: Path,
        reference: list[dict[str, torch.Tensor]],
        report: TortureReport,
        *,
        seed: int = 0,
        timeout: float = 180.0,
        strategy: str = "lowdiff",
        log: Callable[[str], None] | None = None,
        server: PreforkServer | None = None,
    ) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.workdir, self.ref, self.report = Path(workdir), reference, report
        self.seed, self.timeout, self.log = seed, timeout, log or (lambda _: None)
        self.strategy = strategy
        self.server = server  # jobs are forks of it (else new interpreters)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        """Set on an interrupt: the chain ends after its current job, which is killed."""
        self.proc: Any = None
        """The job running now."""

    def run(self, plans: list[dict[str, Any]]) -> None:
        dumps = self.workdir / "dumps"
        dumps.mkdir(parents=True, exist_ok=True)
        chains: dict[int, _Chain] = {}
        chain, i = 0, 0
        while i < len(plans) and not self.stop.is_set():
            cfg = {
                "base": str(self.workdir),
                "dump_dir": str(dumps),
                "chain": chain,
                "start_plan": i,
                "plans": plans,
                "n_steps": len(self.ref) - 1,
                "sleep": STEP_SLEEP,
                "seed": self.seed,
                "strategy": self.strategy,
            }
            current, chain, rc, tail = self._run_job(cfg, plans, chains, chain, i)
            plan = plans[current]
            if rc == -signal.SIGKILL:
                self._count_kill(plan)
                if plan["target"] == "trainer":
                    c = chains.setdefault(chain, _Chain())
                    c.expect_handed = c.handed
                    c.killed = plan["point"]
            elif rc == 0:
                break
            else:
                with self.lock:
                    self.report.fail(f"job exited with {rc} in plan {current} {plan}: {tail}")
                chain += 1  # go on in a new directory rather than fail every later plan
            i = current + 1
        if self.stop.is_set():
            self.end_survivors()
            return
        self._check_leaks()

    def interrupt(self) -> None:
        """Stop the chain: its running job is killed (from another thread)."""
        self.stop.set()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            _kill_group(proc.pid)

    def end_survivors(self) -> None:
        """After an interrupt: no process or shared memory of the chains outlives the run.
        Each chain's checkpointing process is let go (it persists what it holds and
        exits), and the segments of the chain's runs that no process maps are removed
        (a job killed with its checkpointing process leaves them to the next job, which
        will not come)."""
        for d in sorted(self.workdir.glob("chain-*")):
            with contextlib.suppress(Exception):
                rp.forget_released(d, rp.release_orphan(d, 5.0))
        ours = _runs_under(self.workdir)
        for name in sorted(_lowdiff_segments() - _mapped_segments()):
            if ours and name.startswith(ours):
                with contextlib.suppress(OSError):
                    os.unlink(f"/dev/shm/{name}")

    def _check_leaks(self, wait_s: float = 15.0) -> None:
        """Nothing may outlive the run: no checkpointing process of any chain, and no
        shared-memory segment of any of their runs."""
        deadline = time.monotonic() + wait_s
        for d in sorted(self.workdir.glob("chain-*")):
            runs = set()
            desc = rp.read_descriptor(d)
            if desc is not None:
                runs.add(desc.run_id)
                while rp.pid_alive(desc.pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if rp.pid_alive(desc.pid):
                    with self.lock:
                        self.report.leaked += 1
                        self.report.fail(f"{d.name}: process {desc.pid} outlived the run")
            with contextlib.suppress(Exception):
                runs.add(str(layout.read_manifest(d)["run_id"]))
            try:
                names = os.listdir("/dev/shm")
            except OSError:
                names = []
            left = [n for n in names for r in runs if n.startswith(f"lowdiff-{r[:16]}-")]
            if left:
                with self.lock:
                    self.report.leaked += len(left)
                    self.report.fail(f"{d.name}: shared memory left behind: {sorted(left)}")

    def _count_kill(self, plan: dict[str, Any]) -> None:
        with self.lock:
            self.report.kills += 1
            self.report.kills_by_target[plan["target"]] += 1
            self.report.kills_by_point[plan["point"]] += 1
            self.report.kills_by_strategy[self.strategy] += 1

    def _run_job(
        self,
        cfg: dict[str, Any],
        plans: list[dict[str, Any]],
        chains: dict[int, _Chain],
        chain: int,
        current: int,
    ) -> tuple[int, int, int | None, str]:
        env = dict(os.environ)
        env.pop("LOWDIFF_FAULTS", None)
        src = str(Path(lowdiff.__file__).resolve().parents[1])
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
        # stderr goes to a file: a checkpointing process that outlives the job (a LowDiff+
        # replica waiting for the next trainer) inherits it, and must not hold a pipe open
        err_file = tempfile.TemporaryFile(mode="w+", dir=self.workdir)  # noqa: SIM115 -- closed below
        start = subprocess.Popen if self.server is None else self.server.popen
        proc = start(
            [sys.executable, "-m", "lowdiff_lab.torture.job", json.dumps(cfg)],
            stdout=subprocess.PIPE,
            stderr=err_file,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.proc = proc
        if self.stop.is_set():  # interrupted while it started
            _kill_group(proc.pid)
        hung = threading.Event()

        def on_timeout() -> None:
            hung.set()
            _kill_group(proc.pid)

        timer = threading.Timer(self.timeout, on_timeout)
        timer.start()
        try:
            assert proc.stdout is not None
            for raw in proc.stdout:
                current, chain = self._on_line(raw.rstrip("\n"), plans, chains, chain, current)
            proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                _kill_group(proc.pid)
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
            err_file.seek(0)
            err_lines = err_file.readlines()[-6:]
            err_file.close()
        if hung.is_set():
            with self.lock:
                self.report.fail(f"plan {current}: the job hung for {self.timeout:.0f} s")
        # the checkpointing process of a killed trainer finishes on its own; wait for it
        # through the writer lock at the next resume, but never leave one behind at the end
        tail = "".join(err_lines).strip().replace("\n", " | ")[-600:]
        return current, chain, proc.returncode, tail

    def _on_line(
        self,
        line: str,
        plans: list[dict[str, Any]],
        chains: dict[int, _Chain],
        chain: int,
        current: int,
    ) -> tuple[int, int]:
        """Take in one line of the job's output (see :mod:`lowdiff_lab.torture.job`); returns
        the plan and chain it runs now."""
        word, _, rest = line.partition(" ")
        c = chains.setdefault(chain, _Chain())
        if word == "plan":
            current = int(rest)
            c.handed = -1  # steps handed off count from this session's resume
        elif word == "chain":
            chain = int(rest)
        elif word == "durable":
            c.acked = max(c.acked, int(rest))
        elif word == "step":
            c.handed = int(rest)
        elif word == "resumed":
            step, source, path = rest.split(" ", 2)
            self._check_recovery(c, int(step), source, Path(path))
            c.handed = int(step)
        elif word in ("adopted", "refused"):
            with self.lock:
                if word == "adopted":
                    self.report.adoptions += 1
                else:
                    self.report.refused_survivors += 1
        elif word == "worker_error":
            plan = plans[current]
            if plan["target"] == "worker":
                self._count_kill(plan)
            else:
                with self.lock:
                    self.report.fail(f"plan {current} {plan}: unexpected {line}")
        elif word == "recovery_failed":
            with self.lock:
                self.report.recoveries += 1
                self.report.recoveries_by_source[f"{self.strategy} failed"] += 1
                self.report.fail(f"{self.strategy} chain {chain}, plan {current}: {line}")
        return current, chain

    def _check_recovery(self, c: _Chain, step: int, source: str, dump: Path) -> None:
        got = safetensors.torch.load_file(str(dump))
        dump.unlink()
        bad = diff_states(self.ref[step], got) if step < len(self.ref) else ["beyond reference"]
        what = f"{self.strategy}: recovered step {step} ({source})"
        with self.lock:
            r = self.report
            r.recoveries += 1
            r.recoveries_by_source[f"{self.strategy} {source}"] += 1
            ok = True
            if bad:
                r.wrong_states += 1
                r.wrong_states_by_strategy[self.strategy] += 1
                r.fail(f"{what} differs from the reference: {bad[:5]}")
                ok = False
            if step < c.acked:
                r.lost_acknowledged += 1
                r.fail(f"{what} < acknowledged durable step {c.acked}")
                ok = False
            if step < c.expect_handed:
                r.lost_handed_off += 1
                r.fail(
                    f"{what} after a trainer-only kill ({c.killed}) < "
                    f"{c.expect_handed} steps handed off"
                )
                ok = False
            if c.acked >= 0:
                r.margin(step, c.acked)
            r.recoveries_ok += ok
        c.expect_handed = -1
        c.acked = max(c.acked, step)


def _run_reporting_errors(
    h: CrashHarness, plans: list[dict[str, Any]], report: TortureReport
) -> None:
    """Run a chain of plans; an error in the harness itself fails the report (never a silent OK)."""
    try:
        h.run(plans)
    except Exception as e:  # noqa: BLE001 -- recorded as a failure of the run
        with h.lock:
            report.fail(f"the harness of {h.workdir.name} stopped: {type(e).__name__}: {e}")


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def split_kills(n_kills: int, strategies: tuple[str, ...] = STRATEGIES) -> dict[str, int]:
    """Kill plans per strategy: LowDiff+ gets a third of them when both are driven."""
    for name in strategies:
        if name not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {name!r}")
    if not strategies:
        raise ValueError("strategies must name at least one strategy")
    if set(strategies) == set(STRATEGIES):
        plus = n_kills // 3
        return {"lowdiff": n_kills - plus, "lowdiff+": plus}
    return {strategies[0]: n_kills}


def run_crash(
    workdir: Path,
    n_kills: int,
    report: TortureReport,
    *,
    seed: int = 0,
    jobs: int = 1,
    reference: list[dict[str, torch.Tensor]] | None = None,
    plus_reference: list[dict[str, torch.Tensor]] | None = None,
    strategies: tuple[str, ...] = STRATEGIES,
    log: Callable[[str], None] | None = None,
    fork: bool = True,
) -> None:
    """Run ``n_kills`` kill plans, split over ``strategies`` (LowDiff+ gets a third when
    both are driven) and, for each strategy, over ``jobs`` independent chains of
    directories. ``reference`` and ``plus_reference`` are the uninterrupted trajectories
    of LowDiff and LowDiff+ (computed when not given). With ``fork``, every job is a fork
    of one server that imported torch and lowdiff once (:mod:`lowdiff_lab.prefork`), not a
    new interpreter."""
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(PreforkServer(JOB_PRELOAD)) if fork else None
        _run_crash(
            workdir, n_kills, report, seed, jobs, reference, plus_reference, strategies, log,
            server,
        )  # fmt: skip


def _run_crash(
    workdir: Path,
    n_kills: int,
    report: TortureReport,
    seed: int,
    jobs: int,
    reference: list[dict[str, torch.Tensor]] | None,
    plus_reference: list[dict[str, torch.Tensor]] | None,
    strategies: tuple[str, ...],
    log: Callable[[str], None] | None,
    server: PreforkServer | None,
) -> None:
    from lowdiff_lab.torture import workload

    segments_before = _lowdiff_segments()
    for strategy, share_kills in split_kills(n_kills, strategies).items():
        if share_kills == 0:
            continue
        if strategy == "lowdiff":
            ref = reference if reference is not None else workload.reference(N_STEPS)
            sub, seed0 = "crash", seed
        else:
            ref = (
                plus_reference
                if plus_reference is not None
                else workload.reference(N_STEPS, plus=True)
            )
            sub, seed0 = "crash-plus", seed + 1000
        n_jobs = max(1, min(jobs, share_kills))
        shares = [share_kills // n_jobs + (j < share_kills % n_jobs) for j in range(n_jobs)]
        threads, harnesses = [], []
        t0 = time.monotonic()
        kills0 = report.kills_by_strategy[strategy]
        for j, share in enumerate(shares):
            h = CrashHarness(
                Path(workdir) / f"{sub}-{j}",
                ref,
                report,
                seed=seed0 + j,
                strategy=strategy,
                log=log,
                server=server,
            )
            th = threading.Thread(
                target=_run_reporting_errors,
                args=(h, make_plans(share, seed0 + j, strategy), report),
            )
            th.start()
            threads.append(th)
            harnesses.append(h)
        try:
            for th in threads:
                th.join()
        except KeyboardInterrupt:
            # every chain ends now, and leaves nothing running or in shared memory
            for h in harnesses:
                h.interrupt()
            for th in threads:
                th.join()
            raise
        if log:
            done = report.kills_by_strategy[strategy] - kills0
            log(f"crash ({strategy}): {done} kills in {time.monotonic() - t0:.0f} s")
    _check_orphan_segments(segments_before, report, Path(workdir))


def _lowdiff_segments() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("lowdiff-")}
    except OSError:
        return set()


def _mapped_segments() -> set[str]:
    """The /dev/shm segments some live process maps."""
    out: set[str] = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
                out.update(
                    line.rsplit("/dev/shm/", 1)[1].split()[0] for line in f if "/dev/shm/" in line
                )
    return out


def _runs_under(workdir: Path) -> tuple[str, ...]:
    """The segment-name prefixes of every run whose manifest lies under ``workdir`` (a
    session lists its run there before it starts any process, and every run before it)."""
    runs: set[str] = set()
    for m in workdir.rglob(layout.MANIFEST):
        with contextlib.suppress(Exception):
            body = layout.read_manifest(m.parent)
            runs.update(str(r) for r in [body["run_id"], *body.get("runs", [])])
    return tuple(f"lowdiff-{r[:16]}-" for r in runs)


def _check_orphan_segments(
    before: set[str], report: TortureReport, workdir: Path, wait_s: float = 15.0
) -> None:
    """Every kill series over: a lowdiff segment of the series' runs made since it began
    that no live process maps is an orphan (one a per-directory check cannot name: a
    process killed before its descriptor named its segments). Segments of other lowdiff
    jobs on the machine are not the series' own."""
    ours = _runs_under(workdir)
    deadline = time.monotonic() + wait_s
    while True:
        new = _lowdiff_segments() - before - _mapped_segments()
        orphans = sorted(n for n in new if n.startswith(ours))
        if not orphans or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if orphans:
        report.leaked += len(orphans)
        report.fail(f"shared memory that no process maps, left behind: {orphans}")

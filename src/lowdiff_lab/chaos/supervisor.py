"""The supervisor: run one training job to the end through the failures of a schedule.

Call sequence (all in the supervising process)::

    job = Job(name, config, kind="software")               # what to run, how it fails
    result = supervise(job, schedule, launcher, workdir)   # start, kill, restart, ... done
    acc = account(result.attempts, reference_s)            # lowdiff_lab.chaos.accounting

:func:`supervise` starts the training process, follows its JSON-lines events and arms the
next failure of the schedule when the job reports the failure's step (or resumes at or
past it); after the failure's fraction of a reference step it kills the job:

- ``software``: SIGKILL the training process only. Its checkpointing process, and any
  in-memory state (LowDiff+'s replica, Gemini's holder), survive;
- ``hardware``: SIGKILL the training process, its checkpointing process and every holder
  of the directory together, and remove their shared memory
  (:func:`lowdiff_lab.chaos.procs.kill_job`): recovery has to go to disk. The files already
  written stay (the page cache is not dropped).

It then starts the job again on the same directory (it resumes through ``ck.resume()``),
until a process reports its last step and exits cleanly. A failure whose step is never
reached before the job ends is not injected.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import queue
import select
import struct
import termios
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeAlias

from lowdiff_lab.chaos import procs
from lowdiff_lab.chaos.accounting import Attempt
from lowdiff_lab.chaos.launch import ChaosError, Child, Launcher
from lowdiff_lab.chaos.schedule import FailurePoint, FailureSchedule
from lowdiff_lab.machine import wait_gone

KINDS = ("software", "hardware")
"""Failure kinds."""


@dataclass
class Job:
    """One training job of a chaos run.

    Attributes:
        name: Unique name (file names of its config, logs and checkpoint directory).
        config: Training config (:class:`lowdiff_lab.workloads.train.TrainConfig` keys); its
            ``directory`` and ``result_path`` are set by :func:`supervise`.
        kind: Failure kind, one of :data:`KINDS`, or a sequence of them: failure ``i``
            is then of kind ``kind[i % len(kind)]``.
        env: Extra environment of its processes (e.g. ``LOWDIFF_MTBF``).
    """

    name: str
    config: dict[str, Any]
    kind: str | tuple[str, ...] = "software"
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        kinds = (self.kind,) if isinstance(self.kind, str) else tuple(self.kind)
        bad = [k for k in kinds if k not in KINDS]
        if bad or not kinds:
            raise ValueError(f"failure kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    def kind_of(self, failure: int) -> str:
        """The kind of failure number ``failure`` (0-based)."""
        kinds = (self.kind,) if isinstance(self.kind, str) else tuple(self.kind)
        return kinds[failure % len(kinds)]


@dataclass
class JobResult:
    """What :func:`supervise` saw."""

    name: str
    attempts: list[Attempt]
    result: dict[str, Any]
    """The result JSON of the last training process."""
    kills: list[dict[str, Any]] = field(default_factory=list)
    """Per failure: kind, pids killed, shared-memory segments removed, clean-up seconds."""
    not_injected: int = 0
    """Failures of the schedule the job ended before."""
    leftovers_killed: list[int] = field(default_factory=list)
    """Processes still holding the directory after the end, killed."""


_Lines: TypeAlias = "queue.Queue[tuple[float, str] | None]"
"""A training process's stdout lines with the time each was read; None at EOF."""


class _Stdout:
    """A training process's stdout, read on a thread into :attr:`lines` (and a log file).

    The thread reads the pipe only while holding :attr:`_lock`, and queues each complete
    line before letting go of it. :meth:`settle` can thus tell, once the process is
    dead, when everything it printed is queued: the pipe holds no unread byte while the
    lock is held. That does not wait for the end of the stream, which comes only when
    every holder of the pipe has closed it: an orphaned checkpointing process lets go of
    the dead trainer's streams a moment after it, and a launcher (torchrun, a cluster's
    scheduler) restarts a job when its process exits, not when its output ends.
    """

    def __init__(self, stream: IO[str], log_path: Path) -> None:
        self.lines: _Lines = queue.Queue()
        self._fd = stream.fileno()
        self._stream = stream
        self._lock = threading.Lock()
        self._eof = threading.Event()
        self._log = open(log_path, "w")  # noqa: SIM115 -- closed by _pump
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        buf = b""
        poller = select.poll()  # not select(): a descriptor may be numbered past 1023
        poller.register(self._fd, select.POLLIN)
        try:
            while True:
                poller.poll()
                with self._lock:
                    data = os.read(self._fd, 1 << 16)
                    if not data:
                        break
                    *complete, buf = (buf + data).split(b"\n")
                    for raw in complete:
                        self._put(raw + b"\n")
            if buf:
                self._put(buf)  # a line cut short by the kill
        except OSError:
            pass
        finally:
            self.lines.put(None)
            self._eof.set()
            with contextlib.suppress(Exception):
                self._stream.close()
            self._log.close()

    def _put(self, raw: bytes) -> None:
        line = raw.decode("utf-8", errors="replace")
        self.lines.put((time.time(), line))
        self._log.write(line)
        self._log.flush()

    def settle(self, timeout: float) -> None:
        """(the process is dead) Return once every line it printed is in :attr:`lines`:
        the stream ended, or the pipe holds nothing unread (at most ``timeout`` s)."""
        end = time.monotonic() + timeout
        while not self._eof.is_set() and time.monotonic() < end:
            with self._lock:
                try:
                    unread = struct.unpack(
                        "i", fcntl.ioctl(self._fd, termios.FIONREAD, b"\0\0\0\0")
                    )[0]
                except OSError:
                    return  # closed: the stream ended
                if unread == 0:
                    return
            time.sleep(0.0005)


def _stderr_tail(path: Path, n: int = 20) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    return ""


class _Seen:
    """The events of one training process so far."""

    def __init__(self) -> None:
        self.start_t: float | None = None
        self.resumed_t: float | None = None
        self.resumed_step = 0
        self.recovery: dict[str, Any] | None = None
        self.steps: list[tuple[int, float]] = []
        self.close_s = 0.0
        self.done = False

    def add(self, t_recv: float, raw: str) -> dict[str, Any] | None:
        """Take one line of stdout; returns its event (None for anything else)."""
        raw = raw.strip()
        if not raw.startswith("{"):
            return None
        try:
            ev = json.loads(raw)
        except json.JSONDecodeError:
            return None
        if not isinstance(ev, dict) or "event" not in ev:
            return None
        kind = ev["event"]
        if kind == "start":
            self.start_t = t_recv
        elif kind == "resumed":
            self.resumed_t = t_recv
            self.resumed_step = int(ev["step"])
            self.recovery = ev.get("recovery")
        elif kind == "step":
            # the job's own clock (the same wall clock) is exact; the receipt time is late
            self.steps.append((int(ev["step"]), float(ev.get("t", t_recv))))
        elif kind == "done":
            self.close_s = float(ev.get("close_s") or 0.0)
            self.done = True
        return ev


def supervise(
    job: Job,
    schedule: FailureSchedule | None,
    launcher: Launcher,
    workdir: Path,
    *,
    stall_timeout: float = 300.0,
    on_event: Any = None,
) -> JobResult:
    """Run ``job`` to its last step, injecting the failures of ``schedule``.

    Args:
        job: The job.
        schedule: Its failures (None: none).
        launcher: Starts the training processes.
        workdir: Holds ``<name>/`` (checkpoint directory ``ckpt``, configs, logs).
        stall_timeout: Seconds without an event before the job counts as hung.
        on_event: Called with ``(job name, event dict)`` for progress display.

    Raises:
        ChaosError: a training process exited with an error, or hung.
    """
    files = _JobFiles.write(job, workdir)
    points = list(schedule.points) if schedule is not None else []
    tau = schedule.tau_s if schedule is not None else 0.0
    out = JobResult(name=job.name, attempts=[], result={})
    while True:
        n = len(out.attempts)
        failure = len(out.kills)
        launch_t = time.time()
        stderr_path = files.logs / f"attempt{n}.stderr.log"
        child: Child = launcher.launch(files.config, files.home, stderr_path, job.env)
        out_stream = _read_stdout(child, files.logs / f"attempt{n}.stdout.jsonl")
        seen = _Seen()
        try:
            killed_at = _follow(
                job,
                out_stream.lines,
                seen,
                points[failure] if failure < len(points) else None,
                tau,
                stall_timeout,
                stderr_path,
                on_event,
            )
        except BaseException:
            procs.kill_job(child.pid, files.ckdir)
            raise
        if killed_at is not None:
            out.kills.append(
                _inject(job, failure, points[failure], child, files.ckdir, out_stream, seen)
            )
        else:
            code = child.wait(timeout=60)
            if not seen.done or code != 0:
                procs.kill_job(child.pid, files.ckdir)
                raise ChaosError(
                    f"job {job.name!r}: training process exited with {code} "
                    f"(attempt {n}); stderr ({stderr_path}):\n{_stderr_tail(stderr_path)}"
                )
        out.attempts.append(_attempt(job, n, seen, out, launch_t, killed_at, stderr_path))
        if killed_at is None:
            break
    out.not_injected = len(points) - len(out.kills)
    with contextlib.suppress(OSError, ValueError):
        out.result = json.loads(files.result.read_text())
    out.leftovers_killed = _kill_leftovers(files.ckdir)
    return out


@dataclass(frozen=True)
class _JobFiles:
    """Where one job's files go: ``WORKDIR/<name>/``."""

    home: Path
    logs: Path
    ckdir: Path
    """The checkpoint directory."""
    result: Path
    """The result JSON the last training process writes."""
    config: Path
    """The training config every attempt runs."""

    @classmethod
    def write(cls, job: Job, workdir: Path) -> _JobFiles:
        """Make the job's directories and write its config (pointing at them)."""
        home = workdir / job.name
        logs = home / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        ckdir = home / "ckpt"
        result = home / "result.json"
        cfg = dict(job.config, directory=str(ckdir), result_path=str(result))
        config = home / "config.json"
        config.write_text(json.dumps(cfg, indent=1))
        return cls(home, logs, ckdir, result, config)


def _read_stdout(child: Child, log_path: Path) -> _Stdout:
    """Read ``child``'s stdout on a thread into a queue (and a log file)."""
    return _Stdout(child.stdout, log_path)


def _follow(
    job: Job,
    lines: _Lines,
    seen: _Seen,
    point: FailurePoint | None,
    tau: float,
    stall_timeout: float,
    stderr_path: Path,
    on_event: Any,
) -> float | None:
    """Follow one training process's events until it is done, its stdout ends, or the
    failure ``point`` strikes; returns the time it struck (None if it did not).

    The failure is armed when the job reports the failure's step (or resumes at or past
    it) and strikes ``point.frac`` reference steps ``tau`` later; a job that reports its
    last step first is not failed.
    """
    steps_total = int(job.config.get("steps", 0))
    deadline: float | None = None
    while not seen.done:
        now = time.time()
        if deadline is not None and now >= deadline:
            return now
        try:
            item = lines.get(timeout=stall_timeout if deadline is None else deadline - now)
        except queue.Empty:
            if deadline is not None:
                continue
            raise ChaosError(
                f"job {job.name!r}: no event for {stall_timeout:.0f} s; stderr "
                f"({stderr_path}):\n{_stderr_tail(stderr_path)}"
            ) from None
        if item is None:
            return None  # EOF: the process (and whatever held its stdout) is gone
        ev = seen.add(*item)
        if ev is None:
            continue
        if on_event is not None:
            on_event(job.name, ev)
        step = int(ev.get("step") or 0)
        if ev["event"] == "step" and step >= steps_total:
            deadline = None  # the job is through its steps before the failure struck
        elif (
            ev["event"] in ("resumed", "step")
            and deadline is None
            and point is not None
            and step >= point.step
        ):
            ev_t = seen.steps[-1][1] if ev["event"] == "step" else seen.resumed_t
            assert ev_t is not None
            deadline = ev_t + point.frac * tau
    return None


def _inject(
    job: Job,
    failure: int,
    point: FailurePoint,
    child: Child,
    ckdir: Path,
    out_stream: _Stdout,
    seen: _Seen,
) -> dict[str, Any]:
    """Inject failure number ``failure`` (at ``point``) as its kind says: kill the trainer
    or the whole job; returns what the kill did."""
    t0 = time.time()
    kind = job.kind_of(failure)
    rep = procs.kill_job(child.pid, ckdir) if kind == "hardware" else procs.kill_trainer(child.pid)
    with contextlib.suppress(Exception):
        child.wait(timeout=30)
    # what the trainer printed before it died may still be in the pipe
    out_stream.settle(timeout=5.0)
    while True:
        try:
            item = out_stream.lines.get_nowait()
        except queue.Empty:
            break
        if item is None:
            break
        seen.add(*item)
    return {
        "failure": failure,
        "kind": kind,
        "armed_at_step": point.step,
        "pids": rep.pids,
        "segments_removed": rep.segments,
        "kill_s": time.time() - t0,
    }


def _attempt(
    job: Job,
    n: int,
    seen: _Seen,
    out: JobResult,
    launch_t: float,
    killed_at: float | None,
    stderr_path: Path,
) -> Attempt:
    """Attempt ``n`` of the job from the events it reported (``out``: the attempts and
    kills before it, and this one's kill if it was killed)."""
    if seen.start_t is None or seen.resumed_t is None:
        raise ChaosError(
            f"job {job.name!r}: attempt {n} ended before resuming; stderr "
            f"({stderr_path}):\n{_stderr_tail(stderr_path)}"
        )
    # "start" and "resumed" carry no time stamp: they are timed when read, which a busy
    # machine can delay past the job's own stamp of its first step; that step's stamp
    # bounds them (the job printed them before it)
    resumed_t = min(seen.resumed_t, seen.steps[0][1]) if seen.steps else seen.resumed_t
    start_t = min(seen.start_t, resumed_t)
    if out.attempts:
        start_t = max(start_t, out.attempts[-1].end_t)
        resumed_t = max(resumed_t, start_t)
    last = seen.steps[-1][1] if seen.steps else resumed_t
    end_t = max(killed_at, last) if killed_at is not None else last + seen.close_s
    return Attempt(
        start_t=start_t,
        resumed_t=resumed_t,
        resumed_step=seen.resumed_step,
        steps=seen.steps,
        end_t=end_t,
        killed=killed_at is not None,
        launch_t=launch_t,
        kill_t=killed_at,
        kind=out.kills[-1]["kind"] if killed_at is not None else None,
        restore_s=float((seen.recovery or {}).get("total_s") or 0.0) if n > 0 else 0.0,
        recovery=seen.recovery,
        close_s=seen.close_s,
    )


def _kill_leftovers(ckdir: Path) -> list[int]:
    """Kill whatever still holds the directory after the job's end; returns their pids.

    A holder of an earlier trainer that its successor did not stop must not outlive the
    run; it gets a while to exit on its own first.
    """
    left = procs.leftovers(ckdir)
    if left:
        left = wait_gone(left, 15.0)
        if left:
            return procs.kill_job(None, ckdir).pids
    return []


__all__ = ["KINDS", "Job", "JobResult", "supervise"]

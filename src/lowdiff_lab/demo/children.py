"""The demo's training processes: one job of :mod:`lowdiff_lab.workloads.train` at a time,
followed through its JSON-lines events, SIGKILLed when the demo says so.

Call sequence::

    children = Children()                       # everything started, for the clean-up
    run = run_child("a-killed", config, out, env, children, on_event)
    require_ok(run)                             # DemoError with its stderr's tail
    children.kill_all()                         # nothing outlives the demo
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from lowdiff.proc import holder
from lowdiff_lab.demo.settings import DemoError
from lowdiff_lab.prefork import PreforkedProcess, PreforkServer


@dataclass
class ChildRun:
    """What the demo learned from one training process."""

    name: str
    returncode: int | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    killed_at: int | None = None
    durable_at_kill: int | None = None
    stderr_path: Path | None = None

    def last(self, event: str) -> dict[str, Any] | None:
        """The last event of this kind, if any."""
        for ev in reversed(self.events):
            if ev.get("event") == event:
                return ev
        return None


class Children:
    """Starts the children (forks of ``server``, else new interpreters) and tracks every
    one (each leads its own process group) so nothing outlives the demo."""

    def __init__(self, server: PreforkServer | None = None) -> None:
        self.server = server
        self.procs: list[subprocess.Popen[str] | PreforkedProcess] = []

    def close(self) -> None:
        """Stop the fork server (after :meth:`kill_all`)."""
        if self.server is not None:
            self.server.close()

    def kill_all(self, directories: Iterable[Path] = ()) -> None:
        """SIGKILL the group of every child still running or that failed; reap them.
        Then let the checkpointing process a killed trainer left on any of
        ``directories`` persist what it holds and exit (it has a process group of its
        own, and would otherwise wait ``idle_timeout`` for a trainer that never comes)."""
        for proc in self.procs:
            running = proc.poll() is None
            if running or proc.returncode != 0:
                # A cleanly exited trainer left an empty group, so its id is never
                # signalled (it could belong to someone else by now).
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
            if running:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
        for d in directories:
            with contextlib.suppress(Exception):
                if d.is_dir():
                    holder.forget_released(d, holder.release_orphan(d, 10.0))


def _pump(stream: IO[str], sink: queue.Queue[str | None], log: IO[str]) -> None:
    # Runs until every holder of the pipe closed it, which after a SIGKILL includes the
    # orphaned checkpointing process; draining on a thread keeps that from blocking the
    # demo, and the thread owns (and closes) both files.
    try:
        for line in stream:
            log.write(line)
            log.flush()
            sink.put(line)
    finally:
        sink.put(None)
        stream.close()
        log.close()


def run_child(
    name: str,
    config: dict[str, Any],
    workdir: Path,
    env: dict[str, str],
    children: Children,
    on_event: Callable[[dict[str, Any]], bool] | None = None,
    args: Sequence[str] = (),
) -> ChildRun:
    """Run one training job to completion, or until ``on_event`` asks for a SIGKILL.

    Args:
        name: Phase name, used for the config, stdout and stderr file names.
        config: Training config (see :class:`lowdiff_lab.workloads.train.TrainConfig`).
        workdir: Directory for the config and logs.
        env: Child environment.
        children: Registry used to clean up on interruption.
        on_event: Called with every JSON event; returning ``True`` SIGKILLs the child at
            once (the event's ``step`` is recorded as ``killed_at``).
        args: More arguments of ``python -m lowdiff_lab.workloads.train`` (``--probe-recovery DIR``).

    Returns:
        The :class:`ChildRun`; ``returncode`` is ``-SIGKILL`` for a killed child.
    """
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    cfg_path = workdir / f"{name}.config.json"
    cfg_path.write_text(json.dumps(config, indent=1))
    stderr_path = logs / f"{name}.stderr.log"
    run = ChildRun(name=name, stderr_path=stderr_path)
    with open(stderr_path, "w") as err:
        start = subprocess.Popen if children.server is None else children.server.popen
        proc = start(
            [sys.executable, "-m", "lowdiff_lab.workloads.train", "--config", str(cfg_path), *args],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=str(workdir),
            # Own session: a Ctrl-C at the terminal reaches only the demo, which then
            # kills the whole group (trainer and its checkpointing process) itself.
            start_new_session=True,
        )
    children.procs.append(proc)
    assert proc.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()
    out = open(logs / f"{name}.stdout.jsonl", "w")  # noqa: SIM115 - closed by _pump
    pump = threading.Thread(target=_pump, args=(proc.stdout, lines, out), daemon=True)
    pump.start()
    while True:
        line = lines.get()
        if line is None:
            break
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue
        run.events.append(ev)
        if on_event is not None and on_event(ev):
            os.kill(proc.pid, signal.SIGKILL)
            run.killed_at = ev.get("step")
            run.durable_at_kill = ev.get("durable")
            break
    run.returncode = proc.wait()
    if run.killed_at is None:
        # EOF was seen, so the pump is finishing; after a kill it may still be draining
        # what the orphaned checkpointing process prints, and is left to do so.
        pump.join(timeout=30)
    return run


def _stderr_tail(run: ChildRun, n: int = 25) -> str:
    if run.stderr_path is None or not run.stderr_path.exists():
        return ""
    lines = run.stderr_path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-n:])


def require_ok(run: ChildRun) -> None:
    """Raise :class:`DemoError` (with the tail of its stderr) unless ``run`` exited 0."""
    if run.returncode != 0:
        raise DemoError(
            f"training process {run.name!r} exited with {run.returncode}; "
            f"stderr ({run.stderr_path}):\n{_stderr_tail(run)}"
        )


__all__ = ["ChildRun", "Children", "require_ok", "run_child"]

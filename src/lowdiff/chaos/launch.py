"""Starting training processes: a fresh interpreter each time, or forks of a warm one.

Both launchers run the same job, :func:`lowdiff.workloads.train.main` with a config file,
as a process of its own (its own session, so that a signal meant for the supervisor
never reaches it), with its stdout (the JSON-lines events) on a pipe the supervisor
reads and its stderr in a log file.

- :class:`ExecLauncher` runs ``python -m lowdiff.workloads.train --config CONFIG``: every
  restart pays the interpreter start and the imports of torch and transformers (several
  seconds on a small CPU machine, the same for every strategy).
- :class:`ForkLauncher` forks each process from a server that imported all of that once
  (:mod:`lowdiff.chaos.zygote`): a restart then costs what the job itself does at a
  restart (model build, the checkpointer's ``resume()``, its background processes).
  ``preload_s`` says what the import would have cost.

Call sequence::

    with ForkLauncher(env) as launcher:          # starts the server (imports once)
        child = launcher.launch(config, cwd, stderr_path, env_extra)
        for line in child.stdout: ...            # events until EOF
        child.wait()                             # exit code; -9 after a SIGKILL
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Protocol

from lowdiff.harness import child_env


class ChaosError(RuntimeError):
    """The chaos run could not go on: a training process failed, hung, or did not start."""


class Child(Protocol):
    """A running training process."""

    pid: int
    stdout: IO[str]

    def poll(self) -> int | None:
        """The exit code, or None while it runs."""
        ...

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit code (``-N`` if killed by signal ``N``)."""
        ...


class Launcher(Protocol):
    """Starts training processes (see the module docstring)."""

    name: str

    def launch(
        self, config: Path, cwd: Path, stderr_path: Path, env_extra: dict[str, str]
    ) -> Child: ...

    def close(self) -> None: ...


class ExecLauncher:
    """A fresh ``python -m lowdiff.workloads.train`` per process."""

    name = "exec"

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.preload_s: float | None = None

    def launch(
        self, config: Path, cwd: Path, stderr_path: Path, env_extra: dict[str, str]
    ) -> Child:
        with open(stderr_path, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "lowdiff.workloads.train", "--config", str(config)],
                stdout=subprocess.PIPE,
                stderr=err,
                stdin=subprocess.DEVNULL,
                text=True,
                env={**self.env, **env_extra},
                cwd=str(cwd),
                start_new_session=True,
            )
        return proc  # type: ignore[return-value]  # Popen has pid, stdout, poll, wait

    def close(self) -> None:
        pass

    def __enter__(self) -> ExecLauncher:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class _Forked:
    """A process of the fork server."""

    def __init__(self, launcher: ForkLauncher, pid: int, stdout: IO[str]) -> None:
        self._launcher = launcher
        self.pid = pid
        self.stdout = stdout

    def poll(self) -> int | None:
        return self._launcher.exit_code(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            code = self.poll()
            if code is not None:
                return code
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.005)


class ForkLauncher:
    """Forks training processes from a warm server (see :mod:`lowdiff.chaos.zygote`).

    Args:
        env: Environment of the server (and so of every process it forks).
        log_path: The server's own stderr.
        start_timeout: Seconds to wait for the server's imports.
    """

    name = "fork"

    def __init__(self, env: dict[str, str], log_path: Path, start_timeout: float = 300.0) -> None:
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log = open(log_path, "w")  # noqa: SIM115 -- closed by close()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "lowdiff.chaos.zygote", str(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=self._log,
                env=env,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
        finally:
            theirs.close()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._replies: dict[int, int] = {}
        self._exits: dict[int, int] = {}
        self._next_id = 0
        self._closed = False
        ready = self._recv(start_timeout)
        if ready is None or "ready" not in ready:
            self.close()
            raise ChaosError(f"the fork server did not start (see {log_path})")
        self.preload_s: float | None = float(ready["preload_s"])
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _recv(self, timeout: float) -> dict[str, Any] | None:
        r, _, _ = select.select([self._sock], [], [], timeout)
        if not r:
            return None
        msg = self._sock.recv(1 << 16)
        return json.loads(msg) if msg else None

    def _read(self) -> None:
        while True:
            try:
                msg = self._sock.recv(1 << 16)
            except OSError:
                msg = b""
            with self._cond:
                if not msg:
                    self._closed = True
                    self._cond.notify_all()
                    return
                obj = json.loads(msg)
                if "exit" in obj:
                    self._exits[int(obj["exit"])] = int(obj["code"])
                else:
                    self._replies[int(obj["id"])] = int(obj["pid"])
                self._cond.notify_all()

    def exit_code(self, pid: int) -> int | None:
        """The exit code of forked process ``pid``, or None while it runs."""
        with self._lock:
            if pid in self._exits:
                return self._exits[pid]
            if self._closed:
                return -signal.SIGKILL  # the server is gone: nothing will report the exit
            return None

    def launch(
        self, config: Path, cwd: Path, stderr_path: Path, env_extra: dict[str, str]
    ) -> Child:
        r, w = os.pipe()
        err = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        with self._cond:
            rid = self._next_id
            self._next_id += 1
        try:
            req = {"id": rid, "config": str(config), "cwd": str(cwd), "env": env_extra}
            socket.send_fds(self._sock, [json.dumps(req).encode()], [w, err])
        finally:
            os.close(w)
            os.close(err)
        with self._cond:
            ok = self._cond.wait_for(lambda: rid in self._replies or self._closed, timeout=60)
            if not ok or rid not in self._replies:
                os.close(r)
                raise ChaosError("the fork server did not start a training process")
            pid = self._replies.pop(rid)
        return _Forked(self, pid, os.fdopen(r, "r"))

    def close(self) -> None:
        # shutdown() first: a recv() blocked in the reader thread would otherwise keep the
        # socket open, and the server would never see the end of it
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._log.close()

    def __enter__(self) -> ForkLauncher:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


LAUNCHERS = ("fork", "exec")


def make_launcher(name: str, env: dict[str, str], workdir: Path) -> ExecLauncher | ForkLauncher:
    """The launcher called ``name`` (one of :data:`LAUNCHERS`)."""
    if name == "fork":
        return ForkLauncher(env, workdir / "fork-server.log")
    if name == "exec":
        return ExecLauncher(env)
    raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}, got {name!r}")


__all__ = [
    "LAUNCHERS",
    "ChaosError",
    "Child",
    "ExecLauncher",
    "ForkLauncher",
    "Launcher",
    "child_env",
    "make_launcher",
]

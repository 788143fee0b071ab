"""Starting training processes: a fresh interpreter each time, or forks of a warm one.

Both launchers run the same job, :func:`lowdiff_lab.workloads.train.main` with a config file,
as a process of its own (its own session, so that a signal meant for the supervisor
never reaches it), with its stdout (the JSON-lines events) on a pipe the supervisor
reads and its stderr in a log file.

- :class:`ExecLauncher` runs ``python -m lowdiff_lab.workloads.train --config CONFIG``: every
  restart pays the interpreter start and the imports of torch and transformers (several
  seconds on a small CPU machine, the same for every strategy).
- :class:`ForkLauncher` forks each process from a server that imported all of that once
  (:mod:`lowdiff_lab.prefork`): a restart then costs what the job itself does at a
  restart (model build, the checkpointer's ``resume()``, its background processes).
  ``preload_s`` says what the import would have cost.

Call sequence::

    with ForkLauncher(env) as launcher:          # starts the server (imports once)
        child = launcher.launch(config, cwd, stderr_path, env_extra)
        for line in child.stdout: ...            # events until EOF
        child.wait()                             # exit code; -9 after a SIGKILL
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import TracebackType
from typing import IO, Protocol

from lowdiff_lab.harness import child_env
from lowdiff_lab.prefork import PreforkError, PreforkServer
from lowdiff_lab.workloads.train import PRELOAD


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
    """A fresh ``python -m lowdiff_lab.workloads.train`` per process."""

    name = "exec"

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.preload_s: float | None = None

    def launch(
        self, config: Path, cwd: Path, stderr_path: Path, env_extra: dict[str, str]
    ) -> Child:
        with open(stderr_path, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "lowdiff_lab.workloads.train", "--config", str(config)],
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


class ForkLauncher:
    """Forks training processes from a warm server (see :mod:`lowdiff_lab.prefork`).

    Args:
        env: Environment of the server (and so of every process it forks).
        log_path: The server's own stderr.
        start_timeout: Seconds to wait for the server's imports.
    """

    name = "fork"

    def __init__(self, env: dict[str, str], log_path: Path, start_timeout: float = 300.0) -> None:
        self.env = env
        try:
            self._server = PreforkServer(
                PRELOAD, env=env, log_path=log_path, start_timeout=start_timeout
            )
        except PreforkError as e:
            raise ChaosError(str(e)) from e
        self.preload_s: float | None = self._server.preload_s

    def launch(
        self, config: Path, cwd: Path, stderr_path: Path, env_extra: dict[str, str]
    ) -> Child:
        with open(stderr_path, "w") as err:
            try:
                return self._server.popen(  # type: ignore[return-value]  # has pid, stdout, poll, wait
                    [sys.executable, "-m", "lowdiff_lab.workloads.train", "--config", str(config)],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                    env={**self.env, **env_extra},
                    cwd=cwd,
                )
            except PreforkError as e:
                raise ChaosError(str(e)) from e

    def close(self) -> None:
        self._server.close()

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

"""Starting lowdiff's background processes.

Every background process lowdiff starts (the checkpointing process, a LowDiff+ replica,
the baselines' persist and holder processes) starts with multiprocessing's
``forkserver`` method (:func:`process_context`): one server process per trainer forks
each new process. By default the server is itself a fork of the trainer, taken when the
first process is needed and cleaned of what it could carry over (descriptors, locks,
signal handlers, thread pools: :mod:`lowdiff.proc.server`), so a new process costs two
forks and holds torch, lowdiff and the trainer's main module from the start
(``docs/benchmarks.md``, "Starting a background process", has the figures). The
trainer's environment is handed to each new process as it is when the process starts
(:func:`run_in_env`). The harness's own child processes use plain ``spawn``
(:func:`spawn_context`).

With ``LOWDIFF_PROCESS_START=interpreter`` the server is a new interpreter that imports
torch once (:data:`PRELOAD`) and touches no device and no thread pool. Then, as with
``spawn``, each new process runs the main script again (as the module ``__mp_main__``)
before it calls the process's target, so:

- the script must keep its training under ``if __name__ == "__main__":``. Without the
  guard the new process would start training too; :func:`refuse_in_bootstrap` stops that
  at the first ``Checkpointer`` with an error that says so, and the trainer's error for a
  process that exited before it was ready says the same (:func:`exit_message`).

Either way the main script must be a file (or absent): a script piped into ``python -``
is refused before anything starts (:func:`spawn_context`), since multiprocessing asks
each new process to run it again. ``python -c``, ``python -m`` and notebooks are fine.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing import forkserver, resource_tracker
from multiprocessing import process as mp_process
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as tmp

from lowdiff.errors import LowDiffError
from lowdiff.format import atomic
from lowdiff.proc import server

GUARD_HINT = (
    'lowdiff starts its background processes with multiprocessing\'s "spawn" method, which '
    "runs the main script{where} again in each new process: keep the script's training under "
    '`if __name__ == "__main__":`'
)


def _main_script() -> str | None:
    """The file ``spawn`` runs again in a new process, or None when it runs none."""
    main = sys.modules.get("__main__")
    if main is None or getattr(getattr(main, "__spec__", None), "name", None) is not None:
        return None  # python -m: the new process imports the module by name
    path = getattr(main, "__file__", None)
    if path is None:
        return None  # python -c, a notebook: nothing to run again
    path = str(path)
    origin = getattr(mp.process, "ORIGINAL_DIR", None)  # where spawn resolves a relative path
    if not os.path.isabs(path) and origin is not None:
        path = os.path.join(origin, path)
    return path


def guard_hint() -> str:
    """The reminder about the ``__main__`` guard, naming this process's main script."""
    path = _main_script()
    return GUARD_HINT.format(where="" if path is None else f" ({path})")


def check_main_script(how: str = "multiprocessing's spawn method") -> None:
    """Refuse a main script that a new process could not import (see :func:`spawn_context`).

    Raises:
        LowDiffError: If the main script is not a file (a script piped into ``python -``),
            naming ``how`` the background processes are started.
    """
    path = _main_script()
    if path is not None and not os.path.isfile(path):
        raise LowDiffError(
            f"the main script {path!r} is not a file: lowdiff starts its background "
            f"processes with {how}, which imports the main script again in each new "
            "process. Save the training script to a file and run that (with its "
            'training under `if __name__ == "__main__":`), or use `python -c` or a notebook.'
        )


def spawn_context() -> Any:
    """``torch.multiprocessing``'s spawn context, once the new process can run the main script.

    Raises:
        LowDiffError: If the main script is not a file (a script piped into ``python -``):
            spawn could not run it again, and the new process would die at once.
    """
    check_main_script()
    return tmp.get_context("spawn")


PRELOAD = ("torch",)
"""What the fork server imports once, before it forks any process: torch (most of an
interpreter's start), and nothing that reads the environment at import."""


def process_context() -> Any:
    """The context lowdiff's background processes start in: ``forkserver``, its server
    running (see the module docstring and :mod:`lowdiff.proc.server`).

    Raises:
        LowDiffError: If the main script is not a file (see :func:`check_main_script`).
        ValueError: If ``LOWDIFF_PROCESS_START`` holds no known start method.
    """
    check_main_script("multiprocessing's forkserver method (a server lowdiff forks them from)")
    ctx = tmp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    server.ensure_running()
    return ctx


def forget_child(process: Any) -> None:
    """Take ``process`` off the children this interpreter joins at its exit.

    ``multiprocessing`` joins every non-daemon process it started when the interpreter
    exits. A checkpointing process left running for the next trainer (a rank of a failed
    job, or a trainer dropped without ``close()``) waits up to its idle timeout for that
    trainer: joining it would hold the exiting rank that long, while the job's other
    ranks wait for it and its launcher sees no failure. lowdiff joins its processes
    itself where it stops them.
    """
    children = getattr(mp_process, "_children", None)
    if process is not None and isinstance(children, set):
        children.discard(process)  # one taken over from a previous trainer is not in it


def _forget_inherited_server() -> None:
    """In a process forked from a trainer: forget the trainer's fork server.

    The server is the trainer's child, not this process's, so multiprocessing's check
    of it (``waitpid``) would fail, and a request would reach a server whose processes
    report to the trainer. The fork starts its own server when it needs one; its copy of
    the descriptor that keeps the trainer's server alive is closed.
    """
    fs: Any = forkserver._forkserver
    if getattr(fs, "_forkserver_pid", None) is None:
        return
    _close_server_alive_fd()
    fs._forkserver_address = None
    fs._forkserver_pid = None
    fs._inherited_fds = None
    fs._lock = threading.Lock()


def _close_server_alive_fd() -> None:
    """Close this process's copy of the descriptor that keeps a fork server running (the
    server exits once no process holds it)."""
    fs: Any = forkserver._forkserver
    alive = getattr(fs, "_forkserver_alive_fd", None)
    if alive is not None:
        with contextlib.suppress(OSError):
            os.close(alive)
    fs._forkserver_alive_fd = None


os.register_at_fork(after_in_child=_forget_inherited_server)


def warm_up() -> None:
    """Start the fork server now (if it is not running), so that its import of torch
    overlaps the trainer's own work (building the model, reading a checkpoint) instead of
    delaying the first background process. A main script that cannot be run again is
    left for the start itself to refuse."""
    with contextlib.suppress(LowDiffError):
        process_context()


def trainer_env() -> dict[str, str]:
    """The environment a background process takes from this trainer (see :func:`run_in_env`)."""
    return dict(os.environ, **{atomic.PARENT_ENV: str(os.getpid())})


def use_env(env: dict[str, str]) -> None:
    """Take ``env`` (a trainer's :func:`trainer_env`) as this process's environment: when
    the process starts, and again when a new trainer takes it over."""
    os.environ.clear()
    os.environ.update(env)
    atomic.install_env_hooks()  # read at import, which ran with another environment


def run_in_env(env: dict[str, str], target: Callable[..., None], *args: Any) -> None:
    """Run ``target(*args)`` with the trainer's environment ``env`` (a process forked by
    the server would otherwise see the server's, taken when the server started)."""
    use_env(env)
    target(*args)


def refuse_in_bootstrap(what: str) -> None:
    """Raise if this process is a spawned child still running the main script again.

    That happens when the training script has no ``__main__`` guard: the new background
    process would otherwise train (and take the checkpoint directory) itself.
    """
    if getattr(mp.current_process(), "_inheriting", False):
        raise LowDiffError(
            f"{what} was created while a new process started by spawn was running the main "
            f"script again, before its own work: {guard_hint()}"
        )


def exit_message(what: str, proc: Any, *, ready: bool) -> str:
    """The message for a background process ``proc`` that exited without reporting an
    error: before it reported ready (with the usual cause), or later."""
    if ready:
        # a process this trainer did not start (a holder it attached to) has no exit
        # code it can read
        code = "" if proc.exitcode is None else f" (exit code {proc.exitcode})"
        return f"{what} (pid {proc.pid}) exited unexpectedly{code} without reporting an error"
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            by = signal.Signals(-code).name
        except ValueError:
            by = f"signal {-code}"
        return (
            f"{what} (pid {proc.pid}) was killed by {by} while starting, before it was "
            "ready: something outside lowdiff ended it (a kill, the out-of-memory killer, "
            "a job scheduler)"
        )
    message = (
        f"{what} (pid {proc.pid}) exited with code {code} while starting, before it was "
        "ready; its own error, if any, is on standard error."
    )
    with contextlib.suppress(ValueError):
        if server.start_method() == "interpreter":  # it ran the main script again
            message += f" The usual cause: {guard_hint()}"
    return message


WORKER_NICE = 10
"""How much lower than the trainer's the priority of the checkpointing process is, LowDiff's
and LowDiff+'s (``os.nice``; see :mod:`lowdiff.engine.writer.main` and :mod:`lowdiff.engine.replica.main`)."""


def release_trainer_stdio(log: Path) -> None:
    """Let go of the trainer's standard streams, in a background process that outlives it.

    A launcher that captures the trainer's output (``subprocess.run(capture_output=True)``,
    a CI runner, a scheduler) sees the trainer end only when every holder of its pipes has
    closed them: a survivor that kept them would hold the launcher until the survivor
    exits. From here on this process writes to ``log`` (appended; ``/dev/null`` if it
    cannot be opened) and reads nothing. It also lets go of the fork server and of
    multiprocessing's resource tracker, which the trainer started with the same streams
    and which run while any process holds their pipes (lowdiff's own shared memory is
    not registered with the tracker).
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    try:
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:
        out = os.open(os.devnull, os.O_WRONLY)
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
    finally:
        os.close(out)
        os.close(null)
    # a process forked by the server holds what keeps the server (started by the trainer,
    # with its streams) running, so that it could start processes of its own: let it go
    _close_server_alive_fd()
    tracker: Any = resource_tracker._resource_tracker
    fd = getattr(tracker, "_fd", None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        tracker._fd = tracker._pid = None  # started again if this process needs one


def _no_cuda() -> bool:
    return False


def without_gpu() -> None:
    """Tell torch in this process that it has no GPU (``torch.cuda.is_available()`` is
    False from now on).

    A checkpointing process works on host memory only, and one forked from a trainer
    that had initialised CUDA cannot use the GPU at all: every CUDA call fails with
    "CUDA error: initialization error". Yet ``torch.optim``'s ``step()`` asks the
    current CUDA stream whether a graph capture is under way whenever CUDA is
    available, even for an optimizer over CPU tensors, so without this the LowDiff+
    replica's first step would fail in the fork of a GPU trainer. Called by
    :func:`detach_from_trainer_group`, first thing in every checkpointing process.
    """
    torch.cuda.is_available = _no_cuda  # type: ignore[assignment]


def detach_from_trainer_group() -> None:
    """Leave the trainer's process group.

    Launchers such as torchrun stop a worker by signalling its whole process group; the
    checkpointing process must outlive its trainer to write what it was handed (and, for
    LowDiff+, to keep the replica for a restarted trainer), so it takes a group of its
    own. It still ends by itself: on its trainer's death it writes what it was sent and
    waits ``idle_timeout`` for a new trainer to take it over (LowDiff's writer and
    LowDiff+'s replica alike), then exits. It also never touches the GPU
    (:func:`without_gpu`).
    """
    without_gpu()
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)

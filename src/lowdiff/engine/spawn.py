"""Starting lowdiff's background processes with multiprocessing's ``spawn`` method.

Every background process lowdiff starts (the checkpointing process, a LowDiff+ replica,
the baselines' persist and holder processes) is started with ``spawn``: a fresh
interpreter, never a fork of a trainer that may hold CUDA contexts, OpenMP thread pools
or locks taken by other threads. ``spawn`` runs the main script again in the new process
(as the module ``__mp_main__``) before it calls the process's target, so:

- the script must keep its training under ``if __name__ == "__main__":``. Without the
  guard the new process would start training too; :func:`refuse_in_bootstrap` stops that
  at the first ``Checkpointer`` with an error that says so, and the trainer's error for a
  process that exited before it was ready says the same (:func:`exit_message`);
- the main script must be a file the new process can read. A script piped into
  ``python -`` is not: :func:`spawn_context` refuses it before anything starts.
  ``python -c``, ``python -m`` and notebooks are fine (no file is run again).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from typing import Any

import torch.multiprocessing as tmp

from lowdiff.errors import LowDiffError

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


def spawn_context() -> Any:
    """``torch.multiprocessing``'s spawn context, once the new process can run the main script.

    Raises:
        LowDiffError: If the main script is not a file (a script piped into ``python -``):
            spawn could not run it again, and the new process would die at once.
    """
    path = _main_script()
    if path is not None and not os.path.isfile(path):
        raise LowDiffError(
            f"the main script {path!r} is not a file: lowdiff starts its background "
            "processes with multiprocessing's spawn method, which runs the main script again "
            "in each new process. Save the training script to a file and run that (with its "
            'training under `if __name__ == "__main__":`), or use `python -c` or a notebook.'
        )
    return tmp.get_context("spawn")


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
        return (
            f"{what} (pid {proc.pid}) exited unexpectedly (exit code {proc.exitcode}) "
            "without reporting an error"
        )
    return (
        f"{what} (pid {proc.pid}) exited with code {proc.exitcode} while starting, before "
        f"it was ready; its own error, if any, is on standard error. The usual cause: "
        f"{guard_hint()}"
    )

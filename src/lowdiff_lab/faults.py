"""Fault injection for tests and ``lowdiff torture``: a small language over the
library's hook points (:data:`lowdiff.format.atomic.FAULT_POINTS`).

``LOWDIFF_FAULTS="point:kind:nth:action[,...]"`` names the faults; a process installs
them when :data:`lowdiff.format.atomic.HOOKS_ENV` names :func:`install_env_faults`
(:func:`fault_env` sets both), at import and again in each background process once it
has the trainer's environment.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from lowdiff.errors import InvalidArgumentError
from lowdiff.format import atomic
from lowdiff.format.atomic import FAULT_POINTS, HOOKS_ENV, TMP_PREFIX

INSTALLER = "lowdiff_lab.faults:install_env_faults"
"""What :data:`lowdiff.format.atomic.HOOKS_ENV` names to install ``LOWDIFF_FAULTS``."""

FAULT_KINDS = ("records", "full", "manifest", "any")
FAULT_ACTIONS = ("kill-self", "kill-parent", "kill-both", "enospc", "eio", "slow")
FAULT_ENV = "LOWDIFF_FAULTS"
SLOW_ENV = "LOWDIFF_FAULT_SLOW_S"
"""Seconds the ``slow`` action sleeps (a disk that stalls; default 2)."""
MARK_ENV = "LOWDIFF_FAULT_MARK"
"""A file the ``slow`` action creates before it sleeps: a test knows the process is
inside the stalled step (and can act while it is there)."""



def file_kind(path: Path) -> str:
    """``"records"``, ``"full"`` or ``"manifest"`` for lowdiff's files, else ``"other"``."""
    name = path.name
    if name == "lowdiff.json" or name.startswith(f"{TMP_PREFIX}lowdiff.json"):
        return "manifest"
    if path.parent.name in ("records", "full"):
        return path.parent.name
    return "other"


class _Fault:
    """Fires ``action`` at the ``nth`` time ``point`` is reached for a file of ``kind``."""

    def __init__(self, point: str, kind: str, nth: int, action: str) -> None:
        self.point, self.kind, self.nth, self.action = point, kind, nth, action
        self.seen = 0

    def __call__(self, path: Path) -> None:
        if self.kind != "any" and file_kind(path) != self.kind:
            return
        self.seen += 1
        if self.seen != self.nth:
            return
        if self.action in ("kill-parent", "kill-both"):
            os.kill(atomic.parent_pid(), signal.SIGKILL)
        if self.action in ("kill-self", "kill-both"):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.action == "slow":
            mark = os.environ.get(MARK_ENV)
            if mark:
                Path(mark).touch()
            time.sleep(float(os.environ.get(SLOW_ENV, "2")))
        if self.action in ("enospc", "eio"):
            code = errno.ENOSPC if self.action == "enospc" else errno.EIO
            raise OSError(code, os.strerror(code), str(path))


def parse_faults(spec: str) -> dict[str, Callable[[Path], None]]:
    """Parse ``"point:kind:nth:action[,...]"`` into hooks (one per point).

    ``point`` is one of :data:`FAULT_POINTS`, ``kind`` one of :data:`FAULT_KINDS`,
    ``nth`` counts matching events from 1, and ``action`` is one of :data:`FAULT_ACTIONS`:
    SIGKILL this process, its parent or both, fail with ``ENOSPC`` / ``EIO``, or stall
    (``slow``: create the file ``LOWDIFF_FAULT_MARK`` names, if set, sleep
    ``LOWDIFF_FAULT_SLOW_S`` seconds, default 2, then go on).

    Example:
        >>> sorted(parse_faults("before_rename:records:2:kill-self"))
        ['before_rename']
    """
    hooks: dict[str, Callable[[Path], None]] = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        parts = item.split(":")
        if len(parts) != 4:
            raise InvalidArgumentError(f"fault {item!r} is not point:kind:nth:action")
        point, kind, nth, action = parts
        if point not in FAULT_POINTS or kind not in FAULT_KINDS or action not in FAULT_ACTIONS:
            raise InvalidArgumentError(
                f"fault {item!r}: point must be one of {FAULT_POINTS}, kind one of "
                f"{FAULT_KINDS}, action one of {FAULT_ACTIONS}"
            )
        if not nth.isdigit() or int(nth) < 1:
            raise InvalidArgumentError(f"fault {item!r}: nth must be a positive integer")
        hooks[point] = _Fault(point, kind, int(nth), action)
    return hooks


def install_faults(spec: str) -> None:
    """Replace every installed hook by the faults of ``spec`` (see :func:`parse_faults`)."""
    atomic.replace_hooks(parse_faults(spec))


def install_env_faults() -> None:
    """Install exactly the faults ``LOWDIFF_FAULTS`` names (none when it is unset): at
    import, and again in a background process once it has the trainer's environment
    (:func:`lowdiff.proc.spawn.run_in_env`)."""
    install_faults(os.environ.get(FAULT_ENV, ""))


def fault_env(spec: str) -> dict[str, str]:
    """The environment entries that install the faults of ``spec`` in a process."""
    return {FAULT_ENV: spec, HOOKS_ENV: INSTALLER}


# the lab's processes (torture, its trainers, their checkpointing processes) install the
# faults LOWDIFF_FAULTS names: they inherit this
os.environ.setdefault(HOOKS_ENV, INSTALLER)

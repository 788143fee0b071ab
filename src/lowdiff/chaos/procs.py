"""Find, freeze and kill the processes of one training job; remove their shared memory.

A *software* failure kills the training process alone. A *hardware* failure takes the
whole job with it: the trainer, its checkpointing process (LowDiff's writer, CheckFreq's
persist process, DCP's saver), any holder of in-memory state (LowDiff+'s replica,
Gemini's holder, possibly left over from an earlier trainer of the same directory), and
the shared memory they keep. The job's processes are found two ways, since a
checkpointing process leaves its trainer's process group and outlives it:

- the process tree under the trainer (``/proc/*/stat`` parent links);
- every process of this user with a file of the checkpoint directory open (the
  directory lock, the writer lock that every checkpointing process and holder keeps).

Every process found is stopped (SIGSTOP) first, so that none of them can write a last
file or spawn another process while the set is being completed, then all are killed
together (SIGKILL). The shared-memory segments to remove are the ``/dev/shm`` files those
processes had mapped or open, plus the segments of the descriptor's run.

Only processes of this user that belong to the job are ever signalled, and only
``/dev/shm`` files owned by this user are removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

SHM_DIR = Path("/dev/shm")
DESCRIPTOR = ".lowdiff.replica.json"
"""The replica/holder descriptor of LowDiff+ and Gemini (see :mod:`lowdiff.engine.replica`)."""


def _stat_fields(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid``, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name is in parentheses and may hold spaces: parse after the last ')'
    rest = raw[raw.rfind(")") + 2 :].split()
    try:
        return rest[0], int(rest[1])
    except (IndexError, ValueError):
        return None


def _own_pids() -> list[int]:
    uid = os.getuid()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid == uid:
                out.append(int(name))
        except OSError:
            continue
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    f = _stat_fields(pid)
    return f is not None and f[0] not in ("Z", "X")


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` in the process tree (not ``pid`` itself)."""
    children: dict[int, list[int]] = {}
    for p in _own_pids():
        f = _stat_fields(p)
        if f is not None:
            children.setdefault(f[1], []).append(p)
    out: set[int] = set()
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return {p for p in out if alive(p)}


def _fd_targets(pid: int) -> list[str]:
    base = f"/proc/{pid}/fd"
    try:
        names = os.listdir(base)
    except OSError:
        return []
    out = []
    for n in names:
        with contextlib.suppress(OSError):
            out.append(os.readlink(f"{base}/{n}"))
    return out


def holders(directory: Path) -> set[int]:
    """Live processes with a file under ``directory`` open (its locks, a file being written).

    A descriptor's pid alone is never trusted: the process it names may be gone and its
    pid reused. Every checkpointing process and holder keeps the directory's writer lock
    open for as long as it lives, which is what finds it.
    """
    root = str(Path(directory).resolve())
    prefix = root + os.sep
    me = os.getpid()
    out = set()
    for pid in _own_pids():
        if pid == me:
            continue
        if any(t == root or t.startswith(prefix) for t in _fd_targets(pid)):
            out.add(pid)
    return {p for p in out if alive(p)}


def _descriptor(directory: Path) -> dict[str, object] | None:
    try:
        d = json.loads((Path(directory) / DESCRIPTOR).read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def shm_segments(pids: set[int]) -> set[str]:
    """Names of the ``/dev/shm`` files that ``pids`` have mapped or open (still linked)."""
    names: set[str] = set()
    prefix = str(SHM_DIR) + os.sep
    for pid in pids:
        paths = list(_fd_targets(pid))
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                parts = line.split(maxsplit=5)
                if len(parts) == 6:
                    paths.append(parts[5])
        for p in paths:
            if p.startswith(prefix) and not p.endswith(" (deleted)"):
                name = p[len(prefix) :]
                if name and os.sep not in name:
                    names.add(name)
    return names


def run_segments(directory: Path) -> set[str]:
    """The segments of the run named by ``directory``'s replica descriptor (any generation)."""
    desc = _descriptor(directory)
    run = desc.get("run_id") if desc else None
    if not isinstance(run, str) or not run:
        return set()
    prefix = f"lowdiff-{run[:16]}-"
    with contextlib.suppress(OSError):
        return {n for n in os.listdir(SHM_DIR) if n.startswith(prefix)}
    return set()


def remove_segments(names: set[str]) -> list[str]:
    """Unlink the named ``/dev/shm`` files this user owns; returns the names removed."""
    removed = []
    uid = os.getuid()
    for name in sorted(names):
        path = SHM_DIR / name
        try:
            if path.stat().st_uid != uid:
                continue
            path.unlink()
        except OSError:
            continue
        removed.append(name)
    return removed


def wait_gone(pids: set[int], timeout: float) -> set[int]:
    """Wait until none of ``pids`` is alive; returns those still alive at the timeout."""
    deadline = time.monotonic() + timeout
    left = {p for p in pids if alive(p)}
    while left and time.monotonic() < deadline:
        time.sleep(0.01)
        left = {p for p in left if alive(p)}
    return left


@dataclass
class KillReport:
    """What one kill did."""

    pids: list[int] = field(default_factory=list)
    """Every process killed (the trainer first)."""
    segments: list[str] = field(default_factory=list)
    """Shared-memory segments removed."""


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def kill_job(trainer: int | None, directory: Path, *, timeout: float = 30.0) -> KillReport:
    """Kill every process of the job at once and remove its shared memory (a hardware failure).

    Args:
        trainer: The training process (its process tree is included), or None.
        directory: The job's checkpoint directory (its holders are included).
        timeout: Seconds to wait for the processes to be gone.
    """
    frozen: set[int] = set()
    for _ in range(20):
        found = set()
        if trainer is not None and alive(trainer):
            found.add(trainer)
        for p in {*frozen, *found}:
            found |= descendants(p)
        found |= holders(directory)
        found.discard(os.getpid())
        new = found - frozen
        if not new:
            break
        for p in new:
            _signal(p, signal.SIGSTOP)
        frozen |= new
    segments = shm_segments(frozen) | run_segments(directory)
    order = ([trainer] if trainer in frozen else []) + sorted(frozen - {trainer})
    for p in order:
        _signal(p, signal.SIGKILL)
    wait_gone(frozen, timeout)
    return KillReport(pids=[p for p in order if p is not None], segments=remove_segments(segments))


def kill_trainer(trainer: int) -> KillReport:
    """SIGKILL the training process alone (a software failure)."""
    _signal(trainer, signal.SIGKILL)
    return KillReport(pids=[trainer])


def leftovers(directory: Path) -> set[int]:
    """Processes still holding the job's directory (after its last trainer exited)."""
    return holders(directory)


__all__ = [
    "KillReport",
    "alive",
    "descendants",
    "holders",
    "kill_job",
    "kill_trainer",
    "leftovers",
    "remove_segments",
    "run_segments",
    "shm_segments",
    "wait_gone",
]

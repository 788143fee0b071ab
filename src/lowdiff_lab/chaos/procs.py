"""Find, freeze and kill the processes of one training job; remove their shared memory.

A *software* failure kills the training process alone. A *hardware* failure takes the
whole job with it: the trainer, its checkpointing process (LowDiff's writer, CheckFreq's
persist process, DCP's saver), any holder of in-memory state (LowDiff+'s replica,
Gemini's holder, possibly left over from an earlier trainer of the same directory), and
the shared memory they keep. The job's processes are found two ways, since a
checkpointing process leaves its trainer's process group and outlives it:

- the process tree under the trainer (parent links, :func:`lowdiff_lab.machine.descendants`);
- every process of this user with a file of the checkpoint directory open (the
  directory lock, the writer lock that every checkpointing process and holder keeps).

Every process found is stopped (SIGSTOP) first, so that none of them can write a last
file or spawn another process while the set is being completed, then all are killed
together (SIGKILL). The shared-memory segments to remove are the ``/dev/shm`` files those
processes had mapped or open, plus the segments of the run that the directory's replica
descriptor names (:func:`lowdiff.proc.holder.read_descriptor`).

Only processes of this user that belong to the job are ever signalled, and only
``/dev/shm`` files owned by this user are removed.
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

from lowdiff.proc.holder import read_descriptor
from lowdiff_lab.machine import alive, descendants, mapped_paths, open_paths, user_pids, wait_gone

SHM_DIR = Path("/dev/shm")


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
    for pid in user_pids():
        if pid == me:
            continue
        if any(t == root or t.startswith(prefix) for t in open_paths(pid)):
            out.add(pid)
    return {p for p in out if alive(p)}


def shm_segments(pids: set[int]) -> set[str]:
    """Names of the ``/dev/shm`` files that ``pids`` have mapped or open (still linked)."""
    names: set[str] = set()
    prefix = str(SHM_DIR) + os.sep
    for pid in pids:
        for p in (*open_paths(pid), *mapped_paths(pid)):
            name = p[len(prefix) :] if p.startswith(prefix) else ""
            # a segment already unlinked keeps its name in a mapping: skip what is gone
            if name and os.sep not in name and (SHM_DIR / name).exists():
                names.add(name)
    return names


def run_segments(directory: Path) -> set[str]:
    """The segments of the run named by ``directory``'s replica descriptor (any generation)."""
    desc = read_descriptor(Path(directory))
    if desc is None or not desc.run_id:
        return set()
    prefix = f"lowdiff-{desc.run_id[:16]}-"
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
    "holders",
    "kill_job",
    "kill_trainer",
    "leftovers",
    "remove_segments",
    "run_segments",
    "shm_segments",
]

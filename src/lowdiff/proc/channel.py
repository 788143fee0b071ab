"""The link between a trainer and its checkpointing process, with no shared lock.

Flow control and progress go through a few int64 counters in shared memory. Each counter
has exactly one writer, the checkpointing process, and only grows; the trainer only reads
them. A process killed at any moment therefore never leaves the other one blocked on a
lock it held (a multiprocessing ``Event`` or ``Condition`` can: its internal lock dies
with its holder), and a killed job leaves no named semaphore behind.

Counters (indices into the shared tensor):

- :data:`SLOTS_DONE`: record (or snapshot) slots the checkpointing process has consumed.
  Slots are used round-robin and consumed in order, so the trainer, which counts the
  slots it has filled, knows which are free.
- :data:`STAGING_DONE`: full-checkpoint stagings released (the staging buffer may be
  written again once this count reaches the number of stagings handed over).
- :data:`BEAT`: bumped whenever the process makes progress (a message handled, a chunk
  of a file written). A waiting trainer tells a slow process (large checkpoint, slow
  disk) from a stuck one by it.
- :data:`DURABLE`: one more than the newest step the process has made durable and
  announced (0: none yet). The trainer reads it whenever it polls, so a record file
  written needs no message of its own.
- :data:`RECORD_FILES`, :data:`RECORDS`, :data:`RECORD_BYTES`, :data:`RECORD_WRITE_NS`:
  record files written, the records in them, their bytes, and the nanoseconds spent
  writing them (``ck.stats`` and the ``"auto"`` planner read them).
- With a remote tier (``remote=``): :data:`REMOTE_DURABLE` (one more than the newest
  step the remote tier can recover), :data:`REMOTE_BEAT` (bumped on every chunk sent and
  every commit: a wait on the remote tells a slow upload from a stuck one by it),
  :data:`REMOTE_FILES`, :data:`REMOTE_BYTES`, :data:`REMOTE_NS` (files committed, their
  bytes, nanoseconds spent uploading) and :data:`REMOTE_ERRORS` (failed attempts). Only
  the process's upload thread writes them.
- LowDiff+: :data:`REPLICA_MERGES` and :data:`REPLICA_MERGE_NS`, the steps merged into
  the replica and the nanoseconds the merges took (``ck.stats``; no message per step).
- :data:`STAGES_TAKEN`: staging buffers the process has taken from the pipe. A staging
  buffer is shared memory that only its living owner can hand over, so until the
  process took it, a crash of the trainer would lose the state staged in it.

Every wait of the trainer (:func:`wait_until`) also watches the process's liveness through
its sentinel and the results pipe: a dead process is an error at once, a live one is
waited for while it makes progress, and only ``stall_timeout`` seconds without progress
end the wait.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as _mp_wait
from typing import Any

import torch

SLOTS_DONE, STAGING_DONE, BEAT, DURABLE = 0, 1, 2, 3
RECORD_FILES, RECORDS, RECORD_BYTES, RECORD_WRITE_NS = 4, 5, 6, 7
REMOTE_DURABLE, REMOTE_BEAT, REMOTE_FILES, REMOTE_BYTES, REMOTE_NS, REMOTE_ERRORS = (
    8,
    9,
    10,
    11,
    12,
    13,
)
REPLICA_MERGES, REPLICA_MERGE_NS = 14, 15
STAGES_TAKEN = 16
PEER_ACKED = 17
"""LowDiff+ with peer copies: one more than the newest step whose copy the other node's
replica holds (0: none yet)."""
N_COUNTERS = 18


def new_counters() -> torch.Tensor:
    """The shared counters, all zero (created by the trainer, passed to the process)."""
    return torch.zeros(N_COUNTERS, dtype=torch.int64).share_memory_()


class Counters:
    """The checkpointing process's side: it alone writes the counters."""

    def __init__(self, t: torch.Tensor) -> None:
        self._t = t
        self._v = [0] * N_COUNTERS
        self._view = t.numpy()  # plain stores: no tensor dispatch on the hot path

    def add(self, i: int, n: int = 1) -> None:
        self._v[i] += n
        self._view[i] = self._v[i]

    def raise_to(self, i: int, v: int) -> None:
        """Set counter ``i`` to ``v`` if that is more (counters only grow)."""
        if v > self._v[i]:
            self._v[i] = v
            self._view[i] = v


def view(t: torch.Tensor) -> Any:
    """The trainer's reading view of the counters (a numpy array over the shared memory)."""
    return t.numpy()


def wait_until(
    ready: Callable[[], bool],
    *,
    proc: Any,
    results: Connection | None,
    progress: Callable[[], int],
    check: Callable[[], None],
    stall_timeout: float,
    what: str,
    deadline: float | None = None,
    who: str = "the checkpointing process",
) -> None:
    """Wait until ``ready()``, watching the checkpointing process.

    ``progress()`` grows whenever the process makes progress (its ``BEAT`` counter, or
    the messages it sent). ``who`` names the process in errors. ``check()`` is called on every wake-up: it reads what the process sent and raises if it
    reported an error or is gone. Raises :class:`lowdiff.CheckpointWorkerError` when the
    process makes no progress for ``stall_timeout`` seconds, or, with ``deadline`` (a
    ``time.monotonic()`` value, for waits on a process that reports no progress, such
    as its start), when that passes.
    """
    from lowdiff.errors import CheckpointWorkerError

    if ready():
        return
    beat = progress()
    since = time.monotonic()
    pause = 0.0002
    handles: list[Any] = [proc.sentinel]
    if results is not None:
        handles.append(results)
    while True:
        check()
        if ready():
            return
        _mp_wait(handles, timeout=pause)
        pause = min(pause * 2, 0.05)
        if ready():
            return
        now = time.monotonic()
        b = progress()
        if b != beat:
            beat, since = b, now
        elif deadline is None and now - since > stall_timeout:
            check()
            raise CheckpointWorkerError(
                f"{who} (pid {proc.pid}) made no progress for "
                f"{stall_timeout:.0f} s while the trainer waited for {what}"
            )
        if deadline is not None and now > deadline:
            check()
            raise CheckpointWorkerError(f"{who} (pid {proc.pid}) did not answer {what} in time")

"""Hand-overs that wait for their device-to-host copy.

On a CUDA trainer a step's record, and a full checkpoint, are copied into shared host
memory on a side stream (:class:`DeviceToHost`), while the next step's work is queued on
the compute stream. The checkpointing process reads that memory as soon as it has the
message that names it, so the message goes only once the copy has ended.
:class:`PendingSends` holds the sends waiting for their copies, in the order they were
handed over, and sends each once its copy's event has completed:

1) :meth:`PendingSends.submit`: a hand-over (its copy's event, or None for a copy
   already done); the sends whose copies ended go, and at most :data:`MAX_LAG` steps
   stay waiting: the oldest is waited for (``synchronize()``) beyond that;
2) :meth:`PendingSends.poll` (each step's start, ``poll``): every send whose copy ended,
   in order, without waiting;
3) :meth:`PendingSends.send_all` (``flush()``, ``close()``, SIGTERM, a full checkpoint
   that needs the staging buffer back, no free record slot): every send, each after its
   copy;
4) :meth:`PendingSends.discard`: the process they were for is gone (a storage error
   suspended checkpointing).

On the CPU every copy is done when it is handed over: each send goes at once.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from lowdiff.engine.trainer.progress import Progress
from lowdiff.proc import preempt

MAX_LAG = 1
"""Steps whose hand-over may still wait for its copy when ``step()`` returns: on a GPU
``ck.acknowledged_step`` trails ``ck.step_count`` by at most this many steps."""


class CopyEvent(Protocol):
    """The end of a copy (a ``torch.cuda.Event``)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclasses.dataclass
class _Pending:
    step: int
    """The step the hand-over makes safe from a crash of the trainer."""
    event: CopyEvent | None
    send: Callable[[], None]


class PendingSends:
    """The sends waiting for their copies (see the module docstring).

    Args:
        max_lag: steps that may stay waiting after :meth:`submit`.
    """

    def __init__(self, max_lag: int = MAX_LAG) -> None:
        self.max_lag = max_lag
        self.progress: Progress | None = None
        """Told each step sent (``acknowledge``) and the time waited at the bound
        (``ack_wait_s``); None: nothing is told."""
        self._queue: collections.deque[_Pending] = collections.deque()

    def __len__(self) -> int:
        return len(self._queue)

    def submit(self, step: int, event: CopyEvent | None, send: Callable[[], None]) -> None:
        """Send ``send`` once ``event`` completed (at once for None with nothing waiting
        before it); ``step`` is the step it hands over."""
        if event is None and not self._queue:
            self._send(step, send)
            return
        with preempt.busy():  # a SIGTERM now must find the step among the waiting ones
            self._queue.append(_Pending(step, event, send))
            self._send_ready()
            while self._queue and self._queue[0].step <= step - self.max_lag:
                self._send_oldest(counted=True)

    def poll(self) -> None:
        """Send, in order, every hand-over whose copy ended (no wait)."""
        if self._queue:
            with preempt.busy():
                self._send_ready()

    def send_all(self) -> None:
        """Send every hand-over, in order, each once its copy ended."""
        if self._queue:
            with preempt.busy():
                while self._queue:
                    self._send_oldest(counted=False)

    def discard(self) -> None:
        """Drop every hand-over waiting, unsent."""
        self._queue.clear()

    def _send_ready(self) -> None:
        queue = self._queue
        while queue and (queue[0].event is None or queue[0].event.query()):
            p = queue.popleft()
            self._send(p.step, p.send)

    def _send_oldest(self, counted: bool) -> None:
        p = self._queue.popleft()
        if p.event is not None:
            t0 = time.perf_counter()
            p.event.synchronize()
            if counted and self.progress is not None:
                self.progress.stats["ack_wait_s"] += time.perf_counter() - t0
        self._send(p.step, p.send)

    def _send(self, step: int, send: Callable[[], None]) -> None:
        send()
        if self.progress is not None:
            self.progress.acknowledge(step)


class DeviceToHost:
    """Copies from one CUDA device into host memory on a side stream of its own.

    Args:
        device: the CUDA device the sources are on.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: Any = None

    def copy(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], non_blocking: bool) -> Any:
        """Copy ``srcs`` into ``dsts`` after the work queued on the compute stream so far;
        the event of the copy's end. Each CUDA source is marked as used by the side stream
        (``record_stream``): its memory is not handed out again before the copy ended,
        whenever it is freed. ``non_blocking`` only into page-locked memory."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        side = self._stream
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            side.wait_event(ready)
            if dsts:
                torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)
            for s in srcs:
                if s.is_cuda:
                    s.record_stream(side)
            done = torch.cuda.Event()
            done.record(side)
        return done


def fresh_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` in new memory of their devices, queued on the current stream:
    what a side stream reads while the compute stream goes on changing the originals."""
    out = [torch.empty_like(t) for t in tensors]
    if out:
        torch._foreach_copy_(out, tensors)
    return out

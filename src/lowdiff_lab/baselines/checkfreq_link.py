"""The trainer's end of CheckFreq's persist process (:mod:`lowdiff_lab.baselines.checkfreq_persist`).

One :class:`~lowdiff.proc.link.ProcessLink` carries the requests; this part keeps what the
process reported: the step in flight, the durable step and the persist statistics. The
trainer waits for the process only while it lives (a persist of any size may take as
long as it needs), so waits have no stall limit.
"""

from __future__ import annotations

import contextlib
import math
import threading
from pathlib import Path

from lowdiff.errors import CheckpointWorkerError
from lowdiff.proc.link import ProcessLink
from lowdiff.proc.protocol import Close, Closed, Message, unexpected
from lowdiff_lab.baselines.checkfreq_persist import CfDone, PersistConfig, persist_main
from lowdiff_lab.baselines.checkfreq_policy import IntervalPolicy

WHAT = "the checkfreq persist process"
"""How errors name the process."""


class PersistLink:
    """The persist process seen from the trainer: requests out, acknowledgements in.

    Args:
        start_timeout: seconds to wait for the process to start, or to exit when stopped.
        policy: told how long each persist took (``"auto"`` measures one).
        stats: the checkpointer's ``stats``; ``persist_s``, ``write_s`` and
            ``bytes_written`` are kept here.
    """

    def __init__(
        self, start_timeout: float, policy: IntervalPolicy, stats: dict[str, float]
    ) -> None:
        self.link = ProcessLink(
            WHAT, stall_timeout=math.inf, start_timeout=start_timeout, on_message=self._on_message
        )
        self.send_lock = threading.Lock()
        """Held around every request: the snapshot thread sends its own."""
        self.policy, self.stats = policy, stats
        self.inflight: int | None = None
        """The step handed over (or being copied) and not yet persisted."""
        self.durable = -1
        self._persist_sum = self._persist_n = 0.0

    def start(self, root: Path, keep_full: int | None) -> None:
        """Spawn the process and wait until it holds the writer lock."""
        self.link.start(
            persist_main, (PersistConfig(str(root), keep_full),), name="lowdiff-checkfreq-persist"
        )

    def send(self, msg: Message) -> None:
        with self.send_lock:
            self.link.send(msg)

    def _on_message(self, msg: Message) -> None:
        match msg:
            case CfDone():
                self.durable = max(self.durable, msg.step)
                if msg.step == self.inflight:
                    self.inflight = None
                self.policy.persisted(msg.step, msg.seconds)
                self._persist_sum += msg.seconds
                self._persist_n += 1
                self.stats["persist_s"] = self._persist_sum / self._persist_n
                self.stats["write_s"] += msg.seconds
                self.stats["bytes_written"] += msg.nbytes
            case Closed():
                pass
            case _:
                raise unexpected(msg)

    def wait_persisted(self) -> None:
        """Wait until the checkpoint in flight is durable (one in flight at most)."""
        if self.inflight is not None:
            self.link.wait(lambda: self.inflight is None, f"the persist of step {self.inflight}")

    def stop(self, timeout: float) -> None:
        """Tell the process to exit; wait ``timeout`` for it, then kill it; drop the pipes."""
        proc = self.link.proc
        if proc is None:
            return
        if proc.is_alive() and self.link.requests is not None:
            # gone already: its error was raised to the caller before
            with contextlib.suppress(CheckpointWorkerError):
                self.send(Close())
        self.link.stop(timeout)

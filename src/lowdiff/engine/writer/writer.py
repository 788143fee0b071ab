"""What LowDiff's writer does with each message: records batched into files, full
checkpoints, the durable step.

:class:`Writer` is driven by :mod:`lowdiff.engine.writer.main` (the process's entry
point and its takeover). Record files name their steps, so recovery reads any mix of
batch sizes; a session's record files never go on disk before the full checkpoint they
chain from.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from lowdiff.engine.process.full_writer import FullWriter
from lowdiff.engine.process.remote import drain, start_uploader
from lowdiff.engine.wire.configs import WriterConfig
from lowdiff.engine.wire.messages import BatchSize, Full, Record, Stage
from lowdiff.errors import InvalidArgumentError, UsageError
from lowdiff.format import layout, sfile
from lowdiff.format.dtypes import dtype_from_name
from lowdiff.proc.channel import (
    BEAT,
    DURABLE,
    RECORD_BYTES,
    RECORD_FILES,
    RECORD_WRITE_NS,
    RECORDS,
    SLOTS_DONE,
    STAGES_TAKEN,
    STAGING_DONE,
    Counters,
)
from lowdiff.proc.child_end import ChildEnd
from lowdiff.proc.protocol import Close, Closed, Flush, Flushed, Message, unexpected
from lowdiff.remote.uploader import Uploader


class Writer:
    """LowDiff's writer: records batched into files, full checkpoints on a thread, and
    the durable step announced (see :mod:`lowdiff.engine.writer.main` for the call
    sequence). Everything here runs on the process's main thread, but :meth:`send`."""

    def __init__(
        self,
        cfg: WriterConfig,
        slots: torch.Tensor,
        counters: Counters,
        end: ChildEnd,
    ) -> None:
        self.cfg = cfg
        self.root = Path(cfg.root)
        self.slots = slots
        self.counters = counters
        self.end = end
        """The link to the trainer served now (a new one after a takeover)."""
        self.batch = torch.empty((cfg.batch_size, cfg.row_bytes), dtype=torch.uint8)
        self.metas: list[str] = []
        self.steps: list[int] = []
        self.staging: torch.Tensor | None = None
        self.uploader: Uploader | None = None
        remote = cfg.remote is not None
        self.full = FullWriter(
            self.root,
            cfg.keep_full,
            self.send,
            announce_durable=True,
            on_released=lambda: self.counters.add(STAGING_DONE),
            progress=lambda _n: self.counters.add(BEAT),
            on_written=self.upload if remote else None,
            protect=self.not_uploaded if remote else None,
        )
        self.durable = -1
        self.acked = -1
        self.resumed: bool | None = None
        """Whether this session continues a recovered state (its first message is a record)
        or starts from a full checkpoint of its own (the first message is a full request)."""
        self.follows: str | None = cfg.follows
        """The run whose state the next record file of a resumed session follows: the
        recovered state's run until this session has written a record file, then its own."""

    def send(self, msg: Message) -> None:
        """To whichever trainer is served now (from any thread)."""
        self.end.send(msg)

    def durable_now(self) -> int:
        """The newest step recoverable from what this writer wrote (-1: none yet)."""
        return max(self.acked, self.full.persisted)

    def start_remote(self) -> None:
        """Start the upload thread (once the writer lock is held: it cleans the remote)."""
        if self.cfg.remote is not None:
            self.uploader = start_uploader(
                self.root, self.cfg.remote, self.cfg.keep_full, lambda: self.counters, self.send
            )

    def upload(self, path: Path) -> None:
        if self.uploader is not None:
            self.uploader.submit(path)

    def not_uploaded(self) -> set[Path]:
        """Files local retention must keep: every file until the upload thread runs."""
        if self.uploader is None:
            return {
                p for d in (layout.FULL_DIR, layout.RECORDS_DIR) for p in (self.root / d).glob("*")
            }
        return self.uploader.protected()

    def drain_remote(self) -> None:
        """Wait for the uploads (``Close``), as long as they make progress within the
        remote's timeout; the trainer sees the remote durable step either way."""
        drain(self.uploader, self.cfg.remote, lambda: self.counters)

    def ack(self) -> None:
        """Announce the newest durable step, once its records chain to a full checkpoint
        on disk: the recovered state, or the first full checkpoint this session writes."""
        step = self.take_ack()
        if step >= 0:
            self.counters.raise_to(DURABLE, step + 1)

    def take_ack(self) -> int:
        """The durable step to announce now, or -1 (see :meth:`ack`)."""
        if self.durable > self.acked and (self.resumed or self.full.persisted >= 0):
            self.acked = self.durable
            return self.acked
        return -1

    # -- records --------------------------------------------------------------------------
    def add_record(self, row: torch.Tensor, step: int, meta: str) -> None:
        if self.steps and step != self.steps[-1] + 1:
            raise UsageError(
                f"record for step {step} arrived after step {self.steps[-1]}: records must be contiguous"
            )
        n = len(self.steps)
        self.batch[n].copy_(row)
        self.steps.append(step)
        self.metas.append(meta)
        if len(self.steps) == len(self.batch):
            self.write_batch()

    def set_batch_size(self, b: int) -> None:
        """Write the partial batch, then batch ``b`` records per file."""
        if b < 1:
            raise InvalidArgumentError(f"batch size must be >= 1, got {b}")
        self.write_batch()
        if b != len(self.batch):
            self.batch = torch.empty((b, self.cfg.row_bytes), dtype=torch.uint8)

    def write_batch(self) -> None:
        if not self.steps:
            return
        if not self.resumed and self.full.persisted < 0:
            # these records chain from this session's first full checkpoint, still being
            # written: no record file goes on disk before it does (a writer killed in
            # between would leave records that nothing can be recovered from, and the
            # directory could not be resumed; with no file but the manifest, resume()
            # starts afresh, as nothing was ever durable)
            self.wait_full()
            if self.full.persisted < 0:
                # it never will be: the trainer died before this process could take the
                # state it staged (handle_orphaned)
                raise UsageError(
                    f"records {self.steps[0]}..{self.steps[-1]} were not written: this "
                    "session's first full checkpoint, which they chain from, could not be "
                    "written (the trainer died before its staged state reached this process)"
                )
        n, first, last = len(self.steps), self.steps[0], self.steps[-1]
        entry = sfile.TensorEntry(
            "records", torch.uint8, (n, self.cfg.row_bytes), 0, n * self.cfg.row_bytes
        )
        meta = {
            "kind": "records",
            "first_step": str(first),
            "last_step": str(last),
            "n_records": str(n),
            "layout_id": self.cfg.layout_id,
            "run_id": self.cfg.run_id,
            "records_meta": "[" + ",".join(self.metas) + "]",
        }
        # lineage (docs/format.md): a session that started from its own full checkpoint
        # follows itself from the start; a resumed one, the recovered state's run first
        follows = self.follows if self.resumed else self.cfg.run_id
        if follows is not None:
            meta["follows"] = follows
        t0 = time.perf_counter()
        path = layout.records_path(self.root, first, last)
        size = sfile.write(path, [entry], self.batch[:n].reshape(-1), meta)
        self.upload(path)
        self.follows = self.cfg.run_id
        took = time.perf_counter() - t0
        self.steps.clear()
        self.metas.clear()
        self.durable = last + 1
        # no message: the trainer reads these counters when it polls
        c = self.counters
        c.add(RECORDS, n)
        c.add(RECORD_BYTES, size)
        c.add(RECORD_WRITE_NS, int(took * 1e9))
        c.add(RECORD_FILES)
        self.ack()

    # -- full checkpoints -------------------------------------------------------------------
    def start_full(self, step: int, entries_json: list[Any], meta: dict[str, str]) -> None:
        self.wait_full()
        if self.staging is None:
            raise UsageError("full checkpoint requested before a staging buffer was sent")
        entries = [
            sfile.TensorEntry(n, dtype_from_name(dt), tuple(shape), a, b)
            for n, dt, shape, a, b in entries_json
        ]
        size = entries[-1].end if entries else 0
        self.full.start(step, entries, self.staging[:size], meta)

    def wait_full(self) -> None:
        self.full.wait()

    # -- dispatch -----------------------------------------------------------------------------
    def handle_orphaned(self, msg: Message) -> bool:
        """:meth:`handle` after the trainer died: a full checkpoint that cannot be written
        (its staging buffer died with the trainer) must not cost the records after it."""
        if isinstance(msg, (Full, Stage)):
            try:
                self.handle(msg)
                self.full.wait()
            except Exception:  # noqa: BLE001 -- the records are what matters now
                self.full.error = None
            return True
        return self.handle(msg)

    def handle(self, msg: Message) -> bool:
        """Handle one message; returns False when the process should stop."""
        if self.full.error is not None:
            self.full.wait()  # a failed full checkpoint is reported on the next step
        if self.resumed is None and isinstance(msg, (Record, Full)):
            self.resumed = isinstance(msg, Record)
        self.ack()
        self.counters.add(BEAT)
        match msg:
            case Record(slot=slot, step=step, meta=meta):
                self.add_record(self.slots[slot], step, meta)
                self.counters.add(SLOTS_DONE)
            case Stage(buffer=buffer):
                self.counters.add(STAGES_TAKEN)
                self.wait_full()
                self.staging = buffer
            case Full(step=step, entries=entries, meta=meta):
                self.start_full(step, entries, meta)
            case BatchSize(b=b):
                self.set_batch_size(int(b))
            case Flush() | Close():
                self.write_batch()
                self.wait_full()
                self.ack()
                durable = self.durable_now()
                if isinstance(msg, Close):
                    self.drain_remote()
                    self.send(Closed(durable))
                    return False
                self.send(Flushed(durable))
            case _:
                raise unexpected(msg)
        return True

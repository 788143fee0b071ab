"""The checkpointing process: receives records and full-checkpoint requests, writes them.

It is started with ``spawn`` by :class:`lowdiff.Checkpointer` and talks to the trainer
over two pipes. The call sequence:

0) (trainer) creates the shared record slots, the shared progress counters
   (:mod:`lowdiff.proc.channel`) and the pipes, starts this process.
1) (checkpointing) takes the directory's writer lock.
2) (trainer, every step) waits for a free slot, writes the record row into it (from a
   device: a copy into the pinned host slot, finished before the message is sent) and
   sends :class:`~lowdiff.engine.messages.Record`. (checkpointing) copies the row into its batch
   buffer, counts the slot as consumed, and after ``batch_size`` records writes them as
   one file.
3) (trainer, every ``full_every`` steps) copies the state into the shared staging
   buffer and sends :class:`~lowdiff.engine.messages.Full`; a thread of this process writes it while records
   keep flowing, then counts the staging buffer as released and applies retention.
4) (trainer) ``Flush`` / ``Close``: write the partial batch, wait for the full
   checkpoint in flight, answer with the durable step. ``close`` also ends the process.
5) (trainer, ``batch_size="auto"``) ``BatchSize(b)``: write the partial batch, then
   batch ``b`` records per file (record files name their steps, so recovery reads any mix).

When the trainer dies without ``close`` (its end of the pipe closes, or this process is
re-parented), the process drains every record already sent, writes them, finishes the
full checkpoint in flight and exits. Every error is sent back to the trainer with its
traceback and raised there on its next call; the full checkpoint in flight is finished
(or its temp file removed) before the error is sent and the process exits.

No lock is shared with the trainer: flow control and progress go through counters in
shared memory that only this process writes, so a process killed at any moment can
never leave the other one blocked (see :mod:`lowdiff.proc.channel`).
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from lowdiff.engine.messages import BatchSize, Durable, Full, FullDone, Record, Stage
from lowdiff.engine.remote_tier import RemoteSettings, drain, start_uploader
from lowdiff.engine.writer_survivor import WriterSurvivor
from lowdiff.errors import InvalidArgumentError, UsageError
from lowdiff.format import layout, sfile
from lowdiff.format.atomic import _hook
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
from lowdiff.proc.child_end import ChildEnd, exits_within, run_checkpointing_process
from lowdiff.proc.protocol import (
    Close,
    Closed,
    Flush,
    Flushed,
    Kind,
    Message,
    unexpected,
)
from lowdiff.remote.uploader import Uploader


@dataclass(frozen=True)
class WorkerConfig:
    root: str
    batch_size: int
    keep_full: int | None
    row_bytes: int
    layout_id: str
    run_id: str
    follows: str | None = None
    """The run that produced the state this session resumed from (``RecoveryStats.
    state_run_id``): the ``follows`` of its first record file. None for a fresh session
    (its first records follow its own step-0 full checkpoint) or an unknown run."""
    remote: RemoteSettings | None = None
    """The remote tier (``remote=``), or None: no upload thread."""
    idle_timeout: float = 0.0
    """Seconds the writer waits for a new trainer after its trainer died
    (:mod:`lowdiff.engine.writer_survivor`); 0: it exits once it wrote what it was sent."""
    trainer_pid: int = 0
    """The trainer served: a trainer that let go of the writer and lives on (a
    Checkpointer dropped without ``close()``) is not waited for."""


def retention(
    root: Path, keep_full: int | None, protect: Callable[[], set[Path]] | None = None
) -> list[Path]:
    """Delete the full checkpoints and records that no recovery can need any more.

    Runs in the checkpointing process after each full checkpoint it publishes, on its own
    directory ``root``. It keeps the newest ``keep_full`` full checkpoints, deletes the
    older ones, and deletes the record files that end before the oldest one kept.

    In a distributed job (``root`` is a shard ``JOB/rank-NNNNN/`` of a directory with a
    job manifest) a shard's newest full checkpoints are of no use on their own: recovery
    starts from a full checkpoint that *every* shard holds. So the oldest step kept is
    never newer than :func:`job_retention_floor`, the newest full checkpoint every shard
    holds: that one, every newer one of this shard and every record file of this shard
    that reaches it or later stay, and a crash of any rank at any moment (one still
    writing, or killed during, its next full checkpoint) leaves a full checkpoint common
    to all shards. A single-process directory is not affected.

    ``keep_full=None`` keeps everything. ``protect()`` names files to keep whatever their
    step (those the remote tier has not committed yet). Returns the deleted paths.

    Example:
        >>> retention(Path("runs/ckpt/rank-00000"), keep_full=1)  # doctest: +SKIP
        [PosixPath('runs/ckpt/rank-00000/full/full-000000000000.safetensors'), ...]
    """
    if keep_full is None:
        return []
    fulls = sorted(_full_steps(root).items())
    if len(fulls) <= keep_full:
        return []
    oldest_kept = fulls[-keep_full][0]
    floor = job_retention_floor(root)
    if floor is not None:
        oldest_kept = min(oldest_kept, floor)
    removed = [p for s, p in fulls if s < oldest_kept]
    for p in (root / layout.RECORDS_DIR).glob("rec-*.safetensors"):
        r = layout.parse_records_name(p.name)
        if r is not None and r[1] < oldest_kept:
            removed.append(p)
    if protect is not None:
        keep = protect()
        removed = [p for p in removed if p not in keep]
    for p in removed:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
        _hook("retention", p)
    return removed


def _full_steps(root: Path) -> dict[int, Path]:
    """The full checkpoints in ``root/full/`` by step, from their names alone."""
    return {
        s: p
        for p in (root / layout.FULL_DIR).glob("full-*.safetensors")
        if (s := layout.parse_full_name(p.name)) is not None
    }


def job_world_size(shard: Path) -> int | None:
    """The world size of the distributed job ``shard`` belongs to, or None.

    ``shard`` belongs to a job when its parent holds a readable job manifest (see
    :func:`lowdiff.recovery.job.is_job_dir`) and ``shard`` is one of the job's rank
    directories.
    """
    # imported here: the dist layer sits above this module
    from lowdiff.ddp.context import rank_dir
    from lowdiff.errors import CorruptCheckpointError
    from lowdiff.recovery.job import JOB_KIND

    job = shard.parent
    try:
        manifest = layout.read_manifest(job)
        world = int(manifest["world_size"]) if manifest.get("kind") == JOB_KIND else 0
    except (CorruptCheckpointError, KeyError, TypeError, ValueError):
        return None
    if world < 1 or shard.name not in {rank_dir(job, r).name for r in range(world)}:
        return None
    return world


def job_retention_floor(shard: Path) -> int | None:
    """The step below which retention may delete in a shard of a distributed job.

    The newest full checkpoint that every shard of the job holds, by the names in each
    shard's ``full/`` directory (a listing per shard, no file is opened). When no step is
    held by all of them yet, or a shard cannot be listed, it is 0: nothing may go. None
    when ``shard`` is not part of a distributed job (see :func:`job_world_size`).

    Why this is safe while the other shards' processes write and delete concurrently:
    every shard's files are published whole (atomic rename) in step order, and a shard
    deletes a full checkpoint only below a step it has just seen in every shard. The
    newest step ever seen in every shard is thus deleted by no shard, and stays common.
    A shard's full checkpoint that is present but damaged counts as held, as
    ``keep_full`` counts it in a single process.
    """
    from lowdiff.ddp.context import rank_dir

    world = job_world_size(shard)
    if world is None:
        return None
    common: set[int] | None = None
    for r in range(world):
        try:
            steps = set(_full_steps(rank_dir(shard.parent, r)))
        except OSError:
            return 0
        common = steps if common is None else common & steps
    return max(common) if common else 0


class FullWriter:
    """Writes one full checkpoint at a time in a background thread, then applies retention.

    ``on_released`` runs as soon as the data blob may be reused (after the write, or after
    a failure). ``announce_durable`` sends :class:`~lowdiff.engine.messages.Durable`: a full checkpoint is the
    durable point of LowDiff+, while LowDiff's durable point is its newest record.
    """

    def __init__(
        self,
        root: Path,
        keep_full: int | None,
        send: Callable[[Message], None],
        *,
        announce_durable: bool = False,
        on_released: Any = None,
        progress: Any = None,
        on_written: Callable[[Path], None] | None = None,
        protect: Callable[[], set[Path]] | None = None,
    ) -> None:
        self.root, self.keep_full, self.send = root, keep_full, send
        self.announce_durable, self.on_released = announce_durable, on_released
        self.progress = progress
        self.on_written, self.protect = on_written, protect
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.persisted = -1
        self.next_auto = 0.0
        """Earliest time for the next "as often as the disk keeps up" write (at most 50 % duty)."""
        self.took = 0.0
        """Seconds the last write took (with retention), 0 before the first."""
        self.started_at = -math.inf
        """When the last write began (``time.monotonic``)."""

    @property
    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def start(
        self, step: int, entries: list[sfile.TensorEntry], blob: torch.Tensor, meta: dict[str, str]
    ) -> None:
        self.wait()
        self.started_at = time.monotonic()
        self.thread = threading.Thread(
            target=self._write, args=(step, entries, blob, meta), daemon=True
        )
        self.thread.start()

    def _write(
        self, step: int, entries: list[sfile.TensorEntry], blob: torch.Tensor, meta: dict[str, str]
    ) -> None:
        released = False
        try:
            t0 = time.perf_counter()
            path = layout.full_path(self.root, step)
            nbytes = sfile.write(
                path,
                entries,
                blob,
                meta,
                progress=self.progress,
                direct=True,  # from the shared staging buffer, bypassing the page cache
            )
            released = True
            if self.on_released is not None:
                self.on_released()
            if self.on_written is not None:
                self.on_written(path)
            removed = retention(self.root, self.keep_full, self.protect)
            took = time.perf_counter() - t0
            self.took = took
            self.next_auto = time.monotonic() + took
            self.persisted = max(self.persisted, step)
            if self.announce_durable:
                self.send(Durable(step))
            self.send(FullDone(step, nbytes, took, len(removed)))
        except BaseException as e:  # noqa: BLE001 -- raised in the owner's thread by wait()
            self.error = e
            if not released and self.on_released is not None:
                self.on_released()

    def wait(self) -> None:
        """Wait for the write in flight; raise if it failed."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            # the original exception (an OSError stays an OSError), with the writer
            # thread's frames in its traceback
            err, self.error = self.error, None
            raise err


class _Writer:
    def __init__(
        self,
        cfg: WorkerConfig,
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


TRAINER_EXIT_S = 2.0
"""How long a trainer whose end of the pipes closed may take to be seen dead (it closes
them as it exits) before the writer takes it for one that let go of it and lives on."""


def worker_main(
    cfg: WorkerConfig,
    slots: torch.Tensor,
    counters: torch.Tensor,
    requests: Connection,
    results: Connection,
) -> None:
    """Entry point of the checkpointing process (see
    :func:`lowdiff.proc.child_end.run_checkpointing_process` for its frame: at nice 10 it waits
    for a moment the trainer leaves a core, and its few percent of a core are still far
    below the share that priority gets; SCHED_BATCH was slower end to end)."""
    w = _Writer(cfg, slots, Counters(counters), ChildEnd(requests, results))
    survivor = WriterSurvivor(w)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer's close() decides
    signal.signal(signal.SIGTERM, survivor.on_sigterm)

    def run() -> None:
        w.start_remote()
        survivor.start()
        w.end.ready()
        while w.end.serve(w.handle):
            # The trainer died without close(): keep every record it managed to send,
            # then wait for the next trainer (idle_timeout) or exit.
            survivor.trainer_gone()
            w.end.drain(w.handle_orphaned, (Kind.RECORD, Kind.FULL, Kind.STAGE, Kind.BATCH_SIZE))
            w.end.close()
            w.write_batch()
            w.wait_full()
            if not exits_within(w.cfg.trainer_pid, TRAINER_EXIT_S) or not survivor.orphaned():
                w.drain_remote()
                return

    # an error: the full checkpoint in flight completes (or removes its temp file) before
    # the trainer learns of it, so nothing of this process is still writing by then
    run_checkpointing_process(
        Path(cfg.root), run, report=w.send, finish=w.wait_full, cleanup=survivor.teardown
    )

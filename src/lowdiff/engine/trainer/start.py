"""Starting a session's checkpointing: a fresh directory, a recovered state, or a process
taken over.

:class:`Starter` holds the steps that every resume is made of (:mod:`resume` in one
process, :mod:`resume_ddp` and :mod:`resume_fsdp` under DDP and ``fully_shard``,
:mod:`resume_memory` for LowDiff+'s replica in memory, all in
:mod:`lowdiff.engine.trainer`): wait for (or find) the previous trainer's process, start a
new one with a full checkpoint, or continue a recovered state, taking the previous
process over when it can (:mod:`lowdiff.engine.trainer.takeover`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

from lowdiff.engine.trainer.backend import Backend
from lowdiff.engine.trainer.parts import SessionParts
from lowdiff.engine.trainer.staging import FullStager
from lowdiff.engine.trainer.takeover import Takeover
from lowdiff.engine.wire.messages import Full
from lowdiff.proc.holder import release_orphan
from lowdiff.recovery.replay import RecoveryStats
from lowdiff.state import capture as st


class Starter:
    """The steps that start checkpointing (see the module docstring); every other part
    of the session is handed to it."""

    def __init__(self, parts: SessionParts, stager: FullStager, backend: Backend) -> None:
        (self.objects, self.progress, self.cadence, self.options, self.directory,
         self.session) = parts.unpack()  # fmt: skip
        self.stager, self.backend = stager, backend
        self.takeover = Takeover(parts, stager, backend)

    # ------------------------------------------------------------------ a new process
    def launch(self, first: type[Full] | None = None) -> None:
        """Start a checkpointing process for this session; a previous trainer's process
        kept for a takeover that did not happen is released first (it exits once it
        persisted what it holds).

        The fork server is asked for the process on a thread while the state at this
        step is staged and sent as ``first`` (the full checkpoint it starts with, if
        any). The start goes on while training does: the first step's record waits in
        the pipe for the process, and it is waited for when the step is acknowledged
        (it must have taken the staging buffer: :meth:`FullStager.ensure_taken`), or
        when a slot, a flush or a reply needs it, or the pipe has no sure room left
        (:meth:`lowdiff.proc.link.ProcessLink.send`). A start that failed raises from
        the first request after it (here when it failed at once).
        """
        if self.takeover.release_kept():
            self.wait_for_previous_writer()
        self.backend.prepare_launch()
        target, cfg, n_slots = self.backend.process(self.directory.run_id)
        self.stager.reset()
        self.session.launch(target, cfg, n_slots)
        self.backend.started()
        if first is not None:
            self.stager.emit(self.session, self.progress.step, first)
        self.session.link.finish_start(block=False)

    def start_fresh(self) -> None:
        """A new session in an empty directory: manifest, process, full checkpoint."""
        self.directory.make_dirs()
        self.write_manifest()
        self.progress.start()
        self.launch(self.backend.first_message)

    def write_manifest(self) -> None:
        self.directory.write_manifest(
            self.objects.manifest(
                self.directory.run_id, self.cadence.configured, self.options.keep_full
            )
        )

    # ------------------------------------------------------------------ the previous process
    def wait_for_previous_writer(self, since: float | None = None) -> None:
        """A killed trainer's checkpointing process may still be flushing: wait for it
        (one kept for a new trainer is released: it exits once it has persisted), for
        ``start_timeout`` seconds in all from ``since`` (by default now)."""
        self.directory.wait_for_previous_writer(self.options.start_timeout, since)

    def settle_previous_process(self) -> None:
        """Before recovering from disk: a killed trainer's checkpointing process may
        still be writing what it was sent. LowDiff's writer, which a trainer recovering
        from disk takes over, is waited for until it wrote everything and kept in
        ``takeover.orphan``; any other process is waited for until it exits."""
        start = time.monotonic()
        found = None if self.backend.keeps_replica else self.takeover.find_writer()
        if found is None:
            self.wait_for_previous_writer(since=start)

    def release_stale_orphans(self, dirs: list[Path]) -> None:
        """Under DDP: let processes left by crashed trainers of other world sizes in
        ``dirs`` persist what they hold and exit (their memory is of no use to this world
        size); each rank releases its share of them."""
        ctx = self.objects.dist
        assert ctx is not None
        for i, d in enumerate(dirs):
            if i % ctx.world_size == ctx.rank and d.is_dir():
                with contextlib.suppress(Exception):
                    release_orphan(d, self.options.start_timeout)

    # ------------------------------------------------------------------ a recovered state
    def take_recovered(self, stats: RecoveryStats, where: Path | str, durable: bool = True) -> None:
        """The recovered state is loaded: take its extra state, step and durability."""
        objects = self.objects
        st.apply_extra(objects.extra, stats.extra, f"{where} step {stats.step}")
        self.progress.recovered(stats, durable)
        objects.compressor.reset_state()  # error-feedback residuals restart at zero

    def continue_recovered(self, barrier: Callable[[], None] | None = None) -> int:
        """Cut the directory back to the recovered step and start checkpointing from it
        (under DDP ``barrier`` keeps every rank from writing before every shard is cut)."""
        progress = self.progress
        assert progress.recovery_stats is not None
        self.directory.quarantine_beyond(progress.recovery_stats)
        if barrier is not None:
            barrier()
        if self.takeover.take_over_orphan(progress.recovery_stats):
            return progress.step
        self.write_manifest()
        progress.start()
        self.launch(self.backend.resume_message)
        return progress.step

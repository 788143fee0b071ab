"""Starting and resuming a checkpointing session in one process.

Shared by LowDiff and LowDiff+ (:class:`CheckpointingStrategy`): a fresh directory
gets the manifest, the checkpointing process and a full checkpoint at step 0; a
directory with checkpoints is recovered (read, decode, replay), cut back to the
recovered step (later and damaged files are quarantined) and continued. LowDiff+ first
looks for a replica in memory (:mod:`lowdiff.engine.lowdiff_plus`); under DDP the ranks
agree on one step (:mod:`lowdiff.engine.resume_ddp`).
"""

from __future__ import annotations

import abc
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from lowdiff.engine.base import EngineStrategy
from lowdiff.engine.messages import Full
from lowdiff.engine.resume_ddp import remote_holds_lost_job, resume_ddp
from lowdiff.engine.session import ProcessSession
from lowdiff.engine.staging import FullStager
from lowdiff.errors import LowDiffError
from lowdiff.format import layout
from lowdiff.proc import preempt
from lowdiff.proc.protocol import Flush, Kind
from lowdiff.proc.spawn import warm_up
from lowdiff.recovery.restore import recover
from lowdiff.recovery.scan import is_empty_dir
from lowdiff.remote.fetch import fetch, has_commits
from lowdiff.remote.store import preload


class CheckpointingStrategy(EngineStrategy):
    """The part of the shared API that LowDiff and LowDiff+ (the strategies that write
    checkpoints) add: the directory, the checkpointing process, resume."""

    initial_message: ClassVar[type[Full]] = Full
    """What the full checkpoint that starts a process is sent as (LowDiff+: ``Init``)."""
    reseeds_on_resume: ClassVar[bool] = False
    """Whether a process continuing a recovered state needs the state first (LowDiff+'s
    replica does; LowDiff's writer continues the chain on disk)."""

    def _install(self, directory: str | os.PathLike[str] | None) -> None:
        if directory is None:
            raise ValueError(f"strategy {self.name!r} needs a checkpoint directory, got None")
        self._install_ddp_hook()
        self.core.open_directory(directory)
        if self.options.remote is not None:
            preload(self.options.remote)  # before the process server is forked from here
        warm_up()  # the process server starts while the trainer resumes
        opts = self.options
        self.session = ProcessSession(
            self.core, start_timeout=opts.start_timeout, stall_timeout=opts.stall_timeout
        )
        self.policy.watch(self.session)
        self.stager = FullStager(self.core, self.handover)
        self._register_exit()
        if opts.sigterm_timeout is not None:
            preempt.register(self, opts.sigterm_timeout)

    def _install_ddp_hook(self) -> None:  # noqa: B027
        """Register the strategy's DDP communication hook (before the first backward)."""

    @abc.abstractmethod
    def _process(self) -> tuple[Callable[..., None], Any, int]:
        """The checkpointing process to start: (entry point, its config, record slots)."""

    # ------------------------------------------------------------------ the process
    def launch(self) -> None:
        """Start a checkpointing process for this session (and wait until it is ready)."""
        assert self.session is not None
        target, cfg, n_slots = self._process()
        self.stager.reset()
        self.session.launch(target, cfg, n_slots)
        self._started_process()

    def _started_process(self) -> None:  # noqa: B027
        """The process is ready (LowDiff+ snapshots into its slots from now on)."""

    def emit_full(self, step: int, message: type[Full] = Full) -> None:
        """Stage the state at ``step`` and hand it to the process as ``message``."""
        assert self.session is not None
        self.stager.emit(self.session, step, message)

    # ------------------------------------------------------------------ start and resume
    def wait_for_previous_writer(self) -> None:
        """A killed trainer's checkpointing process may still be flushing: wait for it."""
        self.core.wait_for_previous_writer(self.options.start_timeout)

    def start_fresh(self) -> None:
        """A new session in an empty directory: manifest, process, full checkpoint."""
        core = self.core
        core.make_dirs()
        core.write_manifest(self.options.keep_full)
        self.launch()
        core.started = True
        self.emit_full(core.step, self.initial_message)

    def continue_recovered(self, barrier: Callable[[], None] | None = None) -> int:
        """Cut the directory back to the recovered step and start checkpointing from it
        (under DDP ``barrier`` keeps every rank from writing before every shard is cut)."""
        core = self.core
        assert core.recovery_stats is not None
        core.quarantine_beyond(core.recovery_stats)
        if barrier is not None:
            barrier()
        core.write_manifest(self.options.keep_full)
        self.launch()
        core.started = True
        if self.reseeds_on_resume:
            self.emit_full(core.step, self.initial_message)
        return core.step

    def resume(self) -> int:
        """Restore the newest recoverable state, or prepare an empty directory.

        Restores model parameters and buffers, optimizer state, scheduler state and RNG
        states. Files past the recovered step, and damaged files, are moved to
        ``DIR/quarantine/`` (never deleted). The error-feedback residuals restart at zero.

        Returns:
            The recovered step (0 for an empty directory).
        """
        core = self.core
        if core.started:
            raise RuntimeError("resume() must be called once, before the first step()")
        assert core.root is not None
        if core.dist is not None:
            return resume_ddp(self)
        if self._resume_from_memory():
            return core.step
        self.wait_for_previous_writer()
        core.remove_stale_temps()
        if is_empty_dir(core.root) and not self._fetch_remote():
            self.start_fresh()
            return 0
        core.check_manifest(layout.read_manifest(core.root))
        stats = recover(core.root, core.model, core.optimizer, core.scheduler)
        core.adopt_recovered(stats, core.root)
        return self.continue_recovered()

    def _fetch_remote(self) -> bool:
        """A new node (the local directory empty or lost): download the remote tier's
        newest committed full checkpoint and the records after it into the directory.
        Returns whether there was anything to download."""
        url = self.options.remote
        if url is None or not has_commits(url, self.options.remote_options):
            return False
        assert self.core.root is not None
        self.core.make_dirs()
        fetch(url, self.core.root, self.options.remote_options)
        return True

    def _resume_from_memory(self) -> bool:
        """Restore from a replica left in memory by a crashed trainer (LowDiff+)."""
        return False

    def resume_ddp_from_memory(self) -> bool:
        """Under DDP, in the job's newest generation: rebuild the state from every rank's
        replica in memory (LowDiff+; a collective call). False when that is not possible."""
        return False

    def release_stale_holders(self, dirs: list[Path]) -> None:  # noqa: B027
        """Under DDP: let processes left by crashed trainers of other world sizes in
        ``dirs`` persist what they hold and exit (LowDiff+'s replicas)."""

    def _start_implicit(self) -> None:
        core = self.core
        assert core.root is not None
        if core.dist is not None:
            if core.job_holds_checkpoints():
                raise LowDiffError(
                    f"{core.job_root} already holds checkpoints; call ck.resume() on every rank "
                    "before the first step() to continue from them, or use a new directory"
                )
            if remote_holds_lost_job(self):
                raise LowDiffError(
                    f"the remote tier {self.options.remote} already holds the job's "
                    "checkpoints; call ck.resume() on every rank before the first step() to "
                    "continue from them, or use a new remote prefix"
                )
            resume_ddp(self)
            return
        self.wait_for_previous_writer()
        url = self.options.remote
        if (
            is_empty_dir(core.root)
            and url is not None
            and has_commits(url, self.options.remote_options)
        ):
            raise LowDiffError(
                f"the remote tier {url} already holds checkpoints; call ck.resume() before the "
                "first step() to continue from them, or use a new remote prefix"
            )
        if not is_empty_dir(core.root):
            raise LowDiffError(
                f"{core.root} already holds checkpoints; call ck.resume() before the first step() to continue "
                "from them, or use a new directory"
            )
        self.start_fresh()

    def preempt(self, deadline: float) -> None:
        """On SIGTERM (:mod:`lowdiff.proc.preempt`): make every step whose ``step()``
        returned durable by ``deadline`` (this process's own shard; no collective)."""
        core, session = self.core, self.session
        if session is None or not session.started or not core.started or core.closed:
            return
        if self.policy.suspended is not None:
            return
        self.handover.finish()
        seen = session.link.replies[Kind.FLUSHED]
        session.send(Flush())
        session.wait(
            lambda: session.link.replies[Kind.FLUSHED] > seen,
            "'flushed' after SIGTERM",
            timeout=max(0.0, deadline - time.monotonic()),
        )

    def _release(self) -> None:
        preempt.unregister(self)
        super()._release()

    def _close_session(self) -> None:
        self._request_close()

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
import contextlib
import multiprocessing
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from lowdiff.engine.base import EngineStrategy
from lowdiff.engine.messages import Adopt, Full
from lowdiff.engine.resume_ddp import remote_holds_lost_job, resume_ddp
from lowdiff.engine.session import Accepted, EarlyAnswer, ProcessSession, ask_to_take_over
from lowdiff.engine.staging import FullStager
from lowdiff.errors import InvalidArgumentError, LowDiffError, UsageError
from lowdiff.format import layout
from lowdiff.proc import preempt
from lowdiff.proc.holder import Survivor, release_survivor, remove_stale_replica, survivor_waits
from lowdiff.proc.protocol import Close, Flush, Kind
from lowdiff.proc.spawn import trainer_env, warm_up
from lowdiff.recovery.replay import RecoveryStats
from lowdiff.recovery.restore import recover
from lowdiff.recovery.scan import is_empty_dir
from lowdiff.remote.fetch import fetch, has_commits
from lowdiff.remote.store import preload


class CheckpointingStrategy(EngineStrategy):
    """The part of the shared API that LowDiff and LowDiff+ (the strategies that write
    checkpoints) add: the directory, the checkpointing process, resume."""

    initial_message: ClassVar[type[Full]] = Full
    """What the full checkpoint that starts a process is sent as (LowDiff+: ``Init``)."""
    survivor: Survivor | None = None
    """The previous trainer's process, found by :meth:`settle_previous_process` and not
    (yet) taken over; released before a process of this session starts."""
    closes_when_dropped: ClassVar[bool] = False
    """Whether the process exits when a live trainer lets go of it (a Checkpointer dropped
    without ``close()``), and waits for a next trainer only once its trainer is dead
    (LowDiff's writer); LowDiff+'s replica keeps the state in memory either way."""
    reseeds_on_resume: ClassVar[bool] = False
    """Whether a process continuing a recovered state needs the state first (LowDiff+'s
    replica does; LowDiff's writer continues the chain on disk)."""

    def _install(self, directory: str | os.PathLike[str] | None) -> None:
        if directory is None:
            raise InvalidArgumentError(f"strategy {self.name!r} needs a checkpoint directory, got None")
        self._install_ddp_hook()
        self.core.open_directory(directory)
        if self.options.remote is not None:
            preload(self.options.remote)  # before the process server is forked from here
        if not survivor_waits(self.core.root):
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
        assert self.session is not None
        if self.survivor is not None:
            self.survivor.release_owner(self.options.start_timeout)
            self.survivor = None
            self.wait_for_previous_writer()
        target, cfg, n_slots = self._process()
        self.stager.reset()
        self.session.launch(target, cfg, n_slots)
        self._started_process()
        if first is not None:
            self.emit_full(self.core.step, first)
        self.session.link.finish_start(block=False)

    def _started_process(self) -> None:  # noqa: B027
        """The process is ready (LowDiff+ snapshots into its slots from now on)."""

    def emit_full(self, step: int, message: type[Full] = Full) -> None:
        """Stage the state at ``step`` and hand it to the process as ``message``."""
        assert self.session is not None
        self.stager.emit(self.session, step, message)

    # ------------------------------------------------------------------ start and resume
    def wait_for_previous_writer(self, since: float | None = None) -> None:
        """A killed trainer's checkpointing process may still be flushing: wait for it
        (one kept for a new trainer is released: it exits once it has persisted), for
        ``start_timeout`` seconds in all from ``since`` (by default now)."""
        self.core.wait_for_previous_writer(self.options.start_timeout, since)

    def settle_previous_process(self) -> None:
        """Before recovering from disk: a killed trainer's checkpointing process may
        still be writing what it was sent. A process this strategy can take over
        (:meth:`_find_survivor`) is waited for until it wrote everything and kept in
        :attr:`survivor`; any other is waited for until it exits."""
        start = time.monotonic()
        self.survivor = self._find_survivor()
        if self.survivor is None:
            self.wait_for_previous_writer(since=start)

    def _find_survivor(self) -> Survivor | None:
        """The previous trainer's process, done writing and waiting for a new trainer,
        when this strategy takes such a process over after a recovery from disk
        (LowDiff's writer); None otherwise."""
        return None

    def start_fresh(self) -> None:
        """A new session in an empty directory: manifest, process, full checkpoint."""
        core = self.core
        core.make_dirs()
        core.write_manifest(self.options.keep_full)
        core.started = True
        self.launch(self.initial_message)

    def continue_recovered(self, barrier: Callable[[], None] | None = None) -> int:
        """Cut the directory back to the recovered step and start checkpointing from it
        (under DDP ``barrier`` keeps every rank from writing before every shard is cut)."""
        core = self.core
        assert core.recovery_stats is not None
        core.quarantine_beyond(core.recovery_stats)
        if barrier is not None:
            barrier()
        if self._take_over_survivor(core.recovery_stats):
            return core.step
        core.write_manifest(self.options.keep_full)
        core.started = True
        self.launch(self.initial_message if self.reseeds_on_resume else None)
        return core.step

    def _take_over_survivor(self, stats: RecoveryStats) -> bool:
        """Go on with the previous trainer's process (:attr:`survivor`) instead of
        starting one, when it serves the recovered state's run at the recovered step.
        Under DDP every rank takes its own over, or none does (a collective call)."""
        found = self.survivor
        ok = (
            found is not None
            and found.descriptor.run_id == stats.state_run_id
            and found.step == stats.step
        )
        if not ok:
            self._drop_early_answer()
        ok = ok and found is not None and self._adopt(found, stats)
        ctx = self.core.dist
        if ctx is not None and not ctx.all_min([int(ok)])[0]:
            if ok:  # another rank could not: every rank starts anew, this one too
                self._give_back_adopted(stats)
            ok = False
        if ok:
            self.survivor = None
            self._continue_adopted(stats)
        return ok

    _early: EarlyAnswer | None = None
    """The survivor's answer to a request sent while the state was recovered from disk."""

    def _adoption_request(self, found: Survivor) -> Adopt:
        """The request to take ``found`` over (this session continues its run)."""
        core = self.core
        own, core.run_id = core.run_id, found.descriptor.run_id
        try:
            _, cfg, n_slots = self._process()
        finally:
            core.run_id = own
        key = bytes(multiprocessing.current_process().authkey)
        return Adopt(os.getpid(), found.step, n_slots, cfg, trainer_env(), key)

    def _ask_survivor_early(self, found: Survivor | None) -> None:
        """(one process) Ask ``found``, the previous trainer's process, to serve this
        trainer on a thread, while the state is recovered (from disk, or copied out of
        its memory): its answer is waited for only by :meth:`_adopt` (its request names
        the step the process holds, and is used only if the recovery reaches that step)."""
        if found is None or "address" not in found.doc or self.core.dist is not None:
            return
        assert self.session is not None
        self._early = EarlyAnswer(
            found.doc, self._adoption_request(found), self.session.link.start_timeout
        )

    def _drop_early_answer(self) -> None:
        """An early request's answer that will not be used: a process that accepted is
        let go again (it exits once it has persisted; :meth:`launch` waits for it)."""
        early, self._early = self._early, None
        if early is not None:
            answer = early.result()
            if isinstance(answer, Accepted):
                answer.give_up()

    def _adopt(self, found: Survivor, stats: RecoveryStats) -> bool:
        """Ask the previous trainer's process (``found``; the state it serves is loaded
        here) to serve this trainer; True once it does (``stats.adopted_pid``), False (and
        why, in ``memory_miss_reason``) when it cannot: it then still waits to be released."""
        session, core = self.session, self.core
        assert session is not None
        if "address" not in found.doc:
            core.memory_miss_reason = "the process takes no new trainer"
            return False
        early, self._early = self._early, None
        if early is not None:
            answer = early.result()
        else:
            answer = ask_to_take_over(
                found.doc, self._adoption_request(found), session.link.start_timeout
            )
        why = session.attach_accepted(answer)
        found.close()
        if why:
            core.memory_miss_reason = f"cannot take the process over: {why}"
            return False
        core.run_id = found.descriptor.run_id  # the session goes on as its run
        stats.adopted_pid = found.descriptor.pid
        return True

    def _give_back_adopted(self, stats: RecoveryStats) -> None:
        """Let a process taken over go again: it persists what it holds and exits."""
        session = self.session
        assert session is not None
        with contextlib.suppress(Exception):
            session.request(Close(), Kind.CLOSED)
            session.join()
        session.release()
        stats.adopted_pid = None

    def _continue_adopted(self, stats: RecoveryStats) -> None:
        """Go on with the process taken over: it holds what it persisted, and its slots;
        the manifest stays as the previous trainer wrote it (same run, layout, retention)."""
        core, session = self.core, self.session
        assert session is not None
        core.durable = int((session.link.info or {}).get("durable", -1))
        self.stager.reset(session.staging)
        core.started = True
        self._started_process()

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
            raise UsageError("resume() must be called once, before the first step()")
        assert core.root is not None
        if core.dist is not None:
            return resume_ddp(self)
        if self._resume_from_memory():
            return core.step
        self.settle_previous_process()
        self._ask_survivor_early(self.survivor)
        try:
            core.remove_stale_temps()
            if is_empty_dir(core.root) and not self._fetch_remote():
                self._drop_early_answer()
                self.start_fresh()
                return 0
            core.check_manifest(layout.read_manifest(core.root))
            stats = recover(core.root, core.model, core.optimizer, core.scheduler)
            core.adopt_recovered(stats, core.root)
            return self.continue_recovered()
        finally:
            self._drop_early_answer()  # not asked for (an error): the process is let go

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

    def release_stale_holders(self, dirs: list[Path]) -> None:
        """Under DDP: let processes left by crashed trainers of other world sizes in
        ``dirs`` persist what they hold and exit (their memory is of no use to this world
        size); each rank releases its share of them."""
        ctx = self.core.dist
        assert ctx is not None
        for i, d in enumerate(dirs):
            if i % ctx.world_size == ctx.rank and d.is_dir():
                with contextlib.suppress(Exception):
                    release_survivor(d, self.options.start_timeout)

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
        session.link.request(
            Flush(),
            Kind.FLUSHED,
            timeout=max(0.0, deadline - time.monotonic()),
            what="'flushed' after SIGTERM",
            check=session.check,
        )

    def _release(self) -> None:
        preempt.unregister(self)
        self._remove_dead_process_segments()
        super()._release()

    def _remove_dead_process_segments(self) -> None:
        """A checkpointing process of this directory that died on its own (SIGKILLed)
        leaves its shared memory behind: remove it now, not at the next ``resume()`` on
        the directory (which may never come). A live one (a process left to wait for the
        next trainer) is left alone; the directory lock is still held here."""
        root = self.core.root
        if root is not None:
            with contextlib.suppress(Exception):
                remove_stale_replica(root)

    def _close_session(self) -> None:
        self._request_close()

    def _close_at_exit(self) -> None:
        core = self.core
        if core.dist is not None and not core.closed:
            # A rank exiting without close() under DDP is a failed job that its launcher
            # will restart: leave the checkpointing process running (it writes or persists
            # what it holds and waits idle_timeout for a restarted trainer) instead of
            # shutting it down.
            core.closed = True
            if not self.closes_when_dropped:
                with contextlib.suppress(Exception):
                    self._release()
            # else the pipes close as the process ends: a writer that sees its trainer
            # gone then waits for the next one (one let go by a live trainer exits)
            return
        super()._close_at_exit()

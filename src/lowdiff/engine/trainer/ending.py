"""The end of a session on the trainer: ``flush()``, ``close()``, SIGTERM, interpreter
exit, and a Checkpointer dropped without ``close()``.

:class:`SessionEnd` makes what was handed over durable (a send that waits for its
device-to-host copy goes first, :mod:`lowdiff.engine.trainer.pending`), stops (or
leaves behind) the checkpointing process, and gives back what the session holds: the
pipes, the pinned slots and staging buffer, the directory lock.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from lowdiff.engine.options import EngineOptions
from lowdiff.engine.trainer import remote_wait
from lowdiff.engine.trainer.handover import Handover, OptimizerHooks
from lowdiff.engine.trainer.pipeline import StepPipeline
from lowdiff.engine.trainer.progress import Progress
from lowdiff.engine.trainer.start import Starter
from lowdiff.engine.trainer.storage_policy import CheckpointingSuspended, StoragePolicy
from lowdiff.engine.trainer.training import TrainingObjects
from lowdiff.proc.holder import remove_stale_replica
from lowdiff.proc.protocol import Close, Flush, Kind


class SessionEnd:
    """Flush and close one session (see the module docstring).

    Args:
        objects, progress, options: the training objects, the progress, the options.
        handover, hooks: the steps waiting for the hand-over; the optimizer's hooks.
        policy: the storage-error policy.
        pipeline: the step pipeline (to read what the process reported).
        starter: the session's checkpointing, or None (``"compression-only"``).
    """

    def __init__(
        self,
        objects: TrainingObjects,
        progress: Progress,
        options: EngineOptions,
        handover: Handover,
        hooks: OptimizerHooks,
        policy: StoragePolicy,
        pipeline: StepPipeline,
        starter: Starter | None,
    ) -> None:
        self.objects, self.progress, self.options = objects, progress, options
        self.handover, self.hooks, self.policy = handover, hooks, policy
        self.pipeline, self.starter = pipeline, starter
        self.on_close: list[Callable[[], None]] = []

    def _running(self) -> bool:
        progress = self.progress
        return self.starter is not None and progress.started and not progress.closed

    def flush(self) -> int:
        """Write the records waiting for a full batch and wait until they are durable;
        the durable step (under DDP a collective call: the job's)."""
        progress = self.progress
        if not self._running():
            self.pipeline.poll()
            return progress.durable_step()
        assert self.starter is not None
        try:
            self.handover.finish()
            if self.policy.suspended is None:
                self.handover.copies.send_all()
                self.starter.session.request(Flush(), Kind.FLUSHED)
        except CheckpointingSuspended:
            pass
        if self.policy.suspended is not None:
            self.policy.warn_not_durable("flush()")
        if progress.job is not None:
            return progress.job.now(*progress.figures())[0]
        return progress.durable

    def flush_remote(self) -> int:
        """:meth:`flush`, then wait until the remote tier holds every durable step."""
        url = self.options.remote
        assert url is not None
        self.flush()
        running = self._running() and not self.policy.suspended
        session = self.starter.session if running and self.starter is not None else None
        return remote_wait.wait_remote(session, self.progress, url, self.options.remote_timeout)

    def close(self, release: Callable[[], None]) -> None:
        """Flush everything, wait until it is durable, stop the checkpointing process and
        ``release()`` what the session holds (see :meth:`lowdiff.Checkpointer.close`)."""
        progress = self.progress
        if progress.closed:
            return
        self.hooks.detach()
        for fn in self.on_close:
            fn()
        progress.close()
        self.handover.closed = True
        closed = settled = failed = False
        try:
            self._finish_steps()
            closed = self.policy.suspended is None
            if self.options.remote is not None and self.starter is not None and closed:
                self.pipeline.poll()  # the remote durable step the process reached
        except CheckpointingSuspended:
            pass
        except BaseException:
            # the process failed, or made no progress for stall_timeout: it is not waited
            # for a second time (it finishes what it was writing and exits once its pipes
            # close; the next session waits for it before touching the directory)
            failed = True
            raise
        finally:
            settled = self._settle_job(closed)
            if self.starter is not None and not failed:
                self.starter.session.join()
            release()
        if self.policy.suspended is not None:
            self.policy.warn_not_durable("close()")
        elif closed and self.options.remote is not None:
            remote_wait.check_closed(
                progress, self.options.remote, self.options.remote_timeout, settled
            )

    def _finish_steps(self) -> None:
        """Hand over the steps waiting, then make them durable and stop the process."""
        if self.progress.started and self.objects.groups_changed():
            # a step handed over late (attach) would be sent with the new group's
            # hyperparameters and optimizer state: it is not saved
            self.handover.discard()
        if self.progress.started:
            self.handover.finish()  # steps driven by the optimizer's hooks
        s = self.starter
        if s is not None and s.session.started and self.policy.suspended is None:
            self.handover.copies.send_all()
            s.session.request(Close(), Kind.CLOSED)

    def _settle_job(self, closed: bool) -> bool:
        """Under DDP: exchange both durable steps once more (``closed``: every step of
        this shard is durable), so that they say the job's final figures; whether the
        exchange settled."""
        progress = self.progress
        if progress.job is None:
            return False
        if closed:
            # settle() gives up on a rank that never closes, and durable_step keeps the
            # older value; a peer that died fails the exchange (a framework closes on the
            # error its death raised): this rank's shard is durable all the same
            with contextlib.suppress(RuntimeError):
                progress.job.refresh(*progress.figures())
        return progress.job.settle() and closed

    def preempt(self, deadline: float) -> None:
        """On SIGTERM (:mod:`lowdiff.proc.preempt`): make every step whose ``step()``
        returned durable by ``deadline`` (this process's own shard; no collective)."""
        s = self.starter
        if s is None or not s.session.started or not self._running():
            return
        if self.policy.suspended is not None:
            return
        self.handover.finish()
        self.handover.copies.send_all()
        s.session.link.request(
            Flush(),
            Kind.FLUSHED,
            timeout=max(0.0, deadline - time.monotonic()),
            what="'flushed' after SIGTERM",
            check=s.session.check,
        )

    def close_at_exit(self, close: Callable[[], None], release: Callable[[], None]) -> None:
        """At interpreter exit without ``close()``: ``close()``, except for a rank of a
        distributed job, which leaves its checkpointing process running."""
        progress, s = self.progress, self.starter
        if s is not None and self.objects.dist is not None and not progress.closed:
            # A rank exiting without close() under DDP is a failed job that its launcher
            # will restart: leave the checkpointing process running (it writes or persists
            # what it holds and waits idle_timeout for a restarted trainer) instead of
            # shutting it down; the steps whose copies were in flight are sent to it first.
            if self.policy.suspended is None:
                with contextlib.suppress(Exception):
                    self.handover.copies.send_all()
            progress.close()
            if not s.backend.closes_when_dropped:
                with contextlib.suppress(Exception):
                    release()
            # else the pipes close as the process ends: a writer that sees its trainer
            # gone then waits for the next one (one let go by a live trainer exits)
            return
        with contextlib.suppress(Exception):
            close()

    def release(self) -> None:
        """Give back what the session holds (pipes, pinned memory, the directory lock)."""
        s = self.starter
        if s is None:
            return
        copies = self.handover.copies
        if copies and not self.progress.closed and self.policy.suspended is None:
            # dropped without close(): every step whose step() returned reaches the process
            with contextlib.suppress(Exception):
                copies.send_all()
        copies.discard()  # close() sent them; after a failure they cannot go
        s.stager.release()
        s.backend.release()
        # a checkpointing process of this directory that died on its own (SIGKILLed)
        # leaves its shared memory behind: removed now, not at the next resume() on the
        # directory (which may never come); a live one (waiting for the next trainer) is
        # left alone; the directory lock is still held here
        with contextlib.suppress(Exception):
            remove_stale_replica(s.directory.root)
        s.session.release()
        s.directory.release_lock()

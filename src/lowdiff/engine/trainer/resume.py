"""Resuming a session: ``ck.resume()``, or the first ``step()`` without it.

A fresh directory gets the manifest, the checkpointing process and a full checkpoint at
step 0; a directory with checkpoints is recovered (read, decode, replay), cut back to the
recovered step (later and damaged files are quarantined) and continued. LowDiff+ first
looks for its replica in memory (:mod:`lowdiff.engine.trainer.resume_memory`); LowDiff
takes its writer over once it wrote what it was sent
(:mod:`lowdiff.engine.trainer.takeover`); under DDP the ranks agree on one step
(:mod:`lowdiff.engine.trainer.resume_ddp`). Every step of it is a
:class:`~lowdiff.engine.trainer.start.Starter`'s.
"""

from __future__ import annotations

from lowdiff.engine.trainer.resume_ddp import remote_holds_lost_job, resume_ddp
from lowdiff.engine.trainer.resume_memory import resume_from_memory
from lowdiff.engine.trainer.start import Starter
from lowdiff.errors import LowDiffError
from lowdiff.format import layout
from lowdiff.recovery.restore import recover
from lowdiff.recovery.scan import is_empty_dir
from lowdiff.remote.fetch import fetch, has_commits


def resume(s: Starter) -> int:
    """Restore the newest recoverable state, or prepare an empty directory; the step
    (0 for an empty directory). See :meth:`lowdiff.Checkpointer.resume`."""
    objects, progress, d = s.objects, s.progress, s.directory
    if objects.dist is not None:
        return resume_ddp(s)
    if s.backend.keeps_replica and resume_from_memory(s):
        return progress.step
    s.settle_previous_process()
    s.takeover.ask_early(s.takeover.orphan)
    try:
        d.remove_stale_temps()
        if is_empty_dir(d.root) and not _fetch_remote(s):
            s.takeover.drop_pending()
            s.start_fresh()
            return 0
        objects.check_manifest(layout.read_manifest(d.root), d.root)
        stats = recover(d.root, objects.model, objects.optimizer, objects.scheduler)
        s.take_recovered(stats, d.root)
        return s.continue_recovered()
    finally:
        s.takeover.drop_pending()  # not asked for (an error): the process is let go


def _fetch_remote(s: Starter) -> bool:
    """A new node (the local directory empty or lost): download the remote tier's newest
    committed full checkpoint and the records after it into the directory. Returns
    whether there was anything to download."""
    url, options = s.options.remote, s.options.remote_options
    if url is None or not has_commits(url, options):
        return False
    s.directory.make_dirs()
    fetch(url, s.directory.root, options)
    return True


def start_implicit(s: Starter) -> None:
    """The first ``step()`` without ``resume()``: a fresh start, in a directory (and a
    remote tier) that must hold no checkpoint yet."""
    d, url = s.directory, s.options.remote
    if s.objects.dist is not None:
        if d.job_holds_checkpoints():
            raise LowDiffError(
                f"{d.job_root} already holds checkpoints; call ck.resume() on every rank "
                "before the first step() to continue from them, or use a new directory"
            )
        if remote_holds_lost_job(s):
            raise LowDiffError(
                f"the remote tier {url} already holds the job's checkpoints; call "
                "ck.resume() on every rank before the first step() to continue from them, "
                "or use a new remote prefix"
            )
        resume_ddp(s)
        return
    s.wait_for_previous_writer()
    if is_empty_dir(d.root) and url is not None and has_commits(url, s.options.remote_options):
        raise LowDiffError(
            f"the remote tier {url} already holds checkpoints; call ck.resume() before the "
            "first step() to continue from them, or use a new remote prefix"
        )
    if not is_empty_dir(d.root):
        raise LowDiffError(
            f"{d.root} already holds checkpoints; call ck.resume() before the first step() "
            "to continue from them, or use a new directory"
        )
    s.start_fresh()

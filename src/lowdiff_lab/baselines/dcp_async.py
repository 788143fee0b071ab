"""``method="dcp-async"``: PyTorch's own ``torch.distributed.checkpoint.async_save``.

What a user of the PyTorch ecosystem picks today (torchtitan's checkpointer is built on
it). Every ``full_every`` steps, on the training process:

1. back-pressure: wait until the previous save has finished (at most one save in
   flight, as CheckFreq does; the wait counts as stall);
2. build the state with DCP's helpers (``get_model_state_dict`` /
   ``get_optimizer_state_dict``; scheduler, RNG and step go in one small blob);
3. ``dcp.async_save``: DCP's ``DefaultStager`` copies every tensor into a staging
   buffer (shared memory for the process saver, pinned as well when CUDA is there; the
   buffers are cached and reused from one save to the next, which is why step 1 waits
   first), and hands the staged state to the saver; training goes on. Staging is
   synchronous (``use_async_staging=False``): the next forward pass updates BatchNorm
   buffers in place, so a copy still running then would mix two steps.

``stats`` adds ``wait_s`` (step 1) and ``stage_s`` (steps 2-3) to the common counters;
both are part of ``stall_s``.

The saver is DCP's default, the thread-based one (``AsyncCheckpointerType.THREAD``, what
``async_save`` does when not told otherwise and what torchtitan's ``async`` mode runs):
``dcp.save`` runs in a thread of the training process, from a staged copy in ordinary
CPU memory, with no process group (``no_dist=True``). ``async_mode="process"`` runs
DCP's process-based saver instead: one spawned daemon per trainer process that receives
the staged state through a pipe (staging then goes to shared memory, so tensors travel
as handles, not bytes) and runs the ordinary ``dcp.save``; it falls back to the thread
saver where this torch lacks it. Errors of either saver come back through the future
and are raised on the trainer's next call as :class:`lowdiff.CheckpointWorkerError`.
The attributes ``async_mode`` and ``staging`` say which saver and which staging options
run (also in the manifest; ``stats["process_saver"]`` is 1.0 for the process saver).

Process group (process saver only): DCP starts its daemon through one (it broadcasts
the daemon's TCP store address over it, and the daemon joins a gloo group of its own). When the trainer has
none, this strategy creates a single-rank gloo group over an in-memory ``HashStore`` for
as long as it runs and destroys it on ``close()``; a group the user initialised is used
as it is (it needs a CPU backend), and every rank then saves its own directory
(``no_dist``). Loading never needs a group (``dcp.load(no_dist=True)``).

DCP writes no checksums. The saver's storage writer therefore publishes, as the last
step of every save and after DCP's own ``.metadata``, a commit file holding the
xxh3-128 digest of every file of the checkpoint (written by the saver, so hashing costs
the trainer nothing); a checkpoint is durable, and ``durable_step`` advances, once the
save's future has completed with its commit in place. The saver holds
``DIR/.lowdiff.writer.lock`` while it writes, so a restarted trainer waits for a save
that a killed trainer's daemon is still finishing instead of reading it half-written.

Layout::

    DIR/lowdiff.json                     manifest (strategy, async mode, stager)
    DIR/full/dcp-{step:012d}/            one DCP checkpoint: .metadata, __0_0.distcp
    DIR/full/dcp-{step:012d}.commit      {"files": [{name, bytes, xxh3_128}], ...}

Recovery takes the newest directory whose commit is intact and whose files match it
(a damaged or uncommitted one is named in a :class:`lowdiff.RecoveryWarning` and moved
to ``DIR/quarantine/``) and ``dcp.load``\\ s it in place into the live objects, then
applies it with ``set_model_state_dict`` / ``set_optimizer_state_dict``, the
scheduler's ``load_state_dict`` and the RNG states. If no checkpoint was ever committed
(the trainer died during its first save), the partial directories are removed and
training starts afresh.

One deviation from DCP's helpers, for exactness: they initialise an empty optimizer
state with a zero-gradient step (Adam's step counter would be 1 before the first real
update, and training would change). A checkpoint taken before the first update (step 0)
therefore holds the optimizer's own ``state_dict`` (empty state, param groups) in its
blob instead, and its recovery leaves the state empty as it was.

Note: DCP unpickles ``.metadata`` and non-tensor entries with ``weights_only=False``;
the commit digests are checked first, but they guard against damage, not against a
checkpoint written by someone else.

Parts: the commit file is :mod:`lowdiff_lab.baselines.files`; DCP's daemon
:mod:`~lowdiff_lab.baselines.dcp_saver`; the names on disk and recovery
:mod:`~lowdiff_lab.baselines.dcp_resume`; what runs in the saver (:class:`CommittingWriter`)
and the strategy are here.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import os
import shutil
import time
import traceback
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
)

from lowdiff.errors import CheckpointWorkerError
from lowdiff.format import layout
from lowdiff.proc.locks import acquire_flock
from lowdiff.state import capture as st
from lowdiff_lab.baselines.base import BaselineCheckpointer
from lowdiff_lab.baselines.dcp_resume import (
    PREFIX,
    dir_name,
    drop_never_committed,
    recover,
    writer_lock,
)
from lowdiff_lab.baselines.dcp_saver import (
    acquire_process_saver,
    process_saver_available,
    release_process_saver,
)
from lowdiff_lab.baselines.files import commit_path, publish_commit, published

ASYNC_MODES = ("process", "thread")


# --------------------------------------------------------------------------- in the saver
# (DCP's daemon process, or the saver thread)

_held_locks: dict[str, int] = {}
"""Writer locks this process holds, by path (the saver is one thread per process)."""


def _hold_writer_lock(path: str) -> None:
    if path not in _held_locks:
        fd = acquire_flock(Path(path), blocking=True)
        assert fd is not None
        _held_locks[path] = fd


def _release_writer_lock(path: str) -> None:
    fd = _held_locks.pop(path, None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def kept_stager(options: Any) -> Any:
    """DCP's ``DefaultStager`` with ``options``, kept for every save of the strategy and
    closed only by its ``release()``.

    Its staging buffers are cached from one save to the next, and DCP's documentation
    asks the owner of a stager it is given to close it after the last save. Some torch
    versions (2.11) close it at the end of every ``async_save`` all the same, and the
    next save then fails inside the closed stager (``KeyError: <class 'type'>``); so
    ``close()`` does nothing here.
    """
    from torch.distributed.checkpoint.staging import DefaultStager

    class KeptStager(DefaultStager):
        def close(self) -> None:
            """Closed by :meth:`release` only (see :func:`kept_stager`)."""

        def release(self) -> None:
            DefaultStager.close(self)

    return KeptStager(options)


class CommittingWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` that holds the writer lock and publishes a commit file.

    Pickled to the saver with each request, so its methods run where DCP runs ``save``:
    ``set_up_storage_writer`` (lock) -> DCP writes the data files and ``.metadata`` ->
    ``finish`` (commit, unlock).
    """

    def __init__(
        self, path: Path, *, step: int, lock_path: Path, trainer_pid: int, quiet: bool
    ) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, overwrite=True)
        self.lowdiff_step = step
        self.lowdiff_lock = str(lock_path)
        self.lowdiff_trainer_pid = trainer_pid
        self.lowdiff_quiet = quiet

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.lowdiff_quiet and os.getpid() != self.lowdiff_trainer_pid:
            # DCP's daemon logs three INFO lines per save on the root logger; with a
            # checkpoint every step that floods the trainer's stderr (daemon only)
            logging.getLogger().setLevel(logging.WARNING)
        _hold_writer_lock(self.lowdiff_lock)
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)

    def finish(self, metadata: Any, results: Any) -> None:
        super().finish(metadata, results)
        try:
            publish_commit(Path(self.path), self.lowdiff_step)
        finally:
            _release_writer_lock(self.lowdiff_lock)


# --------------------------------------------------------------------------- the strategy


class DCPAsyncCheckpointer(BaselineCheckpointer):
    """Full checkpoints with ``torch.distributed.checkpoint.async_save`` (see the module docstring).

    Args:
        async_mode: ``"thread"`` (a saver thread in the training process: DCP's default,
            and the default here) or ``"process"`` (DCP's daemon process), which falls
            back to ``"thread"`` when this torch has no process-based saver.
        The other arguments are those of :class:`lowdiff.Checkpointer`.

    Example:
        >>> ck = lowdiff.Checkpointer("ck", model, opt, method="dcp-async", full_every=1)  # doctest: +SKIP
        >>> start = ck.resume()  # doctest: +SKIP
    """

    strategy = "dcp-async"

    def __init__(self, *args: Any, async_mode: str = "thread", **kwargs: Any) -> None:
        if async_mode not in ASYNC_MODES:
            raise ValueError(
                f"async_mode must be one of {', '.join(map(repr, ASYNC_MODES))}, got {async_mode!r}"
            )
        if dist.is_available() and dist.is_initialized():
            pg = dist.group.WORLD
            if pg is not None and torch.device("cpu") not in pg._device_types:
                raise ValueError(
                    "strategy 'dcp-async' needs a CPU backend in the default process group "
                    "(DCP's async_save requires one); initialise it with backend='cpu:gloo,cuda:nccl'"
                )
        super().__init__(*args, **kwargs)
        self.requested_async_mode = async_mode
        self.async_mode = (
            "process" if async_mode == "process" and process_saver_available() else "thread"
        )
        cuda = torch.cuda.is_available()
        # shared memory lets the staged tensors reach the daemon as handles; pinning
        # needs CUDA (DCP ignores it otherwise)
        self.staging: dict[str, bool] = {
            "use_pinned_memory": cuda,
            "use_shared_memory": self.async_mode == "process",
            "use_async_staging": False,
            "use_non_blocking_copy": cuda,
        }
        self._stager: Any = None
        self._saver_held = False
        self._pending: tuple[int, Future[Any], float] | None = None
        self._done_at: dict[int, float] = {}
        self._error: CheckpointWorkerError | None = None
        self._no_dist = True
        self._stats.update(
            {"process_saver": float(self.async_mode == "process"), "stage_s": 0.0, "wait_s": 0.0}
        )

    # ------------------------------------------------------------------ hooks
    def _manifest_extra(self) -> dict[str, Any]:
        return {
            "dcp": {
                "async_mode": self.async_mode,
                "requested_async_mode": self.requested_async_mode,
                "stager": "DefaultStager",
                "staging": self.staging,
                "torch": torch.__version__,
            }
        }

    def resume(self) -> int:
        """As :meth:`BaselineCheckpointer.resume`; first waits for a save that a killed
        trainer's daemon is still finishing, and drops partial saves if none was ever
        committed (see the module docstring)."""
        if not self._started:
            with writer_lock(self.root, self.start_timeout):
                drop_never_committed(self.root)
        return super().resume()

    def _after_resume(self) -> None:
        from torch.distributed.checkpoint.staging import StagingOptions

        self._stager = kept_stager(
            StagingOptions(
                use_pinned_memory=self.staging["use_pinned_memory"],
                use_shared_memory=self.staging["use_shared_memory"],
                use_async_staging=False,
                use_non_blocking_copy=self.staging["use_non_blocking_copy"],
            )
        )
        user_group = dist.is_available() and dist.is_initialized()
        if self.async_mode == "process":
            acquire_process_saver()
            self._saver_held = True
            # one rank (our own group): DCP's ordinary collective path in the daemon's
            # one-rank group; the user's group: each rank saves its own directory
            self._no_dist = user_group and dist.get_world_size() > 1
        else:
            self._no_dist = True

    def _checkpoint(self, step: int) -> None:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        t0 = time.perf_counter()
        self._wait_pending()  # back-pressure: the staging buffers are reused
        self._raise_background_error()
        t1 = time.perf_counter()
        self._stats["wait_s"] += t1 - t0
        full = self.root / layout.FULL_DIR
        full.mkdir(exist_ok=True)
        ckpt = full / dir_name(step)
        if ckpt.exists():  # a partial save of this step that recovery did not see
            with contextlib.suppress(FileNotFoundError):
                commit_path(ckpt).unlink()
            shutil.rmtree(ckpt)
        writer = CommittingWriter(
            ckpt,
            step=step,
            lock_path=self.root / layout.WRITER_LOCK_FILE,
            trainer_pid=os.getpid(),
            quiet=self.async_mode == "process",
        )
        kind = (
            AsyncCheckpointerType.PROCESS
            if self.async_mode == "process"
            else AsyncCheckpointerType.THREAD
        )
        fut = dcp.async_save(
            self._state_dict(step),
            storage_writer=writer,
            async_checkpointer_type=kind,
            async_stager=self._stager,
            no_dist=self._no_dist,
        )
        if not isinstance(fut, Future):  # an AsyncSaveResponse (async staging): not used here
            fut = fut.upload_completion
        fut.add_done_callback(functools.partial(self._mark_done, step))
        self._pending = (step, fut, t1)
        self._stats["stage_s"] += time.perf_counter() - t1

    def _mark_done(self, step: int, _fut: Future[Any]) -> None:
        self._done_at[step] = time.perf_counter()  # on the saver's thread

    def _state_dict(self, step: int) -> dict[str, Any]:
        rng_t, rng_extra = st.capture_rng(self._rng_layout)
        empty = not self.optimizer.state
        train: dict[str, Any] = {
            "step": step,
            "optimizer_state_empty": empty,
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "rng": {"tensors": rng_t, "extra": rng_extra},
        }
        if empty:  # before the first update: see the module docstring
            train["optimizer"] = self.optimizer.state_dict()
        blob = io.BytesIO()
        torch.save(train, blob)
        sd: dict[str, Any] = {
            "model": get_model_state_dict(self.model),
            "step": step,
            "train": blob.getvalue(),
        }
        if not empty:
            sd["optim"] = get_optimizer_state_dict(self.model, self.optimizer)
        return sd

    def _poll(self) -> None:
        if self._pending is None or not self._pending[1].done():
            return
        step, fut, t_submit = self._pending
        self._pending = None
        exc = fut.exception()
        if exc is not None:
            if self._error is None:
                self._error = CheckpointWorkerError(
                    f"DCP async_save of step {step} ({self.async_mode} saver) failed: "
                    f"{type(exc).__name__}: {exc}",
                    "".join(traceback.format_exception(exc)),
                    storage=_is_storage_error(exc),
                )
            return
        ckpt = self.root / layout.FULL_DIR / dir_name(step)
        try:
            commit = json.loads(commit_path(ckpt).read_bytes())
            self._stats["bytes_written"] += int(commit["bytes"])
        except (OSError, ValueError, KeyError) as e:
            self._error = CheckpointWorkerError(
                f"DCP async_save of step {step} finished without its commit file: {e}"
            )
            return
        self._stats["write_s"] += self._done_at.pop(step, time.perf_counter()) - t_submit
        self._durable = max(self._durable, step)
        self._retain_dirs()

    def _wait_pending(self) -> None:
        if self._pending is not None:
            futures.wait([self._pending[1]])  # DCP's CheckpointException is no Exception
            self._poll()

    def _flush(self) -> None:
        self._wait_pending()

    def _raise_background_error(self) -> None:
        self._poll()
        if self._error is not None:
            raise self._error

    def _shutdown(self) -> None:
        if self._pending is not None:  # only after an error: do not wait long for it
            futures.wait([self._pending[1]], timeout=self.start_timeout)
            self._pending = None
        if self._stager is not None:
            with contextlib.suppress(Exception):
                self._stager.release()
            self._stager = None
        if self._saver_held:
            self._saver_held = False
            release_process_saver(self.start_timeout)
        _release_writer_lock(str(self.root / layout.WRITER_LOCK_FILE))

    def _retain_dirs(self) -> None:
        """Keep the newest ``keep_full`` committed checkpoints; delete everything older."""
        if self.keep_full is None:
            return
        full = self.root / layout.FULL_DIR
        committed = [s for s, p in published(full, PREFIX, "") if commit_path(p).exists()]
        if len(committed) <= self.keep_full:
            return
        oldest_kept = committed[-self.keep_full]
        for s, p in published(full, PREFIX, ""):
            if s < oldest_kept:
                with contextlib.suppress(FileNotFoundError):
                    commit_path(
                        p
                    ).unlink()  # unpublish first: a crash leaves no half-deleted checkpoint
                shutil.rmtree(p, ignore_errors=True)

    # ------------------------------------------------------------------ recovery
    def _recover(self) -> int | None:
        found = recover(self.root, self.start_timeout, self.model, self.optimizer, self.scheduler)
        if found is None:
            return None
        step, self.recovery_stats = found
        return step


def _is_storage_error(exc: BaseException) -> bool:
    """True when the save failed in the storage (DCP wraps the rank's error)."""
    if isinstance(exc, OSError) and not isinstance(exc, ConnectionError):
        return True
    failures = getattr(exc, "failures", None)  # DCP's CheckpointException: rank -> (error, stack)
    if isinstance(failures, dict):
        for v in failures.values():
            e = v[0] if isinstance(v, tuple) and v else v
            if isinstance(e, BaseException) and _is_storage_error(e):
                return True
    return False

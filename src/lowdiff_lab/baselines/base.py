"""The contract every baseline strategy implements, and what they share.

A baseline is a checkpointing strategy lowdiff is compared against (``torch-save``,
``checkfreq``, ``gemini``, ``naive-dc``, ``dcp-async``). Users get one through the same
call as lowdiff's own methods, ``lowdiff.Checkpointer(DIR, model, opt,
method="checkfreq", ...)`` (registered by :mod:`lowdiff_lab.plugin`), and drive it with
the same loop::

    ck = Checkpointer(DIR, model, opt, method=..., full_every=f)  # validates, locks DIR
    start = ck.resume()     # restores the newest checkpoint, or writes the step-0 one
    for step in range(start, total):
        ...; loss.backward()
        ck.step()           # [compress the gradients] -> optimizer.step() -> scheduler.step()
                            # -> the strategy's checkpoint, every full_every steps
        opt.zero_grad()
    ck.close()              # waits until the last checkpoint is durable

What a subclass provides (all on the training process):

- ``_before_update(t)``: called before update ``t`` changes the state (CheckFreq waits
  for its in-flight snapshot here);
- ``_checkpoint(step)``: take the checkpoint of the state after ``step`` updates;
- ``_recover()``: restore the newest recoverable state into the live objects and return
  its step, with ``self.recovery_stats`` filled in (None: nothing to recover);
- ``_flush()`` and ``_shutdown()``: wait for in-flight work; stop background workers.

Directory: ``DIR/lowdiff.json`` (a checksummed manifest naming the strategy, so that a
directory is never read by a strategy that did not write it) and the strategy's files.
Files written with :func:`~lowdiff_lab.baselines.files.save_state` are published atomically and carry an xxh3-128
digest in a commit file next to them: a torn, truncated or altered checkpoint is named
and passed over at recovery, never loaded.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import time
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from lowdiff.compressors.base import Compressor
from lowdiff.errors import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    LowDiffError,
    RecoveryWarning,
)
from lowdiff.format import layout
from lowdiff.format.atomic import remove_stale_temps
from lowdiff.format.sfile import open_regular
from lowdiff.options import check_int
from lowdiff.proc.locks import lock_directory
from lowdiff.recovery.directory import check_directory, is_empty_dir
from lowdiff.recovery.stats import RecoveryStats
from lowdiff.state import capture as st
from lowdiff.state.sharded import refuse_sharded
from lowdiff.strategy import StepGrads, Strategy, compress_grads
from lowdiff_lab.baselines.files import (
    COMMIT_SUFFIX,
    commit_path,
    load_state,
    published,
    quarantine,
    read_committed,
    save_state,
    verify_commit,
)
from lowdiff_lab.baselines.training_state import capture_state, restore_state

__all__ = [
    "BASELINE_FORMAT",
    "BaselineCheckpointer",
    "BaselineOptions",
    "capture_state",
    "checkpoint_files",
    "commit_path",
    "is_baseline_dir",
    "load_state",
    "published",
    "quarantine",
    "restore_state",
    "save_state",
    "verify_baseline_dir",
]
"""What the baselines share: the contract, its options, and (from
:mod:`lowdiff_lab.baselines.files` and :mod:`lowdiff_lab.baselines.training_state`) the files
and the state they write."""

BASELINE_FORMAT = "lowdiff-baseline"
BASELINE_FORMAT_VERSION = 1


# --------------------------------------------------------------------------- the options


@dataclass(frozen=True)
class BaselineOptions:
    """The options every baseline takes, checked before the directory is locked.

    Raises:
        TypeError, ValueError: naming the option and its value.
    """

    compressor: Compressor | None = None
    """The training's gradient compressor (part of training, not of the checkpoint)."""
    full_every: int = 30
    """A checkpoint every this many steps (and at step 0)."""
    keep_full: int | None = 2
    """Checkpoints to keep on disk; None keeps everything."""
    start_timeout: float = 120.0
    """Seconds to wait for a background process to start or finish."""

    def __post_init__(self) -> None:
        if self.compressor is not None and not isinstance(self.compressor, Compressor):
            raise TypeError(
                "compressor must be a lowdiff.Compressor or None, "
                f"got {type(self.compressor).__name__}"
            )
        check_int("full_every", self.full_every, 1)
        if self.keep_full is not None:
            check_int("keep_full", self.keep_full, 1)
        object.__setattr__(self, "start_timeout", float(self.start_timeout))


# --------------------------------------------------------------------------- the contract


class BaselineCheckpointer(Strategy):
    """Common half of every baseline: validation, locking, the pipeline's stages and resume.

    Args:
        model, optimizer, directory, scheduler: as for :class:`lowdiff.Checkpointer`.
        compressor: the training's gradient compressor (applied to ``.grad`` before the
            optimizer, exactly as strategy ``"none"`` does), or None for uncompressed
            training. It is part of training, not of the checkpoint.
        full_every: a checkpoint every this many steps (and at step 0).
        keep_full: checkpoints to keep on disk; None keeps everything.
        start_timeout: seconds to wait for a background process to start or finish.
    """

    strategy: ClassVar[str] = ""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        directory: str | os.PathLike[str] | None,
        *,
        compressor: Compressor | None = None,
        full_every: int = 30,
        scheduler: Any | None = None,
        keep_full: int | None = 2,
        start_timeout: float = 120.0,
    ) -> None:
        st.check_training_objects(model, optimizer, scheduler)
        refuse_sharded(model, optimizer, self.strategy)
        st.refuse_lbfgs(optimizer)
        options = BaselineOptions(compressor, full_every, keep_full, start_timeout)
        if directory is None:
            raise ValueError(f"strategy {self.strategy!r} needs a checkpoint directory, got None")
        self.full_every = full_every
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.compressor, self.keep_full = compressor, keep_full
        self.name = self.strategy
        self.start_timeout = options.start_timeout
        self._params = st.optimizer_params(model, optimizer)
        self._numels = [p.numel() for _, p in self._params]
        self._rng_layout = st.RngLayout()
        self._step = 0
        self._durable = -1
        self._started = False
        self._closed = False
        self.recovery_stats: RecoveryStats | None = None
        self._stats: dict[str, float] = {
            "steps": 0,
            "checkpoints": 0,
            "stall_s": 0.0,
            "bytes_written": 0,
            "write_s": 0.0,
        }
        self.root = Path(directory)
        check_directory(self.root)
        self._lock_fd: int | None = lock_directory(
            self.root, "; two trainers cannot write to one checkpoint directory"
        )
        ref = weakref.ref(self)
        atexit.register(_close_at_exit, ref)

    # ------------------------------------------------------------------ public API
    @property
    def is_closed(self) -> bool:
        return self._closed

    @property
    def step_count(self) -> int:
        """Optimizer updates done so far."""
        return self._step

    @property
    def durable_step(self) -> int:
        """Newest step whose state is recoverable from disk (-1 before the first write)."""
        self._poll()
        return self._durable

    @property
    def stats(self) -> dict[str, float]:
        """Counters and timings of this session; ``stall_s`` is time ``step()`` spent blocked."""
        self._poll()
        return dict(self._stats, durable_step=self._durable)

    def resume(self) -> int:
        """Restore the newest recoverable checkpoint, or start an empty directory.

        Returns:
            The recovered step (0 for an empty directory).
        """
        if self._started:
            raise RuntimeError("resume() must be called once, before the first step()")
        remove_stale_temps(self.root)
        if is_empty_dir(self.root):
            self._start_fresh()
            return 0
        self._check_manifest(layout.read_manifest(self.root))
        step = self._recover()
        if step is None:
            raise LowDiffError(
                f"{self.root}: no recoverable checkpoint of strategy {self.strategy!r}"
            )
        self._step = step
        self._durable = max(self._durable, step)
        self._started = True
        self._after_resume()
        return step

    def begin_step(self) -> int:
        if self._closed:
            raise RuntimeError("step() after close()")
        if not self._started:
            if not is_empty_dir(self.root):
                raise LowDiffError(
                    f"{self.root} already holds checkpoints; call ck.resume() before the first step() "
                    "to continue from them, or use a new directory"
                )
            self._start_fresh()
        self._raise_background_error()
        return self._step

    def before_update(self, t: int) -> None:
        t0 = time.perf_counter()
        self._before_update(t)
        self._stats["stall_s"] += time.perf_counter() - t0

    def take_gradients(self, t: int) -> StepGrads:
        """The training's compression (as strategy ``"none"`` applies it), or nothing."""
        if self.compressor is None:
            return StepGrads()
        t0 = time.perf_counter()
        compress_grads(self._params, self._numels, self.compressor, t)
        return StepGrads(compress_s=time.perf_counter() - t0)

    def after_update(self, t: int, grads: StepGrads, hp: Any, update_s: float) -> None:
        """Checkpoint the state after update ``t`` every ``full_every`` steps."""
        self._step = t + 1
        self._stats["steps"] += 1
        if self._step % self.full_every == 0:
            t0 = time.perf_counter()
            self._checkpoint(self._step)
            self._stats["checkpoints"] += 1
            self._stats["stall_s"] += time.perf_counter() - t0

    def flush(self) -> int:
        """Wait until every checkpoint taken so far is durable; returns the durable step."""
        if self._started and not self._closed:
            self._flush()
            self._raise_background_error()
        return self._durable

    def close(self) -> None:
        """Flush, stop background work and release the directory."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._started:
                self._flush()
                self._raise_background_error()
        finally:
            self._shutdown()
            self._release()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(strategy={self.strategy!r}, directory={str(self.root)!r}, "
            f"full_every={self.full_every}, step={self._step})"
        )

    # ------------------------------------------------------------------ subclass hooks
    def _before_update(self, t: int) -> None:
        """Called before update ``t`` overwrites the state."""

    def _checkpoint(self, step: int) -> None:
        raise NotImplementedError

    def _recover(self) -> int | None:
        raise NotImplementedError

    def _after_resume(self) -> None:
        """Called once the recovered state is loaded (start background workers here)."""

    def _flush(self) -> None:
        """Wait for in-flight checkpoints."""

    def _shutdown(self) -> None:
        """Stop background workers (after ``_flush``, or on an error)."""

    def _poll(self) -> None:
        """Collect finished background work (update ``self._durable``)."""

    def _raise_background_error(self) -> None:
        """Raise :class:`lowdiff.CheckpointWorkerError` if background work failed."""

    def _manifest_extra(self) -> dict[str, Any]:
        return {}

    # ------------------------------------------------------------------ shared machinery
    def _start_fresh(self) -> None:
        self._write_manifest()
        self._started = True
        self._after_resume()
        self._checkpoint(0)

    def _manifest_body(self) -> dict[str, Any]:
        return {
            "format": BASELINE_FORMAT,
            "format_version": BASELINE_FORMAT_VERSION,
            "strategy": self.strategy,
            "optimizer": st.class_path(self.optimizer),
            "full_every": self.full_every,
            "keep_full": self.keep_full,
            **self._manifest_extra(),
        }

    def _write_manifest(self) -> None:
        layout.write_manifest(self.root, self._manifest_body())

    def _check_manifest(self, manifest: dict[str, Any]) -> None:
        if manifest.get("strategy") != self.strategy:
            raise CheckpointMismatchError(
                f"{self.root} was written by strategy {manifest.get('strategy')!r}, "
                f"this Checkpointer uses {self.strategy!r}"
            )
        if manifest.get("format") != BASELINE_FORMAT:
            raise CheckpointMismatchError(
                f"{self.root}: format {manifest.get('format')!r}, expected {BASELINE_FORMAT!r}"
            )
        want = st.class_path(self.optimizer)
        if manifest.get("optimizer") != want:
            raise CheckpointMismatchError(
                f"the checkpoint was written with optimizer {manifest.get('optimizer')}, got {want}"
            )

    def _capture(self, step: int) -> dict[str, Any]:
        return capture_state(self.model, self.optimizer, self.scheduler, step, self._rng_layout)

    def _recover_newest_file(
        self, directory: Path, prefix: str, suffix: str, source: str = "disk"
    ) -> int | None:
        """Load the newest intact ``save_state`` file; damaged ones are quarantined with a warning."""
        t_start = time.perf_counter()
        skipped: list[tuple[str, str]] = []
        for step, path in reversed(published(directory, prefix, suffix)):
            stats = RecoveryStats(full_step=step, step=step, source=source)
            try:
                state = load_state(path, stats)
                if not isinstance(state, dict) or state.get("step") != step:
                    raise CorruptCheckpointError(path, "its contents do not match its name")
            except CorruptCheckpointError as e:
                skipped.append((str(e.path), e.reason))
                warnings.warn(
                    f"recovery passed over {e.path}: {e.reason}", RecoveryWarning, stacklevel=3
                )
                quarantine(self.root, path)
                continue
            t0 = time.perf_counter()
            restore_state(state, self.model, self.optimizer, self.scheduler, where=path.name)
            stats.replay_s += time.perf_counter() - t0
            stats.skipped = skipped
            stats.total_s = time.perf_counter() - t_start
            self.recovery_stats = stats
            return step
        return None

    def _retain(self, directory: Path, prefix: str, suffix: str) -> None:
        """Delete checkpoints beyond the newest ``keep_full`` (with their commit files)."""
        if self.keep_full is None:
            return
        files = published(directory, prefix, suffix)
        for _, p in files[: max(0, len(files) - self.keep_full)]:
            for q in (commit_path(p), p):
                with contextlib.suppress(FileNotFoundError):
                    q.unlink()

    def _release(self) -> None:
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if not self._closed:
                self._shutdown()
                self._release()


def _close_at_exit(ref: weakref.ref[BaselineCheckpointer]) -> None:
    ck = ref()
    if ck is not None and not ck._closed:
        with contextlib.suppress(Exception):
            ck.close()


# --------------------------------------------------------------------------- inspect / verify


def is_baseline_dir(root: Path) -> bool:
    """True when ``root`` holds a baseline strategy's manifest (read, not verified)."""
    try:
        with open_regular(root / layout.MANIFEST) as f:
            body = json.loads(f.read()).get("lowdiff_manifest", {})
    except (OSError, ValueError, AttributeError, LowDiffError):
        return False
    return isinstance(body, dict) and body.get("format") == BASELINE_FORMAT


def checkpoint_files(root: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every published checkpoint (file or DCP directory), oldest first.

    Checkpoints live in ``full/`` (and ``diffs/`` for naive-dc); each has a commit file.
    """
    out = []
    for sub in (layout.FULL_DIR, "diffs"):
        d = root / sub
        if not d.is_dir():
            continue
        for p in sorted(d.iterdir()):
            if p.name.startswith(".") or p.name.endswith(COMMIT_SUFFIX):
                continue
            digits = "".join(c for c in p.name.split("-")[-1].split(".")[0] if c.isdigit())
            out.append((int(digits) if digits else -1, p))
    return sorted(out)


def verify_baseline_dir(root: Path) -> tuple[int, list[tuple[Path, str]]]:
    """Check the manifest and every checkpoint against its commit file.

    Returns:
        (number of items checked, [(path, reason) for every bad one]).
    """
    bad: list[tuple[Path, str]] = []
    try:
        layout.read_manifest(root)
    except CorruptCheckpointError as e:
        bad.append((e.path, e.reason))
    checked = 1
    for step, p in checkpoint_files(root):
        checked += 1
        try:
            if p.is_dir():
                verify_commit(p, step)
            else:
                read_committed(p)
        except CorruptCheckpointError as e:
            bad.append((e.path, e.reason))
    for sub in (layout.FULL_DIR, "diffs"):
        d = root / sub
        if d.is_dir():
            for c in d.glob(f"*{COMMIT_SUFFIX}"):
                if not c.with_name(c.name[: -len(COMMIT_SUFFIX)]).exists():
                    checked += 1
                    bad.append((c, "commit file of a checkpoint that is missing"))
    return checked, bad

"""``dcp-async``'s checkpoints on disk: their names, and recovery from them.

A checkpoint is the DCP directory ``DIR/full/dcp-{step:012d}/`` published by its commit
file (:func:`lowdiff_lab.baselines.files.publish_commit`). Recovery, under the saver's writer
lock (a killed trainer's daemon may still be finishing a save), takes the newest
directory whose commit is intact and whose files match it (a damaged or uncommitted one
is named in a :class:`lowdiff.RecoveryWarning` and moved to ``DIR/quarantine/``),
``dcp.load``\\ s it in place into the live objects' state dicts and applies them.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from lowdiff.errors import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    LowDiffError,
    RecoveryWarning,
)
from lowdiff.format import layout
from lowdiff.proc.locks import acquire_flock, lock_holder
from lowdiff.recovery.stats import RecoveryStats
from lowdiff.state import capture as st
from lowdiff_lab.baselines.files import commit_path, published, quarantine, verify_commit
from lowdiff_lab.baselines.training_state import check_scheduler

PREFIX = "dcp-"
_NO_DIST_WARNING = r"torch\.distributed is (disabled, )?unavailable or uninitialized"


def dir_name(step: int) -> str:
    """The name of the checkpoint directory of ``step``."""
    return f"{PREFIX}{step:012d}"


@contextlib.contextmanager
def writer_lock(root: Path, timeout: float) -> Iterator[None]:
    """Hold the saver's lock: a killed trainer's daemon may still be finishing a save."""
    path = root / layout.WRITER_LOCK_FILE
    if not root.is_dir():
        yield
        return
    deadline = time.monotonic() + timeout
    while (fd := acquire_flock(path, blocking=False)) is None:
        if time.monotonic() > deadline:
            raise LowDiffError(
                f"{root}: a checkpoint save is still running ({lock_holder(path)}) "
                f"after {timeout:.0f} s"
            )
        time.sleep(0.05)
    try:
        yield
    finally:
        os.close(fd)


def candidates(root: Path) -> list[tuple[int, Path]]:
    """Checkpoint directories and stray commit files, oldest first."""
    full = root / layout.FULL_DIR
    steps = dict(published(full, PREFIX, ""))
    for s, c in published(full, PREFIX, ".commit"):
        steps.setdefault(s, c.with_name(dir_name(s)))
    return sorted(steps.items())


def drop_never_committed(root: Path) -> None:
    """No commit was ever published: remove the partial first saves (nothing was durable)."""
    full = root / layout.FULL_DIR
    if not full.is_dir() or any(commit_path(p).exists() for _, p in candidates(root)):
        return
    for _, p in candidates(root):
        warnings.warn(
            f"recovery removed {p}: an unfinished save, and no checkpoint was ever committed",
            RecoveryWarning,
            stacklevel=4,
        )
        shutil.rmtree(p, ignore_errors=True)


def recover(
    root: Path,
    timeout: float,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
) -> tuple[int, RecoveryStats] | None:
    """Load the newest intact checkpoint into the live objects; its step and statistics
    (None: no checkpoint is intact)."""
    t_start = time.perf_counter()
    skipped: list[tuple[str, str]] = []
    with writer_lock(root, timeout):
        for step, path in reversed(candidates(root)):
            stats = RecoveryStats(full_step=step, step=step, source="disk")
            try:
                load(path, step, stats, model, optimizer, scheduler)
            except CorruptCheckpointError as e:
                skipped.append((str(e.path), e.reason))
                warnings.warn(
                    f"recovery passed over {e.path}: {e.reason}", RecoveryWarning, stacklevel=4
                )
                quarantine(root, path)
                continue
            stats.skipped = skipped
            stats.total_s = time.perf_counter() - t_start
            return step, stats
    return None


def load(
    ckpt: Path,
    step: int,
    stats: RecoveryStats,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
) -> None:
    """Verify ``ckpt`` and load it into the live objects."""
    t0 = time.perf_counter()
    saved = _verify(ckpt, step, stats)
    stats.read_s += time.perf_counter() - t0
    t1 = time.perf_counter()
    template, train = _read(ckpt, step, saved, model, optimizer)
    t2 = time.perf_counter()
    stats.decode_s += t2 - t1
    _apply(ckpt, template, train, model, optimizer, scheduler)
    stats.replay_s += time.perf_counter() - t2


def _verify(ckpt: Path, step: int, stats: RecoveryStats) -> set[str]:
    """Check ``ckpt`` against its commit; the flat keys its DCP metadata holds."""
    commit = verify_commit(ckpt, step)
    try:
        saved = set(dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata)
    except Exception as e:  # a verified file that DCP cannot read is foreign
        raise CorruptCheckpointError(ckpt, f"unreadable DCP metadata ({e})") from None
    stats.bytes_read += int(commit["bytes"])
    stats.files_read += len(commit["files"])
    return saved


def _read(
    ckpt: Path,
    step: int,
    saved: set[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``dcp.load`` the checkpoint into state dicts of the live objects; returns them and
    the training blob (scheduler, RNG, step)."""
    template: dict[str, Any] = {"model": get_model_state_dict(model), "step": -1, "train": b""}
    if any(k.startswith("optim.") for k in saved):
        template["optim"] = get_optimizer_state_dict(model, optimizer)
    flat, _ = flatten_state_dict(template)
    if saved != set(flat):
        extra, missing = sorted(saved - set(flat)), sorted(set(flat) - saved)
        raise CheckpointMismatchError(
            f"{ckpt.name}: the model or optimizer does not match the checkpoint "
            f"(only in the checkpoint: {extra[:5]}, only in the training: {missing[:5]})"
        )
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
            dcp.load(template, checkpoint_id=ckpt, no_dist=True)
    except Exception as e:
        text = str(e)
        if "Size mismatch" in text or "Missing key" in text:
            raise CheckpointMismatchError(
                f"{ckpt.name}: the model or optimizer does not match the checkpoint: {e}"
            ) from None
        raise CorruptCheckpointError(ckpt, f"DCP cannot load it ({e})") from None
    try:
        train = torch.load(io.BytesIO(template["train"]), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CorruptCheckpointError(ckpt, f"unreadable training state ({e})") from None
    if template["step"] != step or not isinstance(train, dict) or train.get("step") != step:
        raise CorruptCheckpointError(ckpt, "its contents do not match its name")
    return template, train


def _apply(
    ckpt: Path,
    template: dict[str, Any],
    train: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
) -> None:
    """Load what :func:`_read` read into the live objects."""
    try:
        set_model_state_dict(model, template["model"])
    except RuntimeError as e:
        raise CheckpointMismatchError(
            f"{ckpt.name}: the model does not match the checkpoint: {e}"
        ) from None
    if train["optimizer_state_empty"]:
        optimizer.state.clear()
        optimizer.load_state_dict(train["optimizer"])
    else:
        set_optimizer_state_dict(model, optimizer, template["optim"])
    check_scheduler(ckpt.name, has_state=train["scheduler"] is not None, scheduler=scheduler)
    if scheduler is not None:
        scheduler.load_state_dict(train["scheduler"])
    st.restore_rng(train["rng"]["tensors"], train["rng"]["extra"])

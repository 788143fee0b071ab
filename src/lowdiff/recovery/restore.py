"""The recovery entry points: :func:`restore` (public) and :func:`recover` (its stats).

Both accept a single process's checkpoint directory, which :mod:`lowdiff.recovery.replay`
restores, and a distributed job's, which :mod:`lowdiff.recovery.job` rebuilds from every
shard; this module sits above the two and picks one by what the directory holds.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from lowdiff.errors import (
    ArgumentTypeError,
    CorruptCheckpointError,
    InvalidArgumentError,
    RecoveryError,
)
from lowdiff.recovery.fsdp2 import recover_fsdp2
from lowdiff.recovery.job import recover_job
from lowdiff.recovery.job_layout import is_job_dir, job_sharding
from lowdiff.recovery.replay import pass_over_full, replay, warn_damaged
from lowdiff.recovery.scan import make_plan, scan
from lowdiff.recovery.stats import RecoveryStats
from lowdiff.state import capture as st
from lowdiff.state.sharded import FSDP2, refuse_sharded

__all__ = ["recover", "recover_shard", "restore"]


def recover(
    root: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None = None,
    step: int | None = None,
) -> RecoveryStats:
    """Restore the live objects to ``step`` (None: the newest recoverable step).

    ``root`` may also be a distributed job's directory (written by any number of ranks):
    the state is rebuilt from every shard, with rank 0's per-rank state (see
    :func:`lowdiff.recovery.job.recover_job`).
    """
    st.check_training_objects(model, optimizer, scheduler)
    refuse_sharded(model, optimizer, "lowdiff.restore")
    root = Path(root)
    if is_job_dir(root):
        if job_sharding(root) == FSDP2:
            return recover_fsdp2(root, model, optimizer, scheduler, step)
        return recover_job(root, model, optimizer, scheduler, step)
    return recover_shard(root, model, optimizer, scheduler, step)


def recover_shard(
    root: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None = None,
    step: int | None = None,
) -> RecoveryStats:
    """Restore the live objects from one checkpoint directory (a single process's, or
    under ``fully_shard`` this rank's shard directory, into its sharded model)."""
    sc = scan(root)
    skipped = warn_damaged(sc.problems, step)
    bad: set[Path] = set()
    while True:
        try:
            plan = make_plan(sc, step, bad)
        except RecoveryError as e:
            if not bad:
                raise
            damaged = "; ".join(f"{Path(p).name}: {why}" for p, why in skipped)
            raise RecoveryError(f"{e} (damaged: {damaged})") from None
        try:
            stats = replay(root, sc, plan, model, optimizer, scheduler, strict=step is not None)
        except CorruptCheckpointError as e:
            # the full checkpoint itself is damaged: try the next plan without it
            pass_over_full(e, bad, skipped)
            continue
        stats.skipped = skipped + stats.skipped
        return stats


def restore(
    directory: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None = None,
    step: int | None = None,
    *,
    extra_state: dict[str, Any] | None = None,
) -> int:
    """Restore model, optimizer, scheduler and RNG state to a recoverable step.

    Args:
        directory: a lowdiff checkpoint directory, or a distributed job's (written by any
            number of ranks; restored in this process, with rank 0's buffers and RNG).
        model: the model, built the same way as for training (same parameter names and shapes).
        optimizer: an optimizer of the same type over ``model``'s parameters.
        scheduler: the LR scheduler, if training used one.
        step: any recoverable step; None picks the newest.
        extra_state: the objects training passed as ``extra_state`` (same names): each
            gets ``load_state_dict()`` with its state at the restored step.

    Returns:
        The step restored (the number of optimizer updates the state has seen).

    Example:
        >>> step = lowdiff.restore("runs/ckpt", model, optimizer, step=120)  # doctest: +SKIP
    """
    if not isinstance(directory, (str, os.PathLike)):
        raise ArgumentTypeError(f"directory must be a path (str or os.PathLike), got {directory!r}")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise InvalidArgumentError(f"step must be a non-negative int or None, got {step!r}")
    extra = st.check_extra_state(extra_state)
    stats = recover(directory, model, optimizer, scheduler, step)
    st.apply_extra(extra, stats.extra, f"{directory} step {stats.step}")
    return stats.step

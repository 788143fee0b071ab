"""The small, fully deterministic training job every torture part uses.

The trajectory depends only on the step number: the data of step ``t`` comes from a
generator seeded with ``t``, dropout draws from the global RNG (which checkpoints
restore), and the compressor has no error feedback. A resumed run therefore continues
exactly like an uninterrupted one, so every recovered state can be compared bit for bit
with the reference trajectory.

LowDiff+ (``method="lowdiff+"``) trains on the uncompressed gradients; its reference
is the same job with :class:`~lowdiff.NoCompression` (``reference(n, plus=True)``).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import lowdiff
from lowdiff.state.capture import snapshot_state
from lowdiff_lab import checkpointers

FULL_EVERY = 4
BATCH_SIZE = 3
KEEP_FULL = 1
PERSIST_EVERY = 3
"""LowDiff+: the replica is persisted as a full checkpoint every this many steps."""
IDLE_TIMEOUT = 20.0
"""LowDiff+: seconds a replica whose trainer died waits for a new one."""


def build(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """Model, optimizer and scheduler, initialised from ``seed``."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.BatchNorm1d(32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 4)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.9)
    return model, opt, sched


def compressor() -> lowdiff.Compressor:
    return lowdiff.TopK(ratio=0.1, error_feedback=False)


def loss_at(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    return nn.functional.mse_loss(model(x), y)


def checkpointer(directory: str | Path | None, **kw: Any) -> tuple[Any, ...]:
    """A fresh model, optimizer and scheduler with a Checkpointer on ``directory``."""
    model, opt, sched = build()
    kw.setdefault("full_every", FULL_EVERY)
    kw.setdefault("batch_size", BATCH_SIZE)
    kw.setdefault("keep_full", KEEP_FULL)
    kw.setdefault("start_timeout", 60.0)
    if directory is not None:
        kw.setdefault("idle_timeout", IDLE_TIMEOUT)
    ck = checkpointers.build(directory, model, opt, scheduler=sched, compressor=compressor(), **kw)
    return ck, model, opt, sched


def plus_checkpointer(directory: str | Path, **kw: Any) -> tuple[Any, ...]:
    """A fresh model, optimizer and scheduler with a LowDiff+ Checkpointer on ``directory``."""
    model, opt, sched = build()
    kw.setdefault("persist_every", PERSIST_EVERY)
    kw.setdefault("keep_full", KEEP_FULL)
    kw.setdefault("idle_timeout", IDLE_TIMEOUT)
    kw.setdefault("start_timeout", 60.0)
    ck = checkpointers.build(directory, model, opt, "lowdiff+", scheduler=sched, **kw)
    return ck, model, opt, sched


def reference(n_steps: int, *, plus: bool = False) -> list[dict[str, torch.Tensor]]:
    """The state after every step ``0..n_steps`` of the uninterrupted run.

    ``plus``: the trajectory LowDiff+ trains (uncompressed gradients) instead of LowDiff's.
    """
    with one_thread():
        return _reference(n_steps, plus)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Train on one thread, as the jobs do: another thread count may round differently."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _reference(n_steps: int, plus: bool = False) -> list[dict[str, torch.Tensor]]:
    if plus:
        model, opt, sched = build()
        ck = lowdiff.Checkpointer(
            None, model, opt, scheduler=sched, method="compression-only",
            compressor=lowdiff.NoCompression(),
        )  # fmt: skip
    else:
        ck, model, opt, sched = checkpointer(None, strategy="none")
    ck.resume()
    out = [snapshot_state(model, opt, sched)]
    for step in range(n_steps):
        loss_at(model, step).backward()
        ck.step()
        opt.zero_grad()
        out.append(snapshot_state(model, opt, sched))
    ck.close()
    return out


def train_directory(directory: Path, n_steps: int, keep_full: int | None = None) -> None:
    """Write a checkpoint directory of ``n_steps`` steps (every full checkpoint kept)."""
    ck, model, opt, _ = checkpointer(directory, keep_full=keep_full)
    try:
        with one_thread():
            ck.resume()
            for step in range(n_steps):
                loss_at(model, step).backward()
                ck.step()
                opt.zero_grad()
    finally:
        ck.close()

"""Shared training harness of the baseline tests.

``Run`` builds a small deterministic training job (an MLP with BatchNorm and dropout, so
buffers and the RNG are part of the state; Adam; a step scheduler). ``reference(n)``
gives the exact state after ``n`` uninterrupted steps, to compare a recovery against.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import lowdiff
from lowdiff.state.capture import diff_states, snapshot_state


def build(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)
    return model, opt, sched


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)


def train_step(model: nn.Module, step: int) -> None:
    x, y = batch(step)
    nn.functional.cross_entropy(model(x), y).backward()


def run(
    directory: Path | None,
    start: int,
    stop: int,
    *,
    strategy: str,
    objects: tuple[nn.Module, torch.optim.Optimizer, Any] | None = None,
    close: bool = True,
    **kwargs: Any,
) -> tuple[Any, tuple[nn.Module, torch.optim.Optimizer, Any], int]:
    """Train steps ``[resumed, stop)`` under a Checkpointer; returns (ck, objects, resumed step)."""
    model, opt, sched = objects or build()
    ck = lowdiff.Checkpointer(model, opt, directory, strategy=strategy, scheduler=sched, **kwargs)
    resumed = ck.resume()
    assert resumed >= start or start == 0
    for t in range(resumed, stop):
        train_step(model, t)
        ck.step()
        opt.zero_grad()
    if close:
        ck.close()
    return ck, (model, opt, sched), resumed


def reference(steps: int, compressor: Any = None) -> dict[str, torch.Tensor]:
    """The exact state after ``steps`` uninterrupted steps (no checkpointing)."""
    model, opt, sched = build()
    ck = lowdiff.Checkpointer(
        None,
        model,
        opt,
        method="compression-only",
        scheduler=sched,
        compressor=compressor or lowdiff.NoCompression(),
    )
    ck.resume()
    for t in range(steps):
        train_step(model, t)
        ck.step()
        opt.zero_grad()
    ck.close()
    return snapshot_state(model, opt, sched)


def state_of(objects: tuple[nn.Module, torch.optim.Optimizer, Any]) -> dict[str, torch.Tensor]:
    return snapshot_state(*objects)


def assert_exact(want: dict[str, torch.Tensor], objects: Any) -> None:
    diffs = diff_states(want, state_of(objects))
    assert not diffs, f"recovered state differs in {len(diffs)} entries: {diffs[:8]}"

"""Gradient accumulation under ``fully_shard`` with LowDiff+, 2 gloo ranks.

Each step accumulates 3 micro-batches, the first two with
``set_requires_gradient_sync(False)`` (no reduce-scatter: FSDP2 accumulates the unsharded
gradients) and the last one with it on, which reduce-scatters the sum into each rank's
gradient shard. A run checkpointed every step by ``ck.step()``, stopped after step 3 and
resumed by a new Checkpointer, ends bit-identical (``torch.equal``) to the same loop
without lowdiff: model and AdamW state shards, scheduler, and the RNG that dropout draws.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp
from tests.ddp.spawned import join_group, run_ranks
from torch import nn

import lowdiff
from lowdiff.state.capture import diff_states, snapshot_state

if not hasattr(torch.distributed.fsdp, "fully_shard"):
    pytest.skip("fully_shard (FSDP2) is public from torch 2.6", allow_module_level=True)

WORLD, STEPS, MICRO = 2, 6, 3


def _build(mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 5))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.9)


def _steps(model: Any, opt: Any, sched: Any, ck: Any, rank: int, a: int, b: int) -> None:
    for step in range(a, b):
        for micro in range(MICRO):
            model.set_requires_gradient_sync(micro == MICRO - 1)
            g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 5, generator=g)
            (((model(x) - y) ** 2).mean() / MICRO).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # fires: the norm is large
        if ck is None:
            opt.step()
            sched.step()
        else:
            ck.step()  # steps the optimizer and the scheduler
        opt.zero_grad()


def _rank(rank: int, tmp: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    join_group(rank, WORLD, tmp / "store")
    mesh = init_device_mesh("cpu", (WORLD,))
    ref = _build(mesh)
    torch.manual_seed(100 + rank)
    _steps(*ref, None, rank, 0, STEPS)  # no lowdiff
    want = snapshot_state(*ref)  # this rank's shards, the scheduler and the RNG
    for a, b in ((0, 3), (3, STEPS)):
        model, opt, sched = _build(mesh)
        ck = lowdiff.Checkpointer(tmp / "job", model, opt, method="lowdiff+", scheduler=sched)
        torch.manual_seed(100 + rank)  # replaced by the saved RNG state when resuming
        assert ck.resume() == a
        _steps(model, opt, sched, ck, rank, a, b)
        ck.close()
        assert ck.durable_step == b
    assert diff_states(want, snapshot_state(model, opt, sched)) == []
    dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_accumulation_without_gradient_sync_resumes_bit_exactly(tmp_path: Path) -> None:
    assert run_ranks(_rank, WORLD, tmp_path, timeout=120) == [0] * WORLD

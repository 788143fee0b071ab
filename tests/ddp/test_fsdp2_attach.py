"""``lowdiff.attach`` on a ``fully_shard``ed model (LowDiff+), 2 gloo ranks.

The unmodified loop (``optimizer.step()``, ``scheduler.step()``) is checkpointed; a run
stopped after step 4 and resumed by a new attach ends where an uninterrupted loop without
lowdiff does, bit for bit, with clipping firing at every step. The job, exported with
``--format dcp`` in one process, loads into a new ``fully_shard`` model with ``dcp.load``
and ``set_state_dict``, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp
from tests.ddp.spawned import join_group, run_ranks
from torch import nn

import lowdiff

if not hasattr(torch.distributed.fsdp, "fully_shard"):
    pytest.skip("fully_shard (FSDP2) is public from torch 2.6", allow_module_level=True)

WORLD, STEPS, MAX_NORM = 2, 6, 0.05


def _loop(
    model: nn.Module, opt: torch.optim.Optimizer, sched: object, rank: int, a: int, b: int
) -> int:
    clipped = 0
    for step in range(a, b):
        g = torch.Generator().manual_seed(31 * step + rank)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 5, generator=g)
        ((model(x) - y) ** 2).mean().backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        clipped += int(norm.full_tensor() > MAX_NORM)
        opt.step()
        sched.step()  # type: ignore[attr-defined]
        opt.zero_grad()
    return clipped


def _rank(rank: int, tmp: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    join_group(rank, WORLD, tmp / "store")
    mesh = init_device_mesh("cpu", (WORLD,))

    def build() -> tuple[nn.Module, torch.optim.Optimizer, object]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 5))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.9)

    ref, ref_opt, ref_sched = build()
    _loop(ref, ref_opt, ref_sched, rank, 0, STEPS)  # no lowdiff
    clipped = 0
    for a, b in ((0, 4), (4, STEPS)):
        model, opt, sched = build()
        ck = lowdiff.attach(tmp / "job", model, opt, method="lowdiff+", scheduler=sched)
        assert ck.resume() == a
        clipped += _loop(model, opt, sched, rank, a, b)
        ck.close()
        assert ck.durable_step == b
    assert clipped == STEPS
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.to_local(), q.to_local()), n
        for k, v in opt.state[p].items():
            w = ref_opt.state[q][k]
            assert torch.equal(
                getattr(v, "to_local", lambda v=v: v)(), getattr(w, "to_local", lambda w=w: w)()
            ), (n, k)
    assert sched.state_dict() == ref_sched.state_dict()  # type: ignore[attr-defined]

    # the job exported as dcp (in one process) loads into a new fully_shard model
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if rank == 0:
        assert lowdiff.export(tmp / "job", out=tmp / "dcp", format="dcp") == STEPS
    dist.barrier()
    fresh, fresh_opt, _ = build()
    msd, osd = get_state_dict(fresh, fresh_opt)
    state = {"model": msd, "optimizer": osd}
    dcp_load(state, checkpoint_id=str(tmp / "dcp"))
    set_state_dict(
        fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    for (n, p), q in zip(fresh.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p.to_local(), q.to_local()), n
        assert set(fresh_opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}, n
        for k, v in fresh_opt.state[p].items():
            w = opt.state[q][k]
            assert torch.equal(
                getattr(v, "to_local", lambda v=v: v)(), getattr(w, "to_local", lambda w=w: w)()
            ), (n, k)
    dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_attach_checkpoints_an_unmodified_fsdp2_loop(tmp_path: Path) -> None:
    assert run_ranks(_rank, WORLD, tmp_path, timeout=120) == [0] * WORLD

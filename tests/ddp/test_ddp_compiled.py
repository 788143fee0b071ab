"""Under DDP, a ``torch.compile``d model's job uses the canonical names, 2 gloo ranks.

A DDP job of the plain model is resumed by the compiled one (``DDP(torch.compile(m))``),
and that job restores into the plain model in one process: the same bits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tests.ddp.spawned import join_group, run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lowdiff

WORLD = 2


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


def _train(model: nn.Module, opt: torch.optim.Optimizer, job: Path, rank: int, steps: int) -> int:
    ck = lowdiff.Checkpointer(job, model, opt, method="lowdiff+", full_every=2)
    start = ck.resume()
    for step in range(start, steps):
        g = torch.Generator().manual_seed(31 * step + rank)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        ((model(x) - y) ** 2).mean().backward()
        ck.step()
        opt.zero_grad()
    ck.close()
    return start


def _rank(rank: int, tmp: Path) -> None:
    join_group(rank, WORLD, tmp / "store")
    plain = DDP(_net())
    _train(plain, torch.optim.AdamW(plain.parameters(), lr=0.01), tmp / "job", rank, 3)
    net = _net()
    compiled = DDP(torch.compile(net, backend="eager"))
    opt = torch.optim.AdamW(compiled.parameters(), lr=0.01)
    start = _train(compiled, opt, tmp / "job", rank, 5)
    if rank == 0:
        names = {id(p): n for n, p in net.named_parameters()}
        state = {f"model/{k}": v for k, v in net.state_dict().items()}
        for p, s in opt.state.items():
            state.update({f"optim/{names[id(p)]}/{k}": v for k, v in s.items()})
        state["start"] = torch.tensor(start)
        torch.save(state, tmp / "state.pt")
    dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ddp_plain_job_resumes_compiled_and_restores_plain(tmp_path: Path) -> None:
    assert run_ranks(_rank, WORLD, tmp_path, timeout=180) == [0] * WORLD
    want = torch.load(tmp_path / "state.pt")
    assert int(want.pop("start")) == 3  # the compiled job resumed the plain one
    plain = _net()
    opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
    assert lowdiff.restore(tmp_path / "job", plain, opt) == 5
    names = {id(p): n for n, p in plain.named_parameters()}
    got = {f"model/{k}": v for k, v in plain.state_dict().items()}
    for p, s in opt.state.items():
        got.update({f"optim/{names[id(p)]}/{k}": v for k, v in s.items()})
    assert len(want) == 4 + 4 * 3 and want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)

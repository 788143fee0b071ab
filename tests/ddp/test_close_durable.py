"""Under DDP, ``durable_step`` after ``close()`` is the job's final durable step.

During training the ranks exchange their durable steps in the background, so the job-wide
value trails by a step; ``close()`` makes every step durable, and then says so.
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

WORLD, STEPS = 2, 10


def _job(rank: int, job: Path, store: Path, strategy: str, **options):
    """This rank's DDP model, optimizer and Checkpointer (every test's, and each rank's)."""
    join_group(rank, WORLD, store)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = {"compressor": lowdiff.TopK(0.5)} if strategy == "lowdiff" else {}
    ck = lowdiff.Checkpointer(model, opt, job, strategy=strategy, full_every=100, **kw, **options)
    return model, opt, ck


def _rank(rank: int, job: Path, out: Path, store: Path, strategy: str) -> None:
    # records are written in batches of 4: steps 9 and 10 wait for close()
    model, opt, ck = _job(rank, job, store, strategy, batch_size=4)
    ck.resume()
    for step in range(STEPS):
        g = torch.Generator().manual_seed(31 * step + rank)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        ((model(x) - y) ** 2).mean().backward()
        ck.step()
        opt.zero_grad()
    before = ck.durable_step
    ck.close()
    (out / f"rank{rank}.txt").write_text(f"{before} {ck.durable_step}")
    dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["lowdiff", "lowdiff+"])
def test_durable_step_after_close_is_the_last_step(tmp_path: Path, strategy: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    codes = run_ranks(_rank, WORLD, tmp_path / "ck", out, tmp_path / "store", strategy)
    assert codes == [0] * WORLD
    got = [tuple(map(int, (out / f"rank{r}.txt").read_text().split())) for r in range(WORLD)]
    for before, after in got:
        assert before < STEPS  # the last steps were not durable before close() ...
        assert after == STEPS  # ... and close() made them durable, and says so


def _survivor(rank: int, job: Path, out: Path, store: Path) -> None:
    """Rank 1 is SIGKILLed inside step 4, after DDP's all-reduce; rank 0 finishes the step
    once rank 1 is gone (its exchange of durable steps then fails) and closes, as a
    framework does on the error a dead peer raised (Lightning's ``on_exception``)."""
    import os
    import signal
    import time

    join_group(rank, WORLD, store)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = lowdiff.Checkpointer(job, model, opt, method="lowdiff+", full_every=2)
    ck.resume()
    for step in range(4):
        g = torch.Generator().manual_seed(31 * step + rank)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        ((model(x) - y) ** 2).mean().backward()
        if step == 3:
            if rank == 1:
                (out / "gone").write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)
            while not (out / "gone").exists():
                time.sleep(0.05)
            time.sleep(0.5)  # the dead peer's sockets are closed
        ck.step()
        opt.zero_grad()
    ck.close()  # must not fail on the exchange with the dead rank
    from lowdiff.recovery.scan import make_plan, scan

    (out / "rank0.txt").write_text(str(make_plan(scan(job / "rank-00000"), None).target))


@pytest.mark.multiprocess
def test_close_after_a_peer_died_makes_this_shard_durable(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    codes = run_ranks(_survivor, WORLD, tmp_path / "ck", out, tmp_path / "store")
    assert codes[0] == 0 and codes[1] == -9
    assert (out / "rank0.txt").read_text() == "4"
    # the killed rank's replica waits idle_timeout for a restarted rank: let it go (it
    # persists what it holds, frees its shared memory and exits)
    from lowdiff.proc.holder import release_orphan

    assert release_orphan(tmp_path / "ck" / "rank-00001", 60.0)  # it was there


def test_an_exchange_a_dead_peer_never_joined_keeps_the_values(monkeypatch) -> None:
    """The background exchange of durable steps started at one step fails at the next
    (the peer died before taking part): the step goes on, the job-wide values stay as
    they were (never ahead of any rank), and the next exchange starts."""
    from lowdiff.ddp.context import JobMin

    waited: list[int] = []

    class Failed:
        def wait(self) -> None:
            waited.append(1)
            raise RuntimeError("Read error: Connection reset by peer")

    class Ctx:
        group = None

        def _t(self, values):
            return torch.tensor(list(values), dtype=torch.int64)

    started: list[torch.Tensor] = []

    def all_reduce(t, **kw):
        started.append(t)
        return Failed()

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    job = JobMin(Ctx())  # type: ignore[arg-type]
    job.values = [5]
    job.refresh(7)  # started
    job.refresh(8)  # the first one's wait fails: no error here
    assert waited == [1]  # the failure did happen, inside refresh(8)
    assert job.values == [5] and [t.tolist() for t in started] == [[7], [8]]


def _resumed(rank: int, job: Path, out: Path, store: Path, strategy: str) -> None:
    model, _, ck = _job(rank, job, store, strategy)
    start = ck.resume()
    seen = [start, ck.recovery_stats.source, ck.durable_step]
    g = torch.Generator().manual_seed(rank)
    ((model(torch.randn(6, 8, generator=g)) - 1) ** 2).mean().backward()
    ck.step()
    seen.append(ck.durable_step)
    ck.close()
    (out / f"resumed{rank}.txt").write_text(" ".join(map(str, seen)))
    dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["lowdiff", "lowdiff+"])
def test_durable_step_right_after_a_resume_from_disk_is_the_resumed_step(
    tmp_path: Path, strategy: str
) -> None:
    """Every rank resumed from its shard's files of one step: the job's durable step is
    that step at once, not -1 until the first background exchange."""
    out = tmp_path / "out"
    out.mkdir()
    job = tmp_path / "ck"
    assert run_ranks(_rank, WORLD, job, out, tmp_path / "store", strategy) == [0] * WORLD
    assert run_ranks(_resumed, WORLD, job, out, tmp_path / "store2", strategy) == [0] * WORLD
    for r in range(WORLD):
        start, source, right_after, after_step = (out / f"resumed{r}.txt").read_text().split()
        assert (int(start), source) == (STEPS, "disk")  # closed: nothing in memory
        assert int(right_after) == STEPS
        assert int(after_step) >= STEPS

"""The remote tier under DDP: 2 ranks on gloo, each uploading its own shard.

- both figures are job-wide: ``remote_durable_step`` is the minimum over the ranks, and a
  rank whose upload stalls holds it back (and remote retention keeps the full checkpoint
  every shard has committed, so the job stays recoverable from the remote meanwhile);
- a new node (the job directory gone) recovers the job from the remote tier, on every
  rank bit-identical to the uninterrupted run, and trains on;
- the job's URL is read in one plain process (``fetch`` + ``lowdiff.restore``, and
  ``lowdiff inspect`` / ``verify``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from tests.ddp.spawned import join_group, run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lowdiff
from lowdiff.cli.main import main
from lowdiff.engine.options import EngineOptions
from lowdiff.remote import RemoteStore, fetch
from lowdiff.state.capture import diff_states

from .common import Counter, train_state
from .conftest import Backend

pytestmark = pytest.mark.multiprocess

WORLD = 2


def _build(seed: int) -> tuple[nn.Module, Any, Any, Counter]:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    return m, o, torch.optim.lr_scheduler.StepLR(o, 3, 0.5), Counter()


def _ck(
    rank: int, job: Path, url: str, options: dict[str, Any], strategy: str, **kw: Any
) -> tuple[lowdiff.Checkpointer, DDP, Counter]:
    m, o, s, c = _build(0 if kw.pop("same_init", True) else 10 + rank)
    model = DDP(m)
    if strategy == "lowdiff":
        kw.setdefault("compressor", lowdiff.TopK(0.5))
    ck = lowdiff.Checkpointer(
        model, o, job, strategy=strategy, scheduler=s, extra_state={"data": c},
        remote=url, remote_options=options, remote_timeout=60, **kw,
    )  # fmt: skip
    return ck, model, c


def _train(
    ck: lowdiff.Checkpointer, model: nn.Module, c: Counter, rank: int, a: int, b: int
) -> None:
    for t in range(a, b):
        g = torch.Generator().manual_seed(100 * t + rank)
        c.pos += 1
        c.seen[t % 3] += 1
        ((model(torch.randn(6, 8, generator=g)) - 1) ** 2).mean().backward()
        ck.step()
        ck.optimizer.zero_grad()


def _ck_state(ck: lowdiff.Checkpointer, model: DDP, c: Counter) -> dict[str, torch.Tensor]:
    return train_state(model.module, ck.optimizer, ck.scheduler, c)


# ---------------------------------------------------------------------------- ranks


def _job_then_new_node(
    rank: int, tmp: Path, url: str, options: dict[str, Any], strategy: str, steps: int
) -> None:
    """Train ``steps`` steps and close; remove the job directory (a new node); resume
    from the remote tier and train two more steps."""
    join_group(rank, WORLD, tmp / "store")
    job, out = tmp / "job", tmp / "out"
    kw: dict[str, Any] = {"full_every": 4, "batch_size": 3}
    if strategy == "lowdiff+":
        kw = {"persist_every": 4}
    ck, model, c = _ck(rank, job, url, options, strategy, **kw)
    assert ck.resume() == 0
    _train(ck, model, c, rank, 0, steps)
    flushed = ck.flush(remote=True)
    ck.close()
    torch.save(
        {"state": _ck_state(ck, model, c), "flushed": flushed, "closed": ck.remote_durable_step},
        out / f"trained-rank{rank}.pt",
    )
    dist.barrier()
    if rank == 0:
        shutil.rmtree(job)  # the node is gone, and its disk
    dist.barrier()
    ck, model, c = _ck(rank, job, url, options, strategy, same_init=False)
    resumed = ck.resume()
    state = _ck_state(ck, model, c)
    _train(ck, model, c, rank, steps, steps + 2)
    again = ck.flush(remote=True)
    ck.close()
    torch.save(
        {"state": state, "resumed": resumed, "again": again, "final": _ck_state(ck, model, c)},
        out / f"new-rank{rank}.pt",
    )
    dist.destroy_process_group()


def _lagging(rank: int, tmp: Path, url: str, mark: str) -> None:
    """Rank 1's upload of its third record file (steps 4..5) stalls before its commit, and
    every upload behind it (full-6 among them) waits: the job's remote durable step waits
    for rank 1, and rank 0's remote retention keeps a full checkpoint both shards have
    committed."""
    if rank == 1:
        os.environ.update(
            LOWDIFF_FAULTS="before_commit:records:3:slow",
            LOWDIFF_FAULT_SLOW_S="3",
            LOWDIFF_FAULT_MARK=mark,
        )
    join_group(rank, WORLD, tmp / "store")
    job, out = tmp / "job", tmp / "out"
    ck, model, c = _ck(rank, job, url, {}, "lowdiff", full_every=3, batch_size=2, keep_full=1)
    ck.resume()
    _train(ck, model, c, rank, 0, 8)
    ck.flush()  # every step is on the local tier: 8
    deadline = time.monotonic() + 30
    while not Path(mark).exists():  # rank 1's uploader is inside rec-4-5's commit
        assert time.monotonic() < deadline, "rank 1's upload of rec-4-5 never started"
        time.sleep(0.02)
    core = ck.strategy_impl.progress  # type: ignore[attr-defined]
    while rank == 0 and core.remote_durable < 8:
        assert time.monotonic() < deadline, "rank 0's uploads did not reach step 8"
        time.sleep(0.02)
        _ = ck.remote_durable_step  # reads the process's counters
    ck.flush()  # the ranks exchange both figures now
    own = core.remote_durable  # what this rank took into the exchange
    owns = [torch.tensor([own if r == rank else 0]) for r in range(WORLD)]
    for r in range(WORLD):
        dist.broadcast(owns[r], src=r)
    store = RemoteStore(url)
    held = {r: sorted(store.sub(f"rank-{r:05d}").fulls()[0]) for r in range(WORLD)}
    figures = {
        "own": [int(t) for t in owns],
        "job": ck.remote_durable_step,
        "held": held,
        "flushed": ck.flush(remote=True),
    }
    _train(ck, model, c, rank, 8, 10)
    ck.close()
    figures["closed"] = ck.remote_durable_step
    torch.save({"state": _ck_state(ck, model, c), **figures}, out / f"lag-rank{rank}.pt")
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- tests


def _run(target: Any, tmp: Path, *args: Any) -> None:
    (tmp / "out").mkdir(exist_ok=True)
    assert run_ranks(target, WORLD, tmp, *args, timeout=150) == [0] * WORLD


@pytest.mark.parametrize(
    ("strategy", "where"), [("lowdiff", "file"), ("lowdiff+", "file"), ("lowdiff", "s3")]
)
def test_a_new_node_recovers_the_job_bit_identically(
    strategy: str, where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if where == "file":
        backend = Backend("file", f"file://{tmp_path}/remote")
    else:
        from .conftest import new_bucket

        server = request.getfixturevalue("moto_server")
        backend = Backend("s3", f"s3://{new_bucket(server)}/job", server.options())
    _run(_job_then_new_node, tmp_path, backend.url, backend.options, strategy, 9)
    for r in range(WORLD):
        trained = torch.load(tmp_path / "out" / f"trained-rank{r}.pt")
        new = torch.load(tmp_path / "out" / f"new-rank{r}.pt")
        assert trained["flushed"] == trained["closed"] == 9
        assert new["resumed"] == 9 and new["again"] == 11
        assert diff_states(trained["state"], new["state"]) == []
    assert not (tmp_path / "job" / "gen-1").exists()  # it continued in place
    # the layout mirrors the job directory's: the job's manifest, then one tier per shard
    store = RemoteStore(backend.url, backend.options)
    assert store.read_commit("lowdiff.json").size > 0
    for r in range(WORLD):
        assert store.sub(f"rank-{r:05d}").fulls()[0], f"rank {r} committed no full checkpoint"
    if (strategy, where) == ("lowdiff", "file"):
        _damaged_newest_full_falls_back(store, tmp_path)


def _damaged_newest_full_falls_back(store: RemoteStore, tmp_path: Path) -> None:
    """Rank 1's newest full checkpoint (8) is truncated on the remote: a reader of the
    job takes the newest step whose full checkpoint every shard holds intact (4), from
    every shard, and the records reach the job's last step from there."""
    shard = store.sub("rank-00001")
    c = shard.read_commit("full/full-000000000008.safetensors")
    data = shard.fs.cat_file(shard.key(c.object))
    shard.fs.pipe_file(shard.key(c.object), data[: len(data) // 2])
    with pytest.warns(lowdiff.RecoveryWarning, match=r"rank-00001/data/full/full-0+8"):
        got = fetch(store.url, tmp_path / "down")
    # rank 0's full-8 may come down too (it was tried first); recovery starts from 4
    for r in range(WORLD):
        assert f"rank-0000{r}/full/full-000000000004.safetensors" in got.files
    assert "rank-00001/full/full-000000000008.safetensors" not in got.files
    m, o, s, c0 = _build(5)
    assert lowdiff.restore(tmp_path / "down", m, o, s, extra_state={"data": c0}) == 11
    final = torch.load(tmp_path / "out" / "new-rank0.pt")["final"]
    assert diff_states(final, train_state(m, o, s, c0)) == []


def test_remote_is_refused_under_fully_shard() -> None:
    with pytest.raises(ValueError, match=r"fully_shard \(FSDP2\).*does not download its shards"):
        EngineOptions(remote="file:///x").check_for(
            "lowdiff+", ddp=True, replica=True, sharded=True
        )


def test_remote_durable_step_is_job_wide_and_retention_keeps_a_common_full(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"file://{tmp_path}/remote"
    _run(_lagging, tmp_path, url, str(tmp_path / "in-commit"))
    got = [torch.load(tmp_path / "out" / f"lag-rank{r}.pt") for r in range(WORLD)]
    own = got[0]["own"]
    assert got[1]["own"] == own
    # rank 1 is held at records 0..3 (full-3, if committed, reaches no further), rank 0
    # reached step 8
    assert own == [8, 4]
    assert [g["job"] for g in got] == [min(own)] * WORLD
    # rank 0 keeps a full checkpoint rank 1 has committed (full-3) besides full-6,
    # although keep_full=1: full-6 alone would leave the remote no common starting point
    held = got[0]["held"]
    assert 6 in held[0] and len(held[0]) > 1 and set(held[0]) & set(held[1]), held
    assert [g["flushed"] for g in got] == [8, 8] and [g["closed"] for g in got] == [10, 10]

    # the job's URL in one plain process: download, restore (rank 0's per-rank state)
    m, o, s, c = _build(5)
    fetch(url, tmp_path / "down")
    assert lowdiff.restore(tmp_path / "down", m, o, s, extra_state={"data": c}) == 10
    assert diff_states(got[0]["state"], train_state(m, o, s, c)) == []
    assert main(["verify", url]) == 0
    assert "0 bad" in capsys.readouterr().out
    assert main(["inspect", url, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["recoverable"][-1] == 10, info

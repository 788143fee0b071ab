"""LowDiff+'s peer copies under DDP: 2 ranks, each its own "node" (LOCAL_WORLD_SIZE=1).

Rank r's replica also keeps a copy of rank 1-r's shard, stepped from the averaged gradient
its own trainer snapshots, with rank 1-r's per-rank state (RNG, buffers, scheduler, extra
state) sent over a loopback socket by rank 1-r's replica. When rank 1's node is lost
(its trainer and replica SIGKILLed, its shared memory and its local storage gone: each
rank writes to a directory of its own, as on nodes without a shared file system), the
restarted job rebuilds rank 1's shard from rank 0's copy and ends bit-identical to an
uninterrupted run; no file of rank 1's shard is read (none is left to read).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from lowdiff.proc import holder as rp

from .spawned import join_group, run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

STEPS = 10


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 32)
        self.norm = torch.nn.BatchNorm1d(32)
        self.drop = torch.nn.Dropout(0.3)
        self.b = torch.nn.Linear(32, 16)
        self.c = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(self.drop(torch.relu(self.norm(self.a(x)))))))


class Counter:
    """Per-rank extra state: differs between the ranks."""

    def __init__(self, rank: int) -> None:
        self.seen = rank * 1000

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.seen = int(sd["seen"])


def _rank(rank: int, store: str, ck: str, out: str, crash_after: int, seed_rng: bool) -> None:
    import lowdiff

    os.environ.update(LOCAL_WORLD_SIZE="1", LOCAL_RANK="0", LOWDIFF_PEER_ADDR="127.0.0.1")
    join_group(rank, 2, Path(store))
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(Net(), broadcast_buffers=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    counter = Counter(rank)
    node = Path(ck, f"node-{rank}")  # each "node" has storage of its own, no shared file system
    ck_ = lowdiff.Checkpointer(
        node, model, opt, method="lowdiff+", scheduler=sched, extra_state={"counter": counter},
        replica=lowdiff.ReplicaOptions(persist_every=100, peer_copies=True),
    )  # fmt: skip
    torch.manual_seed(100 + rank)  # per-rank RNG: dropout differs between the ranks
    start = ck_.resume()
    stats = ck_.recovery_stats
    if stats is not None:
        Path(out, f"resumed-rank{rank}.json").write_text(
            json.dumps({"step": start, "source": stats.source, "shards": stats.shard_sources})
        )
    for step in range(start, STEPS):
        g = torch.Generator().manual_seed(step * 10 + rank)
        x = torch.randn(16, 8, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x[:, :1])
        loss.backward()
        counter.seen += 1
        ck_.step()  # steps the optimizer and the scheduler
        opt.zero_grad()
        if step + 1 == crash_after:
            deadline = time.monotonic() + 30
            while ck_.acknowledged_step < crash_after and time.monotonic() < deadline:
                time.sleep(0.01)
            Path(out, f"acked-rank{rank}.txt").write_text(str(ck_.acknowledged_step))
            os._exit(0)  # the trainer dies; its replica lives on (or dies with its node)
    torch.save(
        {
            "model": model.module.state_dict(),
            "optim": opt.state_dict(),
            "sched": sched.state_dict(),
            "rng": torch.get_rng_state(),
            "counter": counter.seen,
        },
        Path(out, f"final-rank{rank}.pt"),
    )
    ck_.close()


def _run(tmp: Path, name: str, ck: Path, crash_after: int = 0) -> Path:
    out = tmp / name
    out.mkdir()
    store = tmp / f"store-{name}"
    codes = run_ranks(_rank, 2, str(store), str(ck), str(out), crash_after, True, timeout=120)
    assert codes == [0, 0], codes
    return out


def _lose_node(ck: Path, rank: int) -> None:
    """What losing rank ``rank``'s node takes with it: its replica process (SIGKILLed),
    its shared memory and its local storage."""
    root = ck / f"node-{rank}" / f"rank-{rank:05d}"
    d = rp.read_descriptor(root)
    assert d is not None and rp.pid_alive(d.pid), "the replica must outlive its trainer"
    os.kill(d.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while rp.pid_alive(d.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    prefix = f"lowdiff-{d.run_id[:16]}-"
    for n in os.listdir("/dev/shm"):
        if n.startswith(prefix):
            rp.unlink_segment(n)
    shutil.rmtree(root.parent)


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _check(ref: Path, resumed: Path, shards: dict[str, str]) -> None:
    for r in (0, 1):
        info = json.loads((resumed / f"resumed-rank{r}.json").read_text())
        assert info == {"step": 6, "source": "memory", "shards": shards}
        want = torch.load(ref / f"final-rank{r}.pt", weights_only=False)
        got = torch.load(resumed / f"final-rank{r}.pt", weights_only=False)
        assert want.keys() == got.keys()
        diff = [k for k in want if not _equal(want[k], got[k])]
        diff += [n for n in want["model"] if not torch.equal(want["model"][n], got["model"][n])]
        assert diff == [], f"rank {r}: {diff} differ"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("peer-ref")
    return _run(tmp, "ref", tmp / "ck")


@pytest.mark.timeout(300)
def test_node_lost_resumes_from_the_peer_copy_bit_identical(tmp_path, reference):
    ck = tmp_path / "ck"
    crashed = _run(tmp_path, "crash", ck, crash_after=6)
    acked = [int((crashed / f"acked-rank{r}.txt").read_text()) for r in (0, 1)]
    assert acked == [6, 6]  # both shards and both copies held step 6 before the crash
    _lose_node(ck, 1)
    resumed = _run(tmp_path, "resumed", ck)
    _check(reference, resumed, {"0": "memory", "1": "peer memory (rank 0)"})


@pytest.mark.timeout(300)
def test_trainers_crash_each_takes_its_replica_with_its_copy_over(tmp_path, reference):
    ck = tmp_path / "ck"
    _run(tmp_path, "crash", ck, crash_after=6)
    resumed = _run(tmp_path, "resumed", ck)
    _check(reference, resumed, {"0": "memory", "1": "memory"})

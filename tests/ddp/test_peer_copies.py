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
RESUME_AT = 6


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


def _wrap(net: torch.nn.Module, world: int, fsdp: bool) -> torch.nn.Module:
    if not fsdp:
        return torch.nn.parallel.DistributedDataParallel(net, broadcast_buffers=False)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in (net.a, net.b, net.c):
        fully_shard(layer, mesh=mesh)
    return fully_shard(net, mesh=mesh)


def _local(tree: object) -> object:
    """``tree`` with every DTensor as this rank's shard."""
    if hasattr(tree, "to_local"):
        return tree.to_local().clone()  # type: ignore[attr-defined]
    if isinstance(tree, dict):
        return {k: _local(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_local(v) for v in tree]
    return tree


def _rank(
    rank: int,
    world: int,
    local: int,
    store: str,
    ck: str,
    out: str,
    crash_after: int,
    fsdp: bool = False,
    remote: str = "",
) -> None:
    import lowdiff

    os.environ.update(
        LOCAL_WORLD_SIZE=str(local), LOCAL_RANK=str(rank % local), LOWDIFF_PEER_ADDR="127.0.0.1"
    )
    join_group(rank, world, Path(store))
    torch.manual_seed(0)
    model = _wrap(Net(), world, fsdp)
    module = model if fsdp else model.module
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    counter = Counter(rank)
    # each "node" has storage of its own, no shared file system
    node = Path(ck, f"node-{rank // local}")
    # with a remote tier: no peer copies, persisted every 3 steps and uploaded
    replica = lowdiff.ReplicaOptions(persist_every=3 if remote else 100, peer_copies=not remote)
    ck_ = lowdiff.Checkpointer(
        node, model, opt, method="lowdiff+", scheduler=sched, extra_state={"counter": counter},
        replica=replica, remote=f"file://{remote}" if remote else None,
    )  # fmt: skip
    torch.manual_seed(100 + rank)  # per-rank RNG: dropout differs between the ranks
    start = ck_.resume()

    def save(name: str) -> None:
        state = {
            "model": _local(module.state_dict()),
            "optim": _local(opt.state_dict()),
            "sched": sched.state_dict(),
            "rng": torch.get_rng_state(),
            "counter": counter.seen,
        }
        torch.save(state, Path(out, f"{name}-rank{rank}.pt"))

    if start == RESUME_AT:
        save("at-resume")
    stats = ck_.recovery_stats
    if stats is not None:
        Path(out, f"resumed-rank{rank}.json").write_text(
            json.dumps(
                {
                    "step": start,
                    "source": stats.source,
                    "shards": stats.shard_sources,
                    "taken_over": stats.takeover_pid is not None,
                }
            )
        )
    for step in range(start, STEPS):
        g = torch.Generator().manual_seed(step * 10 + rank)
        x = torch.randn(16, 8, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x[:, :1])
        loss.backward()
        counter.seen += 1
        ck_.step()  # steps the optimizer and the scheduler
        opt.zero_grad()
        if step + 1 == RESUME_AT and crash_after == 0:
            save("at-resume")
        if step + 1 == crash_after:
            deadline = time.monotonic() + 30
            impl = ck_.strategy_impl
            while time.monotonic() < deadline:
                impl.pipeline.poll()  # type: ignore[attr-defined]
                uploaded = impl.progress.remote_durable  # type: ignore[attr-defined]
                if ck_.acknowledged_step >= crash_after and (not remote or uploaded >= crash_after):
                    break
                time.sleep(0.01)
            Path(out, f"acked-rank{rank}.txt").write_text(str(ck_.acknowledged_step))
            os._exit(0)  # the trainer dies; its replica lives on (or dies with its node)
    save("final")
    ck_.close()


def _run(
    tmp: Path,
    name: str,
    ck: Path,
    world: int,
    local: int,
    crash_after: int = 0,
    fsdp: bool = False,
    remote: str = "",
) -> Path:
    out = tmp / name
    out.mkdir()
    store = tmp / f"store-{name}"
    codes = run_ranks(
        _rank, world, world, local, str(store), str(ck), str(out), crash_after, fsdp, remote,
        timeout=180,
    )  # fmt: skip
    assert codes == [0] * world, codes
    return out


def _lose_node(ck: Path, node: int, local: int) -> None:
    """What losing node ``node`` takes with it: its ranks' replica processes
    (SIGKILLed), their shared memory and the node's storage."""
    root = ck / f"node-{node}"
    for rank in range(node * local, (node + 1) * local):
        d = rp.read_descriptor(root / f"rank-{rank:05d}")
        assert d is not None and rp.pid_alive(d.pid), "the replica must outlive its trainer"
        os.kill(d.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while rp.pid_alive(d.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        prefix = f"lowdiff-{d.run_id[:16]}-"
        for n in os.listdir("/dev/shm"):
            if n.startswith(prefix):
                rp.unlink_segment(n)
    shutil.rmtree(root)


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _check(
    ref: Path,
    resumed: Path,
    shards: dict[str, str],
    at: tuple[str, ...],
    source: str = "memory",
    taken_over: bool = False,
) -> None:
    """Every rank resumed from ``source`` at RESUME_AT, its shard from where ``shards``
    says, taking its replica's process over or not as ``taken_over`` says, and its state (model, optimizer, scheduler, RNG, extra state) equals the
    uninterrupted run's at each point of ``at``."""
    for r in range(len(shards)):
        info = json.loads((resumed / f"resumed-rank{r}.json").read_text())
        expect = shards if source == "memory" else {}
        assert info == {
            "step": RESUME_AT, "source": source, "shards": expect, "taken_over": taken_over,
        }  # fmt: skip
        for point in at:
            want = torch.load(ref / f"{point}-rank{r}.pt", weights_only=False)
            got = torch.load(resumed / f"{point}-rank{r}.pt", weights_only=False)
            assert want.keys() == got.keys()
            diff = [k for k in want if not _equal(want[k], got[k])]
            diff += [n for n in want["model"] if not torch.equal(want["model"][n], got["model"][n])]
            assert diff == [], f"rank {r}, {point}: {diff} differ"


BOTH = ("at-resume", "final")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("peer-ref")
    return _run(tmp, "ref", tmp / "ck", 2, 1)


@pytest.mark.timeout(300)
def test_node_lost_resumes_from_the_peer_copy_bit_identical(tmp_path, reference):
    ck = tmp_path / "ck"
    crashed = _run(tmp_path, "crash", ck, 2, 1, crash_after=6)
    acked = [int((crashed / f"acked-rank{r}.txt").read_text()) for r in (0, 1)]
    assert acked == [6, 6]  # both shards and both copies held step 6 before the crash
    # what `lowdiff inspect` shows of rank 0's orphaned replica: its copy of rank 1's shard
    status = rp.replica_status(ck / "node-0" / "rank-00000")
    assert status is not None and status["peer_copy"] == {"rank": 1, "step": 6}
    _lose_node(ck, 1, 1)
    resumed = _run(tmp_path, "resumed", ck, 2, 1)
    _check(reference, resumed, {"0": "memory", "1": "peer memory (rank 0)"}, BOTH)


@pytest.mark.timeout(300)
def test_trainers_crash_each_takes_its_replica_with_its_copy_over(tmp_path, reference):
    ck = tmp_path / "ck"
    _run(tmp_path, "crash", ck, 2, 1, crash_after=6)
    resumed = _run(tmp_path, "resumed", ck, 2, 1)
    # every rank took its replica's process over (its copy in it): none was started anew
    _check(reference, resumed, {"0": "memory", "1": "memory"}, BOTH, taken_over=True)


@pytest.mark.timeout(400)
def test_two_nodes_of_two_ranks_lose_the_first_node(tmp_path):
    """Ranks 0 and 1 on node 0, 2 and 3 on node 1; rank r copies rank (r - 2) mod 4. Node 0
    is lost: ranks 0 and 1 come back from the copies ranks 2 and 3 keep."""
    ref = _run(tmp_path, "ref", tmp_path / "ck-ref", 4, 2)
    ck = tmp_path / "ck"
    _run(tmp_path, "crash", ck, 4, 2, crash_after=6)
    _lose_node(ck, 0, 2)
    resumed = _run(tmp_path, "resumed", ck, 4, 2)
    # compared where resumed: the training after it runs DDP's first-iteration buckets
    # again, and with more than 2 ranks the all-reduce's sums then group differently
    shards = {
        "0": "peer memory (rank 2)",
        "1": "peer memory (rank 3)",
        "2": "memory",
        "3": "memory",
    }
    _check(ref, resumed, shards, ("at-resume",))


@pytest.mark.timeout(300)
def test_fully_shard_node_lost_resumes_from_the_mirrored_replica(tmp_path):
    """Under fully_shard no rank holds another's gradients: rank 0's replica mirrors rank
    1's, fed with its snapshot slots. Node 1 is lost: rank 1's shard comes back from the
    mirror, bit-identical, and the job ends as an uninterrupted one does."""
    ref = _run(tmp_path, "ref", tmp_path / "ck-ref", 2, 1, fsdp=True)
    ck = tmp_path / "ck"
    crashed = _run(tmp_path, "crash", ck, 2, 1, crash_after=RESUME_AT, fsdp=True)
    acked = [int((crashed / f"acked-rank{r}.txt").read_text()) for r in (0, 1)]
    assert acked == [RESUME_AT, RESUME_AT]
    _lose_node(ck, 1, 1)
    resumed = _run(tmp_path, "resumed", ck, 2, 1, fsdp=True)
    _check(ref, resumed, {"0": "memory", "1": "peer memory (rank 0)"}, BOTH)


@pytest.mark.timeout(300)
def test_without_copies_a_lost_node_s_shard_comes_from_the_remote_tier(tmp_path, reference):
    """Each node its own directory, copies off, a remote tier: node 1 is lost. Node 0's
    shard is read from its own disk, node 1's downloaded from the remote tier (and
    node 0's own shard downloaded to the replacement node): the job resumes at the step
    both persisted and uploaded."""
    ck, remote = tmp_path / "ck", tmp_path / "remote"
    _run(tmp_path, "crash", ck, 2, 1, crash_after=RESUME_AT, remote=str(remote))
    _lose_node(ck, 1, 1)
    resumed = _run(tmp_path, "resumed", ck, 2, 1, remote=str(remote))
    _check(reference, resumed, {"0": "", "1": ""}, BOTH, source="disk")
    assert (ck / "node-0" / "rank-00001").is_dir()  # node 0 read node 1's shard too

"""LowDiff+ under FSDP2 (``fully_shard``), 2 gloo ranks: each rank's replica holds its shard.

One job, compared with an uninterrupted run of the same job after every step it took:

1. both trainers are SIGKILLed after step 3 (their replicas live on): the restarted ranks
   restore from the replicas in memory, at step 3, and take their processes over;
2. after step 6 the trainers and their replicas are SIGKILLed (a machine failure): the
   restarted ranks restore from disk, at a step both shards persisted;
3. the job ends at step 8 bit-identical to the uninterrupted run: every rank's shard of
   model and AdamW state, scheduler, RNG and extra state (``torch.equal``);
4. one plain process reads the job: ``verify``, ``inspect``, ``restore`` into the model
   without ``fully_shard`` (the shards joined: the uninterrupted run's shards joined) and
   ``export``;
5. the job resumes at other world sizes, 2 -> 1 -> 2 -> 4 (rank 3 of 4 holds no row of
   the last layer): each resumed state is the previous run's final state, its shards
   joined, with old rank ``min(r, W - 1)``'s RNG, scheduler and extra state; a resharded
   generation that died before it persisted a step is passed over.

Gradient clipping fires at every step (its norm spans the ranks), through torch on even
steps and ``ck.clip_grad_norm_`` on odd ones, so the replica applies gradients changed
after their snapshot: they are copied again.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp
from tests.ddp.spawned import join_group, run_ranks
from torch import nn

import lowdiff

if not hasattr(torch.distributed.fsdp, "fully_shard"):
    pytest.skip("fully_shard (FSDP2) is public from torch 2.6", allow_module_level=True)
from lowdiff.state.capture import diff_states

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORLD, STEPS, MAX_NORM = 2, 8, 0.05
RESHARDED = ("d", "d2", "e", "f")


class Counter:
    """Training state beyond model and optimizer (extra_state)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = int(sd["n"])


def _job(
    rank: int,
    tmp: Path,
    run: str,
    job: Path,
    kill_at: int,
    kill_replica: bool,
    world: int = WORLD,
    steps: int = STEPS,
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    join_group(rank, world, tmp / f"store-{run}")
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    # 5 output rows: rank 0 holds 3 of them, rank 1 two (uneven shards)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 5))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.9)
    counter = Counter()
    ck = lowdiff.Checkpointer(job, model, opt, method="lowdiff+", scheduler=sched, full_every=2, extra_state={"counter": counter}, timeouts=lowdiff.Timeouts(idle=60))  # fmt: skip
    torch.manual_seed(100 + rank)  # the RNG stream, restored with the state
    start = ck.resume()
    stats = ck.recovery_stats
    info: dict[str, Any] = {
        "start": start,
        "source": None if stats is None else stats.source,
        "adopted": None if stats is None else stats.takeover_pid,
        "clipped": 0,
    }
    if run in RESHARDED:  # the whole state as resumed (full_tensor: a collective)
        torch.save(_whole(model, opt, sched, counter), tmp / f"{run}-resumed-rank{rank}.pt")
    for step in range(start, steps):
        g = torch.Generator().manual_seed(31 * step + rank)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 5, generator=g)
        x = x + 0.1 * torch.randn(6, 8)  # the global RNG is part of the state
        ((model(x) - y) ** 2).mean().backward()
        if step % 2:  # lowdiff's clip: under fully_shard the same as torch's
            norm = ck.clip_grad_norm_(MAX_NORM)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        info["clipped"] += int(norm.full_tensor() > MAX_NORM)  # the norm over both ranks
        counter.n += 1  # part of the step: captured by ck.step()
        ck.step()
        opt.zero_grad()
        if step + 1 == kill_at:
            info["durable_at_kill"] = ck.durable_step
            (tmp / f"{run}-rank{rank}.json").write_text(json.dumps(info))
            proc = ck.strategy_impl.worker_process  # type: ignore[attr-defined]
            if kill_replica and proc is not None:
                os.kill(proc.pid, signal.SIGKILL)  # a machine failure: the replica too
                proc.join(10)
            os.kill(os.getpid(), signal.SIGKILL)
    ck.close()
    state: dict[str, torch.Tensor] = {
        f"model/{k}": v.to_local().clone() for k, v in model.state_dict().items()
    }
    names = {id(p): n for n, p in model.named_parameters()}
    for p, s in opt.state.items():
        for k, v in s.items():
            state[f"optim/{names[id(p)]}/{k}"] = v.to_local() if hasattr(v, "to_local") else v
    state["rng"] = torch.get_rng_state()
    state["sched/last_epoch"] = torch.tensor(sched.state_dict()["last_epoch"])
    state["sched/lr"] = torch.tensor(sched.get_last_lr())
    state["counter"] = torch.tensor(counter.n)
    torch.save(state, tmp / f"{run}-state-rank{rank}.pt")
    info["steps"] = ck.step_count
    (tmp / f"{run}-rank{rank}.json").write_text(json.dumps(info))
    dist.destroy_process_group()


def _whole(model: nn.Module, opt: Any, sched: Any, counter: Counter) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.full_tensor() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, s in opt.state.items():
        for k, v in s.items():
            out[f"optim/{names[id(p)]}/{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v
    out["rng"] = torch.get_rng_state()
    out["sched/last_epoch"] = torch.tensor(sched.state_dict()["last_epoch"])
    out["sched/lr"] = torch.tensor(sched.get_last_lr())
    out["counter"] = torch.tensor(counter.n)
    return out


def _joined(tmp: Path, run: str, world: int, rank: int) -> dict[str, torch.Tensor]:
    """Run ``run``'s final shards joined, with the per-rank state of ``rank``."""
    parts = [torch.load(tmp / f"{run}-state-rank{r}.pt") for r in range(world)]
    out = dict(parts[rank])
    for k in out:
        if k.startswith("model/") or (k.startswith("optim/") and not k.endswith("/step")):
            out[k] = torch.cat([p[k] for p in parts])
    return out


def _info(tmp: Path, run: str, rank: int) -> dict[str, Any]:
    return json.loads((tmp / f"{run}-rank{rank}.json").read_text())


def test_fsdp2_lowdiff_plus_memory_disk_one_process_and_resharding(tmp_path: Path) -> None:
    ref, job = tmp_path / "ref", tmp_path / "job"
    assert run_ranks(_job, WORLD, tmp_path, "ref", ref, 0, False) == [0] * WORLD
    # 1. both trainers die after step 3; their replicas live on
    codes = run_ranks(_job, WORLD, tmp_path, "a", job, 3, False)
    assert codes == [-signal.SIGKILL] * WORLD
    # 2. restored from memory at step 3; after step 6 trainers and replicas die
    codes = run_ranks(_job, WORLD, tmp_path, "b", job, 6, True)
    assert codes == [-signal.SIGKILL] * WORLD
    # 3. restored from disk, then to the end
    assert run_ranks(_job, WORLD, tmp_path, "c", job, 0, False) == [0] * WORLD
    for rank in range(WORLD):
        a, b, c = (_info(tmp_path, run, rank) for run in "abc")
        assert a["start"] == 0 and a["clipped"] == 3  # clipping fired at every step
        assert (b["start"], b["source"]) == (3, "memory") and b["adopted"] is not None
        # the kill landed after step 6; the disk held a step both shards persisted,
        # no older than what was durable job-wide at the kill
        assert c["source"] != "memory"
        assert b["durable_at_kill"] <= c["start"] <= 6
        assert c["start"] == _info(tmp_path, "c", 1 - rank)["start"]
        assert c["steps"] == STEPS and c["clipped"] == STEPS - c["start"]
        want = torch.load(tmp_path / f"ref-state-rank{rank}.pt")
        got = torch.load(tmp_path / f"c-state-rank{rank}.pt")
        assert len(want) == 4 + 4 * 3 + 4  # model, AdamW, RNG, scheduler (2), counter
        assert diff_states(want, got) == []
    _read_in_one_process(tmp_path, job)
    # resharding: 2 -> 1, 1 -> 2, 2 -> 4 ranks, each resumed state the previous run's
    # final state (its shards joined; new rank r takes old rank min(r, W - 1)'s RNG)
    previous, before = "c", WORLD
    runs = (("d", 1, 8, 10), ("d2", 1, 8, 10), ("e", 2, 10, 12), ("f", 4, 12, 13))
    for run, world, start, steps in runs:
        if run == "d2":
            # generation 1 dies before it persisted a step: the next resume passes it
            # over and reshards generation 0's step 8 again, into generation 2
            for f in (job / "gen-1" / "rank-00000" / "full").iterdir():
                f.rename(tmp_path / f"gone-{f.name}")
            previous, before = "c", WORLD
        assert run_ranks(_job, world, tmp_path, run, job, 0, False, world, steps) == [0] * world
        for rank in range(world):
            assert (_info(tmp_path, run, rank)["start"], _info(tmp_path, run, rank)["steps"]) == (
                start,
                steps,
            )
            want = _joined(tmp_path, previous, before, min(rank, before - 1))
            got = torch.load(tmp_path / f"{run}-resumed-rank{rank}.pt")
            assert want.keys() == got.keys() and diff_states(want, got) == [], run
        previous, before = run, world
    assert (job / "gen-2" / "rank-00000").is_dir() and (job / "gen-4" / "rank-00003").is_dir()
    # the 4-rank generation (rank 3 holds no row of the last layer) read in one process
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 5))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    assert lowdiff.restore(job, model, opt) == 13
    want = _joined(tmp_path, "f", 4, 0)
    assert all(torch.equal(p.detach(), want[f"model/{n}"]) for n, p in model.named_parameters())


def _read_in_one_process(tmp: Path, job: Path) -> None:
    """The job in one plain process: its shards joined into whole tensors (rank 0's
    RNG, scheduler and extra state), equal to the uninterrupted run's shards joined."""
    n_checked, problems = lowdiff.verify_dir(job)
    assert n_checked > 0 and problems == []
    from lowdiff.inspection import inspect_job

    assert inspect_job(job).describe() == "FSDP2 job, 2 ranks"
    refs = [torch.load(tmp / f"ref-state-rank{r}.pt") for r in range(WORLD)]
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 5))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.9)
    counter = Counter()
    steps = lowdiff.restore(job, model, opt, sched, extra_state={"counter": counter})
    assert steps == STEPS and counter.n == STEPS
    assert torch.equal(torch.get_rng_state(), refs[0]["rng"])
    assert torch.equal(torch.tensor(sched.get_last_lr()), refs[0]["sched/lr"])
    joined = 0
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), torch.cat([r[f"model/{name}"] for r in refs]))
        for k, v in opt.state[p].items():
            want = [r[f"optim/{name}/{k}"] for r in refs]
            assert torch.equal(v, want[0] if k == "step" else torch.cat(want)), (name, k)
            joined += 1
    assert joined == 4 * 3
    assert lowdiff.export(job, out=tmp / "out.pt", format="torch") == STEPS
    exported = torch.load(tmp / "out.pt")
    assert all(torch.equal(v, exported["model"][k]) for k, v in model.state_dict().items())
    assert lowdiff.export(job, out=tmp / "out-dcp", format="dcp") == STEPS

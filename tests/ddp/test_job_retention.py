"""Retention in a distributed job keeps the newest full checkpoint every shard holds.

Recovery of a job starts from a full checkpoint present in every shard. With
``keep_full=1`` a rank whose newer full checkpoint is published while another rank's is
not (still being written, or that rank was killed while writing it) must not delete the
older one: it is the only full checkpoint the shards have in common.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tests.ddp.spawned import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lowdiff
from lowdiff.ddp.context import rank_dir
from lowdiff.engine.process.full_writer import job_retention_floor, job_world_size, retention
from lowdiff.format import layout
from lowdiff.proc.holder import wait_until_written
from lowdiff.recovery.job_layout import job_manifest
from lowdiff.state.capture import diff_states, snapshot_state
from lowdiff_lab.faults import FAULT_ENV

# ---------------------------------------------------------------------------- directories


def _shard(job: Path, rank: int, fulls: list[int], records: list[tuple[int, int]]) -> Path:
    """A shard directory with empty files under the names retention reads."""
    d = rank_dir(job, rank)
    (d / layout.FULL_DIR).mkdir(parents=True)
    (d / layout.RECORDS_DIR).mkdir()
    for s in fulls:
        layout.full_path(d, s).touch()
    for a, b in records:
        layout.records_path(d, a, b).touch()
    return d


def _job(tmp_path: Path, world: int = 2) -> Path:
    job = tmp_path / "job"
    job.mkdir(parents=True)
    layout.write_manifest(job, job_manifest(world, "lowdiff"))
    return job


def _fulls(d: Path) -> list[int]:
    return sorted(
        s
        for p in (d / layout.FULL_DIR).iterdir()
        if (s := layout.parse_full_name(p.name)) is not None
    )


def _recs(d: Path) -> list[tuple[int, int]]:
    return sorted(
        r for p in (d / layout.RECORDS_DIR).iterdir() if (r := layout.parse_records_name(p.name))
    )


RECS = [(0, 4), (5, 9), (10, 14), (15, 19), (20, 21)]


def test_keeps_the_newest_full_checkpoint_every_shard_holds(tmp_path):
    job = _job(tmp_path)
    r0 = _shard(job, 0, [0, 10, 20], RECS)
    r1 = _shard(job, 1, [0, 10], RECS[:4])  # its full checkpoint of step 20 is not there yet
    assert job_world_size(r0) == 2 and job_retention_floor(r0) == 10

    removed = retention(r0, keep_full=1)
    # full-20 alone would leave no full checkpoint common to both shards
    assert _fulls(r0) == [10, 20]
    assert _recs(r0) == RECS[2:]  # every record from step 10 on
    assert sorted(p.name for p in removed) == sorted(
        [layout.full_path(r0, 0).name, *(layout.records_path(r0, *r).name for r in RECS[:2])]
    )
    # rank 1 catches up: step 20 is common, step 10 may go
    layout.full_path(r1, 20).touch()
    retention(r0, keep_full=1)
    assert _fulls(r0) == [20] and _recs(r0) == [(20, 21)]


def test_record_file_straddling_the_common_step_is_kept(tmp_path):
    job = _job(tmp_path)
    recs = [(0, 3), (4, 7), (8, 11), (12, 15), (16, 19), (20, 20)]
    r0 = _shard(job, 0, [0, 10, 20], recs)
    _shard(job, 1, [0, 10], recs[:5])
    retention(r0, keep_full=1)
    assert _fulls(r0) == [10, 20] and _recs(r0) == recs[2:]  # 8-11 holds records 10 and 11


def test_nothing_goes_while_no_full_checkpoint_is_common(tmp_path):
    job = _job(tmp_path, world=3)
    r0 = _shard(job, 0, [10, 20], RECS[2:])
    _shard(job, 1, [10, 20], RECS[2:])
    _shard(job, 2, [], [])  # a rank whose first full checkpoint is still being written
    assert job_retention_floor(r0) == 0
    assert retention(r0, keep_full=1) == []
    assert _fulls(r0) == [10, 20] and _recs(r0) == RECS[2:]


def test_single_process_retention_is_unchanged(tmp_path):
    # the same files, without a job manifest above them: keep_full counts alone
    d = _shard(tmp_path, 0, [0, 10, 20], RECS)
    _shard(tmp_path, 1, [0], [])
    assert job_world_size(d) is None and job_retention_floor(d) is None
    retention(d, keep_full=1)
    assert _fulls(d) == [20] and _recs(d) == [(20, 21)]
    assert retention(d, keep_full=None) == []
    # a single-process manifest above is not a job either
    layout.write_manifest(tmp_path, {"format": "lowdiff", "kind": "single"})
    assert job_world_size(d) is None
    # nor a directory that is not one of the job's shards
    job = _job(tmp_path / "j")
    other = job / "extra"
    other.mkdir()
    assert job_world_size(other) is None and job_world_size(rank_dir(job, 1)) == 2
    assert job_world_size(rank_dir(job, 2)) is None


def test_checkpointing_process_applies_it(tmp_path):
    """A real checkpointing process in a shard directory keeps the common full checkpoint.

    Shard 1 stops at step 4, then shard 0 reaches step 12 (full checkpoints 0, 4, 8, 12):
    with ``keep_full=1`` shard 0 keeps 4 and everything after it."""
    job = _job(tmp_path)
    for rank, steps in ((1, 4), (0, 12)):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ck = lowdiff.Checkpointer(
            rank_dir(job, rank),
            model,
            opt,
            compressor=lowdiff.TopK(0.5),
            full_every=4,
            records_per_file=2,
            keep_full=1,
        )
        assert ck.resume() == 0
        for step in range(steps):
            model(torch.full((3, 4), float(step))).sum().backward()
            ck.step()
            opt.zero_grad()
        ck.close()
    # shard 1 ran first, when shard 0 held nothing yet: no common step, nothing deleted
    assert _fulls(rank_dir(job, 1)) == [0, 4]
    assert _fulls(rank_dir(job, 0)) == [4, 8, 12]
    assert min(a for a, _ in _recs(rank_dir(job, 0))) == 4
    retention(rank_dir(job, 1), keep_full=1)
    assert _fulls(rank_dir(job, 1)) == [4]


# ------------------------------------------------------------------ a 2-rank job, one killed

WORLD = 2
STEPS = 10
FULL_EVERY = 4  # full checkpoints 0, 4, 8
KILL_AT = 8  # the full checkpoint rank 1's checkpointing process is killed while writing
WAIT_S = 60.0


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _build(job: Path):
    torch.manual_seed(0)
    model = DDP(_Net())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    ck = lowdiff.Checkpointer(
        job,
        model,
        opt,
        scheduler=sched,
        compressor=lowdiff.TopK(0.3, error_feedback=False),
        full_every=FULL_EVERY,
        records_per_file=2,
        keep_full=1,
    )
    return model, opt, sched, ck


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.02)


def _rank(rank: int, job: Path, out: Path, store: Path, phase: str) -> None:
    torch.set_num_threads(1)
    if phase == "train" and rank == 1:
        # rank 1's checkpointing process kills itself while publishing its third full
        # checkpoint (steps 0, 4, 8): after the fsync, before the rename
        os.environ[FAULT_ENV] = "before_rename:full:3:kill-self"
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=WAIT_S),
    )
    model, opt, sched, ck = _build(job)
    start = ck.resume()
    torch.save(snapshot_state(model, opt, sched), out / f"{phase}-{start}-rank{rank}.pt")
    if phase == "resume":
        ck.close()
        dist.destroy_process_group()
        return
    for step in range(start, STEPS):
        g = torch.Generator().manual_seed(31 * step + rank)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        ((model(x) - y) ** 2).mean().backward()
        ck.step()
        opt.zero_grad()
        torch.save(snapshot_state(model, opt, sched), out / f"state-{step + 1}-rank{rank}.pt")
        if step + 1 == KILL_AT:
            # the job dies: rank 0 once its full checkpoint of step 8 is published (its
            # retention runs with rank 1's missing), rank 1 after that (its own is
            # never published)
            _wait_for(layout.full_path(rank_dir(job, 0), KILL_AT))
            os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("not reached")


def _run(job: Path, out: Path, store: Path, phase: str) -> list[int | None]:
    return run_ranks(_rank, WORLD, job, out, store, phase)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_keep_full_1_and_a_rank_killed_during_a_full_checkpoint(tmp_path):
    job, out = tmp_path / "job", tmp_path / "out"
    out.mkdir()
    codes = _run(job, out, tmp_path / "store1", "train")
    assert codes == [-signal.SIGKILL, -signal.SIGKILL]
    for r in range(WORLD):
        # the orphaned checkpointing processes wrote what they were sent
        wait_until_written(rank_dir(job, r), WAIT_S)

    r0, r1 = rank_dir(job, 0), rank_dir(job, 1)
    # the condition: rank 1 was killed while writing full-8 (its temp file is left over;
    # it may still hold full-0, if rank 0 had not published full-4 at its retention)...
    assert _fulls(r1)[-1] == 4
    assert any(
        p.name.startswith(".tmp-full-000000000008") for p in (r1 / layout.FULL_DIR).iterdir()
    )
    # ... after rank 0 published its own and ran retention (full-0 is gone), which kept 4
    assert _fulls(r0) == [4, 8]
    assert min(a for a, _ in _recs(r0)) == 4

    # the job is recoverable, from the common full checkpoint, bit for bit
    assert _run(job, out, tmp_path / "store2", "resume") == [0, 0]
    for r in range(WORLD):
        (resumed,) = out.glob(f"resume-*-rank{r}.pt")
        step = int(resumed.name.split("-")[1])
        assert FULL_EVERY <= step <= KILL_AT
        want = torch.load(out / f"state-{step}-rank{r}.pt", weights_only=True)
        assert diff_states(want, torch.load(resumed, weights_only=True)) == []

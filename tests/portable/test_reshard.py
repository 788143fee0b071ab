"""Resuming a job at another world size: 2 -> 1, 1 -> 2 and 2 -> 4 ranks (gloo, torchrun).

Each old run saves its live state after chosen steps (``state-{s}-rank{r}.pt``); the
resumed job saves the state it resumed with (``resumed-{s}-rank{r}.pt``). Parameters and
optimizer state are the same on every rank of a DDP job, so every new rank must hold
exactly the old rank 0's; buffers, RNG streams and scheduler are those of old rank
``min(r, W - 1)``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lowdiff
from lowdiff.cli.main import main
from lowdiff.recovery.job_layout import generations
from lowdiff.state.capture import diff_states, snapshot_state
from lowdiff_lab.prefork import PreforkServer
from lowdiff_lab.torture.ddp import JOB_MODULE, _free_port
from lowdiff_lab.torture.ddp_job import Net

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _job(server: PreforkServer, nproc: int, ck: Path, out: Path, *args: str) -> None:
    """The training job with ``nproc`` ranks (0: one plain process, no DDP), forked from
    ``server`` (under torch's elastic agent with forked ranks: ``lowdiff_lab.torture.ddp_agent``)."""
    out.mkdir(parents=True, exist_ok=True)
    job = ["--dir", str(ck), "--out", str(out), "--ef", *args]
    if nproc == 0:
        cmd = [sys.executable, "-m", JOB_MODULE, "--single", *job]
    else:
        cmd = [
            sys.executable, "-m", "lowdiff_lab.torture.ddp_agent", "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
            "--module", JOB_MODULE, *job,
        ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    # a file, not a pipe: a LowDiff+ replica left by a killed job holds its descriptors
    log = out / f"job-{nproc}.log"
    with log.open("ab") as f:
        p = server.popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        code = p.wait(timeout=240)
    assert code == 0, log.read_text()[-8000:]


def _load(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def _restored(ck: Path, step: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    assert lowdiff.restore(ck, net, opt, sched, step=step) == step
    return snapshot_state(net, opt, sched)


def _check_resumed(old: Path, new: Path, step: int, old_world: int, new_world: int) -> None:
    for r in range(new_world):
        got = _load(new / f"resumed-{step}-rank{r}.pt")
        # parameters and optimizer state: the old run's (rank 0's, equal on every rank)
        rank0 = _load(old / f"state-{step}-rank0.pt")
        params = {f"model/{n}" for n, _ in Net().named_parameters()}
        shared = [k for k in rank0 if k in params or k.startswith("optim/")]
        assert len(shared) > len(params)
        assert diff_states({k: rank0[k] for k in shared}, {k: got[k] for k in shared}) == []
        # everything, per-rank state included: old rank min(r, W - 1)'s
        assert diff_states(_load(old / f"state-{step}-rank{min(r, old_world - 1)}.pt"), got) == []
        assert (new / f"final-rank{r}.pt").exists()  # and it trained on


def test_two_ranks_resume_in_one(prefork, tmp_path, capsys):
    ck, old, new = tmp_path / "ck", tmp_path / "old", tmp_path / "new"
    _job(prefork, 2, ck, old, "--steps", "12", "--save-steps", "7,12")
    _job(prefork, 1, ck, new, "--steps", "18", "--save-steps", "15")
    _check_resumed(old, new, 12, 2, 1)
    assert [(g.index, g.world_size, g.start_step) for g in generations(ck)] == [
        (0, 2, 0),
        (1, 1, 12),
    ]
    # a step of each generation, in one process
    assert diff_states(_load(old / "state-7-rank0.pt"), _restored(ck, 7)) == []
    assert diff_states(_load(new / "state-15-rank0.pt"), _restored(ck, 15)) == []
    # and the resumed job's own restart continues in its generation
    again = tmp_path / "again"
    _job(prefork, 1, ck, again, "--steps", "20")
    assert (again / "resumed-18-rank0.pt").exists()
    assert len(generations(ck)) == 2
    # a step no generation serves: the error names what each generation does serve
    net = Net()
    with pytest.raises(lowdiff.RecoveryError, match="step 40 is not recoverable in any") as e:
        lowdiff.restore(ck, net, torch.optim.AdamW(net.parameters()), step=40)
    msg = str(e.value)
    assert "0..12 (generation 0, 2 ranks from step 0)" in msg, msg
    assert "(generation 1, 1 rank from step 12)" in msg, msg
    # inspect says so too, and names every shard by its own directory
    assert main(["inspect", str(ck)]) == 0
    out = capsys.readouterr().out
    assert "(distributed job, 2 generations: 2 ranks from step 0, 1 rank from step 12)" in out
    names = [ln.split()[0] for ln in out.splitlines() if ln.startswith("  ") and "params" in ln]
    assert names == ["rank-00000", "rank-00001", "gen-1/rank-00000"], out


def test_one_process_resumed_by_two_ranks(prefork, tmp_path):
    ck, old, new = tmp_path / "ck", tmp_path / "old", tmp_path / "new"
    _job(prefork, 0, ck, old, "--steps", "10", "--save-steps", "6,10")
    _job(prefork, 2, ck, new, "--steps", "14", "--save-steps", "13")
    _check_resumed(old, new, 10, 1, 2)
    assert [(g.world_size, g.single) for g in generations(ck)] == [(1, True), (2, False)]
    assert diff_states(_load(old / "state-6-rank0.pt"), _restored(ck, 6)) == []
    assert diff_states(_load(new / "state-13-rank0.pt"), _restored(ck, 13)) == []


def test_two_ranks_resume_in_four(prefork, tmp_path):
    ck, old, new = tmp_path / "ck", tmp_path / "old", tmp_path / "new"
    _job(prefork, 2, ck, old, "--steps", "10", "--save-steps", "4,10")
    _job(prefork, 4, ck, new, "--steps", "13", "--save-steps", "12")
    _check_resumed(old, new, 10, 2, 4)
    assert diff_states(_load(old / "state-4-rank0.pt"), _restored(ck, 4)) == []
    assert diff_states(_load(new / "state-12-rank0.pt"), _restored(ck, 12)) == []
    # inspect, verify and export see both generations
    from lowdiff.inspection import inspect_job, verify_dir

    job = inspect_job(ck)
    assert job.world_size == 4 and job.recoverable == (0, 13) and len(job.shards) == 6
    assert verify_dir(ck)[1] == []
    assert inspect_job(ck, verify=True).recoverable_intervals == job.recoverable_intervals
    # a byte flipped in the data of one shard's newest record file: the headers still
    # promise step 13; --verify leaves the file out, for the whole generation
    import shutil

    damaged_job = tmp_path / "damaged"
    shutil.copytree(ck, damaged_job)
    shard = sorted(p for p in damaged_job.rglob("rank-00002") if p.is_dir())[-1]
    rec = sorted((shard / "records").glob("rec-*"))[-1]
    raw = bytearray(rec.read_bytes())
    raw[-3] ^= 0x10
    rec.write_bytes(bytes(raw))
    assert inspect_job(damaged_job).recoverable == (0, 13)
    checked = inspect_job(damaged_job, verify=True)
    assert checked.recoverable is not None and checked.recoverable[1] < 13, checked
    assert checked.recoverable[0] == 0
    assert [p for s in checked.shards for p, _ in s.problems] == [rec]
    for step in (4, 12):
        assert lowdiff.export(ck, step=step, format="torch", out=tmp_path / f"{step}.pt") == step
        got = torch.load(tmp_path / f"{step}.pt", weights_only=False)
        want = _load((old if step == 4 else new) / f"state-{step}-rank0.pt")
        for name, t in got["model"].items():
            assert torch.equal(t, want[f"model/{name}"]), name


def test_lowdiff_plus_killed_two_ranks_resume_in_one(prefork, tmp_path):
    """LowDiff+ after a crash: the old replicas persist what they hold, and the state is
    resharded from disk."""
    ck, old, new = tmp_path / "ck", tmp_path / "old", tmp_path / "new"
    every = ",".join(str(s) for s in range(1, 13))
    with pytest.raises(AssertionError):  # rank 1 SIGKILLs itself: torchrun fails
        _job(prefork, 2, ck, old, "--strategy", "lowdiff+", "--steps", "12", "--save-steps", every,
             "--kill-at", "8", "--kill-rank", "1")  # fmt: skip
    assert (old / "killed").exists()
    _job(prefork, 1, ck, new, "--strategy", "lowdiff+", "--steps", "12")
    (start,) = [p.name.split("-")[1] for p in new.glob("resumed-*-rank0.pt")]
    step = int(start)
    assert 1 <= step <= 8
    _check_resumed(old, new, step, 2, 1)
    assert [g.world_size for g in generations(ck)] == [2, 1]


def test_generation_without_a_full_checkpoint_is_passed_over(prefork, tmp_path):
    """A job that died before its new generation's first full checkpoint: the next resume
    starts from the old generation again, in a newer generation."""
    from lowdiff.format import layout
    from lowdiff.recovery.directory import is_empty_dir
    from lowdiff.recovery.job_layout import generation_dir, job_manifest

    ck, old, new = tmp_path / "ck", tmp_path / "old", tmp_path / "new"
    _job(prefork, 2, ck, old, "--steps", "8", "--save-steps", "8")
    dead = generation_dir(ck, 1)
    (dead / "rank-00000").mkdir(parents=True)
    layout.write_manifest(dead, job_manifest(1, "lowdiff", generation=1, start_step=8))
    _job(prefork, 1, ck, new, "--steps", "10")
    _check_resumed(old, new, 8, 2, 1)
    assert [(g.index, g.world_size) for g in generations(ck)] == [(0, 2), (1, 1), (2, 1)]
    assert is_empty_dir(dead / "rank-00000")  # nothing was written there


def test_a_plain_process_is_refused_on_a_job_directory(tmp_path):
    """Writing a job's directory from one plain process would fork its chain: refused."""
    from lowdiff.format import layout
    from lowdiff.recovery.job_layout import job_manifest

    d = tmp_path / "job"
    d.mkdir()
    layout.write_manifest(d, job_manifest(2, "lowdiff"))
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(lowdiff.CheckpointMismatchError, match="distributed job's directory"):
        lowdiff.Checkpointer(d, model, opt, compressor=lowdiff.TopK(ratio=0.01))

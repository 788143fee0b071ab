"""Restoring a distributed job's directory in one process, without a process group."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

import lowdiff
from lowdiff.state.capture import diff_states, snapshot_state
from lowdiff_lab.torture.ddp_job import Net

from .conftest import SAVED_STEPS

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _objects():
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    return net, opt, sched


def _digest(root: Path) -> dict[str, str]:
    """Every file under ``root`` with the hash of its bytes (to see that nothing changed)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("step", SAVED_STEPS)
def test_restore_equals_rank0_live_state(ddp_job, step):
    ck, out = ddp_job
    before = _digest(ck)
    net, opt, sched = _objects()
    assert lowdiff.restore(ck, net, opt, sched, step=step) == step
    want = torch.load(out / f"state-{step}-rank0.pt", weights_only=True)
    # parameters, optimizer state, scheduler, buffers and every RNG stream of rank 0
    assert diff_states(want, snapshot_state(net, opt, sched)) == []
    assert _digest(ck) == before


def test_restore_newest_step(ddp_job):
    ck, out = ddp_job
    net, opt, sched = _objects()
    assert lowdiff.restore(ck, net, opt, sched) == 12
    want = torch.load(out / "state-12-rank0.pt", weights_only=True)
    assert diff_states(want, snapshot_state(net, opt, sched)) == []


def test_mismatched_model_names_the_parameter(ddp_job):
    ck, _ = ddp_job
    before = _digest(ck)
    torch.manual_seed(0)
    net = Net()
    net.head = torch.nn.Linear(32, 5)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    with pytest.raises(lowdiff.CheckpointMismatchError, match="head.weight"):
        lowdiff.restore(ck, net, opt, step=5)
    assert _digest(ck) == before


def test_step_no_shard_serves_is_a_clear_error(ddp_job):
    ck, _ = ddp_job
    net, opt, sched = _objects()
    with pytest.raises(lowdiff.RecoveryError, match="step 40 is not recoverable in every shard"):
        lowdiff.restore(ck, net, opt, sched, step=40)


def test_missing_shard_is_named(ddp_job, tmp_path):
    ck, _ = ddp_job
    copy = tmp_path / "ck"
    shutil.copytree(ck, copy)
    shutil.rmtree(copy / "rank-00001")
    before = _digest(copy)
    net, opt, sched = _objects()
    with pytest.raises(lowdiff.RecoveryError, match="rank-00001"):
        lowdiff.restore(copy, net, opt, sched, step=5)
    assert _digest(copy) == before


def test_damaged_shard_file_is_named(ddp_job, tmp_path):
    ck, _ = ddp_job
    copy = tmp_path / "ck"
    shutil.copytree(ck, copy)
    rec = sorted((copy / "rank-00001" / "records").iterdir())
    victim = next(p for p in rec if p.name.startswith("rec-000000000006"))
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))
    before = _digest(copy)
    net, opt, sched = _objects()
    with pytest.raises(lowdiff.RecoveryError, match=victim.name):
        lowdiff.restore(copy, net, opt, sched, step=8)
    assert _digest(copy) == before
    # a step before the damage still restores exactly
    assert lowdiff.restore(copy, net, opt, sched, step=5) == 5

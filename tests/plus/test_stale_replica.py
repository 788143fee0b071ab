"""LowDiff+: stale or foreign replica shared memory is detected and never attached.

The segments and descriptors here are made by hand with ``lowdiff.proc.holder``; every
segment a test creates is unlinked at teardown.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from torch import nn

import lowdiff
from lowdiff.format.sfile import TensorEntry
from lowdiff.proc import holder as rp

SHM = Path("/dev/shm")
LAYOUT_ID = "0123456789abcdef"

pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="needs /dev/shm")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert not rp.pid_alive(proc.pid)
    return proc.pid


class Segments:
    """Creates named segments and unlinks them all at the end."""

    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex[:12]
        self.names: list[str] = []
        self.handles: list = []

    def create(self, suffix: str, size: int):
        name = f"lowdiff-test-{self.tag}-{suffix}"
        shm = rp.create_segment(name, size)
        self.names.append(name)
        self.handles.append(shm)
        return shm

    def replica(
        self,
        run_id: str,
        layout_id: str = LAYOUT_ID,
        state: int = rp.STATE_ORPHANED,
        doc_run_id: str | None = None,
    ) -> tuple[str, str]:
        """A control block + an arena holding one tensor; returns (ctl name, arena name)."""
        arena = self.create("a1", 64)
        rp.segment_tensor(arena, 16).view(torch.float32).copy_(torch.arange(4.0))
        ctl = self.create("ctl", 1 << 16)
        doc = {
            "run_id": doc_run_id or run_id,
            "layout_id": layout_id,
            "arena": arena.name,
            "entries": rp.entries_to_json([TensorEntry("model/w", torch.float32, (4,), 0, 16)]),
            "meta": {"kind": "full", "step": "5"},
        }
        rp.ControlBlock(ctl).write(state, 5, doc)
        return ctl.name, arena.name

    def close(self) -> None:
        for shm in self.handles:
            # BufferError: a tensor still views it; the memory goes with the process
            with contextlib.suppress(BufferError):
                shm.close()
        for n in self.names:
            rp.unlink_segment(n)


@pytest.fixture
def segs():
    s = Segments()
    yield s
    s.close()


def _exists(name: str) -> bool:
    return (SHM / name.lstrip("/")).exists()


def _descriptor(root: Path, pid: int, run_id: str, ctl: str, layout_id: str = LAYOUT_ID):
    root.mkdir(parents=True, exist_ok=True)
    rp.write_descriptor(root, rp.Descriptor(pid, socket.gethostname(), run_id, ctl, layout_id))


# ----------------------------------------------------------------------------- find_live_replica


def test_dead_owner_segments_are_unlinked_never_attached(tmp_path, segs):
    run_id = uuid.uuid4().hex
    ctl, arena = segs.replica(run_id)
    assert _exists(ctl) and _exists(arena)
    _descriptor(tmp_path, _dead_pid(), run_id, ctl)
    live, why = rp.find_live_replica(tmp_path, LAYOUT_ID, wait_s=0.2)
    assert live is None
    assert "gone" in why and "stale" in why
    assert not _exists(ctl) and not _exists(arena)
    assert not (tmp_path / rp.DESCRIPTOR).exists()
    # a second look finds nothing at all
    assert rp.find_live_replica(tmp_path, LAYOUT_ID, wait_s=0.2) == (None, "no live replica")


def test_dead_owner_with_garbage_control_block(tmp_path, segs):
    ctl = segs.create("ctl", 4096)
    ctl.buf[:16] = b"not a lowdiff cb"
    _descriptor(tmp_path, _dead_pid(), uuid.uuid4().hex, ctl.name)
    live, _ = rp.find_live_replica(tmp_path, LAYOUT_ID, wait_s=0.2)
    assert live is None
    assert not _exists(ctl.name)
    assert not (tmp_path / rp.DESCRIPTOR).exists()


def test_live_owner_of_another_run_is_not_attached(tmp_path, segs):
    run_id = uuid.uuid4().hex
    ctl, arena = segs.replica(run_id, doc_run_id=uuid.uuid4().hex)
    _descriptor(tmp_path, os.getpid(), run_id, ctl)
    live, why = rp.find_live_replica(tmp_path, LAYOUT_ID, wait_s=0.2)
    assert live is None
    assert "another run" in why and "stale" in why
    # the owner is alive: its segments are left alone
    assert _exists(ctl) and _exists(arena)


def test_layout_mismatch_is_not_attached(tmp_path, segs):
    run_id = uuid.uuid4().hex
    ctl, arena = segs.replica(run_id, layout_id="fedcba9876543210")
    _descriptor(tmp_path, os.getpid(), run_id, ctl, layout_id="fedcba9876543210")
    live, why = rp.find_live_replica(tmp_path, LAYOUT_ID, wait_s=0.2)
    assert live is None
    assert "another model" in why
    assert _exists(ctl) and _exists(arena)


def test_missing_control_block_is_not_attached(tmp_path):
    _descriptor(tmp_path, os.getpid(), uuid.uuid4().hex, f"lowdiff-test-{uuid.uuid4().hex[:12]}")
    live, why = rp.find_live_replica(tmp_path, LAYOUT_ID, wait_s=0.2)
    assert live is None
    assert "gone" in why


def test_replica_still_running_is_not_attached_after_wait(tmp_path, segs):
    run_id = uuid.uuid4().hex
    ctl, _ = segs.replica(run_id, state=rp.STATE_RUNNING)
    _descriptor(tmp_path, os.getpid(), run_id, ctl)
    live, why = rp.find_live_replica(tmp_path, LAYOUT_ID, wait_s=0.1)
    assert live is None
    assert "not available" in why


def test_matching_orphaned_replica_is_attached(tmp_path, segs):
    """The positive control: everything matches, so the replica is found and readable."""
    run_id = uuid.uuid4().hex
    ctl, arena = segs.replica(run_id)
    _descriptor(tmp_path, os.getpid(), run_id, ctl)
    live, why = rp.find_live_replica(tmp_path, LAYOUT_ID, wait_s=0.2)
    assert live is not None, why
    try:
        assert live.step == 5 and live.state == rp.STATE_ORPHANED
        assert torch.equal(live.tensors()["model/w"], torch.arange(4.0))
    finally:
        live.close()  # never release_owner(): the "owner" is this test process


# ----------------------------------------------------------------------------- end to end


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _build():
    torch.manual_seed(0)
    m = Tiny()
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def _train(ck: lowdiff.Checkpointer, m: nn.Module, o: torch.optim.Optimizer, steps: range):
    for step in steps:
        g = torch.Generator().manual_seed(step)
        ((m(torch.randn(5, 4, generator=g)) - 1.0) ** 2).mean().backward()
        ck.step()
        o.zero_grad()


@pytest.mark.multiprocess
def test_checkpointer_ignores_stale_descriptor_and_resumes_from_disk(tmp_path, segs):
    d = tmp_path / "ck"
    m, o = _build()
    ck = lowdiff.Checkpointer(
        d, m, o, method="lowdiff+", replica=lowdiff.ReplicaOptions(persist_every=2)
    )
    try:
        assert ck.resume() == 0
        _train(ck, m, o, range(3))
    finally:
        ck.close()
    assert ck.durable_step == 3
    assert not (d / rp.DESCRIPTOR).exists()  # a clean close removes it
    want = {k: v.clone() for k, v in m.state_dict().items()}

    # a crashed checkpointing process of a previous session left segments and descriptor
    run_id = uuid.uuid4().hex
    ctl, arena = segs.replica(run_id)
    _descriptor(d, _dead_pid(), run_id, ctl)

    m2, o2 = _build()
    ck2 = lowdiff.Checkpointer(
        d, m2, o2, method="lowdiff+", replica=lowdiff.ReplicaOptions(persist_every=2)
    )
    try:
        assert ck2.resume() == 3
        assert ck2.recovery_stats is not None
        assert ck2.recovery_stats.source == "disk"
        assert not _exists(ctl) and not _exists(arena)
        for k, v in m2.state_dict().items():
            assert torch.equal(v, want[k]), k
        _train(ck2, m2, o2, range(3, 5))
    finally:
        ck2.close()
    assert ck2.durable_step == 5
    assert not (d / rp.DESCRIPTOR).exists()


@pytest.mark.multiprocess
def test_checkpointer_fresh_start_next_to_a_stale_descriptor(tmp_path, segs):
    d = tmp_path / "ck"
    run_id = uuid.uuid4().hex
    ctl, arena = segs.replica(run_id)
    _descriptor(d, _dead_pid(), run_id, ctl)
    m, o = _build()
    ck = lowdiff.Checkpointer(d, m, o, method="lowdiff+")
    try:
        assert ck.resume() == 0
        assert not _exists(ctl) and not _exists(arena)
        _train(ck, m, o, range(2))
    finally:
        ck.close()
    assert ck.durable_step == 2


def test_replica_of_another_host_is_never_touched(tmp_path):
    """On a shared filesystem another host's replica is neither attached nor cleaned up."""
    d = tmp_path / "ck"
    d.mkdir()
    rp.write_descriptor(
        d, rp.Descriptor(2**22 + 12345, "some-other-host", uuid.uuid4().hex, "lowdiff-x-ctl", "abc")
    )
    live, why = rp.find_live_replica(d, "abc", wait_s=0.1)
    assert live is None and "some-other-host" in why
    assert rp.read_descriptor(d) is not None  # left alone


def test_shared_memory_shortage_is_a_clear_error(monkeypatch):
    """A full /dev/shm is reported by name and size, never as a bus error."""

    class Tiny:
        f_bavail, f_frsize = 10, 4096

    monkeypatch.setattr(rp.os, "statvfs", lambda path: Tiny)
    with pytest.raises(lowdiff.LowDiffError, match=r"not enough shared memory.*--shm-size"):
        rp.create_segment(f"lowdiff-test-{uuid.uuid4().hex[:12]}-big", 1 << 20)


_CRASHING_TRAINER = """
import os, signal, sys, torch, lowdiff
torch.manual_seed(0)
m = torch.nn.Linear(6, 3)
o = torch.optim.Adam(m.parameters(), lr=1e-2)
ck = lowdiff.Checkpointer(m, o, sys.argv[1], strategy="lowdiff+", full_every=4)
ck.resume()
for i in range(int(sys.argv[2])):
    m(torch.randn(5, 6, generator=torch.Generator().manual_seed(i))).pow(2).mean().backward()
    ck.step()
    o.zero_grad()
ck.flush()
os.kill(os.getpid(), signal.SIGKILL)
"""


def _plain() -> tuple[nn.Module, torch.optim.Optimizer]:
    m = nn.Linear(6, 3)
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


@pytest.mark.multiprocess
def test_a_copied_directory_leaves_the_originals_survivor_alone(tmp_path: Path) -> None:
    """``cp -a`` of a directory whose trainer crashed copies the descriptor of the process
    that outlived it. A trainer on the copy must recover from the copy's files, not from
    that process (which serves the original), and must not retire it: the original's
    next trainer still takes it over."""
    import shutil

    from tests import launch

    src, copy = tmp_path / "src", tmp_path / "copy"
    r = launch.run([sys.executable, "-c", _CRASHING_TRAINER, str(src), "4"], timeout=300)
    assert r.returncode == -9
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns(".lowdiff.*.lock"))
    assert (copy / rp.DESCRIPTOR).exists()  # copied along, naming the original's process
    survivor = rp.read_descriptor(src)
    assert survivor is not None and rp.pid_alive(survivor.pid)
    assert rp.read_descriptor(copy) is None  # not this directory's
    m, o = _plain()
    with lowdiff.Checkpointer(copy, m, o, method="lowdiff+", full_every=4) as ck:
        assert ck.resume() == 4
        stats = ck.recovery_stats
        assert stats.source == "disk" and stats.takeover_pid is None
    assert rp.pid_alive(survivor.pid)  # left alone
    m2, o2 = _plain()
    with lowdiff.Checkpointer(src, m2, o2, method="lowdiff+", full_every=4) as ck2:
        assert ck2.resume() == 4
        assert ck2.recovery_stats.source == "memory"
        assert ck2.recovery_stats.takeover_pid == survivor.pid
    for k, v in m.state_dict().items():
        assert torch.equal(v, m2.state_dict()[k]), k  # the same state either way

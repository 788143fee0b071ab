"""LowDiff+: a SIGKILLed trainer is recovered from the replica in memory, without disk reads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import lowdiff
from lowdiff.format import layout
from lowdiff.proc import holder as rp

from .test_sigkill_recovery import _equal_states, _losses, _run

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _recovery_line(lines: list[str]) -> tuple[str, int]:
    parts = next(ln for ln in lines if ln.startswith("recovery ")).split()
    return parts[1], int(parts[2])


def test_training_crash_recovers_from_memory_exactly(tmp_path):
    steps = 30
    ckdir = tmp_path / "ck"
    base = {
        "dir": str(ckdir),
        "steps": steps,
        "strategy": "lowdiff+",
        "sleep": 0.02,
        "idle_timeout": 120,
    }
    _, reported = _run(base, kill_after=17)
    resumed = dict(
        base,
        sleep=0,
        dump_at_resume=str(tmp_path / "resumed.safetensors"),
        dump_at={steps: str(tmp_path / "final.safetensors")},
    )
    lines, _ = _run(resumed)
    start = int(lines[0].split()[1])
    source, file_reads = _recovery_line(lines)
    assert source == "memory"
    assert file_reads == 0, "recovery from memory read checkpoint files"
    # the newest merged step: the last step the trainer completed, or one earlier when
    # the kill landed before that step's snapshot was handed over
    assert reported - 1 <= start <= reported + 1

    ref = {
        "dir": str(tmp_path / "u"),
        "steps": steps,
        "strategy": "none",
        "uncompressed": True,
        "dump_at": {
            start: str(tmp_path / "ref_start.safetensors"),
            steps: str(tmp_path / "ref_final.safetensors"),
        },
    }
    ref_lines, _ = _run(ref)
    assert _equal_states(tmp_path / "resumed.safetensors", tmp_path / "ref_start.safetensors") == []
    assert _equal_states(tmp_path / "final.safetensors", tmp_path / "ref_final.safetensors") == []
    got, want = _losses(lines), _losses(ref_lines)
    assert {s: got[s] for s in got} == {s: want[s] for s in got}
    # closed cleanly: the final state is persisted and no replica is left in memory
    assert lowdiff.inspect_dir(ckdir).recoverable[1] == steps
    assert rp.read_descriptor(ckdir) is None


def _kill_both_at(cfg: dict, kill_after: int, ckdir: Path) -> tuple[int, rp.Descriptor]:
    """Hardware failure: SIGKILL the checkpointing process, then the trainer, at once."""

    from .test_sigkill_recovery import SCRIPT, _env

    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), json.dumps(cfg)],
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    reported = 0
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("step "):
                reported = int(line.split()[1])
                if reported >= kill_after:
                    d = rp.read_descriptor(ckdir)
                    assert d is not None
                    os.kill(d.pid, signal.SIGKILL)
                    os.kill(proc.pid, signal.SIGKILL)
                    break
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 30
    while rp.pid_alive(d.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return reported, d


def test_both_processes_killed_recovers_from_disk(tmp_path):
    ckdir = tmp_path / "ck"
    base = {
        "dir": str(ckdir),
        "steps": 24,
        "strategy": "lowdiff+",
        "sleep": 0.02,
        "persist_every": 5,
    }
    reported, d = _kill_both_at(base, 13, ckdir)
    resumed = dict(base, sleep=0, dump_at_resume=str(tmp_path / "resumed.safetensors"))
    lines, _ = _run(resumed)
    start = int(lines[0].split()[1])
    source, file_reads = _recovery_line(lines)
    assert source == "disk" and file_reads > 0
    assert start <= reported and start % 5 == 0
    ref = {
        "dir": str(tmp_path / "u"),
        "steps": start,
        "strategy": "none",
        "uncompressed": True,
        "dump_at": {start: str(tmp_path / "ref.safetensors")},
    }
    _run(ref)
    assert _equal_states(tmp_path / "resumed.safetensors", tmp_path / "ref.safetensors") == []
    # the dead owner's segments were detected as stale and removed, never attached
    assert not any(n.startswith(f"lowdiff-{d.run_id[:16]}") for n in os.listdir("/dev/shm"))


def test_orphaned_replica_persists_and_exits_after_idle_timeout(tmp_path):
    ckdir = tmp_path / "ck"
    base = {
        "dir": str(ckdir),
        "steps": 40,
        "strategy": "lowdiff+",
        "sleep": 0.02,
        "idle_timeout": 1.0,
        "persist_every": 1000,
    }
    _, reported = _run(base, kill_after=9)
    d = rp.read_descriptor(ckdir)
    deadline = time.monotonic() + 60
    while d is not None and rp.pid_alive(d.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert d is None or not rp.pid_alive(d.pid)
    info = lowdiff.inspect_dir(ckdir)
    # its final merged state was persisted before it exited
    assert info.recoverable is not None and info.recoverable[1] >= reported - 1
    assert rp.read_descriptor(ckdir) is None


def test_killed_trainer_returns_to_a_launcher_that_captures_its_output(tmp_path):
    """A launcher that reads the trainer's stdout and stderr to the end (as
    ``subprocess.run(capture_output=True)``, CI runners and schedulers do) sees a SIGKILLed
    trainer end at once, while its replica lives on for the next trainer."""
    ckdir = tmp_path / "ck"
    cfg = {"dir": str(ckdir), "steps": 60, "strategy": "lowdiff+", "sleep": 0.02}
    cfg["idle_timeout"] = 120
    # both pipes are read to their end after the kill: no survivor may hold them (else
    # this would wait for the replica's idle_timeout)
    _run(cfg, kill_after=9, read_to_end=True)
    # the replica did survive the trainer: it is there for a new one ...
    d = rp.read_descriptor(ckdir)
    assert d is not None and rp.pid_alive(d.pid)
    assert (ckdir / layout.REPLICA_LOG).exists()  # ... and writes to the directory now
    os.kill(d.pid, signal.SIGTERM)  # released: it persists, cleans up and exits
    deadline = time.monotonic() + 60
    while rp.pid_alive(d.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not rp.pid_alive(d.pid)

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
from tests import launch

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


def _process_line(lines: list[str]) -> tuple[int, int]:
    """(the checkpointing process's pid, the pid of the process taken over or -1)."""
    parts = next(ln for ln in lines if ln.startswith("process ")).split()
    return int(parts[1]), int(parts[3])


def test_next_trainer_takes_the_surviving_process_over(tmp_path):
    """Two crashes in a row: each next trainer takes over the replica's process that
    outlived the last one (no new process), and the run ends bit-identical."""
    steps = 30
    ckdir = tmp_path / "ck"
    base = {"dir": str(ckdir), "steps": steps, "strategy": "lowdiff+", "idle_timeout": 120}
    first, _ = _run(dict(base, sleep=0.02), kill_after=9)
    started, adopted = _process_line(first)
    assert adopted == -1 and started > 0
    survivor = rp.read_descriptor(ckdir)
    assert survivor is not None and survivor.pid == started and rp.pid_alive(started)

    second, _ = _run(dict(base, sleep=0.02), kill_after=19)
    assert _recovery_line(second) == ("memory", 0)
    assert _process_line(second) == (started, started)  # taken over, not started anew
    assert rp.pid_alive(started)

    last, _ = _run(dict(base, dump_at={steps: str(tmp_path / "final.safetensors")}))
    assert _recovery_line(last) == ("memory", 0)
    assert _process_line(last) == (started, started)
    ref, _ = _run(
        {"dir": str(tmp_path / "u"), "steps": steps, "strategy": "none", "uncompressed": True,
         "dump_at": {steps: str(tmp_path / "ref.safetensors")}}
    )  # fmt: skip
    assert _equal_states(tmp_path / "final.safetensors", tmp_path / "ref.safetensors") == []
    assert _losses(last) == {s: v for s, v in _losses(ref).items() if s in _losses(last)}
    # closed: the process persisted the last step and exited, leaving nothing in memory
    deadline = time.monotonic() + 30
    while rp.pid_alive(started) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not rp.pid_alive(started)
    assert lowdiff.inspect_dir(ckdir).recoverable[1] == steps
    assert rp.read_descriptor(ckdir) is None
    assert not [
        n for n in os.listdir("/dev/shm") if n.startswith(f"lowdiff-{survivor.run_id[:16]}")
    ]


def test_a_trainer_of_another_job_is_refused_and_starts_its_own_process(tmp_path):
    """A survivor that does not match the new trainer (here: another ``keep_full``) is
    not taken over: it persists what it holds and exits, and the trainer recovers from
    its memory with a new process."""
    ckdir = tmp_path / "ck"
    base = {"dir": str(ckdir), "steps": 20, "strategy": "lowdiff+", "idle_timeout": 120}
    first, _ = _run(dict(base, sleep=0.02), kill_after=8)
    started, _ = _process_line(first)
    lines, _ = _run(dict(base, keep_full=3))
    assert _recovery_line(lines)[0] == "memory"
    pid, adopted = _process_line(lines)
    assert adopted == -1 and pid != started
    assert not rp.pid_alive(started)


def _kill_both_at(cfg: dict, kill_after: int, ckdir: Path) -> tuple[int, rp.Descriptor]:
    """Hardware failure: SIGKILL the checkpointing process, then the trainer, at once."""

    from .test_sigkill_recovery import SCRIPT, _env

    proc = launch.popen(
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


@pytest.mark.parametrize("strategy", ["lowdiff+", "gemini"])
def test_killed_trainer_returns_to_a_launcher_that_captures_its_output(tmp_path, strategy):
    """A launcher that reads the trainer's stdout and stderr to the end (as
    ``subprocess.run(capture_output=True)``, CI runners and schedulers do) sees a SIGKILLed
    trainer end at once, while the process holding its state in memory (LowDiff+'s
    replica, Gemini's holder) lives on for the next trainer."""
    ckdir = tmp_path / "ck"
    cfg = {"dir": str(ckdir), "steps": 60, "strategy": strategy, "sleep": 0.02}
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

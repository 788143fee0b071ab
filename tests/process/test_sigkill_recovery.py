"""End to end: SIGKILL a real training process, restart it, compare with an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from tests import launch

import lowdiff
from lowdiff.state.capture import diff_states

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("job_script.py")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    src = str(Path(lowdiff.__file__).resolve().parents[1])
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(
    cfg: dict, kill_after: int | None = None, read_to_end: bool = False
) -> tuple[list[str], int]:
    """Run the job; with ``kill_after``, SIGKILL it once it reports that many steps.

    With ``read_to_end``, stderr is captured too and both pipes are read to their end
    after the kill, as ``subprocess.run(capture_output=True)`` does: that returns only
    once no process holds them any more.
    """
    proc = launch.popen(
        [sys.executable, str(SCRIPT), json.dumps(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if read_to_end else None,
        text=True,
        env=_env(),
    )
    lines: list[str] = []
    reported = 0
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.strip())
            if line.startswith("step "):
                reported = int(line.split()[1])
                if kill_after is not None and reported >= kill_after:
                    os.kill(proc.pid, signal.SIGKILL)
                    break
        if read_to_end:
            proc.communicate(timeout=60)
        else:
            proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if kill_after is None:
        assert proc.returncode == 0, lines[-5:]
    else:
        assert proc.returncode == -signal.SIGKILL
    return lines, reported


def _losses(lines: list[str]) -> dict[int, str]:
    return {int(p[1]): p[2] for p in (ln.split() for ln in lines) if p[0] == "step"}


def cpu_replica_diffs(
    want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]
) -> tuple[list[str], list[str]]:
    """A LowDiff+ replica of CUDA training steps on the CPU, whose kernels round
    differently: (the integer tensors that differ at all, the float tensors that differ
    beyond rtol 1e-4 / atol 1e-6). Both empty: the state agrees to rounding."""
    assert got.keys() == want.keys()
    exact = [k for k in want if not want[k].is_floating_point()]
    unequal = [k for k in exact if not torch.equal(got[k], want[k])]
    far = [
        k
        for k in want
        if k not in exact and not torch.allclose(got[k], want[k], rtol=1e-4, atol=1e-6)
    ]
    return unequal, far


def _equal_states(a_path: Path, b_path: Path) -> list[str]:
    a = safetensors.torch.load_file(str(a_path))
    b = safetensors.torch.load_file(str(b_path))
    assert a.keys() == b.keys()
    return diff_states(a, b)


@pytest.mark.parametrize("kill_after", [14, 23])
def test_sigkill_then_resume_is_bit_identical(tmp_path, kill_after):
    steps = 30
    ckdir = tmp_path / "ck"
    base = {
        "dir": str(ckdir),
        "steps": steps,
        "strategy": "lowdiff",
        "full_every": 10,
        "batch_size": 4,
        "sleep": 0.01,
    }
    _, reported = _run(base, kill_after=kill_after)

    # The orphaned checkpointing process flushes every record it received, then exits.
    resumed = dict(
        base,
        dump_at_resume=str(tmp_path / "resumed.safetensors"),
        dump_at={steps: str(tmp_path / "final.safetensors")},
    )
    lines, _ = _run(resumed)
    start = int(lines[0].split()[1])
    assert start >= reported, (
        f"records handed off before the kill were lost: resumed at {start}, trainer had reported {reported}"
    )

    ref_cfg = {
        "dir": str(tmp_path / "unused"),
        "steps": steps,
        "strategy": "none",
        "dump_at": {
            start: str(tmp_path / "ref_at_start.safetensors"),
            steps: str(tmp_path / "ref_final.safetensors"),
        },
    }
    ref_lines, _ = _run(ref_cfg)

    assert (
        _equal_states(tmp_path / "resumed.safetensors", tmp_path / "ref_at_start.safetensors") == []
    )
    assert _equal_states(tmp_path / "final.safetensors", tmp_path / "ref_final.safetensors") == []
    ref_losses, got = _losses(ref_lines), _losses(lines)
    assert {s: got[s] for s in got} == {s: ref_losses[s] for s in got}

    info = lowdiff.inspect_dir(ckdir)
    assert info.recoverable is not None and info.recoverable[1] == steps


def test_sigkill_with_error_feedback_recovers_exact_state(tmp_path):
    ckdir = tmp_path / "ck"
    base = {
        "dir": str(ckdir),
        "steps": 20,
        "strategy": "lowdiff",
        "error_feedback": True,
        "full_every": 6,
        "batch_size": 3,
    }
    _, reported = _run(base, kill_after=11)
    lines, _ = _run(dict(base, steps=0, dump_at_resume=str(tmp_path / "resumed.safetensors")))
    start = int(lines[0].split()[1])
    assert start >= reported
    ref = {
        "dir": str(tmp_path / "u"),
        "steps": start,
        "strategy": "none",
        "error_feedback": True,
        "dump_at": {start: str(tmp_path / "ref.safetensors")},
    }
    _run(ref)
    assert _equal_states(tmp_path / "resumed.safetensors", tmp_path / "ref.safetensors") == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sigkill_then_resume_is_bit_identical(tmp_path):
    """On CUDA every record is complete in pinned host memory before ck.step() returns:
    a trainer killed right after a step loses none of the steps it reported."""
    steps = 24
    base = {
        "dir": str(tmp_path / "ck"),
        "steps": steps,
        "strategy": "lowdiff",
        "device": "cuda",
        "full_every": 10,
        "batch_size": 4,
    }
    _, reported = _run(base, kill_after=13)
    lines, _ = _run(dict(base, dump_at_resume=str(tmp_path / "resumed.safetensors")))
    start = int(lines[0].split()[1])
    assert start >= reported
    ref = dict(
        base,
        dir=str(tmp_path / "u"),
        strategy="none",
        dump_at={start: str(tmp_path / "ref.safetensors")},
    )
    _run(ref)
    assert _equal_states(tmp_path / "resumed.safetensors", tmp_path / "ref.safetensors") == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_lowdiff_plus_sigkill_then_resume_from_memory(tmp_path):
    """LowDiff+ on CUDA: a SIGKILLed trainer resumes from the surviving replica, bit for
    bit what the replica holds (the same state a restart from its persisted checkpoint
    loads), and loses no step it reported. The replica's optimizer step runs on the CPU,
    so against uninterrupted CUDA training the floats agree to rounding (see Limits in
    the README) and every integer (step counters, BatchNorm's count) exactly."""
    steps = 24
    base = {
        "dir": str(tmp_path / "ck"),
        "steps": steps,
        "strategy": "lowdiff+",
        "device": "cuda",
        "idle_timeout": 120,
    }
    _, reported = _run(base, kill_after=13)
    assert 13 <= reported < steps  # the kill landed mid-run
    lines, _ = _run(dict(base, steps=0, dump_at_resume=str(tmp_path / "memory.safetensors")))
    start = int(lines[0].split()[1])
    assert next(ln for ln in lines if ln.startswith("recovery ")).split()[1] == "memory"
    assert reported - 1 <= start <= reported + 1
    # close() above persisted the replica and stopped it: this restart reads the disk
    lines, _ = _run(dict(base, steps=0, dump_at_resume=str(tmp_path / "disk.safetensors")))
    assert int(lines[0].split()[1]) == start
    assert next(ln for ln in lines if ln.startswith("recovery ")).split()[1] == "disk"
    assert _equal_states(tmp_path / "memory.safetensors", tmp_path / "disk.safetensors") == []
    ref = dict(
        base,
        dir=str(tmp_path / "u"),
        strategy="none",
        uncompressed=True,
        dump_at={start: str(tmp_path / "ref.safetensors")},
    )
    _run(ref)
    got = safetensors.torch.load_file(str(tmp_path / "memory.safetensors"))
    want = safetensors.torch.load_file(str(tmp_path / "ref.safetensors"))
    unequal_integers, far = cpu_replica_diffs(want, got)
    assert unequal_integers == []
    assert far == []


@pytest.mark.parametrize("kill_after", [13, 16])
def test_sigkill_of_an_attached_loop_then_resume_is_bit_identical(tmp_path, kill_after):
    """lowdiff.attach: the loop calls opt.step() and sched.step() itself. A step is handed
    over when the next one begins, so a kill loses at most the step reported last. Step 16
    writes a full checkpoint (full_every=8): its record too waits for the user's
    scheduler.step() (sent with the full checkpoint's staging, it held the scheduler's
    state from before that step)."""
    steps = 22
    base = {
        "dir": str(tmp_path / "ck"),
        "steps": steps,
        "strategy": "lowdiff",
        "attach": True,
        "full_every": 8,
        "batch_size": 3,
        # after the full-checkpoint step, a long pause: the kill lands before the next update
        "sleep": 0.3 if kill_after == 16 else 0.01,
    }
    _, reported = _run(base, kill_after=kill_after)
    resumed = dict(
        base,
        dump_at_resume=str(tmp_path / "resumed.safetensors"),
        dump_at={steps: str(tmp_path / "final.safetensors")},
        sleep=0.01,
    )
    lines, _ = _run(resumed)
    start = int(lines[0].split()[1])
    assert reported - 1 <= start <= reported + 1
    if kill_after == 16:
        # the kill landed between step 16 (reported) and the next update: its record was
        # still waiting for that update's hand-over, and only it was lost
        assert reported == 16 and start == 15, (reported, start)
    ref = {
        "dir": str(tmp_path / "u"),
        "steps": steps,
        "strategy": "none",
        "dump_at": {
            start: str(tmp_path / "ref_start.safetensors"),
            steps: str(tmp_path / "ref.safetensors"),
        },
    }
    _run(ref)
    assert _equal_states(tmp_path / "resumed.safetensors", tmp_path / "ref_start.safetensors") == []
    assert _equal_states(tmp_path / "final.safetensors", tmp_path / "ref.safetensors") == []

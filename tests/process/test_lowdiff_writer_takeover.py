"""LowDiff: the writer outlives a SIGKILLed trainer, writes what it was sent, and the
next trainer takes it over after recovering from disk (no new process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from tests import launch

import lowdiff
from lowdiff.format import layout
from lowdiff.proc import holder as rp
from lowdiff_lab import faults

from .test_lowdiff_plus_recovery import _process_line, _recovery_line
from .test_sigkill_recovery import SCRIPT, _env, _equal_states, _losses, _run

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

BASE = {"strategy": "lowdiff", "full_every": 5, "batch_size": 3, "idle_timeout": 120}


def _wait_gone(pid: int, timeout: float = 30) -> bool:
    return _wait_for(lambda: not rp.pid_alive(pid), timeout)


def _wait_for(cond, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(cond())


def _segments(run_id: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"lowdiff-{run_id[:16]}")]


def _finish_and_compare(tmp_path, base: dict, steps: int) -> tuple[list[str], list[str]]:
    """A new trainer of ``base`` trains to ``steps``, and the same job runs uninterrupted
    in another directory: their final states are ``torch.equal``. The two runs' lines."""
    last, _ = _run(dict(base, dump_at={steps: str(tmp_path / "final.safetensors")}))
    ref, _ = _run(
        dict(BASE, dir=str(tmp_path / "u"), steps=steps,
             dump_at={steps: str(tmp_path / "ref.safetensors")})
    )  # fmt: skip
    assert _equal_states(tmp_path / "final.safetensors", tmp_path / "ref.safetensors") == []
    return last, ref


def test_next_trainer_takes_the_surviving_writer_over(tmp_path):
    """Two crashes in a row: each next trainer recovers from disk every step it handed
    over, then takes over the writer that outlived the last one; the run ends
    bit-identical to an uninterrupted one, and the writer exits at close()."""
    steps = 24
    ckdir = tmp_path / "ck"
    base = dict(BASE, dir=str(ckdir), steps=steps)
    first, reported = _run(dict(base, sleep=0.02), kill_after=8)
    started, adopted = _process_line(first)
    assert adopted == -1 and started > 0
    survivor = rp.read_descriptor(ckdir)
    assert survivor is not None and survivor.pid == started and rp.pid_alive(started)

    second, reported2 = _run(dict(base, sleep=0.02), kill_after=17)
    source, reads = _recovery_line(second)
    assert source == "disk" and reads > 0
    start = int(second[0].split()[1])
    # every step whose step() returned was written by the survivor before it was taken over
    assert reported <= start <= reported + 1
    assert _process_line(second) == (started, started)  # taken over, not started anew

    last, ref = _finish_and_compare(tmp_path, base, steps)
    assert reported2 <= int(last[0].split()[1]) <= reported2 + 1
    assert _process_line(last) == (started, started)
    assert _losses(last) == {s: v for s, v in _losses(ref).items() if s in _losses(last)}
    # closed: the writer wrote the last step and exited, leaving nothing behind (its
    # descriptor, and the slots, counters and staging buffers it made for each trainer)
    assert _wait_gone(started)
    assert not _segments(survivor.run_id)
    assert rp.read_descriptor(ckdir) is None
    assert lowdiff.inspect_dir(ckdir).recoverable[1] == steps
    assert rp.read_descriptor(ckdir) is None
    assert not _segments(survivor.run_id)


def test_the_next_trainer_stages_its_full_checkpoints_in_the_buffer_the_writer_made(
    tmp_path,
):
    """Waiting, the writer makes the next trainer's staging buffer (as large as the dead
    trainer's, its pages allocated): after the takeover, the trainer's full checkpoints
    are copied into it instead of into a buffer of its own, and a full checkpoint
    written from it restores bit-identical to the state it was taken from."""
    ckdir = tmp_path / "ck"
    base = dict(BASE, dir=str(ckdir), steps=40, sleep=0.02)
    first, _ = _run(base, kill_after=7)  # past the full checkpoint at 5
    started, _ = _process_line(first)
    d = rp.read_descriptor(ckdir)
    assert d is not None and d.pid == started
    assert _wait_for(lambda: any(n.endswith("-t1-stage") for n in _segments(d.run_id)))
    stage = next(n for n in _segments(d.run_id) if n.endswith("-t1-stage"))
    assert os.path.getsize(f"/dev/shm/{stage}") > 0

    second, _ = _run(
        dict(base, report_staging=True, dump_at={10: str(tmp_path / "at10.safetensors")}),
        kill_after=12,
    )
    assert _process_line(second) == (started, started)
    assert "staged 10 into the process buffer" in second, second

    rp.wait_until_written(ckdir, 60)
    from .job_script import build

    model, opt, sched = build()
    assert lowdiff.restore(ckdir, model, opt, sched, step=10) == 10
    assert 10 in [f.first_step for f in lowdiff.inspect_dir(ckdir).full_checkpoints]
    restored = tmp_path / "restored.safetensors"
    from .job_script import dump

    dump(str(restored), model, opt, sched)
    assert _equal_states(restored, tmp_path / "at10.safetensors") == []
    os.kill(started, signal.SIGTERM)
    assert _wait_gone(started, 60)
    assert not _segments(d.run_id)


def test_a_trainer_of_another_job_is_refused_and_starts_its_own_writer(tmp_path):
    """A writer that does not match the new trainer (another ``keep_full``) is not taken
    over: it exits, and the trainer starts a writer of its own."""
    ckdir = tmp_path / "ck"
    base = dict(BASE, dir=str(ckdir), steps=16)
    first, _ = _run(dict(base, sleep=0.02), kill_after=7)
    started, _ = _process_line(first)
    lines, _ = _run(dict(base, keep_full=3))
    assert _recovery_line(lines)[0] == "disk"
    pid, adopted = _process_line(lines)
    assert adopted == -1 and pid != started
    assert _wait_gone(started)


def test_a_writer_whose_chain_the_recovery_does_not_reach_is_not_taken_over(tmp_path):
    """The newest record file is damaged after the writer wrote it: the recovery stops
    before the end of the writer's chain, so the writer (asked while the state was being
    recovered) is let go instead of taken over, and the trainer starts its own; the run
    still ends bit-identical to an uninterrupted one, with nothing left in /dev/shm."""
    steps = 20
    ckdir = tmp_path / "ck"
    base = dict(BASE, dir=str(ckdir), steps=steps)
    first, _ = _run(dict(base, sleep=0.02), kill_after=8)  # past the full at 5
    started, _ = _process_line(first)
    survivor = rp.read_descriptor(ckdir)
    assert survivor is not None and rp.pid_alive(started)
    rp.wait_until_written(ckdir, 60)  # the launcher returned before the writer was done
    written = lowdiff.inspect_dir(ckdir).recoverable[1]
    newest = max((ckdir / "records").glob("rec-*.safetensors"))  # rec-FIRST-LAST, zero-padded
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])

    lines, _ = _finish_and_compare(tmp_path, base, steps)
    start = int(lines[0].split()[1])
    assert start < written  # the damage made the recovery stop short of the writer's chain
    pid, adopted = _process_line(lines)
    assert adopted == -1 and pid != started
    assert _wait_gone(started)
    assert not _segments(survivor.run_id)


def test_a_recovery_that_fails_leaves_the_writer_for_the_next_trainer(tmp_path):
    """The manifest is damaged after the crash: the next trainer has already asked the
    writer to take it on (while recovering) when its recovery raises, naming the file.
    That trainer gone, the writer waits for the next one again; once the manifest is
    repaired, the next trainer takes it over and the run ends bit-identical."""
    steps = 20
    ckdir = tmp_path / "ck"
    base = dict(BASE, dir=str(ckdir), steps=steps)
    first, reported = _run(dict(base, sleep=0.02), kill_after=8)
    started, _ = _process_line(first)
    survivor = rp.read_descriptor(ckdir)
    assert survivor is not None and rp.pid_alive(started)
    rp.wait_until_written(ckdir, 60)
    manifest = ckdir / layout.MANIFEST
    good = manifest.read_bytes()
    raw = bytearray(good)
    i = raw.index(b'"format')
    raw[i + 2] ^= 0x01  # a flipped bit inside the checksummed JSON
    manifest.write_bytes(bytes(raw))

    out = launch.run(
        [sys.executable, str(SCRIPT), json.dumps(base)],
        capture_output=True, text=True, env=_env(), timeout=120,
    )  # fmt: skip
    assert out.returncode != 0
    assert "lowdiff.json" in out.stderr and "CorruptCheckpointError" in out.stderr
    assert _wait_for(lambda: rp.orphan_idle(ckdir)) and rp.pid_alive(started)
    # the failing trainer's request had been accepted before it failed: it took the
    # slots made ahead (t1), and waiting again the writer made the next ones (t2)
    assert _wait_for(lambda: any(n.endswith("-t2-slots") for n in _segments(survivor.run_id)))

    manifest.write_bytes(good)
    last, _ = _finish_and_compare(tmp_path, base, steps)
    assert reported <= int(last[0].split()[1]) <= reported + 1
    assert _process_line(last) == (started, started)
    assert _wait_gone(started)
    assert not _segments(survivor.run_id)


def test_orphaned_writer_exits_after_idle_timeout(tmp_path):
    """No trainer comes: the writer, having written every record it was sent, exits
    ``idle_timeout`` later and leaves no descriptor and no shared memory."""
    ckdir = tmp_path / "ck"
    _, reported = _run(dict(BASE, dir=str(ckdir), steps=40, sleep=0.02, idle_timeout=1.0),
                       kill_after=9)  # fmt: skip
    d = rp.read_descriptor(ckdir)
    assert d is not None
    assert _wait_gone(d.pid, 60)
    assert lowdiff.inspect_dir(ckdir).recoverable[1] >= reported
    assert rp.read_descriptor(ckdir) is None
    assert not _segments(d.run_id)


def test_killed_trainer_returns_to_a_launcher_that_captures_its_output(tmp_path):
    """A launcher that reads the trainer's stdout and stderr to their end sees a
    SIGKILLed trainer end at once, while its writer waits for the next trainer."""
    ckdir = tmp_path / "ck"
    _run(dict(BASE, dir=str(ckdir), steps=60, sleep=0.02), kill_after=9, read_to_end=True)
    d = rp.read_descriptor(ckdir)
    assert d is not None and rp.pid_alive(d.pid)
    assert (ckdir / layout.REPLICA_LOG).exists()
    # it made the next trainer's slots while waiting (lowdiff-<run>-t1-slots)
    assert _wait_for(lambda: any(n.endswith("-t1-slots") for n in _segments(d.run_id)))
    os.kill(d.pid, signal.SIGTERM)  # released: it exits
    assert _wait_gone(d.pid, 60)
    assert rp.read_descriptor(ckdir) is None
    assert not _segments(d.run_id)  # the slots it made ahead for the next trainer too


def test_idle_timeout_zero_keeps_no_writer(tmp_path):
    """``idle_timeout=0``: the writer of a killed trainer writes what it was sent and
    exits at once, as before; the next trainer starts its own."""
    ckdir = tmp_path / "ck"
    first, reported = _run(dict(BASE, dir=str(ckdir), steps=16, sleep=0.02, idle_timeout=0),
                           kill_after=7)  # fmt: skip
    started, _ = _process_line(first)
    assert _wait_gone(started)
    assert rp.read_descriptor(ckdir) is None
    lines, _ = _run(dict(BASE, dir=str(ckdir), steps=16))
    assert reported <= int(lines[0].split()[1])
    assert _process_line(lines)[1] == -1


def test_no_record_file_lands_before_the_first_full_checkpoint(tmp_path):
    """The writer is killed while its first full checkpoint (step 0) is still being
    written (stalled before its rename) and records of later steps have reached it: no
    record file is on disk, since records chain from that checkpoint. The next trainer
    finds nothing durable and starts afresh instead of refusing the directory."""

    ckdir = tmp_path / "ck"
    mark = tmp_path / "full-stalled"
    env = dict(
        _env(),
        **{
            faults.FAULT_ENV: "before_rename:full:1:slow",
            faults.SLOW_ENV: "20",
            faults.MARK_ENV: str(mark),
        },
    )
    cfg = dict(BASE, dir=str(ckdir), steps=30, batch_size=1, full_every=100, idle_timeout=0)
    proc = launch.popen(
        [sys.executable, str(SCRIPT), json.dumps(cfg)],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line.strip())
            if line.startswith("step 3"):
                break
        writer, _ = _process_line(lines)
        assert _wait_for(mark.exists)  # the full checkpoint of step 0 is stalled
        # the trainer reported step 3: the records of steps 1 to 3 were handed over; the
        # writer gets a second to act on them (without the fix they land as files in it)
        time.sleep(1.0)
        assert not [p for p in (ckdir / "records").iterdir() if not p.name.startswith(".")]
        os.kill(writer, signal.SIGKILL)
        assert _wait_gone(writer)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert not list((ckdir / "full").glob("full-*"))  # the stalled checkpoint never landed
    assert not [p for p in (ckdir / "records").iterdir() if not p.name.startswith(".")]

    again, _ = _run(dict(cfg, steps=6))
    assert again[0] == "resumed 0" and _recovery_line(again) == ("none", 0)
    assert again[-1] == "done"


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[1])


def test_the_process_server_outlives_its_trainer_until_the_survivor_exits(tmp_path):
    """The process server of a SIGKILLed trainer stays while the writer it forked waits for
    the next trainer (so that the writer is never the last holder of the dead trainer's
    memory), holding none of the trainer's standard streams; it reaps the writer when the
    writer exits after the next trainer's close(), and exits too."""
    ckdir = tmp_path / "ck"
    base = dict(BASE, dir=str(ckdir), steps=16)
    first, _ = _run(dict(base, sleep=0.02), kill_after=8, read_to_end=True)
    writer, _ = _process_line(first)
    assert rp.pid_alive(writer) and rp.read_descriptor(ckdir) is not None
    server = _ppid(writer)
    with open(f"/proc/{server}/comm") as f:
        assert f.read().strip() == "lowdiff-server"
    assert rp.pid_alive(server)
    assert [os.readlink(f"/proc/{server}/fd/{fd}") for fd in (0, 1, 2)] == ["/dev/null"] * 3

    last, _ = _run(dict(base))  # takes the writer over, trains to the end, closes
    assert _process_line(last) == (writer, writer)
    assert _wait_gone(writer) and _wait_gone(server)
    # reaped by its server, not left a zombie for the container's first process
    assert not os.path.exists(f"/proc/{writer}")

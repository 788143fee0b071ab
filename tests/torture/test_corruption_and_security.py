"""Every flipped byte and every truncation is detected and never loaded; no load path
unpickles; names read from a directory cannot reach outside it; one trainer per directory."""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tests import launch

import lowdiff
from lowdiff.proc import holder as rp
from lowdiff_lab.torture import workload
from lowdiff_lab.torture.corrupt import N_STEPS, run_corruption
from lowdiff_lab.torture.report import TortureReport

pytestmark = pytest.mark.multiprocess

SRC = Path(lowdiff.__file__).resolve().parent


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A directory holding ``corrupt/``: fulls 0, 4, 8, 12 and records 0..13."""
    w = tmp_path_factory.mktemp("torture")
    workload.train_directory(w / "corrupt", N_STEPS)
    return w


@pytest.fixture(scope="module")
def ref():
    return workload.reference(N_STEPS)


def test_corruption_sweep(work, ref, torture_report) -> None:
    report = TortureReport()
    run_corruption(work, report, flips=4, cuts=2, seed=5, reference=ref)
    torture_report.merge(report)
    assert report.failures == []
    assert report.corruptions == report.corruptions_detected == 10 * 6
    assert report.corruptions_undetected == report.damaged_loads == 0
    assert report.fallback_not_newest == 0
    assert report.fallbacks > 0
    assert set(report.corruptions_by_file) == {"manifest", "full", "records"}


# ----------------------------------------------------------------------------- security


def test_no_load_path_unpickles(work, ref, tmp_path, monkeypatch) -> None:
    def refuse(*_a, **_k):
        raise AssertionError("checkpoint data must never be unpickled")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    d = work / "corrupt"
    model, opt, sched = workload.build(seed=7)
    assert lowdiff.restore(d, model, opt, sched, step=6) == 6
    assert lowdiff.verify_dir(d)[1] == []
    assert lowdiff.inspect_dir(d).recoverable == (0, N_STEPS)
    assert lowdiff.export(d, None, tmp_path / "m.safetensors") == N_STEPS


def test_source_never_unpickles() -> None:
    """lowdiff's own formats never unpickle. The baselines' format is ``torch.save``'s:
    they load it only with PyTorch's restricted unpickler (``weights_only=True``: tensors
    and plain containers), after the file's digest was checked. The torture harness reads
    the reference states its own DDP job saved, with the same restricted unpickler; no
    checkpoint a user hands lowdiff goes through it."""
    offenders = []
    for p in SRC.rglob("*.py"):
        rel = p.relative_to(SRC)
        for line in p.read_text().splitlines():
            for needle in ("pickle.load", "torch.load(", "Unpickler", "np.load("):
                if needle not in line:
                    continue
                if (
                    rel.parts[0] in ("baselines", "torture")
                    and needle == "torch.load("
                    and "weights_only=True" in line
                ):
                    continue
                offenders.append(f"{rel}: {line.strip()}")
    assert offenders == []


@pytest.mark.parametrize(
    "ctl",
    ["../../etc/passwd", "/lowdiff-x/../../y", "lowdiff-ok/../../z", "psm_other", "", 5],
)
def test_forged_replica_descriptor_reaches_nothing_outside(tmp_path, ctl) -> None:
    (tmp_path / rp.DESCRIPTOR).write_text(
        f'{{"pid": {os.getpid()}, "host": "{socket.gethostname()}", "run_id": "ab", '
        f'"ctl": {ctl!r}, "layout_id": "x"}}'.replace("'", '"')
    )
    assert rp.read_descriptor(tmp_path) is None
    live, why = rp.find_live_replica(tmp_path, "x", wait_s=0)
    assert live is None and why == "no live replica"
    assert rp.valid_segment_name("lowdiff-0123abcd-ctl")
    assert not rp.valid_segment_name(ctl)


def test_file_names_come_from_steps_not_from_metadata(work, tmp_path) -> None:
    d = tmp_path / "ck"
    shutil.copytree(work / "corrupt", d, ignore=shutil.ignore_patterns(".lowdiff*.lock"))
    # a full checkpoint whose metadata disagrees with its name is never used
    (d / "full" / "full-000000000012.safetensors").rename(
        d / "full" / "full-000000000016.safetensors"
    )
    info = lowdiff.inspect_dir(d)
    assert [p.name for p, _ in info.problems] == ["full-000000000016.safetensors"]
    assert "does not match the file name" in info.problems[0][1]
    # a foreign file in records/ is reported, not read
    (d / "records" / "..evil.safetensors").write_bytes(b"x")
    assert "..evil.safetensors" in {p.name for p, _ in lowdiff.inspect_dir(d).problems}


def test_second_trainer_on_a_directory_gets_the_holders_pid_and_host(tmp_path) -> None:
    holder = launch.popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from lowdiff.proc.locks import acquire_flock; "
            "acquire_flock(Path(sys.argv[1]) / '.lowdiff.lock', blocking=True); print('held', flush=True); "
            "time.sleep(120)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        model, opt, _ = workload.build()
        with pytest.raises(lowdiff.DirectoryLockedError) as info:
            lowdiff.Checkpointer(tmp_path, model, opt, compressor=workload.compressor())
        text = str(info.value)
        assert f"pid={holder.pid}" in text and f"host={socket.gethostname()}" in text
        assert str(tmp_path) in text
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
    # a killed holder leaves no stale lock behind
    ck = lowdiff.Checkpointer(tmp_path, model, opt, compressor=workload.compressor())
    ck.close()


def test_a_busy_process_that_never_lets_go_is_named_after_start_timeout_in_all(tmp_path) -> None:
    """A process that holds the directory's writer lock and names itself in a replica
    descriptor, forever busy (never waiting for a new trainer): resume() looks for a
    survivor, then for one to release, then waits for the lock, and gives up after
    start_timeout seconds for the three together, naming the holder and the whole wait."""
    ctl = f"lowdiff-{os.getpid()}busy-ctl"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, socket, sys, time; from pathlib import Path; "
            "from lowdiff.proc.locks import acquire_flock; from lowdiff.proc import holder as rp; "
            "root = Path(sys.argv[1]); acquire_flock(root / '.lowdiff.writer.lock', blocking=True); "
            "shm = rp.create_segment(sys.argv[2], rp.CTL_BYTES); "
            "rp.ControlBlock(shm).write(rp.STATE_RUNNING, 3, {'run_id': 'r1', 'layout_id': 'x'}); "
            "rp.write_descriptor(root, rp.Descriptor(os.getpid(), socket.gethostname(), 'r1', "
            "sys.argv[2], 'x', process='writer')); "
            "print('held', flush=True); time.sleep(120)",
            str(tmp_path),
            ctl,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        model, opt, _ = workload.build()
        ck = lowdiff.Checkpointer(
            tmp_path,
            model,
            opt,
            compressor=workload.compressor(),
            timeouts=lowdiff.Timeouts(start=2.0),
        )
        try:
            t0 = time.monotonic()
            with pytest.raises(lowdiff.DirectoryLockedError) as info:
                ck.resume()
            waited = time.monotonic() - t0
        finally:
            ck.close()
        text = str(info.value)
        assert f"pid={holder.pid}" in text and str(tmp_path) in text
        said = float(text.rsplit("after ", 1)[1].removesuffix(" s"))
        assert said >= 2.0 and abs(said - waited) < 1.0, (text, waited)
        assert holder.poll() is None  # asked to go (SIGTERM) it would have exited
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{ctl}")

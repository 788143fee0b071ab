"""strategy="dcp-async": torch.distributed.checkpoint.async_save, exact recovery, damage named.

The process-based saver (DCP's daemon) costs a few seconds to start, so only the tests
that are about it use it; the others run the thread-based saver, whose files and
recovery path are the same.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch.distributed as dist
from tests import launch
from tests.baselines import harness

import lowdiff
from lowdiff.format import layout
from lowdiff_lab.baselines import BaselineCheckpointer, dcp_async

pytestmark = [
    pytest.mark.multiprocess,
    # the thread saver runs dcp.save(no_dist=True) on purpose; DCP says so once
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]

REPO = Path(__file__).resolve().parents[2]


def _children() -> set[int]:
    """Live child processes of this process, but multiprocessing's resource tracker.

    (The tracker is one per process, started by the first spawn of anyone, and ends
    with its parent; it is not a worker.)
    """
    out: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        with open(task / "children") as f:
            out.update(int(p) for p in f.read().split())
    return {p for p in out if _alive(p) and b"resource_tracker" not in _cmdline(p)}


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _train(ck: BaselineCheckpointer, objects: tuple, start: int, stop: int) -> None:
    model, opt, _ = objects
    for t in range(start, stop):
        harness.train_step(model, t)
        ck.step()
        opt.zero_grad()


def test_process_saver_resume_is_exact_and_leaves_no_process(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    before = _children()
    ck, _, _ = harness.run(d, 0, 7, strategy="dcp-async", full_every=3, async_mode="process")
    assert isinstance(ck, lowdiff.Checkpointer) and ck.method == "dcp-async"
    assert isinstance(ck.strategy_impl, BaselineCheckpointer)
    assert ck.strategy_impl.async_mode == "process" and ck.stats["process_saver"] == 1.0
    assert ck.stats["durable_step"] == 6 and ck.stats["bytes_written"] > 0
    assert layout.read_manifest(d)["dcp"]["async_mode"] == "process"
    # close() stopped DCP's daemon and destroyed the private one-rank group
    assert _children() == before and not dist.is_initialized()
    assert sorted(p.name for p in (d / "full").iterdir()) == [
        "dcp-000000000003",
        "dcp-000000000003.commit",
        "dcp-000000000006",
        "dcp-000000000006.commit",
    ]

    ck, objects, resumed = harness.run(
        d, 0, 6, strategy="dcp-async", full_every=3, async_mode="process", close=False
    )
    assert resumed == 6  # step 7 was never saved
    rs = ck.recovery_stats
    assert rs is not None and rs.bytes_read > 0 and rs.files_read == 2
    assert rs.read_s > 0 and rs.decode_s > 0 and rs.replay_s > 0
    harness.assert_exact(harness.reference(6), objects)
    # continuing after the resume equals the uninterrupted run
    _train(ck, objects, 6, 9)
    ck.close()
    assert ck.durable_step == 9
    harness.assert_exact(harness.reference(9), objects)
    assert _children() == before and not dist.is_initialized()


def test_default_is_dcps_own_default_the_thread_saver_without_a_group(tmp_path: Path) -> None:
    # what async_save does when not told otherwise (and torchtitan's "async" mode)
    before = _children()
    ck, _, _ = harness.run(tmp_path / "ckpt", 0, 4, strategy="dcp-async", full_every=2)
    assert (
        ck.strategy_impl.async_mode == "thread"
        and ck.strategy_impl.requested_async_mode == "thread"
    )
    assert (
        ck.stats["process_saver"] == 0.0 and ck.strategy_impl.staging["use_shared_memory"] is False
    )
    assert ck.durable_step == 4 and _children() == before and not dist.is_initialized()
    assert layout.read_manifest(tmp_path / "ckpt")["dcp"]["async_mode"] == "thread"


def test_thread_saver_resume_from_step_zero_is_exact(tmp_path: Path) -> None:
    # only the step-0 checkpoint exists: the optimizer state was empty when it was taken
    d = tmp_path / "ckpt"
    ck, _, _ = harness.run(d, 0, 2, strategy="dcp-async", full_every=5, async_mode="thread")
    assert ck.strategy_impl.async_mode == "thread" and ck.stats["process_saver"] == 0.0
    ck, objects, resumed = harness.run(
        d, 0, 0, strategy="dcp-async", full_every=5, async_mode="thread", close=False
    )
    assert resumed == 0
    harness.assert_exact(harness.reference(0), objects)
    _train(ck, objects, 0, 6)  # the checkpoint at 5 holds a real optimizer state
    ck.close()
    harness.assert_exact(harness.reference(6), objects)
    ck, objects, resumed = harness.run(
        d, 0, 5, strategy="dcp-async", full_every=5, async_mode="thread", close=False
    )
    assert resumed == 5
    ck.close()
    harness.assert_exact(harness.reference(5), objects)


CHILD = """
import sys
import torch
from tests.baselines import harness
import lowdiff
from lowdiff_lab.baselines.dcp_saver import saver_pid

def main():
    torch.set_num_threads(1)  # as the tests' conftest: the reference is computed so
    model, opt, sched = harness.build()
    ck = lowdiff.Checkpointer(model, opt, sys.argv[1], strategy="dcp-async", scheduler=sched,
                              full_every=1, keep_full=3, async_mode="process")
    start = ck.resume()
    print("saver", saver_pid(), flush=True)
    for t in range(start, 10_000):
        harness.train_step(model, t)
        ck.step()
        opt.zero_grad()
        print("step", t + 1, ck.durable_step, flush=True)

if __name__ == "__main__":
    main()
"""


def test_sigkill_of_the_trainer_recovers_its_durable_step(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    script = tmp_path / "job.py"
    script.write_text(CHILD)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "src")]))
    proc = launch.popen(
        [sys.executable, str(script), str(d)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=REPO,
    )
    saver, durable, steps = None, -1, 0
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            kind, *vals = line.split()
            if kind == "saver":
                saver = int(vals[0])
            elif kind == "step":
                steps, durable = int(vals[0]), int(vals[1])
                if durable >= 6:
                    os.kill(proc.pid, signal.SIGKILL)
                    break
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL and saver is not None and durable >= 6
    # the killed trainer's daemon finishes what it was handed, then ends by itself
    deadline = time.monotonic() + 60
    while _alive(saver) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(saver)

    ck, objects, resumed = harness.run(
        d, 0, 0, strategy="dcp-async", full_every=1, async_mode="thread", close=False
    )
    assert durable <= resumed <= steps
    ck.close()
    harness.assert_exact(harness.reference(resumed), objects)


@pytest.mark.parametrize("damage", ["flip-data", "flip-metadata", "truncate", "no-commit"])
def test_damaged_newest_falls_back_with_a_warning(tmp_path: Path, damage: str) -> None:
    d = tmp_path / "ckpt"
    harness.run(d, 0, 4, strategy="dcp-async", full_every=2, keep_full=None, async_mode="thread")
    newest = d / "full" / "dcp-000000000004"
    target = newest / (".metadata" if damage == "flip-metadata" else "__0_0.distcp")
    raw = bytearray(target.read_bytes())
    if damage.startswith("flip"):
        raw[len(raw) // 2] ^= 0x10
        target.write_bytes(bytes(raw))
    elif damage == "truncate":
        target.write_bytes(bytes(raw[: len(raw) // 3]))
    else:
        (d / "full" / "dcp-000000000004.commit").unlink()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ck, objects, resumed = harness.run(
            d, 0, 2, strategy="dcp-async", full_every=2, async_mode="thread", close=False
        )
    assert resumed == 2
    assert any(
        issubclass(x.category, lowdiff.RecoveryWarning) and "dcp-000000000004" in str(x.message)
        for x in w
    )
    assert any(p.name.startswith("dcp-000000000004") for p in (d / "quarantine").iterdir())
    assert ck.recovery_stats is not None and len(ck.recovery_stats.skipped) == 1
    ck.close()
    harness.assert_exact(harness.reference(2), objects)


def test_a_trainer_killed_in_its_first_save_starts_afresh(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    harness.run(d, 0, 1, strategy="dcp-async", full_every=5, async_mode="thread")
    (d / "full" / "dcp-000000000000.commit").unlink()  # the save never finished
    with pytest.warns(lowdiff.RecoveryWarning, match="dcp-000000000000"):
        ck, objects, resumed = harness.run(d, 0, 3, strategy="dcp-async", async_mode="thread")
    assert resumed == 0
    harness.assert_exact(harness.reference(3), objects)


def test_a_failed_save_is_raised_on_the_next_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_space(ckpt: Path, step: int) -> dict:
        if step == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(ckpt))
        return real(ckpt, step)

    real = dcp_async.publish_commit
    monkeypatch.setattr(dcp_async, "publish_commit", no_space)
    model, opt, sched = objects = harness.build()
    ck = lowdiff.Checkpointer(
        tmp_path / "c",
        model,
        opt,
        method="dcp-async",
        full_every=2,
        method_options={"async_mode": "thread"},
    )
    ck.resume()
    with pytest.raises(lowdiff.CheckpointWorkerError, match="step 2") as e:
        _train(ck, objects, 0, 10)
    assert e.value.storage and ck.durable_step == 0
    with pytest.raises(lowdiff.CheckpointWorkerError):
        ck.close()


def test_bad_options(tmp_path: Path) -> None:
    model, opt, _ = harness.build()
    with pytest.raises(ValueError, match="async_mode"):
        lowdiff.Checkpointer(
            tmp_path / "a", model, opt, method="dcp-async", method_options={"async_mode": "gpu"}
        )
    with pytest.raises(TypeError, match="batch_size"):
        lowdiff.Checkpointer(
            tmp_path / "b", model, opt, method="dcp-async", method_options={"batch_size": 3}
        )
    with pytest.raises(ValueError, match="full_every"):
        lowdiff.Checkpointer(tmp_path / "c", model, opt, method="dcp-async", full_every=0)
    with pytest.raises(ValueError, match="keep_full"):
        lowdiff.Checkpointer(tmp_path / "d", model, opt, method="dcp-async", keep_full=0)
    d = tmp_path / "e"
    harness.run(d, 0, 2, strategy="torch-save", full_every=2)
    with pytest.raises(lowdiff.CheckpointMismatchError, match="torch-save"):
        lowdiff.Checkpointer(d, model, opt, method="dcp-async").resume()


def test_retention_keeps_newest(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    harness.run(d, 0, 8, strategy="dcp-async", full_every=2, keep_full=2, async_mode="thread")
    assert sorted(p.name for p in (d / "full").iterdir()) == [
        "dcp-000000000006",
        "dcp-000000000006.commit",
        "dcp-000000000008",
        "dcp-000000000008.commit",
    ]


def test_a_stager_closed_by_async_save_still_serves_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch 2.11's ``async_save`` closes the stager it is given after every save (later
    versions close only their own). Such an ``async_save`` is imitated here: every save
    after the first still stages, and the resume is exact."""
    import torch.distributed.checkpoint as dcp

    real = dcp.async_save
    closes = []

    def closing_async_save(*args, **kwargs):
        fut = real(*args, **kwargs)
        kwargs["async_stager"].close()
        closes.append(1)
        return fut

    monkeypatch.setattr(dcp, "async_save", closing_async_save)
    d = tmp_path / "ckpt"
    ck, _, _ = harness.run(d, 0, 5, strategy="dcp-async", full_every=1, async_mode="thread")
    assert len(closes) == 6  # step 0 and every step after it: five saves on a closed stager
    assert ck.durable_step == 5
    monkeypatch.setattr(dcp, "async_save", real)
    ck, objects, resumed = harness.run(d, 5, 5, strategy="dcp-async", full_every=1)
    assert resumed == 5
    harness.assert_exact(harness.reference(5), objects)

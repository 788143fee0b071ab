"""The checkpointing process: flushing, durability, errors coming back to the trainer."""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest
import torch

import lowdiff
from lowdiff.format import layout
from lowdiff_lab import faults

pytestmark = pytest.mark.multiprocess


def _setup(tmp_path, **kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 5)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ck = lowdiff.Checkpointer(model, opt, tmp_path / "ck", compressor=lowdiff.TopK(0.2), **kw)
    return model, opt, ck


def _train(model, opt, ck, n):
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        model(torch.randn(4, 20, generator=g)).pow(2).mean().backward()
        ck.step()
        opt.zero_grad()


def test_partial_batch_is_flushed_and_durable_at_close(tmp_path):
    model, opt, ck = _setup(tmp_path, full_every=100, batch_size=4)
    assert ck.resume() == 0
    _train(model, opt, ck, 7)
    ck.close()
    assert ck.durable_step == 7
    info = lowdiff.inspect_dir(tmp_path / "ck")
    assert [(f.first_step, f.last_step) for f in info.record_files] == [(0, 3), (4, 6)]
    assert info.recoverable == (0, 7)
    ck.close()  # idempotent


def test_flush_makes_records_durable_without_closing(tmp_path):
    model, opt, ck = _setup(tmp_path, full_every=100, batch_size=50)
    ck.resume()
    _train(model, opt, ck, 5)
    assert ck.flush() == 5
    assert lowdiff.inspect_dir(tmp_path / "ck").recoverable == (0, 5)
    _train(model, opt, ck, 2)
    ck.close()
    assert ck.durable_step == 7


def test_storage_error_reaches_the_trainer_with_traceback(tmp_path):
    model, opt, ck = _setup(tmp_path, full_every=100, batch_size=2)
    ck.resume()
    _train(model, opt, ck, 2)
    ck.flush()
    # make the records directory unusable: the next batch write fails in the checkpointing process
    rec = tmp_path / "ck" / layout.RECORDS_DIR
    shutil.rmtree(rec)
    rec.write_text("not a directory")
    with pytest.raises(lowdiff.CheckpointWorkerError) as err:
        _train(model, opt, ck, 6)
        ck.flush()
    assert "checkpointing process traceback" in str(err.value)
    assert "Error" in str(err.value)
    with pytest.raises(lowdiff.CheckpointWorkerError):
        ck.step()
    ck.strategy_impl._release()


def test_dead_checkpointing_process_is_reported(tmp_path):
    model, opt, ck = _setup(tmp_path, full_every=100, batch_size=2)
    ck.resume()
    _train(model, opt, ck, 2)
    ck.flush()  # the process is up and has published its shared memory
    os.kill(ck.strategy_impl.worker_process.pid, signal.SIGKILL)
    ck.strategy_impl.worker_process.join(10)
    with pytest.raises(
        lowdiff.CheckpointWorkerError, match="exited unexpectedly|closed its connection"
    ):
        _train(model, opt, ck, 10)
    prefix = f"lowdiff-{ck.strategy_impl.directory.run_id[:16]}-"
    left = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    assert left, "the killed process published no shared memory"
    ck.strategy_impl._release()
    # what the killed process left in shared memory is removed with the session
    assert [n for n in os.listdir("/dev/shm") if n.startswith(prefix)] == []


def test_context_manager_closes(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with lowdiff.Checkpointer(
        tmp_path / "ck", model, opt, compressor=lowdiff.RandomK(0.5), records_per_file=3
    ) as ck:
        ck.resume()
        _train_small(model, opt, ck)
    assert not ck.strategy_impl.worker_process.is_alive()
    assert lowdiff.inspect_dir(tmp_path / "ck").recoverable == (0, 4)


def _train_small(model, opt, ck):
    for i in range(4):
        model(torch.full((2, 4), float(i))).sum().backward()
        ck.step()
        opt.zero_grad()


def test_retention_keeps_newest_full_checkpoints(tmp_path):
    model, opt, ck = _setup(tmp_path, full_every=3, batch_size=2, keep_full=2)
    ck.resume()
    _train(model, opt, ck, 10)
    ck.close()
    info = lowdiff.inspect_dir(tmp_path / "ck")
    assert [f.first_step for f in info.full_checkpoints] == [6, 9]
    assert all(f.last_step >= 6 for f in info.record_files)
    assert info.recoverable == (6, 10)


def test_full_checkpoint_does_not_wait_for_disk(tmp_path, monkeypatch):
    """step() returns while the full checkpoint is still being written (its fsync stalls
    for 3 s); flush() then waits for the writing process, which is alive and finishes."""

    monkeypatch.setenv(faults.FAULT_ENV, "before_fsync:full:2:slow")
    monkeypatch.setenv(faults.SLOW_ENV, "3")
    model, opt, ck = _setup(tmp_path, full_every=1, batch_size=1, stall_timeout=60)
    ck.resume()
    monkeypatch.delenv(faults.FAULT_ENV)
    _train(model, opt, ck, 1)  # requests the full checkpoint of step 1, the stalled one
    s = ck.stats
    assert s["fulls_requested"] == 2 and s["fulls_written"] <= 1  # still being written
    assert ck.flush() == 1
    assert ck.stats["fulls_written"] == 2
    _train(model, opt, ck, 3)
    ck.close()
    s = ck.stats
    assert s["fulls_requested"] == 5 and s["fulls_written"] == 5


def test_a_stuck_checkpointing_process_fails_after_stall_timeout(tmp_path, monkeypatch):

    monkeypatch.setenv(faults.FAULT_ENV, "before_fsync:full:2:slow")
    monkeypatch.setenv(faults.SLOW_ENV, "8")
    model, opt, ck = _setup(tmp_path, full_every=1, batch_size=1, stall_timeout=1.5)
    ck.resume()
    monkeypatch.delenv(faults.FAULT_ENV)
    _train(model, opt, ck, 1)
    t0 = time.monotonic()
    with pytest.raises(lowdiff.CheckpointWorkerError, match="made no progress for 2 s"):
        ck.flush()
    assert time.monotonic() - t0 < 7  # it gave up before the stalled write finished
    with pytest.raises(lowdiff.CheckpointWorkerError):
        ck.close()


def test_close_on_a_stopped_process_waits_one_stall_timeout(tmp_path):
    """close() on a process that makes no progress (stopped) raises after stall_timeout,
    once: it does not wait for the process's exit a second stall_timeout."""
    import warnings

    model, opt, ck = _setup(tmp_path, full_every=100, batch_size=4, stall_timeout=1.5)
    ck.resume()
    _train(model, opt, ck, 2)
    pid = ck.strategy_impl.worker_process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with pytest.raises(lowdiff.CheckpointWorkerError, match="made no progress"):
                ck.close()
        assert not [w for w in seen if "after it was told to stop" in str(w.message)]
    finally:
        os.kill(pid, signal.SIGKILL)
        os.kill(pid, signal.SIGCONT)
    ck.strategy_impl.worker_process.join(10)
    from lowdiff.proc import holder

    holder.remove_stale_replica(tmp_path / "ck")  # what the killed process left in /dev/shm


def test_checkpointing_process_killed_during_a_full_checkpoint(tmp_path, monkeypatch):
    """The process dies while it writes a full checkpoint and the trainer waits for the
    staging buffer: the trainer raises with the exit code instead of waiting forever."""

    monkeypatch.setenv(faults.FAULT_ENV, "before_fsync:full:2:kill-self")
    model, opt, ck = _setup(tmp_path, full_every=1, batch_size=1, stall_timeout=600)
    ck.resume()
    monkeypatch.delenv(faults.FAULT_ENV)
    with pytest.raises(lowdiff.CheckpointWorkerError, match="exit code -9"):
        _train(model, opt, ck, 3)  # the full of step 2 waits for the staging of step 1
    assert (
        ck.strategy_impl.worker_process is not None
        and ck.strategy_impl.worker_process.exitcode == -signal.SIGKILL
    )
    with pytest.raises(lowdiff.CheckpointWorkerError):
        ck.close()
    assert lowdiff.restore(tmp_path / "ck", *_setup(tmp_path / "r")[:2]) >= 1


@pytest.mark.parametrize("strategy", ["lowdiff", "lowdiff+"])
def test_training_goes_on_while_the_process_starts(tmp_path, monkeypatch, strategy):
    """resume() does not wait for the checkpointing process's start: the first forward
    and backward run while it starts, and the first ck.step() returns once the process
    is up and took the staged state (until then a crash of the trainer would lose it).
    The start is held for a while here; every step is durable and exact once it is up."""
    import multiprocessing.context as mpc
    import threading
    import time

    release = threading.Event()
    started_at: list[float] = []
    original = mpc.ForkServerProcess.start

    def slow_start(self):
        assert release.wait(30)
        started_at.append(time.monotonic())
        original(self)

    monkeypatch.setattr(mpc.ForkServerProcess, "start", slow_start)
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 5)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    kw = {"compressor": lowdiff.TopK(0.2)} if strategy == "lowdiff" else {}
    ck = lowdiff.Checkpointer(
        model, opt, tmp_path / "ck", strategy=strategy, full_every=100, batch_size=2, **kw
    )
    assert ck.resume() == 0
    link = ck.strategy_impl.session.link
    model(torch.randn(8, 20)).pow(2).mean().backward()
    assert link.proc is None and not started_at  # a forward and backward, and no process yet
    assert link._early_bytes > 0  # the staged step-0 state went into the pipe it will read
    threading.Timer(0.3, release.set).start()
    ck.step()
    opt.zero_grad()
    assert started_at and link.proc is not None  # acknowledged once the process was up
    _train(model, opt, ck, 2)
    assert ck.flush() == 3
    assert link.ready
    ck.close()
    assert ck.durable_step == 3
    model2 = torch.nn.Linear(20, 5)
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    lowdiff.restore(tmp_path / "ck", model=model2, optimizer=opt2)
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    for k in s1:
        for name in s1[k]:
            assert torch.equal(torch.as_tensor(s1[k][name]), torch.as_tensor(s2[k][name]))


def test_a_request_with_a_deadline_does_not_wait_longer_for_a_start(monkeypatch):
    """A request with a timeout (the SIGTERM flush) gives up on a process still starting
    at that timeout, not at ``start_timeout``."""
    import multiprocessing.context as mpc
    import threading

    from lowdiff.proc.link import ProcessLink
    from lowdiff.proc.protocol import Flush, Kind

    hold = threading.Event()

    def held_start(self):
        assert hold.wait(30)
        raise RuntimeError("the start was let go")

    monkeypatch.setattr(mpc.ForkServerProcess, "start", held_start)
    link = ProcessLink("the test process", stall_timeout=60.0, start_timeout=60.0)
    link.start(print, (), name="lowdiff-test", wait=False, background=True)
    try:
        with pytest.raises(lowdiff.CheckpointWorkerError, match=r"did not start within 0\.2 s"):
            link.request(Flush(), Kind.FLUSHED, timeout=0.2)
    finally:
        hold.set()
        link.close_pipes()


def test_lowdiff_plus_counts_every_merge_in_its_stats(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 5)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ck = lowdiff.Checkpointer(tmp_path / "ck", model, opt, method="lowdiff+", full_every=100)
    ck.resume()
    _train(model, opt, ck, 6)
    ck.flush()  # every step merged into the replica before it is made durable
    st = ck.stats
    assert st["replica_merges"] == 6 and st["replica_merge_s"] > 0
    _train(model, opt, ck, 3)
    ck.close()
    assert ck.stats["replica_merges"] == 9

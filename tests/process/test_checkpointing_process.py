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
    ck._release()


def test_dead_checkpointing_process_is_reported(tmp_path):
    model, opt, ck = _setup(tmp_path, full_every=100, batch_size=2)
    ck.resume()
    _train(model, opt, ck, 2)
    os.kill(ck._proc.pid, signal.SIGKILL)
    ck._proc.join(10)
    with pytest.raises(
        lowdiff.CheckpointWorkerError, match="exited unexpectedly|closed its connection"
    ):
        _train(model, opt, ck, 10)
    ck._release()


def test_context_manager_closes(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with lowdiff.Checkpointer(
        model, opt, tmp_path / "ck", compressor=lowdiff.RandomK(0.5), batch_size=3
    ) as ck:
        ck.resume()
        _train_small(model, opt, ck)
    assert not ck._proc.is_alive()
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


def test_full_checkpoint_does_not_wait_for_disk(tmp_path):
    """Staging copies the state once; the write happens in the checkpointing process."""
    model, opt, ck = _setup(tmp_path, full_every=1, batch_size=1)
    ck.resume()
    t0 = time.perf_counter()
    _train(model, opt, ck, 5)
    ck.close()
    s = ck.stats
    assert s["fulls_requested"] == 6 and s["fulls_written"] == 6
    assert time.perf_counter() - t0 > 0  # the stats above are what matters; no timing assertion

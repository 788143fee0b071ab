"""ENOSPC and EIO while the checkpointing process writes: the trainer learns of it, no
partial file becomes visible, recovery keeps what was acknowledged."""

from __future__ import annotations

import pytest
import torch

import lowdiff
from lowdiff.format import atomic
from lowdiff_lab import faults
from lowdiff_lab.torture import workload
from lowdiff_lab.torture.report import TortureReport
from lowdiff_lab.torture.storage import N_STEPS, run_scenario

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def ref():
    return workload.reference(N_STEPS)


@pytest.mark.parametrize(
    "point, kind, nth, action, policy",
    [
        ("before_write", "records", 2, "enospc", "raise"),
        ("before_fsync", "full", 2, "eio", "raise"),
        ("before_fsync", "records", 2, "enospc", "warn"),
    ],
)
def test_storage_fault(tmp_path, ref, torture_report, point, kind, nth, action, policy) -> None:
    report = TortureReport()
    run_scenario(tmp_path / "ck", point, kind, nth, action, policy, report, ref)
    torture_report.merge(report)
    assert report.failures == []
    assert report.storage_faults == report.storage_faults_surfaced == 1
    assert report.partial_files_visible == 0


def test_raise_policy_error_names_the_problem_and_the_file(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(faults.FAULT_ENV, "before_write:records:1:enospc")
    ck, model, opt, _ = workload.checkpointer(tmp_path, batch_size=2)
    ck.resume()
    monkeypatch.delenv(faults.FAULT_ENV)
    with pytest.raises(lowdiff.CheckpointWorkerError) as info:
        for step in range(8):
            workload.loss_at(model, step).backward()
            ck.step()
            opt.zero_grad()
        ck.flush()
    text = str(info.value)
    assert "No space left on device" in text
    assert "rec-000000000000-000000000001.safetensors" in text
    assert info.value.storage
    with pytest.raises(lowdiff.CheckpointWorkerError):
        ck.close()
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(atomic.TMP_PREFIX)]


def test_warn_policy_counts_steps_that_are_not_durable(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(faults.FAULT_ENV, "before_write:full:2:eio")
    ck, model, opt, _ = workload.checkpointer(tmp_path, on_storage_error="warn", batch_size=1)
    ck.resume()
    with pytest.warns(lowdiff.DurabilityWarning) as caught:
        for step in range(6):
            workload.loss_at(model, step).backward()
            ck.step()
            opt.zero_grad()
        # the full checkpoint of step 4 failed: checkpointing stops until step 8;
        # records 4 and 5 may have landed before the failure was seen
        assert 4 <= ck.flush() <= 6
    monkeypatch.delenv(faults.FAULT_ENV)
    text = str(caught[0].message)
    assert "Input/output error" in text and "full-000000000004" in text
    assert "step(s) are not durable" in text and "retries with a full checkpoint at step 8" in text
    for step in range(6, 10):
        workload.loss_at(model, step).backward()
        ck.step()
        opt.zero_grad()
    assert ck.flush() == 10
    ck.close()
    assert lowdiff.inspect_dir(tmp_path).recoverable_intervals[-1][1] == 10


def test_storage_error_policy_is_checked() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="on_storage_error.*'ignore'"):
        lowdiff.Checkpointer(
            None,
            model,
            opt,
            method="compression-only",
            on_storage_error="ignore",
            compressor=lowdiff.TopK(ratio=0.01),
        )
    with pytest.raises(ValueError, match="on_storage_error='warn'.*lowdiff\\+"):
        lowdiff.Checkpointer("unused", model, opt, method="lowdiff+", on_storage_error="warn")


@pytest.mark.parametrize(
    "spec, match",
    [
        ("before_fsync:records:1", "point:kind:nth:action"),
        ("during_lunch:records:1:eio", "point must be one of"),
        ("before_fsync:records:0:eio", "nth must be a positive integer"),
        ("before_fsync:records:1:explode", "action one of"),
    ],
)
def test_fault_specs_are_checked(spec, match) -> None:
    with pytest.raises(ValueError, match=match):
        faults.parse_faults(spec)

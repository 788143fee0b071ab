"""Training that continues after ``resume()`` is bit-identical to an uninterrupted run."""

from __future__ import annotations

import gc
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import lowdiff
from lowdiff.state.capture import diff_states as _diff
from lowdiff.state.capture import snapshot_state as _snap
from lowdiff.state.capture import state_tensors

TOTAL = 20
FULL_EVERY = 4
BATCH_SIZE = 3

pytestmark = pytest.mark.multiprocess


def _build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 4)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    return model, opt, sched


def _seed_globals() -> None:
    random.seed(3)
    np.random.seed(3)


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    # data augmentation that draws from the global Python / NumPy RNGs
    scale = 1.0 + 0.05 * random.random() + 0.05 * float(np.random.rand())
    x = torch.randn(6, 8, generator=g) * scale
    y = torch.randn(6, 4, generator=g)
    return ((model(x) - y) ** 2).mean()


def _train(
    ck: lowdiff.Checkpointer,
    model: nn.Module,
    opt: Any,
    sched: Any,
    start: int,
    stop: int,
    snaps: dict[int, Any] | None = None,
) -> list[float]:
    losses = []
    for step in range(start, stop):
        loss = _loss(model, step)
        loss.backward()
        losses.append(loss.item())
        ck.step()
        opt.zero_grad()
        if snaps is not None:
            snaps[step + 1] = _snap(model, opt, sched)
    return losses


def _reference(error_feedback: bool) -> tuple[list[float], dict[int, dict[str, torch.Tensor]]]:
    """The uninterrupted run: strategy "none" (same compression, no checkpointing)."""
    _seed_globals()
    model, opt, sched = _build(0)
    ck = lowdiff.Checkpointer(
        None,
        model,
        opt,
        method="compression-only",
        scheduler=sched,
        compressor=lowdiff.TopK(ratio=0.25, error_feedback=error_feedback),
    )
    assert ck.resume() == 0
    snaps = {0: _snap(model, opt, sched)}
    losses = _train(ck, model, opt, sched, 0, TOTAL, snaps)
    ck.close()
    return losses, snaps


@pytest.fixture(scope="module")
def reference_no_ef() -> tuple[list[float], dict[int, dict[str, torch.Tensor]]]:
    return _reference(error_feedback=False)


def _checkpointer(
    model: nn.Module, opt: Any, sched: Any, directory: Path, error_feedback: bool
) -> lowdiff.Checkpointer:
    return lowdiff.Checkpointer(
        directory,
        model,
        opt,
        scheduler=sched,
        compressor=lowdiff.TopK(ratio=0.25, error_feedback=error_feedback),
        full_every=FULL_EVERY,
        records_per_file=BATCH_SIZE,
        keep_full=None,
    )


def _interrupted_run(directory: Path, k: int, error_feedback: bool, *, close: bool) -> list[float]:
    _seed_globals()
    model, opt, sched = _build(0)
    ck = _checkpointer(model, opt, sched, directory, error_feedback)
    assert ck.resume() == 0
    losses = _train(ck, model, opt, sched, 0, k)
    if close:
        ck.close()
        assert ck.durable_step == k
    else:
        proc = ck.strategy_impl.worker_process
        del ck
        gc.collect()
        # the checkpointing process notices the trainer is gone, writes what it got, exits
        proc.join(60)
        assert proc.exitcode == 0
    return losses


@pytest.mark.parametrize("k", [8, 10], ids=["at-full", "mid-batch"])
def test_resume_continues_bit_identically(tmp_path: Path, reference_no_ef: Any, k: int) -> None:
    ref_losses, ref = reference_no_ef
    # the reference trajectory actually moves
    assert _diff(ref[0], ref[TOTAL])

    losses = _interrupted_run(tmp_path, k, error_feedback=False, close=True)
    assert losses == ref_losses[:k]

    # a new process' worth of objects, deliberately initialised differently
    random.seed(999)
    np.random.seed(999)
    model, opt, sched = _build(seed=1234)
    assert _diff(ref[k], state_tensors(model, opt, sched))
    ck = _checkpointer(model, opt, sched, tmp_path, error_feedback=False)
    try:
        start = ck.resume()
        assert start == k
        assert ck.step_count == k
        assert not _diff(ref[k], state_tensors(model, opt, sched))
        losses = _train(ck, model, opt, sched, start, TOTAL)
    finally:
        ck.close()
    assert losses == ref_losses[k:]
    assert not _diff(ref[TOTAL], state_tensors(model, opt, sched))

    # the records written across the interruption replay exactly too
    assert lowdiff.inspect_dir(tmp_path).recoverable == (0, TOTAL)
    for s in range(k - 2, TOTAL + 1):
        m2, o2, s2 = _build(seed=77)
        assert lowdiff.restore(tmp_path, m2, o2, s2, step=s) == s
        assert not _diff(ref[s], state_tensors(m2, o2, s2)), f"step {s}"


def test_resume_with_error_feedback_recovers_exact_state(tmp_path: Path) -> None:
    _, ref = _reference(error_feedback=True)
    k = 7
    _interrupted_run(tmp_path, k, error_feedback=True, close=True)

    model, opt, sched = _build(seed=4321)
    ck = _checkpointer(model, opt, sched, tmp_path, error_feedback=True)
    try:
        assert ck.resume() == k
        assert not _diff(ref[k], state_tensors(model, opt, sched))
        # the residuals restart at zero: training goes on and is checkpointed
        _train(ck, model, opt, sched, k, k + 3)
        assert ck.flush() == k + 3
    finally:
        ck.close()
    assert lowdiff.inspect_dir(tmp_path).recoverable == (0, k + 3)


def test_resume_after_checkpointer_dropped_without_close(
    tmp_path: Path, reference_no_ef: Any
) -> None:
    ref_losses, ref = reference_no_ef
    k = 10
    _interrupted_run(tmp_path, k, error_feedback=False, close=False)
    # everything sent before the drop is durable
    assert lowdiff.inspect_dir(tmp_path).recoverable == (0, k)

    model, opt, sched = _build(seed=1234)
    ck = _checkpointer(model, opt, sched, tmp_path, error_feedback=False)
    try:
        assert ck.resume() == k
        assert not _diff(ref[k], state_tensors(model, opt, sched))
        losses = _train(ck, model, opt, sched, k, TOTAL)
    finally:
        ck.close()
    assert losses == ref_losses[k:]
    assert not _diff(ref[TOTAL], state_tensors(model, opt, sched))


def test_resume_on_empty_directory_returns_zero(tmp_path: Path) -> None:
    target = tmp_path / "not-yet-created"
    model, opt, sched = _build(0)
    before = _snap(model, opt, sched)
    ck = _checkpointer(model, opt, sched, target, error_feedback=True)
    try:
        assert ck.resume() == 0
        assert ck.step_count == 0
        # nothing was restored into the live objects
        assert not _diff(before, state_tensors(model, opt, sched))
    finally:
        ck.close()
    info = lowdiff.inspect_dir(target)
    assert info.recoverable == (0, 0)
    assert [f.first_step for f in info.full_checkpoints] == [0]
    assert info.record_files == []


def test_step_without_resume_and_resume_twice(tmp_path: Path) -> None:
    # an empty directory: step() without resume() starts a fresh run implicitly
    model, opt, sched = _build(0)
    ck = _checkpointer(model, opt, sched, tmp_path, error_feedback=False)
    try:
        _train(ck, model, opt, sched, 0, 2)
    finally:
        ck.close()
    with pytest.raises(RuntimeError, match="close"):
        ck.step()
    assert lowdiff.inspect_dir(tmp_path).recoverable == (0, 2)

    # a directory that holds checkpoints: step() without resume() refuses
    model, opt, sched = _build(1)
    ck = _checkpointer(model, opt, sched, tmp_path, error_feedback=False)
    try:
        _loss(model, 0).backward()
        before = _snap(model, opt, sched)
        with pytest.raises(lowdiff.LowDiffError, match="resume"):
            ck.step()
        # the refused step did not touch the parameters or the optimizer
        after = _snap(model, opt, sched)
        assert not _diff(before, after)
    finally:
        ck.close()
    assert lowdiff.inspect_dir(tmp_path).recoverable == (0, 2)

    # resume() twice
    model, opt, sched = _build(2)
    ck = _checkpointer(model, opt, sched, tmp_path, error_feedback=False)
    try:
        assert ck.resume() == 2
        with pytest.raises(RuntimeError, match="once"):
            ck.resume()
        assert ck.step_count == 2
    finally:
        ck.close()


def _build_conv(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(36, 2))
    model = model.to(memory_format=torch.channels_last)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2, fused=True), None


def _conv_loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4, 2, 5, 5, generator=g).contiguous(memory_format=torch.channels_last)
    return (model(x) ** 2).mean()


def test_resume_channels_last_fused_adam_from_full_checkpoint(tmp_path: Path) -> None:
    total, k = 6, FULL_EVERY  # resume exactly at a full checkpoint: no record is replayed
    comp = lowdiff.TopK(ratio=1.0, error_feedback=False)

    model, opt, _ = _build_conv(0)
    ck = lowdiff.Checkpointer(None, model, opt, method="compression-only", compressor=comp)
    ck.resume()
    for step in range(total):
        _conv_loss(model, step).backward()
        ck.step()
        opt.zero_grad()
    ck.close()
    want = _snap(model, opt, None)

    model, opt, _ = _build_conv(0)
    ck = lowdiff.Checkpointer(
        tmp_path, model, opt, compressor=comp, full_every=FULL_EVERY, records_per_file=BATCH_SIZE
    )
    ck.resume()
    for step in range(k):
        _conv_loss(model, step).backward()
        ck.step()
        opt.zero_grad()
    ck.close()

    model, opt, _ = _build_conv(1)
    ck = lowdiff.Checkpointer(
        tmp_path, model, opt, compressor=comp, full_every=FULL_EVERY, records_per_file=BATCH_SIZE
    )
    try:
        assert ck.resume() == k
        for step in range(k, total):
            _conv_loss(model, step).backward()
            ck.step()
            opt.zero_grad()
    finally:
        ck.close()
    assert not _diff(want, state_tensors(model, opt, None))

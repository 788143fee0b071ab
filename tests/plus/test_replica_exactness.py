"""LowDiff+: the CPU replica applies bit-for-bit the trainer's updates.

Each case trains in process under ``strategy="lowdiff+"`` with ``persist_every=1`` and
``keep_full=None``, snapshots the whole training state after every step, closes, then
restores every persisted step from disk into fresh objects and compares every tensor
with ``torch.equal``: every full checkpoint the replica wrote must equal the trainer's
state at that step.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import lowdiff
from lowdiff.state.capture import diff_states as _diff
from lowdiff.state.capture import snapshot_state as _snap

N_STEPS = 8

# ----------------------------------------------------------------------------- models


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, 16),
            nn.BatchNorm1d(16),
            nn.ReLU(),
            nn.Dropout(0.25),
            nn.Linear(16, 4),
        )

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        return self.net(x)


class ConvNet(nn.Module):
    """A conv net in channels_last memory format (4-D parameters with permuted strides)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        x = x.view(6, 2, 4, 1).expand(6, 2, 4, 4).contiguous(memory_format=torch.channels_last)
        return self.fc(torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))


def _channels_last_convnet() -> nn.Module:
    return ConvNet().to(memory_format=torch.channels_last)


class SmallBranchNet(nn.Module):
    """``branch`` (small, next to the body's parameters) has a gradient on some steps."""

    def __init__(self) -> None:
        super().__init__()
        self.body = MLP()
        self.branch = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        y = self.body(x, step)
        if step % 3 == 2:
            y = y + self.branch(y)
        return y


class BigBranchNet(nn.Module):
    """``big`` has a gradient on some steps only; it is larger than the snapshotter's
    default 1 MiB block, so it is snapshotted alone (chunked)."""

    BIG = (1 << 18) + 16  # float32 elements: just over 1 MiB

    def __init__(self) -> None:
        super().__init__()
        self.body = MLP()
        self.big = nn.Parameter(torch.randn(self.BIG) * 0.01)
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        y = self.body(x, step)
        if step % 3 == 2:
            y = y + self.big[:4] * self.big[4:8].sum()
        return self.head(y)


# ----------------------------------------------------------------------------- cases


@dataclass
class Case:
    id: str
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    model: Callable[[], nn.Module] = MLP
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    clip_on: Callable[[int], bool] = lambda step: False


def _steplr(o: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5)


CASES = [
    Case(
        "adamw-default-steplr-clip",
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
        scheduler=_steplr,
        clip_on=lambda s: s % 2 == 1,
    ),
    Case(
        "adam-foreach-nograd-big-branch-clip",
        lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, foreach=True),
        model=BigBranchNet,
        clip_on=lambda s: s % 4 == 1,
    ),
    Case(
        "adam-fused-steplr-channels-last",
        lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, fused=True),
        model=_channels_last_convnet,
        scheduler=_steplr,
    ),
    Case(
        "sgd-nesterov-clip",
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True),
        clip_on=lambda s: s in (2, 3, 6),
    ),
]

XFAIL_CASES = [
    Case(
        "adam-nograd-small-branch",
        lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
        model=SmallBranchNet,
    ),
]


def _build(case: Case) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = case.model()
    opt = case.optimizer(model)
    sched = case.scheduler(opt) if case.scheduler is not None else None
    return model, opt, sched


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    # the data pipeline draws from Python's and NumPy's global RNGs too
    noise = 1.0 + 0.01 * random.random() + 0.01 * float(np.random.rand())
    x = torch.randn(6, 8, generator=g) * noise
    y = torch.randn(6, 4, generator=g)
    return ((model(x, step) - y) ** 2).mean()


def _train_step(case: Case, ck: lowdiff.Checkpointer, model, opt, step: int) -> None:
    _loss(model, step).backward()
    if case.clip_on(step):
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
    ck.step()
    opt.zero_grad()


def _persisted_steps(directory: Path) -> list[int]:
    info = lowdiff.inspect_dir(directory)
    return sorted(f.first_step for f in info.full_checkpoints)


def _check_every_step(directory: Path, case: Case, snaps: dict[int, dict[str, torch.Tensor]]):
    for step in sorted(snaps):
        model, opt, sched = _build(case)
        assert lowdiff.restore(directory, model, opt, sched, step=step) == step
        bad = _diff(snaps[step], _snap(model, opt, sched))
        assert not bad, f"{case.id}: step {step} differs from the trainer in {bad[:8]}"


def _run_case(tmp_path: Path, case: Case, copy_mode: str | None = None) -> None:
    random.seed(11)
    np.random.seed(11)
    model, opt, sched = _build(case)
    d = tmp_path / "ck"
    ck = lowdiff.Checkpointer(
        d,
        model,
        opt,
        method="lowdiff+",
        scheduler=sched,
        keep_full=None,
        replica=lowdiff.ReplicaOptions(persist_every=1),
    )
    snaps: dict[int, dict[str, torch.Tensor]] = {}
    try:
        assert ck.resume() == 0
        if copy_mode is not None:
            assert ck.strategy_impl.snapshotter.copy_mode == copy_mode
        snaps[0] = _snap(model, opt, sched)
        for step in range(N_STEPS):
            _train_step(case, ck, model, opt, step)
            snaps[step + 1] = _snap(model, opt, sched)
    finally:
        ck.close()
    assert ck.durable_step == N_STEPS
    assert ck.stats["steps"] == N_STEPS
    assert _persisted_steps(d) == list(range(N_STEPS + 1))
    _check_every_step(d, case, snaps)


@pytest.mark.multiprocess
@pytest.mark.parametrize("copy_mode", ["inline", "thread"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_persisted_step_equals_the_trainer(tmp_path, monkeypatch, case, copy_mode):
    """Under both places the CPU snapshot copies can run (``copy_mode="auto"`` picks one
    by the machine's cores)."""
    import lowdiff.engine.trainer.snapshot as snapshot

    real = snapshot.cpu_copy_mode
    monkeypatch.setattr(snapshot, "cpu_copy_mode", lambda _mode="auto": real(copy_mode))
    _run_case(tmp_path, case, copy_mode)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", XFAIL_CASES, ids=[c.id for c in XFAIL_CASES])
def test_nograd_parameter_in_shared_block(tmp_path, case):
    _run_case(tmp_path, case)


@pytest.mark.multiprocess
def test_persist_auto_max_lag_1_and_flush(tmp_path):
    case = CASES[0]
    random.seed(11)
    np.random.seed(11)
    model, opt, sched = _build(case)
    d = tmp_path / "ck"
    ck = lowdiff.Checkpointer(
        d,
        model,
        opt,
        method="lowdiff+",
        scheduler=sched,
        keep_full=None,
        replica=lowdiff.ReplicaOptions(persist_every="auto", max_lag=1),
    )
    snaps: dict[int, dict[str, torch.Tensor]] = {}
    try:
        assert ck.resume() == 0
        for step in range(6):
            _train_step(case, ck, model, opt, step)
            if step == 2:
                snaps[3] = _snap(model, opt, sched)
                assert ck.flush() == 3  # persists the replica's current step
        snaps[6] = _snap(model, opt, sched)
        stats = ck.stats
    finally:
        ck.close()
    assert ck.durable_step == 6
    assert isinstance(stats["lag_wait_s"], float) and stats["lag_wait_s"] >= 0
    assert "snapshot_finish_s" in stats
    steps = _persisted_steps(d)
    assert 0 in steps and 3 in steps and 6 in steps  # init, flush, close
    _check_every_step(d, case, snaps)


@pytest.mark.multiprocess
def test_persist_auto_follows_the_mtbf(tmp_path):
    """``persist_every="auto"`` persists at the Young–Daly interval of the MTBF: failures a
    microsecond apart persist the replica as often as the disk keeps up, failures 30
    years apart only at the start and the end; every persisted step restores exactly.

    The policy never writes more than half of the time, so a persist is due again only
    twice its own duration after it started: the steps of the 1 µs run last 50 ms each,
    longer than a persist of this model takes even on a loaded machine, so that the
    disk keeps up within the run (eight steps of a few milliseconds could all fall
    inside the first persist's wait)."""
    case = CASES[0]
    persisted = {}
    for mtbf in (1e-6, 1e9):
        random.seed(11)
        np.random.seed(11)
        model, opt, sched = _build(case)
        d = tmp_path / f"ck-{mtbf:g}"
        ck = lowdiff.Checkpointer(d, model, opt, method="lowdiff+", scheduler=sched, mtbf=mtbf, keep_full=None, replica=lowdiff.ReplicaOptions(persist_every="auto"))  # fmt: skip
        snaps: dict[int, dict[str, torch.Tensor]] = {}
        try:
            assert ck.resume() == 0
            for step in range(N_STEPS):
                _train_step(case, ck, model, opt, step)
                snaps[step + 1] = _snap(model, opt, sched)
                ck.flush() if step == N_STEPS - 1 else None
                if mtbf < 1:
                    time.sleep(0.05)
        finally:
            ck.close()
        persisted[mtbf] = _persisted_steps(d)
        _check_every_step(d, case, {s: snaps[s] for s in persisted[mtbf] if s in snaps})
    assert persisted[1e9] == [0, N_STEPS]  # the start, the flush (close adds no step)
    assert len(persisted[1e-6]) > len(persisted[1e9])


# ----------------------------------------------------------------------------- arguments


class HomeMadeSGD(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-g["lr"])


class AdamWSubclass(torch.optim.AdamW):
    pass


def _model_opt() -> tuple[nn.Module, torch.optim.Optimizer]:
    m = nn.Linear(3, 2)
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


def test_compressor_is_rejected(tmp_path):
    m, o = _model_opt()
    with pytest.raises(ValueError, match="compressor"):
        lowdiff.Checkpointer(
            tmp_path / "ck", m, o, method="lowdiff+", compressor=lowdiff.TopK(ratio=0.1)
        )
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("cls", [HomeMadeSGD, AdamWSubclass])
def test_optimizer_outside_torch_optim_is_rejected(tmp_path, cls):
    m = nn.Linear(3, 2)
    o = cls(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="torch.optim"):
        lowdiff.Checkpointer(tmp_path / "ck", m, o, method="lowdiff+")
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize(
    ("kw", "exc"),
    [
        ({"persist_every": 0}, ValueError),
        ({"persist_every": -3}, ValueError),
        ({"persist_every": "sometimes"}, TypeError),
        ({"persist_every": 1.5}, TypeError),
        ({"max_lag": 0}, ValueError),
        ({"max_lag": True}, TypeError),
        ({"idle_timeout": -1.0}, ValueError),
        ({"replica_threads": 0}, ValueError),
    ],
)
def test_bad_settings_raise(tmp_path, kw, exc):
    m, o = _model_opt()
    with pytest.raises(exc):
        lowdiff.Checkpointer(m, o, tmp_path / "ck", strategy="lowdiff+", **kw)
    assert not (tmp_path / "ck").exists()

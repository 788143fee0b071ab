"""Replay exactness: every step of a run restores bit for bit.

Each case trains a small model for ``N_STEPS`` steps under a Checkpointer, snapshots the
whole training state (``state_tensors``) after every step, then restores every step
0..N into freshly built objects and compares every entry with ``torch.equal``.
"""

from __future__ import annotations

import random
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
from lowdiff.state.capture import state_tensors

N_STEPS = 12
FULL_EVERY = 4
BATCH_SIZE = 3

pytestmark = pytest.mark.multiprocess


# ----------------------------------------------------------------------------- models


class MLP(nn.Module):
    def __init__(self, n_in: int = 8, hidden: int = 16, n_out: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(n_in, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Dropout(0.25),
            nn.Linear(hidden, n_out),
        )

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        return self.net(x)


class BranchNet(nn.Module):
    """``branch`` only gets a gradient when ``step % 3 == 2``; ``frozen`` never does."""

    def __init__(self) -> None:
        super().__init__()
        self.body = MLP(8, 16, 4)
        self.branch = nn.Linear(4, 4)
        self.frozen = nn.Parameter(torch.randn(4), requires_grad=False)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        y = self.body(x, step) + self.frozen
        if step % 3 == 2:
            y = y + self.branch(y)
        return y


class TiedLM(nn.Module):
    """An embedding whose weight is shared with the output layer."""

    VOCAB = 12

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(self.VOCAB, 8)
        self.mid = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(8, self.VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        return self.head(self.drop(torch.tanh(self.mid(self.emb(tokens)))))


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


def _channels_last(m: nn.Module) -> nn.Module:
    return m.to(memory_format=torch.channels_last)


class EmaNet(nn.Module):
    """Keeps an exponential moving average of a weight in a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.body = MLP(8, 16, 4)
        self.ema = nn.Parameter(self.body.net[0].weight.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        with torch.no_grad():
            self.ema.mul_(0.9).add_(self.body.net[0].weight, alpha=0.1)
        return self.body(x, step)


def _noise() -> float:
    # A data pipeline that draws from Python's and NumPy's global RNGs: their states
    # are part of the checkpointed state.
    return 1.0 + 0.01 * random.random() + 0.01 * float(np.random.rand())


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    if isinstance(model, TiedLM):
        tokens = torch.randint(0, TiedLM.VOCAB, (6,), generator=g)
        targets = torch.randint(0, TiedLM.VOCAB, (6,), generator=g)
        return nn.functional.cross_entropy(model(tokens, step), targets)
    if isinstance(model, ConvNet):
        x = torch.randn(6, 8, generator=g) * _noise()
        return ((model(x, step) - torch.randn(6, 4, generator=g)) ** 2).mean()
    n_in = model.net[0].in_features if isinstance(model, MLP) else 8
    n_out = model.net[-1].out_features if isinstance(model, MLP) else 4
    x = torch.randn(6, n_in, generator=g) * _noise()
    y = torch.randn(6, n_out, generator=g)
    return ((model(x, step) - y) ** 2).mean()


# ----------------------------------------------------------------------------- cases


@dataclass
class Case:
    id: str
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    compressor: Callable[[], lowdiff.Compressor] = lambda: lowdiff.TopK(ratio=0.25)
    model: Callable[[], nn.Module] = MLP
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    manual_lr: bool = False
    clip: bool = False
    xfail: str = ""


def _params(m: nn.Module) -> list[nn.Parameter]:
    return [p for p in m.parameters() if p.requires_grad]


def _two_groups(m: nn.Module) -> torch.optim.Optimizer:
    first = list(m.net[0].parameters()) + list(m.net[1].parameters())
    rest = list(m.net[4].parameters())
    return torch.optim.Adam(
        [
            {"params": first, "lr": 1e-2, "weight_decay": 0.0},
            {"params": rest, "lr": 3e-3, "weight_decay": 0.1},
        ]
    )


def _seq_lr(o: torch.optim.Optimizer) -> Any:
    warm = torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=3)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=6)
    return torch.optim.lr_scheduler.SequentialLR(o, [warm, cos], milestones=[3])


CASES = [
    Case("adam-foreach", lambda m: torch.optim.Adam(_params(m), lr=1e-2, foreach=True)),
    Case("adam-fused", lambda m: torch.optim.Adam(_params(m), lr=1e-2, fused=True)),
    Case(
        "adam-amsgrad", lambda m: torch.optim.Adam(_params(m), lr=1e-2, amsgrad=True, foreach=True)
    ),
    Case("adamw-fused", lambda m: torch.optim.AdamW(_params(m), lr=1e-2, fused=True)),
    Case(
        "sgd-momentum", lambda m: torch.optim.SGD(_params(m), lr=0.05, momentum=0.9, foreach=False)
    ),
    Case(
        "sgd-nesterov-foreach",
        lambda m: torch.optim.SGD(_params(m), lr=0.05, momentum=0.9, nesterov=True, foreach=True),
    ),
    Case(
        "sgd-momentum-fused",
        lambda m: torch.optim.SGD(_params(m), lr=0.05, momentum=0.9, fused=True),
    ),
    Case("adagrad", lambda m: torch.optim.Adagrad(_params(m), lr=0.05)),
    Case("adagrad-fused", lambda m: torch.optim.Adagrad(_params(m), lr=0.05, fused=True)),
    Case(
        "rmsprop-centered-foreach",
        lambda m: torch.optim.RMSprop(
            _params(m), lr=1e-2, momentum=0.9, centered=True, foreach=True
        ),
    ),
    Case(
        "two-groups-steplr",
        _two_groups,
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
    ),
    # AdamW with the default (single-tensor on CPU) implementation
    Case("adamw-sequentiallr", lambda m: torch.optim.AdamW(_params(m), lr=1e-2), scheduler=_seq_lr),
    Case(
        "manual-lr-clip",
        lambda m: torch.optim.SGD(_params(m), lr=0.05, momentum=0.9, weight_decay=1e-3),
        manual_lr=True,
        clip=True,
    ),
    # Adam with the default (single-tensor on CPU) implementation here and below
    Case("nograd-branch-frozen", lambda m: torch.optim.Adam(_params(m), lr=1e-2), model=BranchNet),
    Case("tied-weights", lambda m: torch.optim.AdamW(_params(m), lr=1e-2), model=TiedLM),
    Case(
        "topk-no-ef",
        lambda m: torch.optim.SGD(_params(m), lr=0.05, momentum=0.9, nesterov=True),
        compressor=lambda: lowdiff.TopK(ratio=0.25, error_feedback=False),
    ),
    Case(
        # 17 * 2048 = 34816 >= 32768 elements: ApproxTopK takes its sampled-threshold path.
        "approx-topk-wide",
        lambda m: torch.optim.Adam(_params(m), lr=1e-3),
        compressor=lambda: lowdiff.ApproxTopK(ratio=0.01, seed=3),
        model=lambda: MLP(17, 2048, 4),
    ),
    Case(
        "randomk",
        lambda m: torch.optim.Adam(_params(m), lr=1e-2),
        compressor=lambda: lowdiff.RandomK(ratio=0.3, seed=5),
    ),
    Case(
        "qsgd",
        lambda m: torch.optim.Adam(_params(m), lr=1e-2),
        compressor=lambda: lowdiff.QSGD(bucket_size=24, seed=7),
    ),
    Case(
        "channels-last-foreach",
        lambda m: torch.optim.Adam(_params(m), lr=1e-2, foreach=True),
        model=lambda: _channels_last(ConvNet()),
    ),
    Case(
        "channels-last-fused",
        lambda m: torch.optim.Adam(_params(m), lr=1e-2, fused=True),
        model=lambda: _channels_last(ConvNet()),
    ),
    Case(
        "ema-in-frozen-parameter",
        lambda m: torch.optim.Adam(_params(m), lr=1e-2),
        model=EmaNet,
        # A documented limitation: records carry optimized parameters and buffers only, so a
        # parameter outside the optimizer that changes between steps (an EMA) is restored
        # from the full checkpoint, stale. Keep such state in buffers.
        xfail="parameters outside the optimizer are assumed constant between full checkpoints",
    ),
]


def _build(case: Case, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = case.model()
    opt = case.optimizer(model)
    sched = case.scheduler(opt) if case.scheduler is not None else None
    return model, opt, sched


def _train(directory: Path, case: Case) -> list[dict[str, torch.Tensor]]:
    random.seed(11)
    np.random.seed(11)
    model, opt, sched = _build(case, seed=0)
    ck = lowdiff.Checkpointer(
        directory,
        model,
        opt,
        compressor=case.compressor(),
        full_every=FULL_EVERY,
        records_per_file=BATCH_SIZE,
        scheduler=sched,
        keep_full=None,
    )
    try:
        assert ck.resume() == 0
        snaps = [_snap(model, opt, sched)]
        for step in range(N_STEPS):
            if case.manual_lr:
                for i, g in enumerate(opt.param_groups):
                    g["lr"] = 0.02 * (1 + (step + i) % 3)
            _loss(model, step).backward()
            if case.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
            ck.step()
            opt.zero_grad()
            snaps.append(_snap(model, opt, sched))
    finally:
        ck.close()
    assert ck.durable_step == N_STEPS
    return snaps


def _optimizer_supported(case: Case) -> None:
    """Skip optimizer variants this torch build cannot run on CPU."""
    model, opt, _ = _build(case, seed=0)
    try:
        _loss(model, 0).backward()
        opt.step()
    except (RuntimeError, TypeError, ValueError) as e:
        pytest.skip(f"{case.id} is not supported by torch {torch.__version__} on CPU: {e}")


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            c,
            marks=[pytest.mark.xfail(strict=True, raises=AssertionError, reason=c.xfail)]
            if c.xfail
            else [],
        )
        for c in CASES
    ],
    ids=[c.id for c in CASES],
)
def test_every_step_restores_exactly(tmp_path: Path, case: Case) -> None:
    _optimizer_supported(case)
    snaps = _train(tmp_path, case)

    # the run did change the state, so equality below is not vacuous
    assert _diff(snaps[0], snaps[-1])
    params_changed = [k for k in _diff(snaps[0], snaps[-1]) if k.startswith("model/")]
    assert params_changed

    info = lowdiff.inspect_dir(tmp_path)
    assert info.recoverable == (0, N_STEPS)
    assert [f.first_step for f in info.full_checkpoints] == list(range(0, N_STEPS + 1, FULL_EVERY))

    for s in range(N_STEPS + 1):
        model, opt, sched = _build(case, seed=100 + s)
        got = lowdiff.restore(tmp_path, model, opt, sched, step=s)
        assert got == s
        bad = _diff(snaps[s], state_tensors(model, opt, sched))
        assert not bad, f"{case.id}: step {s} differs after restore: {bad[:8]}"
        if isinstance(model, TiedLM):
            assert model.head.weight is model.emb.weight

    # step=None picks the newest step
    model, opt, sched = _build(case, seed=999)
    assert lowdiff.restore(tmp_path, model, opt, sched) == N_STEPS
    assert not _diff(snaps[N_STEPS], state_tensors(model, opt, sched))

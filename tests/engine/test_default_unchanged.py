"""The default Checkpointer never changes training: without a compressor, the optimizer
applies exactly the gradients it would apply without lowdiff.

Each run trains the same model from the same seed with clipping (asserted to fire),
dropout (random numbers drawn every step) and an LR schedule, once with no lowdiff and
once through lowdiff's default; every parameter and every optimizer state tensor must be
bit-identical after N steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import lowdiff

STEPS = 12
MAX_NORM = 0.05


def _setup() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 4)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    return model, opt, sched


def _backward(model: torch.nn.Module, step: int, norms: list[float]) -> None:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    torch.nn.functional.mse_loss(model(x), y).backward()
    norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))


def _plain() -> tuple[torch.nn.Module, torch.optim.Optimizer, list[float]]:
    model, opt, sched = _setup()
    norms: list[float] = []
    for step in range(STEPS):
        _backward(model, step, norms)
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, norms


def _assert_same(a: tuple, b: tuple) -> None:
    (ma, oa, na), (mb, ob, nb) = a, b
    assert max(na) > MAX_NORM, "clipping never fired"
    assert na == nb
    for (name, p), q in zip(ma.named_parameters(), mb.parameters(), strict=True):
        assert torch.equal(p, q), name
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for k, st in sa["state"].items():
        for key, t in st.items():
            assert torch.equal(torch.as_tensor(t), torch.as_tensor(sb["state"][k][key])), (k, key)


@pytest.mark.multiprocess
def test_checkpointer_default_keeps_training_bit_identical(tmp_path: Path) -> None:
    model, opt, sched = _setup()
    ck = lowdiff.Checkpointer(tmp_path / "ck", model, opt, scheduler=sched)
    assert ck.method == "lowdiff+"
    norms: list[float] = []
    assert ck.resume() == 0
    for step in range(STEPS):
        _backward(model, step, norms)
        ck.step()
        opt.zero_grad()
    assert ck.flush() == STEPS
    ck.close()
    _assert_same(_plain(), (model, opt, norms))


@pytest.mark.multiprocess
def test_attach_default_keeps_training_bit_identical(tmp_path: Path) -> None:
    model, opt, sched = _setup()
    ck = lowdiff.attach(tmp_path / "ck", model, opt, scheduler=sched)
    assert ck.method == "lowdiff+"
    norms: list[float] = []
    ck.resume()
    for step in range(STEPS):
        _backward(model, step, norms)
        opt.step()
        sched.step()
        opt.zero_grad()
    ck.close()
    assert ck.durable_step == STEPS
    _assert_same(_plain(), (model, opt, norms))


def test_a_compressor_is_asked_for_not_assumed(tmp_path: Path) -> None:
    """LowDiff changes what the optimizer applies: it runs only when a compressor is given."""
    model, opt, _ = _setup()
    with pytest.raises(lowdiff.InvalidArgumentError, match="needs compressor="):
        lowdiff.Checkpointer(tmp_path / "a", model, opt, method="lowdiff")
    ck = lowdiff.Checkpointer(tmp_path / "b", model, opt, compressor=lowdiff.TopK(ratio=0.5))
    assert ck.method == "lowdiff"
    ck.close()

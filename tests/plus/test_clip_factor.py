"""LowDiff+ with gradient clipping: one host copy of each gradient per step.

- :mod:`lowdiff.state.clipping` gives the norm, the factor and the bits of
  ``torch.nn.utils.clip_grad_norm_``.
- ``ck.clip_grad_norm_`` keeps the copies made during backward and carries the factor to
  the replica: every gradient is copied once per step (``ck.stats["gradient_copies"]``),
  the clip fires on every step (the returned norm is above ``max_norm``), and every
  persisted step equals a run without lowdiff that clips with torch, bit for bit.
- ``torch.nn.utils.clip_grad_norm_`` made by the loop stays exact: the first step copies
  the gradients again, every later step copies them once, after the clip.
- A change after ``ck.clip_grad_norm_`` (one gradient scaled by hand) is detected: that
  gradient alone is copied again and left out of the factor, and the step stays exact.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import lowdiff
from lowdiff.state import clipping
from lowdiff.state.capture import diff_states, snapshot_state

STEPS = 6
MAX_NORM = 0.05
"""Below every step's gradient norm here: the clip fires on every step."""


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.Linear(64, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _backward(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 16, generator=g)
    nn.functional.mse_loss(model(x), torch.randn(32, 4, generator=g) * 3).backward()


def _reference(steps: int) -> dict[int, dict[str, torch.Tensor]]:
    """Every step's state of the same training without lowdiff, clipped by torch."""
    model, opt = _model()
    out = {0: snapshot_state(model, opt)}
    for t in range(steps):
        _backward(model, t)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        assert float(norm) > MAX_NORM
        opt.step()
        opt.zero_grad()
        out[t + 1] = snapshot_state(model, opt)
    return out


def _check_persisted(d: Path, ref: dict[int, dict[str, torch.Tensor]]) -> list[int]:
    steps = sorted(int(p.name.split("-")[1].split(".")[0]) for p in (d / "full").glob("full-*"))
    assert steps and steps[-1] == STEPS
    for s in steps:
        model, opt = _model()
        assert lowdiff.restore(d, model, opt, step=s) == s
        assert diff_states(snapshot_state(model, opt), ref[s]) == [], f"step {s}"
    return steps


def _n_grads(opt: torch.optim.Optimizer) -> int:
    return sum(len(g["params"]) for g in opt.param_groups)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("foreach", [None, False])
@pytest.mark.parametrize("max_norm", [0.01, 1e6])
def test_norm_and_factor_give_torch_bits(norm_type, foreach, max_norm):
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(s, generator=g) for s in [(7, 5), (5,), (300,), (1,)]]
    ref = [x.clone() for x in grads]
    params = [nn.Parameter(torch.zeros_like(x)) for x in ref]
    for p, x in zip(params, ref, strict=True):
        p.grad = x
    want = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, foreach=foreach)
    norm, factor = clipping.norm_and_factor(grads, max_norm, norm_type, foreach=foreach)
    clipping.scale_(grads, factor)
    assert torch.equal(norm, want)
    assert (float(factor) < 1.0) == (max_norm < 1.0)  # fires with the small max_norm only
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, params, strict=True))


def _use_copy_mode(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    import lowdiff.engine.trainer.snapshot as snapshot

    real = snapshot.cpu_copy_mode
    monkeypatch.setattr(snapshot, "cpu_copy_mode", lambda _mode="auto": real(mode))


@pytest.fixture(params=["inline", "thread"])
def copy_mode(request, monkeypatch):
    """Both places the CPU snapshot copies can run (``"auto"`` picks one by the cores)."""
    _use_copy_mode(monkeypatch, request.param)
    return request.param


def _train_clipped(d: Path, clip: str) -> tuple[dict[str, float], nn.Module, torch.optim.Optimizer]:
    """LowDiff+ over ``STEPS`` steps, each clipped (``clip``: ``"lowdiff"`` through
    ``ck.clip_grad_norm_``, ``"torch"`` through torch's), the clip firing every time;
    the session's statistics."""
    model, opt = _model()
    with lowdiff.Checkpointer(
        d, model, opt, method="lowdiff+", keep_full=None,
        replica=lowdiff.ReplicaOptions(persist_every=1),
    ) as ck:  # fmt: skip
        assert ck.resume() == 0
        for t in range(STEPS):
            _backward(model, t)
            if clip == "lowdiff":
                norm = ck.clip_grad_norm_(MAX_NORM)
            else:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            assert float(norm) > MAX_NORM  # the clip fired
            ck.step()
            opt.zero_grad()
        stats = ck.stats
    return stats, model, opt


def test_clip_through_lowdiff_copies_each_gradient_once(tmp_path, copy_mode):
    """Beside backward (a copy thread, or CUDA's copy stream) the copies stay there and
    the factor travels on every step; inline, from the second step on, the copies run
    after the clip (they cost training the same there, and spare the replica the
    multiplication)."""
    ref = _reference(STEPS)
    stats, model, opt = _train_clipped(tmp_path / "ck", "lowdiff")
    assert stats["gradient_copies"] == STEPS * _n_grads(opt)
    assert stats["clip_scaled_steps"] == (STEPS if copy_mode == "thread" else 1)
    assert diff_states(snapshot_state(model, opt), ref[STEPS]) == []
    assert _check_persisted(tmp_path / "ck", ref) == list(range(STEPS + 1))


def test_clip_by_torch_copies_after_the_clip_from_the_second_step(tmp_path):
    ref = _reference(STEPS)
    stats, _, opt = _train_clipped(tmp_path / "ck", "torch")
    # the first step copied during backward and again after the clip; then once each
    assert stats["gradient_copies"] == (STEPS + 1) * _n_grads(opt)
    assert stats["clip_scaled_steps"] == 0
    _check_persisted(tmp_path / "ck", ref)


def _beside_torch(
    d: Path,
    before: Callable[[nn.Module, int], None] = lambda m, t: None,
    after: Callable[[nn.Module, int], None] = lambda m, t: None,
) -> dict[str, float]:
    """LowDiff+ clipping through ``ck.clip_grad_norm_`` (copies beside backward) and the
    same training clipped by torch, side by side; ``before`` and ``after`` change both
    models' gradients before and after the clip. Asserts the restored state equals
    torch's; the session's statistics."""
    model, opt = _model()
    ref_model, ref_opt = _model()
    with lowdiff.Checkpointer(
        d, model, opt, method="lowdiff+", keep_full=None,
        replica=lowdiff.ReplicaOptions(persist_every=1),
    ) as ck:  # fmt: skip
        ck.resume()
        for t in range(STEPS):
            for m in (model, ref_model):
                _backward(m, t)
                before(m, t)
            assert float(ck.clip_grad_norm_(MAX_NORM)) > MAX_NORM  # the clip fired
            torch.nn.utils.clip_grad_norm_(ref_model.parameters(), MAX_NORM)
            for m in (model, ref_model):
                after(m, t)
            ck.step()
            ref_opt.step()
            for o in (opt, ref_opt):
                o.zero_grad()
        stats = ck.stats
    model2, opt2 = _model()
    assert lowdiff.restore(d, model2, opt2) == STEPS
    assert diff_states(snapshot_state(model2, opt2), snapshot_state(ref_model, ref_opt)) == []
    return stats


def test_change_after_the_clip_is_copied_again_and_stays_exact(tmp_path, monkeypatch):
    _use_copy_mode(monkeypatch, "thread")  # the copies stay beside backward

    def halve_one(m: nn.Module, t: int) -> None:
        if t == 2:  # after the clip: one gradient changed by hand
            m[0].bias.grad.mul_(0.5)

    stats = _beside_torch(tmp_path / "ck", after=halve_one)
    assert stats["clip_scaled_steps"] == STEPS  # step 2: all but the changed one
    assert stats["gradient_copies"] == STEPS * _n_grads(_model()[1]) + 1  # and the changed one


def test_clip_that_does_not_fire_changes_nothing(tmp_path):
    model, opt = _model()
    with lowdiff.Checkpointer(tmp_path / "ck", model, opt, method="lowdiff+") as ck:
        ck.resume()
        for t in range(3):
            _backward(model, t)
            before = [p.grad.clone() for p in model.parameters()]
            assert float(ck.clip_grad_norm_(1e6)) < 1e6
            assert all(
                torch.equal(a, p.grad) for a, p in zip(before, model.parameters(), strict=True)
            )
            ck.step()
            opt.zero_grad()
        assert ck.stats["gradient_copies"] == 3 * _n_grads(opt)
        assert ck.stats["clip_scaled_steps"] == 0


def test_clip_under_lowdiff_and_attach_is_torch_clip(tmp_path):
    """Other methods clip as torch does (the compressed gradient is taken after it)."""
    model, opt = _model()
    ref_model, _ = _model()
    ck = lowdiff.attach(tmp_path / "a", model, opt, compressor=lowdiff.TopK(ratio=0.5))
    try:
        _backward(model, 0)
        _backward(ref_model, 0)
        got = ck.clip_grad_norm_(MAX_NORM, norm_type=2.0)
        want = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), MAX_NORM)
        assert float(want) > MAX_NORM and torch.equal(got, want)
        for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
        opt.step()
    finally:
        ck.close()


def test_clip_through_lowdiff_under_attach(tmp_path, monkeypatch):
    """Under ``attach`` (the optimizer's own ``step()`` drives lowdiff, a step handed
    over when the next begins) the factor travels with the step all the same."""
    _use_copy_mode(monkeypatch, "thread")
    ref = _reference(STEPS)
    model, opt = _model()
    d = tmp_path / "ck"
    ck = lowdiff.attach(
        d, model, opt, keep_full=None, replica=lowdiff.ReplicaOptions(persist_every=1)
    )
    try:
        ck.resume()
        for t in range(STEPS):
            _backward(model, t)
            assert float(ck.clip_grad_norm_(MAX_NORM)) > MAX_NORM
            opt.step()
            opt.zero_grad()
        stats = ck.stats
    finally:
        ck.close()
    assert stats["clip_scaled_steps"] == STEPS
    assert stats["gradient_copies"] == STEPS * _n_grads(opt)
    _check_persisted(d, ref)


@pytest.mark.parametrize("before", ["accumulate", "unscale"])
def test_work_before_the_clip_stays_exact(tmp_path, monkeypatch, before):
    """Two backward passes accumulated before the clip (the slot holds the sum, copied
    once the block's gradients are final), or every gradient changed in place before
    the clip (a ``GradScaler``'s unscaling): the replica ends where torch does."""
    _use_copy_mode(monkeypatch, "thread")

    def work(m: nn.Module, t: int) -> None:
        if before == "accumulate":
            _backward(m, t + 100)
        else:
            torch._foreach_mul_([p.grad for p in m.parameters()], 0.75)

    stats = _beside_torch(tmp_path / "ck", before=work)
    if before == "unscale":  # every gradient changed before the clip: none carried
        assert stats["clip_scaled_steps"] == 0

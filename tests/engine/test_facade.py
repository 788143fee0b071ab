"""The Checkpointer facade: typed properties, no attribute forwarding, one typed way in."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import lowdiff
import lowdiff.checkpointer
from lowdiff.engine.options import EngineOptions
from lowdiff.engine.trainer.strategy import (
    CompressionOnlyStrategy,
    LowDiffPlusStrategy,
    LowDiffStrategy,
)


def _objects() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_properties_are_the_strategys() -> None:
    model, opt = _objects()
    ck = lowdiff.Checkpointer(
        None, model, opt, method="compression-only", compressor=lowdiff.TopK(ratio=0.01)
    )
    assert ck.model is model and ck.optimizer is opt and ck.scheduler is None
    assert ck.method == "compression-only" and isinstance(ck.strategy_impl, CompressionOnlyStrategy)
    assert ck.step_count == 0 and ck.durable_step == -1 and ck.plan_history == []
    ck.close()


def test_setting_an_unknown_attribute_fails_instead_of_passing_silently() -> None:
    model, opt = _objects()
    ck = lowdiff.Checkpointer(
        None, model, opt, method="compression-only", compressor=lowdiff.TopK(ratio=0.01)
    )
    with pytest.raises(AttributeError):
        ck.full_every = 5  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        ck.step_count = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        _ = ck.compressor  # type: ignore[attr-defined]
    ck.close()


def test_own_strategy_is_typed_and_refuses_a_baseline(tmp_path: Path) -> None:
    model, opt = _objects()
    ck = lowdiff.Checkpointer(
        None, model, opt, method="compression-only", compressor=lowdiff.TopK(ratio=0.01)
    )
    impl = lowdiff.own_strategy(ck)
    assert impl is ck.strategy_impl and impl.full_every == 30 and impl.worker_process is None
    ck.close()
    base = lowdiff.Checkpointer(model, opt, tmp_path / "b", strategy="torch-save")
    with pytest.raises(TypeError, match="not a lowdiff strategy"):
        lowdiff.own_strategy(base)
    base.close()


@pytest.mark.parametrize(
    ("strategy", "cls"),
    [
        ("lowdiff", LowDiffStrategy),
        ("lowdiff+", LowDiffPlusStrategy),
        ("compression-only", CompressionOnlyStrategy),
    ],
)
def test_each_name_has_its_own_peer_class(strategy: str, cls: type) -> None:
    assert lowdiff.methods.method_class(strategy) is cls
    assert cls.name == strategy


def test_an_unknown_option_is_a_type_error_naming_it() -> None:
    model, opt = _objects()
    with pytest.raises(TypeError, match="fulll_every"):
        lowdiff.Checkpointer(
            None,
            model,
            opt,
            method="compression-only",
            fulll_every=3,
            compressor=lowdiff.TopK(ratio=0.01),
        )


@pytest.mark.parametrize(
    ("option", "value", "error"),
    [
        ("full_every", 0, ValueError),
        ("full_every", "often", ValueError),
        ("batch_size", 1.5, TypeError),
        ("keep_full", 0, ValueError),
        ("max_inflight", True, TypeError),
        ("stall_timeout", 0, ValueError),
        ("start_timeout", "soon", ValueError),
        ("on_storage_error", "ignore", ValueError),
        ("compressor", "topk", TypeError),
    ],
)
def test_options_validate_themselves(option: str, value: object, error: type) -> None:
    with pytest.raises(error, match=option):
        EngineOptions(**{option: value})


def test_options_are_frozen() -> None:
    opts = EngineOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.full_every = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("strategy", "options", "match"),
    [
        ("lowdiff+", {"compressor": lowdiff.TopK(0.1)}, "without compression"),
        ("lowdiff+", {"max_lag": 0}, "max_lag"),
        ("lowdiff+", {"idle_timeout": -1}, "Timeouts.idle"),
        ("lowdiff+", {"full_every": "auto"}, "'lowdiff' only"),
        ("lowdiff+", {"on_storage_error": "warn"}, "'lowdiff' only"),
        ("none", {"on_storage_error": "warn"}, "'lowdiff' only"),
    ],
)
def test_rules_of_one_strategy(strategy: str, options: dict, match: str, tmp_path: Path) -> None:
    model, opt = _objects()
    with pytest.raises(ValueError, match=match):
        lowdiff.Checkpointer(model, opt, tmp_path / "c", strategy=strategy, **options)


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["lowdiff", "lowdiff+", "torch-save"])
@pytest.mark.parametrize("trained", [False, True])
def test_resume_after_close_is_refused_and_starts_nothing(
    strategy: str, trained: bool, tmp_path: Path
) -> None:
    """A closed Checkpointer has let go of its directory: resume() must not start a
    session (a checkpointing process nothing would ever close) on it again."""
    import multiprocessing

    model, opt = _objects()
    d = tmp_path / "ck"
    ck = lowdiff.Checkpointer(model, opt, d, strategy=strategy)
    if trained:
        ck.resume()
        model(torch.randn(3, 4)).sum().backward()
        ck.step()
        opt.zero_grad()
    ck.close()
    durable = max(ck.durable_step, 0)  # torch-save: the step-0 checkpoint (every 30 steps)
    files = sorted(p.relative_to(d) for p in d.rglob("*")) if d.exists() else []
    with pytest.raises(RuntimeError, match=r"resume\(\) after close\(\)"):
        ck.resume()
    with pytest.raises(RuntimeError, match=r"step\(\) after close\(\)"):
        ck.step()
    assert multiprocessing.active_children() == []
    assert (sorted(p.relative_to(d) for p in d.rglob("*")) if d.exists() else []) == files
    # the directory is free: a new Checkpointer takes it at once
    model2, opt2 = _objects()
    with lowdiff.Checkpointer(model2, opt2, d, strategy=strategy) as ck2:
        assert ck2.resume() == durable

"""The public API as a user and a type checker see it: visible typed options, option
groups that check themselves, one error family, the spellings of 0.1 that still work,
and the registration hook a third-party method uses."""

from __future__ import annotations

import dataclasses
import inspect
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import lowdiff
from lowdiff.integrations import hf, lightning


def _objects() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _backward(model: torch.nn.Module) -> None:
    model(torch.randn(3, 4)).sum().backward()


@pytest.mark.parametrize(
    "fn", [lowdiff.Checkpointer, lowdiff.attach, hf.LowDiffCallback, lightning.LowDiffCallback]
)
def test_signatures_show_every_option(fn: Any) -> None:
    params = inspect.signature(fn).parameters
    kinds = {p.kind for p in params.values()}
    assert inspect.Parameter.VAR_KEYWORD not in kinds
    assert inspect.Parameter.VAR_POSITIONAL not in kinds
    assert next(iter(params)) == "directory"
    for name in ("method", "compressor", "full_every", "records_per_file", "replica", "remote",
                 "timeouts"):  # fmt: skip
        assert name in params, name


@pytest.mark.parametrize(
    ("make", "match", "error"),
    [
        (lambda: lowdiff.ReplicaOptions(max_lag=0), "ReplicaOptions.max_lag", ValueError),
        (lambda: lowdiff.ReplicaOptions(persist_every="often"), "persist_every", TypeError),
        (lambda: lowdiff.ReplicaOptions(threads=1.5), "ReplicaOptions.threads", TypeError),
        (lambda: lowdiff.RemoteOptions("bucket/run"), "fsspec URL", ValueError),
        (lambda: lowdiff.RemoteOptions(3), "fsspec URL", TypeError),
        (lambda: lowdiff.RemoteOptions("s3://b/r", bandwidth=0), "bandwidth", ValueError),
        (lambda: lowdiff.RemoteOptions("s3://b/r", storage_options=[1]), "storage_options", TypeError),
        (lambda: lowdiff.Timeouts(start=0), "Timeouts.start", ValueError),
        (lambda: lowdiff.Timeouts(idle=-1), "Timeouts.idle", ValueError),
        (lambda: lowdiff.Timeouts(sigterm="soon"), "Timeouts.sigterm", ValueError),
    ],
)
def test_option_groups_check_themselves(make: Any, match: str, error: type) -> None:
    with pytest.raises(error, match=match) as info:
        make()
    assert isinstance(info.value, lowdiff.LowDiffError)


def test_option_groups_are_frozen_and_keep_their_values() -> None:
    t = lowdiff.Timeouts(start=5, sigterm=None)
    assert (t.start, t.stall, t.idle, t.sigterm) == (5.0, 300.0, 300.0, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.start = 1  # type: ignore[misc]
    assert lowdiff.RemoteOptions("file:///x").timeout == 60.0


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"records_per_fil": 3}, TypeError, "did you mean 'records_per_file'"),
        ({"full_every": 0}, ValueError, "full_every"),
        ({"records_per_file": 1.5}, TypeError, "batch_size|records_per_file"),
        ({"method": "bogus"}, ValueError, "method must be one of"),
        ({"method": "lowdiff"}, ValueError, "needs compressor="),
        ({"compressor": "topk"}, TypeError, "compressor must be a lowdiff.Compressor"),
        ({"replica": lowdiff.ReplicaOptions(), "compressor": lowdiff.TopK(0.1)}, ValueError,
         "replica= applies to method 'lowdiff\\+'"),  # fmt: skip
        ({"timeouts": 30}, TypeError, "lowdiff.Timeouts"),
        ({"remote": 3}, TypeError, "remote must be"),
    ],
)
def test_a_wrong_option_is_an_error_naming_it(
    options: dict, error: type, match: str, tmp_path: Path
) -> None:
    model, opt = _objects()
    with pytest.raises(error, match=match) as info:
        lowdiff.Checkpointer(tmp_path / "ck", model, opt, **options)
    assert isinstance(info.value, lowdiff.LowDiffError)


def test_the_spellings_of_0_1_still_work_with_a_deprecation_warning(tmp_path: Path) -> None:
    model, opt = _objects()
    with pytest.warns(DeprecationWarning) as record:
        ck = lowdiff.Checkpointer(model, opt, tmp_path / "a", batch_size=2, stall_timeout=50)
    said = " ".join(str(w.message) for w in record)
    assert "Checkpointer(directory, model, optimizer)" in said
    assert "records_per_file=" in said and "timeouts=lowdiff.Timeouts" in said
    # the old order keeps the old default: LowDiff with top-k 1%
    impl = ck.strategy_impl
    assert ck.method == "lowdiff" and isinstance(impl.compressor, lowdiff.TopK)
    assert impl.options.batch_size == 2 and impl.options.stall_timeout == 50.0
    ck.close()
    with pytest.warns(DeprecationWarning, match="method='compression-only'"):
        ck = lowdiff.Checkpointer(
            None, model, opt, strategy="none", compressor=lowdiff.TopK(0.5)
        )
    assert ck.method == "compression-only"
    ck.close()
    with pytest.warns(DeprecationWarning, match="replica=lowdiff.ReplicaOptions"):
        ck = lowdiff.Checkpointer(tmp_path / "b", model, opt, max_lag=3, replica_threads=2)
    assert ck.method == "lowdiff+"
    assert (ck.strategy_impl.options.max_lag, ck.strategy_impl.options.replica_threads) == (3, 2)
    ck.close()


def test_the_new_spellings_warn_about_nothing(tmp_path: Path) -> None:
    model, opt = _objects()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ck = lowdiff.Checkpointer(
            tmp_path / "ck",
            model,
            opt,
            compressor=lowdiff.TopK(0.5),
            records_per_file=2,
            timeouts=lowdiff.Timeouts(stall=50),
        )
        assert ck.method == "lowdiff"
        ck.close()


@pytest.mark.multiprocess
def test_misuse_is_a_usage_error(tmp_path: Path) -> None:
    model, opt = _objects()
    ck = lowdiff.attach(tmp_path / "a", model, opt, compressor=lowdiff.TopK(0.5))
    with pytest.raises(lowdiff.UsageError, match="already attached"):
        lowdiff.attach(tmp_path / "b", model, opt, compressor=lowdiff.TopK(0.5))
    ck.resume()
    with pytest.raises(lowdiff.UsageError, match="optimizer.step()"):
        ck.step()
    ck.close()
    with pytest.raises(lowdiff.UsageError, match="after close"):
        ck.resume()
    ck = lowdiff.Checkpointer(tmp_path / "c", model, opt, compressor=lowdiff.TopK(0.5))
    with pytest.raises(lowdiff.UsageError, match="lowdiff.attach"):
        ck.retake("x")
    ck.resume()
    with pytest.raises(lowdiff.UsageError, match="once"):
        ck.resume()
    ck.close()
    with pytest.raises(lowdiff.UsageError, match="after close"):
        ck.step()
    for cls in (lowdiff.UsageError, lowdiff.InvalidArgumentError, lowdiff.ArgumentTypeError):
        assert issubclass(cls, lowdiff.LowDiffError)
    assert issubclass(lowdiff.UsageError, RuntimeError)
    assert issubclass(lowdiff.ArgumentTypeError, TypeError)
    assert issubclass(lowdiff.InvalidArgumentError, ValueError)


@pytest.mark.multiprocess
def test_timings_are_a_typed_stats_object(tmp_path: Path) -> None:
    model, opt = _objects()
    with lowdiff.Checkpointer(tmp_path / "ck", model, opt, compressor=lowdiff.TopK(0.5)) as ck:
        ck.resume()
        for _ in range(3):
            _backward(model)
            ck.step()
            opt.zero_grad()
        t = ck.timings
    assert isinstance(t, lowdiff.StepTimings) and t.steps == 3
    assert t.update > 0 and t.overhead_s >= 0 and t.compress <= t.take_gradients


class _SaveEveryN(lowdiff.Strategy):
    """A third-party method: ``torch.save`` of the model every ``every`` steps."""

    name = "save-every-n"

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        directory: str | os.PathLike[str] | None,
        *,
        scheduler: Any = None,
        full_every: int = 30,
        keep_full: int | None = 2,
        every: int = 1,
    ) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.root = Path(directory or ".")
        self.every, self._step, self._saved = every, 0, -1

    def resume(self) -> int:
        self.root.mkdir(parents=True, exist_ok=True)
        return 0

    def begin_step(self) -> int:
        return self._step

    def take_gradients(self, t: int) -> Any:
        from lowdiff.strategy import StepGrads

        return StepGrads()

    def after_update(self, t: int, grads: Any, hp: Any, update_s: float) -> None:
        self._step = t + 1
        if self._step % self.every == 0:
            torch.save(self.model.state_dict(), self.root / f"{self._step}.pt")
            self._saved = self._step

    def flush(self) -> int:
        return self._saved

    def close(self) -> None:
        pass

    step_count = property(lambda self: self._step)
    durable_step = property(lambda self: self._saved)
    stats = property(lambda self: {"steps": float(self._step)})


def test_a_third_party_method_registers_through_the_public_hook(tmp_path: Path) -> None:
    lowdiff.register_method("save-every-n", _SaveEveryN)
    model, opt = _objects()
    ck = lowdiff.Checkpointer(
        tmp_path / "ck", model, opt, method="save-every-n", method_options={"every": 2}
    )
    assert ck.method == "save-every-n" and ck.resume() == 0
    for _ in range(5):
        _backward(model)
        ck.step()
        opt.zero_grad()
    assert ck.flush() == 4 and sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["2.pt", "4.pt"]
    ck.close()
    with pytest.raises(lowdiff.InvalidArgumentError, match="records_per_file"):
        lowdiff.Checkpointer(tmp_path / "x", model, opt, method="save-every-n", records_per_file=5)
    with pytest.raises(lowdiff.InvalidArgumentError, match="one of lowdiff's own"):
        lowdiff.register_method("lowdiff", _SaveEveryN)


def test_the_four_entry_points_take_the_same_options_with_the_same_defaults() -> None:
    """Checkpointer, attach and both callbacks spell each option out (for IDEs and type
    checkers); they must stay one list: same names, defaults and annotations."""

    def options(fn: Any, leave_out: set[str]) -> dict[str, tuple[Any, Any]]:
        params = inspect.signature(fn).parameters.values()
        return {
            p.name: (p.default, p.annotation)
            for p in params
            if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in leave_out
        }

    full = options(lowdiff.Checkpointer, set())
    assert options(lowdiff.attach, set()) == full
    framework = {"scheduler", "method_options"}  # the framework's scheduler; lowdiff's methods
    for cb in (hf.LowDiffCallback, lightning.LowDiffCallback):
        mine = options(cb, {"log_stats"})
        assert mine == {k: v for k, v in full.items() if k not in framework}


@pytest.mark.multiprocess
@pytest.mark.parametrize("attached", [False, True])
def test_a_closed_checkpointer_is_freed_without_the_cycle_collector(
    tmp_path: Path, attached: bool
) -> None:
    """Dropped after close(), the method object is freed at once, by reference counting:
    left to the cycle collector, it (and a process group it holds under DDP) would be freed
    at an arbitrary point, on whatever thread the collector runs on."""
    import gc
    import weakref

    model, opt = _objects()
    make = lowdiff.attach if attached else lowdiff.Checkpointer
    ck = make(tmp_path / "ck", model, opt, compressor=lowdiff.TopK(0.5))
    ck.resume()
    for _ in range(3):
        _backward(model)
        opt.step() if attached else ck.step()
        opt.zero_grad()
    assert ck.step_count == 3  # the steps went through lowdiff (its hooks, when attached)
    ck.close()
    gone = weakref.ref(ck.strategy_impl)
    gc.disable()
    try:
        del ck
        assert gone() is None, [type(r).__name__ for r in gc.get_referrers(gone())]
    finally:
        gc.enable()

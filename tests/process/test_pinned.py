"""Page-locking the slots a GPU copies into: a failure is said, never silent."""

from __future__ import annotations

import types

import pytest
import torch

import lowdiff
from lowdiff.proc import pinned


def _fake_cudart(monkeypatch: pytest.MonkeyPatch, register) -> list[str]:
    calls: list[str] = []

    def host_register(ptr: int, size: int, flags: int):
        calls.append("register")
        return register(ptr, size, flags)

    fake = types.SimpleNamespace(
        cudaHostRegister=host_register,
        cudaGetLastError=lambda: calls.append("clear") or 0,
    )
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return calls


def test_pinning_that_the_runtime_refuses_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_cudart(monkeypatch, lambda *a: 712)  # cudaErrorHostMemoryAlreadyRegistered
    t = torch.zeros(2**20, dtype=torch.uint8)
    with pytest.warns(UserWarning, match=r"could not page-lock 1\.0 MiB .*error 712"):
        assert pinned.pin(t) is False
    assert calls == ["register", "clear"]  # the error is cleared for the next CUDA call


def test_pinning_without_a_runtime_binding_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(*a):
        raise AttributeError("module has no attribute 'cudaHostRegister'")

    _fake_cudart(monkeypatch, missing)
    with pytest.warns(UserWarning, match="AttributeError: module has no attribute"):
        assert pinned.pin(torch.zeros(8, dtype=torch.uint8)) is False


def test_pinning_that_works_says_nothing(monkeypatch: pytest.MonkeyPatch, recwarn) -> None:
    _fake_cudart(monkeypatch, lambda *a: 0)
    assert pinned.pin(torch.zeros(8, dtype=torch.uint8)) is True
    assert not [w for w in recwarn if "page-lock" in str(w.message)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["lowdiff", "lowdiff+"])
def test_stats_say_whether_the_slots_are_pinned(tmp_path, strategy: str) -> None:
    """On CPU training nothing is pinned (no device copies into the slots)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = {"compressor": None} if strategy == "lowdiff+" else {}
    with lowdiff.Checkpointer(model, opt, tmp_path / "ck", strategy=strategy, **kw) as ck:
        ck.resume()
        model(torch.randn(3, 4)).sum().backward()
        ck.step()
        assert ck.stats["slots_pinned"] == 0.0

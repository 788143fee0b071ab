"""Every strategy is a peer under one contract, reached through one facade."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import lowdiff
from lowdiff.methods import method_class as strategy_class
from lowdiff.methods import method_names
from lowdiff.strategy import Strategy

STRATEGIES = method_names()

SRC = Path(lowdiff.__file__).parent


@pytest.mark.parametrize("name", STRATEGIES)
def test_every_strategy_is_a_checkpointer_running_the_one_pipeline(tmp_path, name):
    cls = strategy_class(name)
    assert issubclass(cls, Strategy)
    # the step pipeline exists once: no strategy has its own step()
    assert cls.step is Strategy.step
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = {"compressor": None} if name == "lowdiff+" else {}
    ck = lowdiff.Checkpointer(model, opt, tmp_path / "ck", strategy=name, **kw)
    try:
        assert isinstance(ck, lowdiff.Checkpointer)
        assert isinstance(ck.strategy_impl, cls) and ck.method == name
    finally:
        ck.close()


def test_the_contract_is_abstract():
    with pytest.raises(TypeError, match="abstract"):
        Strategy(torch.nn.Linear(1, 1), None, None)  # type: ignore[abstract]


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_the_engine_does_not_import_the_baselines():
    """The baselines build on the engine; the engine never depends on them (no cycle)."""
    for path in sorted((SRC / "engine").glob("*.py")):
        bad = [m for m in _imports(path) if m.startswith("lowdiff_lab.baselines")]
        assert bad == [], f"{path.name} imports {bad}"
    bad = [m for m in _imports(SRC / "strategy.py") if m.startswith("lowdiff_lab.baselines")]
    assert bad == []


def test_unknown_strategy_and_option_are_clear_errors(tmp_path):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="method must be one of .*'dcp-async'.*, got 'bogus'"):
        lowdiff.Checkpointer(model, opt, tmp_path / "a", strategy="bogus")
    with pytest.raises(TypeError, match="max_lag"):
        lowdiff.Checkpointer(model, opt, tmp_path / "b", strategy="torch-save", max_lag=3)


@pytest.mark.parametrize("strategy", ["lowdiff", "lowdiff+", "torch-save", "gemini"])
def test_lbfgs_is_refused_with_the_reason(tmp_path, strategy):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.LBFGS(model.parameters())
    comp = lowdiff.TopK(0.5) if strategy == "lowdiff" else None
    with pytest.raises(
        ValueError, match="LBFGS is not supported: its step\\(\\) evaluates the closure"
    ):
        lowdiff.Checkpointer(model, opt, tmp_path / "ck", strategy=strategy, compressor=comp)
    assert not (tmp_path / "ck").exists()

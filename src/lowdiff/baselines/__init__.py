"""Baseline checkpointing strategies, behind the same API as lowdiff's own.

``lowdiff.Checkpointer(model, opt, DIR, strategy=NAME, ...)`` runs one of these for the
names in :data:`BASELINES`. They implement :class:`lowdiff.strategy.Strategy`, as
lowdiff's own strategies do; :mod:`lowdiff.baselines.base` holds what they share.
"""

from __future__ import annotations

import importlib

from lowdiff.baselines.base import BaselineCheckpointer

BASELINES: dict[str, str] = {
    "torch-save": "lowdiff.baselines.torch_save:TorchSaveCheckpointer",
    "checkfreq": "lowdiff.baselines.checkfreq:CheckFreqCheckpointer",
    "gemini": "lowdiff.baselines.gemini:GeminiCheckpointer",
    "naive-dc": "lowdiff.baselines.naive_dc:NaiveDCCheckpointer",
    "dcp-async": "lowdiff.baselines.dcp_async:DCPAsyncCheckpointer",
}
"""Strategy name -> ``module:class`` (imported on first use)."""


def baseline_class(strategy: str) -> type[BaselineCheckpointer]:
    """The class implementing a baseline strategy."""
    if strategy not in BASELINES:
        raise ValueError(f"unknown baseline strategy {strategy!r}; known: {sorted(BASELINES)}")
    module, _, name = BASELINES[strategy].partition(":")
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, BaselineCheckpointer) and cls.strategy == strategy
    return cls


__all__ = ["BASELINES", "BaselineCheckpointer", "baseline_class"]

"""Baseline checkpointing strategies, behind the same API as lowdiff's own.

``lowdiff.Checkpointer(DIR, model, opt, method=NAME, method_options={...})`` runs one of
these for the names in :data:`BASELINES` (registered by :mod:`lowdiff_lab.plugin`). They implement :class:`lowdiff.strategy.Strategy`, as
lowdiff's own strategies do; :mod:`lowdiff_lab.baselines.base` holds what they share.
"""

from __future__ import annotations

from lowdiff_lab.baselines.base import BaselineCheckpointer

BASELINES: dict[str, str] = {
    "torch-save": "lowdiff_lab.baselines.torch_save:TorchSaveCheckpointer",
    "checkfreq": "lowdiff_lab.baselines.checkfreq:CheckFreqCheckpointer",
    "gemini": "lowdiff_lab.baselines.gemini:GeminiCheckpointer",
    "naive-dc": "lowdiff_lab.baselines.naive_dc:NaiveDCCheckpointer",
    "dcp-async": "lowdiff_lab.baselines.dcp_async:DCPAsyncCheckpointer",
}
"""Strategy name -> ``module:class`` (imported on first use)."""


__all__ = ["BASELINES", "BaselineCheckpointer"]

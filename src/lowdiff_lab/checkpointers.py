"""How the lab builds a Checkpointer from its job configurations.

The lab's configurations (``TrainConfig.strategy_options``, chaos and torture jobs,
bench arms) name options flat, as JSON does: ``{"persist_every": 10}``. This maps them
onto the library's API: for lowdiff's own methods the option groups
(:class:`lowdiff.ReplicaOptions`, :class:`lowdiff.Timeouts`, :class:`lowdiff.RemoteOptions`),
for a baseline its ``method_options``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

import lowdiff
from lowdiff.checkpointer import OPTIONS
from lowdiff.legacy import regroup
from lowdiff.methods import RENAMED


def typed_options(method: str, flat: dict[str, Any]) -> dict[str, Any]:
    """``Checkpointer`` keyword arguments from a lab configuration's flat options (the
    library's own mapping of flat names, :func:`lowdiff.legacy.regroup`)."""
    return regroup(flat, method, OPTIONS)[0]


def build(
    directory: str | os.PathLike[str] | None,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    strategy: str = "lowdiff",
    **flat: Any,
) -> lowdiff.Checkpointer:
    """A Checkpointer of ``strategy`` (a lab name) with the lab's flat options."""
    method = RENAMED.get(strategy, strategy)
    return lowdiff.Checkpointer(
        directory, model, optimizer, method=method, **typed_options(method, flat)
    )

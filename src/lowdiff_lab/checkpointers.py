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
from lowdiff.methods import is_builtin

_REPLICA = {"max_lag": "max_lag", "persist_every": "persist_every", "replica_threads": "threads"}
_TIMEOUTS = {"start_timeout": "start", "stall_timeout": "stall", "idle_timeout": "idle",
             "sigterm_timeout": "sigterm"}  # fmt: skip
_REMOTE = {"remote_options": "storage_options", "remote_bandwidth": "bandwidth",
           "remote_timeout": "timeout"}  # fmt: skip
_SHARED = ("compressor", "scheduler", "full_every", "keep_full", "extra_state")


def method_name(strategy: str) -> str:
    """The lab's strategy names are the library's method names (``"none"`` is
    ``"compression-only"``)."""
    return "compression-only" if strategy == "none" else strategy


def typed_options(method: str, flat: dict[str, Any]) -> dict[str, Any]:
    """``Checkpointer`` keyword arguments from a lab configuration's flat options."""
    flat = dict(flat)
    if not is_builtin(method):
        shared = {k: flat.pop(k) for k in _SHARED if k in flat}
        return {**shared, "method_options": flat} if flat else shared
    out: dict[str, Any] = {}
    if "batch_size" in flat:
        out["records_per_file"] = flat.pop("batch_size")
    for group, names, cls in (
        ("replica", _REPLICA, lowdiff.ReplicaOptions),
        ("timeouts", _TIMEOUTS, lowdiff.Timeouts),
    ):
        given = {names[k]: flat.pop(k) for k in list(flat) if k in names}
        if given:
            out[group] = cls(**given)
    remote = {_REMOTE[k]: flat.pop(k) for k in list(flat) if k in _REMOTE}
    if remote:
        out["remote"] = lowdiff.RemoteOptions(flat.pop("remote"), **remote)
    return {**out, **flat}


def build(
    directory: str | os.PathLike[str] | None,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    strategy: str = "lowdiff",
    **flat: Any,
) -> lowdiff.Checkpointer:
    """A Checkpointer of ``strategy`` (a lab name) with the lab's flat options."""
    method = method_name(strategy)
    return lowdiff.Checkpointer(directory, model, optimizer, method=method, **typed_options(method, flat))

"""Splitting the training state into per-rank shards, and putting it back together.

A shard is the sorted list of optimizer indices a rank owns. Its optimizer state dict is
what ``torch.optim`` would produce for an optimizer over those parameters alone: the
same parameter groups (empty where the shard has none of a group's parameters), local
positions ``0 .. n-1`` and the state of the owned parameters. That is both what a
rank's full checkpoint stores and what a LowDiff+ replica of the shard runs on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lowdiff.errors import InvalidArgumentError


def shard_state_dict(osd: Mapping[str, Any], shard: Sequence[int]) -> dict[str, Any]:
    """The part of ``optimizer.state_dict()`` that belongs to ``shard`` (local numbering)."""
    local = {g: i for i, g in enumerate(shard)}
    groups = []
    for g in osd["param_groups"]:
        rest = {k: v for k, v in g.items() if k != "params"}
        groups.append({**rest, "params": [local[i] for i in g["params"] if i in local]})
    state = {local[i]: v for i, v in osd["state"].items() if i in local}
    return {"state": state, "param_groups": groups}


def merge_state_dicts(
    parts: Sequence[tuple[Mapping[str, Any], Sequence[int]]], own: int
) -> dict[str, Any]:
    """Rebuild the whole optimizer state dict from every shard's ``(state dict, shard)``.

    Hyperparameters come from part ``own``; parameter indices return to global numbering.
    """
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": []}
        for g in parts[own][0]["param_groups"]
    ]
    state: dict[int, Any] = {}
    for osd, shard in parts:
        if len(osd["param_groups"]) != len(groups):
            raise InvalidArgumentError("the shards' optimizer states have different parameter groups")
        for gi, g in enumerate(osd["param_groups"]):
            groups[gi]["params"].extend(shard[i] for i in g["params"])
        for i, v in osd["state"].items():
            state[shard[int(i)]] = v
    for g in groups:
        g["params"].sort()
    # optimizer order, which is the order torch.optim creates state in
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def shard_model_tensors(
    msd: Mapping[str, torch.Tensor], foreign_params: set[str]
) -> dict[str, torch.Tensor]:
    """The model state a rank stores: everything except the parameters other ranks own."""
    return {k: v for k, v in msd.items() if k not in foreign_params}

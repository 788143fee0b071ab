"""Models whose state is sharded across ranks (FSDP2, FSDP1, DTensor): detected and refused.

lowdiff captures, records and restores whole tensors: one process's parameters and
optimizer state, or under DDP every rank's identical replica of them, of which each rank
persists a share (:mod:`lowdiff.ddp`). A model sharded with ``fully_shard`` (FSDP2),
``FullyShardedDataParallel`` (FSDP1) or tensor parallelism holds on each rank only a shard
of each parameter (a ``DTensor``, or FSDP1's flat parameter), and so does its optimizer.
Taken for a single-process model, each rank of such a job would checkpoint its shard as if
it were the whole model, into the one directory every rank was given (the second rank then
fails on the directory lock) and under names and shapes that describe no real model.
:func:`refuse_sharded` stops that at every entry point, with what to use instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lowdiff.errors import UnsupportedSetupError

__all__ = ["refuse_sharded", "sharded_reason"]

_DCP = (
    "checkpoint this job with torch.distributed.checkpoint (get_state_dict, then "
    "dcp.async_save or dcp.save on every rank), or train with DistributedDataParallel, "
    "which every lowdiff strategy supports"
)

_WHY: dict[str, str] = {
    "lowdiff+": (
        "LowDiff+'s replica and its recovery handle whole parameters (one process, or "
        "DDP's identical replicas, of which each rank persists a share), not each rank's "
        "own shard of every parameter and its optimizer state"
    ),
    "lowdiff": (
        "LowDiff's records are the compressed gradients that gradient compression already "
        "made for communication, reused; under fully_shard the gradients are reduce-"
        "scattered densely inside FSDP, so there is no compressed gradient to reuse: "
        "compressing each rank's shard afterwards would change every update (the optimizer "
        "would apply the compressed shard) and save no communication. LowDiff+ (no "
        "compression) is the strategy meant for sharded training"
    ),
    "none": (
        "strategy 'none' trains with LowDiff's gradient compression, which needs DDP's "
        "communication hook; fully_shard reduce-scatters the gradients itself"
    ),
    "lowdiff.restore": (
        "a lowdiff checkpoint holds whole tensors; restore it into the model built "
        "without fully_shard (one process), or export it with `lowdiff export --format "
        "dcp` and load that into the sharded model with dcp.load and set_state_dict"
    ),
}
_BASELINE_WHY = (
    "the baselines capture one process's whole model and optimizer state into one "
    "directory, not each rank's shard"
)


def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a build of torch without distributed: no DTensor exists
        return False
    return isinstance(t, DTensor)


def _sharding_modules() -> tuple[type, ...]:
    kinds: list[type] = []
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:
        return ()
    kinds += [FSDPModule, FullyShardedDataParallel]
    return tuple(kinds)


def sharded_reason(model: torch.nn.Module, optimizer: Any | None = None) -> str | None:
    """What makes ``model`` (and ``optimizer``) sharded across ranks, or None if nothing.

    Looks for a module sharded by ``fully_shard`` (``FSDPModule``) or wrapped in
    ``FullyShardedDataParallel``, and for ``DTensor`` parameters and buffers of the model
    or parameters of the optimizer (tensor parallelism without FSDP, too).

    Example:
        >>> sharded_reason(torch.nn.Linear(2, 2)) is None
        True
    """
    kinds = _sharding_modules()
    for name, m in model.named_modules():
        if kinds and isinstance(m, kinds):
            where = f"submodule {name!r}" if name else "the model"
            how = (
                "FullyShardedDataParallel (FSDP1)"
                if type(m).__name__ == "FullyShardedDataParallel"
                else "fully_shard (FSDP2)"
            )
            return f"{where} is sharded with {how}"
    tensors: Iterable[tuple[str, Any]] = [
        *model.named_parameters(),
        *model.named_buffers(),
    ]
    for name, t in tensors:
        if _is_dtensor(t):
            return f"{name!r} is a DTensor (sharded or replicated across ranks)"
    if optimizer is not None:
        for group in getattr(optimizer, "param_groups", []):
            for p in group["params"]:
                if _is_dtensor(p):
                    return f"the optimizer updates a DTensor parameter of shape {tuple(p.shape)}"
    return None


def refuse_sharded(model: torch.nn.Module, optimizer: Any | None, what: str) -> None:
    """Raise :class:`UnsupportedSetupError` when ``model`` is sharded across ranks.

    Args:
        model: the model passed to lowdiff.
        optimizer: its optimizer (None: only the model is looked at).
        what: the strategy's name, or ``"lowdiff.restore"``: the error says why that one
            is not supported and what to use.

    Raises:
        UnsupportedSetupError: naming what is sharded, what is not supported and why,
            and what to use instead.
    """
    found = sharded_reason(model, optimizer)
    if found is None:
        return
    why = _WHY.get(what, _BASELINE_WHY)
    if what == "lowdiff.restore":
        subject, instead = what, ""  # what to do instead is the reason's second half
    else:
        subject, instead = f"strategy {what!r}", f" Instead, {_DCP}."
    raise UnsupportedSetupError(
        f"{subject} does not support models sharded across ranks (FSDP2 fully_shard, "
        f"FSDP1, DTensor/tensor parallelism), and {found}: {why}.{instead}"
    )

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

import sys
from collections.abc import Iterable
from typing import Any

import torch

from lowdiff.errors import UnsupportedSetupError

__all__ = [
    "FSDP2",
    "fsdp2_group",
    "fsdp2_unsupported",
    "is_dtensor",
    "local",
    "refuse_sharded",
    "sharded_reason",
    "shard_like",
    "shard_model_state",
    "shard_optimizer_state",
]

FSDP2 = "fsdp2"
"""The ``sharding`` of a job written under ``fully_shard`` (in its job manifest)."""

_DCP = (
    "checkpoint this job with torch.distributed.checkpoint (get_state_dict, then "
    "dcp.async_save or dcp.save on every rank), or train with DistributedDataParallel, "
    "which every lowdiff method supports"
)

_WHY: dict[str, str] = {
    "lowdiff": (
        "LowDiff's records are the compressed gradients that gradient compression already "
        "made for communication, reused; under fully_shard the gradients are reduce-"
        "scattered densely inside FSDP, so there is no compressed gradient to reuse: "
        "compressing each rank's shard afterwards would change every update (the optimizer "
        "would apply the compressed shard) and save no communication. LowDiff+ (no "
        "compression) is the method meant for sharded training"
    ),
    "compression-only": (
        "method 'compression-only' trains with LowDiff's gradient compression, which needs DDP's "
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


_DTENSOR_MODULES = ("torch.distributed.tensor", "torch.distributed._tensor")
_FSDP2_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")
"""Where ``DTensor`` and ``FSDPModule`` live: the public modules, and before them (torch
2.4) the private ones; either is imported once such an object exists."""


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor``.

    Looked up in ``sys.modules``, never imported: no DTensor exists before its package is
    imported, and the check runs for every gradient at every step.
    """
    if type(t) is torch.Tensor:
        return False  # a plain tensor (every gradient outside fully_shard)
    for where in _DTENSOR_MODULES:
        cls = getattr(sys.modules.get(where), "DTensor", None)
        if cls is not None:
            return isinstance(t, cls)
    return False


def _tensor_api() -> Any:
    """The DTensor package (``torch.distributed.tensor``; ``._tensor`` before torch 2.5)."""
    try:
        import torch.distributed.tensor as api
    except ImportError:
        import torch.distributed._tensor as api  # type: ignore[no-redef]
    return api


def _sharding_modules() -> tuple[type, ...]:
    """FSDP2's ``FSDPModule`` and FSDP1's class, once ``torch.distributed.fsdp`` is
    imported (no module can be sharded before)."""
    mod = sys.modules.get("torch.distributed.fsdp")
    kinds = [_fsdp_module(), getattr(mod, "FullyShardedDataParallel", None)]
    return tuple(k for k in kinds if isinstance(k, type))


def _fsdp_module() -> type | None:
    """FSDP2's ``FSDPModule`` class, if imported (where torch 2.4 to 2.13 define it)."""
    for where in _FSDP2_MODULES:
        cls = getattr(sys.modules.get(where), "FSDPModule", None)
        if isinstance(cls, type):
            return cls
    return None


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
        if is_dtensor(t):
            return f"{name!r} is a DTensor (sharded or replicated across ranks)"
    if optimizer is not None:
        for group in getattr(optimizer, "param_groups", []):
            for p in group["params"]:
                if is_dtensor(p):
                    return f"the optimizer updates a DTensor parameter of shape {tuple(p.shape)}"
    return None


ELEMENTWISE = frozenset(
    {"ASGD", "Adadelta", "Adagrad", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop",
     "Rprop", "SGD"}
)  # fmt: skip
"""``torch.optim`` optimizers whose update of an element reads that element's gradient
and state alone: applied to a rank's shard, they make the update of the whole parameter
restricted to the shard, which is what a rank's replica runs."""


def fsdp2_unsupported(model: torch.nn.Module, optimizer: Any | None) -> str | None:
    """Why ``model`` is not a sharded model LowDiff+ runs (None: it is one).

    LowDiff+ runs a model sharded with ``fully_shard`` over a 1-D mesh: every parameter
    the optimizer updates is a ``DTensor`` placed ``Shard(0)`` on that one mesh, so each
    rank's optimizer updates its local shard elementwise, which the rank's replica does
    too (:data:`ELEMENTWISE`). Tensor parallelism, HSDP (2-D meshes), FSDP1, replicated
    DTensors, other optimizers (Adafactor) and (so far) CUDA parameters are not.
    """
    fsdp_module = _fsdp_module()
    fsdp2 = [m for m in model.modules() if fsdp_module and isinstance(m, fsdp_module)]
    if not fsdp2:
        return "no module of the model is sharded with fully_shard (FSDP2)"
    if any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()):
        return "FullyShardedDataParallel (FSDP1) wraps part of the model"
    Shard = _tensor_api().Shard  # noqa: N806 -- the class, as torch names it

    params = [p for g in getattr(optimizer, "param_groups", []) for p in g["params"]]
    meshes = set()
    for name, p in model.named_parameters():
        if not is_dtensor(p):
            return f"parameter {name!r} is not sharded (fully_shard every parameter)"
        d: Any = p  # a DTensor
        if d.device_mesh.ndim != 1 or tuple(d.placements) != (Shard(0),):
            return (
                f"parameter {name!r} is placed {tuple(d.placements)} on a {d.device_mesh.ndim}-D "
                "mesh (HSDP or tensor parallelism), not Shard(0) on a 1-D mesh"
            )
        meshes.add(id(d.device_mesh))
    if len(meshes) > 1:
        return "the parameters are sharded over more than one device mesh"
    kind = type(optimizer)
    if kind.__module__.startswith("torch.optim") and kind.__name__ not in ELEMENTWISE:
        return (
            f"its optimizer {kind.__name__} does not update each element on its own (its "
            "state or update spans rows of a parameter, which fully_shard splits across "
            f"ranks); LowDiff+ under fully_shard runs {', '.join(sorted(ELEMENTWISE))}"
        )
    devices = {p.device.type for p in model.parameters()}
    if devices != {"cpu"}:
        # on CUDA the snapshot's check for gradients changed after their hook (clipping)
        # would compare pinned host copies with device memory; not built nor measured yet
        return (
            f"its parameters are on {sorted(devices)}: under fully_shard LowDiff+ runs on "
            "CPU (gloo) so far"
        )
    if not all(is_dtensor(p) for p in params):
        return "the optimizer updates a parameter that is not a DTensor"
    return None


def fsdp2_group(model: torch.nn.Module) -> Any | None:
    """The process group a ``fully_shard``ed model is sharded over (None: not sharded)."""
    for p in model.parameters():
        if is_dtensor(p):
            d: Any = p
            return d.device_mesh.get_group()
    return None


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` when it is a ``DTensor``, else ``t`` itself."""
    if is_dtensor(t):
        with torch.no_grad():  # the shard itself, not a differentiable view of it
            return t.to_local()  # type: ignore[attr-defined, no-any-return]
    return t


def shard_like(template: Any, shard: torch.Tensor) -> torch.Tensor:
    """``shard`` (a rank's local shard) as a ``DTensor`` placed as ``template`` is; ``shard``
    itself when ``template`` is no ``DTensor``."""
    if not is_dtensor(template):
        return shard
    return _tensor_api().DTensor.from_local(  # type: ignore[no-any-return]
        shard,
        template.device_mesh,
        template.placements,
        run_check=False,
        shape=template.shape,
        stride=template.stride(),
    )


def shard_model_state(
    sd: dict[str, torch.Tensor], module: torch.nn.Module
) -> dict[str, torch.Tensor]:
    """Under ``fully_shard``: a state dict of this rank's local shards, as the ``DTensor``
    shards ``module.load_state_dict`` takes (``sd`` itself for any other module; ``module``
    is the user's module, out of its DDP or ``torch.compile`` wrapper)."""
    live = module.state_dict()
    if not any(is_dtensor(v) for v in live.values()):
        return sd
    return {k: shard_like(live[k], v) if k in live else v for k, v in sd.items()}


def shard_optimizer_state(osd: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Under ``fully_shard``: per-parameter optimizer state read as this rank's local
    shards, made ``DTensor`` shards placed as their parameter (the optimizer mixes no plain
    tensor with a ``DTensor``). Scalars such as Adam's ``step`` stay as they are."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for idx, entry in osd.get("state", {}).items():
        if not isinstance(idx, int) or not 0 <= idx < len(params) or not isinstance(entry, dict):
            continue
        p = params[idx]
        shard_shape = local(p).shape
        for k, v in entry.items():
            if isinstance(v, torch.Tensor) and v is not p and v.shape == shard_shape and v.dim():
                entry[k] = shard_like(p, v)
    return osd


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
    if what == "lowdiff+":
        why_not = fsdp2_unsupported(model, optimizer)
        if why_not is None:
            return
        raise UnsupportedSetupError(
            f"method 'lowdiff+' runs models sharded with fully_shard (FSDP2) over a 1-D "
            f"mesh, and {found}, but {why_not}. Instead, {_DCP}."
        )
    why = _WHY.get(what, _BASELINE_WHY)
    if what == "lowdiff.restore":
        subject, instead = what, ""  # what to do instead is the reason's second half
    else:
        subject, instead = f"method {what!r}", f" Instead, {_DCP}."
    raise UnsupportedSetupError(
        f"{subject} does not support models sharded across ranks (FSDP2 fully_shard, "
        f"FSDP1, DTensor/tensor parallelism), and {found}: {why}.{instead}"
    )

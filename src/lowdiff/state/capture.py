"""Capturing and restoring the pieces of training state that lowdiff checkpoints.

Everything here runs in the training process (or a recovery process) and touches the
user's live objects: the model, the optimizer, the LR scheduler and the RNGs. The rule
that ties records and full checkpoints together is written down once:

    Full checkpoint F holds the state after F optimizer updates ("step F").
    Record t turns the state after t updates into the state after t + 1.

A state consists of the model's parameters and persistent buffers, the optimizer's
``state_dict()`` (including its step counters and per-group hyperparameters), the
scheduler's ``state_dict()``, and the RNG states (torch CPU, CUDA when initialised,
Python's ``random`` and NumPy's global generator).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lowdiff.errors import (
    ArgumentTypeError,
    CheckpointMismatchError,
    InvalidArgumentError,
    LowDiffError,
)
from lowdiff.format import codec
from lowdiff.state.rng import RngCapture as RngCapture  # re-exported: the state API
from lowdiff.state.rng import RngLayout, capture_rng
from lowdiff.state.rng import restore_rng as restore_rng
from lowdiff.state.sharded import local

# --------------------------------------------------------------------------- arguments


def check_training_objects(model: Any, optimizer: Any, scheduler: Any | None) -> None:
    """Reject arguments that are not a model, an optimizer and an LR scheduler of it.

    Raises:
        TypeError / ValueError naming the argument.
    """
    if not isinstance(model, torch.nn.Module):
        raise ArgumentTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ArgumentTypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if scheduler is None:
        return
    if isinstance(scheduler, torch.optim.Optimizer) or not all(
        callable(getattr(scheduler, a, None)) for a in ("step", "state_dict", "load_state_dict")
    ):
        raise ArgumentTypeError(
            f"scheduler must be an LR scheduler (with step, state_dict and load_state_dict), got {type(scheduler).__name__}"
        )
    attached = getattr(scheduler, "optimizer", optimizer)
    # a framework's wrapper of this optimizer (Accelerate's AcceleratedOptimizer, whose
    # param_groups are the optimizer's) drives the same hyperparameters
    if attached is not optimizer and getattr(attached, "optimizer", None) is not optimizer:
        raise InvalidArgumentError("scheduler is attached to a different optimizer than the one passed")


# --------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class ParamInfo:
    """One parameter the optimizer updates, in optimizer order."""

    index: int
    """Position in the optimizer's flattened ``param_groups`` (its ``state_dict`` key)."""
    name: str
    """Name in ``model.named_parameters()``."""
    shape: tuple[int, ...]
    dtype: torch.dtype


COMPILED_PREFIX = "_orig_mod."
"""What ``torch.compile``'s wrapper adds to every name of the module it compiles."""


def _compiled_class() -> type | None:
    # torch.compile's wrapper class, if torch.compile was ever used in this process (no
    # import of torch._dynamo, which costs about a second, otherwise)
    mod = sys.modules.get("torch._dynamo.eval_frame")
    cls = getattr(mod, "OptimizedModule", None)
    return cls if isinstance(cls, type) else None


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside DDP / DataParallel style wrappers (their ``.module``) and
    ``torch.compile``'s (its ``_orig_mod``), in any order.

    Names are taken from it, so they are canonical: those of
    ``torch.distributed.checkpoint.state_dict.get_model_state_dict``, without the
    ``module.`` and ``_orig_mod.`` prefixes, and a compiled model's checkpoint restores
    into the same model uncompiled, and back.
    """
    compiled = _compiled_class()
    while True:
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        elif compiled is not None and isinstance(model, compiled):
            model = model._orig_mod  # type: ignore[assignment]
        else:
            return model


def canonical_name(name: str) -> str:
    """``name`` without ``torch.compile``'s ``_orig_mod.`` (names in checkpoints written
    before :func:`unwrap_model` removed it)."""
    return name.replace(COMPILED_PREFIX, "")


def optimizer_params(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> list[tuple[ParamInfo, torch.nn.Parameter]]:
    """Pair every optimizer parameter with its model name, in optimizer order.

    Raises:
        ValueError: a parameter the optimizer updates is not part of the model, or
            appears twice in the optimizer.
    """
    names = {id(p): n for n, p in unwrap_model(model).named_parameters()}
    out: list[tuple[ParamInfo, torch.nn.Parameter]] = []
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in seen:
                raise InvalidArgumentError("the optimizer holds the same parameter twice")
            seen.add(id(p))
            if id(p) not in names:
                raise InvalidArgumentError(
                    f"the optimizer updates a parameter of shape {tuple(p.shape)} that is not in the model; "
                    "pass the model whose parameters the optimizer was built from"
                )
            out.append((ParamInfo(len(out), names[id(p)], tuple(p.shape), p.dtype), p))
    return out


def model_state(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The model's ``state_dict`` without aliases, plus ``{alias: canonical name}``.

    Tied weights (e.g. a language model's input embedding and output head) appear under
    two names that share storage; they are stored once. A ``fully_shard``ed model's
    parameters are this rank's shards.
    """
    sd = {k: local(v) for k, v in unwrap_model(model).state_dict().items()}
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, t in sd.items():
        key = (
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            tuple(t.stride()),
            t.dtype,
            t.device,
        )
        if t.numel() and key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            unique[name] = t
    return unique, aliases


def buffer_names(model: torch.nn.Module) -> list[str]:
    """Persistent buffers (those in ``state_dict``), which change in forward, not in the optimizer."""
    m = unwrap_model(model)
    sd_keys = set(m.state_dict().keys())
    return [n for n, _ in m.named_buffers() if n in sd_keys]


def get_buffers(model: torch.nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    m = unwrap_model(model)
    all_b = dict(m.named_buffers())
    return {n: all_b[n] for n in names}


class BufferRefs:
    """Where each named buffer lives, resolved once (the per-step path does no module walk).

    A buffer is read from its module's ``_buffers`` dict at every :meth:`tensors` call, so
    a buffer reassigned in place of the old one (``self.running_mean = t``, ``module.to``)
    is the one taken.
    """

    def __init__(self, model: torch.nn.Module, names: list[str]) -> None:
        mods = dict(unwrap_model(model).named_modules())
        self.refs: list[tuple[dict[str, Any], str]] = []
        for n in names:
            owner, _, attr = n.rpartition(".")
            self.refs.append((mods[owner]._buffers, attr))

    def tensors(self) -> list[torch.Tensor]:
        return [d[a] for d, a in self.refs]


def set_buffers(model: torch.nn.Module, values: Mapping[str, torch.Tensor]) -> None:
    m = unwrap_model(model)
    all_b = dict(m.named_buffers())
    with torch.no_grad():
        for n, v in values.items():
            n = canonical_name(n)  # a checkpoint of before names were canonical
            if n not in all_b:
                raise CheckpointMismatchError(
                    f"the checkpoint has buffer {n!r}, the model has no such buffer"
                )
            if tuple(all_b[n].shape) != tuple(v.shape):
                raise CheckpointMismatchError(
                    f"buffer {n!r}: checkpoint shape {tuple(v.shape)}, model shape {tuple(all_b[n].shape)}"
                )
            all_b[n].copy_(v)


# --------------------------------------------------------------------------- hyperparameters


def capture_hparams(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Per-group hyperparameters (everything but ``params``), as live Python values."""
    out = []
    for g in optimizer.param_groups:
        d = {}
        for k, v in g.items():
            if k == "params":
                continue
            d[k] = v.detach().clone() if isinstance(v, torch.Tensor) else v
        out.append(d)
    return out


class HparamsText:
    """The JSON text of the per-group hyperparameters (``codec.dumps`` of
    :func:`capture_hparams`), encoding again only what changed since the previous call
    (:class:`lowdiff.format.codec.DumpsMemo`): a scheduler's new ``lr`` is encoded, the
    rest of the group's text is reused. What a scheduler or a user assigns
    (``g["lr"] = x``) is a new object, so it is seen at the next call; a tensor or a list
    is looked at every time.
    """

    def __init__(self) -> None:
        self._memo = codec.DumpsMemo()

    def __call__(self, optimizer: torch.optim.Optimizer) -> str:
        return self._memo(
            [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        )


def apply_hparams(optimizer: torch.optim.Optimizer, hparams: list[dict[str, Any]]) -> None:
    if len(hparams) != len(optimizer.param_groups):
        raise CheckpointMismatchError(
            f"the checkpoint has {len(hparams)} parameter groups, the optimizer has {len(optimizer.param_groups)}"
        )
    for g, hp in zip(optimizer.param_groups, hparams, strict=True):
        for k, v in hp.items():
            if isinstance(v, torch.Tensor) and isinstance(g.get(k), torch.Tensor):
                g[k].copy_(v)  # keep tensor identity (capturable / compiled optimizers hold it)
            else:
                g[k] = v


# --------------------------------------------------------------------------- full state


def match_param_layout(osd: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Give per-parameter optimizer state the memory layout of its parameter.

    Files hold tensors in standard (contiguous) layout. Optimizers create their state
    with ``zeros_like(param)``, i.e. in the parameter's layout (channels_last, ...), and
    fused kernels rely on it, so state loaded for a non-contiguous parameter is copied
    back into that layout.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for idx, entry in osd.get("state", {}).items():
        if not isinstance(idx, int) or not 0 <= idx < len(params) or not isinstance(entry, dict):
            continue
        p = params[idx]
        if p.is_contiguous():
            continue
        for k, v in entry.items():
            if isinstance(v, torch.Tensor) and v.shape == p.shape and v.is_contiguous():
                entry[k] = torch.empty_like(p, dtype=v.dtype, device=v.device).copy_(v)
    return osd


def optimizer_state_tensors(
    optimizer: torch.optim.Optimizer, state_dict: dict[str, Any] | None = None
) -> tuple[dict[str, torch.Tensor], str]:
    """``optimizer.state_dict()`` (or ``state_dict``) as (tensors by name, JSON that references them)."""
    tensors: dict[str, torch.Tensor] = {}

    def sink(path: str, t: torch.Tensor) -> str:
        name = "optim/" + path.removeprefix("$.")
        tensors[name] = local(t)  # under fully_shard: this rank's shard of the state
        return name

    text = codec.dumps(optimizer.state_dict() if state_dict is None else state_dict, sink)
    return tensors, text


def check_extra_state(extra_state: Any) -> dict[str, Any]:
    """``extra_state``: a dict of name -> object with ``state_dict()`` and
    ``load_state_dict()`` (a data loader, a sampler, a ``GradScaler``, a user's counters).

    Raises:
        TypeError naming the entry that is not such an object.
    """
    if extra_state is None:
        return {}
    if not isinstance(extra_state, dict):
        raise ArgumentTypeError(
            f"extra_state must be a dict of name -> stateful object, got {type(extra_state).__name__}"
        )
    for name, obj in extra_state.items():
        if not isinstance(name, str) or not name:
            raise ArgumentTypeError(f"extra_state keys must be non-empty strings, got {name!r}")
        missing = [
            m for m in ("state_dict", "load_state_dict") if not callable(getattr(obj, m, None))
        ]
        if missing:
            raise ArgumentTypeError(
                f"extra_state[{name!r}] ({type(obj).__name__}) has no {' or '.join(missing)}(); "
                "lowdiff saves and restores extra state through them"
            )
    return dict(extra_state)


def capture_extra(extra_state: dict[str, Any]) -> Any:
    """Every extra object's ``state_dict()``, as a JSON tree (tensors inline, never pickled).

    Raises:
        LowDiffError naming the entry and the object's type when its ``state_dict()``
        raises; TypeError naming the object and where in its state a value cannot be
        encoded.
    """
    if not extra_state:
        return None
    out = {}
    for name, obj in extra_state.items():
        sd = _extra_call(name, obj, "state_dict")
        try:
            out[name] = codec.encode(sd, None, f"$.{name}")
        except TypeError as e:
            raise ArgumentTypeError(
                f"extra_state[{name!r}]: its state_dict() cannot be saved without pickling: {e}"
            ) from None
    return out


def _extra_call(name: str, obj: Any, method: str, *args: Any) -> Any:
    """``obj.<method>(*args)`` of ``extra_state[name]``; a failure is a :class:`LowDiffError`
    that names the entry and the object's type (an error lowdiff raises itself goes through)."""
    try:
        return getattr(obj, method)(*args)
    except LowDiffError:
        raise
    except Exception as e:
        hint = ""
        if type(obj).__module__.startswith("accelerate."):
            hint = (
                " (an Accelerate data loader has a state only with Accelerator(dataloader_config="
                "DataLoaderConfiguration(use_stateful_dataloader=True)))"
            )
        raise LowDiffError(
            f"extra_state[{name!r}] ({type(obj).__name__}): its {method}() raised "
            f"{type(e).__name__}: {e}{hint}"
        ) from e


def apply_extra(extra_state: dict[str, Any] | None, tree: Any, where: str) -> None:
    """Load a captured extra-state tree (:func:`capture_extra`) into the user's objects."""
    if not extra_state:
        return
    saved = {} if tree is None else tree
    missing = [n for n in extra_state if n not in saved]
    if missing:
        from lowdiff.errors import CheckpointMismatchError

        raise CheckpointMismatchError(
            f"{where}: extra_state {', '.join(map(repr, missing))} was passed, but the checkpoint "
            f"holds {'no extra state' if not saved else 'only ' + ', '.join(map(repr, saved))}"
        )
    for name, obj in extra_state.items():
        _extra_call(name, obj, "load_state_dict", codec.decode(saved[name]))


def scheduler_state_json(scheduler: Any | None) -> str:
    return codec.dumps(None if scheduler is None else scheduler.state_dict())


def state_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any | None = None
) -> dict[str, torch.Tensor]:
    """The whole training state as a flat, alias-free ``{name: tensor}`` dict.

    Meant for exact comparisons (``torch.equal`` on every entry): non-tensor values
    (hyperparameters, scheduler state, Python RNG bookkeeping) are included as the
    UTF-8 bytes of their canonical JSON, so equal bytes mean equal values.

    Example:
        >>> a = state_tensors(model, opt, sched)  # doctest: +SKIP
        >>> all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()  # doctest: +SKIP
    """
    out: dict[str, torch.Tensor] = {}
    msd, aliases = model_state(model)
    for k, v in msd.items():
        out[f"model/{k}"] = v.detach().cpu()
    otensors, ojson = optimizer_state_tensors(optimizer)
    out.update({k: v.detach().cpu() for k, v in otensors.items()})
    out["optim.json"] = _text_tensor(ojson)
    out["scheduler.json"] = _text_tensor(scheduler_state_json(scheduler))
    rt, rextra = capture_rng(RngLayout())
    out.update(rt)
    out["rng.json"] = _text_tensor(codec.dumps(rextra))
    out["model.aliases.json"] = _text_tensor(codec.dumps(aliases))
    return out


def _text_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).clone()


def snapshot_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any | None = None
) -> dict[str, torch.Tensor]:
    """A copy of :func:`state_tensors` that later training does not change."""
    return {k: v.clone() for k, v in state_tensors(model, optimizer, scheduler).items()}


def diff_states(want: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor]) -> list[str]:
    """Every difference between two flat states; empty means bit-identical.

    Entries are ``"missing <key>"`` (only in ``want``), ``"extra <key>"`` (only in ``got``)
    and ``"<key>"`` (present in both, but dtype, shape or any element differs).

    Example:
        >>> diff_states(snapshot_state(m, o), snapshot_state(m2, o2))  # doctest: +SKIP
        []
    """
    problems = [f"missing {k}" for k in want.keys() - got.keys()]
    problems += [f"extra {k}" for k in got.keys() - want.keys()]
    for k in want.keys() & got.keys():
        a, b = want[k], got[k]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            problems.append(k)
    return sorted(problems)


def sparse_gradient_error(name: str, source: str = "") -> str:
    """The refusal of a sparse gradient (of parameter ``name``, from ``source``)."""
    came = f" ({source})" if source else ""
    return (
        f"parameter {name!r} has a sparse gradient{came}; lowdiff supports dense gradients "
        "only (build the embedding with sparse=False)"
    )


def refuse_lbfgs(optimizer: torch.optim.Optimizer) -> None:
    """LBFGS evaluates its closure several times per update: no strategy can take it."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise InvalidArgumentError(
            "LBFGS is not supported: its step() evaluates the closure several times per "
            "update, and lowdiff records the one gradient each update applies"
        )


def class_path(obj: Any) -> str:
    """``module.QualifiedName`` of ``obj``'s class (how manifests name classes)."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"

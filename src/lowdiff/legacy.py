"""The spellings of lowdiff 0.1 that still work for one release, each with a
``DeprecationWarning`` that names its replacement.

- ``Checkpointer(model, optimizer, directory)`` and ``attach(model, optimizer,
  directory)``: the directory now comes first. A call in the old order also keeps the
  old default (``method="lowdiff"`` with ``TopK(ratio=0.01)`` when no compressor is
  given), so that it trains as it did.
- ``strategy=`` is ``method=``; ``strategy="none"`` is ``method="compression-only"``.
- ``batch_size=`` is ``records_per_file=``.
- ``max_lag=``, ``persist_every=``, ``replica_threads=`` are ``replica=ReplicaOptions(...)``.
- ``remote_options=``, ``remote_bandwidth=``, ``remote_timeout=`` are
  ``remote=RemoteOptions(url, storage_options=..., bandwidth=..., timeout=...)``.
- ``start_timeout=``, ``stall_timeout=``, ``idle_timeout=``, ``sigterm_timeout=`` are
  ``timeouts=Timeouts(start=..., stall=..., idle=..., sigterm=...)``.
- A registered method's own options (a baseline's ``persist_every``) are
  ``method_options={...}``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import warnings
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch

from lowdiff.errors import ArgumentTypeError
from lowdiff.methods import BUILTIN, RENAMED
from lowdiff.options import RemoteOptions, ReplicaOptions, Timeouts

P = ParamSpec("P")
R = TypeVar("R")

_REPLICA = {"max_lag": "max_lag", "persist_every": "persist_every", "replica_threads": "threads"}
_REMOTE = {"remote_options": "storage_options", "remote_bandwidth": "bandwidth",
           "remote_timeout": "timeout"}  # fmt: skip
_TIMEOUTS = {"start_timeout": "start", "stall_timeout": "stall", "idle_timeout": "idle",
             "sigterm_timeout": "sigterm"}  # fmt: skip


def _warn(old: str, new: str, what: str) -> None:
    warnings.warn(
        f"{what}: {old} is deprecated and will be removed in lowdiff 0.3; use {new}",
        DeprecationWarning,
        stacklevel=4,
    )


def translate(
    what: str, known: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of a 0.1 call (``args`` after ``self``) in today's spelling.

    Raises:
        ArgumentTypeError: an option that neither exists nor existed, naming the nearest one.
    """
    kw = dict(kwargs)
    old_order = bool(args) and isinstance(args[0], torch.nn.Module)
    if old_order:
        _warn(f"{what}(model, optimizer, directory)", f"{what}(directory, model, optimizer)", what)
        args = (args[2], args[0], args[1], *args[3:]) if len(args) >= 3 else args
        if len(args) < 3 and "directory" in kw:
            args = (kw.pop("directory"), *args)
    if "strategy" in kw:
        _warn("strategy=", "method=", what)
        kw.setdefault("method", kw.pop("strategy"))
    method = kw.get("method")
    if method in RENAMED:
        _warn(f"method={method!r}", f"method={RENAMED[method]!r}", what)
        method = kw["method"] = RENAMED[method]
    if (
        old_order
        and kw.get("compressor") is None
        and method in (None, "lowdiff", "compression-only")
    ):
        # 0.1's default: LowDiff with top-k 1% (the call is in the old order: it keeps it)
        from lowdiff.compressors import TopK  # noqa: PLC0415

        kw["method"] = method or "lowdiff"
        kw["compressor"] = TopK(ratio=0.01)
    kw, rewritten = regroup(kw, method, known, what)
    for old, new in rewritten:
        _warn(old, new, what)
    if method is not None and method != "auto" and method not in BUILTIN:
        return args, kw  # a registered method checks its own options
    unknown = sorted(set(kw) - set(known))
    if unknown:
        where = f"{what}(method={method!r})" if method else f"{what}()"
        raise ArgumentTypeError(
            f"{where} takes no option {unknown[0]!r}{did_you_mean(unknown[0], known)} "
            f"(its options: {', '.join(known)})"
        )
    return args, kw


def regroup(
    flat: dict[str, Any], method: str | None, known: tuple[str, ...], what: str = "Checkpointer"
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """0.1's flat options in today's spelling, and the (old, new) spellings it rewrote;
    it warns about nothing (the lab's job configurations name options flat, as JSON does).

    For lowdiff's own methods: ``batch_size`` is ``records_per_file``, and the replica's,
    the timeouts' and the remote tier's options go into their groups. For a registered
    method, every option ``Checkpointer`` does not take goes into ``method_options``.
    """
    kw, said = dict(flat), []
    if method is not None and method != "auto" and method not in BUILTIN:
        own = {k: kw.pop(k) for k in list(kw) if k not in known}
        if own:
            said.append((", ".join(f"{k}=" for k in own), "method_options={...}"))
            kw["method_options"] = {**own, **(kw.get("method_options") or {})}
        return kw, said
    if "batch_size" in kw:
        said.append(("batch_size=", "records_per_file="))
        kw.setdefault("records_per_file", kw.pop("batch_size"))
    for names, target, cls in (
        (_REPLICA, "replica", ReplicaOptions),
        (_TIMEOUTS, "timeouts", Timeouts),
    ):
        given = {k: kw.pop(k) for k in names if k in kw}
        if given:
            said.append(
                (", ".join(f"{k}=" for k in given), f"{target}=lowdiff.{cls.__name__}(...)")
            )
            base = {} if kw.get(target) is None else dataclasses.asdict(kw[target])
            kw[target] = cls(**{**base, **{names[k]: v for k, v in given.items()}})
    remote = {k: kw.pop(k) for k in _REMOTE if k in kw}
    if remote:
        said.append((", ".join(f"{k}=" for k in remote), "remote=RemoteOptions(...)"))
        if not isinstance(kw.get("remote"), str):
            raise ArgumentTypeError(f"{what}: {next(iter(remote))} is given without remote=")
        kw["remote"] = RemoteOptions(kw["remote"], **{_REMOTE[k]: v for k, v in remote.items()})
    return kw, said


RENAMED_OPTIONS: dict[str, str] = {
    "strategy": "method", "batch_size": "records_per_file",
    **{k: f"replica=lowdiff.ReplicaOptions({v}=...)" for k, v in _REPLICA.items()},
    **{k: f"timeouts=lowdiff.Timeouts({v}=...)" for k, v in _TIMEOUTS.items()},
    **{k: f"remote=lowdiff.RemoteOptions(url, {v}=...)" for k, v in _REMOTE.items()},
}  # fmt: skip
"""Each option of 0.1 and how it is spelled now (for the hint of an unknown option)."""


def did_you_mean(name: str, known: list[str] | tuple[str, ...], *, renamed: bool = True) -> str:
    """``"; did you mean 'x'?"`` for the option nearest ``name`` (with ``renamed``, an
    option of 0.1 is matched too and named as it is spelled now), or ``""``."""
    near = difflib.get_close_matches(name, [*known, *(RENAMED_OPTIONS if renamed else ())], n=1)
    if not near:
        return ""
    return f"; did you mean {RENAMED_OPTIONS.get(near[0], near[0])!r}?"


def accepts_old_spellings(
    what: str, known: tuple[str, ...]
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate ``__init__`` (or a function) so that the spellings of lowdiff 0.1 still
    work (see the module docstring). ``inspect.signature`` and type checkers see the
    decorated function's own parameters."""

    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        method = fn.__name__ == "__init__"

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            head, rest = (args[:1], args[1:]) if method else ((), args)
            rest, kwargs = translate(what, known, rest, kwargs)
            return fn(*head, *rest, **kwargs)

        return call

    return wrap

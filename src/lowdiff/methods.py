"""The registry of checkpointing methods, directory kinds and CLI commands.

lowdiff's own methods (``"lowdiff"``, ``"lowdiff+"``, ``"compression-only"``) are built
in. Anything else registers itself through :func:`register_method`: a third party's
method, and the baselines of ``lowdiff_lab`` (torch.save, CheckFreq, Gemini, naive DC,
DCP async). A method is a :class:`lowdiff.strategy.Strategy` subclass, built as
``cls(model, optimizer, directory, **options)``.

Plugins are found through the ``lowdiff.plugins`` entry-point group: each entry point
names a callable that registers what it brings (methods, directory kinds, commands).
They are loaded the first time a name is not found, so ``import lowdiff`` loads none.

Example:
    >>> import lowdiff  # doctest: +SKIP
    >>> lowdiff.register_method("my-method", MyStrategy)  # doctest: +SKIP
    >>> ck = lowdiff.Checkpointer("ckpt", model, opt, method="my-method")  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lowdiff.errors import InvalidArgumentError

if TYPE_CHECKING:
    import argparse

PLUGIN_GROUP = "lowdiff.plugins"
"""The entry-point group whose callables register methods, directory kinds and commands."""

BUILTIN: dict[str, str] = {
    "lowdiff": "lowdiff.engine.trainer.strategy:LowDiffStrategy",
    "lowdiff+": "lowdiff.engine.trainer.strategy:LowDiffPlusStrategy",
    "compression-only": "lowdiff.engine.trainer.strategy:CompressionOnlyStrategy",
}
"""lowdiff's own methods: name -> ``module:class`` (imported on first use)."""

RENAMED: dict[str, str] = {"none": "compression-only"}
"""Old method names that still work for one release (with a ``DeprecationWarning``)."""


@dataclasses.dataclass(frozen=True)
class DirectoryKind:
    """A kind of checkpoint directory that ``inspect`` and ``verify`` read (a registered
    method's own layout).

    Attributes:
        name: what the kind is called in messages.
        matches: whether a directory is of this kind (reads, never writes).
        verify: checks every file; (items checked, [(path, reason) of each bad one]).
        checkpoints: ``(step, path)`` of every published checkpoint, oldest first.
    """

    name: str
    matches: Callable[[Path], bool]
    verify: Callable[[Path], tuple[int, list[tuple[Path, str]]]]
    checkpoints: Callable[[Path], list[tuple[int, Path]]]


_METHODS: dict[str, Any] = {}
"""Registered method name -> Strategy class (or ``module:class`` text)."""
_MODULES: dict[str, str] = {}
"""Registered method name -> the module to import ahead (process servers)."""
_KINDS: list[DirectoryKind] = []
_COMMANDS: dict[str, Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]] = {}
_loaded = False
_lock = threading.Lock()


def register_method(name: str, strategy: Any) -> None:
    """Make ``method=name`` build ``strategy`` (a :class:`lowdiff.strategy.Strategy`
    subclass, or its ``"module:Class"`` path, imported on first use).

    Raises:
        InvalidArgumentError: ``name`` is one of lowdiff's own methods, or already registered to
            another class.
    """
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"a method name must be a non-empty str, got {name!r}")
    if name in BUILTIN or name in RENAMED:
        raise InvalidArgumentError(f"method {name!r} is one of lowdiff's own; pick another name")
    old = _METHODS.get(name)
    if old is not None and old != strategy:
        raise InvalidArgumentError(f"method {name!r} is already registered ({old!r})")
    _METHODS[name] = strategy
    module = strategy if isinstance(strategy, str) else strategy.__module__
    _MODULES[name] = module.partition(":")[0]


def register_directory_kind(kind: DirectoryKind) -> None:
    """Let ``inspect`` and ``verify`` read a registered method's directories."""
    if all(k.name != kind.name for k in _KINDS):
        _KINDS.append(kind)


def register_command(name: str, add_parser: Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]) -> None:
    """Add a ``lowdiff NAME`` command: ``add_parser(subparsers)`` adds its parser, whose
    ``func`` default runs it."""
    _COMMANDS[name] = add_parser


def load_plugins() -> None:
    """Run every ``lowdiff.plugins`` entry point once (each registers what it brings).

    A plugin that fails to load is skipped: its methods and commands stay unknown, and
    asking for one says so.
    """
    global _loaded
    with _lock:
        if _loaded:
            return
        _loaded = True
        for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP):
            try:
                ep.load()()
            except Exception:  # noqa: BLE001 -- an optional plugin's import failed
                continue


def method_names() -> tuple[str, ...]:
    """Every method ``Checkpointer`` can build: lowdiff's own, then the registered ones."""
    load_plugins()
    return (*BUILTIN, *sorted(_METHODS))


def is_builtin(name: str) -> bool:
    return name in BUILTIN


def method_class(name: str) -> type:
    """The Strategy class of method ``name``.

    Raises:
        InvalidArgumentError: no such method (the message lists the known ones).
    """
    from lowdiff.strategy import Strategy  # noqa: PLC0415 -- torch, on first use

    target = BUILTIN.get(name)
    if target is None:
        if name not in _METHODS:
            load_plugins()
        target = _METHODS.get(name)
    if target is None:
        raise InvalidArgumentError(
            f"method must be one of {', '.join(map(repr, ('auto', *method_names())))}, got {name!r}"
            + ("" if _METHODS else " (the baselines come with lowdiff_lab: pip install 'lowdiff[lab]')")
        )
    if isinstance(target, str):
        module, _, cls_name = target.partition(":")
        target = getattr(importlib.import_module(module), cls_name)
    if not (isinstance(target, type) and issubclass(target, Strategy)):
        raise InvalidArgumentError(f"method {name!r} is not a lowdiff.strategy.Strategy: {target!r}")
    return target


def method_modules() -> tuple[str, ...]:
    """The modules of every method (imported on first use), for a process server that
    imports ahead what a training job will."""
    load_plugins()
    own = (v.partition(":")[0] for v in BUILTIN.values())
    return tuple(dict.fromkeys([*own, *_MODULES.values()]))


def directory_kind(root: Path) -> DirectoryKind | None:
    """The registered kind ``root`` is of, or None (a lowdiff directory, or nothing known).

    The plugins are loaded only for a directory whose manifest names another format than
    lowdiff's own: reading lowdiff's directories imports no plugin."""
    found = next((k for k in _KINDS if k.matches(root)), None)
    if found is None and not _loaded and _other_format(root):
        load_plugins()
        found = next((k for k in _KINDS if k.matches(root)), None)
    return found


def _other_format(root: Path) -> bool:
    """Whether ``root`` holds a manifest (read, not verified) of a format not lowdiff's."""
    import json  # noqa: PLC0415

    from lowdiff.errors import LowDiffError  # noqa: PLC0415
    from lowdiff.format.layout import MANIFEST  # noqa: PLC0415
    from lowdiff.format.sfile import FORMAT_NAME, open_regular  # noqa: PLC0415

    try:  # a regular file only: a named pipe in its place must not block the reader
        with open_regular(root / MANIFEST) as f:
            body = json.loads(f.read(1 << 20)).get("lowdiff_manifest", {})
    except (OSError, ValueError, AttributeError, LowDiffError):
        return False
    return isinstance(body, dict) and body.get("format") not in (None, FORMAT_NAME)


def commands() -> dict[str, Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]]:
    """The registered CLI commands."""
    load_plugins()
    return dict(_COMMANDS)

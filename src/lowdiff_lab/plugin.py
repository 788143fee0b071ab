"""What the lab registers with the library (the ``lowdiff.plugins`` entry point): the
baselines as methods, their directories for ``inspect`` and ``verify``, and the
``demo``, ``bench``, ``chaos`` and ``torture`` commands."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from lowdiff import methods
from lowdiff_lab.baselines import BASELINES


def _command(module: str) -> Callable[[argparse._SubParsersAction], None]:
    """A command's ``add_parser``, its module imported only when the CLI is built."""

    def add_parser(sub: argparse._SubParsersAction) -> None:
        import importlib  # noqa: PLC0415

        importlib.import_module(f"lowdiff_lab.cli.{module}").add_parser(sub)

    return add_parser


def register() -> None:
    """Register the baselines, their directory kind and the lab's commands."""
    from lowdiff_lab.baselines.base import (  # noqa: PLC0415
        checkpoint_files,
        is_baseline_dir,
        verify_baseline_dir,
    )

    for name, target in BASELINES.items():
        methods.register_method(name, target)
    methods.register_directory_kind(
        methods.DirectoryKind("baseline", is_baseline_dir, verify_baseline_dir, checkpoint_files)
    )
    for name in ("demo", "bench", "chaos", "torture"):
        methods.register_command(name, _command(name))

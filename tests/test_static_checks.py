"""Lint and type checks run with the test suite, so CI enforces them."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = [
    f"src/lowdiff/{m}"
    for m in (
        "__init__.py", "checkpointer.py", "attach.py", "options.py", "errors.py", "methods.py",
        "strategy.py", "legacy.py", "inspection.py", "exporting.py", "compressors",
        "integrations", "recovery/restore.py",
    )
]  # fmt: skip
"""The modules that hold the library's public names (``lowdiff.__all__``, the
compressors and the framework integrations)."""


@pytest.mark.parametrize(
    "tool,args",
    [
        ("ruff", ["check", "src", "tests"]),
        ("mypy", []),
        # the library's public modules, strict: what users import type-checks as written
        ("mypy", ["--strict", "--follow-imports=silent", *PUBLIC]),
    ],
)
def test_static_check(tool, args):
    if importlib.util.find_spec(tool) is None:
        pytest.skip(f"{tool} is not installed (pip install -e '.[dev]')")
    r = subprocess.run(
        [sys.executable, "-m", tool, *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, f"{tool} failed:\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"

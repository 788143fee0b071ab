"""Lint and type checks run with the test suite, so CI enforces them."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "tool,args",
    [
        ("ruff", ["check", "src", "tests"]),
        # the library's public modules are checked with --strict's flags (pyproject.toml's
        # [[tool.mypy.overrides]]), in the same run
        ("mypy", []),
    ],
)
def test_static_check(tool, args):
    if importlib.util.find_spec(tool) is None:
        pytest.skip(f"{tool} is not installed (pip install -e '.[dev]')")
    r = subprocess.run(
        [sys.executable, "-m", tool, *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, f"{tool} failed:\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"

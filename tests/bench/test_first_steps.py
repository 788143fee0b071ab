"""benchmarks/first_steps.py runs end to end: a crash, a restart from memory, two steps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "first_steps.py"

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_every_restart_recovers_from_memory_and_is_split():
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--workload", "gpt2-s-tiny", "--repeats", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    rows = json.loads(p.stdout)
    assert sorted(r["method"] for r in rows) == ["Gemini (S)", "LowDiff+ (S)"]
    for r in rows:
        assert r["source"] == "memory"  # the trainer was SIGKILLed, its survivor served
        assert 0 < r["copy_s"] < r["resume_s"]
        assert r["first_step_s"] > 0 and r["second_step_s"] > 0

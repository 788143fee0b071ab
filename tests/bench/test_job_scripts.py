"""benchmarks/fork_state.py and benchmarks/job_phases.py run end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _run(script: str, *args: str) -> object:
    p = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args, "--json"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, madvise")
def test_fork_state_shows_the_server_without_the_training_state():
    # 2 layers of 2048x2048 with AdamW: about 130 MB of parameters, gradients and state
    rows = _run("fork_state.py", "--strategies", "lowdiff", "--layers", "2", "--repeats", "1",
                "--steps", "3")  # fmt: skip
    by_mode = {r["training_state"]: r for r in rows}  # type: ignore[union-attr]
    assert set(by_mode) == {"share", "leave-out"}
    shared, left_out = by_mode["share"], by_mode["leave-out"]
    # shared, the server holds what the trainer held when it was forked; left out, not the
    # parameters (32 MB) and the optimizer state (64 MB)
    assert shared["server_mb"] > shared["trainer_mb"] - 16
    assert left_out["server_mb"] < left_out["trainer_mb"] - 64
    for r in rows:  # type: ignore[union-attr]
        assert r["first_step_ms"] > 0 and r["close_ms"] > 0


def test_job_phases_splits_a_fresh_and_a_restarted_job():
    out = _run("job_phases.py", "--methods", "lowdiff", "--repeats", "1", "--kill-at", "12")
    assert isinstance(out, dict)
    assert set(out["fresh"]) == {"none", "lowdiff"}
    fresh = out["fresh"]["lowdiff"][0]
    assert fresh["start"] == 0 and fresh["steps"] > fresh["in_step"] > 0
    restarted = out["restarted"]["lowdiff"][0]
    # every step the killed trainer took was recovered, by replay from disk
    assert restarted["start"] == 12 and restarted["restore"] > 0

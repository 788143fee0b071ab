"""examples/ddp_train.py as the README runs it: 2 ranks, one killed, torchrun restarts the job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

EXAMPLE = Path(__file__).parents[2] / "examples" / "ddp_train.py"


@pytest.mark.parametrize("strategy", ["lowdiff"])  # lowdiff+ memory recovery: test_ddp_plus.py
def test_example_recovers_after_one_rank_is_killed(torchrun, tmp_path, strategy):
    report = tmp_path / "report.json"
    p = torchrun(
        "--dir",
        str(tmp_path / "ck"),
        "--strategy",
        strategy,
        "--steps",
        "30",
        "--width",
        "64",
        "--depth",
        "2",
        "--full-every",
        "10",
        "--kill-rank",
        "1",
        "--kill-at",
        "22",
        "--report",
        str(report),
        restarts=1,
        script=EXAMPLE,
        agent="exec",  # the README's torchrun command
    )
    assert "[rank 1] SIGKILL at step 22" in p.stdout
    source = "memory" if strategy == "lowdiff+" else "disk"
    assert "resumed 2 ranks at step" in p.stdout and f"from {source}" in p.stdout
    ranks = json.loads(report.read_text())
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world_size"] == 2 for r in ranks)

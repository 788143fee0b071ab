"""``lowdiff bench fsdp2``: the 2-rank FSDP2 job runs under torchrun and its table becomes
rows and a report section."""

from __future__ import annotations

import json

import pytest

from lowdiff.bench import BenchSettings, run_bench
from lowdiff.bench.context import QUICK_PROFILE

pytest.importorskip("torch.distributed.fsdp", reason="no torch.distributed.fsdp")
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_fsdp2_experiment_reports_every_arm(tmp_path) -> None:
    out = tmp_path / "out"
    s = BenchSettings("gpt2-tiny", workdir=tmp_path / "work")
    files = run_bench(["fsdp2"], out=out, settings=s, profile=QUICK_PROFILE)
    lines = [json.loads(x) for x in files["results"].read_text().splitlines()]
    rows = [r for r in lines if r.get("kind") == "row"]
    assert [r["arm"] for r in rows] == ["none", "lowdiff+", "dcp-async"]
    for r in rows:
        assert r["experiment"] == "fsdp2" and r["world_size"] == 2
        assert r["steps"] == QUICK_PROFILE.fsdp2_steps and r["per_step_s"] > 0
    assert rows[0]["vs_none"] == 1.0
    report = (out / "report.md").read_text()
    assert "## FSDP2: LowDiff+ every step against DCP async_save every step" in report
    assert "LowDiff+ every step takes" in report
    # the scratch directory of the job is removed
    assert not list((tmp_path / "work").glob("lowdiff-bench-fsdp2-*"))

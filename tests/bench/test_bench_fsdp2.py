"""``lowdiff bench fsdp2``: the 2-rank FSDP2 job runs under torchrun and its table becomes
rows and a report section, with DCP at every step and at its Young–Daly interval."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lowdiff_lab.bench import BenchSettings, run_bench
from lowdiff_lab.bench.context import QUICK_PROFILE, Profile

pytest.importorskip("torch.distributed.fsdp", reason="no torch.distributed.fsdp")
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_fsdp2_experiment_reports_every_arm(tmp_path) -> None:
    out = tmp_path / "out"
    s = BenchSettings("gpt2-tiny", workdir=tmp_path / "work")
    # a short MTBF puts k inside the 8 steps at this machine's costs (any k is checked)
    profile = dataclasses.replace(QUICK_PROFILE, fsdp2_mtbf_s=0.05)
    files = run_bench(["fsdp2"], out=out, settings=s, profile=profile)
    lines = [json.loads(x) for x in files["results"].read_text().splitlines()]
    rows = [r for r in lines if r.get("kind") == "row"]
    assert [r["arm"] for r in rows] == ["none", "lowdiff+", "dcp-async", "dcp-young-daly"]
    for r in rows:
        assert r["experiment"] == "fsdp2" and r["world_size"] == 2
        assert r["steps"] == QUICK_PROFILE.fsdp2_steps and r["per_step_s"] > 0
    assert rows[0]["vs_none"] == 1.0
    every, yd = rows[2], rows[3]
    assert every["interval"] == 1 and every["saves"] == QUICK_PROFILE.fsdp2_steps
    k, n = yd["interval"], QUICK_PROFILE.fsdp2_steps
    assert k >= 1 and yd["mtbf_s"] == 0.05 and yd["save_cost_s"] >= 0
    # every k-th step, and the last one when k does not divide the steps
    assert yd["saves"] == n // k + (n % k != 0)
    report = (out / "report.md").read_text()
    assert "## FSDP2: LowDiff+ every step against DCP async_save every step and at its" in report
    assert f"Young–Daly interval k = max(1, round(sqrt(2 C M) / t)) = {k} steps" in report
    assert "LowDiff+ every step takes" in report and "at its Young–Daly interval." in report
    # the scratch directory of the job is removed
    assert not list((tmp_path / "work").glob("lowdiff-bench-fsdp2-*"))


def test_profile_refuses_a_bad_mtbf() -> None:
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="fsdp2_mtbf_s"):
            Profile(fsdp2_mtbf_s=bad)

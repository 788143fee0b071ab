"""``lowdiff bench hotpaths``: every hot-path target beside its measurement (no timing is
asserted: only that each figure is the ratio of the measurements it names)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from lowdiff.strategy import PIPELINE_STAGES
from lowdiff_lab.bench import DEFAULT_EXPERIMENTS, EXPERIMENTS, run_bench
from lowdiff_lab.bench.core import BenchSettings
from lowdiff_lab.bench.experiments import Profile
from lowdiff_lab.bench.hotpaths import END_TO_END_TARGET, TRAINER_TARGET, lowdiff_step_bench


def test_hotpaths_runs_only_when_named():
    assert "hotpaths" in EXPERIMENTS and "hotpaths" not in DEFAULT_EXPERIMENTS


def test_lowdiff_step_bench_rows(tmp_path: Path) -> None:
    lines: list[str] = []
    rows = lowdiff_step_bench(
        workload="gpt2-tiny", steps=3, repeats=2, warmup=1, workdir=tmp_path, progress=lines.append
    )
    assert len(lines) == 4  # two blocks per arm
    summary = {r["name"]: r for r in rows if r["table"] == "summary"}
    e2e, tr = summary["end_to_end_overhead"], summary["trainer_overhead"]
    # the median of the back-to-back pairs' ratios; the ratio of the medians beside it
    pairs = [a / b - 1 for a, b in zip(e2e["blocks_lowdiff_s"], e2e["blocks_none_s"], strict=True)]
    assert e2e["paired_overheads"] == pairs
    assert e2e["value"] == statistics.median(pairs)
    assert e2e["ratio_of_medians"] == e2e["lowdiff_s_per_step"] / e2e["none_s_per_step"] - 1
    assert e2e["target"] == END_TO_END_TARGET and e2e["met"] == (e2e["value"] <= 0.03)
    assert len(e2e["blocks_lowdiff_s"]) == len(e2e["blocks_none_s"]) == 2
    assert tr["value"] == tr["trainer_s_per_step"] / tr["none_s_per_step"]
    assert tr["target"] == TRAINER_TARGET and tr["trainer_s_per_step"] > 0
    stages = {r["stage"]: r for r in rows if r["table"] == "stage"}
    assert set(stages) == set(PIPELINE_STAGES) - {"steps"}
    # compressed training compresses in both arms; only LowDiff hands records over
    assert (
        stages["compress"]["none_s_per_step"] > 0 and stages["compress"]["lowdiff_s_per_step"] > 0
    )
    assert stages["after_update"]["lowdiff_s_per_step"] > stages["after_update"]["none_s_per_step"]
    parts = {r["part"] for r in rows if r["table"] == "part"}
    assert {"record_send_s", "full_copy_s"} <= parts
    assert not list(tmp_path.iterdir())  # the checkpoint directories are removed
    with pytest.raises(ValueError, match="steps"):
        lowdiff_step_bench(workload="gpt2-tiny", steps=0)


@pytest.mark.timeout(600)
def test_hotpaths_experiment_reports_every_target(tmp_path: Path) -> None:
    out = tmp_path / "results"
    s = BenchSettings("gpt2-tiny", iters=2, repeats=1, workdir=tmp_path / "work")
    p = Profile(
        replica_params=20_000,
        replica_threads=[1],
        hot_e2e_workload="gpt2-tiny",
        hot_trainer_workload="gpt2-tiny",
        hot_steps=2,
    )
    run_bench(["hotpaths", "breakdown"], out=out, settings=s, profile=p, methods=["lowdiff"])
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    rows = lines[1:]
    targets = [r for r in rows if r["experiment"] == "hotpaths" and r["table"] == "target"]
    assert {r["target_id"] for r in targets} == {1, 2, 3, 4, 5}
    for r in targets:
        if r["target"] is not None:
            ok = r["value"] <= r["target"] if r["compare"] == "<=" else r["value"] >= r["target"]
            if r["target_id"] in (2, 3):
                assert r["met"] == ok, r
            else:  # the replica and snapshot targets also need identical bits
                assert (not r["met"]) or ok, r
    wire = next(r for r in targets if r["target_id"] == 5)
    assert 0 < wire["value"] < 1 and "uint" in wire["detail"]
    # the trainer-side tables appear in breakdown too, from the same measurement
    trainer = [r for r in rows if r["experiment"] == "breakdown" and r["table"] == "trainer-stage"]
    assert {r["stage"] for r in trainer} == set(PIPELINE_STAGES) - {"steps"}
    report = (out / "report.md").read_text()
    assert "## Hot paths: each target beside its measurement" in report
    assert "LowDiff's own work on the training process" in report

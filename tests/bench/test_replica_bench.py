"""``lowdiff bench replica``: the LowDiff+ replica update against a bare torch.optim step."""

from __future__ import annotations

import json
import math
from pathlib import Path

from lowdiff_lab.bench import DEFAULT_EXPERIMENTS, EXPERIMENTS, run_bench
from lowdiff_lab.bench.core import BenchSettings
from lowdiff_lab.bench.experiments import Profile
from lowdiff_lab.bench.replica import bench_shapes, format_rows


def test_replica_is_an_experiment_run_by_default():
    assert "replica" in EXPERIMENTS and "replica" in DEFAULT_EXPERIMENTS


def test_bench_shapes_are_about_the_asked_size():
    # 32 blocks of a 512-wide linear layer and a layer norm: the 8.4M parameters
    assert sum(math.prod(s) for s in bench_shapes(8_437_760)) == 8_437_760
    assert 10_000 < sum(math.prod(s) for s in bench_shapes(20_000)) < 40_000


def test_replica_experiment_reports_ratio_target_and_bits(tmp_path: Path) -> None:
    out = tmp_path / "results"
    s = BenchSettings("gpt2-s-tiny", iters=2, repeats=1, workdir=tmp_path / "work")
    p = Profile(replica_params=20_000, replica_threads=[1, 3])
    run_bench(["replica"], out=out, settings=s, profile=p)
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    rows = [r for r in lines[1:] if r.get("experiment") == "replica"]
    # the default kernels (fused and foreach AdamW), each at every thread count
    assert [(r["flags"], r["threads"]) for r in rows] == [
        ({"fused": True}, 1),
        ({"fused": True}, 3),
        ({"foreach": True}, 1),
        ({"foreach": True}, 3),
    ]
    for r in rows:
        assert r["identical"] is True
        assert r["target"] == 1.2
        assert r["ratio"] == r["replica_s"] / r["bare_s"]
        assert r["meets_target"] == (r["ratio"] <= 1.2)
        assert len(r["replica_block_s"]) == len(r["bare_block_s"]) == 3
    report = (out / "report.md").read_text()
    assert "## LowDiff+ replica update" in report
    assert format_rows(rows).splitlines()[0] in report
    # the settings' workload is not what this experiment trains: the header says so
    assert lines[0]["n_params"] is None
    assert "gpt2-s-tiny" not in report.split("\n## ")[0]
    assert "each measurement names its own" in report

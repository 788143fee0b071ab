"""The LowDiff+ snapshot copy bandwidth bench (``lowdiff_lab.bench.snapshot_bw``); no timings asserted."""

from __future__ import annotations

import json

import pytest

from lowdiff_lab.bench.snapshot_bw import (
    DEFINITION,
    SNAPSHOT_TARGET,
    format_rows,
    snapshot_bandwidth_bench,
)


def test_bench_returns_one_flat_row_with_ratio_and_target():
    said: list[str] = []
    rows = snapshot_bandwidth_bench(workload="gpt2-tiny", repeats=1, steps=2, progress=said.append)
    assert said
    assert len(rows) == 1
    r = rows[0]
    json.dumps(r)  # JSON-able as it is
    for key in ("memcpy_gbps", "memcpy_split_gbps", "memcpy_one_thread_gbps", "snapshot_gbps"):
        assert r[key] > 0, key
    assert r["snapshot_over_memcpy"] == r["snapshot_gbps"] / r["memcpy_gbps"] > 0
    assert r["target"] == SNAPSHOT_TARGET == 0.70
    assert r["met"] == (r["snapshot_over_memcpy"] >= 0.70)
    assert r["definition"] == DEFINITION
    assert r["identical"] is True
    assert r["workload"] == "gpt2-tiny"
    assert r["grad_bytes"] > 0 and r["tensors"] > 0 and r["blocks"] > 0
    # every gradient byte of a step went through the copy thread during backward
    assert r["copy_bytes_per_step"] == r["grad_bytes"]
    assert len(r["snapshot_gbps_per_step"]) == 2
    table = format_rows(rows)
    assert "gpt2-tiny" in table and "| snapshot / memcpy |" in table


def test_bench_rejects_empty_runs():
    with pytest.raises(ValueError, match="repeats"):
        snapshot_bandwidth_bench(workload="gpt2-tiny", repeats=0)
    with pytest.raises(ValueError, match="steps"):
        snapshot_bandwidth_bench(workload="gpt2-tiny", steps=0)

"""benchmarks/gpu_reference.py runs end to end (a tiny model on the CPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_reference.py"

pytestmark = pytest.mark.multiprocess


def test_reference_script_measures_every_arm(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "res.json"
    res = mod.main(
        [
            "--tiny",
            "--device",
            "cpu",
            "--repeats",
            "2",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--workdir",
            str(tmp_path),
            "--json",
            str(out),
        ]
    )
    assert set(res["ms_per_step"]) == {"plain", "topk", "lowdiff", "lowdiff+"}
    assert all(len(v) == 2 and min(v) > 0 for v in res["per_repeat_ms"].values())
    assert res["record_bytes_per_step"] > 0 and out.exists()
    assert res["lowdiff_vs_topk"] == res["ms_per_step"]["lowdiff"] / res["ms_per_step"]["topk"] - 1

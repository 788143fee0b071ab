"""benchmarks/gpu_summary.py on small result files shaped like those of gpu_check.sh's
phases: the table's figures, its targets, and "not run" for the phases that left nothing."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_summary.py"
P117M, P1B = 117_811_200, 1_041_248_256


@pytest.fixture(scope="module")
def gs() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_summary", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up
    spec.loader.exec_module(mod)
    return mod


def reference(
    model: str, params: int, ms: dict[str, float], *, complete: bool = True, threads: int = 14
) -> dict[str, Any]:
    """A result of ``gpu_reference.py --json`` (the keys its ``result()`` writes)."""
    steps = {"plain": 40, "topk": 40, "lowdiff": 40, "lowdiff+": 20, "dcp": 8}
    out: dict[str, Any] = {
        "machine": "gpu-host",
        "device": "NVIDIA H200",
        "torch": "2.11.0+cu130",
        "lowdiff": "0.2.0",
        "cpus": 16,
        "git": "abc1234",
        "parameters": params,
        "settings": {
            "device": "cuda",
            "tiny": False,
            "model": model,
            "arms": list(ms),
            "steps": 40,
            "replica_threads": threads,
        },
        "steps_per_block": {a: steps[a] for a in ms},
        "repeats_done": 3 if complete else 1,
        "complete": complete,
        "ms_per_step": ms,
        "per_repeat_ms": {a: [v] * (3 if complete else 1) for a, v in ms.items()},
        "restore_check": {},
        "slots_pinned": {},
        "parts_ms_per_step": {a: {"block_flush_s": 0.5} for a in ms if a != "plain"},
        "gpu_peak_bytes": 0,
        "gpu_total_bytes": 0,
    }
    for key, arm, base in (
        ("lowdiff_vs_topk", "lowdiff", "topk"),
        ("lowdiff_plus_vs_plain", "lowdiff+", "plain"),
        ("dcp_vs_plain", "dcp", "plain"),
    ):
        if arm in ms and base in ms:
            out[key] = ms[arm] / ms[base] - 1
    return out


def replica_row(threads: int, replica_ms: float, bare_ms: float) -> dict[str, Any]:
    """A row of ``replica_update_bench``."""
    return {
        "optimizer": "torch.optim.AdamW",
        "flags": {"fused": True},
        "threads": threads,
        "n_params": P117M,
        "replica_s": replica_ms / 1e3,
        "bare_s": bare_ms / 1e3,
        "ratio": replica_ms / bare_ms,
        "target": 1.2,
        "meets_target": replica_ms / bare_ms <= 1.2,
        "identical": True,
        "replica_block_s": [replica_ms / 1e3] * 5,
        "bare_block_s": [bare_ms / 1e3] * 5,
        "steps_per_block": 3,
        "cpus": 16,
        "shapes": "gpt2-117m",
        "clip": True,
        "stage_s": {"bind": 0.001, "optimizer": replica_ms / 1e3, "hand_back": 0.0},
        "copy_in_s": 0.01,
    }


FAILED = "tests/process/test_sigkill_recovery.py::test_cuda_sigkill_then_resume_is_bit_identical"
TESTS_LOG = f"""\
tests/process/test_cuda_handoff.py::test_cuda_records_replay_exactly PASSED [  5%]
{FAILED} FAILED [ 10%]
=========================== short test summary info ============================
FAILED {FAILED} - AssertionError
SKIPPED [1] tests/workloads/test_zoo.py:201: needs CUDA
=========== 18 passed, 1 failed, 2 skipped, 300 deselected in 52.31s ===========
"""


def write(d: Path, name: str, data: Any) -> None:
    (d / name).write_text(json.dumps(data) if not isinstance(data, str) else data)


def table(text: str) -> dict[str, list[str]]:
    """The table's rows by their first cell: the other cells."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| check"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


@pytest.fixture
def full(tmp_path: Path) -> Path:
    """Every phase's file, as a whole run leaves them."""
    write(
        tmp_path,
        "env.json",
        {
            "kind": "gpu-env",
            "gpu": "NVIDIA H200",
            "gpu_memory_bytes": 150_000_000_000,
            "torch": "2.11.0+cu130",
            "cuda": "13.0",
            "lowdiff": "0.2.0",
            "cpus": 16,
            "git": "abc1234",
            "copy_gbps": {"pageable": 10.0, "torch_pinned": 50.0, "shared_registered": 49.5},
        },
    )
    ms = {"plain": 30.0, "topk": 40.0, "lowdiff": 41.0, "lowdiff+": 60.0, "dcp": 300.0}
    write(tmp_path, "ref117m.json", reference("gpt2-117m", P117M, ms))
    ms1b = {"plain": 400.0, "topk": 450.0, "lowdiff": 495.0, "lowdiff+": 3000.0}
    write(tmp_path, "ref1b.json", reference("gpt2-1b", P1B, ms1b))
    write(tmp_path, "ref1b-dcp.json", reference("gpt2-1b", P1B, {"plain": 410.0, "dcp": 9000.0}))
    rows = [replica_row(14, 15.0, 12.0), replica_row(1, 200.0, 100.0)]
    write(tmp_path, "replica.json", {"kind": "replica", "cpus": 16, "rows": rows})
    write(tmp_path, "tests.log", TESTS_LOG)
    recovery = [
        {"kind": "run", "settings": {}},
        {"kind": "row", "experiment": "recovery", "method": "torch.save", "full_every": 5,
         "first_new_step_s": 2.0, "restarts": 1},
        {"kind": "row", "experiment": "recovery", "method": "LowDiff+ (S)", "full_every": 5,
         "first_new_step_s": 0.5, "restarts": 1},
    ]  # fmt: skip
    write(tmp_path, "recovery.jsonl", "\n".join(json.dumps(r) for r in recovery) + "\n")
    return tmp_path


def test_every_phase(gs: Any, full: Path) -> None:
    text = gs.summary(gs.load(full))
    assert text.count("| check |") == 1  # one table
    head = text.splitlines()[2]
    parts = ("NVIDIA H200", "torch 2.11.0+cu130", "16 host cores", "lowdiff 0.2.0", "49.5 GB/s")
    assert all(part in head for part in parts), head
    rows = table(text)
    # measured, blocks, baseline, overhead, target, met
    assert rows["117.8M plain"][:2] == ["30.00 ms", "40 steps × 3"]
    assert rows["117.8M LowDiff"] == [
        "41.00 ms (0.50 ms in flush)", "40 steps × 3", "TopK 40.00 ms", "+2.5%", "≤ +5%", "yes"
    ]  # fmt: skip
    # bare fused AdamW at the arm's 14 threads: 12 ms, at most half of 30 ms: the target applies
    plus = rows["117.8M LowDiff+"]
    assert plus[2:4] == ["plain 30.00 ms", "+100.0%"]
    assert "applies: bare 12.00 ms ≤ 15.00 ms" in plus[4] and plus[5] == "**no**"
    assert rows["117.8M DCP async_save"][2:4] == ["plain 30.00 ms", "+900.0%"]
    assert rows["117.8M LowDiff cheaper than DCP"][0] == "adds 1.00 ms a step; DCP adds 270.0 ms"
    assert rows["117.8M LowDiff cheaper than DCP"][-1] == "yes"
    assert rows["117.8M LowDiff+ cheaper than DCP"][-1] == "yes"
    # 1.04B: LowDiff from one run, DCP against the plain arm of its own run
    assert rows["1.04B LowDiff"][2:] == ["TopK 450.0 ms", "+10.0%", "≤ +5%", "**no**"]
    assert rows["1.04B DCP async_save"][2:4] == ["plain 410.0 ms", "+2095.1%"]
    assert rows["1.04B LowDiff cheaper than DCP"][0] == "adds 45.00 ms a step; DCP adds 8,590 ms"
    # the bare step measured at 117.8M, scaled to 1.04B: 106 ms, at most half of 400 ms
    plus1b = rows["1.04B LowDiff+"]
    assert plus1b[4].endswith("applies: bare ≈ 106.1 ms ≤ 200.0 ms") and plus1b[5] == "**no**"
    assert rows["replica update, 14 threads, 117.8M"] == [
        "15.00 ms (same bits)", "3 steps × 5", "bare fused AdamW 12.00 ms", "1.25x", "≤ 1.3x", "yes"
    ]  # fmt: skip
    assert rows["replica update, 1 thread, 117.8M"][3:] == ["2.00x", "≤ 1.3x", "**no**"]
    tests = rows["CUDA tests (pytest -m gpu)"]
    assert tests[0] == "18 passed, 1 failed, 0 errors, 2 skipped" and tests[-1] == "**no**"
    assert f"failed: {FAILED}" in rows
    rec = rows["recovery, f = 5: LowDiff+ (S)"]
    assert rec[0] == "500.0 ms to the first new step"
    assert rec[2:4] == ["torch.save 2.00 s", "4.0x sooner"]
    assert "not run" not in text


def test_partial_set(gs: Any, tmp_path: Path) -> None:
    """Only ref1b, stopped after one repeat without LowDiff+: every other phase "not run"."""
    ms = {"plain": 400.0, "topk": 450.0, "lowdiff": 470.0}
    write(tmp_path, "ref1b.json", reference("gpt2-1b", P1B, ms, complete=False))
    (tmp_path / "summary.md").write_text("an older table")  # not JSON: left alone
    rows = table(gs.summary(gs.load(tmp_path)))
    assert rows["117.8M: all arms"][0] == "not run (ref117m)"
    assert rows["1.04B LowDiff"] == [
        "470.0 ms (0.50 ms in flush)", "40 steps × 1 (run cut short)", "TopK 450.0 ms", "+4.4%", "≤ +5%", "yes"
    ]  # fmt: skip
    assert rows["1.04B LowDiff+"][0] == "not run"
    assert rows["1.04B DCP async_save"][0] == "not run"
    assert rows["1.04B LowDiff cheaper than DCP"][0] == "not run (DCP)"
    assert rows["replica update"][0] == "not run (replica)"
    assert rows["CUDA tests (pytest -m gpu)"][0] == "not run (tests)"
    assert rows["recovery (to the first new step)"][0] == "not run (recovery)"
    # an arm the run was to measure but stopped before
    run = reference("gpt2-1b", P1B, ms, complete=False)
    run["settings"]["arms"].append("lowdiff+")
    write(tmp_path, "ref1b.json", run)
    got = table(gs.summary(gs.load(tmp_path)))["1.04B LowDiff+"]
    assert got[0] == "no timed block (run cut short)"


def test_lowdiff_plus_target_applies_where_the_bare_step_fits(gs: Any, tmp_path: Path) -> None:
    ms = {"plain": 20.0, "lowdiff+": 21.0}
    write(tmp_path, "ref117m.json", reference("gpt2-117m", P117M, ms, threads=8))
    plus = table(gs.summary(gs.load(tmp_path)))["117.8M LowDiff+"]
    assert plus[3:] == ["+5.0%", "≤ +10% where bare CPU AdamW ≤ ½ step (replica not run)", "?"]
    # the row of the arm's 8 threads: 12 ms, more than half of 20 ms
    rows = [replica_row(1, 100.0, 90.0), replica_row(8, 13.0, 12.0)]
    write(tmp_path, "replica.json", {"kind": "replica", "rows": rows})
    plus = table(gs.summary(gs.load(tmp_path)))["117.8M LowDiff+"]
    assert plus[4].endswith("does not apply: bare 12.00 ms > 10.00 ms") and plus[5] == "n/a"


def test_pytest_log_cut_short(gs: Any) -> None:
    """A log without pytest's closing line: counted from the -v lines, marked incomplete."""
    skipped = "tests/workloads/test_zoo.py::test_cuda_workloads[x] SKIPPED\n"
    log = TESTS_LOG.split("=====")[0] + skipped
    got = gs.parse_pytest(log)
    assert (got["passed"], got["failed"], got["errors"], got["skipped"]) == (1, 1, 0, 1)
    assert got["complete"] is False
    assert got["failures"] == [FAILED]


def test_main_prints_the_table_and_writes_the_environment(
    gs: Any, full: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert gs.main([str(full)]) == 0
    assert "| 117.8M LowDiff |" in capsys.readouterr().out
    env = tmp_path / "machine.json"
    assert gs.main(["--write-env", str(env)]) == 0
    info = json.loads(env.read_text())
    assert info["kind"] == "gpu-env" and info["cpus"] == os.cpu_count() and info["lowdiff"]

"""lowdiff bench: interleaved timing, the experiments end to end, the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowdiff.bench import DEFAULT_EXPERIMENTS, run_bench
from lowdiff.bench.core import Arena, Arm, BenchSettings, summarize
from lowdiff.bench.experiments import Profile
from lowdiff.bench.report import markdown, plots
from lowdiff.cli.main import main

pytestmark = pytest.mark.multiprocess

TINY = dict(workload="gpt2-tiny", iters=2, repeats=2)


def test_arena_interleaves_rotating_order_and_measures_every_arm(tmp_path: Path) -> None:
    s = BenchSettings(**TINY, workdir=tmp_path)
    arms = [
        Arm("plain", None),
        Arm("W/O CKPT", "none", 0.01),
        Arm("LowDiff", "lowdiff", 0.01, 3, (("batch_size", 2),)),
        Arm("torch.save", "torch-save", 0.01, 1),
    ]
    said: list[str] = []
    with Arena(s, arms, said.append, phases=True) as arena:
        arena.run()
        res = arena.results()
        disk = {r.arm.label: arena.disk_bytes(r) for r in arena.runs}
        steps = {r.arm.label: r.step for r in arena.runs}
    rounds = [m for m in said if m.startswith("round")]
    assert [m.split(": ")[1] for m in rounds] == [
        "plain",
        "W/O CKPT",
        "LowDiff",
        "torch.save",
        "W/O CKPT",
        "LowDiff",
        "torch.save",
        "plain",
    ]
    for label, r in res.items():
        assert r["n"] == 2 and 0 < r["min_s"] <= r["median_s"] <= r["max_s"], label
        assert steps[label] == 6  # warm-up block + 2 timed blocks of 2
        assert set(r["phases_s"]) == {"forward_backward", "update_and_checkpoint"}
    ld = res["LowDiff"]["stats"]
    assert ld["records_written"] == 6 and ld["record_bytes"] > 0
    assert res["torch.save"]["stats"]["checkpoints"] == 6
    assert disk["torch.save"] > 0 and disk["LowDiff"] > 0 and disk["plain"] == 0
    assert not list(tmp_path.iterdir())  # checkpoint directories are removed


def test_summarize() -> None:
    assert summarize([3.0, 1.0, 2.0]) == {"median_s": 2.0, "min_s": 1.0, "max_s": 3.0, "n": 3}
    assert summarize([])["median_s"] is None


def test_bad_settings(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="iters"):
        BenchSettings("gpt2-tiny", iters=0)
    with pytest.raises(ValueError, match="device"):
        BenchSettings("gpt2-tiny", device="tpu")
    with pytest.raises(ValueError, match="unique"):
        Arena(BenchSettings("gpt2-tiny", workdir=tmp_path), [Arm("a", None), Arm("a", None)])
    with pytest.raises(ValueError, match="unknown experiment"):
        run_bench(["overhead", "speed"], out=tmp_path)
    assert main(["bench", "speed", "--out", str(tmp_path / "r")]) == 2
    with pytest.raises(ValueError, match="unknown method"):
        run_bench(["overhead"], out=tmp_path, methods=["lowdiff", "checkpoint-everything"])


def test_every_experiment_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "results"
    s = BenchSettings("gpt2-tiny", iters=2, repeats=1, workdir=tmp_path / "work")
    p = Profile(intervals=[1], recovery_fulls=[2], batch_sizes=[2], ratios=[0.01, 0.1])
    files = run_bench(list(DEFAULT_EXPERIMENTS), out=out, settings=s, profile=p)
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    run, rows = lines[0], lines[1:]
    assert run["kind"] == "run" and run["machine"]["torch"] and "git_revision" in run["machine"]
    by_exp = {e: [r for r in rows if r["experiment"] == e] for e in DEFAULT_EXPERIMENTS}
    assert all(by_exp[e] for e in DEFAULT_EXPERIMENTS), {e: len(v) for e, v in by_exp.items()}
    methods = {r["method"] for r in by_exp["overhead"] if r["setting"] == "compressed"}
    assert methods == {
        "W/O CKPT",
        "LowDiff",
        "torch.save",
        "CheckFreq",
        "Gemini",
        "Naive DC",
        "DCP async",
    }
    methods = {r["method"] for r in by_exp["overhead"] if r["setting"] == "uncompressed"}
    assert {"W/O CKPT", "LowDiff+"} <= methods
    for r in by_exp["recovery"]:
        assert r["recovered_step"] + r["retrained_steps"] == r["failure_step"] == 3, r
    lowdiff = next(r for r in by_exp["recovery"] if r["method"] == "LowDiff")
    assert lowdiff["recovered_step"] == 3 and lowdiff["records_replayed"] == 1
    plus = next(r for r in by_exp["recovery"] if r["method"] == "LowDiff+ (S)")
    assert plus["source"] == "memory" and plus["recovered_step"] == 3
    torch_save = next(r for r in by_exp["recovery"] if r["method"] == "Baseline (torch.save)")
    assert torch_save["recovered_step"] == 2 and torch_save["retrain_s"] > 0
    ratio = {r["ratio"]: r for r in by_exp["ratio"]}
    assert ratio[0.1]["record_bytes"] > ratio[0.01]["record_bytes"]
    storage = {(r["method"], r["setting"]): r for r in by_exp["storage"]}
    assert (
        storage[("LowDiff", "compressed")]["differential_bytes"]
        < storage[("torch.save", "compressed")]["full_checkpoint_bytes"]
    )
    report = (out / "report.md").read_text()
    for title in (
        "Overhead",
        "frequency",
        "Recovery",
        "Batched writes",
        "Storage",
        "Compression ratio",
        "breakdown",
    ):
        assert title in report
    for name in ("overhead", "frequency", "recovery", "batching", "storage", "ratio", "breakdown"):
        assert files[name].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_renders_missing_values(tmp_path: Path) -> None:
    run = {
        "machine": {
            "processor": "x",
            "cpus_usable": 2,
            "platform": "p",
            "torch": "t",
            "lowdiff": "l",
            "git_revision": None,
            "torch_threads": 1,
        },
        "settings": {
            "workload": "w",
            "device": "cpu",
            "iters": 1,
            "repeats": 1,
            "amp": None,
            "grad_accum": 1,
        },
        "experiments": ["frequency"],
        "quick": True,
        "n_params": 10,
        "wall_s": 1.0,
    }
    rows = [
        {
            "experiment": "frequency",
            "method": "A",
            "interval": 1,
            "overhead": 0.5,
            "median_s": 1.0,
            "reference_median_s": 0.66,
            "within_bound": False,
        },
        {
            "experiment": "frequency",
            "method": "A",
            "summary": True,
            "bound": 0.035,
            "min_interval": None,
            "largest_interval_tried": 1,
        },
    ]
    text = markdown(run, rows)
    assert "| A | > 1 | 1: +50.0% |" in text
    assert [p.name for p in plots(tmp_path, rows, ["frequency"])] == ["frequency.png"]

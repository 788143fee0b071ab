"""lowdiff bench: interleaved timing, the experiments end to end, the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowdiff.cli.main import main
from lowdiff_lab.bench import DEFAULT_EXPERIMENTS, run_bench
from lowdiff_lab.bench.arms import compressed_arms, uncompressed_arms
from lowdiff_lab.bench.core import (
    Arena,
    Arm,
    BenchSettings,
    block_length,
    newest_full_bytes,
    summarize,
)
from lowdiff_lab.bench.experiments import Profile
from lowdiff_lab.bench.report import markdown, plots

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
    for run in arena.runs:
        # a block's time is its iterations and its final drain (ck.flush()) together
        n = 2
        for total, it, drain in zip(run.blocks, run.iter_blocks, run.drains, strict=True):
            assert total * n == pytest.approx(it * n + drain, rel=1e-9, abs=1e-12)
            if run.ck is not None:
                assert drain > 0 and total > it
    ld = res["LowDiff"]["stats"]
    assert ld["records_written"] == 6 and ld["record_bytes"] > 0
    assert res["torch.save"]["stats"]["checkpoints"] == 6
    assert disk["torch.save"] > 0 and disk["LowDiff"] > 0 and disk["plain"] == 0
    assert not list(tmp_path.iterdir())  # checkpoint directories are removed


def test_block_length_holds_every_period() -> None:
    assert block_length(5, [20, 5]) == 20
    assert block_length(20, [20, 10]) == 20
    assert block_length(21, [20, 1]) == 40
    assert block_length(3, [4, 6]) == 12
    assert block_length(7, []) == 7
    with pytest.raises(ValueError, match="periods"):
        block_length(5, [0])


def test_arms_compare_at_equal_durability() -> None:
    p = Profile(lowdiff_full_every=20)
    for k in (1, 5, 10):
        arms = {a.label: a for a in compressed_arms(p, k)}
        assert dict(arms["LowDiff"].options)["batch_size"] == k
        gem = arms["Gemini"]
        assert gem.full_every == 1 and dict(gem.options)["persist_every"] == k
        for label in ("torch.save", "CheckFreq", "DCP async (thread)", "DCP async (process)"):
            assert arms[label].full_every == k, label
        assert dict(arms["DCP async (thread)"].options)["async_mode"] == "thread"
        assert dict(arms["DCP async (process)"].options)["async_mode"] == "process"
        assert dict(arms["Naive DC"].options)["diff_every"] == k
        durable = {a.label: a.durable_every for a in arms.values() if a.strategy != "none"}
        assert set(durable.values()) == {k}, durable
        assert arms["LowDiff"].memory_every == gem.memory_every == 1
        assert arms["torch.save"].memory_every == k
        plus = {a.label: a for a in uncompressed_arms(p, k)}["LowDiff+"]
        assert dict(plus.options)["persist_every"] == k and plus.durable_every == k
    own = {a.label: a for a in compressed_arms(p, 1, own_policies=True)}
    assert own["CheckFreq (auto)"].full_every == "auto"
    assert "CheckFreq (auto)" not in {a.label for a in compressed_arms(p, 1)}


def test_newest_full_bytes_skips_the_step_zero_checkpoint(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    full = d / "full"
    full.mkdir(parents=True)
    (full / "full-000000000000.safetensors").write_bytes(b"x" * 10)
    assert newest_full_bytes(d) is None
    (full / "full-000000000020.safetensors").write_bytes(b"x" * 30)
    (full / "full-000000000040.safetensors").write_bytes(b"x" * 31)
    (full / ".tmp-full-000000000060.safetensors.1.ab").write_bytes(b"x" * 99)
    (full / "ckpt-000000000040.pt.commit").write_bytes(b"x" * 77)
    assert newest_full_bytes(d) == 31
    dcp = full / "dcp-000000000050"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"m" * 5)
    (dcp / "__0_0.distcp").write_bytes(b"d" * 40)
    assert newest_full_bytes(d) == 45
    assert newest_full_bytes(None) is None


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


@pytest.mark.timeout(900)  # about 100 s on a quiet 2-core machine; every experiment runs
def test_every_experiment_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "results"
    s = BenchSettings("gpt2-tiny", iters=2, repeats=1, workdir=tmp_path / "work")
    p = Profile(
        lowdiff_full_every=2,
        lowdiff_batch=2,
        intervals=[1, 2],
        recovery_fulls=[2],
        batch_sizes=[2],
        ratios=[0.01, 0.1],
        hot_trainer_workload="gpt2-tiny",
        hot_steps=3,
    )
    files = run_bench(list(DEFAULT_EXPERIMENTS), out=out, settings=s, profile=p)
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    run, rows = lines[0], lines[1:]
    assert run["kind"] == "run" and run["machine"]["torch"] and "git_revision" in run["machine"]
    assert "OMP_WAIT_POLICY" in run["machine"]["env"]  # reported, set or not
    assert "OMP_WAIT_POLICY" in run["background_env"]
    by_exp = {e: [r for r in rows if r["experiment"] == e] for e in DEFAULT_EXPERIMENTS}
    assert all(by_exp[e] for e in DEFAULT_EXPERIMENTS), {e: len(v) for e, v in by_exp.items()}
    baselines = {
        "torch.save",
        "CheckFreq",
        "Gemini",
        "Naive DC",
        "DCP async (thread)",
        "DCP async (process)",
    }
    for k in (1, 2):
        comp = [
            r for r in by_exp["overhead"] if r["setting"] == "compressed" and r["interval"] == k
        ]
        methods = {r["method"] for r in comp}
        assert methods == {"W/O CKPT", "LowDiff", *baselines} | (
            {"CheckFreq (auto)"} if k == 1 else set()
        )
        for r in comp:
            if r["method"] == "W/O CKPT":
                continue
            if r["method"] != "CheckFreq (auto)":
                assert r["durable_every"] == k, r
            # every method's figure holds its drain
            assert r["median_s"] >= r["iter_median_s"] and r["drain_s"] > 0, r
            assert r["block_iters"] == 2
        unc = {r["method"] for r in by_exp["overhead"] if r["setting"] == "uncompressed"}
        assert {"W/O CKPT", "LowDiff+"} <= unc
    auto = next(r for r in by_exp["overhead"] if r["method"] == "CheckFreq (auto)")
    # CheckFreq's policy profiles 5 steps first: too few here to have chosen
    assert auto["arm_full_every"] == "auto" and "durable_every" in auto
    summary = {r["method"]: r for r in by_exp["frequency"] if r.get("summary")}
    assert {"LowDiff", "LowDiff+", *baselines} <= set(summary)
    rec = {r["method"]: r for r in by_exp["recovery"]}
    assert set(rec) == {
        "torch.save",
        "CheckFreq",
        "DCP async",
        "Naive DC w/o OC",
        "Naive DC w/ OC",
        "LowDiff",
        "LowDiff (S)",
        "Gemini (S)",
        "LowDiff+ (S)",
    }
    for r in rec.values():
        assert r["recovered_step"] + r["retrained_steps"] == r["failure_step"] == 3, r
        # one definition for every method: resume(), the first step, the first new step
        assert 0 < r["resume_s"] < r["first_step_s"] <= r["first_new_step_s"], r
        assert r["retrain_s"] < r["first_new_step_s"] - r["resume_s"], r
        if r["retrained_steps"] == 0:
            assert r["first_step_s"] == r["first_new_step_s"] and r["retrain_s"] == 0, r
    assert rec["LowDiff"]["recovered_step"] == 3 and rec["LowDiff"]["records_replayed"] == 1
    # the killed LowDiff trainer: every record it was sent is written, read from disk
    assert rec["LowDiff (S)"]["recovered_step"] == 3 and rec["LowDiff (S)"]["source"] == "disk"
    assert rec["LowDiff+ (S)"]["source"] == "memory" and rec["Gemini (S)"]["source"] == "memory"
    assert rec["torch.save"]["recovered_step"] == 2 and rec["torch.save"]["retrain_s"] > 0
    ratio = {r["ratio"]: r for r in by_exp["ratio"]}
    assert ratio[0.1]["record_bytes"] > ratio[0.01]["record_bytes"]
    storage = {(r["method"], r["setting"]): r for r in by_exp["storage"]}
    ld = storage[("LowDiff", "compressed")]
    assert ld["differential_bytes"] < storage[("torch.save", "compressed")]["full_checkpoint_bytes"]
    # the full checkpoint is one with Adam's state (about three copies of the parameters),
    # not an average with step 0's (one copy)
    assert ld["full_checkpoint_bytes"] > 2.5 * 4 * run["n_params"]
    report = (out / "report.md").read_text()
    for title in (
        "Overhead",
        "equal durability",
        "k = 2",
        "frequency",
        "Recovery",
        "to first new step",
        "against torch.save's at the same f",
        "Batched writes",
        "Storage",
        "Compression ratio",
        "breakdown",
        "drain / block",
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


def test_training_processes_keep_the_callers_openmp_policy(monkeypatch) -> None:
    """The demo's, the bench's and chaos's training processes run as the user's training
    would: no wait policy is forced on them, and one the caller set is kept."""
    from lowdiff_lab.harness import child_env

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    env = child_env(3)
    assert "OMP_WAIT_POLICY" not in env
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "3"
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert child_env(1)["OMP_WAIT_POLICY"] == "PASSIVE"

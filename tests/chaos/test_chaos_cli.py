"""``lowdiff chaos`` on the command line: bad options named, the report files written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowdiff.cli.main import main


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--mtbf", "0"], "--mtbf must be positive seconds, got 0.0"),
        (["--mtbf", "2,-1"], "--mtbf must be positive seconds, got -1.0"),
        (["--methods", "lowdiff,frobnicate"], "--methods: unknown strategy 'frobnicate'"),
        (["--methods", "lowdiff:meteor"], "--methods: unknown failure kind 'meteor'"),
        (["--methods", "gemini,gemini"], "--methods: gemini given twice"),
        (["--lowdiff", "3,5"], "--lowdiff must be 'auto', 'model' or 'F,B'"),
        (["--lowdiff", "often"], "--lowdiff must be 'auto', 'model' or 'F,B'"),
        (["--steps", "0"], "--steps must be an integer >= 1, got 0"),
        (["--interval", "0"], "--interval must be 'young-daly' or an integer >= 1, got 0"),
        (["--persist-interval", "0"], "--persist-interval must be an integer >= 1, got 0"),
        (["--grid", "--grid-f", "1", "--grid-b", "2"], "no pair with b <= f"),
        (["--grid-b", "0"], "--grid-b values must be integers >= 1, got 0"),
        (["--grid-mtbf", "-3"], "--grid-mtbf must be positive seconds"),
        (["--ratio", "2"], "--ratio must be in (0, 1], got 2.0"),
        (["--model", "gpt5"], "--model: unknown model 'gpt5'"),
        (["--rounds", "0"], "--rounds must be an integer >= 1, got 0"),
        (
            ["--grid", "--rounds", "2"],
            "--rounds repeats the comparison; --grid runs each cell once",
        ),
    ],
)
def test_bad_options_are_named(argv: list[str], needle: str, capsys, tmp_path: Path) -> None:
    rc = main(["chaos", "--out", str(tmp_path / "o"), *argv])
    assert rc == 2
    err = capsys.readouterr().err
    assert needle in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--mtbf", "soon"], "--mtbf: expected comma-separated numbers, got 'soon'"),
        (["--grid-f", "1,x"], "--grid-f: expected comma-separated integers"),
        (["--launcher", "teleport"], "invalid choice: 'teleport'"),
        (["--interval", "often"], "--interval: expected 'young-daly' or an integer, got 'often'"),
    ],
)
def test_unparsable_options_exit_2(argv: list[str], needle: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["chaos", *argv])
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_small_run_writes_the_report(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    rc = main(
        [
            "chaos",
            "--quick",
            "--quiet",
            "--steps",
            "20",
            "--methods",
            "torch-save,gemini",
            "--mtbf",
            "0.25",
            "--seed",
            "4",
            "--sim-gpus",
            "8,16",
            "--rounds",
            "2",
            "--out",
            str(out),
            "--workdir",
            str(tmp_path / "work"),
        ]
    )
    assert rc == 0, capsys.readouterr().err
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    run, rows = lines[0], lines[1:]
    assert run["kind"] == "run" and all(r["kind"] == "row" for r in rows)
    assert {"torch", "git_revision", "cpus_usable"} <= set(run["machine"])
    assert run["info"]["mtbfs_s"] == [0.25]
    wasted = [r for r in rows if r["experiment"] == "wasted"]
    assert [(r["round"], r["method"]) for r in wasted] == [
        (0, "torch.save"),
        (0, "Gemini (S)"),
        (1, "torch.save"),
        (1, "Gemini (S)"),
    ]
    # each round's block has reference jobs on both sides: 3 for 2 blocks
    refs = [r for r in rows if r["experiment"] == "reference"]
    assert sorted(r["job"] for r in refs) == [f"ref-compressed-{b}" for b in range(3)]
    sched = next(r for r in rows if r["experiment"] == "schedule")
    for r in wasted:
        # the same failures for both methods, every one injected or said not to be
        assert r["failures"] + r["failures_not_injected"] == len(sched["points"])
        assert r["failures"] >= 1
        parts = r["startup_overhead_s"] + r["overhead_s"] + r["lost_work_s"] + r["recovery_s"]
        assert parts == pytest.approx(r["wasted_s"])
        assert r["total_s"] - r["wasted_s"] == pytest.approx(r["reference_s"])
    gem = wasted[1]
    assert set(gem["recovery_sources"]) == {"memory"}
    sim = [r for r in rows if r["experiment"] == "scale-gpus"]
    assert sim and all(r["simulation"] is True for r in sim)
    assert {r["n_gpus"] for r in sim} == {8, 16}
    md = (out / "report.md").read_text()
    assert "Wasted time (Exp. 3)" in md and "SIMULATION" in md and "Gemini (S)" in md
    assert "Median over 2 rounds" in md and "| Gemini (S) (2) |" in md
    for name in ("wasted", "effective_ratio", "scale_gpus"):
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the jobs' directories are kept where asked, with every attempt's logs
    assert (tmp_path / "work" / "r1-mtbf0-gemini" / "logs" / "attempt0.stderr.log").exists()

"""End-to-end test of ``lowdiff demo --quick``: a real SIGKILL, a real resume, exact state."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from lowdiff_lab.cli.demo import add_parser, run_demo
from lowdiff_lab.demo import kill_target


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lowdiff")
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["demo", *argv])


def test_parser_defaults_and_choices() -> None:
    args = _parse([])
    assert args.strategy == "lowdiff" and args.compressor == "topk" and args.ratio == 0.01
    assert args.func is run_demo
    assert _parse(["--strategy", "lowdiff+"]).strategy == "lowdiff+"
    with pytest.raises(SystemExit):
        _parse(["--strategy", "checkfreq"])


@pytest.mark.parametrize(
    "argv, needle",
    [
        (
            ["--strategy", "lowdiff+", "--ratio", "0.05"],
            "--ratio: strategy lowdiff+ trains without",
        ),
        (
            ["--strategy", "lowdiff+", "--compressor", "topk", "--ratio", "0.1"],
            "--compressor and --ratio: strategy lowdiff+ trains without",
        ),
        (["--threads", "0"], "--threads must be >= 1, got 0"),
        (["--steps", "3"], "--steps must be >= 10, got 3"),
    ],
)
def test_bad_options_are_usage_errors(argv: list[str], needle: str, capsys) -> None:
    """Refused before anything runs, as every other command refuses a bad option: exit
    code 2 and ``lowdiff demo: error: ...`` (an option LowDiff+ would ignore included)."""
    assert run_demo(_parse([*argv, "--out-dir", "/nonexistent/never-made"])) == 2
    err = capsys.readouterr().err
    assert f"lowdiff demo: error: {needle}" in err, err
    assert not Path("/nonexistent/never-made").exists()


def test_kill_target_is_seeded_and_mid_run() -> None:
    targets = {kill_target(seed, 200) for seed in range(50)}
    assert min(targets) >= 80 and max(targets) <= 160
    assert len(targets) > 5
    assert kill_target(3, 200) == kill_target(3, 200)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_quick_demo_recovers_bit_identical_state(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    args = _parse(
        ["--quick", "--no-progress", "--json", str(report_path), "--out-dir", str(tmp_path / "out")]
    )
    rc = run_demo(args)
    report = json.loads(report_path.read_text())
    state = report["state_check"]
    assert state["bit_identical"], state
    assert rc == 0
    kill = report["kill"]
    assert kill["kill_step"] is not None and kill["killed_returncode"] != 0
    assert kill["recovered_step"] >= kill["kill_step"] - report["batch_size"]
    assert report["storage"]["records"] > 0
    assert report["recovery"] is not None
    # the worst case replays the most records the files allow: at least the restart's
    worst = report["recovery_worst_case"]
    assert worst["records_replayed"] >= report["recovery"]["records_replayed"]
    assert worst["source"] == "disk"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_quick_demo_lowdiff_plus_recovers_from_memory(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    args = _parse(
        [
            "--quick",
            "--strategy",
            "lowdiff+",
            "--no-progress",
            "--json",
            str(report_path),
            "--out-dir",
            str(tmp_path / "out"),
        ]
    )
    assert run_demo(args) == 0
    report = json.loads(report_path.read_text())
    assert report["state_check"]["bit_identical"] is True
    assert report["recovery"]["source"] == "memory"
    assert report["recovery"]["files_read"] == 0
    assert report["recovery_worst_case"]["source"] == "disk"
    # no error feedback, no compression: the recovered run continues bit-identically
    assert report["loss"]["recovered_final"] == report["loss"]["reference_final"]

"""Invalid arguments and directories at the command line: exit code 2, the problem named."""

from __future__ import annotations

import pytest

from lowdiff.cli.main import main
from lowdiff_lab.torture.report import TortureReport


@pytest.mark.parametrize(
    "argv, needle",
    [
        (
            ["export", "ck", "--step", "-1", "--out", "x"],
            "--step: expected an integer >= 0, got -1",
        ),
        (["export", "ck", "--step", "abc", "--out", "x"], "--step: expected an integer >= 0"),
        (["export", "ck"], "--out"),
        (["torture", "--kills", "-3"], "--kills: expected an integer >= 0"),
        (["torture", "--jobs", "0"], "--jobs: expected an integer >= 1"),
        (["torture", "--jobs", "-1"], "--jobs: expected an integer >= 1, got -1"),
        (["torture", "--ddp", "0"], "--ddp: expected an integer >= 1, got 0"),
        (["torture", "--seed", "x"], "--seed"),
        (["inspect"], "directory"),
        (["frobnicate"], "invalid choice"),
        (["bench", "--steps", "0"], "--steps: expected an integer >= 1, got 0"),
        (["bench", "--repeats", "0"], "--repeats: expected an integer >= 1, got 0"),
        # an option a subcommand does not have: its own error and usage
        (["bench", "--bogus"], "lowdiff bench: error: unrecognized arguments: --bogus"),
        (["inspect", "d", "--frob"], "lowdiff inspect: error: unrecognized arguments: --frob"),
    ],
)
def test_invalid_argument_values(argv, needle, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (
            ["torture", "--method", "lowdiff+"],
            "--method applies to the --ddp and --nodes series only",
        ),
        (["torture", "--ddp", "2", "--kills", "3"], "--kills applies to the single-process"),
        (["torture", "--ddp", "2", "--quick", "--jobs", "2"], "--quick, --jobs apply to"),
        (["torture", "--nodes", "2", "--quick"], "not to --nodes N"),
        (["torture", "--nodes", "2", "--ddp", "2"], "--ddp and --nodes are two series"),
    ],
)
def test_torture_options_that_would_be_ignored_are_refused(argv, needle, capsys) -> None:
    """An option the chosen series does not use is refused, not ignored (a --strategy
    without --ddp started the 20-minute full profile)."""
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("command", ["inspect", "verify", "export"])
def test_empty_missing_foreign_directory_and_file(tmp_path, capsys, command) -> None:
    extra = ["--out", str(tmp_path / "o.safetensors")] if command == "export" else []
    (tmp_path / "empty").mkdir()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("x")
    for target, needle in [
        ("empty", "lowdiff.json"),
        ("missing", "missing"),
        ("foreign", "not a lowdiff checkpoint directory"),
        ("file", "file"),
    ]:
        code = main([command, str(tmp_path / target), *extra])
        out = capsys.readouterr()
        assert code in (1, 2) if command == "verify" else code == 2
        assert needle in out.err + out.out, (command, target, out)
    assert not (tmp_path / "o.safetensors").exists()
    assert (foreign / "notes.txt").read_text() == "mine"


def test_torture_command_prints_the_figures_and_fails_on_a_broken_promise(
    monkeypatch, capsys
) -> None:
    seen = {}

    def fake(profile, **kw):
        seen.update(kw, profile=profile)
        r = TortureReport(kills=3, recoveries=3, recoveries_ok=3, corruptions=5)
        r.corruptions_detected = 5
        return r

    monkeypatch.setattr("lowdiff_lab.torture.run_torture", fake)
    assert main(["torture", "--quick", "--kills", "3", "--seed", "4", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert "kills performed          3" in out and "result                   OK" in out
    assert seen["profile"].kills == 3 and seen["seed"] == 4 and seen["jobs"] == 2

    def broken(profile, **kw):
        r = TortureReport(corruptions=1, corruptions_undetected=1)
        r.fail("x.safetensors: not detected")
        return r

    monkeypatch.setattr("lowdiff_lab.torture.run_torture", broken)
    assert main(["torture", "--quick", "--json"]) == 1
    assert '"ok": false' in capsys.readouterr().out


def test_outputs_that_cannot_be_written_are_refused_before_any_work(tmp_path, capsys) -> None:
    """An unusable --out (or demo's --json) is an error at once, not after the run whose
    results it was to hold; so is an empty --methods, and a torture --out holding the
    runs of an earlier torture."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    used = tmp_path / "used"
    used.mkdir()
    (used / "chain-0").mkdir()
    for argv, needle in [
        (["bench", "overhead", "--quick", "--out", str(a_file / "r")], f"--out {a_file / 'r'}"),
        (["bench", "overhead", "--quick", "--methods", " , "], "give at least one method"),
        (["chaos", "--quick", "--out", str(a_file)], "exists and is not a folder"),
        (["chaos", "--quick", "--methods", ""], "give at least one method"),
        (["demo", "--quick", "--json", str(a_file / "r.json")], f"--json {a_file / 'r.json'}"),
        (["torture", "--quick", "--out", str(used)], "not empty"),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"lowdiff {argv[0]}: error:" in err and needle in err, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "used"]  # nothing made


def test_ctrl_c_is_a_one_line_message_and_exit_code_130(monkeypatch, capsys) -> None:
    from lowdiff.cli import main as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_verify", interrupted)
    assert cli.main(["verify", "somewhere"]) == 130
    assert capsys.readouterr().err == "lowdiff verify: interrupted\n"

"""``lowdiff plan`` and the cost model built from a ``lowdiff bench`` results file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lowdiff.cli.main import main
from lowdiff.cli.plan import duration, int_list, rate, size
from lowdiff.plan import (
    CostModel,
    bench_inputs,
    continuous_f,
    cost_model_from_bench,
    fit_bandwidth,
    optimize,
    wasted_time,
)

FLAGS = [
    "--tau",
    "500ms",
    "--total-time",
    "24h",
    "--mtbf",
    "1h",
    "--full-bytes",
    "8G",
    "--record-bytes",
    "20MB",
    "--write-bw",
    "1GB/s",
    "--read-bw",
    "2GB/s",
    "--full-latency",
    "0.2",
    "--batch-latency",
    "5ms",
    "--full-recovery",
    "10s",
    "--decompress",
    "10ms",
    "--replay",
    "50ms",
]
MODEL = CostModel(
    tau=0.5,
    total_time=86400.0,
    mtbf=3600.0,
    full_bytes=8e9,
    record_bytes=2e7,
    write_bw=1e9,
    read_bw=2e9,
    full_latency=0.2,
    batch_latency=0.005,
    full_recovery_s=10.0,
    decompress_s_per_record=0.01,
    replay_s_per_record=0.05,
)


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# --------------------------------------------------------------------------- units


@pytest.mark.parametrize(
    "text,want",
    [("0.5", 0.5), ("500ms", 0.5), ("90s", 90.0), ("10min", 600.0), ("1h", 3600.0), ("2d", 172800)],
)
def test_durations(text, want):
    assert duration(text) == pytest.approx(want)


@pytest.mark.parametrize(
    "text,want",
    [("123", 123.0), ("8.7G", 8.7e9), ("8.7GB", 8.7e9), ("2GiB", 2 * 2**30), ("20MB", 2e7)],
)
def test_sizes(text, want):
    assert size(text) == pytest.approx(want)


def test_rates_and_lists():
    assert rate("2GB/s") == 2e9 and rate("500MiB/s") == 500 * 2**20 and rate("1e9") == 1e9
    assert int_list("1-4,8,16") == [1, 2, 3, 4, 8, 16]
    assert int_list("10,30,50,100") == [10, 30, 50, 100]


# --------------------------------------------------------------------------- the command


def test_flags_give_the_model_and_its_argmin(capsys):
    out = _json(capsys, FLAGS)
    assert out["inputs"] == MODEL.as_dict()
    p = optimize(MODEL)
    assert (out["f"], out["b"]) == (p.f, p.b)
    assert out["wasted_s"] == p.wasted_s
    assert out["f_c"] == continuous_f(MODEL, p.b)
    assert math.fsum(out["terms"].values()) == pytest.approx(out["wasted_s"])
    assert out["c_f"] == MODEL.c_f() and out["r_b"] == MODEL.r_b(p.b)
    t = out["table"]
    row = t["f_values"].index(p.f)
    assert t["normalized"][row][t["b_values"].index(p.b)] == 1.0
    assert min(v for r in t["normalized"] for v in r if v is not None) == 1.0


def test_the_papers_grid(capsys):
    # the paper's Table: f in {10, 30, 50, 100}, b in 1..6, normalised to the argmin
    out = _json(capsys, [*FLAGS, "--f-values", "10,30,50,100", "--b-values", "1-6"])
    grid = {(f, b): wasted_time(MODEL, f, b) for f in (10, 30, 50, 100) for b in range(1, 7)}
    best = min(grid, key=lambda k: grid[k])
    assert (out["f"], out["b"]) == best
    assert out["table"]["f_values"] == [10, 30, 50, 100]
    assert out["table"]["b_values"] == [1, 2, 3, 4, 5, 6]
    for i, f in enumerate((10, 30, 50, 100)):
        for j, b in enumerate(range(1, 7)):
            assert out["table"]["normalized"][i][j] == pytest.approx(grid[(f, b)] / grid[best])


def test_text_output(capsys):
    assert main(["plan", *FLAGS]) == 0
    text = capsys.readouterr().out
    p = optimize(MODEL)
    assert f"f* = {p.f}   b* = {p.b}" in text
    assert "f_c(b*) = " in text and "terms of T_w" in text and "normalized wasted time" in text
    assert "record replay" in text and "--mtbf" in text


def test_read_bandwidth_defaults_to_write(capsys):
    argv = [a for a in FLAGS]
    i = argv.index("--read-bw")
    del argv[i : i + 2]
    out = _json(capsys, argv)
    assert out["inputs"]["read_bw"] == out["inputs"]["write_bw"] == 1e9


def test_missing_inputs_are_named(capsys):
    assert main(["plan", "--tau", "1", "--mtbf", "1h"]) == 2
    err = capsys.readouterr().err
    assert "missing --total-time, --full-bytes, --record-bytes, --write-bw" in err
    assert "--from-bench" in err


@pytest.mark.parametrize(
    "flag,value,msg",
    [("--mtbf", "1 fortnight", "duration"), ("--full-bytes", "lots", "size")],
)
def test_unparsable_values_are_named(capsys, flag, value, msg):
    argv = list(FLAGS)
    argv[argv.index(flag) + 1] = value
    with pytest.raises(SystemExit) as e:
        main(["plan", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and msg in err and value in err


def test_non_positive_values_name_the_flag(capsys):
    argv = list(FLAGS)
    argv[argv.index("--tau") + 1] = "0"
    assert main(["plan", *argv]) == 2
    assert "--tau must be > 0, got 0.0" in capsys.readouterr().err


def test_bad_candidates(capsys):
    assert main(["plan", *FLAGS, "--f-values", "2", "--b-values", "3-4"]) == 2
    assert "no candidate pair" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", *FLAGS, "--b-values", "0-3"])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["plan", *FLAGS, "--b-values", "5-1"])
    assert "range '5-1' runs backwards: write it low-high (1-5)" in capsys.readouterr().err


# --------------------------------------------------------------------------- from a bench run


def _bench_file(tmp_path: Path, experiments: tuple[str, ...] = ("all",)) -> Path:
    """Rows as ``lowdiff bench`` writes them, with costs that fit exactly."""
    row_bytes, w, lat = 1000, 1e6, 0.002
    rows: list[dict] = [{"kind": "run", "profile": {"lowdiff_batch": 5}}]
    want = lambda e: "all" in experiments or e in experiments  # noqa: E731
    if want("overhead"):
        rows.append(
            {
                "kind": "row",
                "experiment": "overhead",
                "setting": "compressed",
                "method": "W/O CKPT",
                "median_s": 0.25,
            }
        )
        rows.append(
            {
                "kind": "row",
                "experiment": "overhead",
                "setting": "uncompressed",
                "method": "W/O CKPT",
                "median_s": 9.0,
            }
        )
    if want("storage"):
        rows.append(
            {
                "kind": "row",
                "experiment": "storage",
                "setting": "compressed",
                "method": "LowDiff",
                "full_checkpoint_bytes": 50000.0,
                "differential_bytes": 1040.0,  # 40 bytes of header per record at b = 5
            }
        )
    if want("batching"):
        for b in (1, 2, 5):
            rows.append(
                {
                    "kind": "row",
                    "experiment": "batching",
                    "batch_size": b,
                    "records": 10,
                    "writes": 10 // b,
                    "record_row_bytes": row_bytes,
                    "write_s_per_write": lat + b * row_bytes / w,
                }
            )
    if want("recovery"):
        for n, f in ((4, 5), (9, 10)):  # read at 1e7 B/s, 1 ms + 3 ms per record, R_F 0.1 s
            nbytes = 50000 + n * 1000
            rows.append(
                {
                    "kind": "row",
                    "experiment": "recovery",
                    "method": "LowDiff",
                    "full_every": f,
                    "records_replayed": n,
                    "bytes_read": nbytes,
                    "read_s": nbytes / 1e7,
                    "decompress_s": n * 0.001,
                    "reconstruct_s": n * 0.003,
                    "recovery_s": 0.1 + n * 0.004 + n * 1000 / 1e7,
                }
            )
        rows.append(
            {
                "kind": "row",
                "experiment": "recovery",
                "method": "Baseline (torch.save)",
                "records_replayed": 0,
                "bytes_read": 1,
                "read_s": 100.0,
                "decompress_s": 0,
                "reconstruct_s": 0,
                "recovery_s": 100.0,
            }
        )
    p = tmp_path / "results.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_cost_model_from_bench(tmp_path):
    m = cost_model_from_bench(_bench_file(tmp_path), mtbf=600, total_time=7200, n_gpus=4)
    assert m.tau == 0.25 and m.mtbf == 600 and m.total_time == 7200 and m.n_gpus == 4
    assert m.full_bytes == 50000 and m.record_bytes == 1000
    assert m.batch_overhead_bytes == pytest.approx(200.0)
    assert m.write_bw == pytest.approx(1e6) and m.batch_latency == pytest.approx(0.002)
    assert m.full_latency == m.batch_latency
    assert m.read_bw == pytest.approx(1e7)
    assert m.decompress_s_per_record == pytest.approx(0.001)
    assert m.replay_s_per_record == pytest.approx(0.003)
    assert m.full_recovery_s == pytest.approx(0.1)


@pytest.mark.parametrize("missing", ["overhead", "storage", "batching", "recovery"])
def test_a_missing_experiment_is_named(tmp_path, missing):
    keep = tuple(e for e in ("overhead", "storage", "batching", "recovery") if e != missing)
    path = _bench_file(tmp_path, keep)
    with pytest.raises(ValueError, match=f"lacks the bench experiment\\(s\\) {missing}"):
        cost_model_from_bench(path, mtbf=600, total_time=7200)
    _, lacking = bench_inputs(path)
    assert lacking == [missing]


def test_from_bench_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        cost_model_from_bench(tmp_path / "none.jsonl", mtbf=1, total_time=1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kind": "run"}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not a JSON line"):
        bench_inputs(bad)


def test_cli_from_bench_with_overrides(tmp_path, capsys):
    path = _bench_file(tmp_path)
    out = _json(capsys, ["--from-bench", str(path), "--mtbf", "10min", "--total-time", "2h"])
    assert out["inputs"] == cost_model_from_bench(path, mtbf=600, total_time=7200).as_dict()
    out2 = _json(
        capsys,
        ["--from-bench", str(path), "--mtbf", "10min", "--total-time", "2h", "--tau", "1s"],
    )
    assert out2["inputs"]["tau"] == 1.0 and out2["inputs"]["full_bytes"] == 50000


def test_cli_from_bench_lacking_an_experiment(tmp_path, capsys):
    path = _bench_file(tmp_path, ("storage", "batching", "recovery"))
    argv = ["plan", "--from-bench", str(path), "--mtbf", "1h", "--total-time", "1d"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "missing --tau" in err and "lacks the bench experiment(s) overhead" in err
    # the flag fills the gap
    assert main([*argv, "--tau", "0.3"]) == 0


def test_fit_bandwidth_fallbacks():
    assert fit_bandwidth([100, 300], [1.5, 3.5]) == pytest.approx((100.0, 0.5))
    # time that does not grow with size: all of it on the bandwidth
    assert fit_bandwidth([100, 300], [2.0, 1.0]) == pytest.approx((400 / 3, 0.0))
    # a negative intercept: refit through the origin
    bw, lat = fit_bandwidth([100, 200], [0.5, 1.5])
    assert lat == 0.0 and bw == pytest.approx((100**2 + 200**2) / (50 + 300))
    assert fit_bandwidth([100], [2.0]) == (50.0, 0.0)

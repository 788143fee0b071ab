"""The chaos report of several rounds (``lowdiff chaos --rounds``): medians and ranges."""

from __future__ import annotations

from lowdiff_lab.chaos import report


def _wasted(method: str, mtbf: float, rnd: int, ratio: float) -> dict:
    return {
        "experiment": "wasted",
        "round": rnd,
        "method": method,
        "strategy": "torch-save",
        "full_every": 10,
        "interval_policy": "fixed",
        "mtbf_s": mtbf,
        "failures": 1,
        "failed_at_steps": [7],
        "total_s": 1.0 / ratio,
        "wasted_s": 1.0 / ratio - 1.0,
        "startup_overhead_s": 0.0,
        "overhead_s": 0.0,
        "lost_work_s": 1.0 / ratio - 1.0,
        "steps_redone": 1,
        "recovery_s": 0.0,
        "restore_s": 0.0,
        "recovery_sources": ["disk"],
        "recovered_steps": [7],
        "effective_ratio": ratio,
        "core_ratio": ratio + 0.1,
    }


ROWS = [
    _wasted("A", 2.0, 0, 0.70),
    _wasted("A", 2.0, 1, 0.50),
    _wasted("A", 2.0, 2, 0.60),
    _wasted("B", 2.0, 0, 0.80),
    _wasted("B", 2.0, 1, 0.90),
    _wasted("B", 2.0, 2, 0.40),
    _wasted("A", 1.0, 0, 0.30),
    _wasted("A", 1.0, 1, 0.20),
    _wasted("A", 1.0, 2, 0.25),
]


def test_the_ratio_table_gives_the_median_and_the_range_of_the_rounds() -> None:
    text = report.section_ratio(ROWS)
    assert "Median over 3 rounds" in text
    assert "| A | 60.0% [50.0–70.0] (70.0%) | 25.0% [20.0–30.0] (35.0%) |" in text
    assert "| B | 80.0% [40.0–90.0] (90.0%) | – |" in text


def test_one_round_reads_as_before() -> None:
    one = [r for r in ROWS if r["round"] == 0]
    text = report.section_ratio(one)
    assert "Median" not in text and "[" not in text
    assert "| A | 70.0% (80.0%) | 30.0% (40.0%) |" in text
    assert "(round)" not in report.section_wasted(one)


def test_every_round_is_listed_and_the_figures_take_the_median_round() -> None:
    text = report.section_wasted(ROWS)
    assert "ran 3 rounds" in text
    for rnd in (1, 2, 3):
        assert f"| A ({rnd}) |" in text and f"| B ({rnd}) |" in text
    picked = {(r["method"], r["mtbf_s"]): r["round"] for r in report.median_rows(ROWS)}
    assert picked == {("A", 2.0): 2, ("B", 2.0): 0, ("A", 1.0): 2}

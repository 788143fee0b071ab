"""Exp. 12 as a simulation: the formula, the label, the check against measured MTBFs."""

from __future__ import annotations

import pytest

from lowdiff_lab.chaos.run import simulate_gpus


def _row(method: str, mtbf: float, failures: int, ratio: float) -> dict:
    return {
        "method": method,
        "mtbf_s": mtbf,
        "reference_s": 4.0,
        "overhead_s": 0.4,
        "startup_overhead_s": 1.0,
        "failures": failures,
        "lost_work_s": 0.5 * failures,
        "recovery_s": 1.5 * failures,
        "effective_ratio": ratio,
    }


def test_simulated_ratio_follows_the_measured_costs() -> None:
    rows = [_row("A", 4.0, 1, 0.5), _row("A", 2.01, 2, 0.4), _row("B", 4.0, 0, 0.9)]
    sim = simulate_gpus(rows, [8, 16, 64], base_mtbf=4.0)
    assert all(r["simulation"] is True and r["experiment"] == "scale-gpus" for r in sim)
    a = {r["n_gpus"]: r for r in sim if r["method"] == "A"}
    # o = 0.4 / 4 = 0.1, u = 1, c = 2 s per failure; M_N = 4 * 8 / N
    for n, r in a.items():
        m = 4.0 * 8 / n
        assert r["system_mtbf_s"] == pytest.approx(m)
        assert r["effective_ratio"] == pytest.approx(4.0 / (4.0 * 1.1 + 1.0 + 4.0 / m * 2.0))
    # a measured MTBF within rounding of M_N is shown next to the simulation
    assert a[8]["measured_effective_ratio"] == 0.5
    assert a[16]["measured_effective_ratio"] == 0.4
    assert a[64]["measured_effective_ratio"] is None
    assert a[64]["effective_ratio"] < a[16]["effective_ratio"] < a[8]["effective_ratio"]
    b = [r for r in sim if r["method"] == "B"]
    assert {r["cost_per_failure_s"] for r in b} == {0.0}


def test_a_measured_mtbf_of_several_rounds_shows_their_median() -> None:
    rows = [_row("A", 4.0, 1, r) for r in (0.5, 0.7, 0.6)]
    sim = simulate_gpus(rows, [8], base_mtbf=4.0)
    assert sim[0]["measured_effective_ratio"] == 0.6

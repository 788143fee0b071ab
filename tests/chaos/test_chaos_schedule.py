"""Failure schedules: deterministic per seed, exponentially distributed, turned into steps."""

from __future__ import annotations

import math

import pytest

from lowdiff_lab.chaos.schedule import failure_schedule, failure_times, unit_exponentials


def test_same_seed_same_schedule_other_seed_other_schedule() -> None:
    a = failure_schedule(mtbf_s=1.5, horizon_s=30.0, seed=7, tau_s=0.04)
    b = failure_schedule(mtbf_s=1.5, horizon_s=30.0, seed=7, tau_s=0.04)
    c = failure_schedule(mtbf_s=1.5, horizon_s=30.0, seed=8, tau_s=0.04)
    assert a == b
    assert a.times_s != c.times_s
    assert len(a.points) > 5


def test_points_are_the_times_in_steps() -> None:
    tau = 0.037
    s = failure_schedule(mtbf_s=0.5, horizon_s=10.0, seed=3, tau_s=tau)
    prev = 0.0
    for i, p in enumerate(s.points):
        assert p.index == i
        assert prev <= p.time_s < 10.0
        assert p.step == math.floor(p.time_s / tau)
        assert 0.0 <= p.frac < 1.0
        assert (p.step + p.frac) * tau == pytest.approx(p.time_s)
        prev = p.time_s
    assert s.expected_failures == pytest.approx(20.0)


def test_unit_draws_are_exponential() -> None:
    n = 20_000
    xs = unit_exponentials(seed=123, n=n)
    mean = sum(xs) / n
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    assert 0.97 < mean < 1.03
    assert 0.94 < var < 1.06
    # memorylessness: P(X > 1) = e^-1, P(X > 2 | X > 1) = e^-1
    above1 = [x for x in xs if x > 1]
    assert abs(len(above1) / n - math.exp(-1)) < 0.015
    assert abs(sum(x > 2 for x in above1) / len(above1) - math.exp(-1)) < 0.025
    # Kolmogorov-Smirnov against Exp(1): under the 5% critical value 1.36 / sqrt(n)
    xs.sort()
    d = max(
        max((i + 1) / n - (1 - math.exp(-x)), (1 - math.exp(-x)) - i / n) for i, x in enumerate(xs)
    )
    assert d < 1.36 / math.sqrt(n)


def test_gaps_have_the_mtbf_as_mean_and_the_pattern_scales_with_it() -> None:
    times = failure_times(mtbf_s=2.0, horizon_s=40_000.0, seed=5)
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert len(times) == pytest.approx(20_000, rel=0.03)
    assert sum(gaps) / len(gaps) == pytest.approx(2.0, rel=0.03)
    # one seed, two MTBFs: the same unit draws, stretched
    short = failure_times(mtbf_s=1.0, horizon_s=50.0, seed=5)
    long = failure_times(mtbf_s=4.0, horizon_s=200.0, seed=5)
    assert len(short) == len(long)
    assert [4 * t for t in short] == pytest.approx(long)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mtbf_s": 0.0, "horizon_s": 1.0, "seed": 0, "tau_s": 0.1}, "mtbf_s"),
        ({"mtbf_s": -2.0, "horizon_s": 1.0, "seed": 0, "tau_s": 0.1}, "mtbf_s"),
        ({"mtbf_s": 1.0, "horizon_s": float("inf"), "seed": 0, "tau_s": 0.1}, "horizon_s"),
        ({"mtbf_s": 1.0, "horizon_s": 1.0, "seed": 0, "tau_s": 0.0}, "tau_s"),
    ],
)
def test_bad_input_names_the_argument(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        failure_schedule(**kwargs)

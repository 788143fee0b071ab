"""The (f, b) cost model: the paper's equations, their argmin and the input checks."""

from __future__ import annotations

import dataclasses
import math

import pytest

from lowdiff.plan import (
    CostModel,
    continuous_f,
    default_f_values,
    optimize,
    optimize_exact,
    wasted_time,
    wasted_time_terms,
)


def hand_model(**kw: object) -> CostModel:
    """Every input non-zero, with numbers that are easy to follow by hand."""
    base: dict[str, object] = dict(
        n_gpus=2,
        tau=0.5,
        total_time=1000.0,
        mtbf=250.0,
        full_bytes=100.0,
        record_bytes=10.0,
        batch_overhead_bytes=2.0,
        write_bw=10.0,
        read_bw=20.0,
        full_latency=1.0,
        batch_latency=0.5,
        full_recovery_s=3.0,
        decompress_s_per_record=0.1,
        replay_s_per_record=0.2,
    )
    base.update(kw)
    return CostModel(**base)  # type: ignore[arg-type]


def realistic(**kw: object) -> CostModel:
    """An 8 GB model at 0.5 s/iteration for a day, a failure an hour."""
    base: dict[str, object] = dict(
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
    base.update(kw)
    return CostModel(**base)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- equations


def test_costs_by_hand():
    m = hand_model()
    assert m.c_f() == 11.0  # 1 + 100/10
    assert m.s_b(2) == 22.0  # 2*10 + 2
    assert m.c_b(2) == pytest.approx(2.7)  # 0.5 + 22/10
    assert m.r_b(2) == pytest.approx(1.7)  # 22/20 + 2*0.1 + 2*0.2
    assert m.expected_failures == 4.0


def test_wasted_time_terms_by_hand():
    # N T / M = 2 * 1000 / 250 = 8 failures-GPU; f/b - 1 = 2 record files between fulls
    t = wasted_time_terms(hand_model(), 6, 2)
    assert set(t) == {"lost_work", "full_recovery", "replay", "full_writes", "batch_writes"}
    assert t["lost_work"] == pytest.approx(4.0)  # 8 * 2*0.5/2
    assert t["full_recovery"] == pytest.approx(24.0)  # 8 * 3
    assert t["replay"] == pytest.approx(13.6)  # 8 * 1.7/2 * 2
    assert t["full_writes"] == pytest.approx(22000 / 3)  # 2*1000*11 / (6*0.5)
    assert t["batch_writes"] == pytest.approx(3600.0)  # 2*1000*2.7 / 3 * 2
    assert wasted_time(hand_model(), 6, 2) == pytest.approx(4 + 24 + 13.6 + 22000 / 3 + 3600)


def test_terms_sum_to_wasted_time_everywhere():
    m = realistic()
    for f, b in [(1, 1), (7, 3), (30, 3), (100, 7), (1000, 32)]:
        assert math.fsum(wasted_time_terms(m, f, b).values()) == wasted_time(m, f, b)


def test_f_equal_b_has_no_record_files():
    # f = b: every batch is followed by a full checkpoint, so no record file is ever replayed
    t = wasted_time_terms(hand_model(), 4, 4)
    assert t["replay"] == 0.0 and t["batch_writes"] == 0.0


def test_wasted_time_scales_with_gpus():
    a, b = wasted_time(hand_model(n_gpus=1), 6, 2), wasted_time(hand_model(n_gpus=4), 6, 2)
    assert b == pytest.approx(4 * a)


def test_continuous_f_by_hand():
    # sqrt(2 M b (C_F - C_B(b)) / (tau R_B(b))) = sqrt(2*250*2*8.3 / (0.5*1.7))
    assert continuous_f(hand_model(), 2) == pytest.approx(math.sqrt(8300 / 0.85))


def _golden_min(fn, lo: float, hi: float) -> float:
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    for _ in range(200):
        c, d = b - g * (b - a), a + g * (b - a)
        if fn(c) < fn(d):
            b = d
        else:
            a = c
    return (a + b) / 2


@pytest.mark.parametrize("b", [1, 2, 3, 8, 10])
@pytest.mark.parametrize("make", [hand_model, realistic])
def test_continuous_f_is_the_minimiser_over_real_f(make, b):
    from lowdiff.plan.model import _wasted_real

    m = make()
    fc = continuous_f(m, b)
    assert fc is not None
    numeric = _golden_min(lambda x: _wasted_real(m, x, b), 1e-3, 100 * fc)
    assert abs(numeric - fc) <= 0.01 * fc
    # and the real-f formula is the integer one where f is an integer
    assert _wasted_real(m, 60.0, b) == pytest.approx(wasted_time(m, 60, b))


def test_no_stationary_point_when_a_full_is_cheaper_than_a_batch():
    # C_F <= C_B(b): T_w grows with f, so the best f for such a b is b itself
    m = hand_model(full_bytes=1.0, full_latency=0.0, batch_latency=5.0)
    assert m.c_f() <= m.c_b(1)
    assert continuous_f(m, 1) is None
    p = optimize(m, b_values=[3])
    assert (p.f, p.b) == (3, 3)


# --------------------------------------------------------------------------- argmin


def _brute(m: CostModel, f_max: int, b_max: int = 32) -> tuple[int, int, float]:
    best = min(
        ((wasted_time(m, f, b), f, b) for b in range(1, b_max + 1) for f in range(b, f_max + 1)),
    )
    return best[1], best[2], best[0]


@pytest.mark.parametrize(
    "m",
    [
        hand_model(),
        hand_model(batch_latency=20.0),
        hand_model(mtbf=20.0),
        realistic(mtbf=600.0, full_bytes=4e8),
        realistic(mtbf=120.0, full_bytes=1e8, batch_latency=0.5),
    ],
)
def test_optimize_equals_brute_force(m):
    p = optimize(m)
    fcs = [continuous_f(m, b) or 0.0 for b in range(1, 33)]
    f_max = max(64, math.ceil(3 * max(fcs)))
    assert f_max < 2000  # the brute force stays small
    f, b, w = _brute(m, f_max)
    assert (p.f, p.b) == (f, b)
    assert p.wasted_s == w
    q = optimize_exact(m)  # three evaluations per b find the same pair
    assert (q.f, q.b, q.wasted_s) == (f, b, w)
    assert len(q.grid) <= 3 * 32
    assert p.grid[(p.f, p.b)] == p.wasted_s
    assert all(v >= p.wasted_s for v in p.grid.values())
    assert all(1 <= bb <= ff for ff, bb in p.grid)


def test_optimize_over_given_candidates_is_their_argmin():
    m = realistic()
    fs, bs = [10, 30, 50, 100], [1, 2, 3, 4, 5, 6]
    p = optimize(m, fs, bs)
    assert set(p.grid) == {(f, b) for f in fs for b in bs}
    assert p.wasted_s == min(wasted_time(m, f, b) for f in fs for b in bs)
    table = p.table(fs, bs)
    assert table[(p.f, p.b)] == 1.0
    assert min(v for v in table.values() if v is not None) == 1.0


def test_table_marks_infeasible_pairs():
    p = optimize(hand_model(), [2, 4], [1, 3])
    t = p.table([2, 4], [1, 3])
    assert t[(2, 3)] is None and t[(4, 3)] is not None


def test_default_f_values_hold_every_continuous_optimum():
    m = realistic()
    fs = set(default_f_values(m))
    for b in range(1, 33):
        fc = continuous_f(m, b)
        assert fc is not None
        assert math.floor(fc) in fs and math.ceil(fc) in fs
        assert b in fs
    assert max(fs) >= 4 * max(continuous_f(m, b) or 0 for b in range(1, 33))


def test_plan_reports_f_c_and_terms():
    p = optimize(realistic())
    assert p.f_c == continuous_f(p.model, p.b)
    assert p.f in (math.floor(p.f_c), math.ceil(p.f_c))  # type: ignore[arg-type]
    d = p.as_dict()
    assert d["f"] == p.f and d["b"] == p.b and d["wasted_s"] == p.wasted_s
    assert math.fsum(d["terms"].values()) == p.wasted_s
    assert d["inputs"]["mtbf"] == 3600.0


# --------------------------------------------------------------------------- behaviour


def test_smaller_mtbf_gives_smaller_f():
    fs = [optimize(realistic(mtbf=mtbf)).f for mtbf in (86400.0, 3600.0, 600.0, 60.0)]
    assert fs == sorted(fs, reverse=True)
    assert fs[-1] < fs[0]


def test_slower_writes_give_larger_f():
    fast = optimize(realistic(write_bw=4e9)).f
    slow = optimize(realistic(write_bw=2.5e8)).f
    assert slow > fast


def test_large_batch_latency_makes_batching_pay():
    # the paper: a small b means many I/O requests; with a fixed cost per request, b* > 1
    cheap = optimize(realistic(mtbf=60.0, batch_latency=0.0, batch_overhead_bytes=0.0))
    costly = optimize(realistic(mtbf=60.0, batch_latency=0.2))
    assert cheap.b == 1
    assert costly.b > 1


def test_frequent_failures_shrink_b():
    # lost work (b tau / 2 per failure) grows with the failure rate
    rare = optimize(realistic(mtbf=86400.0, batch_latency=0.2))
    often = optimize(realistic(mtbf=60.0, batch_latency=0.2))
    assert often.b < rare.b


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "field,value",
    [
        ("tau", 0.0),
        ("total_time", -1.0),
        ("mtbf", 0.0),
        ("full_bytes", 0.0),
        ("record_bytes", 0.0),
        ("write_bw", 0.0),
        ("read_bw", -5.0),
        ("batch_latency", -0.1),
        ("full_latency", float("nan")),
        ("full_recovery_s", float("inf")),
        ("replay_s_per_record", -1.0),
        ("decompress_s_per_record", "1"),
        ("batch_overhead_bytes", -1.0),
        ("n_gpus", 0),
        ("n_gpus", 1.5),
        ("n_gpus", True),
    ],
)
def test_bad_inputs_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"CostModel.{field}"):
        hand_model(**{field: value})


def test_zero_latencies_and_costs_are_allowed():
    m = hand_model(
        full_latency=0.0,
        batch_latency=0.0,
        full_recovery_s=0.0,
        decompress_s_per_record=0.0,
        replay_s_per_record=0.0,
        batch_overhead_bytes=0.0,
    )
    assert wasted_time(m, 6, 2) > 0


def test_model_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        hand_model().tau = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("f,b", [(2, 3), (0, 0), (5, 0), (5.0, 1), (5, True), (-1, 1)])
def test_wasted_time_rejects_bad_pairs(f, b):
    with pytest.raises(ValueError, match="f|b"):
        wasted_time(hand_model(), f, b)


def test_continuous_f_rejects_bad_b():
    with pytest.raises(ValueError, match="b must be"):
        continuous_f(hand_model(), 0)


def test_optimize_rejects_bad_candidates():
    with pytest.raises(ValueError, match="no candidate pair"):
        optimize(hand_model(), f_values=[1, 2], b_values=[3])
    with pytest.raises(ValueError, match="f_values"):
        optimize(hand_model(), f_values=[0, 2])
    with pytest.raises(ValueError, match="b_values"):
        optimize(hand_model(), b_values=[1.5])  # type: ignore[list-item]

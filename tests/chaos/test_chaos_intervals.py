"""Each baseline's own interval policy in ``lowdiff chaos`` (Young–Daly, CheckFreq's own)."""

from __future__ import annotations

import math

import pytest

from lowdiff_lab.chaos.run import _policy
from lowdiff_lab.chaos.settings import (
    YOUNG_DALY,
    ChaosSettings,
    method_config,
    parse_method,
    young_daly_interval,
)


def test_young_daly_interval_is_sqrt_2cm_in_steps() -> None:
    assert young_daly_interval(0.02, 100.0, 0.1) == 20
    assert young_daly_interval(0.5, 3600.0, 1.0) == 60
    # it grows with the checkpoint cost and the MTBF, as sqrt
    assert young_daly_interval(0.08, 100.0, 0.1) == 40
    assert young_daly_interval(0.02, 400.0, 0.1) == 40
    # a free checkpoint, or one much cheaper than a step: every step
    assert young_daly_interval(0.0, 100.0, 0.1) == 1
    assert young_daly_interval(1e-6, 1.0, 0.1) == 1
    for c, m, tau in ((0.003, 7.0, 0.02), (0.2, 50.0, 0.05)):
        assert young_daly_interval(c, m, tau) == round(math.sqrt(2 * c * m) / tau)


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((-0.1, 10.0, 0.1), "cost_s"),
        ((0.1, 0.0, 0.1), "mtbf_s"),
        ((0.1, 10.0, 0.0), "tau_s"),
        ((0.1, math.inf, 0.1), "mtbf_s"),
        ((math.nan, 10.0, 0.1), "cost_s"),
    ],
)
def test_young_daly_interval_names_a_bad_input(args: tuple[float, ...], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        young_daly_interval(*args)


def test_each_baseline_gets_its_own_policy() -> None:
    s = ChaosSettings(quick=True)
    assert s.interval == YOUNG_DALY
    ts, dcp = parse_method("torch-save"), parse_method("dcp-async")
    # the Young–Daly interval at the job's MTBF
    assert method_config(ts, s, None, 7)["full_every"] == 7
    assert method_config(dcp, s, None, 13)["full_every"] == 13
    assert _policy("torch-save", s) == _policy("dcp-async", s) == "Young–Daly"
    assert method_config(parse_method("checkfreq"), s, None)["full_every"] == "auto"
    gem = method_config(parse_method("gemini"), s, None)
    assert gem["full_every"] == 1 and gem["strategy_options"]["persist_every"] == 10
    fixed = ChaosSettings(quick=True, interval=4, persist_interval=6)
    assert method_config(ts, fixed, None)["full_every"] == 4
    assert _policy("torch-save", fixed) == "fixed"
    assert method_config(parse_method("naive-dc"), fixed, None)["full_every"] == 6
    with pytest.raises(ValueError, match="--interval must be 'young-daly' or an integer >= 1"):
        ChaosSettings(quick=True, interval="often")

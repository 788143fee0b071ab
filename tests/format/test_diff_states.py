from __future__ import annotations

import torch

from lowdiff.state.capture import diff_states, snapshot_state


def test_diff_states_reports_every_kind_of_difference():
    base = {"a": torch.zeros(3), "b": torch.ones(2, dtype=torch.int64), "c": torch.ones(4)}
    assert diff_states(base, {k: v.clone() for k, v in base.items()}) == []
    got = {
        "a": torch.tensor([0.0, 0.0, 1e-30]),  # one element differs
        "b": torch.ones(2, dtype=torch.int32),  # same values, other dtype
        "d": torch.ones(1),  # not in want
    }
    assert diff_states(base, got) == ["a", "b", "extra d", "missing c"]
    assert diff_states({"x": torch.zeros(2, 2)}, {"x": torch.zeros(4)}) == ["x"]  # shape


def test_snapshot_state_is_a_copy():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = snapshot_state(model, opt)
    with torch.no_grad():
        model.weight.add_(1)
    assert diff_states(snap, snapshot_state(model, opt)) == ["model/weight"]

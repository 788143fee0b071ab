"""lowdiff's work on the training process is visible in torch.profiler traces."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

import lowdiff


def _names(prof) -> set[str]:
    return {e.name for e in prof.events()}


def test_step_and_attach_show_their_ranges(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 4)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    ck = lowdiff.Checkpointer(tmp_path / "a", m, o, compressor=lowdiff.TopK(0.5))
    ck.resume()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            m(torch.randn(2, 8)).sum().backward()
            ck.step()
            o.zero_grad()
    ck.close()
    assert {"lowdiff.take_gradients", "lowdiff.after_update"} <= _names(prof)

    ck = lowdiff.attach(tmp_path / "b", m, o, compressor=lowdiff.TopK(0.5))
    ck.resume()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            m(torch.randn(2, 8)).sum().backward()
            o.step()
            o.zero_grad()
    ck.close()
    assert {"lowdiff.take_gradients", "lowdiff.after_update", "lowdiff.handover"} <= _names(prof)

"""Recovery's reader decodes at most a bounded number of bytes of gradients ahead.

The dense gradients of the records queued ahead of replay live on the parameters'
devices; eight of them would need eight times a large model's size beside the model. The
bound (:data:`lowdiff.recovery.replay.READ_AHEAD_BYTES`) leaves a large model one record
ahead, and replay one record ahead restores the same bits as eight ahead.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import lowdiff
from lowdiff.recovery import replay
from lowdiff.state.capture import diff_states, snapshot_state

pytestmark = pytest.mark.multiprocess


def _layout(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> SimpleNamespace:
    return SimpleNamespace(params=[SimpleNamespace(shape=s, dtype=dtype) for s in shapes])


def test_the_read_ahead_is_bounded_by_bytes():
    small = _layout((16, 16), (16,))
    assert replay.read_ahead([(small, [])]) == replay.READ_AHEAD_RECORDS
    # a 100M-parameter fp32 model: 400 MB of gradients a record, one record ahead
    large = _layout((100_000, 1000))
    assert replay.read_ahead([(large, [])]) == 1
    # in between: as many records as fit in the budget; every shard's gradients count
    mid = _layout((24 << 20,), dtype=torch.float16)  # 48 MiB a record
    assert replay.read_ahead([(mid, [])]) == 5  # 256 MiB // 48 MiB
    assert replay.read_ahead([(mid, []), (mid, [])]) == 2  # 256 MiB // 96 MiB


def _train(directory, steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ck = lowdiff.Checkpointer(
        directory,
        model,
        opt,
        compressor=lowdiff.TopK(ratio=0.25),
        full_every=20,
        records_per_file=3,
    )
    ck.resume()
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ((model(torch.randn(6, 8, generator=g)) - 1) ** 2).mean().backward()
        ck.step()
        opt.zero_grad(set_to_none=True)
    ck.close()
    return model, opt


def test_one_record_ahead_restores_the_same_bits(tmp_path, monkeypatch):
    model, opt = _train(tmp_path, 12)
    want = snapshot_state(model, opt)
    depths: list[int] = []
    original = replay.read_ahead

    def spy(sources):
        depths.append(original(sources))
        return depths[-1]

    monkeypatch.setattr(replay, "READ_AHEAD_BYTES", 1)  # smaller than one record
    monkeypatch.setattr(replay, "read_ahead", spy)
    fresh = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert lowdiff.restore(tmp_path, fresh, fresh_opt) == 12
    assert depths == [1]  # the 12 records after the full checkpoint at 0, one ahead
    assert diff_states(want, snapshot_state(fresh, fresh_opt)) == []

"""CUDA path: records leave the GPU as IPC handles; the checkpointing process copies them."""

from __future__ import annotations

import pytest
import torch

import lowdiff
from lowdiff.engine.state import state_tensors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multiprocess,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _build():
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(64, 128),
        torch.nn.BatchNorm1d(128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 10),
    ).cuda()
    return m, torch.optim.Adam(m.parameters(), lr=1e-3)


def test_cuda_records_replay_exactly(tmp_path):
    m, o = _build()
    snaps = {}
    with lowdiff.Checkpointer(
        m, o, tmp_path / "ck", compressor=lowdiff.TopK(0.05), full_every=5, batch_size=3
    ) as ck:
        ck.resume()
        for i in range(12):
            g = torch.Generator(device="cuda").manual_seed(i)
            m(torch.randn(32, 64, device="cuda", generator=g)).pow(2).mean().backward()
            ck.step()
            o.zero_grad()
            snaps[i + 1] = {k: v.clone() for k, v in state_tensors(m, o).items()}
    for s in (10, 12):
        m2, o2 = _build()
        assert lowdiff.restore(tmp_path / "ck", m2, o2, step=s) == s
        got = state_tensors(m2, o2)
        assert [k for k in snaps[s] if not torch.equal(snaps[s][k], got[k])] == []

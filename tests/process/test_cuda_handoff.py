"""CUDA path: records are copied into pinned host slots on a side stream before they are handed over."""

from __future__ import annotations

import pytest
import torch

import lowdiff
from lowdiff.state.capture import state_tensors

from .test_sigkill_recovery import cpu_replica_diffs

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
        tmp_path / "ck", m, o, compressor=lowdiff.TopK(0.05), full_every=5, records_per_file=3
    ) as ck:
        ck.resume()
        for i in range(12):
            g = torch.Generator(device="cuda").manual_seed(i)
            m(torch.randn(32, 64, device="cuda", generator=g)).pow(2).mean().backward()
            ck.step()
            o.zero_grad()
            snaps[i + 1] = {k: v.clone() for k, v in state_tensors(m, o).items()}
        assert ck.stats["slots_pinned"] == 1.0  # the side stream's copies are asynchronous
    for s in (10, 12):
        m2, o2 = _build()
        assert lowdiff.restore(tmp_path / "ck", m2, o2, step=s) == s
        got = state_tensors(m2, o2)
        assert [k for k in snaps[s] if not torch.equal(snaps[s][k], got[k])] == []


def test_cuda_lowdiff_plus_replica_matches_trainer(tmp_path):
    """LowDiff+ on CUDA: pinned snapshots on a side stream feed the CPU replica.

    The replica's optimizer step runs on the CPU, whose kernels round differently from
    CUDA's (fused multiply-add), so floating-point state agrees to rounding, not bit for
    bit; step counters and every non-float tensor are exact. A second Checkpointer in the
    same process must pin its buffers again (the first one's registration is released).
    """
    m, o = _build()
    snaps = {}
    with lowdiff.Checkpointer(
        tmp_path / "ck",
        m,
        o,
        method="lowdiff+",
        compressor=None,
        keep_full=None,
        replica=lowdiff.ReplicaOptions(persist_every=1),
    ) as ck:
        ck.resume()
        for i in range(8):
            g = torch.Generator(device="cuda").manual_seed(i)
            m(torch.randn(32, 64, device="cuda", generator=g)).pow(2).mean().backward()
            assert torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01) > 0.01  # it fired
            ck.step()
            o.zero_grad()
            snaps[i + 1] = {k: v.detach().cpu().clone() for k, v in state_tensors(m, o).items()}
        assert ck.stats["slots_pinned"] == 1.0
        # every gradient changed after its hook at every step: from the second step on,
        # they are copied to host memory once, in ck.step(), not during backward too
        assert ck.strategy_impl.snapshotter.stats.deferred == 7
    for s in (4, 8):
        m2, o2 = _build()
        assert lowdiff.restore(tmp_path / "ck", m2, o2, step=s) == s
        got = {k: v.detach().cpu() for k, v in state_tensors(m2, o2).items()}
        unequal_integers, far = cpu_replica_diffs(snaps[s], got)
        assert unequal_integers == []
        assert far == []


def test_cuda_lowdiff_plus_twice_in_one_process(tmp_path):
    for run in range(2):
        m, o = _build()
        with lowdiff.Checkpointer(
            tmp_path / f"ck{run}", m, o, method="lowdiff+", compressor=None
        ) as ck:
            for _ in range(3):
                m(torch.randn(32, 64, device="cuda")).pow(2).mean().backward()
                ck.step()
                o.zero_grad()
        assert lowdiff.inspect_dir(tmp_path / f"ck{run}").recoverable[1] == 3

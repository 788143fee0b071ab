"""Accelerate: lowdiff.attach on the optimizer under accelerator.prepare's
AcceleratedOptimizer. Its step hooks fire once per real update (gradient accumulation
included), and every step restores exactly."""

from __future__ import annotations

import pytest
import torch

import lowdiff
from lowdiff.state.capture import diff_states, state_tensors

accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed")


def _build():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    s = torch.optim.lr_scheduler.StepLR(o, 2, 0.7)
    return m, o, s


def _data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 6, generator=g)
    return torch.utils.data.TensorDataset(x, x[:, :2].sin())


def test_attach_under_accelerator_prepare(tmp_path):
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    m, o, s = _build()
    loader = torch.utils.data.DataLoader(_data(), batch_size=4)
    pm, po, ploader, ps = acc.prepare(m, o, loader, s)
    assert type(po).__name__ == "AcceleratedOptimizer" and po.optimizer is o
    # the hooks go on the torch optimizer under the wrapper (the wrapper's own step()
    # calls it only when the gradients are synced)
    ck = lowdiff.attach(
        tmp_path / "ck",
        pm,
        po.optimizer,
        scheduler=ps.scheduler,
        compressor=lowdiff.TopK(0.25, error_feedback=False),
        full_every=4,
        records_per_file=2,
        keep_full=None,
    )
    assert ck.resume() == 0
    snaps = {}
    for x, y in ploader:  # 12 batches, 2 per update: 6 updates
        with acc.accumulate(pm):
            acc.backward(torch.nn.functional.mse_loss(pm(x), y))
            po.step()
            ps.step()
            po.zero_grad()
        if acc.sync_gradients:
            snaps[ck.step_count] = {k: v.clone() for k, v in state_tensors(m, o, s).items()}
    assert ck.step_count == 6 and sorted(snaps) == [1, 2, 3, 4, 5, 6]
    ck.close()
    for step in (6, 5, 3):
        m2, o2, s2 = _build()
        assert lowdiff.restore(tmp_path / "ck", m2, o2, s2, step=step) == step
        got = state_tensors(m2, o2, s2)
        want = {k: v for k, v in snaps[step].items() if not k.startswith("rng")}
        assert diff_states(want, {k: v for k, v in got.items() if not k.startswith("rng")}) == []

    # a new process would do the same: attach again under prepare, resume() at step 6
    m3, o3, s3 = _build()
    pm3, po3, ps3 = accelerate.Accelerator(cpu=True).prepare(m3, o3, s3)
    ck = lowdiff.attach(
        tmp_path / "ck",
        pm3,
        po3.optimizer,
        scheduler=ps3.scheduler,
        compressor=lowdiff.TopK(0.25, error_feedback=False),
    )
    assert ck.resume() == 6
    ck.close()
    got = state_tensors(m3, o3, s3)
    assert (
        diff_states(
            {k: v for k, v in snaps[6].items() if not k.startswith("rng")},
            {k: v for k, v in got.items() if not k.startswith("rng")},
        )
        == []
    )


def test_a_prepared_loader_needs_use_stateful_dataloader(tmp_path):
    """A loader prepared without ``use_stateful_dataloader=True`` has a ``state_dict()``
    that raises: attach names the entry, its type and the setting at once, before anything
    is written. With the setting, its position is saved with every step and resumed."""
    from accelerate.utils import DataLoaderConfiguration

    m, o, _ = _build()
    pm, po, ploader = accelerate.Accelerator(cpu=True).prepare(
        m, o, torch.utils.data.DataLoader(_data(), batch_size=4)
    )
    want = (
        r"extra_state\['data'\] \(DataLoaderShard\): its state_dict\(\) raised AttributeError"
        r".*use_stateful_dataloader=True"
    )
    with pytest.raises(lowdiff.LowDiffError, match=want):
        lowdiff.attach(
            tmp_path / "ck",
            pm,
            po.optimizer,
            extra_state={"data": ploader},
            compressor=lowdiff.TopK(ratio=0.01),
        )
    assert not (tmp_path / "ck").exists()

    def prepared():
        acc = accelerate.Accelerator(
            cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True)
        )
        m, o, _ = _build()
        return acc.prepare(m, o, torch.utils.data.DataLoader(_data(), batch_size=4))

    pm, po, ploader = prepared()
    ck = lowdiff.attach(tmp_path / "ck", pm, po.optimizer, compressor=None, extra_state={"data": ploader})  # fmt: skip
    assert ck.resume() == 0
    for i, (x, y) in enumerate(ploader):
        torch.nn.functional.mse_loss(pm(x), y).backward()
        po.step()
        po.zero_grad()
        if i == 4:
            break
    ck.close()
    pm, po, ploader = prepared()
    ck = lowdiff.attach(tmp_path / "ck", pm, po.optimizer, compressor=None, extra_state={"data": ploader})  # fmt: skip
    assert ck.resume() == 5
    ck.close()
    x, _ = next(iter(ploader))  # the sixth batch of the epoch
    assert torch.equal(x, _data().tensors[0][20:24])

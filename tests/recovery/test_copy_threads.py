"""Loading a full state copies on one intra-op thread, and gives the caller's count back.

The copies out of a checkpoint (a file, or a surviving process's memory) run under
:func:`lowdiff.recovery.replay.one_copy_thread`; the state loaded must be the same bits as
with any thread count, and the trainer's thread count must be what it was before, after
a load that succeeded and after one that failed.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lowdiff.errors import CheckpointMismatchError
from lowdiff.recovery import full_state as replay
from lowdiff.recovery.full_state import apply_full_state, one_copy_thread
from lowdiff.recovery.stats import RecoveryStats
from lowdiff.state.capture import diff_states, snapshot_state

pytestmark = pytest.mark.skipif(
    not replay._openmp_backend(), reason="torch's thread count is changed under OpenMP only"
)


@pytest.fixture
def two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


def test_one_copy_thread_restores_the_count_after_an_error(two_threads):
    seen = []
    with pytest.raises(RuntimeError, match="boom"), one_copy_thread():
        seen.append(torch.get_num_threads())
        raise RuntimeError("boom")
    assert seen == [1]
    assert torch.get_num_threads() == 2


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(16, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _full_state(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The tensors and metadata of a full checkpoint, as the staging copy makes them."""
    from lowdiff.format import codec
    from lowdiff.state import capture as st

    msd, aliases = st.model_state(model)
    otensors, ojson = st.optimizer_state_tensors(opt)
    tensors = {f"model/{k}": v.clone() for k, v in msd.items()}
    tensors.update({k: v.clone() for k, v in otensors.items()})
    meta = {
        "model_aliases": codec.dumps(aliases),
        "optim": ojson,
        "scheduler": "null",
        "rng": codec.dumps(None),
    }
    return tensors, meta


def _load(tensors: dict, meta: dict, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    stats = RecoveryStats(full_step=3, step=3)
    apply_full_state(tensors, meta, model, opt, None, stats, where="test", restore_rng=False)


def test_a_full_state_loads_the_same_bits_and_keeps_the_thread_count(two_threads):
    src_model, src_opt = _trained(0)
    tensors, meta = _full_state(src_model, src_opt)
    model, opt = _trained(1)  # other values, same shapes
    assert diff_states(snapshot_state(model, opt), snapshot_state(src_model, src_opt))
    seen: list[int] = []
    load = opt.load_state_dict
    opt.load_state_dict = lambda sd: (seen.append(torch.get_num_threads()), load(sd))[1]
    _load(tensors, meta, model, opt)
    assert seen == [1]  # the optimizer state went in on one thread
    assert torch.get_num_threads() == 2
    assert diff_states(snapshot_state(model, opt), snapshot_state(src_model, src_opt)) == []


def test_a_mismatched_model_is_refused_and_the_thread_count_kept(two_threads):
    src_model, src_opt = _trained(0)
    tensors, meta = _full_state(src_model, src_opt)
    other = nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.Linear(128, 8))
    opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    with pytest.raises(CheckpointMismatchError, match="the model does not match"):
        _load(tensors, meta, other, opt)
    assert torch.get_num_threads() == 2

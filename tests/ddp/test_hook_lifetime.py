"""The callbacks lowdiff's DDP hooks chain to their collectives never own the process group.

Those callbacks run on the process group's worker thread, which drops them after they
return. Had one held the group, it could drop the group's last reference there, once the
trainer had destroyed the group and its model, and the group's destructor, joining its own
worker thread, would abort the process.
"""

from __future__ import annotations

import gc
import sys
import types
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import lowdiff


def _reaches_a_process_group(roots: list[Any], limit: int = 200_000) -> bool:
    """Whether a strong reference path leads from ``roots`` to a process group (module
    globals and types are not followed: they are reachable from everything)."""
    module_dicts = {id(m.__dict__) for m in list(sys.modules.values()) if m is not None}
    seen: set[int] = set()
    todo = list(roots)
    while todo and len(seen) < limit:
        obj = todo.pop()
        if id(obj) in seen or id(obj) in module_dicts:
            continue
        seen.add(id(obj))
        if isinstance(obj, dist.ProcessGroup):
            return True
        if isinstance(obj, (type, types.ModuleType)):
            continue
        if isinstance(obj, types.FunctionType):
            todo.extend(c.cell_contents for c in obj.__closure__ or () if _filled(c))
            continue
        todo.extend(gc.get_referents(obj))
    assert len(seen) < limit, "the reference walk did not finish"
    return False


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["lowdiff", "lowdiff+"])
def test_hook_callbacks_hold_no_process_group(tmp_path, one_rank_group, monkeypatch, strategy):
    callbacks: list[Any] = []
    then = torch._C.Future.then  # what get_future() returns

    def recording_then(self: Any, callback: Any) -> Any:
        callbacks.append(callback)
        return then(self, callback)

    monkeypatch.setattr(torch._C.Future, "then", recording_then)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw: dict[str, Any] = {"compressor": lowdiff.TopK(0.5)} if strategy == "lowdiff" else {}
    with lowdiff.Checkpointer(model, opt, tmp_path / "ck", strategy=strategy, **kw) as ck:
        ck.resume()
        model(torch.randn(4, 6)).pow(2).sum().backward()
        ck.step()
        opt.zero_grad()
        # the hooks ran and chained callbacks, and the group is reachable from the hook's state
        assert callbacks
        assert _reaches_a_process_group([ck.strategy_impl])
        for cb in callbacks:
            assert not _reaches_a_process_group([cb]), cb

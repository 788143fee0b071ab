"""The optimizer of LowDiff+'s CPU replica: the trainer's own class, stepped in shards.

The replica runs exactly the update the trainer ran (PyTorch's CPU kernels, the trainer's
optimizer class, groups and flags); :class:`ShardedOptimizer` splits it across threads
without changing a bit of the result.
"""

from __future__ import annotations

import importlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from lowdiff.errors import InvalidArgumentError
from lowdiff.state import capture as st


def optimizer_class(path: str) -> type[torch.optim.Optimizer]:
    module, _, name = path.rpartition(".")
    if not (module == "torch.optim" or module.startswith("torch.optim.")):
        raise InvalidArgumentError(
            f"method 'lowdiff+' runs the optimizer on the CPU replica and supports torch.optim optimizers; got {path}"
        )
    cls = getattr(importlib.import_module(module), name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise InvalidArgumentError(f"{path} is not a torch.optim optimizer")
    return cls


def balanced_shards(numels: list[int], n: int) -> list[list[int]]:
    """Split parameter indices into at most ``n`` shards of about equal total numel.

    Largest first onto the lightest shard (LPT); each shard keeps its indices in ascending
    order, and empty shards are dropped (fewer parameters than ``n``).
    """
    if n < 1:
        raise InvalidArgumentError(f"n must be at least 1, got {n}")
    loads = [0] * n
    members: list[list[int]] = [[] for _ in range(n)]
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        k = min(range(n), key=lambda k: (loads[k], k))
        loads[k] += max(1, numels[i])
        members[k].append(i)
    return [sorted(m) for m in members if m]


class ShardedOptimizer:
    """The trainer's optimizer over the replica's parameters, stepped in parallel shards.

    ``master`` is an instance of the trainer's class with the trainer's groups, flags and
    state; it holds the hyperparameters and the full ``state`` (what ``state_dict()``
    describes). With ``threads > 1`` the parameters are split into balanced shards (by
    numel), each driven by its own optimizer instance of the same class, whose groups share
    the master's hyperparameter values and whose per-parameter state dicts are the master's
    own objects; the shards are stepped in parallel threads (torch's kernels release the
    GIL). torch.optim's element-wise optimizers update each parameter from its own gradient
    and state only, and their for-loop, foreach and fused kernels group tensors without
    mixing them, so a sharded step gives the same bits as one step over all parameters
    (tests/plus/test_replica_sharded.py checks it for Adam, AdamW and SGD).

    Args:
        cls: the trainer's optimizer class.
        params: the replica's parameters, in the trainer's optimizer order.
        osd: the trainer's ``optimizer.state_dict()`` with tensors already resolved.
        threads: parallel shards (at most one per parameter).
    """

    def __init__(
        self,
        cls: type[torch.optim.Optimizer],
        params: list[torch.nn.Parameter],
        osd: dict[str, Any],
        threads: int = 1,
    ) -> None:
        groups = [
            {
                "params": [params[i] for i in g["params"]],
                **{k: v for k, v in g.items() if k != "params"},
            }
            for g in osd["param_groups"]
        ]
        self.master = cls(groups)  # type: ignore[call-arg]
        self.master.load_state_dict(osd)
        self.shards: list[torch.optim.Optimizer] = [self.master]
        self._pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []
        """(shard group, master group): the shard group takes the master's values."""
        self._pool: ThreadPoolExecutor | None = None
        self._owner: list[tuple[torch.Tensor, torch.optim.Optimizer]] = []
        """(parameter, its shard) in the master's parameter order."""
        parts = balanced_shards([p.numel() for p in params], threads)
        if len(parts) > 1:
            self.shards = []
            for part in parts:
                mine = {id(params[i]) for i in part}
                sgroups = []
                masters = []
                for g in self.master.param_groups:
                    ps = [p for p in g["params"] if id(p) in mine]
                    if ps:
                        sgroups.append(
                            {"params": ps, **{k: v for k, v in g.items() if k != "params"}}
                        )
                        masters.append(g)
                opt = cls(sgroups)  # type: ignore[call-arg]
                for sg, mg in zip(opt.param_groups, masters, strict=True):
                    self._pairs.append((sg, mg))
                    for p in sg["params"]:
                        if p in self.master.state:
                            opt.state[p] = self.master.state[p]  # one dict, two owners
                self.shards.append(opt)
            where = {id(p): o for o in self.shards for g in o.param_groups for p in g["params"]}
            self._owner = [(p, where[id(p)]) for g in self.master.param_groups for p in g["params"]]
            self._pool = ThreadPoolExecutor(len(self.shards), thread_name_prefix="lowdiff-shard")

    @property
    def state(self) -> Any:
        return self.master.state

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.master.param_groups

    def state_dict(self) -> dict[str, Any]:
        return self.master.state_dict()

    def apply_hparams(self, hparams: list[dict[str, Any]]) -> None:
        st.apply_hparams(self.master, hparams)
        for sg, mg in self._pairs:
            for k, v in mg.items():
                if k != "params":
                    sg[k] = v

    def step(self) -> None:
        if self._pool is None:
            self.master.step()
            return
        for f in [self._pool.submit(o.step) for o in self.shards]:
            f.result()
        if len(self.master.state) != sum(len(o.state) for o in self.shards):
            # state created by this step (a parameter's first gradient): the master takes
            # it in parameter order, the order one optimizer over all of them creates it in
            # (its state_dict lists the state in that order)
            for p, o in self._owner:
                if p not in self.master.state and p in o.state:
                    self.master.state[p] = o.state[p]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

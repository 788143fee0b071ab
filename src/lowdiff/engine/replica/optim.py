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


ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
)
"""Optimizers whose update of an element reads that element's parameter, gradient and
state alone (and a step count per parameter): a parameter of theirs may be cut into
pieces stepped apart. Exact classes only: a subclass may override ``step``."""

ALIGN = 4096
"""Cuts fall at multiples of this many elements from a parameter's start. Each piece then
starts at the same offset, modulo any vector width, as in the whole tensor, and only the
last piece has a tail: every element goes through the same kernel lane, vectorized or
not, as in one call over the whole parameter."""


def piece_plan(numels: list[int], n: int, align: int = ALIGN) -> list[list[tuple[int, int, int]]]:
    """Lay the parameters end to end and cut them into at most ``n`` runs of about equal
    numel; each run as (parameter index, start, end) pieces in parameter order.

    A parameter is cut only where a run boundary falls inside it, rounded to a multiple of
    ``align`` elements (so parameters of at most ``align`` elements stay whole); empty
    runs are dropped.
    """
    if n < 1:
        raise InvalidArgumentError(f"n must be at least 1, got {n}")
    total = sum(numels)
    per = max(1, -(-total // n))
    runs: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
    off = 0
    for i, size in enumerate(numels):
        k = min(n - 1, off // per)
        start = 0
        for boundary in range((k + 1) * per, min(off + size, n * per), per):
            cut = round((boundary - off) / align) * align
            if start < cut < size:
                runs[k].append((i, start, cut))
                start = cut
            k = min(n - 1, boundary // per)
        runs[k].append((i, start, size))
        off += size
    return [r for r in runs if r]


class ShardedOptimizer:
    """The trainer's optimizer over the replica's parameters, stepped in parallel shards.

    ``master`` is an instance of the trainer's class with the trainer's groups, flags and
    state; it holds the hyperparameters and the whole ``state`` (what ``state_dict()``
    describes). With ``threads > 1`` the parameters are split into ``threads`` shards of
    about equal numel, each driven by its own optimizer of the same class, stepped in
    parallel threads (torch's kernels release the GIL):

    - for :data:`ELEMENTWISE` classes the parameters, laid end to end, are cut into equal
      runs (:func:`piece_plan`): one large parameter (an embedding) is shared between
      threads instead of making one thread the slowest. A cut piece is a view of its
      parameter, and its state tensors are views of the master's; its step count is the
      master's own tensor for the first piece and a copy for the others, which advance in
      step with it;
    - other classes are split by whole parameters (:func:`balanced_shards`), whose state
      dicts are the master's own objects.

    Element-wise kernels (for-loop, foreach, fused) compute each element from its own
    inputs, so a sharded step gives the bits of one step over all parameters
    (tests/plus/test_replica_sharded.py checks Adam, AdamW and SGD). A step in which some
    parameter takes its first gradient runs on the master alone: the state it creates is
    the master's, in the order one optimizer creates it; the shards are rebuilt after it.

    Args:
        cls: the trainer's optimizer class.
        params: the replica's parameters, in the trainer's optimizer order.
        osd: the trainer's ``optimizer.state_dict()`` with tensors already resolved.
        threads: parallel shards.
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
        self.cls = cls
        self.master = cls(groups)  # type: ignore[call-arg]
        self.master.load_state_dict(osd)
        self.threads = threads
        self.shards: list[torch.optim.Optimizer] = [self.master]
        self._params = [p for g in self.master.param_groups for p in g["params"]]
        self._pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []
        """(shard group, master group): the shard group takes the master's values."""
        self._cuts: list[tuple[torch.Tensor, torch.Tensor, int, int]] = []
        """(piece, its parameter, start, end) of every cut piece."""
        self._stepped: set[int] = set()
        """ids of the parameters that took a gradient in a step here."""
        self.stale = True
        """The shards must be (re)built before the next sharded step."""
        self._pool = (
            ThreadPoolExecutor(threads, thread_name_prefix="lowdiff-shard")
            if threads > 1 and len(self._params) > 0
            else None
        )

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

    def invalidate(self) -> None:
        """The parameters' or the state's tensors were replaced (the replica's arena
        moved): rebuild the shards' views before the next step."""
        self.stale = True

    def step(self, scale: torch.Tensor | None = None) -> None:
        """One update; with ``scale``, every gradient is first multiplied by it in place
        (the trainer's gradient clipping, carried as its factor)."""
        live = [p for p in self._params if p.grad is not None]
        state = self.master.state
        if self._pool is None or any(id(p) not in self._stepped and not state.get(p) for p in live):
            if scale is not None:
                torch._foreach_mul_([p.grad for p in live], scale)  # type: ignore[misc]
            self.master.step()
            self._stepped.update(id(p) for p in live)
            self.stale = True
            return
        if self.stale:
            self._build()
        for piece, p, a, b in self._cuts:
            g = p.grad
            piece.grad = None if g is None else g.view(-1)[a:b]
        for f in [self._pool.submit(_step_shard, o, scale) for o in self.shards]:
            f.result()

    def _build(self) -> None:
        """Split the parameters into shards with optimizers over their pieces."""
        numels = [p.numel() for p in self._params]
        if self.cls in ELEMENTWISE and all(_flat(p, self.master.state) for p in self._params):
            plan = piece_plan(numels, self.threads)
        else:
            parts = balanced_shards(numels, self.threads)
            plan = [[(i, 0, numels[i]) for i in part] for part in parts]
        group_of = {id(p): g for g in self.master.param_groups for p in g["params"]}
        self.shards, self._pairs, self._cuts = [], [], []
        for run in plan:
            by_group: dict[int, tuple[dict[str, Any], list[torch.Tensor]]] = {}
            states: list[tuple[torch.Tensor, dict[str, Any]]] = []
            for i, a, b in run:
                p = self._params[i]
                s = self.master.state.get(p)
                if a == 0 and b == numels[i]:
                    q: torch.Tensor = p
                else:
                    q = torch.nn.Parameter(p.detach().view(-1)[a:b], requires_grad=False)
                    s = _piece_state(s or {}, numels[i], a, b)
                    self._cuts.append((q, p, a, b))
                g = group_of[id(p)]
                by_group.setdefault(id(g), (g, []))[1].append(q)
                if s is not None:
                    states.append((q, s))
            sgroups = [
                {"params": ps, **{k: v for k, v in g.items() if k != "params"}}
                for g, ps in by_group.values()
            ]
            opt = self.cls(sgroups)  # type: ignore[call-arg]
            for sg, (mg, _) in zip(opt.param_groups, by_group.values(), strict=True):
                self._pairs.append((sg, mg))
            for q, s in states:
                opt.state[q] = s  # a whole parameter's: one dict, two owners
            self.shards.append(opt)
        self.stale = False

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _flat(p: torch.Tensor, state: Any) -> bool:
    """Whether ``p`` and its state tensors of its size can be viewed as 1-D runs."""
    return p.is_contiguous() and all(
        v.is_contiguous()
        for v in (state.get(p) or {}).values()
        if isinstance(v, torch.Tensor) and v.numel() == p.numel()
    )


def _piece_state(s: dict[str, Any], numel: int, a: int, b: int) -> dict[str, Any]:
    """A cut piece's state: views of the parameter's element-wise state tensors; its
    other tensors (the step count) the master's own for the first piece, copies for the
    others (each piece's optimizer advances its own)."""
    out: dict[str, Any] = {}
    for k, v in s.items():
        if isinstance(v, torch.Tensor) and v.numel() == numel:
            out[k] = v.view(-1)[a:b]
        elif isinstance(v, torch.Tensor) and a > 0:
            out[k] = v.clone()
        else:
            out[k] = v
    return out


def _step_shard(opt: torch.optim.Optimizer, scale: torch.Tensor | None) -> None:
    """One shard's update (on a thread of the pool)."""
    if scale is not None:
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, scale)
    opt.step()

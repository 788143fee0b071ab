"""Naive DC on the training side: the base copy, and the differences that move it on.

The trainer keeps a CPU copy of what a recovery would rebuild at the previous checkpoint
(the *base*), and computes each differential against it, on the parameters' device:
top-k of the model parameters' differences, the optimizer state's as ``new - base``
(top-k too with ``compress_optimizer``), and the small state whole (see
:mod:`lowdiff_lab.baselines.naive_dc`). The base then moves on with exactly the arithmetic
recovery uses (:func:`~lowdiff_lab.baselines.naive_dc_record.add_sparse`), so the two never
drift apart: an entry that top-k leaves out stays in the next difference.

A record is planned first (:class:`~lowdiff_lab.baselines.naive_dc_record.Packer`: sizes, so
that a slot can be taken), then filled into its slot, and only then is the base moved on
(:meth:`BaseCopy.apply`), from the slot's bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from lowdiff.compressors.sparse import TopK
from lowdiff.state import capture as st
from lowdiff_lab.baselines.naive_dc_record import (
    DIFF_KIND,
    Packer,
    SlotRef,
    sub_into,
    update_dense,
    update_sparse,
)


@dataclass
class DiffPlan:
    """A differential planned in a :class:`Packer`, and how it moves the base on."""

    record: dict[str, Any]
    """The record, with a :class:`SlotRef` per tensor (what the checkpointing process gets)."""
    updates: list[Callable[[torch.Tensor], None]] = field(default_factory=list)
    """Applied to the filled slot: base tensors moved on by their packed difference."""
    set_later: list[tuple[dict[str, torch.Tensor], str, SlotRef]] = field(default_factory=list)
    """Optimizer state stored whole: ``base[k]`` becomes a copy of the packed value."""
    new_opt: dict[Any, dict[str, torch.Tensor]] = field(default_factory=dict)
    """The optimizer base after this record (its entries are filled by :meth:`BaseCopy.apply`)."""


class BaseCopy:
    """The trainer's base: the state a recovery would rebuild at the last checkpoint.

    Args:
        model, optimizer, scheduler: the training objects.
        rng_layout: how the RNG states are captured (as for full checkpoints).
        ratio: top-k ratio of the differences.
        compress_optimizer: top-k the optimizer differences too.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any | None,
        rng_layout: st.RngLayout,
        ratio: float,
        compress_optimizer: bool,
    ) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.rng_layout = rng_layout
        self.topk = TopK(ratio, error_feedback=False)
        self.opt_topk = TopK(ratio, error_feedback=False) if compress_optimizer else None
        m = st.unwrap_model(model)
        named = list(m.named_parameters())
        self.float_params = [(n, p) for n, p in named if p.is_floating_point()]
        self.other_params = [(n, p) for n, p in named if not p.is_floating_point()]
        canonical = {id(p): n for n, p in named}
        self.aliases = {
            n: canonical[id(p)]
            for n, p in m.named_parameters(remove_duplicate=False)
            if n != canonical[id(p)]
        }
        """Names a tied parameter also has -> the name the state carries it under."""
        self.param_keys = {n for n, _ in m.named_parameters(remove_duplicate=False)}
        self._pin = any(p.device.type != "cpu" for _, p in named)
        self.params: dict[str, torch.Tensor] = {}
        """Floating-point parameters, flat, by name."""
        self.opt: dict[Any, dict[str, torch.Tensor]] = {}
        """Optimizer state tensors, by parameter index and key."""
        self.step = -1
        """The step the base stands for (-1: none yet)."""
        self._scratch: dict[torch.dtype, torch.Tensor] = {}

    def keep(self, t: torch.Tensor, reuse: torch.Tensor | None = None) -> torch.Tensor:
        """A private CPU copy for the base (page-locked when training runs on a device),
        written into ``reuse`` when that has the same shape and dtype."""
        if reuse is not None and reuse.shape == t.shape and reuse.dtype == t.dtype:
            return reuse.copy_(t)
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=self._pin)
        return out.copy_(t)

    def _delta(self, cur: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """``cur - base`` as a flat tensor on ``cur``'s device (a reused buffer on the CPU)."""
        flat = cur.detach().reshape(-1)
        if flat.device.type != "cpu":
            return flat - base.reshape(-1).to(flat.device, non_blocking=True)
        scratch = self._scratch.get(flat.dtype)
        if scratch is None or scratch.numel() < flat.numel():
            scratch = self._scratch[flat.dtype] = torch.empty(flat.numel(), dtype=flat.dtype)
        out = scratch[: flat.numel()]
        torch.sub(flat, base.reshape(-1), out=out)
        return out

    # ------------------------------------------------------------------ rebasing
    def rebase_full(self, spec: dict[str, Any], buf: torch.Tensor) -> None:
        """A full checkpoint was packed into ``buf``: it becomes the base (its
        :attr:`step` is set once the record is handed off)."""
        model, osd = spec["model"], spec["optimizer"]["state"]
        old_params, old_opt = self.params, self.opt
        self.params = {
            n: self.keep(model[n].view(buf).view(-1), old_params.get(n))
            for n, _ in self.float_params
        }
        self.opt = {
            idx: {
                k: self.keep(r.view(buf), old_opt.get(idx, {}).get(k))
                for k, r in entry.items()
                if isinstance(r, SlotRef)
            }
            for idx, entry in osd.items()
        }

    def rebase_recovered(self, state: dict[str, Any], step: int) -> None:
        """Recovery rebuilt ``state`` at ``step``: it becomes the base (copied before the
        live objects load it: a CPU optimizer keeps loaded tensors by reference)."""
        self.params = {n: self.keep(state["model"][n].reshape(-1)) for n, _ in self.float_params}
        self.opt = {
            idx: {k: self.keep(v) for k, v in entry.items() if isinstance(v, torch.Tensor)}
            for idx, entry in state["optimizer"]["state"].items()
        }
        self.step = step

    # ------------------------------------------------------------------ differentials
    def plan(self, step: int, pk: Packer) -> DiffPlan:
        """Compute and compress the differences of the state after ``step`` updates to
        the base, planned in ``pk``."""
        plan = DiffPlan(record={})
        params = self._plan_params(step, pk, plan)
        osd = self.optimizer.state_dict()
        optim_state = self._plan_optimizer(step, pk, plan, osd["state"])
        msd = st.unwrap_model(self.model).state_dict()
        rng_t, rng_extra = st.capture_rng(self.rng_layout)
        plan.record = {
            "kind": DIFF_KIND,
            "step": step,
            "base_step": self.step,
            "model_compressor": self.topk.spec(),
            "optimizer_compressor": None if self.opt_topk is None else self.opt_topk.spec(),
            "params": params,
            "params_set": {n: pk.put(p) for n, p in self.other_params},
            "model_rest": {k: pk.walk(v) for k, v in msd.items() if k not in self.param_keys},
            "optimizer": {"state": optim_state, "param_groups": pk.walk(osd["param_groups"])},
            "scheduler": None if self.scheduler is None else pk.walk(self.scheduler.state_dict()),
            "rng": {"tensors": pk.walk(rng_t), "extra": rng_extra},
        }
        return plan

    def _plan_params(self, step: int, pk: Packer, plan: DiffPlan) -> dict[str, Any]:
        """Top-k of every floating-point parameter's difference to the base."""
        params: dict[str, Any] = {}
        for key, (name, p) in enumerate(self.float_params):
            base = self.params[name]
            payload = self.topk.compress(self._delta(p, base), key, step)
            v, i = pk.put(payload["values"]), pk.put(payload["indices"])
            params[name] = {"values": v, "indices": i}
            plan.updates.append(partial(update_sparse, base, v, i))
        return params

    def _plan_optimizer(
        self, step: int, pk: Packer, plan: DiffPlan, state: dict[Any, dict[str, Any]]
    ) -> dict[Any, Any]:
        """Every optimizer state entry as an operation on the base: ``set`` (stored
        whole), ``add`` (a dense difference) or ``topk``."""
        optim_state: dict[Any, Any] = {}
        for n_entry, (idx, entry) in enumerate(state.items()):
            old = self.opt.get(idx, {})
            out: dict[str, Any] = {}
            nb: dict[str, torch.Tensor] = {}
            for k, val in entry.items():
                b = old.get(k)
                if not isinstance(val, torch.Tensor):
                    out[k] = {"op": "set", "value": val}
                elif (
                    b is None
                    or not val.is_floating_point()
                    or b.shape != val.shape
                    or b.dtype != val.dtype
                ):
                    ref = pk.put(val)
                    out[k] = {"op": "set", "value": ref}
                    plan.set_later.append((nb, k, ref))
                elif self.opt_topk is not None:
                    okey = len(self.float_params) + n_entry
                    payload = self.opt_topk.compress(self._delta(val, b), okey, step)
                    v, i = pk.put(payload["values"]), pk.put(payload["indices"])
                    out[k] = {"op": "topk", "values": v, "indices": i}
                    nb[k] = b
                    plan.updates.append(partial(update_sparse, b, v, i))
                else:
                    src = val.detach()
                    ref = pk.reserve(
                        src.dtype, tuple(src.shape), partial(sub_into, new=src, base=b)
                    )
                    out[k] = {"op": "add", "delta": ref}
                    nb[k] = b
                    plan.updates.append(partial(update_dense, b, ref))
            optim_state[idx] = out
            plan.new_opt[idx] = nb
        return optim_state

    def apply(self, plan: DiffPlan, buf: torch.Tensor) -> None:
        """The record of ``plan`` was filled into ``buf``: move the base on (its
        :attr:`step` is set once the record is handed off)."""
        for update in plan.updates:
            update(buf)
        for nb, k, ref in plan.set_later:
            nb[k] = self.keep(ref.view(buf))
        self.opt = plan.new_opt

"""The CPU replica of ``method="lowdiff+"``: model and optimizer state in a shared
arena, merged every step, and its background persist.

:class:`Replica` is what LowDiff+'s checkpointing process
(:mod:`lowdiff.engine.replica.main`) holds: the replica's tensors are views into a
named shared-memory arena (:mod:`lowdiff.proc.holder`), updated in place by every merge,
so that a new trainer can copy them after a crash. :class:`Persister` writes exact
snapshots of it as full checkpoints.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from lowdiff.engine.process.full_writer import FullWriter
from lowdiff.engine.replica.optim import ShardedOptimizer, optimizer_class
from lowdiff.engine.wire.configs import ReplicaConfig
from lowdiff.errors import UsageError
from lowdiff.format import codec, sfile
from lowdiff.format.dtypes import dtype_from_name
from lowdiff.format.sfile import plan, view_tensors
from lowdiff.proc import holder as rp
from lowdiff.state.record import RecordLayout

MERGE_STAGES = ("bind", "optimizer", "hand_back")
"""The stages of :meth:`Replica.merge` timed in :attr:`Replica.stage_s`."""


class Replica:
    """Model state and optimizer of the replica, backed by the shared arena.

    Per merged step only the work of the step runs: the gradients bound, the update, the
    buffers and RNG copied, the step number published in the control block's header. The
    metadata of the step (the optimizer's ``state_dict()``, scheduler, RNG, extra state as
    JSON) is built only when something needs it: a persist, and the ORPHANED publication a
    new trainer reads (the only state in which a reader copies the replica).
    """

    def __init__(self, cfg: ReplicaConfig, ctl: rp.ControlBlock, name: str = "a") -> None:
        self.cfg = cfg
        self.rl = RecordLayout.from_json(cfg.layout)
        self.slot_rl = self.rl if cfg.peer is None else RecordLayout.from_json(cfg.peer.slot_layout)
        """The snapshot slots' layout (with a peer copy, both shards' gradients)."""
        self.ctl = ctl
        self.name = name
        """Names this replica's arenas (``lowdiff-RUN-NAME1``, ``NAME2``, ...)."""
        self.head: dict[str, Any] = {}
        """More for the control block's header (the peer copy's control block)."""
        self.arena: Any = None
        self.gen = 0
        self.tensors: dict[str, torch.Tensor] = {}
        self.entries: list[sfile.TensorEntry] = []
        self.params: list[torch.nn.Parameter] = []
        self.opt: ShardedOptimizer | None = None
        self.aliases = "{}"
        self.rng_json = "{}"
        self._sched: Any = None
        """The scheduler state after the last merged step, as it arrived (encoded)."""
        self._sched_json: str | None = "null"
        self._extra: Any = None
        self.extra_json: str | None = None
        """The trainer's extra state (``extra_state=``) at this step, as saved, or None."""
        self.step = -1
        self.doc: dict[str, Any] = {}
        self._entries_json: str | None = None
        self._state_json: str | None = None
        self._state_ids: set[int] = set()
        """ids of the optimizer state tensors bound to arena views."""
        self._state_shape = (-1, -1)
        """(parameters with state, state entries) when the state was last bound."""
        self._row_views: dict[
            int, tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]
        ] = {}
        """Per snapshot slot (by address): what :meth:`_slot_views` returns."""
        self._row_state: dict[int, dict[str, torch.Tensor]] = {}
        """Per snapshot slot (by address): what :meth:`per_rank_state` returns for it."""
        self._arena_moved = False
        self._rng: Any = None
        self._grads_bound: int | None = None
        """The slot (by address) whose gradient views the parameters' ``.grad`` hold."""
        self.stage_s = dict.fromkeys(MERGE_STAGES, 0.0)
        """Seconds of :meth:`merge` per stage, summed: binding the slot's gradients and
        the hyperparameters, the optimizer (with the clip's factor), and handing the step
        back (state check, buffers and RNG copied, the step published)."""
        self.takeover_address: dict[str, str] = {}
        """How a new trainer reaches the process to take it over (published with the
        state; :mod:`lowdiff.engine.process.takeover`)."""

    # -- arena ------------------------------------------------------------------------------
    def _allocate(self, tensors: dict[str, torch.Tensor]) -> None:
        """(Re)build the arena for ``tensors`` and rebind every replica tensor into it."""
        entries, size = plan((k, v.dtype, tuple(v.shape)) for k, v in tensors.items())
        old = self.arena
        self.gen += 1
        name = f"lowdiff-{self.cfg.run_id[:16]}-{self.name}{self.gen}"
        shm = rp.create_segment(name, size)
        views = view_tensors(entries, rp.segment_tensor(shm, size))
        for k, v in tensors.items():
            views[k].copy_(v)
        self.arena, self.entries, self.tensors = shm, entries, views
        self._entries_json = None
        self._state_json = None
        self._arena_moved = True
        if old is not None:
            rp.unlink_and_close(old)

    def _rebind_optimizer_state(self, full: bool = False) -> None:
        """Move optimizer state that lives outside the arena into it.

        After every step (``full=False``) only the shape of the state is checked: how many
        parameters have state and how many entries they hold, which changes when a step
        creates state (a parameter's first gradient). torch.optim's optimizers update
        existing state tensors in place; one that replaced a tensor instead would leave the
        arena behind, so before anything reads the arena (a persist, a publication) the
        check is ``full``: every state tensor compared by identity with the arena views bound
        last time (those stay alive in ``self.tensors``, so an id cannot be reused).
        """
        assert self.opt is not None
        state = self.opt.state
        shape = (len(state), sum(len(s) for s in state.values()))
        if shape == self._state_shape and not full:
            return
        live = {id(v) for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)}
        if live == self._state_ids:
            self._state_shape = shape
            return
        # rebuild: model tensors + current optimizer state + RNG, then rebind everything
        sd = self.opt.state_dict()
        state_tensors: dict[str, torch.Tensor] = {}

        def sink(path: str, t: torch.Tensor) -> str:
            n = "optim/" + path.removeprefix("$.")
            state_tensors[n] = t
            return n

        codec.dumps(sd, sink)
        keep = {k: v for k, v in self.tensors.items() if not k.startswith("optim/")}
        keep.update(state_tensors)
        self._allocate(keep)
        self._bind()

    def _bind(self) -> None:
        """Point parameters and optimizer state at the current arena views."""
        assert self.opt is not None
        with torch.no_grad():
            for info, p in zip(self.rl.params, self.params, strict=True):
                p.data = self.tensors[f"model/{info.name}"]
        by_index = dict(enumerate(self.params))
        bound: set[int] = set()
        for n, view in self.tensors.items():
            if not n.startswith("optim/state["):
                continue
            # optim/state[<index>].<key>
            idx_s, _, key = n[len("optim/state[") :].partition("].")
            owner = by_index.get(int(idx_s))
            if owner is not None and key in self.opt.state.get(owner, {}):
                self.opt.state[owner][key] = view
                bound.add(id(view))
        self._state_ids = bound
        self.opt.invalidate()  # the shards' views name the old tensors
        state = self.opt.state
        self._state_shape = (len(state), sum(len(s) for s in state.values()))
        self._row_views.clear()  # they name the tensors of the old arena

    def _slot_views(
        self, row: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        """A snapshot slot's gradient views and its (replica tensor, slot view) copies of
        buffers and RNG states, built once per slot and arena."""
        key = row.data_ptr()
        got = self._row_views.get(key)
        if got is None:
            views = self.slot_rl.views(row)
            grads = [views[f"g{info.index}.values"].view(info.shape) for info in self.rl.params]
            copies = [
                (self.tensors[f"model/{name}"], v)
                for name, v in self.slot_rl.buffer_values(views).items()
            ]
            copies += [
                (self.tensors[name], v) for name, v in self.slot_rl.rng_tensors(views).items()
            ]
            got = self._row_views[key] = (grads, copies)
        return got

    # -- build and merge -----------------------------------------------------------------------
    def init_from(
        self, staging: torch.Tensor, step: int, entries_json: list[Any], meta: dict[str, str]
    ) -> None:
        """Build the replica from the state its trainer staged (``Init``)."""
        src = staged_tensors(staging, entries_json)
        self.init_from_tensors(
            {k: v for k, v in src.items() if not k.startswith("peer/")}, step, meta
        )

    def init_from_tensors(
        self, tensors: dict[str, torch.Tensor], step: int, meta: dict[str, str]
    ) -> None:
        """Build the replica from ``tensors`` (model, optimizer state and RNG states, by
        their names in a full checkpoint) and the full checkpoint's ``meta``."""
        self._allocate(tensors)
        self.params = [
            torch.nn.Parameter(self.tensors[f"model/{p.name}"], requires_grad=False)
            for p in self.rl.params
        ]
        osd = codec.loads(meta["optim"], lambda n: self.tensors[n])
        if self.opt is not None:
            self.opt.close()
        self.opt = ShardedOptimizer(
            optimizer_class(self.cfg.optimizer), self.params, osd, self.cfg.threads
        )
        self._bind()
        self._rebind_optimizer_state(full=True)
        self.aliases, self.rng_json = meta["model_aliases"], meta["rng"]
        self._sched, self._sched_json = None, meta["scheduler"]
        self._extra, self.extra_json = None, meta.get("extra")
        self.step = step
        self.publish(rp.STATE_RUNNING)

    def merge(
        self,
        row: torch.Tensor,
        step: int,
        meta: dict[str, Any],
        state: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Apply step ``step``: the gradients in the snapshot slot ``row``, the update's
        hyperparameters and the per-rank state after it (buffers, RNG, scheduler, extra
        state) in ``meta``; with ``state``, the buffers and RNG states are those (a peer
        copy's: its source's), not the slot's."""
        opt = self.opt
        assert opt is not None
        if step != self.step:
            raise UsageError(
                f"replica is at step {self.step}, received the gradients of step {step}"
            )
        t0 = time.perf_counter()
        grads, copies = self._slot_views(row)
        nograd = meta["nograd"]
        key = None if nograd else row.data_ptr()
        if key is None or key != self._grads_bound:
            # the gradients stay bound after the step: the next step from the same slot
            # (max_lag=1) finds them in place
            idle = set(nograd)
            for info, p, g in zip(self.rl.params, self.params, grads, strict=True):
                p.grad = None if info.index in idle else g
            self._grads_bound = key
        opt.apply_hparams(codec.decode(meta["hp"]))
        t1 = time.perf_counter()
        opt.step(self._scale(meta.get("scale")))
        t2 = time.perf_counter()
        self._rebind_optimizer_state()
        opt.apply_hparams(codec.decode(meta["hp_after"]))
        if state is not None:
            for name, src in state.items():
                self.tensors[name].copy_(src)
        else:
            if self._arena_moved:  # the copies named the old arena's tensors
                _, copies = self._slot_views(row)
            for dst, src in copies:
                dst.copy_(src)
        # encoded when a persist or a reader needs them (metadata())
        self._sched, self._sched_json = meta["sched"], None
        self.rng_json = ""
        self._rng = meta["rng"]
        if "extra" in meta:
            self._extra, self.extra_json = meta["extra"], None
        self.step = step + 1
        if self._arena_moved:
            self.publish(rp.STATE_RUNNING)  # the arena's name changed
        else:
            self.ctl.set_step(rp.STATE_RUNNING, self.step)
        stage = self.stage_s
        stage["bind"] += t1 - t0
        stage["optimizer"] += t2 - t1
        stage["hand_back"] += time.perf_counter() - t2

    def per_rank_state(self, row: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """What differs between the ranks of a DDP job besides the metadata: the model's
        buffers and the RNG states, in the snapshot slot ``row`` (the state after its
        step), or by default in the replica as it is."""
        if row is None:
            buffers = {f"model/{n}" for n, _, _ in self.rl.buffers}
            return {k: v for k, v in self.tensors.items() if k in buffers or k.startswith("rng.")}
        got = self._row_state.get(row.data_ptr())
        if got is None:  # views of the slot: built once per slot
            views = self.slot_rl.views(row)
            got = {f"model/{n}": v for n, v in self.slot_rl.buffer_values(views).items()}
            got.update(self.slot_rl.rng_tensors(views))
            self._row_state[row.data_ptr()] = got
        return got

    def _scale(self, spec: Any) -> torch.Tensor | None:
        """The factor the trainer's clip multiplied the step's gradients by after they
        were snapshotted (``[dtype name, factor, indices left as they are]``, or None):
        returned for the optimizer's shards to apply, or applied here when some
        gradients were copied after the clip."""
        if spec is None:
            return None
        name, value, unscaled = spec
        factor = torch.tensor(value, dtype=dtype_from_name(name))
        if not unscaled:
            return factor
        skip = set(unscaled)
        grads = [
            p.grad
            for info, p in zip(self.rl.params, self.params, strict=True)
            if p.grad is not None and info.index not in skip
        ]
        if grads:
            torch._foreach_mul_(grads, factor)
        return None

    def forget_slots(self) -> None:
        """The snapshot slots are replaced (a new trainer took the process over): drop
        every view into the old ones."""
        self._row_views.clear()
        self._row_state.clear()
        self._grads_bound = None
        for p in self.params:
            p.grad = None

    def sync(self) -> None:
        """Make the arena hold every optimizer state tensor (before anything reads it)."""
        self._rebind_optimizer_state(full=True)

    def metadata(self) -> dict[str, str]:
        """The metadata a full checkpoint of the current step carries (call :meth:`sync`
        first: the arena may have moved)."""
        assert self.opt is not None
        if self._sched_json is None:
            self._sched_json = codec.dumps(codec.decode(self._sched))
        if not self.rng_json:
            self.rng_json = codec.dumps(self._rng)
        if self.extra_json is None and self._extra is not None:
            # the meta arrived decoded (codec.loads): encode the extra state again
            self.extra_json = json.dumps(codec.encode(self._extra), separators=(",", ":"))
        return {
            "kind": "full",
            "step": str(self.step),
            "run_id": self.cfg.run_id,
            "layout_id": self.rl.layout_id,
            "model_aliases": self.aliases,
            "optim": self._optim_json(),
            "scheduler": self._sched_json,
            "rng": self.rng_json,
            "source": "lowdiff+ replica",
            **({} if self.cfg.shard is None else {"shard": codec.dumps(self.cfg.shard)}),
            **({} if self.extra_json is None else {"extra": self.extra_json}),
        }

    def _optim_json(self) -> str:
        """``optimizer.state_dict()`` as JSON whose tensors name arena entries.

        The "state" half only references tensors, which are updated in place, so its JSON
        is cached until the arena is rebuilt; the hyperparameters are encoded every step.
        """
        assert self.opt is not None
        sd = self.opt.state_dict()
        if self._state_json is None:
            all_refs = [True]

            def sink(path: str, t: torch.Tensor) -> str:
                return "optim/" + path.removeprefix("$.")

            def check(x: Any) -> None:
                if isinstance(x, dict):
                    for v in x.values():
                        check(v)
                elif not isinstance(x, torch.Tensor):
                    all_refs[0] = False  # a Python scalar in the state changes by value

            check(sd["state"])
            text = json.dumps(
                codec.encode(sd["state"], sink, "$.state"), sort_keys=True, separators=(",", ":")
            )
            if not all_refs[0]:
                return f'{{"param_groups":{codec.dumps(sd["param_groups"])},"state":{text}}}'
            self._state_json = text
        return f'{{"param_groups":{codec.dumps(sd["param_groups"])},"state":{self._state_json}}}'

    def publish(self, state: int) -> None:
        """Write the whole control block: arena, entries and the metadata of this step.

        Runs at the start, when the arena moves, and when the replica is ORPHANED (what a
        new trainer reads); every other merged step only advances the header's step.
        """
        self.sync()
        if self._entries_json is None:
            self._entries_json = json.dumps(rp.entries_to_json(self.entries), separators=(",", ":"))
        meta = self.metadata()
        head = json.dumps(
            {
                "run_id": self.cfg.run_id,
                "layout_id": self.rl.layout_id,
                "arena": self.arena.name,
                **self.takeover_address,
                **self.head,
            },
            separators=(",", ":"),
        )
        raw = f'{head[:-1]},"entries":{self._entries_json},"meta":{json.dumps(meta, separators=(",", ":"))}}}'
        self.doc = {"meta": meta}
        self.ctl.write_raw(state, self.step, raw.encode())
        self._arena_moved = False

    def close(self) -> None:
        if self.opt is not None:
            self.opt.close()
        if self.arena is not None:
            rp.unlink_and_close(self.arena)


def staged_tensors(staging: torch.Tensor, entries_json: list[Any]) -> dict[str, torch.Tensor]:
    """The tensors an ``Init`` names in its staging buffer (views)."""
    entries = rp.entries_from_json(entries_json)
    size = entries[-1].end if entries else 0
    return view_tensors(entries, staging[:size])


class Persister(FullWriter):
    """Writes exact snapshots of the replica in a background thread, one at a time."""

    def __init__(
        self, root: Path, keep_full: int | None, send: Any, progress: Any = None, **kw: Any
    ) -> None:
        super().__init__(root, keep_full, send, announce_durable=True, progress=progress, **kw)
        self.buf: torch.Tensor | None = None

    def snapshot(self, rep: Replica) -> None:
        """Copy the replica as it is at this step boundary and write the copy."""
        self.wait()  # the buffer is free only once the previous write is done
        rep.sync()
        size = rep.entries[-1].end if rep.entries else 0
        if self.buf is None or self.buf.numel() < size:
            # page-aligned, so the write bypasses the page cache (sfile.write's direct)
            self.buf = sfile.aligned_empty(size + size // 8)
        # merging continues while the copy is written, so the file holds exactly this step
        self.buf[:size].copy_(rp.segment_tensor(rep.arena, size))
        self.start(rep.step, list(rep.entries), self.buf[:size], rep.metadata())

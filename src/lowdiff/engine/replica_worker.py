"""The checkpointing process of ``strategy="lowdiff+"``: a CPU replica, merged every step.

Call sequence:

0) (trainer) starts this process with the shared snapshot slots and two pipes.
1) (checkpointing) takes the writer lock, creates the control block, publishes the
   replica descriptor.
2) (trainer, once per session) stages its whole state and sends ``("init", ...)``; the
   replica is built from it in a named shared-memory arena and persisted right away.
3) (trainer, every step) fills a slot with the step's gradients (snapshotted layer by
   layer during backward), buffers and RNG states and sends ``("step", slot, t, meta)``.
   (checkpointing) applies the same optimizer update to the replica (PyTorch's own CPU
   kernels: the optimizer class and its foreach/fused flags are the trainer's), copies
   buffers and RNG, publishes the new metadata in the control block, frees the slot,
   and starts a background persist when one is due.
4) (trainer) ``flush`` / ``close``: persist the current step and answer with it.

When the trainer dies, the process merges every step it received completely, marks
the replica ORPHANED (a new trainer may attach and copy it from memory), persists it,
and waits for a new trainer or for ``idle_timeout``. A new trainer that has copied the
replica sends SIGTERM; the process then unlinks its segments and exits.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from lowdiff.engine import replica as rp
from lowdiff.engine import state as st
from lowdiff.engine.channel import BEAT, SLOTS_DONE, STAGING_DONE, Counters
from lowdiff.engine.record import RecordLayout
from lowdiff.engine.worker import (
    FullWriter,
    acquire_flock,
    detach_from_trainer_group,
    drain,
    serve,
)
from lowdiff.format import codec, layout, sfile
from lowdiff.format.sfile import plan, view_tensors


@dataclass(frozen=True)
class ReplicaConfig:
    root: str
    run_id: str
    layout: dict[str, Any]
    optimizer: str
    persist_every: int | str
    keep_full: int | None
    idle_timeout: float
    threads: int
    shard: list[int] | None = None
    """Under DDP: the optimizer indices this replica holds (its optimizer numbers them 0..n-1)."""


def optimizer_class(path: str) -> type[torch.optim.Optimizer]:
    module, _, name = path.rpartition(".")
    if not (module == "torch.optim" or module.startswith("torch.optim.")):
        raise ValueError(
            f"strategy 'lowdiff+' runs the optimizer on the CPU replica and supports torch.optim optimizers; got {path}"
        )
    cls = getattr(importlib.import_module(module), name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"{path} is not a torch.optim optimizer")
    return cls


class _Replica:
    """Model state and optimizer of the replica, backed by the shared arena."""

    def __init__(self, cfg: ReplicaConfig, ctl: rp.ControlBlock) -> None:
        self.cfg = cfg
        self.rl = RecordLayout.from_json(cfg.layout)
        self.ctl = ctl
        self.arena: Any = None
        self.gen = 0
        self.tensors: dict[str, torch.Tensor] = {}
        self.entries: list[sfile.TensorEntry] = []
        self.params: list[torch.nn.Parameter] = []
        self.opt: torch.optim.Optimizer | None = None
        self.aliases = "{}"
        self.sched_json = "null"
        self.rng_json = "{}"
        self.extra_json: str | None = None
        """The trainer's extra state (``extra_state=``) at this step, as saved, or None."""
        self.step = -1
        self.doc: dict[str, Any] = {}
        self._entries_json: str | None = None
        self._state_json: str | None = None

    # -- arena ------------------------------------------------------------------------------
    def _allocate(self, tensors: dict[str, torch.Tensor]) -> None:
        """(Re)build the arena for ``tensors`` and rebind every replica tensor into it."""
        entries, size = plan((k, v.dtype, tuple(v.shape)) for k, v in tensors.items())
        old = self.arena
        self.gen += 1
        name = f"lowdiff-{self.cfg.run_id[:16]}-a{self.gen}"
        shm = rp.create_segment(name, size)
        views = view_tensors(entries, rp.segment_tensor(shm, size))
        for k, v in tensors.items():
            views[k].copy_(v)
        self.arena, self.entries, self.tensors = shm, entries, views
        self._entries_json = None
        self._state_json = None
        if old is not None:
            _unlink_and_close(old)

    def _adopt_optimizer_state(self) -> None:
        """Move optimizer state that lives outside the arena (new after a step) into it."""
        assert self.opt is not None
        live = [
            v
            for p in self.params
            for v in self.opt.state.get(p, {}).values()
            if isinstance(v, torch.Tensor)
        ]
        arena_ptrs = {t.data_ptr() for n, t in self.tensors.items() if n.startswith("optim/state[")}
        if len(live) == len(arena_ptrs) and all(v.data_ptr() in arena_ptrs for v in live):
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
        for n, view in self.tensors.items():
            if not n.startswith("optim/state["):
                continue
            # optim/state[<index>].<key>
            idx_s, _, key = n[len("optim/state[") :].partition("].")
            owner = by_index.get(int(idx_s))
            if owner is not None and key in self.opt.state.get(owner, {}):
                self.opt.state[owner][key] = view

    # -- build and merge -----------------------------------------------------------------------
    def init_from(
        self, staging: torch.Tensor, step: int, entries_json: list[Any], meta: dict[str, str]
    ) -> None:
        entries = rp.entries_from_json(entries_json)
        size = entries[-1].end if entries else 0
        src = view_tensors(entries, staging[:size])
        self._allocate({k: v for k, v in src.items()})
        self.params = [
            torch.nn.Parameter(self.tensors[f"model/{p.name}"], requires_grad=False)
            for p in self.rl.params
        ]
        osd = codec.loads(meta["optim"], lambda n: self.tensors[n])
        cls = optimizer_class(self.cfg.optimizer)
        groups = [
            {
                "params": [self.params[i] for i in g["params"]],
                **{k: v for k, v in g.items() if k != "params"},
            }
            for g in osd["param_groups"]
        ]
        self.opt = cls(groups)  # type: ignore[call-arg]
        self.opt.load_state_dict(osd)
        self._bind()
        self._adopt_optimizer_state()
        self.aliases, self.sched_json, self.rng_json = (
            meta["model_aliases"],
            meta["scheduler"],
            meta["rng"],
        )
        self.extra_json = meta.get("extra")
        self.step = step
        self.publish(rp.STATE_RUNNING)

    def merge(self, row: torch.Tensor, step: int, meta: dict[str, Any]) -> None:
        assert self.opt is not None
        if step != self.step:
            raise RuntimeError(
                f"replica is at step {self.step}, received the gradients of step {step}"
            )
        views = self.rl.views(row)
        nograd = set(meta["nograd"])
        for info, p in zip(self.rl.params, self.params, strict=True):
            p.grad = (
                None if info.index in nograd else views[f"g{info.index}.values"].view(info.shape)
            )
        st.apply_hparams(self.opt, codec.decode(meta["hp"]))
        self.opt.step()
        for p in self.params:
            p.grad = None
        self._adopt_optimizer_state()
        st.apply_hparams(self.opt, codec.decode(meta["hp_after"]))
        for name, v in self.rl.buffer_values(views).items():
            self.tensors[f"model/{name}"].copy_(v)
        for name, v in self.rl.rng_tensors(views).items():
            self.tensors[name].copy_(v)
        self.sched_json = codec.dumps(codec.decode(meta["sched"]))
        self.rng_json = codec.dumps(meta["rng"])
        if "extra" in meta:
            # the meta arrives decoded (codec.loads): encode the extra state again
            self.extra_json = json.dumps(codec.encode(meta["extra"]), separators=(",", ":"))
        self.step = step + 1
        self.publish(rp.STATE_RUNNING)

    def metadata(self) -> dict[str, str]:
        """The metadata a full checkpoint of the current step carries."""
        assert self.opt is not None

        return {
            "kind": "full",
            "step": str(self.step),
            "run_id": self.cfg.run_id,
            "layout_id": self.rl.layout_id,
            "model_aliases": self.aliases,
            "optim": self._optim_json(),
            "scheduler": self.sched_json,
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
        if self._entries_json is None:
            self._entries_json = json.dumps(rp.entries_to_json(self.entries), separators=(",", ":"))
        meta = self.metadata()
        head = json.dumps(
            {"run_id": self.cfg.run_id, "layout_id": self.rl.layout_id, "arena": self.arena.name},
            separators=(",", ":"),
        )
        raw = f'{head[:-1]},"entries":{self._entries_json},"meta":{json.dumps(meta, separators=(",", ":"))}}}'
        self.doc = {"meta": meta}
        self.ctl.write_raw(state, self.step, raw.encode())

    def close(self) -> None:
        if self.arena is not None:
            _unlink_and_close(self.arena)


def _unlink_and_close(shm: Any) -> None:
    # unlink first: close() refuses while tensors still view the buffer
    rp.unlink_segment(shm.name)
    with contextlib.suppress(Exception):
        shm.close()


class _Persister(FullWriter):
    """Writes exact snapshots of the replica in a background thread, one at a time."""

    def __init__(self, root: Path, keep_full: int | None, send: Any, progress: Any = None) -> None:
        super().__init__(root, keep_full, send, announce_durable=True, progress=progress)
        self.buf: torch.Tensor | None = None

    def snapshot(self, rep: _Replica) -> None:
        """Copy the replica as it is at this step boundary and write the copy."""
        self.wait()  # the buffer is free only once the previous write is done
        size = rep.entries[-1].end if rep.entries else 0
        if self.buf is None or self.buf.numel() < size:
            self.buf = torch.empty(size + size // 8, dtype=torch.uint8)
        # merging continues while the copy is written, so the file holds exactly this step
        self.buf[:size].copy_(rp.segment_tensor(rep.arena, size))
        self.start(rep.step, list(rep.entries), self.buf[:size], rep.metadata())


def _warm_up(optimizer_path: str) -> None:
    """Run the optimizer once on a scratch tensor: its first step imports and initialises
    machinery that would otherwise stall the first merge (and so the trainer)."""
    with contextlib.suppress(Exception):
        p = torch.nn.Parameter(torch.zeros(8))
        p.grad = torch.zeros(8)
        optimizer_class(optimizer_path)([p]).step()  # type: ignore[call-arg]


def replica_worker_main(
    cfg: ReplicaConfig,
    slots: torch.Tensor,
    counters: torch.Tensor,
    requests: Connection,
    results: Connection,
) -> None:
    """Entry point of the LowDiff+ checkpointing process."""
    detach_from_trainer_group()
    torch.set_num_threads(max(1, cfg.threads))
    ctr = Counters(counters)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer's close() decides
    released = [False]  # a flag, not an Event: set from a signal handler

    def on_sigterm(*_: Any) -> None:
        released[0] = True

    signal.signal(signal.SIGTERM, on_sigterm)
    send_lock = threading.Lock()

    def send(msg: tuple[Any, ...]) -> None:
        with send_lock, contextlib.suppress(OSError):
            results.send(msg)

    root = Path(cfg.root)
    lock_fd = None
    ctl_shm = None
    rep: _Replica | None = None
    in_flight: _Persister | None = None
    parent = os.getppid()
    try:
        lock_fd = acquire_flock(root / layout.WRITER_LOCK_FILE, blocking=True)
        ctl_name = f"lowdiff-{cfg.run_id[:16]}-ctl"
        ctl_shm = rp.create_segment(ctl_name, rp.CTL_BYTES)
        ctl = rp.ControlBlock(ctl_shm)
        ctl.write(
            rp.STATE_INIT,
            -1,
            {"run_id": cfg.run_id, "layout_id": RecordLayout.from_json(cfg.layout).layout_id},
        )
        rp.write_descriptor(
            root,
            rp.Descriptor(
                os.getpid(),
                socket.gethostname(),
                cfg.run_id,
                ctl_name,
                RecordLayout.from_json(cfg.layout).layout_id,
            ),
        )
        _warm_up(cfg.optimizer)
        rep = _Replica(cfg, ctl)
        persister = _Persister(root, cfg.keep_full, send, progress=lambda _n: ctr.add(BEAT))
        in_flight = persister
        staging: torch.Tensor | None = None
        persist_every = cfg.persist_every
        send(("ready", os.getpid()))

        def maybe_persist() -> None:
            assert rep is not None
            if persister.error is not None:
                persister.wait()
            if persist_every == "auto":
                # as often as the disk keeps up, but writing at most half of the time
                if not persister.busy and time.monotonic() >= persister.next_auto:
                    persister.snapshot(rep)
            elif isinstance(persist_every, int) and rep.step % persist_every == 0:
                persister.snapshot(rep)

        def handle(msg: tuple[Any, ...]) -> bool:
            nonlocal staging
            assert rep is not None
            kind = msg[0]
            if kind == "step":
                _, slot, step, meta_json = msg
                t0 = time.perf_counter()
                rep.merge(slots[slot], step, codec.loads(meta_json))
                ctr.add(SLOTS_DONE)
                ctr.add(BEAT)
                send(("merged", rep.step, time.perf_counter() - t0))
                maybe_persist()
            elif kind == "stage":
                staging = msg[1]
            elif kind == "init":
                _, step, entries_json, meta = msg
                assert staging is not None
                rep.init_from(staging, step, entries_json, meta)
                staging = None  # the replica holds the state now: unmap the staging copy
                ctr.add(STAGING_DONE)
                ctr.add(BEAT)
                send(("merged", rep.step))
                persister.snapshot(rep)
            elif kind in ("flush", "close"):
                persister.wait()
                if persister.persisted < rep.step:
                    persister.snapshot(rep)
                    persister.wait()
                send(("flushed" if kind == "flush" else "closed", persister.persisted))
                return kind == "flush"
            else:
                raise RuntimeError(f"unknown message {kind!r}")
            return True

        if serve(requests, handle, parent):
            # merge every step that arrived completely, then offer the replica to a new trainer
            drain(requests, handle, ("step", "stage", "init"))
            if rep.opt is not None:
                rep.publish(rp.STATE_ORPHANED)
                if persister.persisted < rep.step:
                    persister.snapshot(rep)
                deadline = time.monotonic() + cfg.idle_timeout
                while not released[0] and time.monotonic() < deadline:
                    time.sleep(0.05)
                persister.wait()
    except BaseException as e:  # noqa: BLE001 -- sent back and raised in the trainer
        tb = traceback.format_exc()
        if in_flight is not None:  # finish (or clean up) the write in flight first
            with contextlib.suppress(BaseException):
                in_flight.wait()
        send(("error", type(e).__name__, str(e), tb))
        raise SystemExit(1) from None
    finally:
        if rep is not None:
            with contextlib.suppress(Exception):
                rep.ctl.set_state(rp.STATE_CLOSED)
            rep.close()
        if ctl_shm is not None:
            _unlink_and_close(ctl_shm)
        rp.remove_descriptor(root, cfg.run_id)
        if lock_fd is not None:
            os.close(lock_fd)

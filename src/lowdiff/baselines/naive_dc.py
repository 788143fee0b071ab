"""``strategy="naive-dc"``: the LowDiff paper's "Naïve DC" baseline.

Synchronous, dense differential checkpointing as the LowDiff paper constructs it (its
own baseline, not a reimplementation of Check-N-Run): a full checkpoint every
``full_every`` steps (and at step 0), and in between, every ``diff_every`` steps, a *differential* checkpoint of the state
against the previous checkpoint. Unlike LowDiff, which logs the compressed gradients
that training already computed, Naïve DC computes the differences itself, compresses
them itself and moves the (uncompressed) optimizer differences as well. That extra work
is the cost this baseline exists to measure, so it is done for real, every checkpoint,
on the training side (on the parameters' device), before the hand-off.

What a differential holds (the state after ``step`` updates, relative to ``base_step``,
the previous checkpoint):

- model parameters: ``top-k(P_step - B)`` with :class:`lowdiff.compressors.TopK` at
  ``ratio`` (no error feedback); ``B`` is the CPU copy of what a recovery reconstructs
  at ``base_step``, kept by the trainer and updated with exactly the arithmetic recovery
  uses. Entries that top-k leaves out stay in the next difference, so compression error
  never accumulates: an entry is at most as stale as its last selection;
- optimizer state: every tensor as ``new - base``, dense and uncompressed (the paper's
  Naïve DC compresses only the model); ``compress_optimizer=True`` top-k compresses these too
  (the paper's "Naïve DC w/ OC", Exp. 5). Tensors that are new (lazily created state),
  not floating point, or changed shape, and non-tensor values, are stored whole;
- whole: buffers and other non-parameter model state, the optimizer's param groups,
  scheduler state, RNG states and the step.

Call sequence (all on the training process unless noted):

0) ``resume()`` restores the newest recoverable state (below) and makes it the base, or
   writes the step-0 full checkpoint of a new directory.
1) (every checkpoint) the state is packed into a shared-memory slot: for a full
   checkpoint a copy of the whole state, for a differential the compressed model
   differences, the optimizer differences and the small state; the base copy is moved
   on; a message ``("full" | "diff", slot, ...)`` goes to the checkpointing process.
   ``step()`` blocks only for this (and, under backpressure, for a free slot).
2) (checkpointing process, spawned like lowdiff's own, outside the trainer's process
   group) copies the record out of its slot, frees the slot, ``torch.save``-s it
   atomically with a commit file, and after a full checkpoint applies retention. Its
   errors come back to the trainer and are raised on the next call.
3) ``flush()`` / ``close()`` wait until everything handed off is on disk. A trainer
   that dies (SIGKILL included) leaves a process that writes every record it was handed,
   then exits; the next ``resume()`` waits for it.

Files::

    DIR/lowdiff.json                         manifest (strategy, options)
    DIR/full/ckpt-{step:012d}.pt[.commit]    full checkpoints (torch.save of the state)
    DIR/diffs/diff-{step:012d}.pt[.commit]   differentials, each naming its base_step

Retention keeps the newest ``keep_full`` full checkpoints and deletes the differentials
older than the oldest kept one.

Recovery: the newest intact full checkpoint, then the differentials after it in order,
each applied to the state rebuilt so far (``add`` / top-k scatter-add / replace). The
chain stops, with a :class:`lowdiff.RecoveryWarning` naming the file, at the first
differential that is damaged or does not continue the state rebuilt so far (its base
checkpoint is missing); what lies past the recovered step is moved to
``DIR/quarantine/``. The result is exactly the trainer's base copy at that step, and by
design *not* the exact training state: model parameters carry the top-k error
(bounded by how far each entry moved since it was last selected), optimizer state the
rounding of ``(new - base) + base``. :func:`recovery_error` measures both. Step,
buffers, scheduler and RNG states are restored exactly.
"""

from __future__ import annotations

import builtins
import contextlib
import math
import numbers
import os
import time
import traceback
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from lowdiff.baselines.base import (
    BaselineCheckpointer,
    commit_path,
    load_state,
    published,
    quarantine,
    restore_state,
    save_state,
)
from lowdiff.compressors.base import Compressor, check_payload, compressor_from_spec
from lowdiff.compressors.sparse import TopK
from lowdiff.engine import state as st
from lowdiff.engine.replica import ensure_shm_space
from lowdiff.engine.spawn import exit_message, spawn_context
from lowdiff.engine.worker import (
    acquire_flock,
    detach_from_trainer_group,
    drain,
    serve,
    wait_for_writer,
)
from lowdiff.errors import (
    CheckpointWorkerError,
    CorruptCheckpointError,
    RecoveryWarning,
)
from lowdiff.format import layout
from lowdiff.format.atomic import remove_stale_temps
from lowdiff.recovery.replay import RecoveryStats
from lowdiff.strategy import StepGrads

__all__ = ["NaiveDCCheckpointer", "recovery_error"]

DIFF_DIR = "diffs"
FULL_PREFIX, DIFF_PREFIX, SUFFIX = "ckpt-", "diff-", ".pt"
DIFF_KIND = "naive-dc-diff"
"""``kind`` of a differential file, so that a file of another kind is never applied."""

_ALIGN = 64
"""Byte alignment of every tensor in a hand-off slot (any dtype can be viewed there)."""
_STORAGE_ERRORS = {
    c.__name__
    for c in vars(builtins).values()
    if isinstance(c, type) and issubclass(c, OSError) and not issubclass(c, ConnectionError)
}


# --------------------------------------------------------------------------- records in slots


@dataclass(frozen=True)
class _Ref:
    """Where one tensor of a record lies in a hand-off slot (a flat uint8 tensor)."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def view(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


class _Packer:
    """Lays a record's tensors out in one slot: plan first (sizes), then fill.

    Planning before filling lets a record be sized before a slot is taken, and lets
    dense differences be computed straight into the slot (no temporary per tensor).
    """

    def __init__(self) -> None:
        self.nbytes = 0
        self._fills: list[tuple[_Ref, Callable[[torch.Tensor], Any]]] = []

    def reserve(
        self, dtype: torch.dtype, shape: tuple[int, ...], fill: Callable[[torch.Tensor], Any]
    ) -> _Ref:
        offset = -(-self.nbytes // _ALIGN) * _ALIGN
        ref = _Ref(offset, dtype, tuple(shape))
        self.nbytes = offset + ref.nbytes
        self._fills.append((ref, fill))
        return ref

    def put(self, t: torch.Tensor) -> _Ref:
        src = t.detach()
        return self.reserve(src.dtype, tuple(src.shape), partial(_copy_into, src=src))

    def walk(self, obj: Any) -> Any:
        """``obj`` with every tensor replaced by its :class:`_Ref` (copied at :meth:`fill`)."""
        if isinstance(obj, torch.Tensor):
            return self.put(obj)
        if isinstance(obj, dict):
            return {k: self.walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.walk(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(self.walk(v) for v in obj)
        return obj

    def fill(self, buf: torch.Tensor) -> None:
        for ref, fill in self._fills:
            fill(ref.view(buf))


def _copy_into(view: torch.Tensor, src: torch.Tensor) -> None:
    view.copy_(src)


def _unpack(obj: Any, buf: torch.Tensor) -> Any:
    """A record from its slot, every tensor copied out (each into storage of its own)."""
    if isinstance(obj, _Ref):
        return obj.view(buf).clone()
    if isinstance(obj, dict):
        return {k: _unpack(v, buf) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unpack(v, buf) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_unpack(v, buf) for v in obj)
    return obj


# --------------------------------------------------------------------------- arithmetic


def _add_sparse(t: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> None:
    """``t.view(-1)[indices] += values`` (unique int64 indices), one rounding per entry.

    The trainer's base copy and recovery both go through this function, so they reach
    bit-identical states.
    """
    flat = t.view(-1) if t.is_contiguous() else t.reshape(-1)  # a copy when not contiguous
    flat.index_copy_(0, indices, flat.index_select(0, indices).add_(values))
    if not t.is_contiguous():
        t.copy_(flat.view(t.shape))


def _sub_into(view: torch.Tensor, new: torch.Tensor, base: torch.Tensor) -> None:
    """``view = new - base`` with ``base`` on the CPU and ``new`` on its own device."""
    if new.device.type == "cpu":
        torch.sub(new, base, out=view)
    else:
        view.copy_(new - base.to(new.device, non_blocking=True))


def _update_dense(base: torch.Tensor, delta: _Ref, buf: torch.Tensor) -> None:
    base.add_(delta.view(buf))


def _update_sparse(base: torch.Tensor, values: _Ref, indices: _Ref, buf: torch.Tensor) -> None:
    _add_sparse(base, values.view(buf), indices.view(buf).long())


def _check_ratio(ratio: Any) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real):
        raise TypeError(f"ratio must be a real number, got {type(ratio).__name__} {ratio!r}")
    value = float(ratio)
    if not 0.0 < value <= 1.0:  # written so that NaN fails too
        raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
    return value


# --------------------------------------------------------------------------- the trainer side


class _Pool:
    """Shared-memory slots of one kind of record; grown (all slots idle) when too small."""

    def __init__(self, name: str, n: int) -> None:
        self.name, self.n = name, n
        self.gen = 0
        self.size = 0
        self.buffers: list[torch.Tensor] = []
        self.free: list[int] = []


class NaiveDCCheckpointer(BaselineCheckpointer):
    """The LowDiff paper's Naïve DC: differences computed on the training side (module docstring).

    Args:
        model, optimizer, directory, compressor, full_every, scheduler, keep_full,
            start_timeout: as for :class:`lowdiff.baselines.BaselineCheckpointer`.
        diff_every: a differential checkpoint every this many steps between full ones.
        ratio: top-k ratio of the model-parameter differences, in (0, 1].
        compress_optimizer: top-k compress the optimizer differences too ("w/ OC").
        max_inflight: differentials handed off but not yet taken by the checkpointing
            process before ``step()`` waits (the depth of the shared-memory slot pool).

    ``stats`` adds ``fulls``, ``diffs``, ``compress_s`` (training-side time spent
    computing, compressing and packing differences, summed over ``diffs``),
    ``handoff_wait_s`` (time waiting for a free slot), ``diff_bytes`` / ``full_bytes``
    and ``diff_write_s`` / ``full_write_s`` (files written by the checkpointing process);
    ``checkpoints`` counts both kinds.

    Example:
        >>> ck = lowdiff.Checkpointer(model, opt, "ckpt", strategy="naive-dc",
        ...                           full_every=100, ratio=0.01)  # doctest: +SKIP
        >>> start = ck.resume()  # doctest: +SKIP
    """

    strategy = "naive-dc"

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        directory: str | os.PathLike[str] | None,
        *,
        compressor: Compressor | None = None,
        full_every: int = 30,
        scheduler: Any | None = None,
        keep_full: int | None = 2,
        start_timeout: float = 120.0,
        diff_every: int = 1,
        ratio: float = 0.01,
        compress_optimizer: bool = False,
        max_inflight: int = 2,
    ) -> None:
        from lowdiff.strategy import check_int as _check_int

        # checked before the base class takes the directory lock
        self.diff_every = _check_int("diff_every", diff_every, 1)
        self.ratio = _check_ratio(ratio)
        if not isinstance(compress_optimizer, bool):
            raise TypeError(
                f"compress_optimizer must be a bool, got {type(compress_optimizer).__name__} "
                f"{compress_optimizer!r}"
            )
        self.compress_optimizer = compress_optimizer
        self.max_inflight = _check_int("max_inflight", max_inflight, 1)
        super().__init__(
            model,
            optimizer,
            directory,
            compressor=compressor,
            full_every=full_every,
            scheduler=scheduler,
            keep_full=keep_full,
            start_timeout=start_timeout,
        )
        self._topk = TopK(self.ratio, error_feedback=False)
        self._opt_topk = TopK(self.ratio, error_feedback=False) if compress_optimizer else None
        m = st.unwrap_model(model)
        named = list(m.named_parameters())
        self._float_params = [(n, p) for n, p in named if p.is_floating_point()]
        self._other_params = [(n, p) for n, p in named if not p.is_floating_point()]
        canonical = {id(p): n for n, p in named}
        self._aliases = {
            n: canonical[id(p)]
            for n, p in m.named_parameters(remove_duplicate=False)
            if n != canonical[id(p)]
        }
        self._param_keys = {n for n, _ in m.named_parameters(remove_duplicate=False)}
        self._pin = any(p.device.type != "cpu" for _, p in named)
        self._base_params: dict[str, torch.Tensor] = {}
        self._base_opt: dict[Any, dict[str, torch.Tensor]] = {}
        self._base_step = -1
        self._scratch: dict[torch.dtype, torch.Tensor] = {}
        self._pools = {"full": _Pool("full", 1), "diff": _Pool("diff", self.max_inflight)}
        self._proc: Any = None
        self._ready = self._handed_off = False
        self._req: Connection | None = None
        self._res: Connection | None = None
        self._worker_error: CheckpointWorkerError | None = None
        self._stats.update(
            fulls=0,
            diffs=0,
            compress_s=0.0,
            handoff_wait_s=0.0,
            diff_bytes=0,
            full_bytes=0,
            diff_write_s=0.0,
            full_write_s=0.0,
        )

    # ------------------------------------------------------------------ the step loop
    def after_update(self, t: int, grads: StepGrads, hp: Any, update_s: float) -> None:
        """A full checkpoint when due (the base class), else a differential one when due."""
        super().after_update(t, grads, hp, update_s)
        s = self._step
        if s % self.full_every != 0 and s % self.diff_every == 0:
            t0 = time.perf_counter()
            self._diff(s)
            self._stats["checkpoints"] += 1
            self._stats["stall_s"] += time.perf_counter() - t0

    def _manifest_extra(self) -> dict[str, Any]:
        return {
            "diff_every": self.diff_every,
            "ratio": self.ratio,
            "compress_optimizer": self.compress_optimizer,
        }

    def _keep(self, t: torch.Tensor, reuse: torch.Tensor | None = None) -> torch.Tensor:
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

    def _checkpoint(self, step: int) -> None:
        """Full checkpoint: the whole state into the full slot; it becomes the base."""
        self._ensure_worker()
        pool = self._pools["full"]
        pk = _Packer()
        spec = pk.walk(self._capture(step))
        slot = self._acquire(pool, pk.nbytes)
        buf = pool.buffers[slot]
        pk.fill(buf)
        model, osd = spec["model"], spec["optimizer"]["state"]
        old_params, old_opt = self._base_params, self._base_opt
        self._base_params = {
            n: self._keep(model[n].view(buf).view(-1), old_params.get(n))
            for n, _ in self._float_params
        }
        self._base_opt = {
            idx: {
                k: self._keep(r.view(buf), old_opt.get(idx, {}).get(k))
                for k, r in entry.items()
                if isinstance(r, _Ref)
            }
            for idx, entry in osd.items()
        }
        self._send(("full", pool.gen, slot, step, spec))
        self._base_step = step
        self._stats["fulls"] += 1

    def _diff(self, step: int) -> None:
        """Differential checkpoint: compute and compress the differences, hand them off."""
        self._ensure_worker()
        t0 = time.perf_counter()
        pk = _Packer()
        updates: list[Callable[[torch.Tensor], None]] = []
        params: dict[str, Any] = {}
        for key, (name, p) in enumerate(self._float_params):
            base = self._base_params[name]
            payload = self._topk.compress(self._delta(p, base), key, step)
            v, i = pk.put(payload["values"]), pk.put(payload["indices"])
            params[name] = {"values": v, "indices": i}
            updates.append(partial(_update_sparse, base, v, i))
        optim_state: dict[Any, Any] = {}
        new_base: dict[Any, dict[str, torch.Tensor]] = {}
        osd = self.optimizer.state_dict()
        set_later: list[tuple[dict[str, torch.Tensor], str, _Ref]] = []
        for n_entry, (idx, entry) in enumerate(osd["state"].items()):
            old = self._base_opt.get(idx, {})
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
                    set_later.append((nb, k, ref))
                elif self._opt_topk is not None:
                    okey = len(self._float_params) + n_entry
                    payload = self._opt_topk.compress(self._delta(val, b), okey, step)
                    v, i = pk.put(payload["values"]), pk.put(payload["indices"])
                    out[k] = {"op": "topk", "values": v, "indices": i}
                    nb[k] = b
                    updates.append(partial(_update_sparse, b, v, i))
                else:
                    src = val.detach()
                    ref = pk.reserve(
                        src.dtype, tuple(src.shape), partial(_sub_into, new=src, base=b)
                    )
                    out[k] = {"op": "add", "delta": ref}
                    nb[k] = b
                    updates.append(partial(_update_dense, b, ref))
            optim_state[idx] = out
            new_base[idx] = nb
        msd = st.unwrap_model(self.model).state_dict()
        rng_t, rng_extra = st.capture_rng(self._rng_layout)
        record = {
            "kind": DIFF_KIND,
            "step": step,
            "base_step": self._base_step,
            "model_compressor": self._topk.spec(),
            "optimizer_compressor": None if self._opt_topk is None else self._opt_topk.spec(),
            "params": params,
            "params_set": {n: pk.put(p) for n, p in self._other_params},
            "model_rest": {k: pk.walk(v) for k, v in msd.items() if k not in self._param_keys},
            "optimizer": {"state": optim_state, "param_groups": pk.walk(osd["param_groups"])},
            "scheduler": None if self.scheduler is None else pk.walk(self.scheduler.state_dict()),
            "rng": {"tensors": pk.walk(rng_t), "extra": rng_extra},
        }
        computed = time.perf_counter() - t0
        pool = self._pools["diff"]
        slot = self._acquire(pool, pk.nbytes)
        t1 = time.perf_counter()
        buf = pool.buffers[slot]
        pk.fill(buf)
        for update in updates:
            update(buf)
        for nb, k, ref in set_later:
            nb[k] = self._keep(ref.view(buf))
        self._base_opt = new_base
        self._send(("diff", pool.gen, slot, step, record))
        self._base_step = step
        self._stats["diffs"] += 1
        self._stats["compress_s"] += computed + time.perf_counter() - t1

    # ------------------------------------------------------------------ checkpointing process
    def _after_resume(self) -> None:
        # started here and awaited at the first hand-off, so that its start-up (importing
        # torch) overlaps whatever the trainer does before its first checkpoint
        self._start_worker()

    def _start_worker(self) -> None:
        if self._proc is not None:
            return
        ctx = spawn_context()
        req_r, req_w = ctx.Pipe(duplex=False)
        res_r, res_w = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=_writer_main,
            args=(str(self.root), self.keep_full, req_r, res_w),
            name="lowdiff-naive-dc",
            daemon=False,
        )
        self._proc.start()
        req_r.close()
        res_w.close()
        self._req, self._res = req_w, res_r
        self._ready = False
        self._handed_off = False

    def _ensure_worker(self) -> None:
        """Wait until the checkpointing process is ready for its first hand-off."""
        self._start_worker()
        if not self._ready:
            deadline = time.monotonic() + self.start_timeout
            self._wait_until(lambda: self._ready, deadline=deadline)
        self._handed_off = True

    def _acquire(self, pool: _Pool, nbytes: int) -> int:
        """A free slot of ``pool`` that holds ``nbytes`` (waits for the checkpointing process)."""
        t0 = time.perf_counter()
        if nbytes > pool.size:
            self._wait_until(lambda: len(pool.free) == len(pool.buffers))
            size = max(_ALIGN, nbytes + nbytes // 8)  # headroom for a state that grows a little
            ensure_shm_space(size * pool.n, f"the {pool.name} hand-off slots")
            pool.buffers = []  # give the old slots back before taking new ones
            pool.buffers = [
                torch.empty(size, dtype=torch.uint8).share_memory_() for _ in range(pool.n)
            ]
            pool.gen += 1
            pool.size = size
            pool.free = list(range(pool.n))
            self._send(("slots", pool.name, pool.gen, pool.buffers))
        self._wait_until(lambda: bool(pool.free))
        self._stats["handoff_wait_s"] += time.perf_counter() - t0
        return pool.free.pop()

    def _send(self, msg: tuple[Any, ...]) -> None:
        assert self._req is not None
        try:
            self._req.send(msg)
        except OSError:
            self._raise_background_error()
            raise CheckpointWorkerError("the checkpointing process closed its connection") from None

    def _receive(self, timeout: float) -> None:
        """Handle every message that arrives within ``timeout`` seconds."""
        if self._res is None:
            return
        with contextlib.suppress(EOFError, OSError):
            if self._res.poll(timeout):
                while True:
                    self._handle(self._res.recv())
                    if not self._res.poll():
                        break

    def _wait_until(self, done: Callable[[], bool], deadline: float | None = None) -> None:
        """Handle messages until ``done()``; raise if the checkpointing process fails."""
        while True:
            self._receive(0.05)
            if done():
                return
            self._raise_background_error()
            if deadline is not None and time.monotonic() > deadline:
                raise CheckpointWorkerError(
                    f"the checkpointing process did not start within {self.start_timeout:.0f} s"
                )

    def _handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "ready":
            self._ready = True
        elif kind == "freed":
            _, name, gen, slot = msg
            pool = self._pools[name]
            if gen == pool.gen:
                pool.free.append(slot)
        elif kind == "written":
            _, what, _step, nbytes, secs = msg
            self._stats[f"{what}_bytes"] += nbytes
            self._stats[f"{what}_write_s"] += secs
            self._stats["bytes_written"] += nbytes
            self._stats["write_s"] += secs
        elif kind in ("durable", "flushed", "closed"):
            self._durable = max(self._durable, int(msg[1]))
            if kind != "durable":
                self._reply = kind
        elif kind == "error":
            _, name, text, tb = msg
            self._worker_error = CheckpointWorkerError(
                f"the checkpointing process failed: {name}: {text}", tb, name in _STORAGE_ERRORS
            )

    def _poll(self) -> None:
        self._receive(0)

    def _raise_background_error(self) -> None:
        self._poll()
        if self._worker_error is not None:
            raise self._worker_error
        if self._proc is not None and not self._proc.is_alive():
            self._poll()
            if self._worker_error is not None:
                raise self._worker_error
            raise CheckpointWorkerError(
                exit_message("the checkpointing process", self._proc, ready=self._ready)
            )

    def _request(self, kind: str, reply: str) -> None:
        self._reply = ""
        self._send((kind,))
        self._wait_until(lambda: self._reply == reply)

    def _flush(self) -> None:
        if self._proc is not None and self._handed_off:
            self._request("flush", "flushed")

    def _shutdown(self) -> None:
        proc = self._proc
        if proc is not None:
            if not self._handed_off:
                proc.kill()  # it was handed nothing, so it has nothing to write
            elif self._closed and self._worker_error is None and proc.is_alive():
                with contextlib.suppress(Exception):  # a failure was raised by close() already
                    self._request("close", "closed")
            # Without close() (garbage collection) the closed pipe makes the process write
            # what it was handed and exit on its own; it is never waited for there.
            for c in (self._req, self._res):
                if c is not None:
                    with contextlib.suppress(OSError):
                        c.close()
            self._req = self._res = self._proc = None
            if self._closed or not self._handed_off:
                proc.join(self.start_timeout)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
        for pool in self._pools.values():
            pool.buffers, pool.free, pool.size = [], [], 0

    # ------------------------------------------------------------------ recovery
    def _recover(self) -> int | None:
        wait_for_writer(self.root, self.start_timeout)
        full_dir, diff_dir = self.root / layout.FULL_DIR, self.root / DIFF_DIR
        for d in (full_dir, diff_dir):
            remove_stale_temps(d)
        t_start = time.perf_counter()
        skipped: list[tuple[str, str]] = []

        def pass_over(path: Path, reason: str, what: str) -> None:
            skipped.append((str(path), reason))
            warnings.warn(f"recovery {what} {path}: {reason}", RecoveryWarning, stacklevel=4)

        state: dict[str, Any] | None = None
        stats = RecoveryStats(full_step=-1, step=-1)  # replaced by the full checkpoint's
        for fstep, path in reversed(published(full_dir, FULL_PREFIX, SUFFIX)):
            stats = RecoveryStats(full_step=fstep, step=fstep)
            try:
                loaded = load_state(path, stats)
                if not isinstance(loaded, dict) or loaded.get("step") != fstep:
                    raise CorruptCheckpointError(path, "its contents do not match its name")
            except CorruptCheckpointError as e:
                pass_over(e.path, e.reason, "passed over")
                quarantine(self.root, path)
                continue
            state = loaded
            break
        if state is None:
            return None

        step = stats.full_step
        beyond: list[Path] = []
        chain = [(s, p) for s, p in published(diff_dir, DIFF_PREFIX, SUFFIX) if s > step]
        for n, (s, path) in enumerate(chain):
            try:
                rec = load_state(path, stats)
                _check_diff(rec, s, step, state, path)
            except _ChainBreak as e:
                # intact, but the checkpoint it continues is missing or was damaged
                damaged = {Path(p).name for p, _ in skipped}
                full = full_dir / f"{FULL_PREFIX}{e.missing:012d}{SUFFIX}"
                missing = (
                    full
                    if full.name in damaged
                    else diff_dir / f"{DIFF_PREFIX}{e.missing:012d}{SUFFIX}"
                )
                pass_over(
                    missing,
                    f"missing or damaged ({path.name} continues it); the chain ends at step {step}",
                    "stopped at",
                )
                # a commit file left without its data goes too
                beyond = [missing] + [p for _, p in chain[n:]]
                break
            except CorruptCheckpointError as e:
                pass_over(e.path, f"{e.reason}; the chain ends at step {step}", "stopped at")
                beyond = [p for _, p in chain[n:]]
                break
            _apply_diff(state, rec, stats)
            step = s
            stats.records_replayed += 1
        for alias, name in self._aliases.items():
            if name in state["model"]:
                state["model"][alias] = state["model"][name]
        moved = [p for p in beyond if p.exists() or commit_path(p).exists()]
        for path in moved:
            quarantine(self.root, path)
        if moved:
            warnings.warn(
                f"recovery moved {len(moved)} differential(s) from {moved[0].name} on "
                f"(past the recovered step {step}) to {self.root / layout.QUARANTINE_DIR}",
                RecoveryWarning,
                stacklevel=3,
            )
        t0 = time.perf_counter()
        # the base is the state recovery rebuilt, copied before the live objects load it
        # (a CPU optimizer keeps loaded tensors by reference)
        self._base_params = {
            n: self._keep(state["model"][n].reshape(-1)) for n, _ in self._float_params
        }
        self._base_opt = {
            idx: {k: self._keep(v) for k, v in entry.items() if isinstance(v, torch.Tensor)}
            for idx, entry in state["optimizer"]["state"].items()
        }
        self._base_step = step
        restore_state(state, self.model, self.optimizer, self.scheduler, where=f"step {step}")
        stats.replay_s += time.perf_counter() - t0
        stats.step = step
        stats.skipped = skipped
        stats.total_s = time.perf_counter() - t_start
        self.recovery_stats = stats
        return step


class _ChainBreak(CorruptCheckpointError):
    """An intact differential that continues a checkpoint the chain does not have."""

    def __init__(self, path: Path, missing: int, reached: int) -> None:
        self.missing, self.reached = missing, reached
        super().__init__(path, f"applies to the state at step {missing}")


def _check_diff(rec: Any, step: int, base_step: int, state: dict[str, Any], path: Path) -> None:
    """Raise :class:`CorruptCheckpointError` unless ``rec`` applies to the state rebuilt so far.

    Everything is checked before anything is applied, so a bad record leaves the state
    untouched.
    """
    if not isinstance(rec, dict) or rec.get("kind") != DIFF_KIND or rec.get("step") != step:
        raise CorruptCheckpointError(path, "not the differential its name says")
    if rec["base_step"] != base_step:
        raise _ChainBreak(path, rec["base_step"], base_step)
    model = state["model"]
    try:
        model_fields = compressor_from_spec(rec["model_compressor"]).fields
        for name, payload in rec["params"].items():
            check_payload(name, payload, model_fields(model[name].numel(), model[name].dtype))
        opt_spec = rec["optimizer_compressor"]
        old_state = state["optimizer"]["state"]
        for idx, entry in rec["optimizer"]["state"].items():
            for k, op in entry.items():
                if op["op"] == "set":
                    continue
                t = old_state[idx][k]
                if op["op"] == "add":
                    if op["delta"].shape != t.shape or op["delta"].dtype != t.dtype:
                        raise ValueError(f"optimizer state {idx}.{k}: shape or dtype differs")
                elif op["op"] == "topk" and opt_spec is not None:
                    fields = compressor_from_spec(opt_spec).fields(t.numel(), t.dtype)
                    check_payload(f"optimizer state {idx}.{k}", op, fields)
                else:
                    raise ValueError(f"unknown operation {op['op']!r}")
    except (KeyError, ValueError, TypeError) as e:
        raise CorruptCheckpointError(path, f"does not fit the state it continues ({e!s})") from None


def _apply_diff(state: dict[str, Any], rec: dict[str, Any], stats: RecoveryStats) -> None:
    """Turn the state at ``rec["base_step"]`` into the state at ``rec["step"]``, in place."""
    decode_s = 0.0
    t_start = time.perf_counter()
    model = state["model"]
    sparse: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    old_state = state["optimizer"]["state"]
    new_state: dict[Any, dict[str, Any]] = {}
    for idx, entry in rec["optimizer"]["state"].items():
        out: dict[str, Any] = {}
        for k, op in entry.items():
            if op["op"] == "set":
                out[k] = op["value"]
            elif op["op"] == "add":
                out[k] = old_state[idx][k].add_(op["delta"])
            else:
                out[k] = old_state[idx][k]
                sparse.append((out[k], op["values"], op["indices"]))
        new_state[idx] = out
    sparse += [(model[n], p["values"], p["indices"]) for n, p in rec["params"].items()]
    for t, values, indices in sparse:
        t0 = time.perf_counter()
        wide = indices.long()  # the top-k decompression: widen the indices
        decode_s += time.perf_counter() - t0
        _add_sparse(t, values, wide)
    model.update(rec["params_set"])
    model.update(rec["model_rest"])
    state["optimizer"] = {"state": new_state, "param_groups": rec["optimizer"]["param_groups"]}
    state["scheduler"] = rec["scheduler"]
    state["rng"] = rec["rng"]
    state["step"] = rec["step"]
    stats.decode_s += decode_s
    stats.replay_s += time.perf_counter() - t_start - decode_s


# --------------------------------------------------------------------------- the error


def recovery_error(
    want_state: Mapping[str, torch.Tensor], got_state: Mapping[str, torch.Tensor]
) -> dict[str, Any]:
    """How far a recovered state lies from the state it stands for.

    Both arguments are flat states as :func:`lowdiff.engine.state.snapshot_state` returns
    them (``"model/<name>"``, ``"optim/<path>"``, JSON and RNG entries).

    Returns:
        ``model_max_abs`` / ``optimizer_max_abs``: the largest absolute difference of any
        floating-point entry of the model's state (parameters and buffers) / of the
        optimizer's state tensors; ``model_max_rel`` / ``optimizer_max_rel``: the largest,
        over those tensors, of ``max|got - want| / max|want|`` (each tensor's error
        relative to its own scale, in the max norm); ``model_rel_l2`` /
        ``optimizer_rel_l2``: ``||got - want||_2 / ||want||_2`` over the whole group;
        ``other_differences``: every other entry (integer tensors, JSON, RNG) that is not
        bit-identical, and every entry that is missing, extra, or of another shape or
        dtype. For a Naïve DC recovery ``other_differences`` is empty: step, counters,
        hyperparameters, scheduler and RNG states are exact.

    Example:
        >>> err = recovery_error(snapshot_state(*reference), snapshot_state(*recovered))  # doctest: +SKIP
        >>> err["model_max_rel"], err["other_differences"]  # doctest: +SKIP
        (0.03, [])
    """
    groups: dict[str, dict[str, float]] = {
        g: {"max_abs": 0.0, "max_rel": 0.0, "sq_diff": 0.0, "sq_ref": 0.0}
        for g in ("model", "optimizer")
    }
    other: list[str] = [f"missing {k}" for k in want_state.keys() - got_state.keys()]
    other += [f"extra {k}" for k in got_state.keys() - want_state.keys()]
    for k in sorted(want_state.keys() & got_state.keys()):
        a, b = want_state[k], got_state[k]
        group = (
            "model" if k.startswith("model/") else "optimizer" if k.startswith("optim/") else None
        )
        if a.dtype != b.dtype or a.shape != b.shape:
            other.append(f"{k} (dtype or shape)")
        elif group is None or not a.is_floating_point():
            if not torch.equal(a, b):
                other.append(k)
        elif a.numel():
            a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
            g = groups[group]
            diff = (b64 - a64).abs()
            top, ref = float(diff.max()), float(a64.abs().max())
            g["max_abs"] = max(g["max_abs"], top)
            g["max_rel"] = max(g["max_rel"], top / ref if ref else top)
            g["sq_diff"] += float(diff.square().sum())
            g["sq_ref"] += float(a64.square().sum())
    out: dict[str, Any] = {}
    for name, g in groups.items():
        out[f"{name}_max_abs"] = g["max_abs"]
        out[f"{name}_max_rel"] = g["max_rel"]
        out[f"{name}_rel_l2"] = (
            math.sqrt(g["sq_diff"] / g["sq_ref"]) if g["sq_ref"] else math.sqrt(g["sq_diff"])
        )
    out["other_differences"] = sorted(other)
    return out


# --------------------------------------------------------------------------- the checkpointing process


class _Writer:
    """The checkpointing process's state: the slots it was given and what it wrote."""

    def __init__(self, root: Path, keep_full: int | None, results: Connection) -> None:
        self.root, self.keep_full, self.results = root, keep_full, results
        self.pools: dict[str, tuple[int, list[torch.Tensor]]] = {}
        self.durable = -1
        self.broken = False
        """Orphaned only: a differential was lost, so none is written before the next full."""

    def send(self, msg: tuple[Any, ...]) -> None:
        with contextlib.suppress(OSError):
            self.results.send(msg)

    def handle(self, msg: tuple[Any, ...]) -> bool:
        kind = msg[0]
        if kind == "slots":
            _, name, gen, buffers = msg
            self.pools[name] = (gen, buffers)
        elif kind in ("full", "diff"):
            _, gen, slot, step, spec = msg
            pool = "full" if kind == "full" else "diff"
            have, buffers = self.pools.get(pool, (-1, []))
            if have != gen:
                raise RuntimeError(f"{kind} record of step {step} refers to slots never received")
            record = _unpack(spec, buffers[slot])
            self.send(("freed", pool, gen, slot))
            self.write(kind, step, record)
        elif kind == "flush":
            self.send(("flushed", self.durable))
        elif kind == "close":
            self.send(("closed", self.durable))
            return False
        else:
            raise RuntimeError(f"unknown message {kind!r}")
        return True

    def handle_orphaned(self, msg: tuple[Any, ...]) -> bool:
        """:meth:`handle` after the trainer died: write what can be written, in order."""
        if msg[0] == "diff" and self.broken:
            return True
        try:
            return self.handle(msg)
        except Exception:  # noqa: BLE001 -- a record whose slots died with the trainer
            if msg[0] in ("diff", "slots"):
                self.broken = True
            return True

    def write(self, kind: str, step: int, record: Any) -> None:
        t0 = time.perf_counter()
        if kind == "full":
            d = self.root / layout.FULL_DIR
            d.mkdir(exist_ok=True)
            nbytes = save_state(d / f"{FULL_PREFIX}{step:012d}{SUFFIX}", record, step=step)
            _retain(self.root, self.keep_full)
            self.broken = False
        else:
            d = self.root / DIFF_DIR
            d.mkdir(exist_ok=True)
            nbytes = save_state(d / f"{DIFF_PREFIX}{step:012d}{SUFFIX}", record, step=step)
        self.durable = max(self.durable, step)
        self.send(("written", kind, step, nbytes, time.perf_counter() - t0))
        self.send(("durable", step))


def _retain(root: Path, keep_full: int | None) -> None:
    """Keep the newest ``keep_full`` full checkpoints and the differentials after the oldest."""
    if keep_full is None:
        return
    fulls = published(root / layout.FULL_DIR, FULL_PREFIX, SUFFIX)
    if not fulls:
        return
    oldest_kept = fulls[max(0, len(fulls) - keep_full)][0]
    remove = [p for s, p in fulls if s < oldest_kept]
    remove += [p for s, p in published(root / DIFF_DIR, DIFF_PREFIX, SUFFIX) if s < oldest_kept]
    for p in remove:
        for q in (commit_path(p), p):  # the commit first: a file without one is never loaded
            with contextlib.suppress(FileNotFoundError):
                q.unlink()


def _writer_main(
    root: str, keep_full: int | None, requests: Connection, results: Connection
) -> None:
    """Entry point of the checkpointing process (spawned)."""
    detach_from_trainer_group()
    torch.set_num_threads(1)  # leave the cores to training
    w = _Writer(Path(root), keep_full, results)
    lock_fd = None
    parent = os.getppid()
    try:
        lock_fd = acquire_flock(Path(root) / layout.WRITER_LOCK_FILE, blocking=True)
        w.send(("ready", os.getpid()))
        if serve(requests, w.handle, parent):
            # the trainer died without close(): write every record it handed off
            drain(requests, w.handle_orphaned, ("slots", "full", "diff"))
    except BaseException as e:  # noqa: BLE001 -- sent back and raised in the trainer
        w.send(("error", type(e).__name__, str(e), traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if lock_fd is not None:
            os.close(lock_fd)

"""LowDiff+'s replica as the trainer sees it: the :class:`~lowdiff.engine.trainer.backend.Backend`
of ``method="lowdiff+"``, and its :class:`~lowdiff.engine.trainer.backend.GradientSource`.

Training runs without compression. The gradients are snapshotted layer by layer during
backward into shared host slots (:mod:`lowdiff.engine.trainer.snapshot`) and merged by
the replica (:mod:`lowdiff.engine.replica.main`) into a CPU replica of the model and
optimizer, persisted in the background. After a trainer crash the next trainer restarts
from the replica in memory and takes its process over
(:mod:`lowdiff.engine.trainer.resume_memory`). The slots are the lag buffers: ``max_lag``
of them, so the replica trails the trainer by at most ``max_lag`` steps.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from lowdiff.ddp.hooks import LowDiffHookState, PlusHookState, plus_hook
from lowdiff.ddp.peers import free_port, holder_of, peer_host
from lowdiff.engine.replica.main import replica_main
from lowdiff.engine.replica.optim import optimizer_class
from lowdiff.engine.trainer.backend import GradientSource
from lowdiff.engine.trainer.parts import SessionParts
from lowdiff.engine.trainer.progress import Progress
from lowdiff.engine.trainer.session import ProcessSession
from lowdiff.engine.trainer.snapshot import GradSnapshotter
from lowdiff.engine.trainer.training import TrainingObjects
from lowdiff.engine.wire.configs import PeerConfig, ReplicaConfig
from lowdiff.engine.wire.messages import Full, Init, Step
from lowdiff.errors import InvalidArgumentError, LowDiffError, UnsupportedSetupError
from lowdiff.format.dtypes import dtype_name
from lowdiff.options import AUTO
from lowdiff.plan import DEFAULT_MTBF_S, resolve_mtbf
from lowdiff.proc.protocol import SlotMessage
from lowdiff.state import capture as st
from lowdiff.state import clipping
from lowdiff.strategy import StepGrads


class SnapshotGradients:
    """LowDiff+'s gradients: snapshotted into the replica's slots during backward.

    Args:
        objects: the training objects (the parameters snapshotted).
        progress: the session's counters.
        max_lag: the slots (the replica trails the trainer by at most that many steps).
    """

    hook_state: LowDiffHookState | None = None

    def __init__(self, objects: TrainingObjects, progress: Progress, max_lag: int) -> None:
        self.objects, self.progress, self.max_lag = objects, progress, max_lag
        self.session: ProcessSession | None = None
        self.snapshotter: GradSnapshotter | None = None
        """The layer-wise gradient snapshotter of the running process, or None."""
        self._install_ddp_hook()

    def _install_ddp_hook(self) -> None:
        """Under DDP: the gradients are taken averaged, from the communication hook."""
        dist = self.objects.dist
        if dist is None or dist.sharded:
            return  # fully_shard: the post-accumulate hooks see the reduce-scattered shard
        owned = {id(p): k for k, (_, p) in enumerate(self.objects.snapshot_params())}
        hook_state = PlusHookState(dist, owned, _weak_method(self._on_reduced_grad, None))
        try:
            self.objects.model.register_comm_hook(hook_state, plus_hook)  # type: ignore[operator]
        except RuntimeError as e:
            raise LowDiffError(f"cannot install lowdiff's DDP communication hook: {e}") from None

    def _on_reduced_grad(self, k: int, grad: torch.Tensor) -> None:
        snap = self.snapshotter
        if snap is not None:
            snap.on_reduced_grad(k, grad)

    def start(self, session: ProcessSession) -> None:
        """Snapshot into ``session``'s slots from now on (a process started or taken over)."""
        assert session.slots is not None
        self.session = session
        if self.snapshotter is not None:
            self.snapshotter.close()
        dist = self.objects.dist
        sharded = dist is not None and dist.sharded
        self.snapshotter = GradSnapshotter(
            self.objects.snapshot_params(),
            session.slots.rows(),
            session.slots.views,
            # the hooks on the model's parameters must not keep a Checkpointer dropped
            # without close() alive (its directory lock, its process): a weak reference
            _weak_method(self._acquire_slot, _dropped),
            autograd_hooks=dist is None or sharded,
            compare_bytes=sharded,
        )

    def _acquire_slot(self) -> int:
        """A free snapshot slot; waits while the replica lags ``max_lag`` steps behind."""
        assert self.session is not None
        t0 = time.perf_counter()
        slot = self.session.take_slot(f"the replica to catch up (max_lag={self.max_lag})")
        self.progress.stats["lag_wait_s"] += time.perf_counter() - t0
        return slot

    def take(self, t: int) -> StepGrads:
        """Finish the layer-wise snapshot of step ``t`` (gradients changed after their
        hook, e.g. by clipping, are copied again)."""
        snap, session = self.snapshotter, self.session
        assert snap is not None and session is not None and session.slots is not None
        out = StepGrads()
        t0 = time.perf_counter()
        try:
            out.slot, out.nograd = snap.finish()
            out.scale = snap.last_scale
        except BaseException:
            if snap.abandon() is not None:
                session.slots.give_back()
            raise
        self.progress.stats["snapshot_finish_s"] += time.perf_counter() - t0
        return out

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float, error_if_nonfinite: bool, foreach: bool | None
    ) -> torch.Tensor | None:
        """Clip the optimizer's gradients as ``torch.nn.utils.clip_grad_norm_`` does, and
        let the snapshot carry the factor instead of copying them again; the total norm.
        None where the snapshot cannot tell a clip from other changes by version counters
        (no process yet, ``fully_shard``): the caller clips as torch does."""
        snap = self.snapshotter
        if snap is None or snap.compare_bytes:
            return None
        grads = [
            p.grad
            for g in self.objects.optimizer.param_groups
            for p in g["params"]
            if p.grad is not None
        ]
        if not grads:
            return None
        total, factor = clipping.norm_and_factor(
            grads, max_norm, norm_type, error_if_nonfinite, foreach
        )
        value = float(factor)  # on a GPU: waits for the norm, as the copies' end does
        if value == 1.0:
            return total  # the clip changes no bit
        if math.isfinite(value):
            spec = (dtype_name(factor.dtype), value)
            snap.record_scaling(functools.partial(clipping.scale_, grads, factor), spec)
        else:  # a non-finite norm: the gradients are copied again at step()
            clipping.scale_(grads, factor)
        return total

    def close(self) -> None:
        if self.snapshotter is not None:
            with contextlib.suppress(Exception):
                self.snapshotter.close()
            self.snapshotter = None


class ReplicaBackend:
    """LowDiff+'s replica (see the module docstring)."""

    kind: ClassVar[str] = "replica"
    keeps_replica: ClassVar[bool] = True
    trains_compressed: ClassVar[bool] = False
    can_suspend: ClassVar[bool] = False
    closes_when_dropped: ClassVar[bool] = False
    sends_fulls: ClassVar[bool] = False
    first_message: ClassVar[type[Full]] = Init
    resume_message: ClassVar[type[Full] | None] = Init
    slot_message: ClassVar[type[SlotMessage]] = Step

    def __init__(self, parts: SessionParts, gradients: GradientSource) -> None:
        assert isinstance(gradients, SnapshotGradients)
        (self.objects, self.progress, self.cadence, self.options, self.directory,
         self.session) = parts.unpack()  # fmt: skip
        self.gradients = gradients
        self.peer: PeerConfig | None = None
        """The peer copy the next process keeps (:meth:`prepare_launch`), or None."""

    @staticmethod
    def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
        """A torch.optim optimizer (the replica runs it on the CPU) whose parameters all
        take a gradient (each is snapshotted through a hook)."""
        optimizer_class(st.class_path(optimizer))
        frozen = [
            (gi, pi, tuple(p.shape))
            for gi, g in enumerate(optimizer.param_groups)
            for pi, p in enumerate(g["params"])
            if not p.requires_grad
        ]
        if frozen:
            gi, pi, shape = frozen[0]
            raise UnsupportedSetupError(
                f"method 'lowdiff+': {len(frozen)} parameter(s) of the optimizer do not require "
                f"a gradient (frozen; the first: group {gi}, parameter {pi}, shape {list(shape)}). "
                "LowDiff+ snapshots each gradient through a hook on the parameters it is built "
                "with: leave frozen parameters out of the optimizer (e.g. "
                "Adam(p for p in model.parameters() if p.requires_grad)), or use method "
                "'lowdiff'"
            )

    def prepare_launch(self) -> None:
        """With peer copies: every rank picks the address its new replica will listen on
        for its source, and the ranks trade them (a collective)."""
        ctx = self.objects.dist
        if ctx is None or self.objects.peer is None:
            return
        host = peer_host(self.options.peer_address)
        mine = (host, free_port(host), os.urandom(32))
        every = ctx.all_gather_object(mine)
        holder = holder_of(
            ctx.rank, ctx.world_size, (ctx.rank - self.objects.peer) % ctx.world_size
        )
        self.peer = self._peer_config(
            (mine[0], mine[1]), mine[2], holder, (every[holder][0], every[holder][1]),
            every[holder][2],
        )  # fmt: skip

    def _peer_config(
        self,
        listen: tuple[str, int] = ("", 0),
        key: bytes = b"",
        holder: int = -1,
        holder_address: tuple[str, int] = ("", 0),
        holder_key: bytes = b"",
    ) -> PeerConfig | None:
        """The peer copy a process keeps (None: none); without addresses, what identifies
        it (a request to take a process over, before this trainer launched one)."""
        objects = self.objects
        if objects.peer is None:
            return None
        assert objects.snapshot_layout is not None
        mirror = objects.peer_layout is None  # fully_shard: the source's rows, sent whole
        return PeerConfig(
            objects.peer, list(objects.peer_shard),
            {} if mirror else objects.peer_layout.to_json(),  # type: ignore[union-attr]
            objects.snapshot_layout.to_json(), listen, key, holder, holder_address, holder_key,
            self.options.start_timeout, mirror=mirror,
        )  # fmt: skip

    def process(self, run_id: str) -> tuple[Callable[..., None], Any, int]:
        objects, opts = self.objects, self.options
        assert objects.layout is not None
        persist_every = opts.persist_every
        if objects.dist is not None and persist_every == AUTO:
            # every rank's replica must persist the same steps, so that every shard has them
            persist_every = self.cadence.full_every
        cfg = ReplicaConfig(
            str(self.directory.root),
            run_id,
            objects.layout.to_json(),
            st.class_path(objects.optimizer),
            persist_every,
            opts.keep_full,
            opts.idle_timeout,
            opts.replica_threads,
            None if objects.dist is None else list(objects.shard),
            remote=self.directory.remote_settings(opts.remote_settings()),
            mtbf=resolve_mtbf(opts.mtbf)[0] if persist_every == AUTO else DEFAULT_MTBF_S,
            peer=self.peer if self.peer is not None else self._peer_config(),
        )
        return replica_main, cfg, opts.max_lag

    def started(self) -> None:
        """Snapshot into the process's slots from now on."""
        self.gradients.start(self.session)

    def take_slot(self, t: int, grads: StepGrads) -> int:
        """The slot the snapshot of step ``t`` was taken into during backward."""
        return grads.slot

    def check_attach(self) -> None:
        if self.options.max_lag < 2:
            raise InvalidArgumentError(
                "attach() with method 'lowdiff+' needs max_lag >= 2 (a step is handed over "
                "when the next one begins, so two snapshot slots are in use at once)"
            )

    def release(self) -> None:
        self.gradients.close()


def _dropped() -> Any:
    raise LowDiffError("this Checkpointer was dropped; its gradient hooks are inactive")


def _weak_method(method: Callable[..., Any], gone: Callable[[], Any] | None) -> Callable[..., Any]:
    """``method`` (a bound method) through a weak reference to its object: once the
    object is collected, a call runs ``gone()`` instead (None: does nothing)."""
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def call(*args: Any) -> Any:
        m = ref()
        if m is None:
            return None if gone is None else gone()
        return m(*args)

    return call

"""The training objects as lowdiff's trainer side sees them, and their record layout.

:class:`TrainingObjects` holds the model, optimizer, scheduler and ``extra_state``, the
optimized parameters in the optimizer's order (under DDP: the shard this rank
checkpoints; under ``fully_shard``: this rank's local shards), the compressor of the
records, and the record layout (:meth:`TrainingObjects.lay_out`). Nothing in it changes
after construction but the layout, set once; the step, the durable step and the counters
are :mod:`lowdiff.engine.trainer.progress`'s, the directory
:mod:`lowdiff.engine.trainer.directory`'s.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
from pathlib import Path
from typing import Any

import torch

from lowdiff.compressors.base import Compressor
from lowdiff.ddp.context import DistContext, assign_shards
from lowdiff.ddp.shard import shard_state_dict
from lowdiff.errors import CheckpointMismatchError, InvalidArgumentError, UnsupportedSetupError
from lowdiff.format.sfile import FORMAT_NAME, FORMAT_VERSION
from lowdiff.recovery.compat import check_compatible
from lowdiff.state import capture as st
from lowdiff.state.model_config import model_config_entry
from lowdiff.state.record import RecordLayout
from lowdiff.state.sharded import local


def dumps(tree: Any) -> str:
    """Compact JSON (no NaN), as records and manifests store it."""
    return json.dumps(tree, separators=(",", ":"), allow_nan=False)


class TrainingObjects:
    """The training objects, their parameters and the record layout.

    Args:
        name: the method's name (written to the manifest, checked on resume).
        model, optimizer, scheduler: the training objects.
        compressor: the compressor whose records this session writes (``MergedSparse``
            under DDP).
        dist: the DDP context, or None in a single process.
        extra_state: the ``extra_state`` objects (already checked).
    """

    def __init__(
        self,
        name: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any | None,
        compressor: Compressor,
        dist: DistContext | None,
        extra_state: dict[str, Any],
    ) -> None:
        self.name = name
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.compressor = compressor
        self.dist = dist
        self.extra = extra_state
        self.n_groups = len(optimizer.param_groups)
        """The optimizer's parameter groups (a group added later cannot be checkpointed)."""
        self.params = _optimized_params(model, optimizer, dist)
        self.numels = [local(p).numel() for _, p in self.params]
        self.record_device = _record_device(self.params)
        """The device records are copied from (None: the CPU, copies are synchronous)."""
        self.buffer_names = st.buffer_names(model)
        self.buffer_refs = st.BufferRefs(model, self.buffer_names)
        self.hp_text = st.HparamsText()
        self.shard = [info.index for info, _ in self.params]
        """The optimizer indices this rank checkpoints (all of them in one process)."""
        self.foreign: set[str] = set()
        """Under DDP: names of the parameters other ranks checkpoint."""
        self.owner: list[int] = []
        """Under DDP: the rank that checkpoints each optimizer index."""
        if dist is not None and not dist.sharded:
            self.owner = owner = assign_shards(self.numels, dist.world_size)
            self.shard = [i for i, r in enumerate(owner) if r == dist.rank]
            self.foreign = {info.name for info, _ in self.params if owner[info.index] != dist.rank}
        self.peer: int | None = None
        """With LowDiff+'s peer copies (a job across nodes): the rank whose shard this
        rank's replica also keeps (:mod:`lowdiff.ddp.peers`), else None."""
        self.peer_shard: list[int] = []
        """Under DDP, the optimizer indices of :attr:`peer`'s shard (empty under
        ``fully_shard``: the copy is a mirror of that rank's replica)."""
        self.rng_layout: st.RngLayout | None = None
        self.rng_capture: st.RngCapture | None = None
        self.layout: RecordLayout | None = None
        self.snapshot_layout: RecordLayout | None = None
        """The layout of LowDiff+'s snapshot slots: :attr:`layout`, or with peer copies
        the gradients of this rank's shard and of :attr:`peer`'s."""
        self.peer_layout: RecordLayout | None = None
        """With peer copies: the layout of :attr:`peer`'s shard (its replica's)."""
        self.layout_id = ""
        """``layout.layout_id``, taken once (a hash of the layout's JSON: every full
        checkpoint names it, and the engine never changes its layout)."""

    def lay_out(self) -> None:
        """Lay out the records (methods that write them; once, before the first step)."""
        self.rng_layout = st.RngLayout()
        self.rng_capture = st.RngCapture(self.rng_layout)
        buffers = [
            (n, b.dtype, tuple(b.shape))
            for n, b in st.get_buffers(self.model, self.buffer_names).items()
        ]
        self.layout = RecordLayout.build(
            [info for info, _ in self.shard_params()], self.compressor, buffers, self.rng_layout
        )
        self.layout_id = self.layout.layout_id
        self.snapshot_layout = self.layout
        if self.peer is not None and self.peer_shard:
            peer = set(self.peer_shard)
            self.peer_layout = RecordLayout.build(
                [info for info, _ in self.params if info.index in peer],
                self.compressor, buffers, self.rng_layout,
            )  # fmt: skip
            self.snapshot_layout = RecordLayout.build(
                [info for info, _ in self.snapshot_params()],
                self.compressor, buffers, self.rng_layout,
            )  # fmt: skip

    def keep_peer_copy(self, source: int | None) -> None:
        """Keep a copy of rank ``source``'s shard too (None: none); before the layout.
        Under ``fully_shard`` this rank holds none of its gradients or state: the copy
        mirrors the source's replica (:attr:`peer_shard` stays empty)."""
        assert self.layout is None and self.dist is not None or source is None
        self.peer = source
        self.peer_shard = (
            [] if source is None else [i for i, r in enumerate(self.owner) if r == source]
        )

    # ------------------------------------------------------------------ parameters
    def shard_params(self) -> list[tuple[st.ParamInfo, torch.nn.Parameter]]:
        """The parameters this rank checkpoints (its shard under DDP)."""
        shard = set(self.shard)
        return [(i, p) for i, p in self.params if i.index in shard]

    def snapshot_params(self) -> list[tuple[st.ParamInfo, torch.nn.Parameter]]:
        """The parameters whose gradients LowDiff+ snapshots: this rank's shard, and
        with a peer copy :attr:`peer`'s shard too."""
        keep = set(self.shard) | set(self.peer_shard)
        return [(i, p) for i, p in self.params if i.index in keep]

    def peer_state(self) -> tuple[dict[str, torch.Tensor], str]:
        """:attr:`peer`'s shard of the model's parameters and of the optimizer's state
        (every rank holds all of both under DDP): what the peer copy starts from."""
        peer = set(self.peer_shard)
        tensors = {
            f"peer/model/{info.name}": p.detach() for info, p in self.params if info.index in peer
        }
        otensors, ojson = st.optimizer_state_tensors(
            self.optimizer, shard_state_dict(self.optimizer.state_dict(), self.peer_shard)
        )
        tensors.update({f"peer/{k}": v for k, v in otensors.items()})
        return tensors, ojson

    def optimizer_state(self) -> tuple[dict[str, torch.Tensor], str]:
        """The optimizer's state tensors (this rank's shard under DDP) and its JSON."""
        if self.dist is None or self.dist.sharded:
            return st.optimizer_state_tensors(self.optimizer)
        return st.optimizer_state_tensors(
            self.optimizer, shard_state_dict(self.optimizer.state_dict(), self.shard)
        )

    def groups_changed(self) -> bool:
        """Whether the optimizer gained a parameter group since construction."""
        return len(self.optimizer.param_groups) != self.n_groups

    def check_groups(self) -> None:
        """Refuse an optimizer that gained a parameter group since construction."""
        if self.groups_changed():
            groups = len(self.optimizer.param_groups)
            raise UnsupportedSetupError(
                f"the optimizer has {groups} parameter groups, {self.n_groups} when the "
                "Checkpointer was built (optimizer.add_param_group()): lowdiff's records and "
                "full checkpoints hold the parameters it was built with, so nothing from here "
                "on could be restored. Add every group before building the Checkpointer (a "
                "group may start frozen or with lr 0), or close it and start a new directory"
            )

    # ------------------------------------------------------------------ the manifest
    def manifest(
        self, run_id: str, configured: dict[str, int | str], keep_full: int | None
    ) -> dict[str, Any]:
        """The manifest of a session that writes as ``run_id``."""
        assert self.layout is not None
        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "strategy": self.name,
            "compressor": self.compressor.spec(),
            "optimizer": st.class_path(self.optimizer),
            "scheduler": None if self.scheduler is None else st.class_path(self.scheduler),
            "record_layout": self.layout.to_json(),
            "layout_id": self.layout_id,
            "full_every": configured["full_every"],
            "batch_size": configured["batch_size"],
            "keep_full": keep_full,
            "torch": torch.__version__,
            "updated": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "run_id": run_id,
            **model_config_entry(self.model),  # what an "hf" export rebuilds the model from
        }

    def check_manifest(self, manifest: dict[str, Any], root: Path | None) -> None:
        """Refuse a directory (``root``, for the messages) written by another method,
        compressor, model, optimizer, record layout or scheduler."""
        assert self.layout is not None
        if manifest.get("strategy") != self.name:
            raise CheckpointMismatchError(
                f"{root} was written by method {manifest.get('strategy')!r}, this Checkpointer uses {self.name!r}"
            )
        if manifest.get("compressor") != self.compressor.spec():
            raise CheckpointMismatchError(
                f"{root} was written with compressor {manifest.get('compressor')}, this Checkpointer uses "
                f"{self.compressor.spec()}; resume with the same compressor settings"
            )
        if self.dist is None:
            check_compatible(manifest, self.model, self.optimizer)
        if manifest.get("layout_id") != self.layout_id:
            raise CheckpointMismatchError(
                f"{root}: the record layout differs (model buffers or CUDA devices changed since the "
                "checkpoint was written)"
            )
        want = None if self.scheduler is None else st.class_path(self.scheduler)
        if manifest.get("scheduler") != want:
            raise CheckpointMismatchError(
                f"{root} was written with scheduler {manifest.get('scheduler')}, got {want}"
            )


def _optimized_params(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, dist: DistContext | None
) -> list[tuple[st.ParamInfo, torch.nn.Parameter]]:
    """The optimized parameters in the optimizer's order, dense ones only."""
    params = st.optimizer_params(model, optimizer)
    if dist is not None and dist.sharded:
        # under fully_shard a rank holds, snapshots and restores its own shard of every
        # parameter: the layout is that of the local shards
        params = [(dataclasses.replace(info, shape=tuple(local(p).shape)), p) for info, p in params]
    for info, p in params:
        if p.is_sparse:
            raise InvalidArgumentError(
                f"parameter {info.name!r} is sparse; lowdiff supports dense parameters only"
            )
    _refuse_sparse_gradients(model, {id(p) for _, p in params})
    return params


def _record_device(params: list[tuple[st.ParamInfo, torch.nn.Parameter]]) -> torch.device | None:
    """The one device of the parameters, None for the CPU."""
    devices = {p.device for _, p in params}
    if len(devices) > 1:
        raise InvalidArgumentError(
            f"all optimized parameters must be on one device, found {sorted(map(str, devices))}"
        )
    dev = next(iter(devices), torch.device("cpu"))
    return None if dev.type == "cpu" else dev


def _refuse_sparse_gradients(model: torch.nn.Module, optimized: set[int]) -> None:
    """Refuse, before anything is written, the modules whose optimized weight gets sparse
    gradients (``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True``); other sources
    of a sparse gradient are refused at the step that meets one."""
    for name, m in model.named_modules():
        sparse = isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse
        if sparse and id(m.weight) in optimized:
            where = f"{name}.weight" if name else "weight"
            raise InvalidArgumentError(
                st.sparse_gradient_error(where, f"{type(m).__name__}(sparse=True)")
            )

"""An FSDP2 job's shards joined into whole tensors: the job read in one plain process.

Under ``fully_shard`` (``Shard(0)`` on a 1-D mesh) rank ``r`` of ``W`` holds chunk ``r``
of ``torch.chunk(t, W, dim=0)`` of every parameter ``t``, and the same chunk of its
per-parameter optimizer state; its shard directory holds those chunks (see
``docs/format.md``). Concatenating the ranks' chunks in rank order gives the whole tensor
back, bit for bit, uneven and empty chunks included. Buffers, RNG, scheduler and extra
state are per rank (FSDP2 does not shard buffers): rank 0's are taken (rank
``min(r, W - 1)``'s for new rank ``r`` when a job resumes at another world size, which cuts
the whole tensors again into the new world size's chunks: :func:`cut_for_rank`).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import torch

from lowdiff.ddp.context import rank_dir
from lowdiff.errors import CheckpointMismatchError, RecoveryError
from lowdiff.format import layout, sfile
from lowdiff.recovery.full_state import apply_full_state
from lowdiff.recovery.job_layout import Generation, generations
from lowdiff.recovery.shards import scan_dirs
from lowdiff.recovery.stats import RecoveryStats
from lowdiff.state import capture as st
from lowdiff.state.record import RecordLayout
from lowdiff.state.sharded import is_dtensor, local

__all__ = ["cut_for_rank", "fsdp2_full_state", "newest_fsdp2_state", "recover_fsdp2"]

_OPTIM_STATE = re.compile(r"optim/state\[(\d+)\]\..+")


def fsdp2_full_state(
    job: Path, step: int | None = None, rank: int = 0
) -> tuple[dict[str, torch.Tensor], dict[str, str], int]:
    """The whole state of the FSDP2 job (or generation) in ``job`` at ``step`` (None: the
    newest step every shard holds), as a single process's full checkpoint holds it:
    (tensors, metadata, step), with the per-rank state of rank ``min(rank, W - 1)``.

    Raises:
        RecoveryError: ``step`` is not held by every shard (the message lists the steps
            that are), or no step is.
    """
    world = int(layout.read_manifest(job)["world_size"])
    scans = scan_dirs(job, [rank_dir(job, r) for r in range(world)])
    served = set.intersection(*({f.first_step for f in sc.fulls} for sc in scans))
    if step is None:
        if not served:
            raise RecoveryError(f"{job}: no step is held by every one of the {world} shards")
        step = max(served)
    elif step not in served:
        raise RecoveryError(
            f"{job}: step {step} is not held by every one of the {world} shards; steps "
            f"every shard holds: {sorted(served)}"
        )
    parts = []
    for sc in scans:
        full = [f for f in sc.fulls if f.first_step == step][-1]
        lf = sfile.decode(full.path, sfile.read_raw(full.path))
        rl = RecordLayout.from_json(sc.manifest["record_layout"])
        shapes = {p.index: tuple(p.shape) for p in rl.params}
        names = {p.name: tuple(p.shape) for p in rl.params}
        parts.append((lf.tensors, lf.metadata, shapes, names))
    own, md, _, own_names = parts[min(rank, world - 1)]
    out = dict(own)
    for key in own:
        if key.startswith("model/") and key[len("model/") :] in own_names:
            name = key[len("model/") :]
            if all(tuple(t[key].shape) == n[name] for t, _, _, n in parts):
                out[key] = torch.cat([t[key] for t, _, _, _ in parts])
            continue
        m = _OPTIM_STATE.fullmatch(key)
        if m is None:
            continue
        i = int(m.group(1))
        # per-parameter state has the shape of the rank's chunk; scalars (``step``) do not
        if all(t[key].dim() and tuple(t[key].shape) == s[i] for t, _, s, _ in parts):
            out[key] = torch.cat([t[key] for t, _, _, _ in parts])
    return out, md, step


def newest_fsdp2_state(
    job: Path, step: int | None = None, rank: int = 0
) -> tuple[dict[str, torch.Tensor], dict[str, str], int, Generation]:
    """:func:`fsdp2_full_state` of the newest generation of ``job`` that serves ``step``
    (None: its newest step), and that generation."""
    errors = []
    for g in reversed(generations(job)):
        try:
            return (*fsdp2_full_state(g.root, step, rank), g)
        except RecoveryError as e:
            errors.append(str(e))
    raise RecoveryError("; ".join(errors) or f"{job} holds no generation")


def cut_for_rank(
    tensors: dict[str, torch.Tensor], model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, torch.Tensor]:
    """Whole tensors (:func:`fsdp2_full_state`) cut to this rank's chunks of the live
    ``fully_shard``ed model: parameters and their per-parameter optimizer state.

    Raises:
        CheckpointMismatchError: a parameter's shape differs from the checkpoint's.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    by_name = dict(st.unwrap_model(model).named_parameters())

    def cut(key: str, full: torch.Tensor, p: Any) -> torch.Tensor:
        if tuple(full.shape) != tuple(p.shape):
            raise CheckpointMismatchError(
                f"{key}: checkpoint shape {tuple(full.shape)}, model shape {tuple(p.shape)}"
            )
        if not is_dtensor(p):
            return full
        mine = local(p)
        # fully_shard's chunks: ceil(rows / W) rows each, in rank order (the last ones
        # shorter or empty)
        rows = -(-full.shape[0] // p.device_mesh.size())
        start = min(p.device_mesh.get_local_rank() * rows, full.shape[0])
        return full[start : start + mine.shape[0]].clone()

    out = dict(tensors)
    for key, t in tensors.items():
        if key.startswith("model/") and key[len("model/") :] in by_name:
            out[key] = cut(key, t, by_name[key[len("model/") :]])
            continue
        m = _OPTIM_STATE.fullmatch(key)
        if m is not None and int(m.group(1)) < len(params):
            p = params[int(m.group(1))]
            if t.dim() and tuple(t.shape) == tuple(p.shape):
                out[key] = cut(key, t, p)
    return out


def recover_fsdp2(
    job: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: object | None = None,
    step: int | None = None,
) -> RecoveryStats:
    """Restore an FSDP2 job's state at ``step`` into a plain (unsharded) model and its
    optimizer, in one process (rank 0's buffers, RNG and scheduler)."""
    t0 = time.perf_counter()
    tensors, md, step, _ = newest_fsdp2_state(job, step)
    stats = RecoveryStats(full_step=step, step=step, source="disk")
    stats.read_s = time.perf_counter() - t0
    apply_full_state(
        tensors, md, model, optimizer, scheduler, stats, where=f"{job} (every shard), step {step}"
    )
    stats.total_s = time.perf_counter() - t0
    return stats

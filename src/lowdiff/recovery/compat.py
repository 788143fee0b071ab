"""Whether a checkpoint fits the live objects it is loaded into: the optimizer's and
scheduler's classes, and the model's optimized parameters (names, shapes, dtypes), for
one directory or every shard of a job.
Every reader checks before it loads anything (a directory, a job's shards, resume())."""

from __future__ import annotations

from typing import Any

import torch

from lowdiff.errors import CheckpointMismatchError
from lowdiff.state import capture as st
from lowdiff.state.record import RecordLayout
from lowdiff.state.sharded import local


def check_classes(manifest: dict[str, Any], optimizer: Any, scheduler: Any | None) -> None:
    """Raise :class:`CheckpointMismatchError` unless the optimizer, and the scheduler when
    one is passed, are of the classes the checkpoint was written with (a scheduler of
    another class would take the saved state's keys into its own and step wrongly; None
    restores no scheduler state)."""
    want = st.class_path(optimizer)
    if manifest.get("optimizer") != want:
        raise CheckpointMismatchError(
            f"the checkpoint was written with optimizer {manifest.get('optimizer')}, got {want}"
        )
    if scheduler is None or getattr(scheduler, "takes_any_scheduler_state", False):
        return  # no scheduler state restored, or a holder of whichever state there is
    have = manifest.get("scheduler")
    sched = st.class_path(scheduler)
    if have is None:
        raise CheckpointMismatchError(
            f"a scheduler ({sched}) was passed, but the checkpoint was written without one; "
            "pass scheduler=None"
        )
    if have != sched:
        raise CheckpointMismatchError(
            f"the checkpoint was written with scheduler {have}, got {sched}"
        )


def check_compatible(
    manifest: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None = None,
) -> RecordLayout:
    """Raise :class:`CheckpointMismatchError` unless model, optimizer and scheduler fit
    the checkpoint."""
    rl = RecordLayout.from_json(manifest["record_layout"])
    check_classes(manifest, optimizer, scheduler)
    try:
        live = st.optimizer_params(model, optimizer)
    except ValueError as e:
        raise CheckpointMismatchError(str(e)) from None
    problems = []
    if len(live) != len(rl.params):
        problems.append(
            f"the checkpoint has {len(rl.params)} optimized parameters, the optimizer has {len(live)}"
        )
    for (info, p), saved in zip(live, rl.params, strict=False):
        shape = tuple(local(p).shape)  # under fully_shard the shard directory holds shards
        if info.name != st.canonical_name(saved.name):
            problems.append(
                f"parameter #{saved.index}: checkpoint name {saved.name!r}, model name {info.name!r}"
            )
        elif shape != saved.shape:
            problems.append(
                f"parameter {saved.name!r}: checkpoint shape {list(saved.shape)}, model shape {list(shape)}"
            )
        elif info.dtype != saved.dtype:
            problems.append(
                f"parameter {saved.name!r}: checkpoint dtype {saved.dtype}, model dtype {info.dtype}"
            )
        if len(problems) >= 8:
            problems.append("...")
            break
    if problems:
        raise CheckpointMismatchError(
            "the model does not match the checkpoint: " + "; ".join(problems)
        )
    return rl


def check_compatible_sharded(
    rls: list[RecordLayout],
    manifests: list[dict[str, Any]],
    model: Any,
    optimizer: Any,
    scheduler: Any | None = None,
) -> None:
    for m in manifests:
        check_classes(m, optimizer, scheduler)
    saved = sorted((p for rl in rls for p in rl.params), key=lambda p: p.index)
    live = st.optimizer_params(model, optimizer)
    if [p.index for p in saved] != list(range(len(live))):
        raise CheckpointMismatchError(
            f"the shards hold {len(saved)} parameters, the optimizer has {len(live)}"
        )
    for (info, _), s in zip(live, saved, strict=True):
        if (info.name, info.shape, info.dtype) != (s.name, s.shape, s.dtype):
            raise CheckpointMismatchError(
                f"parameter #{s.index}: checkpoint {s.name!r} {list(s.shape)} {s.dtype}, model "
                f"{info.name!r} {list(info.shape)} {info.dtype}"
            )

"""Recovery of a distributed job: one agreed step, the whole state on every rank.

A job may have been resumed at other world sizes, each writing a generation of shards
(:mod:`lowdiff.recovery.job_layout`). Readers take the newest generation that serves the
step asked for (:func:`serving_generation`), and rank ``r`` of the reader takes the
per-rank state of the generation's rank ``min(r, W - 1)``; the shards of that generation
are then read and replayed at one step every rank agrees on
(:mod:`lowdiff.recovery.shards`). A generation 0 that a single process wrote is recovered
as that process's directory.

Call sequence (:func:`recover_generations`, under a process group; :func:`recover_job`
runs the same in one process, where every agreement is with itself):

0) (all ranks) pick the newest generation every rank can serve the step from;
1) (all ranks) agree on the target step (the minimum over the ranks) and the full
   checkpoint to start from;
2) (every rank) load every shard's full state and replay every shard's records;
3) (all ranks) check that they reached the same step.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

from lowdiff.ddp.context import DistContext
from lowdiff.errors import (
    CorruptCheckpointError,
    InvalidArgumentError,
    NotACheckpointDirectoryError,
    RecoveryError,
)
from lowdiff.recovery.job_layout import (
    JOB_KIND,
    Generation,
    generation_dir,
    generations,
    is_job_dir,
    job_manifest,
    job_sharding,
    rank_root,
    refuse_fsdp2_job,
)
from lowdiff.recovery.replay import pass_over_full, replay, warn_damaged
from lowdiff.recovery.scan import (
    chain_from,
    make_plan,
    merge_intervals,
    recoverable_intervals,
    scan,
    usable,
)
from lowdiff.recovery.shards import apply_sharded_state, plan_sharded, recover_shards, scan_dirs
from lowdiff.recovery.stats import RecoveryStats

__all__ = [
    "generation_intervals",
    "recover_generations",
    "recover_job",
    "serving_generation",
    # re-exported: lowdiff.engine imports these from here (they live in job_layout and shards)
    "JOB_KIND",
    "Generation",
    "apply_sharded_state",
    "generation_dir",
    "generations",
    "is_job_dir",
    "job_manifest",
    "job_sharding",
    "rank_root",
    "refuse_fsdp2_job",
]


def recover_generations(
    root: Path,
    ctx: DistContext,
    model: Any,
    optimizer: Any,
    scheduler: Any | None = None,
    step: int | None = None,
) -> tuple[Generation, RecoveryStats]:
    """(all ranks) Bring every rank to one agreed step and name the generation it came from.

    Any world size may resume any generation: rank ``r`` takes the parameters and
    optimizer state from their owners in that generation, and the per-rank state (buffers,
    RNG streams, scheduler) of the generation's rank ``min(r, W - 1)``.
    """
    if not generations(root):
        raise NotACheckpointDirectoryError(f"{root} holds no distributed lowdiff checkpoint")

    def agree_min(value: int) -> int:
        return ctx.all_min([value])[0]

    return _recover_any(root, ctx.rank, model, optimizer, scheduler, step, agree_min, ctx.agree)


def recover_job(
    root: str | Path,
    model: Any,
    optimizer: Any,
    scheduler: Any | None = None,
    step: int | None = None,
    *,
    rank: int = 0,
) -> RecoveryStats:
    """Rebuild a distributed job's state at ``step`` in this one process, without a group.

    The job may have been written by any number of ranks, and resumed at other world sizes
    (generations): the newest generation that serves ``step`` is read. Parameters and
    their optimizer state come from the shards that own them; buffers, RNG streams and
    scheduler state are those of rank ``min(rank, W - 1)`` of that generation (0: what
    rank 0 held at that step). Nothing in ``root`` is written.

    Example:
        >>> recover_job("runs/ddp", model, optimizer, scheduler, step=120)  # doctest: +SKIP
    """
    root = Path(root)
    gens = generations(root)
    if not is_job_dir(root):
        raise NotACheckpointDirectoryError(f"{root} holds no distributed lowdiff checkpoint")
    refuse_fsdp2_job(root, "reading it in one process")
    world = max(g.world_size for g in gens)
    if not 0 <= rank < world:
        raise InvalidArgumentError(
            f"rank must be in 0..{world - 1} for a job of {world} ranks, got {rank}"
        )

    def same(value: int, what: str = "") -> int:  # noqa: ARG001 -- one process agrees with itself
        return value

    return _recover_any(root, rank, model, optimizer, scheduler, step, same, same)[1]


def _check_serves(g: Generation, step: int | None) -> None:
    """Raise unless every shard of ``g`` can serve ``step`` (None: any step), by the headers."""
    if g.single:
        make_plan(scan(g.root), step)
    else:
        plan_sharded(scan_dirs(g.root, g.shard_dirs()), step)


def generation_intervals(
    g: Generation, exclude: AbstractSet[Path] | None = None
) -> list[tuple[int, int]]:
    """The steps generation ``g`` serves, as sorted, disjoint inclusive intervals (by the
    headers, leaving out the files in ``exclude``; for a sharded generation, the steps
    every shard serves)."""
    exclude = exclude or frozenset()
    if g.single:
        return recoverable_intervals(scan(g.root), exclude)
    scans = scan_dirs(g.root, g.shard_dirs())
    common = set.intersection(
        *({f.first_step for f in sc.fulls if f.path not in usable(sc, exclude)} for sc in scans)
    )
    return merge_intervals((f, min(chain_from(sc, f, exclude)[0] for sc in scans)) for f in common)


def _describe_generations(gens: list[Generation]) -> str:
    """Each generation's recoverable steps, for an error that names them all."""
    parts = []
    for g in gens:
        try:
            iv = ", ".join(f"{lo}..{hi}" for lo, hi in generation_intervals(g)) or "nothing"
        except (RecoveryError, NotACheckpointDirectoryError, CorruptCheckpointError) as e:
            iv = f"unreadable ({e})"
        ranks = f"{g.world_size} rank{'s' if g.world_size != 1 else ''}"
        parts.append(f"{iv} (generation {g.index}, {ranks} from step {g.start_step})")
    return "; ".join(parts)


def serving_generation(
    root: Path, step: int | None, agree_min: Callable[[int], int] | None = None
) -> Generation:
    """The newest generation of the job in ``root`` that serves ``step`` (None: any step).

    With ``agree_min``, every rank of a job settles on the same one. When none does, the
    error is that of the newest generation begun at or before ``step``.
    """
    gens = generations(root)
    if not gens:
        raise NotACheckpointDirectoryError(f"{root} holds no lowdiff checkpoint")
    errors: list[Exception] = []
    for g in reversed(gens):
        ok = 0
        if step is None or step >= g.start_step:
            try:
                _check_serves(g, step)
                ok = 1
            except (RecoveryError, NotACheckpointDirectoryError, CorruptCheckpointError) as e:
                errors.append(e)
        if (agree_min(ok) if agree_min is not None else ok) == 1:
            return g
    if errors and not (len(gens) > 1 and type(errors[0]) is RecoveryError):
        raise errors[0]
    # several generations, none serves the step: name what each of them does serve
    raise RecoveryError(
        f"{root}: step {step} is not recoverable in any generation of the job; recoverable: "
        f"{_describe_generations(gens)}"
    )


def _recover_any(
    root: Path,
    rank: int,
    model: Any,
    optimizer: Any,
    scheduler: Any | None,
    step: int | None,
    agree_min: Callable[[int], int],
    agree: Callable[[int, str], int],
) -> tuple[Generation, RecoveryStats]:
    g = serving_generation(root, step, agree_min)
    agree(g.index, "the generation to recover from")
    if g.single:
        sc = scan(g.root)
        target = agree_min(make_plan(sc, step).target)
        stats = _recover_single(
            g.root, model, optimizer, scheduler, target, strict=step is not None
        )
        agree(stats.step, "the recovered step")
        return g, stats
    own = min(rank, g.world_size - 1)
    return g, recover_shards(
        g.root, g.shard_dirs(), own, model, optimizer, scheduler, step, agree_min, agree
    )


def _recover_single(
    root: Path, model: Any, optimizer: Any, scheduler: Any | None, step: int, *, strict: bool
) -> RecoveryStats:
    """A single process's directory (generation 0 of a job that resumed it) at ``step``."""
    sc = scan(root)
    skipped = warn_damaged(sc.problems, step if strict else None)
    bad: set[Path] = set()
    while True:
        plan = make_plan(sc, step, bad)
        try:
            stats = replay(root, sc, plan, model, optimizer, scheduler, strict=strict)
        except CorruptCheckpointError as e:
            pass_over_full(e, bad, skipped)
            continue
        stats.skipped = skipped + stats.skipped
        return stats

"""Recovery of a distributed job: one agreed step, the whole state on every rank.

Every rank scans every shard directory (``DIR/rank-NNNNN/``, headers only), computes the
newest step that every shard can reach from a common full checkpoint, and the ranks
take the minimum over all of them (an all-reduce), so they agree even if one rank's
checkpointing process published a file after another rank looked. Each rank then reads
the full checkpoint of every shard (parameters and optimizer state of the shard; its
own shard also gives its buffers, RNG and scheduler) and replays the records of every
shard: the gradient of each parameter comes from the shard that owns it, and its own
records restore its per-rank state. At the end the ranks check that they reached the
same step.

A job resumed at another world size writes a new generation of shards (``DIR/gen-G/``,
see :class:`Generation`); readers take the newest generation that serves the step asked
for, and rank ``r`` of the reader takes the per-rank state of the generation's rank
``min(r, W - 1)``.

Lineage is checked per shard: each rank's files name its own session's run, so a shard's
chain takes only record files that follow the state it has reached (see
:mod:`lowdiff.recovery.scan`), and the agreed step is one every shard reaches that way.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lowdiff.compressors.base import compressor_from_spec
from lowdiff.ddp.context import DistContext, rank_dir
from lowdiff.ddp.shard import merge_state_dicts
from lowdiff.errors import (
    CorruptCheckpointError,
    InvalidArgumentError,
    NotACheckpointDirectoryError,
    RecoveryError,
    UnsupportedSetupError,
)
from lowdiff.format import codec, layout, sfile
from lowdiff.recovery.compat import check_compatible_sharded
from lowdiff.recovery.replay import (
    RecoveryStats,
    apply_full_state,
    pass_over_full,
    replay,
    replay_records,
    state_run,
    warn_damaged,
    warn_foreign,
)
from lowdiff.recovery.scan import (
    FileInfo,
    Foreign,
    Scan,
    abandoned,
    chain_from,
    make_plan,
    merge_intervals,
    passed_over,
    recoverable_intervals,
    scan,
    search_chain,
    usable,
)
from lowdiff.state import capture as st
from lowdiff.state.record import RecordLayout
from lowdiff.state.sharded import FSDP2

JOB_KIND = "distributed"
GEN_DIR = "gen-{gen}"


def job_manifest(
    world_size: int,
    strategy: str,
    generation: int = 0,
    start_step: int = 0,
    sharding: str | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "format": "lowdiff",
        "kind": JOB_KIND,
        "strategy": strategy,
        "world_size": world_size,
        "shards": [rank_dir(Path("."), r).name for r in range(world_size)],
    }
    if sharding is not None:
        # each shard holds every parameter's rank-local slice (fully_shard), not whole
        # parameters: readers that merge DDP shards must not take it for one
        body["sharding"] = sharding
    if generation:
        body.update(generation=generation, start_step=start_step)
    return body


@dataclass(frozen=True)
class Generation:
    """One world size's stretch of a job: its shard directories and the step it began at.

    Generation 0 is the job directory itself: ``DIR/rank-NNNNN/`` of a distributed job,
    or ``DIR`` alone when a single process wrote it (``single``). Generation ``g >= 1``
    lives in ``DIR/gen-g/``, with a job manifest of its own naming its world size and
    ``start_step``, the step it resumed at.
    """

    index: int
    root: Path
    world_size: int
    start_step: int
    strategy: str | None
    single: bool = False

    def shard_dirs(self) -> list[Path]:
        return (
            [self.root] if self.single else [rank_dir(self.root, r) for r in range(self.world_size)]
        )


def generation_dir(job: Path, gen: int) -> Path:
    """Where generation ``gen`` of the job in ``job`` keeps its rank directories."""
    return job if gen == 0 else job / GEN_DIR.format(gen=gen)


def _read(root: Path) -> dict[str, Any] | None:
    try:
        return layout.read_manifest(root)
    except Exception:
        return None


def generations(job: str | Path) -> list[Generation]:
    """Every generation of the job in ``job``, oldest first (empty: none was started).

    A ``gen-g`` directory counts once its job manifest is written (by rank 0 of the
    generation, before any rank writes a file there).
    """
    job = Path(job)
    out = []
    m = _read(job)
    if m is not None and m.get("kind") == JOB_KIND:
        out.append(Generation(0, job, int(m["world_size"]), 0, m.get("strategy")))
    elif m is not None and "record_layout" in m:
        out.append(Generation(0, job, 1, 0, m.get("strategy"), single=True))
    if job.is_dir():
        for d in job.iterdir():
            g = re.fullmatch(r"gen-(\d+)", d.name)
            gm = _read(d) if g and d.is_dir() else None
            if g and gm is not None and gm.get("kind") == JOB_KIND and gm.get("generation"):
                out.append(
                    Generation(
                        int(g.group(1)),
                        d,
                        int(gm["world_size"]),
                        int(gm["start_step"]),
                        gm.get("strategy"),
                    )
                )
    return sorted(out, key=lambda g: g.index)


def job_sharding(job: Path) -> str | None:
    """How the job in ``job`` sharded its state: ``"fsdp2"`` (:data:`lowdiff.state.sharded.FSDP2`)
    or None (DDP, or a single process)."""
    m = _read(job)
    return None if m is None else m.get("sharding")


def refuse_fsdp2_job(job: Path, what: str) -> None:
    """Raise :class:`UnsupportedSetupError` when ``job`` was written under ``fully_shard``."""
    if job_sharding(job) == FSDP2:
        m = _read(job) or {}
        raise UnsupportedSetupError(
            f"{job} was written under fully_shard (FSDP2) by {m.get('world_size')} ranks: "
            "each shard directory holds every parameter's rank-local slice, and "
            f"{what} is not supported for such a job; resume it with strategy "
            f"'lowdiff+' under torchrun with {m.get('world_size')} ranks and the "
            "fully_shard model, or read it in one process with lowdiff.restore or "
            "`lowdiff export`"
        )


def is_job_dir(root: Path) -> bool:
    """True when ``root`` holds a distributed job: a job manifest, or a generation begun
    by a job that resumed a single process's directory."""
    m = _read(root)
    if m is not None and m.get("kind") == JOB_KIND:
        return True
    return any(not g.single for g in generations(root))


def rank_root(job: Path, rank: int, world_size: int) -> Path:
    """The shard directory rank ``rank`` of a ``world_size``-rank job writes in ``job``.

    That of the newest generation when it has this world size, else the next generation's
    (a resume then reshards into it; :meth:`LowDiffStrategy._resume_dist` may still move
    on to a later one when the newest generation turns out to hold no usable step).
    """
    gens = generations(job)
    if not gens:
        return rank_dir(job, rank)
    g = gens[-1]
    if not g.single and g.world_size == world_size:
        return rank_dir(g.root, rank)
    return rank_dir(generation_dir(job, g.index + 1), rank)


def shard_scans(root: Path, world_size: int) -> list[Scan]:
    """Scan every shard directory; raise naming the ones that are missing."""
    return scan_dirs(root, [rank_dir(root, r) for r in range(world_size)])


def scan_dirs(root: Path, dirs: list[Path]) -> list[Scan]:
    """Scan the shard directories ``dirs`` of ``root``; raise naming those without a manifest."""
    world_size = len(dirs)
    missing = [d.name for d in dirs if not (d / layout.MANIFEST).exists()]
    if missing:
        raise RecoveryError(
            f"{root}: shard directories without a manifest: {', '.join(missing)}; a distributed "
            f"checkpoint needs all {world_size} shards"
        )
    return [scan(d) for d in dirs]


def plan_sharded(
    scans: list[Scan], target: int | None, bad: AbstractSet[Path] = frozenset()
) -> tuple[int, int]:
    """(target step, full-checkpoint step) that every shard can serve."""
    steps = [{f.first_step for f in sc.fulls if f.path not in usable(sc, bad)} for sc in scans]
    common = set.intersection(*steps) if steps else set()
    if not common:
        raise RecoveryError(
            f"{scans[0].root.parent}: no full checkpoint is present and intact in every shard"
        )
    options = [(min(chain_from(sc, f, bad)[0] for sc in scans), f) for f in sorted(common)]
    if target is None:
        reach, f = max(options)
        return reach, f
    fits = [f for reach, f in options if f <= target <= reach]
    if not fits:
        have = ", ".join(f"{lo}..{hi}" for lo, hi in merge_intervals((f, r) for r, f in options))
        raise RecoveryError(
            f"{scans[0].root.parent}: step {target} is not recoverable in every shard; "
            f"recoverable: {have or 'nothing'}"
        )
    return target, max(fits)


def shard_files(
    sc: Scan, full: int, target: int, bad: AbstractSet[Path]
) -> tuple[FileInfo, list[FileInfo], list[Foreign]]:
    """A shard's full checkpoint at ``full``, its record files up to ``target``, and the
    files of another trajectory its chain passed over on the way."""
    gone = abandoned(sc, bad)
    out = usable(sc, bad)
    f = next(x for x in sc.fulls if x.first_step == full and x.path not in out)
    c = search_chain(sc, full, f.run_id, out)
    files = [r for r in c.files if r.first_step < target]
    return f, files, passed_over(gone, c, full, target)


def _cloner(tensors: dict[str, torch.Tensor]) -> Any:
    return lambda name: tensors[name].clone()


def load_full_sharded(
    fulls: list[FileInfo],
    own: int,
    model: Any,
    optimizer: Any,
    scheduler: Any | None,
    stats: RecoveryStats,
) -> None:
    """Verify every shard's full checkpoint and load their union into the live objects."""
    parts = []
    for info in fulls:
        t0 = time.perf_counter()
        raw = sfile.read_raw(info.path)
        stats.read_s += time.perf_counter() - t0
        stats.bytes_read += len(raw)
        stats.files_read += 1
        lf = sfile.decode(info.path, raw)
        if not isinstance(codec.loads(lf.metadata.get("shard", "null")), list):
            raise CorruptCheckpointError(info.path, "no shard list in a distributed checkpoint")
        parts.append((lf.tensors, lf.metadata))
    apply_sharded_state(parts, own, model, optimizer, scheduler, stats, where=fulls[own].path.name)


def apply_sharded_state(
    parts: list[tuple[dict[str, torch.Tensor], dict[str, str]]],
    own: int,
    model: Any,
    optimizer: Any,
    scheduler: Any | None,
    stats: RecoveryStats,
    *,
    where: str,
) -> None:
    """Load the union of every shard's full state (from files or from the replicas).

    Parameters and optimizer state come from the shard that owns them; buffers, RNG and
    scheduler from shard ``own`` (this rank's).
    """
    param_names = {info.name for info, _ in st.optimizer_params(model, optimizer)}
    tensors: dict[str, torch.Tensor] = {}
    osds = []
    for s, (ts, md) in enumerate(parts):
        shard = codec.loads(md["shard"])
        osds.append((codec.loads(md["optim"], _cloner(ts)), shard))
        for k, v in ts.items():
            if s == own:
                if not k.startswith("optim/"):
                    tensors[k] = v
            elif k.startswith("model/") and k[len("model/") :] in param_names:
                tensors[k] = v
    otensors, ojson = st.optimizer_state_tensors(optimizer, merge_state_dicts(osds, own))
    md = dict(parts[own][1])
    md["optim"] = ojson
    tensors.update(otensors)
    apply_full_state(tensors, md, model, optimizer, scheduler, stats, where=where)


def recover_sharded(
    root: Path,
    ctx: DistContext,
    model: Any,
    optimizer: Any,
    scheduler: Any | None = None,
    step: int | None = None,
) -> RecoveryStats:
    """Bring every rank to one agreed step (None: the newest every rank can reach), from
    whichever generation of the job serves it (see :func:`recover_generations`)."""
    return recover_generations(root, ctx, model, optimizer, scheduler, step)[1]


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
        raise InvalidArgumentError(f"rank must be in 0..{world - 1} for a job of {world} ranks, got {rank}")

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
    return g, _recover_shards(
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


def _recover_shards(
    root: Path,
    dirs: list[Path],
    own: int,
    model: Any,
    optimizer: Any,
    scheduler: Any | None,
    step: int | None,
    agree_min: Callable[[int], int],
    agree: Callable[[int, str], int],
) -> RecoveryStats:
    """Load every shard's state at one step into the live objects (``own``: this rank's
    per-rank state); ``agree_min`` / ``agree`` make the ranks of a job settle on one step
    (identities in a single process)."""
    t_start = time.perf_counter()
    scans = scan_dirs(root, dirs)
    skipped = warn_damaged([pw for sc in scans for pw in sc.problems])
    rls = [RecordLayout.from_json(sc.manifest["record_layout"]) for sc in scans]
    check_compatible_sharded(rls, [sc.manifest for sc in scans], model, optimizer, scheduler)
    compressor = compressor_from_spec(scans[own].manifest["compressor"])
    bad: set[Path] = set()
    while True:
        try:
            local_target, _ = plan_sharded(scans, step, bad)
        except RecoveryError as e:
            if not bad:
                raise
            damaged = "; ".join(f"{Path(p).name}: {why}" for p, why in skipped)
            raise RecoveryError(f"{e} (damaged: {damaged})") from None
        target = agree_min(local_target)
        target, full = plan_sharded(scans, target, bad)
        agree(full, "the full checkpoint to start from")
        picked = [shard_files(sc, full, target, bad) for sc in scans]
        stats = RecoveryStats(full_step=full, step=full)
        try:
            load_full_sharded([f for f, _, _ in picked], own, model, optimizer, scheduler, stats)
        except CorruptCheckpointError as e:
            pass_over_full(e, bad, skipped)
            continue
        stats.skipped += warn_foreign([x for _, _, foreign in picked for x in foreign])
        replay_records(
            [(rl, files) for rl, (_, files, _) in zip(rls, picked, strict=True)],
            own,
            full,
            target,
            model,
            optimizer,
            scheduler,
            compressor,
            stats,
            strict=step is not None,
        )
        agree(stats.step, "the recovered step")
        own_full, own_files, _ = picked[own]
        stats.state_run_id = state_run(own_full, own_files, stats.step)
        stats.skipped = skipped + stats.skipped
        stats.total_s = time.perf_counter() - t_start
        return stats

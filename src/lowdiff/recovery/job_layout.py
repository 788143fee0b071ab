"""A distributed job's directory: its generations of shards and where each rank writes.

A job directory holds a job manifest (``kind: "distributed"``, its world size and
strategy) and one shard directory per rank, ``DIR/rank-NNNNN/``. A job resumed at another
world size writes a new generation of shards (``DIR/gen-G/``, see :class:`Generation`),
with a job manifest of its own naming its world size and the step it began at. A single
process's directory that a distributed job resumed is generation 0 of that job.

This module only names and finds those directories; recovering from them is
:mod:`lowdiff.recovery.job`'s (every generation) and :mod:`lowdiff.recovery.shards`'s (the
shards of one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowdiff.ddp.context import rank_dir
from lowdiff.errors import UnsupportedSetupError
from lowdiff.format import layout
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
            f"{what} is not supported for such a job; resume it with method "
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
    (a resume then reshards into it; the DDP resume (:mod:`lowdiff.engine.trainer.resume_ddp`) may still move
    on to a later one when the newest generation turns out to hold no usable step).
    """
    gens = generations(job)
    if not gens:
        return rank_dir(job, rank)
    g = gens[-1]
    if not g.single and g.world_size == world_size:
        return rank_dir(g.root, rank)
    return rank_dir(generation_dir(job, g.index + 1), rank)

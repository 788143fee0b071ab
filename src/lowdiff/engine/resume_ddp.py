"""Resuming under DDP: every rank ends at one agreed step (see :mod:`lowdiff.recovery.job`).

When the newest generation of the job has this world size and serves a step, the job
continues in it. Otherwise it reshards: the state is rebuilt from the newest generation
that serves a step, and a new generation begins in ``DIR/gen-G/`` with a full checkpoint
at the resumed step; the old generation's files are left as they are. LowDiff+ first
tries to rebuild the state from every rank's replica in memory. With ``remote=``, a job
directory that is empty on every rank (a new node) is first downloaded from the remote
tier, each rank its share (:func:`fetch_job`), and recovered as a local one.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from lowdiff.ddp.context import rank_dir
from lowdiff.engine.resume_fsdp import resume_fsdp
from lowdiff.errors import CheckpointMismatchError, RemoteStorageError
from lowdiff.format import layout
from lowdiff.proc.holder import wait_until_written
from lowdiff.recovery.job import (
    generation_dir,
    generations,
    job_manifest,
    rank_root,
    recover_generations,
    refuse_fsdp2_job,
)
from lowdiff.remote.fetch import fetch, has_commits

if TYPE_CHECKING:
    from lowdiff.engine.resume import CheckpointingStrategy


def resume_ddp(s: CheckpointingStrategy) -> int:
    """Resume ``s`` on this rank, at the step every rank agrees on; the step."""
    core = s.core
    ctx, job = core.dist, core.job_root
    assert ctx is not None and job is not None and core.root is not None
    if ctx.sharded:
        return resume_fsdp(s)
    refuse_fsdp2_job(job, "continuing it under DDP")
    if remote_holds_lost_job(s):
        fetch_job(s)
    gens = generations(job)
    newest = gens[-1] if gens else None
    if newest is not None and newest.strategy != core.name:
        raise CheckpointMismatchError(
            f"{newest.root} was written with strategy {newest.strategy!r}; this job runs "
            f"{core.name!r}"
        )
    in_place = (
        newest is not None
        and not newest.single
        and newest.world_size == ctx.world_size
        and core.root.parent == newest.root
    )
    if in_place and s.resume_ddp_from_memory():
        return core.step
    s.settle_previous_process()
    others = sorted({d for g in gens for d in g.shard_dirs()} - {core.root})
    # the other ranks' processes in this generation are theirs to take over
    peers = set(newest.shard_dirs()) if in_place and newest is not None else set()
    s.release_stale_holders([d for d in others if d not in peers])
    for d in others:
        if d.is_dir():
            wait_until_written(d, s.options.start_timeout)
    core.remove_stale_temps()
    ctx.barrier()  # every rank's previous checkpointing process has finished
    if not core.job_holds_checkpoints():
        # nothing was ever durable: a fresh job, generation 0, at this world size
        core.switch_root(rank_dir(job, ctx.rank))
        if ctx.rank == 0:
            layout.write_manifest(job, job_manifest(ctx.world_size, core.name))
        ctx.barrier()
        s.start_fresh()
        return 0
    if newest is None:
        raise CheckpointMismatchError(f"{job} holds shard directories but no job manifest")
    if in_place and (core.root / layout.MANIFEST).exists():
        core.check_manifest(layout.read_manifest(core.root))
    g, stats = recover_generations(job, ctx, core.model, core.optimizer, core.scheduler)
    core.adopt_recovered(stats, g.root)
    ctx.barrier()  # every rank has read every shard before any file moves
    if in_place and g.index == newest.index:
        return s.continue_recovered(barrier=ctx.barrier)
    # reshard into a new generation; the old ones stay as they are (another directory
    # than the one locked at construction when the newest generation had this world
    # size but serves no step)
    gen = newest.index + 1
    core.switch_root(rank_dir(generation_dir(job, gen), ctx.rank))
    if ctx.rank == 0:
        layout.write_manifest(
            generation_dir(job, gen),
            job_manifest(ctx.world_size, core.name, generation=gen, start_step=core.step),
        )
    ctx.barrier()  # the generation exists before any rank writes in it
    s.start_fresh()
    return core.step


def remote_holds_lost_job(s: CheckpointingStrategy) -> bool:
    """(all ranks) Whether the job directory is empty on every rank (a new node, or the
    directory lost) while the remote tier (``remote=``) holds the job: a collective
    answer, so that every rank downloads or none does.

    Raises:
        RemoteStorageError: a rank cannot read the remote tier (whether it holds
            checkpoints is unknown, and the job must not write over them).
    """
    core, url = s.core, s.options.remote
    ctx, job = core.dist, core.job_root
    assert ctx is not None and job is not None and core.root is not None
    if url is None:
        return False
    if core.job_holds_checkpoints():
        return False
    try:
        code = int(has_commits(url, s.options.remote_options))
    except RemoteStorageError:
        code = 2
    agreed = ctx.all_max([code])[0]
    if code == 2 or agreed == 2:
        has_commits(url, s.options.remote_options)  # this rank's own error, if it has one
        raise RemoteStorageError(
            f"cannot read the remote tier {url} on every rank to learn whether it holds "
            "the job's checkpoints"
        )
    return agreed == 1


def fetch_job(s: CheckpointingStrategy) -> None:
    """(all ranks) Download the job from the remote tier into the job directory: rank
    ``r`` the shards ``r``, ``r + W``, ... of every generation (``W``: this world size),
    rank 0 the job's manifests; per generation the ranks agree on the newest full
    checkpoint every shard has committed and downloads intact (see
    :func:`lowdiff.remote.fetch`). Then this rank's shard directory is the one
    :func:`~lowdiff.recovery.job.rank_root` names for what came down."""
    core, url = s.core, s.options.remote
    ctx, job = core.dist, core.job_root
    assert ctx is not None and job is not None and url is not None

    def mine(rel: str) -> bool:
        shard = re.fullmatch(r"rank-(\d+)", rel.rsplit("/", 1)[-1])
        owner = 0 if shard is None else int(shard.group(1)) % ctx.world_size
        return owner == ctx.rank

    fetch(
        url,
        job,
        s.options.remote_options,
        mine=mine,
        agree_min=lambda v: ctx.all_min([v])[0],
    )
    ctx.barrier()  # every share is down before any rank reads the job
    core.switch_root(rank_root(job, ctx.rank, ctx.world_size))

"""Resuming under DDP: every rank ends at one agreed step (see :mod:`lowdiff.recovery.job`).

When the newest generation of the job has this world size and serves a step, the job
continues in it. Otherwise it reshards: the state is rebuilt from the newest generation
that serves a step, and a new generation begins in ``DIR/gen-G/`` with a full checkpoint
at the resumed step; the old generation's files are left as they are. LowDiff+ first
tries to rebuild the state from every rank's replica in memory
(:mod:`lowdiff.engine.trainer.resume_memory`); under ``fully_shard`` each rank restores
its own shard (:mod:`lowdiff.engine.trainer.resume_fsdp`). With ``remote=``, a job
directory that is empty on every rank (a new node) is first downloaded from the remote
tier, each rank its share (:func:`fetch_job`), and recovered as a local one.
"""

from __future__ import annotations

import os
import re

from lowdiff.ddp.context import rank_dir
from lowdiff.engine.trainer.resume_fsdp import resume_fsdp
from lowdiff.engine.trainer.resume_manifests import adopt_job_manifests, writes_job_manifests
from lowdiff.engine.trainer.resume_memory import resume_job_from_memory
from lowdiff.engine.trainer.start import Starter
from lowdiff.errors import CheckpointMismatchError, RemoteStorageError
from lowdiff.format import layout
from lowdiff.proc.holder import wait_until_written
from lowdiff.recovery.job import (
    Generation,
    generation_dir,
    generations,
    job_manifest,
    rank_root,
    recover_generations,
    refuse_fsdp2_job,
)
from lowdiff.remote.fetch import fetch, has_commits


def resume_ddp(s: Starter) -> int:
    """Resume on this rank, at the step every rank agrees on; the step."""
    objects, d = s.objects, s.directory
    ctx, job = objects.dist, d.job_root
    assert ctx is not None and job is not None
    if ctx.sharded:
        return resume_fsdp(s)
    refuse_fsdp2_job(job, "continuing it under DDP")
    adopt_job_manifests(s)
    if remote_holds_lost_job(s):
        fetch_job(s)
    gens = generations(job)
    newest = gens[-1] if gens else None
    if newest is not None and newest.strategy != objects.name:
        raise CheckpointMismatchError(
            f"{newest.root} was written with method {newest.strategy!r}; this job runs "
            f"{objects.name!r}"
        )
    in_place = (
        newest is not None
        and not newest.single
        and newest.world_size == ctx.world_size
        and d.root.parent == newest.root
    )
    in_place = bool(ctx.all_min([int(in_place)])[0])  # every rank takes one path
    if in_place and s.backend.keeps_replica and resume_job_from_memory(s):
        return s.progress.step
    _settle_every_shard(s, gens, newest if in_place else None)
    fetch_missing_shards(s, gens)
    if not d.job_holds_checkpoints():
        # nothing was ever durable: a fresh job, generation 0, at this world size
        d.switch_root(rank_dir(job, ctx.rank))
        if writes_job_manifests(ctx.rank):
            layout.write_manifest(job, job_manifest(ctx.world_size, objects.name))
        ctx.barrier()
        s.start_fresh()
        return 0
    if newest is None:
        raise CheckpointMismatchError(f"{job} holds shard directories but no job manifest")
    return _recover(s, newest, in_place)


def _settle_every_shard(s: Starter, gens: list[Generation], peers_of: Generation | None) -> None:
    """(all ranks) Wait until every previous checkpointing process of the job has
    finished: this rank's own (kept for a takeover when it can be), and those of every
    other shard directory (of ``peers_of``, the generation continued in place: the other
    ranks' to take over; of any other generation: released)."""
    d, ctx = s.directory, s.objects.dist
    assert ctx is not None
    s.settle_previous_process()
    others = sorted({o for g in gens for o in g.shard_dirs()} - {d.root})
    # the other ranks' processes in this generation are theirs to take over
    peers = set(peers_of.shard_dirs()) if peers_of is not None else set()
    s.release_stale_orphans([o for o in others if o not in peers])
    for o in others:
        if o.is_dir():
            wait_until_written(o, s.options.start_timeout)
    d.remove_stale_temps()
    ctx.barrier()  # every rank's previous checkpointing process has finished


def _recover(s: Starter, newest: Generation, in_place: bool) -> int:
    """(all ranks) Recover the job's newest step every shard serves, and go on: in place
    in the newest generation, or resharded into a new one (the old ones stay as they
    are; another directory than the one locked at construction when the newest
    generation had this world size but serves no step)."""
    objects, d = s.objects, s.directory
    ctx, job = objects.dist, d.job_root
    assert ctx is not None and job is not None
    if in_place and (d.root / layout.MANIFEST).exists():
        objects.check_manifest(layout.read_manifest(d.root), d.root)
    g, stats = recover_generations(job, ctx, objects.model, objects.optimizer, objects.scheduler)
    s.take_recovered(stats, g.root)
    ctx.barrier()  # every rank has read every shard before any file moves
    if in_place and g.index == newest.index:
        return s.continue_recovered(barrier=ctx.barrier)
    gen = newest.index + 1
    d.switch_root(rank_dir(generation_dir(job, gen), ctx.rank))
    if writes_job_manifests(ctx.rank):
        generation_dir(job, gen).mkdir(parents=True, exist_ok=True)
        layout.write_manifest(
            generation_dir(job, gen),
            job_manifest(ctx.world_size, objects.name, generation=gen, start_step=s.progress.step),
        )
    ctx.barrier()  # the generation exists before any rank writes in it
    s.start_fresh()
    return s.progress.step


def remote_holds_lost_job(s: Starter) -> bool:
    """(all ranks) Whether the job directory is empty on every rank (a new node, or the
    directory lost) while the remote tier (``remote=``) holds the job: a collective
    answer, so that every rank downloads or none does.

    Raises:
        RemoteStorageError: a rank cannot read the remote tier (whether it holds
            checkpoints is unknown, and the job must not write over them).
    """
    url, ctx = s.options.remote, s.objects.dist
    assert ctx is not None
    if url is None:
        return False
    if s.directory.job_holds_checkpoints():
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


def shares_job_directory(s: Starter) -> bool:
    """(all ranks) Whether every rank sees one job directory (a shared file system), or
    some node has one of its own: rank 0 leaves a mark in it, every rank looks."""
    ctx, job = s.objects.dist, s.directory.job_root
    assert ctx is not None and job is not None
    job.mkdir(parents=True, exist_ok=True)
    token = ctx.all_max([int.from_bytes(os.urandom(6), "big") if ctx.rank == 0 else 0])[0]
    mark = job / f".lowdiff-shared-{token:012x}"
    if ctx.rank == 0:
        mark.touch()
    ctx.barrier()
    seen = ctx.all_min([int(mark.exists())])[0] == 1
    ctx.barrier()  # every rank looked before the mark goes
    if ctx.rank == 0:
        mark.unlink(missing_ok=True)
    return seen


def _downloader(rel: str, world_size: int) -> int:
    """On a shared file system, the rank that downloads the remote folder ``rel``: shard
    ``k`` (``rank-k``, of any generation) rank ``k mod W``, anything else rank 0."""
    shard = re.fullmatch(r"rank-(\d+)", rel.rsplit("/", 1)[-1])
    return 0 if shard is None else int(shard.group(1)) % world_size


def fetch_missing_shards(s: Starter, gens: list[Generation]) -> None:
    """(all ranks) Recovery from disk reads every shard of a generation on every rank.
    Where a rank's directory lacks some (the nodes have storage of their own, and a node
    was lost or holds only its own ranks' shards), they are downloaded from the remote
    tier, when there is one: the shards this node lacks, each from its newest full
    checkpoint every shard has committed (:func:`lowdiff.remote.fetch`)."""
    url, ctx, job = s.options.remote, s.objects.dist, s.directory.job_root
    assert ctx is not None and job is not None
    lacking = {
        d.relative_to(job).as_posix()
        for g in gens
        if not g.single
        for d in g.shard_dirs()
        if not (d / layout.MANIFEST).exists()
    }
    if url is None or not ctx.all_max([int(bool(lacking))])[0]:
        return
    shared = shares_job_directory(s)

    def mine(rel: str) -> bool:
        return rel in lacking and (not shared or _downloader(rel, ctx.world_size) == ctx.rank)

    fetch(url, job, s.options.remote_options, mine=mine, agree_min=lambda v: ctx.all_min([v])[0])
    ctx.barrier()  # every shard is down before any rank reads the job


def fetch_job(s: Starter) -> None:
    """(all ranks) Download the job from the remote tier into the job directory: on a
    shared file system rank ``r`` the shards ``r``, ``r + W``, ... of every generation
    (``W``: this world size), rank 0 the job's manifests; where the nodes have storage of
    their own, every rank all of it; per generation the ranks agree on the newest full
    checkpoint every shard has committed and downloads intact (see
    :func:`lowdiff.remote.fetch`). Then this rank's shard directory is the one
    :func:`~lowdiff.recovery.job.rank_root` names for what came down."""
    url, ctx, job = s.options.remote, s.objects.dist, s.directory.job_root
    assert ctx is not None and job is not None and url is not None
    shared = shares_job_directory(s)

    def mine(rel: str) -> bool:
        # on storage of its own every node reads every shard from its own directory
        return not shared or _downloader(rel, ctx.world_size) == ctx.rank

    fetch(
        url,
        job,
        s.options.remote_options,
        mine=mine,
        agree_min=lambda v: ctx.all_min([v])[0],
    )
    ctx.barrier()  # every share is down before any rank reads the job
    s.directory.switch_root(rank_root(job, ctx.rank, ctx.world_size))

"""Resuming under ``fully_shard`` (FSDP2): every rank restores its own shard, at one step.

Each rank's shard directory (``DIR/rank-NNNNN/``) holds that rank's slice of every
parameter and of its optimizer state, with the rank's buffers, RNG and scheduler state, so
a rank restores from its own directory (or its own replica in memory) alone; what the
ranks share is the step. Call sequence (every rank):

0) refuse a job written by DDP or a single process;
1) at the newest generation's world size, LowDiff+: every rank finds its replica in
   memory at one step, or none is used
   (:func:`~lowdiff.engine.trainer.resume_memory.resume_job_from_memory`);
2) otherwise each rank finds the newest step its shard serves; the job resumes at the
   oldest of them, which every rank restores (a rank that cannot fails every rank); a
   resharded generation that holds no step yet is passed over for step 3;
3) at another world size (resharding): every rank joins the newest generation's shards
   at the newest step all of them hold (:mod:`lowdiff.recovery.fsdp2`), keeps its own
   chunks, and the job goes on in a new generation ``DIR/gen-G/`` with a full checkpoint
   at that step, as under DDP; the old generation's files stay as they are.
"""

from __future__ import annotations

import time

from lowdiff.ddp.context import rank_dir
from lowdiff.engine.trainer.resume_manifests import adopt_job_manifests, writes_job_manifests
from lowdiff.engine.trainer.resume_memory import resume_job_from_memory
from lowdiff.engine.trainer.start import Starter
from lowdiff.errors import CheckpointMismatchError, RecoveryError
from lowdiff.format import layout
from lowdiff.proc.locks import wait_for_writer
from lowdiff.recovery.fsdp2 import cut_for_rank, newest_fsdp2_state
from lowdiff.recovery.job import generation_dir, generations, job_manifest, job_sharding
from lowdiff.recovery.replay import RecoveryStats, apply_full_state
from lowdiff.recovery.restore import recover_shard
from lowdiff.recovery.scan import make_plan, scan
from lowdiff.state.sharded import FSDP2


def resume_fsdp(s: Starter) -> int:
    """Resume on this rank of a ``fully_shard`` job; the step every rank resumed at."""
    objects, d = s.objects, s.directory
    ctx, job = objects.dist, d.job_root
    assert ctx is not None and job is not None
    adopt_job_manifests(s)
    gens = generations(job)
    newest = gens[-1] if gens else None
    in_place = False
    if newest is not None:
        if newest.strategy != objects.name:
            raise CheckpointMismatchError(
                f"{newest.root} was written with method {newest.strategy!r}; this job runs "
                f"{objects.name!r}"
            )
        if job_sharding(newest.root) != FSDP2:
            raise CheckpointMismatchError(
                f"{job} was written by {'a single process' if newest.single else 'DDP'}; a "
                "fully_shard job cannot continue it (restore it into the model before "
                "fully_shard, or export it with `lowdiff export --format dcp` and load that)"
            )
        in_place = newest.world_size == ctx.world_size and d.root.parent == newest.root
    in_place = bool(ctx.all_min([int(in_place)])[0])  # every rank takes one path
    if in_place and s.backend.keeps_replica and resume_job_from_memory(s):
        return s.progress.step
    s.wait_for_previous_writer()
    others = sorted({o for g in gens for o in g.shard_dirs()} - {d.root})
    s.release_stale_orphans(others)  # replicas of another world size: persisted, gone
    for o in others:
        if o.is_dir():
            wait_for_writer(o, s.options.start_timeout)
    d.remove_stale_temps()
    ctx.barrier()  # every rank's previous checkpointing process has finished
    if not d.job_holds_checkpoints():
        d.switch_root(rank_dir(job, ctx.rank))
        if writes_job_manifests(ctx.rank):
            layout.write_manifest(job, job_manifest(ctx.world_size, objects.name, sharding=FSDP2))
        ctx.barrier()
        s.start_fresh()
        return 0
    if newest is None:
        raise CheckpointMismatchError(f"{job} holds shard directories but no job manifest")
    if in_place:
        step = _agreed_step(s)
        if step >= 0:
            return _resume_in_place(s, step)
        if newest.index == 0:
            raise RecoveryError(
                f"{job}: a rank's shard serves no step; every rank needs its own shard to resume"
            )
        # a generation that died before every shard persisted a step: start again from
        # the newest older one that serves a step, in a newer generation (as under DDP)
    return _reshard(s, newest.index + 1)


def _agreed_step(s: Starter) -> int:
    """The newest step every rank's own shard directory holds (-1: some rank's none)."""
    objects, root = s.objects, s.directory.root
    assert objects.dist is not None
    try:
        objects.check_manifest(layout.read_manifest(root), root)
        newest_here = make_plan(scan(root), None).target
    except (RecoveryError, OSError, ValueError):
        newest_here = -1
    return objects.dist.all_min([newest_here])[0]


def _resume_in_place(s: Starter, step: int) -> int:
    """Every rank restores its own shard directory at ``step``."""
    objects, root = s.objects, s.directory.root
    ctx, job = objects.dist, s.directory.job_root
    assert ctx is not None and job is not None
    error: BaseException | None = None
    try:
        stats = recover_shard(root, objects.model, objects.optimizer, objects.scheduler, step)
    except (RecoveryError, CheckpointMismatchError) as e:
        error = e
    if ctx.all_min([int(error is None)])[0] == 0:
        raise RecoveryError(
            f"{job}: not every rank could restore step {step} (rank {ctx.rank}: "
            f"{error or 'restored it'})"
        )
    s.take_recovered(stats, root)
    ctx.barrier()  # every rank has read its shard before any file moves
    return s.continue_recovered(barrier=ctx.barrier)


def _reshard(s: Starter, gen: int) -> int:
    """Resume at another world size: every rank joins the old shards into whole tensors,
    keeps its own chunks, and the job goes on in a new generation ``gen``."""
    objects = s.objects
    ctx, job = objects.dist, s.directory.job_root
    assert ctx is not None and job is not None
    t0 = time.perf_counter()
    tensors, md, step, g = newest_fsdp2_state(job, None, ctx.rank)
    ctx.agree(step, "the step to resume at")
    stats = RecoveryStats(full_step=step, step=step, source="disk")
    stats.read_s = time.perf_counter() - t0
    mine = cut_for_rank(tensors, objects.model, objects.optimizer)
    apply_full_state(
        mine, md, objects.model, objects.optimizer, objects.scheduler, stats,
        where=f"{g.root} (every shard), step {step}",
    )  # fmt: skip
    stats.total_s = time.perf_counter() - t0
    s.take_recovered(stats, g.root)
    ctx.barrier()  # every rank has read every shard
    gen_root = generation_dir(job, gen)
    s.directory.switch_root(rank_dir(gen_root, ctx.rank))
    if writes_job_manifests(ctx.rank):
        gen_root.mkdir(parents=True, exist_ok=True)
        body = job_manifest(
            ctx.world_size, objects.name, generation=gen, start_step=step, sharding=FSDP2
        )
        layout.write_manifest(gen_root, body)
    ctx.barrier()  # the generation exists before any rank writes in it
    s.start_fresh()
    return s.progress.step

"""Resuming under ``fully_shard`` (FSDP2): every rank restores its own shard, at one step.

Each rank's shard directory (``DIR/rank-NNNNN/``) holds that rank's slice of every
parameter and of its optimizer state, with the rank's buffers, RNG and scheduler state, so
a rank restores from its own directory (or its own replica in memory) alone; what the
ranks share is the step. Call sequence (every rank):

0) refuse a job written by DDP or a single process, or by another world size (resharding
   an FSDP2 job is not supported);
1) LowDiff+: every rank finds its replica in memory at one step, or none is used
   (``resume_ddp_from_memory``);
2) otherwise each rank finds the newest step its shard serves; the job resumes at the
   oldest of them, which every rank restores (a rank that cannot fails every rank).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lowdiff.ddp.context import rank_dir
from lowdiff.errors import CheckpointMismatchError, RecoveryError, UnsupportedSetupError
from lowdiff.format import layout
from lowdiff.recovery.job import generations, job_manifest, job_sharding
from lowdiff.recovery.restore import recover_shard
from lowdiff.recovery.scan import is_empty_dir, make_plan, scan
from lowdiff.state.sharded import FSDP2

if TYPE_CHECKING:
    from lowdiff.engine.resume import CheckpointingStrategy


def resume_fsdp(s: CheckpointingStrategy) -> int:
    """Resume ``s`` on this rank of a ``fully_shard`` job; the step every rank resumed at."""
    core = s.core
    ctx, job = core.dist, core.job_root
    assert ctx is not None and job is not None and core.root is not None
    gens = generations(job)
    newest = gens[-1] if gens else None
    if newest is not None:
        if newest.strategy != core.name:
            raise CheckpointMismatchError(
                f"{newest.root} was written with strategy {newest.strategy!r}; this job runs "
                f"{core.name!r}"
            )
        if job_sharding(newest.root) != FSDP2:
            raise CheckpointMismatchError(
                f"{job} was written by {'a single process' if newest.single else 'DDP'}; a "
                "fully_shard job cannot continue it (restore it into the model before "
                "fully_shard, or export it with `lowdiff export --format dcp` and load that)"
            )
        if newest.index != 0 or newest.world_size != ctx.world_size:
            raise UnsupportedSetupError(
                f"{job} was written under fully_shard by {newest.world_size} ranks, and this "
                f"job has {ctx.world_size}: resharding an FSDP2 job is not supported; resume "
                f"it with {newest.world_size} ranks"
            )
        if s.resume_ddp_from_memory():
            return core.step
    s.wait_for_previous_writer()
    core.remove_stale_temps()
    ctx.barrier()  # every rank's previous checkpointing process has finished
    if ctx.all_max([int(not is_empty_dir(core.root))])[0] == 0:
        core.switch_root(rank_dir(job, ctx.rank))
        if ctx.rank == 0:
            layout.write_manifest(job, job_manifest(ctx.world_size, core.name, sharding=FSDP2))
        ctx.barrier()
        s.start_fresh()
        return 0
    if newest is None:
        raise CheckpointMismatchError(f"{job} holds shard directories but no job manifest")
    try:
        core.check_manifest(layout.read_manifest(core.root))
        newest_here = make_plan(scan(core.root), None).target
    except (RecoveryError, OSError, ValueError):
        newest_here = -1
    step = ctx.all_min([newest_here])[0]
    if step < 0:
        raise RecoveryError(
            f"{job}: a rank's shard serves no step (this is rank {ctx.rank}, whose newest "
            f"step is {newest_here}); every rank needs its own shard to resume"
        )
    error: BaseException | None = None
    try:
        stats = recover_shard(core.root, core.model, core.optimizer, core.scheduler, step)
    except (RecoveryError, CheckpointMismatchError) as e:
        error = e
    if ctx.all_min([int(error is None)])[0] == 0:
        raise RecoveryError(
            f"{job}: not every rank could restore step {step} (rank {ctx.rank}: "
            f"{error or 'restored it'})"
        )
    core.adopt_recovered(stats, core.root)
    ctx.barrier()  # every rank has read its shard before any file moves
    return s.continue_recovered(barrier=ctx.barrier)

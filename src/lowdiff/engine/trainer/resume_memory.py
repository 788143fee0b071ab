"""Resuming LowDiff+ from its replica in memory, and taking the replica's process over.

After a trainer crash, LowDiff+'s replica (:mod:`lowdiff.engine.replica.main`) has merged
every step it received, persisted them and published its state ORPHANED. The next
trainer on the same directory finds it (:func:`lowdiff.proc.holder.find_live_replica`),
copies the state out of its arena into the model, optimizer and scheduler, and takes the
process over (:mod:`lowdiff.engine.trainer.takeover`). When it cannot take it over, the
process persists what it holds and exits, and a new one is started, seeded with the
state. Under DDP every rank must find its replica at one step, else every rank recovers
from disk (:mod:`lowdiff.engine.trainer.resume_ddp`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from lowdiff.ddp.peers import memory_sources
from lowdiff.engine.trainer.start import Starter
from lowdiff.engine.wire.messages import Init
from lowdiff.format import layout
from lowdiff.proc.holder import LiveReplica, find_live_replica, peer_copy
from lowdiff.recovery.job import apply_sharded_state
from lowdiff.recovery.replay import RecoveryStats, apply_full_state


def _find_replica(s: Starter) -> tuple[LiveReplica | None, str]:
    return find_live_replica(s.directory.root, s.objects.layout_id, wait_s=s.options.start_timeout)


def resume_from_memory(s: Starter) -> bool:
    """(one process) Restore from a live replica left by a crashed trainer, and take its
    process over; False when there is none."""
    objects, root = s.objects, s.directory.root
    t0 = time.perf_counter()
    live, why = _find_replica(s)
    if live is None:
        s.takeover.miss_reason = why
        return False
    s.takeover.ask_early(live)
    try:
        objects.check_manifest(layout.read_manifest(root), root)
        stats = RecoveryStats(full_step=live.step, step=live.step, source="memory")
        stats.read_s = time.perf_counter() - t0
        apply_full_state(
            live.tensors(), live.doc["meta"], objects.model, objects.optimizer,
            objects.scheduler, stats, where="replica in memory",
        )  # fmt: skip
        stats.total_s = time.perf_counter() - t0
        taken = s.takeover.take_over(live, stats)
    except BaseException:
        s.takeover.drop_pending()
        live.release_owner(s.options.start_timeout)
        raise
    if taken:
        s.take_recovered(stats, str(root), durable=False)
        s.takeover.go_on()
    else:
        # the old checkpointing process persists what it has not yet and exits
        live.release_owner(s.options.start_timeout)
        _start_anew(s, stats)
    return True


def resume_job_from_memory(s: Starter) -> bool:
    """(all ranks, in the job's newest generation) Rebuild the whole state from the
    replicas in memory: every rank's shard from its own replica or, when that was lost
    with its node, from the peer copy another node's replica keeps of it
    (:func:`lowdiff.ddp.peers.memory_sources`), all at one step. Otherwise the replicas
    found persist what they hold and exit, and recovery reads the disk (False). When
    every rank found its own replica, every rank takes its process over (or, when one
    rank cannot, every rank starts a new one); when a rank's replica is gone, every rank
    starts a new one, seeded with the state."""
    objects, root = s.objects, s.directory.root
    ctx = objects.dist
    assert ctx is not None
    # a rank whose directory was lost with its node has no manifest: another node's peer
    # copy may serve its shard
    if (root / layout.MANIFEST).exists():
        objects.check_manifest(layout.read_manifest(root), root)
    t0 = time.perf_counter()
    live, why = _find_replica(s)
    copy_of, copy = peer_copy(live) if live is not None else (-1, None)
    found = (live.step if live is not None else -1, copy_of, copy.step if copy is not None else -1)
    plan = memory_sources(ctx.all_gather_object(found))
    if isinstance(plan, str):
        s.takeover.miss_reason = why if live is None else str(plan)
        _let_go(s, live, copy)
        return False
    step, sources = plan
    try:
        stats = _restore_shard(s, live, copy, step, sources, t0)
    except BaseException:
        _let_go(s, live, copy)
        raise
    if copy is not None:
        copy.close()
    everyone = ctx.all_min([int(live is not None)])[0] == 1
    if everyone:
        assert live is not None
        try:
            taken = s.takeover.take_over(live, stats)
        except BaseException:
            s.takeover.drop_pending()
            live.release_owner(s.options.start_timeout)
            raise
        if ctx.all_min([int(taken)])[0]:
            s.take_recovered(stats, str(root), durable=False)
            ctx.barrier()
            s.takeover.go_on()
            return True
        if taken:  # another rank could not: every rank starts anew, this one too
            s.takeover.give_back(stats)
    else:
        s.takeover.miss_reason = "a rank's replica was lost with its node"
    if live is not None:
        live.release_owner(s.options.start_timeout)
    _start_anew(s, stats, barrier=ctx.barrier)
    return True


def _let_go(s: Starter, live: LiveReplica | None, copy: LiveReplica | None) -> None:
    """Not used: the peer copy unmapped, the replica released (it persists what it
    holds and exits)."""
    if copy is not None:
        copy.close()
    if live is not None:
        live.release_owner(s.options.start_timeout)


def _restore_shard(
    s: Starter,
    live: LiveReplica | None,
    copy: LiveReplica | None,
    step: int,
    sources: list[int],
    t0: float,
) -> RecoveryStats:
    """(all ranks) Apply every shard at ``step``, from the replica ``sources`` names for
    it, to this rank's objects."""
    objects = s.objects
    ctx = objects.dist
    assert ctx is not None
    stats = RecoveryStats(full_step=step, step=step, source="memory")
    if ctx.sharded:
        # fully_shard: each rank restores its own shard alone, from its own replica or,
        # when that was lost, from the peer copy another node's replica sends
        lost = [shard for shard, src in enumerate(sources) if src != shard]
        mine = {}
        for i, shard in enumerate(lost):
            if sources[shard] == ctx.rank:
                assert copy is not None
                mine[i] = (copy.tensors(), dict(copy.doc["meta"]))
        sent = ctx.gather_parts([sources[shard] for shard in lost], mine) if lost else []
        if ctx.rank in lost:
            tensors, meta = sent[lost.index(ctx.rank)]
        else:
            assert live is not None
            tensors, meta = live.tensors(), live.doc["meta"]
        stats.read_s = time.perf_counter() - t0
        apply_full_state(
            tensors, meta, objects.model, objects.optimizer, objects.scheduler, stats,
            where="replica in memory",
        )  # fmt: skip
    else:
        mine = {}
        for shard, src in enumerate(sources):
            if src != ctx.rank:
                continue
            held = live if shard == ctx.rank else copy
            assert held is not None
            mine[shard] = (held.tensors(), dict(held.doc["meta"]))
        parts = ctx.gather_parts(sources, mine)
        stats.read_s = time.perf_counter() - t0
        apply_sharded_state(
            parts, ctx.rank, objects.model, objects.optimizer, objects.scheduler, stats,
            where="replicas in memory",
        )  # fmt: skip
    stats.shard_sources = {
        shard: "memory" if src == shard else f"peer memory (rank {src})"
        for shard, src in enumerate(sources)
    }
    stats.total_s = time.perf_counter() - t0
    return stats


def _start_anew(
    s: Starter, stats: RecoveryStats, barrier: Callable[[], None] | None = None
) -> None:
    """The replica was released: a new checkpointing process, seeded with the state."""
    s.take_recovered(stats, str(s.directory.root), durable=False)
    s.wait_for_previous_writer()  # the old process persists what it holds, then exits
    s.directory.make_dirs()  # a rank whose directory went with its node starts a new one
    s.directory.remove_stale_temps()
    if barrier is not None:
        barrier()  # every rank's old process is gone before any rank starts anew
    s.write_manifest()
    s.progress.start()
    s.launch(Init)

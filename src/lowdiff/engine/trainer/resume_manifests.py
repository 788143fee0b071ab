"""The job's manifests on every node: a job whose nodes have storage of their own (no
shared file system) keeps the job's and its generations' manifests on every node, and a
replacement node takes them from the other ranks."""

from __future__ import annotations

import os

from lowdiff.engine.trainer.start import Starter
from lowdiff.format import layout
from lowdiff.recovery.job import generations


def writes_job_manifests(rank: int) -> bool:
    """Whether this rank writes the job's manifests: rank 0, and the first rank of every
    node (``LOCAL_RANK`` 0; every rank where the launcher does not say), so that a node
    with storage of its own holds them too (the writes are atomic; on a shared file
    system they write the same bytes)."""
    return rank == 0 or os.environ.get("LOCAL_RANK", "0") == "0"


def adopt_job_manifests(s: Starter) -> None:
    """(all ranks) A rank whose job directory holds no generation (a replacement node
    with storage of its own) takes the job's manifests from a rank that has them, so
    that every rank sees the job's generations: its shard then comes from another node's
    peer copy in memory (:mod:`lowdiff.engine.trainer.resume_memory`)."""
    ctx, job = s.objects.dist, s.directory.job_root
    assert ctx is not None and job is not None
    gens = [g for g in generations(job) if not g.single]
    mine = {g.root.relative_to(job).as_posix(): layout.read_manifest(g.root) for g in gens}
    every = ctx.all_gather_object(mine)
    donor = next((m for m in every if m), None)
    if gens or donor is None:
        return
    for rel, manifest in sorted(donor.items()):
        (job / rel).mkdir(parents=True, exist_ok=True)
        layout.write_manifest(job / rel, manifest)

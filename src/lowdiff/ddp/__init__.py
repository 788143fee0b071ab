"""Data-parallel training (DDP, torchrun) for both strategies.

A :class:`~lowdiff.Checkpointer` given a ``DistributedDataParallel`` model inside an
initialised process group runs in distributed mode:

- ``strategy="lowdiff"`` installs :func:`~lowdiff.ddp.hooks.lowdiff_hook` as the DDP
  communication hook: each rank sparsifies its bucket gradients (with its own error
  feedback), the ranks all-gather the sparse pairs, and every rank merges them into the
  averaged sparse gradient, which the optimizer applies and which is the step's one
  record.
- ``strategy="lowdiff+"`` wraps the all-reduce: as soon as a bucket's averaged gradient is
  ready, the slices of the parameters this rank owns are snapshotted.
- Persistence is sharded: the parameters are split into ``world_size`` balanced shards
  (:func:`~lowdiff.ddp.context.assign_shards`) and rank ``r`` persists only shard ``r``
  (its records and full checkpoints, or its CPU replica), under ``DIR/rank-NNNNN/``.
  Per-rank state (buffers, RNG) is kept by every rank for itself.
- Recovery agrees on one step across ranks (:mod:`lowdiff.recovery.job`) and rebuilds
  the whole state on every rank from all the shards.
- A job may resume at another world size: it rebuilds the state from the old shards
  (new rank ``r`` takes the per-rank state of old rank ``min(r, W - 1)``) and writes a new
  generation of shards in ``DIR/gen-G/``, leaving the old one as it is
  (:func:`~lowdiff.recovery.job.generations`).
"""

from lowdiff.ddp.context import DistContext, assign_shards, detect

__all__ = ["DistContext", "assign_shards", "detect"]

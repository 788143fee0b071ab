"""The experiments of ``lowdiff bench``, after the paper's section "Evaluation".

Each experiment is a function ``(ctx) -> list[row]`` (:data:`RUNNERS`); a row is a flat
JSON-able dict with an ``"experiment"`` key. Rows are measurements only: nothing is
filled in from the paper or from a model of the costs. Values that are computed from
measurements (such as an overhead ratio) say so in their key.

Methods are compared at equal durability (:mod:`lowdiff_lab.bench.arms`), and every time
covers the drain of the block's checkpoints (:mod:`lowdiff_lab.bench.core`).

- ``overhead`` (Exp. 1/2), ``frequency`` (Exp. 4), ``storage`` (Exp. 9), ``ratio``
  (Exp. 10) and ``breakdown``: interleaved runs of every method
  (:mod:`lowdiff_lab.bench.exp_timing`).
- ``recovery`` (Exp. 5): every method restarted after a failure at step 2f−1
  (:mod:`lowdiff_lab.bench.exp_recovery`).
- ``batching`` (Exp. 7): LowDiff's write time per record against the batch size b, and
  the memory a batch holds (:mod:`lowdiff_lab.bench.exp_batching`).
- ``fidelity`` (Exp. 6): a failure and its recovery against the uninterrupted run
  (:mod:`lowdiff_lab.bench.fidelity`).
- ``replica`` and ``hotpaths``: the hot-path targets beside their measurements
  (:mod:`lowdiff_lab.bench.exp_hotpaths`).
- ``fsdp2``: LowDiff+ every step against DCP ``async_save`` every step under
  ``fully_shard``, a 2-rank torchrun job (:mod:`lowdiff_lab.bench.exp_fsdp2`).

The profile the experiments run at and the context they share are
:mod:`lowdiff_lab.bench.context`'s :class:`Profile` and :class:`Context`, also reachable here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lowdiff_lab.bench.context import QUICK_PROFILE, Context, Profile
from lowdiff_lab.bench.exp_batching import batching
from lowdiff_lab.bench.exp_fsdp2 import fsdp2
from lowdiff_lab.bench.exp_hotpaths import hotpaths, replica
from lowdiff_lab.bench.exp_recovery import recovery
from lowdiff_lab.bench.exp_timing import breakdown, frequency, overhead, ratio, storage
from lowdiff_lab.bench.fidelity import fidelity

__all__ = [
    "DEFAULT_EXPERIMENTS",
    "EXPERIMENTS",
    "OWN_WORKLOADS",
    "QUICK_PROFILE",
    "RUNNERS",
    "Context",
    "Profile",
]

EXPERIMENTS = (
    "overhead",
    "breakdown",
    "replica",
    "storage",
    "frequency",
    "recovery",
    "batching",
    "ratio",
    "fidelity",
    "hotpaths",
    "fsdp2",
)
"""Every experiment, in the order they run."""
OWN_WORKLOADS = frozenset({"replica", "hotpaths", "fsdp2"})
"""Experiments that build their own workloads (from the profile), not the settings' one."""
DEFAULT_EXPERIMENTS = tuple(e for e in EXPERIMENTS if e not in ("fidelity", "hotpaths", "fsdp2"))
"""What ``lowdiff bench`` runs when no experiment is named (``fidelity``, ``hotpaths`` and
``fsdp2`` run when named)."""

RUNNERS: dict[str, Callable[[Context], list[dict[str, Any]]]] = {
    "overhead": overhead,
    "frequency": frequency,
    "recovery": recovery,
    "batching": batching,
    "storage": storage,
    "ratio": ratio,
    "fidelity": fidelity,
    "breakdown": breakdown,
    "replica": replica,
    "hotpaths": hotpaths,
    "fsdp2": fsdp2,
}
"""The function that runs each experiment."""

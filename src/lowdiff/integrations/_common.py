"""Helpers shared by the framework integrations (not a public API)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from lowdiff.attach import unwrap_optimizer as unwrap_optimizer  # used by the integrations
from lowdiff.attach import unwrap_scheduler as unwrap_scheduler
from lowdiff.checkpointer import Checkpointer
from lowdiff.errors import InvalidArgumentError, LowDiffError
from lowdiff.format import codec, sfile
from lowdiff.recovery.directory import is_empty_dir
from lowdiff.recovery.scan import make_plan, scan
from lowdiff.state.rng import RngLayout, capture_rng, restore_rng

log = logging.getLogger("lowdiff.integrations")


CALLBACK_OPTIONS: tuple[str, ...] = (
    "extra_state", "log_stats", "method", "compressor", "full_every", "records_per_file",
    "keep_full", "max_inflight", "on_storage_error", "mtbf", "replica", "remote", "timeouts",
)  # fmt: skip
"""The keyword options of the framework callbacks (those of :func:`lowdiff.attach`, less
``scheduler``: the framework's own LR scheduler is the one checkpointed)."""


def callback_extra_state(
    extra_state: dict[str, Any] | None, reserved: str, owner: str
) -> dict[str, Any]:
    """A copy of a framework callback's ``extra_state`` (empty when None), where
    ``reserved`` is the name the framework's state is saved under.
    """
    extra = dict(extra_state or {})
    if reserved in extra:
        raise InvalidArgumentError(f"extra_state: the name {reserved!r} is taken by {owner}")
    return extra


def rng_state() -> dict[str, Any]:
    """This process's RNG states (torch CPU, CUDA, Python, NumPy; as a full checkpoint
    takes them), as a value ``extra_state`` can save."""
    tensors, extra = capture_rng(RngLayout())
    return {"tensors": tensors, "extra": extra}


def set_rng_state(state: dict[str, Any]) -> None:
    """Set the RNG states :func:`rng_state` took."""
    restore_rng(state["tensors"], state["extra"])


def saved_extra(root: str | Path) -> tuple[int, dict[str, Any]] | None:
    """The newest recoverable step of a (single-process) lowdiff directory and the
    ``extra_state`` saved with it, read from the files' headers without replaying anything.

    None when the directory holds no checkpoint. ``resume()`` reaches the same step unless
    a file turns out to be damaged when it is read in full (callers check).
    """
    root = Path(root)
    if is_empty_dir(root):
        return None
    sc = scan(root)
    plan = make_plan(sc, None)
    t = plan.target
    if t == plan.full.first_step:
        md = sfile.read_header(plan.full.path).metadata
        tree = json.loads(md["extra"]) if "extra" in md else None
    else:
        f = next(r for r in reversed(plan.record_files) if r.first_step <= t - 1 <= r.last_step)
        metas = json.loads(sfile.read_header(f.path).metadata["records_meta"])
        tree = codec.decode(metas[t - 1 - f.first_step]).get("extra")
    if not isinstance(tree, dict):
        return t, {}
    return t, {k: codec.decode(v) for k, v in tree.items()}


LOGGED_STATS = (
    "steps",
    "records_written",
    "record_bytes",
    "fulls_written",
    "slot_wait_s",
    "full_wait_s",
    "full_copy_s",
    "record_send_s",
    "lag_wait_s",
)
"""The ``ck.stats`` entries the integrations log (the trainer-side costs and the output)."""


def stats_for_logging(ck: Checkpointer, prefix: str = "lowdiff/") -> dict[str, float]:
    """``ck.stats`` and the durable step, as flat numbers for a framework's logger."""
    stats = ck.stats
    out = {f"{prefix}{k}": float(stats[k]) for k in LOGGED_STATS if k in stats}
    out[f"{prefix}durable_step"] = float(ck.durable_step)
    return out


def not_single_process(what: str) -> LowDiffError:
    return LowDiffError(
        f"{what} runs in one process here; under DDP use lowdiff.attach (or lowdiff.Checkpointer) "
        "with the DistributedDataParallel model in your own loop"
    )

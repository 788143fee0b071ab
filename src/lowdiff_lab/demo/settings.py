"""What one ``lowdiff demo`` run trains: its profile, strategy, compressor and kill step.

Call sequence::

    s = demo_settings(quick=True)         # validates every option, naming the flag
    step = kill_target(s.seed, s.profile.steps)
"""

from __future__ import annotations

import os
import random
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lowdiff.compressors as compressors
from lowdiff_lab.workloads.models import MODELS

COMPRESSORS: dict[str, str] = {
    "topk": "TopK",
    "approx-topk": "ApproxTopK",
    "randomk": "RandomK",
    "qsgd": "QSGD",
}
"""``--compressor`` choice -> class name in :mod:`lowdiff.compressors`."""

SPARSIFIERS = frozenset({"topk", "approx-topk", "randomk"})
"""The compressors that keep a fraction of the values: their classes take ``ratio``, and
their records hold ``ratio * n`` values (QSGD quantizes every value and takes none)."""

STRATEGIES = ("lowdiff", "lowdiff+")
"""Strategies the demo can exercise."""


class DemoError(RuntimeError):
    """A phase of the demo did not behave as the demo needs (a child failed, ...)."""


@dataclass(frozen=True)
class Profile:
    """Workload defaults of one demo profile (each can be overridden by a flag)."""

    model: str
    steps: int
    train_batch_size: int
    seq_len: int
    lr: float
    full_every: int
    batch_size: int
    keep_full: int
    eval_batches: int


PROFILES: dict[str, Profile] = {
    # sized so that the four runs and their process start-ups take a couple of minutes on
    # a 2-core machine (the timings: docs/chaos.md)
    "default": Profile("gpt2-demo", 180, 8, 128, 3e-3, 30, 3, 2, 8),
    # For tests: a few seconds of training; full_every 10 so that the kill lands after
    # at least one full checkpoint past step 0 and recovery replays records on top of it.
    "quick": Profile("gpt2-tiny", 40, 4, 64, 3e-3, 10, 3, 2, 4),
}


@dataclass(frozen=True)
class DemoSettings:
    """Resolved settings of one demo run."""

    profile: Profile
    seed: int
    strategy: str
    compressor: dict[str, Any]
    """The compressor's JSON spec (``{"kind": "none"}`` for LowDiff+)."""
    threads: int
    """Torch threads of each training process."""
    out_dir: Path
    progress: bool
    """Show the progress display on stderr."""


def demo_settings(
    *,
    quick: bool = False,
    seed: int = 0,
    strategy: str = "lowdiff",
    compressor: str = "topk",
    ratio: float = 0.01,
    threads: int | None = None,
    out_dir: str | Path | None = None,
    progress: bool = True,
    **overrides: Any,
) -> DemoSettings:
    """Validated settings of a demo run (the flags of ``lowdiff demo``).

    Args:
        quick: Start from the ``"quick"`` profile instead of ``"default"``.
        seed: Seeds the model, the data order and the kill step.
        strategy: One of :data:`STRATEGIES`.
        compressor: One of :data:`COMPRESSORS` (LowDiff+ trains uncompressed).
        ratio: Kept fraction of a sparsifier.
        threads: Torch threads per training process (None: the CPU count).
        out_dir: Where runs, dumps and logs go; it must be empty (None: a new temporary
            directory, kept).
        progress: Show the progress display.
        overrides: :class:`Profile` fields to override (None: the profile's).

    Raises:
        ValueError: a bad value, naming its flag.

    Example:
        >>> s = demo_settings(quick=True, steps=20)  # doctest: +SKIP
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"--strategy must be one of {list(STRATEGIES)}, got {strategy!r}")
    if compressor not in COMPRESSORS:
        raise ValueError(f"--compressor must be one of {sorted(COMPRESSORS)}, got {compressor!r}")
    prof = PROFILES["quick" if quick else "default"]
    prof = replace(prof, **{k: v for k, v in overrides.items() if v is not None})
    if prof.model not in MODELS:
        raise ValueError(f"--model must be one of {sorted(MODELS)}, got {prof.model!r}")
    if prof.steps < 10:
        raise ValueError(f"--steps must be >= 10, got {prof.steps}")
    for name in ("full_every", "batch_size", "keep_full", "train_batch_size", "seq_len"):
        if getattr(prof, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(prof, name)}")
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"--ratio must be in (0, 1], got {ratio}")
    if out_dir:
        out = Path(out_dir).resolve()
        out.mkdir(parents=True, exist_ok=True)
        if any(out.iterdir()):
            raise ValueError(f"--out-dir {out} is not empty")
    else:
        out = Path(tempfile.mkdtemp(prefix="lowdiff-demo-"))
    return DemoSettings(
        profile=prof,
        seed=seed,
        strategy=strategy,
        compressor={"kind": "none"}
        if strategy == "lowdiff+"
        else compressor_spec(compressor, ratio),
        threads=threads or os.cpu_count() or 1,
        out_dir=out,
        progress=progress,
    )


def compressor_spec(kind: str, ratio: float) -> dict[str, Any]:
    """The JSON spec of the chosen compressor, built by the compressor class itself."""
    cls = getattr(compressors, COMPRESSORS[kind])
    kwargs: dict[str, Any] = {"ratio": ratio} if kind in SPARSIFIERS else {}
    return dict(cls(**kwargs).spec())


def kill_target(seed: int, steps: int) -> int:
    """The step whose report triggers the SIGKILL: uniform in [40%, 80%] of the run."""
    lo = max(1, round(0.4 * steps))
    hi = max(lo, round(0.8 * steps))
    return random.Random(seed).randint(lo, hi)


__all__ = [
    "COMPRESSORS",
    "PROFILES",
    "SPARSIFIERS",
    "STRATEGIES",
    "DemoError",
    "DemoSettings",
    "Profile",
    "compressor_spec",
    "demo_settings",
    "kill_target",
]

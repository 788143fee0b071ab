"""What the experiments of ``lowdiff bench`` share: the profile they run at and their context.

:class:`Profile` holds the sizes of one run (intervals, ratios, workloads of the hot-path
measurements); :data:`QUICK_PROFILE` is the one ``--quick`` picks. :class:`Context` carries
the settings, the profile, the progress callback and the cache through which experiments
reuse each other's runs (``overhead``, ``storage``, ``frequency`` and ``breakdown`` share
their interleaved arenas; ``breakdown`` and ``hotpaths`` share LowDiff's step bench).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lowdiff.plan import DEFAULT_MTBF_S
from lowdiff_lab.bench.core import BenchSettings


@dataclass
class Profile:
    """Sizes of one bench run.

    Attributes:
        ratio: The top-k ratio of compressed training (the paper's 0.01).
        lowdiff_full_every: LowDiff's (and LowDiff+'s, Naive DC's) full-checkpoint
            interval f in the timing experiments.
        lowdiff_batch: LowDiff's batch size b in ``recovery`` and ``ratio``.
        intervals: Durable intervals k of ``overhead`` and ``frequency``.
        recovery_fulls: Full-checkpoint intervals f of ``recovery``.
        batch_sizes: Batch sizes b of ``batching``.
        ratios: Top-k ratios of ``ratio``.
        gemini_persist_every: Gemini's persistence interval where no durable interval is
            asked for (``fidelity``).
    """

    ratio: float = 0.01
    lowdiff_full_every: int = 20
    lowdiff_batch: int = 5
    intervals: list[int] = field(default_factory=lambda: [1, 5, 10, 20])
    recovery_fulls: list[int] = field(default_factory=lambda: [5, 10, 20, 50])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 5, 10, 20])
    ratios: list[float] = field(default_factory=lambda: [0.001, 0.005, 0.01, 0.05, 0.1])
    gemini_persist_every: int = 10
    replica_params: int = 8_437_760
    """Parameters of ``replica`` (the LowDiff+ replica update against a bare step)."""
    replica_threads: list[int] = field(default_factory=lambda: [1, 2])
    """``replica_threads`` values of ``replica``."""
    hot_e2e_workload: str = "gpt2-3m"
    """Workload of ``hotpaths``' end-to-end LowDiff overhead (3.3M parameters)."""
    hot_trainer_workload: str = "gpt2-demo"
    """Workload of the trainer-side cost (``hotpaths``, ``breakdown``) and of the
    snapshot-bandwidth and DDP-exchange measurements."""
    hot_steps: int = 60
    """Timed steps per block of the end-to-end and trainer-side measurements."""
    fsdp2_width: int = 1024
    """Width of ``fsdp2``'s MLP (1024 with depth 4: 3.2M parameters)."""
    fsdp2_depth: int = 4
    """Hidden layers of ``fsdp2``'s MLP."""
    fsdp2_steps: int = 20
    """Timed steps per arm of ``fsdp2``."""
    fsdp2_mtbf_s: float = DEFAULT_MTBF_S
    """Mean time between failures (seconds) that sets DCP's Young–Daly interval in
    ``fsdp2`` (lowdiff's default MTBF: 6 hours)."""

    def __post_init__(self) -> None:
        for name in ("hot_steps", "fsdp2_width", "fsdp2_depth", "fsdp2_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not (0 < self.fsdp2_mtbf_s < float("inf")):
            raise ValueError(f"fsdp2_mtbf_s must be positive seconds, got {self.fsdp2_mtbf_s!r}")
        for name in ("intervals", "recovery_fulls", "batch_sizes", "replica_threads"):
            vals = getattr(self, name)
            if not vals or any(
                isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in vals
            ):
                raise ValueError(f"{name} must be integers >= 1, got {vals!r}")


QUICK_PROFILE = Profile(
    intervals=[1, 5, 10],
    recovery_fulls=[5, 10],
    batch_sizes=[1, 2, 5, 10],
    ratios=[0.001, 0.01, 0.1],
    hot_e2e_workload="gpt2-tiny",
    hot_trainer_workload="gpt2-tiny",
    hot_steps=10,
    fsdp2_width=256,
    fsdp2_depth=3,
    fsdp2_steps=8,
)
"""The profile of ``lowdiff bench --quick``: fewer sizes, tiny hot-path workloads."""


@dataclass
class Context:
    """What experiments share: settings, sizes, the progress callback and cached runs."""

    settings: BenchSettings
    profile: Profile
    progress: Callable[[str], None] = lambda _m: None
    cache: dict[str, Any] = field(default_factory=dict)
    methods: frozenset[str] | None = None
    """Strategies to run (None: all); the runs without checkpointing always run."""

    def wants(self, strategy: str | None) -> bool:
        """Whether ``strategy`` runs: always the runs without checkpointing, else if asked for."""
        return strategy in (None, "none") or self.methods is None or strategy in self.methods

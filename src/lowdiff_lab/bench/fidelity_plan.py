"""The plan of ``lowdiff bench fidelity`` (Exp. 6): its lengths, settings and cases.

:class:`Sizes` says how long the job runs and where it fails; :class:`Setting` how the
gradients are treated (compressed with or without error feedback, or not); a
:class:`Case` is one strategy in one setting, with its own checkpoint directory.
:func:`plan` lists the cases of a bench run (see :mod:`lowdiff_lab.bench.fidelity`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import lowdiff
from lowdiff_lab.bench.arms import baseline_arms
from lowdiff_lab.bench.context import QUICK_PROFILE, Context, Profile
from lowdiff_lab.bench.core import Arm

QUICK_COMPRESSED_BASELINES = ("torch-save",)
"""Baselines the quick profile runs with gradient compression (all run without)."""

IDLE_TIMEOUT_S = 120.0
"""How long a surviving LowDiff+ replica or Gemini holder waits for its new trainer.

Short, so that an experiment stopped between the failure and the recovery leaves no
process behind for long (the default is 300 s)."""


@dataclass(frozen=True)
class Sizes:
    """Lengths of one fidelity run.

    Attributes:
        full_every: Full-checkpoint interval f of LowDiff, LowDiff+ and Naive DC; the
            other baselines checkpoint every step.
        failure_step: Steps completed when the training process is killed (k); best
            between two full checkpoints, so that LowDiff recovers by replaying records.
        final_step: Steps of the whole job; the recovered run trains on to it.
        eval_batches: Held-out batches (of the workload's batch size and sequence length)
            every comparison evaluates.
        lr: Adam learning rate of every run. Higher than the timing experiments' (1e-4), so
            that within a few steps the model leaves its initial, nearly uniform next-token
            distribution, whose top-10 set a rounding error can reorder (the perplexities
            at both rates are in docs/benchmarks.md, "Fidelity after recovery").
    """

    full_every: int
    failure_step: int
    final_step: int
    eval_batches: int
    lr: float = 1e-3

    def __post_init__(self) -> None:
        for name in ("full_every", "failure_step", "eval_batches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not (isinstance(self.lr, float) and self.lr > 0):
            raise ValueError(f"lr must be a positive float, got {self.lr!r}")
        if not isinstance(self.final_step, int) or self.final_step <= self.failure_step:
            raise ValueError(
                f"final_step must be an int > failure_step ({self.failure_step}), "
                f"got {self.final_step!r}"
            )


QUICK_SIZES = Sizes(full_every=10, failure_step=15, final_step=25, eval_batches=4)


def sizes_for(profile: Profile) -> Sizes:
    """The quick sizes for the quick profile; else f from the profile, k = 1.5 f, T = 2.5 f."""
    if profile == QUICK_PROFILE:
        return QUICK_SIZES
    f = profile.lowdiff_full_every
    return Sizes(f, f + f // 2, 2 * f + f // 2, 8)


@dataclass(frozen=True)
class Setting:
    """How the gradients are treated: compressed or not, error feedback on or off.

    Attributes:
        key: Short name in the rows (``"gc-ef"``, ``"gc"``, ``"no-gc"``).
        label: Name in the report.
        ratio: Top-k ratio of the training's compression; None: uncompressed.
        error_feedback: Whether the compressor carries a residual over (compressed only).
    """

    key: str
    label: str
    ratio: float | None
    error_feedback: bool = False

    def compressor(self) -> lowdiff.Compressor | None:
        """A fresh compressor of this setting (a new residual), or None uncompressed."""
        if self.ratio is None:
            return None
        return lowdiff.TopK(ratio=self.ratio, error_feedback=self.error_feedback)


def settings_for(profile: Profile) -> list[Setting]:
    """TopK at the profile's ratio with error feedback, without it, and no compression."""
    r = profile.ratio
    return [
        Setting("gc-ef", f"w/ GC (TopK ρ={r:g}), error feedback on", r, True),
        Setting("gc", f"w/ GC (TopK ρ={r:g}), error feedback off", r, False),
        Setting("no-gc", "w/o GC", None),
    ]


@dataclass(frozen=True)
class Case:
    """One strategy in one setting: what the child trains and the bench process recovers."""

    setting: Setting
    arm: Arm
    directory: str


def plan(ctx: Context, sizes: Sizes, root: Path) -> dict[str, list[Case]]:
    """Cases by setting key: LowDiff (compressed), LowDiff+ (uncompressed), the baselines.

    The quick profile runs every baseline without compression only; with compression it
    runs torch.save (no process of its own to start), which shows what error feedback
    does to any strategy. Every other strategy costs two process starts (each imports torch anew).
    """
    p = replace(ctx.profile, lowdiff_full_every=sizes.full_every)
    quick = ctx.profile == QUICK_PROFILE
    out: dict[str, list[Case]] = {}
    for s in settings_for(ctx.profile):
        arms: list[Arm] = []
        if s.ratio is not None:
            arms.append(
                Arm(
                    "LowDiff",
                    "lowdiff",
                    s.ratio,
                    p.lowdiff_full_every,
                    (("batch_size", p.lowdiff_batch), ("idle_timeout", IDLE_TIMEOUT_S)),
                )
            )
        else:
            arms.append(
                Arm(
                    "LowDiff+",
                    "lowdiff+",
                    None,
                    p.lowdiff_full_every,
                    (("persist_every", "auto"), ("idle_timeout", IDLE_TIMEOUT_S)),
                )
            )
        for a in baseline_arms(p, s.ratio, None):
            if not quick or s.ratio is None or a.strategy in QUICK_COMPRESSED_BASELINES:
                if a.strategy == "gemini":
                    a = replace(a, options=(*a.options, ("idle_timeout", IDLE_TIMEOUT_S)))
                arms.append(a)
        cases = [
            Case(s, a, str(root / f"{s.key}-{i:02d}-{a.strategy}"))
            for i, a in enumerate(arms)
            if ctx.wants(a.strategy)
        ]
        if cases:
            out[s.key] = cases
    return out

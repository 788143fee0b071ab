"""Seeded failure schedules: exponential inter-failure times for a given MTBF.

Failures arrive as a Poisson process: the gaps between them are independent and
exponentially distributed with mean ``M`` (the MTBF). The schedule draws them from a
seeded generator, so the same seed gives the same failure times.

**Failure times are measured in training progress**, not in wall time: failure ``i``
happens after ``t_i`` seconds of *failure-free training* (the training time of the
reference job without checkpointing), which is the point ``p_i = t_i / tau`` in steps,
``tau`` being the reference's step time. The job fails when it first reaches that point
after the previous failure: once it reports step ``floor(p_i)`` (or resumes at or past
it), the supervisor waits the fraction ``p_i - floor(p_i)`` of a reference step and kills
it, so the failure lands inside a step as a real one would.

Why progress and not wall time: every strategy then sees the same failures at the same
points of the training, as in the paper's model (``T / M`` failures over a failure-free
duration ``T``), and the comparison is paired: what differs between strategies is only
what each failure costs them (lost work, recovery), not how many failures a noisy shared
machine happened to place in a run. A wall-clock schedule would give a slower strategy
more failures, and make the number of failures of each run depend on the machine load.
Failures do not strike during a recovery (the restart and ``resume()``).

The unit draws do not depend on ``M``: with one seed, the schedules of two MTBFs are the
same pattern stretched (``t_i = M * (E_1 + ... + E_i)``, ``E`` unit exponentials).

Example:
    >>> s = failure_schedule(mtbf_s=2.0, horizon_s=10.0, seed=0, tau_s=0.05)
    >>> [round(t, 3) for t in s.times_s]
    [3.721, 6.558, 7.65, 8.249, 9.681]
    >>> s.points[0].step, round(s.points[0].frac, 3)
    (74, 0.424)
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class FailurePoint:
    """Where one failure strikes.

    Attributes:
        index: 0 for the first failure.
        time_s: Failure-free training seconds before it (cumulative).
        step: It strikes once the job has completed this many steps...
        frac: ...and this fraction of a reference step more.
    """

    index: int
    time_s: float
    step: int
    frac: float


@dataclass(frozen=True)
class FailureSchedule:
    """The failures of one run.

    Attributes:
        mtbf_s: Mean time between failures, seconds of failure-free training.
        seed: Seed of the draws.
        horizon_s: Failure-free duration of the run; no failure at or after it.
        tau_s: Reference step time that converts seconds to steps.
        points: The failures, in order.
    """

    mtbf_s: float
    seed: int
    horizon_s: float
    tau_s: float
    points: tuple[FailurePoint, ...]

    @property
    def times_s(self) -> list[float]:
        """The failure times in failure-free training seconds."""
        return [p.time_s for p in self.points]

    @property
    def expected_failures(self) -> float:
        """``horizon / MTBF``."""
        return self.horizon_s / self.mtbf_s

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form (points as dicts)."""
        return {
            "mtbf_s": self.mtbf_s,
            "seed": self.seed,
            "horizon_s": self.horizon_s,
            "tau_s": self.tau_s,
            "expected_failures": self.expected_failures,
            "points": [asdict(p) for p in self.points],
        }


def unit_exponentials(seed: int, n: int) -> list[float]:
    """``n`` independent Exp(1) draws of ``seed`` (inverse transform of a Mersenne Twister).

    Written out rather than ``random.expovariate`` so that the values never depend on the
    Python version.
    """
    rng = random.Random(seed)
    return [-math.log(1.0 - rng.random()) for _ in range(n)]


def failure_times(mtbf_s: float, horizon_s: float, seed: int) -> list[float]:
    """Failure times in ``[0, horizon_s)`` with exponential gaps of mean ``mtbf_s``.

    Raises:
        ValueError: ``mtbf_s`` or ``horizon_s`` is not a positive finite number.
    """
    for name, v in (("mtbf_s", mtbf_s), ("horizon_s", horizon_s)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
    out: list[float] = []
    t = 0.0
    rng = random.Random(seed)
    while True:
        t += mtbf_s * -math.log(1.0 - rng.random())
        if t >= horizon_s:
            return out
        out.append(t)


def failure_schedule(
    mtbf_s: float, horizon_s: float, *, seed: int, tau_s: float
) -> FailureSchedule:
    """The failures of a run of ``horizon_s`` failure-free seconds, as progress points.

    Args:
        mtbf_s: Mean time between failures (seconds of failure-free training).
        horizon_s: The run's failure-free duration (steps x ``tau_s``).
        seed: Seed of the draws.
        tau_s: Reference step time (seconds), to turn times into steps.

    Raises:
        ValueError: a non-positive ``mtbf_s``, ``horizon_s`` or ``tau_s``.
    """
    if isinstance(tau_s, bool) or not isinstance(tau_s, (int, float)) or not tau_s > 0:
        raise ValueError(f"tau_s must be a positive number of seconds, got {tau_s!r}")
    points = []
    for i, t in enumerate(failure_times(mtbf_s, horizon_s, seed)):
        p = t / tau_s
        step = math.floor(p)
        points.append(FailurePoint(index=i, time_s=t, step=step, frac=p - step))
    return FailureSchedule(
        mtbf_s=float(mtbf_s),
        seed=seed,
        horizon_s=float(horizon_s),
        tau_s=float(tau_s),
        points=tuple(points),
    )


__all__ = [
    "FailurePoint",
    "FailureSchedule",
    "failure_schedule",
    "failure_times",
    "unit_exponentials",
]

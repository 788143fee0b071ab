"""Where the time of a run with failures went: wasted time and its parts.

A run is a list of :class:`Attempt` (one per training process, in order). Its time line,
from the first process's ``start`` event to the end of its last step plus ``close()``, is
cut into contiguous pieces, so the pieces add up to the total exactly:

- ``startup``: the first process, ``start`` -> ``resumed`` (the strategy's first
  ``resume()``: background processes, the step-0 checkpoint);
- one interval per step event, from the previous event: a step done for the first time
  is *new*; a step at or below the highest step reported before (``hwm``) is *redone*;
- ``tail``: from a killed process's last event to the kill (a step cut short);
- ``restart``: kill -> the next process's ``start`` event (killing, cleaning up, starting
  the process, building the model and the checkpointer);
- ``resume``: ``start`` -> ``resumed`` of a restarted process, split into ``restore``
  (what the strategy's recovery stats time: reading, decompressing, replaying, or the
  copy out of memory) and the rest (starting background processes, waiting for the
  previous checkpointing process, ...);
- ``close``: the final ``close()`` (the last flush).

With ``T_ff`` the failure-free time without checkpointing (the reference job, measured
the same way, ``T_ff0`` of it its own startup), the wasted time ``total - T_ff`` splits
into:

- startup overhead = ``startup - T_ff0`` (the strategy's first ``resume()``: a one-time
  cost that a long run amortises, so it is kept apart from the steady state);
- steady-state overhead = ``new + close - (T_ff - T_ff0)`` (what checkpointing costs
  while nothing fails);
- lost work = ``redone + tail`` (iterations trained twice, and cut-short steps);
- recovery = ``restart + resume``.

The effective training time ratio (Gemini's: the share of the time spent on useful
training progress) is ``T_ff / total``.

The *core* wasted time leaves out the process start-ups (the startup overhead, the
restarts, and ``resume()`` beyond ``restore``): ``steady overhead + lost work + restore``,
the costs the paper's model ``T_w(f, b)`` describes. Where failures are hours apart,
start-ups are amortised; in a run scaled down to failures seconds apart they dominate,
so both figures are given. ``core_ratio = T_ff / (T_ff + core wasted)``.

Example:
    >>> a = Attempt(start_t=0.0, resumed_t=0.5, resumed_step=0,
    ...             steps=[(1, 1.5), (2, 2.5)], end_t=3.0, killed=True)
    >>> b = Attempt(start_t=4.0, resumed_t=4.5, resumed_step=1,
    ...             steps=[(2, 5.5), (3, 6.5)], end_t=6.5, killed=False)
    >>> acc = account([a, b], reference_s=3.0, reference_startup_s=0.0)
    >>> (acc.total_s, acc.wasted_s, acc.lost_work_s, acc.recovery_s, acc.overhead_s)
    (6.5, 3.5, 1.5, 1.5, 0.0)
    >>> acc.startup_overhead_s
    0.5
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Attempt:
    """One training process of a run, as the supervisor saw it (times in seconds, one clock).

    Attributes:
        start_t: Its ``start`` event (model and checkpointer built).
        resumed_t: Its ``resumed`` event (``resume()`` returned).
        resumed_step: The step it resumed at.
        steps: ``(step, time)`` of each step event, in order.
        end_t: When it was killed, or (not killed) its last step event plus ``close_s``.
        killed: Whether a failure ended it.
        launch_t: When the supervisor asked for it (after the previous kill's clean-up).
        kill_t: When the failure struck (None if not killed).
        kind: ``"software"`` or ``"hardware"`` for a killed attempt.
        restore_s: The recovery stats' ``total_s`` of its ``resume()`` (0 without recovery).
        recovery: The recovery stats it reported (or None).
        close_s: Its final ``close()`` (not killed).
    """

    start_t: float
    resumed_t: float
    resumed_step: int
    steps: list[tuple[int, float]]
    end_t: float
    killed: bool
    launch_t: float | None = None
    kill_t: float | None = None
    kind: str | None = None
    restore_s: float = 0.0
    recovery: dict[str, Any] | None = None
    close_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Accounting:
    """The time of one run, split (see the module docstring). Seconds."""

    total_s: float
    reference_s: float
    reference_startup_s: float = 0.0
    startup_s: float = 0.0
    new_s: float = 0.0
    redone_s: float = 0.0
    tail_s: float = 0.0
    restart_s: float = 0.0
    resume_s: float = 0.0
    restore_s: float = 0.0
    close_s: float = 0.0
    failures: int = 0
    steps_new: int = 0
    steps_redone: int = 0
    recovered_steps: list[int] = field(default_factory=list)
    failed_at_steps: list[int] = field(default_factory=list)
    recovery_sources: list[str | None] = field(default_factory=list)

    @property
    def wasted_s(self) -> float:
        """Total minus the failure-free time without checkpointing."""
        return self.total_s - self.reference_s

    @property
    def startup_overhead_s(self) -> float:
        """The first ``resume()`` beyond the reference's."""
        return self.startup_s - self.reference_startup_s

    @property
    def overhead_s(self) -> float:
        """Steady-state checkpointing overhead."""
        return self.new_s + self.close_s - (self.reference_s - self.reference_startup_s)

    @property
    def lost_work_s(self) -> float:
        """Iterations trained twice, and steps cut short by a failure."""
        return self.redone_s + self.tail_s

    @property
    def recovery_s(self) -> float:
        """Restarts and resumes."""
        return self.restart_s + self.resume_s

    @property
    def core_wasted_s(self) -> float:
        """Steady overhead + lost work + restore (no process start-ups)."""
        return self.overhead_s + self.lost_work_s + self.restore_s

    @property
    def core_ratio(self) -> float:
        """``T_ff / (T_ff + core wasted)``."""
        d = self.reference_s + self.core_wasted_s
        return self.reference_s / d if d > 0 else math.nan

    @property
    def effective_ratio(self) -> float:
        """Gemini's effective training time ratio, ``T_ff / total``."""
        return self.reference_s / self.total_s if self.total_s > 0 else math.nan

    def as_dict(self) -> dict[str, Any]:
        """Every field and derived figure, JSON-able."""
        out = asdict(self)
        out.update(
            wasted_s=self.wasted_s,
            startup_overhead_s=self.startup_overhead_s,
            overhead_s=self.overhead_s,
            lost_work_s=self.lost_work_s,
            recovery_s=self.recovery_s,
            effective_ratio=self.effective_ratio,
            core_wasted_s=self.core_wasted_s,
            core_ratio=self.core_ratio,
            resume_other_s=self.resume_s - self.restore_s,
        )
        return out


def account(
    attempts: list[Attempt], reference_s: float, reference_startup_s: float = 0.0
) -> Accounting:
    """Split the time of a run (see the module docstring).

    Args:
        attempts: The run's training processes, in order; all but the last killed.
        reference_s: ``T_ff``, the reference job's total (its :class:`Accounting`'s
            ``total_s``).
        reference_startup_s: ``T_ff0``, the reference's ``startup_s``.

    Raises:
        ValueError: no attempt, a killed last attempt, a non-killed earlier one, or
            times that go backwards.
    """
    if not attempts:
        raise ValueError("a run needs at least one attempt")
    for i, a in enumerate(attempts):
        if a.killed != (i < len(attempts) - 1):
            raise ValueError(
                f"attempt {i}: every attempt but the last must end in a failure "
                f"(killed={a.killed}, {len(attempts)} attempts)"
            )
        times = [a.start_t, a.resumed_t, *(t for _, t in a.steps), a.end_t]
        if any(y < x for x, y in zip(times, times[1:], strict=False)):
            raise ValueError(f"attempt {i}: event times go backwards: {times}")
    acc = Accounting(
        total_s=attempts[-1].end_t - attempts[0].start_t,
        reference_s=float(reference_s),
        reference_startup_s=float(reference_startup_s),
    )
    hwm = -1
    prev_end: float | None = None
    for i, a in enumerate(attempts):
        if i == 0:
            acc.startup_s += a.resumed_t - a.start_t
        else:
            assert prev_end is not None
            if a.start_t < prev_end:
                raise ValueError(f"attempt {i} starts before the previous one ended")
            acc.restart_s += a.start_t - prev_end
            resume = a.resumed_t - a.start_t
            acc.resume_s += resume
            acc.restore_s += min(max(a.restore_s, 0.0), resume)
            acc.recovered_steps.append(a.resumed_step)
            acc.recovery_sources.append((a.recovery or {}).get("source"))
            if a.resumed_step > hwm:
                # steps the killed attempt finished (their records were handed over) but
                # did not live to report: new work, recovered rather than redone
                acc.steps_new += a.resumed_step - hwm
        hwm = max(hwm, a.resumed_step)
        t_prev = a.resumed_t
        for step, t in a.steps:
            if step <= hwm:
                acc.redone_s += t - t_prev
                acc.steps_redone += 1
            else:
                acc.new_s += t - t_prev
                acc.steps_new += 1
                hwm = step
            t_prev = t
        if a.killed:
            acc.tail_s += a.end_t - t_prev
            acc.failures += 1
            acc.failed_at_steps.append(a.steps[-1][0] if a.steps else a.resumed_step)
        else:
            acc.close_s += a.end_t - t_prev
        prev_end = a.end_t
    return acc


__all__ = ["Accounting", "Attempt", "account"]

"""CheckFreq's checkpoint interval: fixed, or chosen from measured costs (``"auto"``).

With ``full_every="auto"`` (CheckFreq's policy), :class:`IntervalPolicy` times
``profile_steps`` iterations with no checkpoint running, lets one measuring checkpoint
run and takes its cost (the extra time of the iteration it overlaps, and the persist
time), then fixes the interval with :func:`choose_interval`. The choice is logged
(logger ``lowdiff_lab.baselines.checkfreq``).
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass
from typing import Any

from lowdiff.options import check_int

log = logging.getLogger("lowdiff_lab.baselines.checkfreq")

AUTO = "auto"


def choose_interval(iter_s: float, snapshot_stall_s: float, persist_s: float, bound: float) -> int:
    """CheckFreq's checkpoint interval: the smallest ``k`` that meets both constraints.

    - overhead: ``snapshot_stall_s / (k * iter_s) <= bound`` (the training time lost to
      one checkpoint, spread over the ``k`` iterations it covers);
    - one checkpoint in flight: ``k * iter_s >= persist_s`` (a checkpoint never waits for
      the previous one to be persisted).

    Args:
        iter_s: iteration time without checkpointing (seconds, > 0).
        snapshot_stall_s: training time lost per checkpoint (seconds, >= 0).
        persist_s: time to persist one checkpoint (seconds, >= 0).
        bound: the accepted overhead, as a fraction of training time (0 < bound < 1).

    Returns:
        The interval in iterations (>= 1).

    Example:
        >>> choose_interval(0.1, 0.02, 0.35, 0.05)  # overhead needs 4, persist needs 4
        4
        >>> choose_interval(0.1, 0.0, 0.0, 0.05)
        1
    """
    for name, value in (
        ("iter_s", iter_s),
        ("snapshot_stall_s", snapshot_stall_s),
        ("persist_s", persist_s),
    ):
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if iter_s <= 0:
        raise ValueError(f"iter_s must be > 0, got {iter_s!r}")
    check_bound(bound, "bound")
    # a relative slack so that an exact quotient (0.3 / 0.1 = 3.0000000000000004) is not
    # rounded up by floating-point error
    eps = 1e-9
    k_overhead = math.ceil(snapshot_stall_s / (bound * iter_s) * (1 - eps))
    k_persist = math.ceil(persist_s / iter_s * (1 - eps))
    return max(1, k_overhead, k_persist)


def check_bound(bound: Any, name: str = "overhead_bound") -> float:
    """``bound`` as a float in (0, 1), or a TypeError / ValueError naming it."""
    if not isinstance(bound, (int, float)) or isinstance(bound, bool):
        raise TypeError(f"{name} must be a number, got {type(bound).__name__} {bound!r}")
    if not 0 < bound < 1:  # also rejects NaN
        raise ValueError(f"{name} must be in (0, 1), got {bound!r}")
    return float(bound)


@dataclass(frozen=True)
class CheckFreqOptions:
    """CheckFreq's own options, checked before the directory is locked.

    Raises:
        TypeError, ValueError: naming the option and its value.
    """

    full_every: int | str = 30
    """A checkpoint every this many steps, or ``"auto"`` for CheckFreq's profiled interval
    (an int is checked with the options every baseline takes)."""
    overhead_bound: float = 0.035
    """With ``"auto"``: the accepted overhead, as a fraction of the iteration time."""
    profile_steps: int = 5
    """With ``"auto"``: iterations timed before the measuring checkpoint."""

    def __post_init__(self) -> None:
        if isinstance(self.full_every, str) and self.full_every != AUTO:
            raise ValueError(f"full_every must be an int >= 1 or {AUTO!r}, got {self.full_every!r}")
        object.__setattr__(self, "overhead_bound", check_bound(self.overhead_bound))
        check_int("profile_steps", self.profile_steps, 1)

    @property
    def auto(self) -> bool:
        return self.full_every == AUTO


class IntervalPolicy:
    """Which steps checkpoint: a fixed interval, or CheckFreq's profiled one.

    The trainer reports every iteration boundary (:meth:`observe`, just before an
    update), every checkpoint taken (:meth:`checkpoint_taken`) and every persist done
    (:meth:`persisted`). With ``"auto"`` the policy then goes: profile (time
    ``profile_steps`` iterations with nothing in flight) -> measure (the next step
    checkpoints; its stall, its overlap with the next iteration and its persist time are
    taken) -> choose (:func:`choose_interval`).
    """

    def __init__(self, options: CheckFreqOptions, where: object) -> None:
        self.auto = options.auto
        self.where = where
        """What the log line names (the checkpoint directory)."""
        self.overhead_bound = options.overhead_bound
        self.profile_steps = options.profile_steps
        self.interval: int | None = None
        """Steps between checkpoints; None while ``"auto"`` is still measuring."""
        self.iter_s_seen = 0.0
        """Iteration time without checkpointing: the profiled median with ``"auto"``,
        else a running mean (0 until one is seen)."""
        self.probe_cost: float | None = None
        """The stall of the measuring checkpoint (``"auto"``)."""
        # iteration timing: an iteration runs from one observe() to the next
        self._mark: float | None = None
        self._mark_ckpt: int | None = None
        self._mark_busy = False
        self._ckpt_stall = 0.0
        self._clean_sum = self._clean_n = 0.0
        self._profile: list[float] = []
        self._iter_s = 0.0
        self._probe_due = False
        self._probe_step: int | None = None
        self._probe_persist: float | None = None

    def fix(self, interval: int) -> None:
        """The interval given by ``full_every=k`` (ignored with ``"auto"``)."""
        if not self.auto:
            self.interval = interval

    def full_every(self, step: int) -> int:
        """The interval as the step loop reads it (``step % full_every == 0``) after
        ``step`` updates. With ``"auto"``, until the interval is chosen, only the
        measuring checkpoint is due."""
        if self.interval is not None:
            return self.interval
        return step if self._probe_due and step > 0 else step + 1

    def stalled(self, seconds: float) -> None:
        """The checkpoint just taken also stalled the next update this long."""
        self._ckpt_stall += seconds

    def checkpoint_taken(self, step: int, stall: float) -> None:
        """A checkpoint of ``step`` was taken; the trainer was blocked ``stall`` seconds."""
        if self._probe_due:
            self._probe_due, self._probe_step = False, step
        self._mark_ckpt = step
        self._ckpt_stall = stall

    def persisted(self, step: int, seconds: float) -> None:
        """The checkpoint of ``step`` took ``seconds`` to persist."""
        if step == self._probe_step:
            self._probe_persist = seconds

    def observe(self, now: float, busy: bool) -> None:
        """Time the iteration that ends now (``busy``: a persist is in flight), and take
        the next policy step for ``"auto"``."""
        self._time_iteration(now, busy)
        if not self.auto or self.interval is not None:
            return
        if self._probe_step is None:
            if len(self._profile) >= self.profile_steps:
                self._iter_s = statistics.median(self._profile)
                self.iter_s_seen = self._iter_s
                self._probe_due = True  # the step loop checkpoints after this update
            return
        if self.probe_cost is not None and self._probe_persist is not None:
            self._choose()

    def _time_iteration(self, now: float, busy: bool) -> None:
        if self._mark is not None:
            d = now - self._mark
            if self._mark_ckpt is not None:
                if self._mark_ckpt == self._probe_step and self.probe_cost is None:
                    # what the checkpoint cost this iteration: the stall, plus the slowdown
                    # of the forward/backward the snapshot ran beside
                    self.probe_cost = max(self._ckpt_stall, d - self._iter_s)
            elif not self._mark_busy and not busy:
                self._clean_sum += d
                self._clean_n += 1
                if self.auto and self.interval is None and self._probe_step is None:
                    self._profile.append(d)
                else:
                    self.iter_s_seen = self._iter_s or self._clean_sum / self._clean_n
        self._mark, self._mark_ckpt, self._mark_busy = now, None, busy

    def _choose(self) -> None:
        assert self.probe_cost is not None and self._probe_persist is not None
        k = choose_interval(self._iter_s, self.probe_cost, self._probe_persist, self.overhead_bound)
        self.interval = k
        log.info(
            "checkfreq: checkpoint every %d steps (iteration %.4f s, stall per checkpoint "
            "%.4f s, persist %.4f s, overhead bound %.1f %%) in %s",
            k,
            self._iter_s,
            self.probe_cost,
            self._probe_persist,
            100 * self.overhead_bound,
            self.where,
        )

    def report(self) -> dict[str, float]:
        """The policy's entries of ``ck.stats``."""
        return {
            "interval": self.interval or 0,
            "iter_s": self.iter_s_seen,
            "snapshot_stall_s": self.probe_cost or 0.0,
        }

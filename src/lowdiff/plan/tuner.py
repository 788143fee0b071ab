"""``full_every="auto"`` / ``batch_size="auto"``: the Checkpointer's (f, b) chosen while it trains.

The :class:`AutoTuner` keeps running means of the costs the trainer measures anyway and
plans with the wasted-time model (:mod:`lowdiff.plan.model`) once they are profiled;
:func:`resolve_mtbf` says which failure rate it plans for.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any

from lowdiff.errors import InvalidArgumentError
from lowdiff.plan.fit import fit_bandwidth
from lowdiff.plan.model import DEFAULT_B_VALUES, CostModel, optimize, optimize_exact, wasted_time

__all__ = [
    "AUTO",
    "DEFAULT_MTBF_S",
    "MTBF_ENV",
    "PLAN_HORIZON_S",
    "START_B",
    "START_F",
    "AutoTuner",
    "resolve_mtbf",
]

AUTO = "auto"
"""The value of ``full_every`` / ``batch_size`` that lets the Checkpointer choose."""

START_F = 30
"""Full-checkpoint interval of an ``"auto"`` run until its costs are profiled."""
START_B = 3
"""Batch size of an ``"auto"`` run until its costs are profiled."""
DEFAULT_MTBF_S = 6 * 3600.0
"""MTBF assumed by ``"auto"`` when neither ``mtbf=`` nor ``LOWDIFF_MTBF`` is given."""
MTBF_ENV = "LOWDIFF_MTBF"
"""Environment variable with the MTBF in seconds (``lowdiff chaos`` sets it)."""
PLAN_HORIZON_S = 3600.0
"""T of the auto planner's model: its predicted T_w is GPU-seconds per hour of training
(the argmin does not depend on T)."""


def resolve_mtbf(mtbf: float | None) -> tuple[float, str]:
    """The MTBF in seconds and where it came from: ``mtbf=``, ``LOWDIFF_MTBF`` or the default.

    Raises:
        ValueError: the option or the environment variable is not a positive number.

    Example:
        >>> resolve_mtbf(600.0)
        (600.0, 'mtbf=')
    """
    if mtbf is not None:
        if (
            isinstance(mtbf, bool)
            or not isinstance(mtbf, (int, float))
            or not math.isfinite(mtbf)
            or mtbf <= 0
        ):
            raise InvalidArgumentError(f"mtbf must be a number of seconds > 0, got {mtbf!r}")
        return float(mtbf), "mtbf="
    text = os.environ.get(MTBF_ENV)
    if text is not None and text.strip():
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value <= 0:
            raise InvalidArgumentError(f"{MTBF_ENV} must be a number of seconds > 0, got {text!r}")
        return value, MTBF_ENV
    return DEFAULT_MTBF_S, "default"


class _Ewma:
    """Exponentially weighted mean (the first sample is taken as is)."""

    def __init__(self, alpha: float) -> None:
        self.alpha, self.value, self.n = alpha, 0.0, 0

    def add(self, x: float) -> None:
        self.value = x if self.n == 0 else self.alpha * x + (1 - self.alpha) * self.value
        self.n += 1


class AutoTuner:
    """The ``full_every="auto"`` / ``batch_size="auto"`` policy of the Checkpointer (pure).

    The trainer feeds it what it measures anyway; the tuner keeps running means (EWMA)
    of the costs and, once profiled, plans with :func:`optimize`:

    - ``observe_iteration(s)``: the time between two ``step()`` calls, without the
      checkpointing work done in them (tau);
    - ``observe_record_file(n, bytes, s)`` and ``observe_full(bytes, s)``: the
      checkpointing process's writes. The two sizes give the bandwidth W and the fixed
      latency (taken as both L_B and L_F) by :func:`fit_bandwidth`;
    - ``observe_optimizer_step(s)`` (replay per record), ``observe_decompress(s)``
      (per record) and ``observe_full_copy(s)`` (copying the state into the staging
      buffer, the reverse of loading it: with S_F / W_r it gives R_F);
    - ``observe_recovery(n, s)``: a real recovery's replay of ``n`` records (a restarted
      trainer's own): a record's replay is counted at least at that rate.

    W_r is taken equal to W. The first plan is applied as soon as the tuner is profiled
    (``profile_steps`` iterations, one full checkpoint and one record file written); it
    re-plans after every full checkpoint (at most every ``profile_steps`` steps) and every
    ``replan_every`` steps, and applies a new (f, b) only when it predicts ``margin`` less
    wasted time than the current one. Planning evaluates T_w about a hundred times
    (:func:`optimize_exact`).

    Example:
        >>> t = AutoTuner(record_bytes=1000, mtbf=3600.0, profile_steps=1)
        >>> t.observe_iteration(0.1); t.observe_record_file(3, 3100, 0.002)
        >>> t.observe_full(10**6, 0.01); t.observe_optimizer_step(0.001)
        >>> entry = t.decide(step=10, full_bytes=10**6)
        >>> (entry["f"], entry["b"]) == (t.f, t.b)
        True
    """

    def __init__(
        self,
        *,
        record_bytes: int,
        mtbf: float,
        tune_f: bool = True,
        tune_b: bool = True,
        f: int = START_F,
        b: int = START_B,
        n_gpus: int = 1,
        profile_steps: int = 10,
        replan_every: int = 100,
        margin: float = 0.05,
        alpha: float = 0.3,
        b_values: Iterable[int] = DEFAULT_B_VALUES,
    ) -> None:
        self.record_bytes, self.mtbf, self.n_gpus = record_bytes, mtbf, n_gpus
        self.tune_f, self.tune_b = tune_f, tune_b
        # the start respects 1 <= b <= f whichever of the two is fixed
        self.f, self.b = (max(f, b), b) if tune_f else (f, min(b, f))
        self.profile_steps, self.replan_every = profile_steps, replan_every
        self.margin = margin
        self.b_values = list(b_values)
        self.history: list[dict[str, Any]] = []
        self.planned = False
        self._due = False
        self._last_plan_step = 0
        self._tau, self._opt, self._dec = _Ewma(alpha), _Ewma(alpha), _Ewma(alpha)
        self._rec_bytes, self._rec_s, self._rec_extra = _Ewma(alpha), _Ewma(alpha), _Ewma(alpha)
        self._full_bytes, self._full_s, self._copy = _Ewma(alpha), _Ewma(alpha), _Ewma(alpha)
        self._recovered = _Ewma(alpha)

    # -- measurements ---------------------------------------------------------------------
    def observe_iteration(self, seconds: float) -> None:
        if seconds > 0:
            self._tau.add(seconds)

    def observe_record_file(self, n_records: float, nbytes: float, seconds: float) -> None:
        self._rec_bytes.add(nbytes)
        self._rec_s.add(seconds)
        self._rec_extra.add(max(0.0, nbytes - n_records * self.record_bytes))

    def observe_full(self, nbytes: float, seconds: float) -> None:
        self._full_bytes.add(nbytes)
        self._full_s.add(seconds)
        self._due = True

    def observe_optimizer_step(self, seconds: float) -> None:
        self._opt.add(seconds)

    def observe_decompress(self, seconds_per_record: float) -> None:
        self._dec.add(seconds_per_record)

    def observe_full_copy(self, seconds: float) -> None:
        self._copy.add(seconds)

    def observe_recovery(self, records: int, seconds: float) -> None:
        """A real recovery replayed ``records`` records in ``seconds`` (their wall time,
        without the full checkpoint's load): from then on a record's replay is counted
        at least at that rate (its decompression and optimizer step, plus what the
        training-time measurements leave out: reading, checking, setting the gradients)."""
        if records > 0 and seconds > 0:
            self._recovered.add(seconds / records)

    @property
    def wants_decompress_sample(self) -> bool:
        """Decompression is timed on a few steps only (it is extra work for the trainer)."""
        return self._dec.n < 3

    @property
    def ready(self) -> bool:
        """Enough has been measured to plan."""
        return self._tau.n >= self.profile_steps and self._full_s.n >= 1 and self._rec_s.n >= 1

    # -- planning -------------------------------------------------------------------------
    def model(self, full_bytes: float) -> CostModel:
        """The cost model of the measurements so far (``full_bytes``: the state's size now)."""
        s_f = max(float(full_bytes), self._full_bytes.value)
        w, lat = fit_bandwidth(
            [self._rec_bytes.value, self._full_bytes.value], [self._rec_s.value, self._full_s.value]
        )
        return CostModel(
            n_gpus=self.n_gpus,
            tau=self._tau.value,
            total_time=PLAN_HORIZON_S,
            mtbf=self.mtbf,
            full_bytes=s_f,
            record_bytes=float(self.record_bytes),
            batch_overhead_bytes=self._rec_extra.value,
            write_bw=w,
            read_bw=w,
            full_latency=lat,
            batch_latency=lat,
            full_recovery_s=s_f / w + self._copy.value,
            decompress_s_per_record=self._dec.value,
            replay_s_per_record=self._replay_s_per_record(),
        )

    def _replay_s_per_record(self) -> float:
        """The optimizer step (training's update stands for a replayed one), or what a
        real recovery measured beyond the decompression, whichever is larger."""
        if self._recovered.n == 0:
            return self._opt.value
        return max(self._opt.value, self._recovered.value - self._dec.value)

    def due(self, step: int) -> bool:
        """Whether :meth:`decide` should run at this step."""
        if not self.ready:
            return False
        if not self.planned:
            return True
        since = step - self._last_plan_step
        # after every full checkpoint, but never more often than every profile_steps steps
        return since >= self.replan_every or (self._due and since >= self.profile_steps)

    def decide(self, step: int, full_bytes: float) -> dict[str, Any] | None:
        """Plan now; returns the history entry of a change (then ``f``/``b`` hold it), else None."""
        self._due = False
        self._last_plan_step = step
        m = self.model(full_bytes)
        bs = self.b_values if self.tune_b else [self.b]
        if self.tune_f:
            p = optimize_exact(m, bs)
        else:
            p = optimize(m, [self.f], [b for b in bs if b <= self.f] or [self.f])
        current = wasted_time(m, self.f, self.b) if self.b <= self.f else math.inf
        first = not self.planned
        self.planned = True
        if (p.f, p.b) == (self.f, self.b):
            return None
        if not first and not p.wasted_s < current * (1 - self.margin):
            return None
        entry = {
            "step": step,
            "f": p.f,
            "b": p.b,
            "previous_f": self.f,
            "previous_b": self.b,
            "wasted_s": p.wasted_s,
            "previous_wasted_s": current,
            "f_c": p.f_c,
            "reason": "profiled" if first else "re-planned",
            "inputs": m.as_dict(),
        }
        self.f, self.b = p.f, p.b
        self.history.append(entry)
        return entry

    def force(self, step: int, f: int, b: int, reason: str = "forced") -> dict[str, Any]:
        """Record a change made from outside the planner."""
        entry = {
            "step": step,
            "f": f,
            "b": b,
            "previous_f": self.f,
            "previous_b": self.b,
            "wasted_s": None,
            "previous_wasted_s": None,
            "f_c": None,
            "reason": reason,
            "inputs": None,
        }
        self.f, self.b = f, b
        self.history.append(entry)
        return entry

"""The wasted-time model of the paper's section "Optimizing Checkpointing Configuration".

LowDiff has two knobs: the full-checkpoint interval ``f`` (iterations between two full
checkpoints) and the batch size ``b`` (differential records per record file), integers
with ``1 <= b <= f``. This module is the paper's model of the expected wasted GPU time
``T_w(f, b)`` and its constrained argmin, as plain arithmetic (no torch).

The model, with ``N`` GPUs, iteration time ``tau``, failure-free duration ``T`` and mean
time between failures ``M`` (so ``T / M`` expected failures)::

    C_F    = L_F + S_F / W                           (equation write-costs)
    C_B(b) = L_B + S_B(b) / W,   S_B(b) = b * record_bytes + batch_overhead_bytes
    R_B(b) = S_B(b) / W_r + b * decompress + b * replay        (batch-recovery-cost)

    T_w(f, b) = N T / M * [ b tau / 2 + R_F + R_B(b) / 2 * (f / b - 1) ]   (wasted)
              + N T C_F / (f tau) + N T C_B(b) / (f tau) * (f / b - 1)

    f_c(b) = sqrt( 2 M b (C_F - C_B(b)) / (tau R_B(b)) )        (conditional-f)

    (f*, b*) = argmin over the candidate set of T_w(f, b)       (optimal)

For a fixed ``b``, ``T_w`` is ``A + B f + D / f`` with ``B > 0``: convex in ``f`` when
``C_F > C_B(b)`` (minimum at ``f_c(b)``) and increasing otherwise (minimum at ``f = b``).
The default candidate set of :func:`optimize` therefore holds the exact integer argmin
over every ``f >= b`` for each candidate ``b``: it contains ``b`` itself and the integers
on both sides of ``f_c(b)``.

Example:
    >>> from lowdiff.plan import CostModel, optimize
    >>> m = CostModel(tau=0.5, total_time=86400, mtbf=3600, full_bytes=8e9,
    ...               record_bytes=2e7, write_bw=1e9, read_bw=2e9, batch_latency=0.005,
    ...               full_recovery_s=10.0, replay_s_per_record=0.05)
    >>> p = optimize(m)
    >>> (p.f, p.b)
    (1354, 18)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

from lowdiff.errors import InvalidArgumentError

__all__ = [
    "DEFAULT_B_VALUES",
    "CostModel",
    "Plan",
    "continuous_f",
    "default_f_values",
    "optimize",
    "optimize_exact",
    "wasted_time",
    "wasted_time_terms",
    "young_daly_s",
]

DEFAULT_B_VALUES = tuple(range(1, 33))
"""Candidate batch sizes of :func:`optimize` (the paper's "small discrete set")."""

_MAX_F = 10**7
"""Cap of the default f grid: a full checkpoint every ten million iterations is never."""


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Inputs of the wasted-time model. Times in seconds, sizes in bytes, rates in B/s.

    Example:
        >>> m = CostModel(tau=0.2, total_time=3600, mtbf=600, full_bytes=1e9,
        ...               record_bytes=1e6, write_bw=5e8, read_bw=5e8)
        >>> round(m.c_f(), 3)
        2.0
    """

    tau: float
    """Mean iteration time (tau), s."""
    total_time: float
    """Failure-free training duration (T), s."""
    mtbf: float
    """Mean time between failures of the whole system (M), s."""
    full_bytes: float
    """Size of one full checkpoint (S_F), bytes."""
    record_bytes: float
    """Size of one differential record; S_B(b) = b * record_bytes + batch_overhead_bytes."""
    write_bw: float
    """Effective write bandwidth (W), B/s."""
    read_bw: float
    """Effective read bandwidth (W_r), B/s."""
    n_gpus: int = 1
    """Number of GPUs (N): wasted time is counted in GPU-seconds."""
    batch_overhead_bytes: float = 0.0
    """Bytes of one record file that do not grow with b (header, index)."""
    full_latency: float = 0.0
    """Fixed latency of writing one full checkpoint (L_F), s."""
    batch_latency: float = 0.0
    """Fixed latency of writing one record file (L_B), s."""
    full_recovery_s: float = 0.0
    """Time to restore one full checkpoint (R_F), s."""
    decompress_s_per_record: float = 0.0
    """Decompression time of one record at recovery, s (C_decomp(b) = b * this)."""
    replay_s_per_record: float = 0.0
    """Replay (optimizer step) time of one record at recovery, s (C_replay(b) = b * this)."""

    _POSITIVE = ("tau", "total_time", "mtbf", "full_bytes", "record_bytes", "write_bw", "read_bw")

    def __post_init__(self) -> None:
        if isinstance(self.n_gpus, bool) or not isinstance(self.n_gpus, int) or self.n_gpus < 1:
            raise InvalidArgumentError(f"CostModel.n_gpus must be an integer >= 1, got {self.n_gpus!r}")
        for f in fields(self):
            if f.name == "n_gpus":
                continue
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise InvalidArgumentError(f"CostModel.{f.name} must be a finite number, got {v!r}")
            if f.name in self._POSITIVE and v <= 0:
                raise InvalidArgumentError(f"CostModel.{f.name} must be > 0, got {v!r}")
            if v < 0:
                raise InvalidArgumentError(f"CostModel.{f.name} must be >= 0, got {v!r}")

    @property
    def expected_failures(self) -> float:
        """T / M."""
        return self.total_time / self.mtbf

    def c_f(self) -> float:
        """Write cost of one full checkpoint, C_F = L_F + S_F / W."""
        return self.full_latency + self.full_bytes / self.write_bw

    def s_b(self, b: int) -> float:
        """Size of one record file of ``b`` records, S_B(b)."""
        return b * self.record_bytes + self.batch_overhead_bytes

    def c_b(self, b: int) -> float:
        """Write cost of one record file, C_B(b) = L_B + S_B(b) / W."""
        return self.batch_latency + self.s_b(b) / self.write_bw

    def r_b(self, b: int) -> float:
        """Recovery cost of one record file: read + decompress + replay of ``b`` records."""
        return (
            self.s_b(b) / self.read_bw
            + b * self.decompress_s_per_record
            + b * self.replay_s_per_record
        )

    def as_dict(self) -> dict[str, Any]:
        """The inputs as a JSON-able dict."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def young_daly_s(cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimal time between checkpoints, ``sqrt(2 C M)`` seconds, for
    checkpoints that cost ``cost_s`` of training each and failures ``mtbf_s`` apart.

    Example:
        >>> young_daly_s(0.02, 100.0)  # sqrt(2 * 0.02 * 100)
        2.0
    """
    for name, v, positive in (("cost_s", cost_s, False), ("mtbf_s", mtbf_s, True)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise InvalidArgumentError(f"{name} must be a finite number, got {v!r}")
        if v < 0 or (positive and v == 0):
            raise InvalidArgumentError(f"{name} must be {'> 0' if positive else '>= 0'}, got {v!r}")
    return math.sqrt(2.0 * cost_s * mtbf_s)


def _check_fb(f: int, b: int) -> None:
    for name, v in (("f", f), ("b", b)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise InvalidArgumentError(f"{name} must be an integer, got {v!r}")
    if not 1 <= b <= f:
        raise InvalidArgumentError(f"need integers 1 <= b <= f, got f={f}, b={b}")


def wasted_time_terms(m: CostModel, f: int, b: int) -> dict[str, float]:
    """The five terms of T_w(f, b) (GPU-seconds), which sum to :func:`wasted_time`.

    ``lost_work`` (N T/M * b tau/2), ``full_recovery`` (N T/M * R_F), ``replay``
    (N T/M * R_B(b)/2 * (f/b - 1)), ``full_writes`` (N T C_F / (f tau)) and
    ``batch_writes`` (N T C_B(b) / (f tau) * (f/b - 1)).

    Example:
        >>> m = CostModel(tau=1, total_time=100, mtbf=50, full_bytes=10, record_bytes=1,
        ...               write_bw=1, read_bw=1)
        >>> wasted_time_terms(m, 4, 2)["lost_work"]
        2.0
    """
    _check_fb(f, b)
    nt = m.n_gpus * m.total_time
    failures = nt / m.mtbf
    diffs_per_full = f / b - 1
    return {
        "lost_work": failures * b * m.tau / 2,
        "full_recovery": failures * m.full_recovery_s,
        "replay": failures * m.r_b(b) / 2 * diffs_per_full,
        "full_writes": nt * m.c_f() / (f * m.tau),
        "batch_writes": nt * m.c_b(b) / (f * m.tau) * diffs_per_full,
    }


def wasted_time(m: CostModel, f: int, b: int) -> float:
    """Expected wasted GPU time T_w(f, b) of the paper's equation "wasted", GPU-seconds.

    Raises:
        ValueError: ``f`` or ``b`` is not an integer with ``1 <= b <= f``.

    Example:
        >>> m = CostModel(tau=1, total_time=100, mtbf=50, full_bytes=10, record_bytes=1,
        ...               write_bw=1, read_bw=1)
        >>> wasted_time(m, 4, 2)
        304.0
    """
    return math.fsum(wasted_time_terms(m, f, b).values())


def _wasted_real(m: CostModel, f: float, b: int) -> float:
    """T_w for a real ``f`` (the continuous relaxation; no integer check)."""
    nt = m.n_gpus * m.total_time
    k = f / b - 1
    return (
        nt / m.mtbf * (b * m.tau / 2 + m.full_recovery_s + m.r_b(b) / 2 * k)
        + nt * m.c_f() / (f * m.tau)
        + nt * m.c_b(b) / (f * m.tau) * k
    )


def continuous_f(m: CostModel, b: int) -> float | None:
    """The stationary point f_c(b) of T_w over real f (equation "conditional-f").

    Returns None when ``C_F <= C_B(b)``: then T_w increases with f and there is no
    stationary point (the best f for that b is f = b, a full checkpoint per batch).

    Example:
        >>> m = CostModel(tau=1, total_time=100, mtbf=50, full_bytes=10, record_bytes=1,
        ...               write_bw=1, read_bw=1)
        >>> round(continuous_f(m, 2), 4)
        28.2843
    """
    if isinstance(b, bool) or not isinstance(b, int) or b < 1:
        raise InvalidArgumentError(f"b must be an integer >= 1, got {b!r}")
    gain = m.c_f() - m.c_b(b)
    if gain <= 0:
        return None
    return math.sqrt(2 * m.mtbf * b * gain / (m.tau * m.r_b(b)))


@dataclass(frozen=True)
class Plan:
    """The result of :func:`optimize`.

    Attributes:
        f: The chosen full-checkpoint interval f*.
        b: The chosen batch size b*.
        wasted_s: The predicted T_w(f*, b*), GPU-seconds.
        grid: T_w over every evaluated candidate ``(f, b)``.
        model: The inputs.
    """

    f: int
    b: int
    wasted_s: float
    grid: dict[tuple[int, int], float]
    model: CostModel

    @property
    def f_c(self) -> float | None:
        """The continuous optimum f_c(b*) (None when C_F <= C_B(b*))."""
        return continuous_f(self.model, self.b)

    def terms(self) -> dict[str, float]:
        """The terms of T_w(f*, b*)."""
        return wasted_time_terms(self.model, self.f, self.b)

    def table(
        self, f_values: Iterable[int], b_values: Iterable[int]
    ) -> dict[tuple[int, int], float | None]:
        """T_w normalised to T_w(f*, b*) over ``f_values x b_values`` (None where b > f).

        The paper's Table "Normalized wasted time": 1.0 at the chosen pair.
        """
        out: dict[tuple[int, int], float | None] = {}
        for f in f_values:
            for b in b_values:
                out[(f, b)] = None if b > f else wasted_time(self.model, f, b) / self.wasted_s
        return out

    def as_dict(self) -> dict[str, Any]:
        """f*, b*, T_w, its terms, f_c(b*) and the inputs, JSON-able (no grid)."""
        return {
            "f": self.f,
            "b": self.b,
            "wasted_s": self.wasted_s,
            "terms": self.terms(),
            "f_c": self.f_c,
            "inputs": self.model.as_dict(),
        }


def default_f_values(m: CostModel, b_values: Iterable[int] = DEFAULT_B_VALUES) -> list[int]:
    """A geometric grid of f plus, for every b, b itself and the integers around f_c(b)."""
    bs = _candidates("b_values", b_values)
    cands: set[int] = set(bs)
    hi = 64.0
    for b in bs:
        fc = continuous_f(m, b)
        if fc is None:
            continue
        fc = min(fc, float(_MAX_F))
        hi = max(hi, 4 * fc)
        cands.update({max(1, math.floor(fc)), max(1, math.ceil(fc))})
    hi = min(hi, float(_MAX_F))
    x = 1.0
    while x < hi:
        cands.add(round(x))
        x *= 1.25
    cands.add(math.ceil(hi))
    return sorted(cands)


def optimize_exact(m: CostModel, b_values: Iterable[int] = DEFAULT_B_VALUES) -> Plan:
    """:func:`optimize` over every integer f >= b, evaluating only where the optimum can be.

    For each b, T_w is convex in f (or increasing), so its integer minimum over f >= b is
    at b or next to f_c(b): three evaluations per b instead of a grid. The argmin equals
    :func:`optimize`'s with its default f values; ``grid`` holds the pairs evaluated.

    Example:
        >>> m = CostModel(tau=1, total_time=100, mtbf=50, full_bytes=10, record_bytes=1,
        ...               write_bw=1, read_bw=1)
        >>> p = optimize_exact(m)
        >>> (p.f, p.b) == (optimize(m).f, optimize(m).b)
        True
    """
    grid: dict[tuple[int, int], float] = {}
    for b in _candidates("b_values", b_values):
        fs = {b}
        fc = continuous_f(m, b)
        if fc is not None:
            fc = min(fc, float(_MAX_F))
            fs.update({math.floor(fc), math.ceil(fc)})
        for f in fs:
            if f >= b:
                grid[(f, b)] = wasted_time(m, f, b)
    if not grid:
        raise InvalidArgumentError("b_values is empty")
    (f, b), w = min(grid.items(), key=lambda kv: (kv[1], kv[0]))
    return Plan(f=f, b=b, wasted_s=w, grid=grid, model=m)


def _candidates(name: str, values: Iterable[int]) -> list[int]:
    vals = list(values)
    for v in vals:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidArgumentError(f"{name} must hold integers >= 1, got {v!r}")
    return sorted(set(vals))


def optimize(
    m: CostModel,
    f_values: Iterable[int] | None = None,
    b_values: Iterable[int] | None = None,
) -> Plan:
    """The constrained argmin of T_w over integer ``(f, b)`` with ``1 <= b <= f`` (equation "optimal").

    Args:
        m: The inputs.
        f_values: Candidate full-checkpoint intervals (default: :func:`default_f_values`,
            which holds the exact integer optimum of every candidate b).
        b_values: Candidate batch sizes (default: 1..32).

    Returns:
        The :class:`Plan`; ties go to the smaller f, then the smaller b.

    Raises:
        ValueError: a candidate is not a positive integer, or no pair has ``b <= f``.

    Example:
        >>> m = CostModel(tau=1, total_time=100, mtbf=50, full_bytes=10, record_bytes=1,
        ...               write_bw=1, read_bw=1)
        >>> p = optimize(m, f_values=[2, 4, 8, 16], b_values=[1, 2, 4])
        >>> (p.f, p.b)
        (16, 4)
    """
    bs = _candidates("b_values", DEFAULT_B_VALUES if b_values is None else b_values)
    fs = _candidates("f_values", default_f_values(m, bs) if f_values is None else f_values)
    grid = {(f, b): wasted_time(m, f, b) for f in fs for b in bs if b <= f}
    if not grid:
        raise InvalidArgumentError(f"no candidate pair has b <= f (f_values={fs}, b_values={bs})")
    (f, b), w = min(grid.items(), key=lambda kv: (kv[1], kv[0]))
    return Plan(f=f, b=b, wasted_s=w, grid=grid, model=m)

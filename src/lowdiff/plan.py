"""The (f, b) configuration model of the paper's section "Optimizing Checkpointing Configuration".

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

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

__all__ = [
    "AUTO",
    "AutoTuner",
    "CostModel",
    "Plan",
    "bench_inputs",
    "continuous_f",
    "cost_model_from_bench",
    "optimize",
    "optimize_exact",
    "resolve_mtbf",
    "wasted_time",
    "wasted_time_terms",
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
            raise ValueError(f"CostModel.n_gpus must be an integer >= 1, got {self.n_gpus!r}")
        for f in fields(self):
            if f.name == "n_gpus":
                continue
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"CostModel.{f.name} must be a finite number, got {v!r}")
            if f.name in self._POSITIVE and v <= 0:
                raise ValueError(f"CostModel.{f.name} must be > 0, got {v!r}")
            if v < 0:
                raise ValueError(f"CostModel.{f.name} must be >= 0, got {v!r}")

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


def _check_fb(f: int, b: int) -> None:
    for name, v in (("f", f), ("b", b)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} must be an integer, got {v!r}")
    if not 1 <= b <= f:
        raise ValueError(f"need integers 1 <= b <= f, got f={f}, b={b}")


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
        raise ValueError(f"b must be an integer >= 1, got {b!r}")
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
        raise ValueError("b_values is empty")
    (f, b), w = min(grid.items(), key=lambda kv: (kv[1], kv[0]))
    return Plan(f=f, b=b, wasted_s=w, grid=grid, model=m)


def _candidates(name: str, values: Iterable[int]) -> list[int]:
    vals = list(values)
    for v in vals:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must hold integers >= 1, got {v!r}")
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
        raise ValueError(f"no candidate pair has b <= f (f_values={fs}, b_values={bs})")
    (f, b), w = min(grid.items(), key=lambda kv: (kv[1], kv[0]))
    return Plan(f=f, b=b, wasted_s=w, grid=grid, model=m)


# --------------------------------------------------------------------------- from a bench run

BENCH_EXPERIMENTS = ("overhead", "storage", "batching", "recovery")
"""The ``lowdiff bench`` experiments :func:`cost_model_from_bench` reads."""

_FROM = {
    "tau": "overhead",
    "full_bytes": "storage",
    "record_bytes": "batching",
    "batch_overhead_bytes": "storage",
    "write_bw": "batching",
    "batch_latency": "batching",
    "full_latency": "batching",
    "read_bw": "recovery",
    "full_recovery_s": "recovery",
    "decompress_s_per_record": "recovery",
    "replay_s_per_record": "recovery",
}
"""Which experiment each input comes from."""


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """Least squares ``y = a + s x``; None without two distinct x."""
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        return None
    s = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - s * mx, s


def fit_bandwidth(nbytes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Fit ``seconds = latency + nbytes / bandwidth``; returns ``(bandwidth, latency)``.

    A negative latency is refitted through the origin (latency 0). Without two distinct
    sizes, or when the time does not grow with the size (latency-bound writes, noise), the
    whole time is put on the bandwidth and the latency is 0.

    Example:
        >>> fit_bandwidth([100, 300], [1.5, 3.5])
        (100.0, 0.5)
    """
    line = fit_line(nbytes, seconds)
    if line is not None:
        a, s = line
        if s > 0 and a >= 0:
            return 1.0 / s, a
        sxy = sum(x * y for x, y in zip(nbytes, seconds, strict=True))
        sxx = sum(x * x for x in nbytes)
        if s > 0 and sxy > 0:
            return sxx / sxy, 0.0
    total_s = sum(seconds)
    if total_s <= 0:
        raise ValueError("cannot fit a bandwidth: every measured time is 0")
    return sum(nbytes) / total_s, 0.0


def bench_inputs(results_jsonl_path: str | Path) -> tuple[dict[str, float], list[str]]:
    """The :class:`CostModel` inputs a ``lowdiff bench`` results file gives.

    Returns:
        ``(inputs, missing)``: the inputs found (field name to value) and the
        experiments of :data:`BENCH_EXPERIMENTS` the file lacks.

    How each input is measured:

    - ``tau``: the median iteration time of compressed training without checkpoints
      (``overhead``, arm "W/O CKPT").
    - ``full_bytes``: LowDiff's full-checkpoint size (``storage``); the record files'
      bytes beyond their rows give ``batch_overhead_bytes``.
    - ``record_bytes``, ``write_bw``, ``batch_latency``: the record row size and a least
      squares fit of write time per file against bytes per file over the batch sizes
      (``batching``). ``full_latency`` is taken equal to ``batch_latency`` (the same
      write, fsync and rename).
    - ``read_bw``: a fit of read time against bytes read; ``decompress_s_per_record`` and
      ``replay_s_per_record``: decompression and reconstruction time per replayed
      record; ``full_recovery_s``: the recovery time left once the records' share is
      taken off (median over the LowDiff rows of ``recovery``).
    """
    path = Path(results_jsonl_path)
    if not path.is_file():
        raise FileNotFoundError(f"no bench results file at {path}")
    run: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    with open(path) as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not a JSON line ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{i}: expected a JSON object")
            if obj.get("kind") == "run":
                run = obj
            elif obj.get("kind") == "row" or "experiment" in obj:
                rows.append(obj)

    def pick(exp: str, **match: Any) -> list[dict[str, Any]]:
        return [
            r
            for r in rows
            if r.get("experiment") == exp and all(r.get(k) == v for k, v in match.items())
        ]

    out: dict[str, float] = {}
    missing: list[str] = []

    ref = pick("overhead", setting="compressed", method="W/O CKPT")
    if ref and ref[0].get("median_s"):
        out["tau"] = float(ref[0]["median_s"])
    else:
        missing.append("overhead")

    batching = [r for r in pick("batching") if r.get("writes") and r.get("record_row_bytes")]
    if batching:
        row_bytes = float(batching[0]["record_row_bytes"])
        out["record_bytes"] = row_bytes
        w, lat = fit_bandwidth(
            [row_bytes * r["records"] / r["writes"] for r in batching],
            [float(r["write_s_per_write"]) for r in batching],
        )
        out["write_bw"], out["batch_latency"], out["full_latency"] = w, lat, lat
    else:
        missing.append("batching")

    store = pick("storage", setting="compressed", method="LowDiff")
    if store and store[0].get("full_checkpoint_bytes"):
        out["full_bytes"] = float(store[0]["full_checkpoint_bytes"])
        per_record = store[0].get("differential_bytes")
        b = int(run.get("profile", {}).get("lowdiff_batch", 0) or 0)
        if per_record and b and "record_bytes" in out:
            out["batch_overhead_bytes"] = max(0.0, (float(per_record) - out["record_bytes"]) * b)
    else:
        missing.append("storage")

    rec = [r for r in pick("recovery", method="LowDiff") if r.get("recovery_s") is not None]
    if rec:
        bw_r, _ = fit_bandwidth(
            [float(r["bytes_read"]) for r in rec], [float(r["read_s"]) for r in rec]
        )
        n = sum(int(r.get("records_replayed") or 0) for r in rec)
        dec = sum(float(r["decompress_s"]) for r in rec) / n if n else 0.0
        rep = sum(float(r["reconstruct_s"]) for r in rec) / n if n else 0.0
        s_f = out.get("full_bytes", 0.0)
        rest = sorted(
            max(
                0.0,
                float(r["recovery_s"])
                - int(r.get("records_replayed") or 0) * (dec + rep)
                - max(0.0, float(r["bytes_read"]) - s_f) / bw_r,
            )
            for r in rec
        )
        out["read_bw"] = bw_r
        out["decompress_s_per_record"] = dec
        out["replay_s_per_record"] = rep
        out["full_recovery_s"] = rest[len(rest) // 2]
    else:
        missing.append("recovery")
    return out, missing


def cost_model_from_bench(
    results_jsonl_path: str | Path, *, mtbf: float, total_time: float, n_gpus: int = 1
) -> CostModel:
    """A :class:`CostModel` from the measurements of a ``lowdiff bench`` run.

    The file must hold the experiments ``overhead``, ``storage``, ``batching`` and
    ``recovery`` (``lowdiff bench overhead storage batching recovery``); see
    :func:`bench_inputs` for how each input is derived.

    Raises:
        ValueError: the file lacks one of those experiments (named in the message).
        FileNotFoundError: there is no such file.

    Example:
        >>> m = cost_model_from_bench("results/results.jsonl", mtbf=3600, total_time=86400)  # doctest: +SKIP
        >>> optimize(m).f  # doctest: +SKIP
    """
    inputs, missing = bench_inputs(results_jsonl_path)
    if missing:
        raise ValueError(
            f"{results_jsonl_path} lacks the bench experiment(s) {', '.join(missing)} "
            f"(needed for {', '.join(k for k, v in _FROM.items() if v in missing)}); run "
            f"`lowdiff bench {' '.join(BENCH_EXPERIMENTS)}`"
        )
    return CostModel(mtbf=mtbf, total_time=total_time, n_gpus=n_gpus, **inputs)


# --------------------------------------------------------------------------- auto mode

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
    import os

    if mtbf is not None:
        if (
            isinstance(mtbf, bool)
            or not isinstance(mtbf, (int, float))
            or not math.isfinite(mtbf)
            or mtbf <= 0
        ):
            raise ValueError(f"mtbf must be a number of seconds > 0, got {mtbf!r}")
        return float(mtbf), "mtbf="
    text = os.environ.get(MTBF_ENV)
    if text is not None and text.strip():
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{MTBF_ENV} must be a number of seconds > 0, got {text!r}")
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
      buffer, the reverse of loading it: with S_F / W_r it gives R_F).

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
            replay_s_per_record=self._opt.value,
        )

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

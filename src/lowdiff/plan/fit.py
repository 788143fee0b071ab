"""Least-squares fits that turn measured write and read times into a bandwidth and a latency.

Both the cost model built from a ``lowdiff bench`` results file (:mod:`.inputs`) and the
auto mode's tuner (:mod:`.tuner`) measure seconds per write at a few sizes and need the
``W`` and ``L`` of ``seconds = L + bytes / W``.
"""

from __future__ import annotations

from lowdiff.errors import InvalidArgumentError

__all__ = ["fit_bandwidth", "fit_line"]


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
        raise InvalidArgumentError("cannot fit a bandwidth: every measured time is 0")
    return sum(nbytes) / total_s, 0.0

"""Formatting shared by the bench's report sections (and by ``lowdiff chaos``'s report).

Times, signed percentages and Markdown tables, plus :func:`rows_of`, the selection of one
experiment's rows every section and plot starts from.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def fmt_s(x: float | None) -> str:
    """Seconds in the unit that suits them (s, ms or µs); ``"n/a"`` for None or NaN.

    Example:
        >>> fmt_s(0.0123), fmt_s(2.5), fmt_s(None)
        ('12.3 ms', '2.50 s', 'n/a')
    """
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if x >= 1:
        return f"{x:.2f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.1f} ms"
    return f"{x * 1e6:.0f} µs"


def fmt_pct(x: float | None) -> str:
    """A fraction as a signed percentage (``0.05`` -> ``"+5.0%"``); ``"n/a"`` for None."""
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table of already formatted cells.

    Example:
        >>> print(table(["a", "b"], [["1", "2"]]))
        | a | b |
        | --- | --- |
        | 1 | 2 |
    """
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def rows_of(rows: list[dict[str, Any]], exp: str, **match: Any) -> list[dict[str, Any]]:
    """The rows of experiment ``exp`` whose fields equal every ``match`` (in their order)."""
    return [
        r for r in rows if r["experiment"] == exp and all(r.get(k) == v for k, v in match.items())
    ]

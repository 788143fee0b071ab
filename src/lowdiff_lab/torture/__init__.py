"""Fault injection for lowdiff: crash-point kills, corruption, storage faults, fuzzing.

``lowdiff torture`` (and :func:`run_torture`) runs every part and reports the figures;
the test suite runs a small sample of each. See ``docs/torture.md``.
"""

from __future__ import annotations

from lowdiff_lab.torture.report import TortureReport
from lowdiff_lab.torture.run import FULL, QUICK, Profile, run_torture

__all__ = ["FULL", "QUICK", "Profile", "TortureReport", "run_torture"]

"""``lowdiff demo``: kill a real training job mid-run, resume it, and prove the state exact.

- :mod:`.settings`: the profiles, the validated settings of a run, its kill step;
- :mod:`.children`: the training processes, followed through their events and killed;
- :mod:`.analysis`: the recovered state against the reference, sizes, overhead;
- :mod:`.run`: the four runs (see its docstring) and the report dict;
- :mod:`.report`: the report as a table.

Example:
    >>> from lowdiff_lab.demo import demo_settings, format_report, orchestrate
    >>> report = orchestrate(demo_settings(quick=True))  # doctest: +SKIP
    >>> print(format_report(report))  # doctest: +SKIP
"""

from __future__ import annotations

from lowdiff_lab.demo.analysis import compare_states
from lowdiff_lab.demo.report import format_report
from lowdiff_lab.demo.run import orchestrate
from lowdiff_lab.demo.settings import (
    COMPRESSORS,
    PROFILES,
    STRATEGIES,
    DemoError,
    DemoSettings,
    Profile,
    demo_settings,
    kill_target,
)

__all__ = [
    "COMPRESSORS",
    "PROFILES",
    "STRATEGIES",
    "DemoError",
    "DemoSettings",
    "Profile",
    "compare_states",
    "demo_settings",
    "format_report",
    "kill_target",
    "orchestrate",
]

"""Writing a bench run: JSON lines, a Markdown report in the paper's layout, PNG plots.

Files in the output folder:

- ``results.jsonl``: one JSON object per line: first ``{"kind": "run", ...}`` (machine,
  torch, git revision, settings), then one ``{"kind": "row", ...}`` per measurement.
- ``report.md``: the tables, one section per experiment (:data:`SECTIONS`).
- ``<experiment>.png``: one figure per experiment (:mod:`lowdiff_lab.bench.plots`).

The formatting helpers the sections share live in :mod:`lowdiff_lab.bench.tables`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lowdiff_lab.bench.exp_fsdp2 import section_fsdp2
from lowdiff_lab.bench.plots import plots
from lowdiff_lab.bench.report_fidelity import section_fidelity
from lowdiff_lab.bench.report_hotpaths import section_breakdown, section_hotpaths, section_replica
from lowdiff_lab.bench.report_timing import (
    section_batching,
    section_frequency,
    section_overhead,
    section_ratio,
    section_recovery,
    section_storage,
)

__all__ = ["SECTIONS", "markdown", "plots", "write"]

SECTIONS: dict[str, Callable[[list[dict[str, Any]]], str]] = {
    "overhead": section_overhead,
    "frequency": section_frequency,
    "recovery": section_recovery,
    "batching": section_batching,
    "storage": section_storage,
    "ratio": section_ratio,
    "breakdown": section_breakdown,
    "replica": section_replica,
    "hotpaths": section_hotpaths,
    "fidelity": section_fidelity,
    "fsdp2": section_fsdp2,
}
"""The report section of each experiment (empty when the run has no rows of it)."""


def markdown(run: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The whole ``report.md``: a header saying where and with what the run was measured,
    then the section of every experiment that ran, in the order they ran."""
    m = run["machine"]
    s = run["settings"]
    where = f"{m['processor']}, {m['cpus_usable']} usable CPUs, {m.get('memory_gib', '?')} GiB"
    if m.get("gpu"):
        where = f"{m['gpu']} (CUDA {m.get('cuda')}); host: {where}"
    head = [
        "# lowdiff bench report",
        "",
        f"- Machine: {where}; {m['platform']}",
        f"- torch {m['torch']}, lowdiff {m['lowdiff']}, git {m['git_revision']}, "
        f"{m['torch_threads']} torch threads",
        (
            f"- Workload: {s['workload']} ({run['n_params']:,} parameters), device {s['device']}, "
            f"at least {s['iters']} iterations per block (a multiple of every interval of the experiment), "
            f"{s['repeats']} timed blocks per method after a warm-up block, amp {s['amp']}, gradient accumulation {s['grad_accum']}"
            if run.get("n_params") is not None
            else f"- Workloads: each measurement names its own (the profile's); {s['repeats']} "
            f"repeats, device {s['device']}"
        ),
        f"- Profile: {'quick' if run['quick'] else 'full'}; experiments: {', '.join(run['experiments'])}; "
        f"took {run['wall_s']:.0f} s",
    ]
    env = m.get("env")
    if env:
        bg = run.get("background_env", {}).get("OMP_WAIT_POLICY")
        head.append(
            "- Environment of the training process: "
            + ", ".join(f"{k}={v if v is not None else 'unset'}" for k, v in env.items())
            + (f"; background processes: OMP_WAIT_POLICY={bg}" if bg else "")
        )
    head.append("")
    parts = [SECTIONS[e](rows) for e in run["experiments"] if e in SECTIONS]
    return "\n".join(head) + "\n" + "\n\n".join(p for p in parts if p) + "\n"


def write(out: Path, run: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Path]:
    """Write ``results.jsonl``, ``report.md`` and the plots into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.jsonl", "w") as f:
        f.write(json.dumps({"kind": "run", **run}, sort_keys=True) + "\n")
        for r in rows:
            f.write(json.dumps({"kind": "row", **r}, sort_keys=True) + "\n")
    (out / "report.md").write_text(markdown(run, rows))
    files = {"results": out / "results.jsonl", "report": out / "report.md"}
    for p in plots(out, rows, run["experiments"]):
        files[p.stem] = p
    return files

"""Moving files out of a shard's chain at resume: damaged files and files past the
recovered step go to ``DIR/quarantine/<time>-<run>/`` (never deleted)."""

from __future__ import annotations

import datetime as _dt
import shutil
import warnings
from pathlib import Path

from lowdiff.errors import RecoveryWarning
from lowdiff.format import layout
from lowdiff.recovery.replay import RecoveryStats


def quarantine_beyond(root: Path, stats: RecoveryStats, run_id: str) -> list[Path]:
    """Move files that are damaged or lie past the recovered step out of ``root``'s chain.

    Returns the new paths of the moved files.
    """
    s = stats.step
    move: list[Path] = [Path(p) for p, _ in stats.skipped]
    for p in (root / layout.FULL_DIR).glob("full-*.safetensors"):
        step = layout.parse_full_name(p.name)
        if step is not None and step > s:
            move.append(p)
    for p in (root / layout.RECORDS_DIR).glob("rec-*.safetensors"):
        r = layout.parse_records_name(p.name)
        if r is not None and r[1] >= s:
            move.append(p)
    move = [p for p in dict.fromkeys(move) if p.exists()]
    if not move:
        return []
    dest = (
        root / layout.QUARANTINE_DIR / (_dt.datetime.now().strftime("%Y%m%d-%H%M%S-") + run_id[:8])
    )
    dest.mkdir(parents=True, exist_ok=True)
    moved = []
    for p in move:
        target = dest / f"{p.parent.name}--{p.name}"
        shutil.move(str(p), target)
        moved.append(target)
    warnings.warn(
        f"lowdiff: moved {len(move)} file(s) that are damaged or past the recovered step {s} to {dest}",
        RecoveryWarning,
        stacklevel=4,
    )
    return moved

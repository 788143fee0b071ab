"""The figures a torture run produces, and their text and JSON forms."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TortureReport:
    """Counters of one torture run (or of a test session); every part adds to it."""

    kills: int = 0
    """SIGKILLs that hit a trainer, a checkpointing process or both."""
    kills_by_target: Counter[str] = field(default_factory=Counter)
    kills_by_point: Counter[str] = field(default_factory=Counter)
    kills_by_strategy: Counter[str] = field(default_factory=Counter)
    """Kills per strategy driven: ``lowdiff``, ``lowdiff+``."""
    recoveries: int = 0
    """Recoveries after a kill that were checked (resume, then compare)."""
    recoveries_ok: int = 0
    recoveries_by_source: Counter[str] = field(default_factory=Counter)
    """Recoveries per strategy and source: ``lowdiff disk``, ``lowdiff+ memory``, ``lowdiff+
    disk``, ``... fresh`` (an empty directory), ``... failed``."""
    wrong_states: int = 0
    """Recovered states that differ from the uninterrupted reference (target: 0)."""
    wrong_states_by_strategy: Counter[str] = field(default_factory=Counter)
    lost_acknowledged: int = 0
    """Recoveries that ended before the newest step acknowledged as durable (target: 0)."""
    lost_acknowledged_steps: int = 0
    """Acknowledged steps those recoveries lost, summed (filled by the DDP kill series)."""
    lost_handed_off: int = 0
    """Recoveries after a trainer-only kill that lost steps the trainer had handed off."""
    adoptions: int = 0
    """LowDiff+ recoveries that took over the replica process left by the killed trainer."""
    refused_survivors: int = 0
    """Sessions of another job (another ``keep_full``) that found a survivor: refused,
    it persisted and exited, and the session started its own process."""
    leaked: int = 0
    """Processes or shared-memory segments left behind at the end (target: 0)."""
    margin_min: int | None = None
    """Smallest recovered step minus acknowledged durable step."""
    margin_max: int | None = None

    corruptions: int = 0
    corruptions_by_file: Counter[str] = field(default_factory=Counter)
    corruptions_detected: int = 0
    """Damaged files that ``verify`` named (target: every one)."""
    corruptions_undetected: int = 0
    damaged_loads: int = 0
    """Recoveries that returned a state other than the reference after damage (target: 0)."""
    fallbacks: int = 0
    """Recoveries that fell back past a damaged file, with a RecoveryWarning naming it."""
    fallback_not_newest: int = 0
    """Fallbacks that stopped before the newest intact step (target: 0)."""

    storage_faults: int = 0
    storage_faults_surfaced: int = 0
    """Faults that reached the trainer as an exception or a DurabilityWarning."""
    partial_files_visible: int = 0
    """Temp or unverifiable files left visible after a storage fault (target: 0)."""

    fuzz_inputs: int = 0
    fuzz_clean_errors: int = 0
    fuzz_valid_parses: int = 0
    fuzz_crashes: int = 0
    """Inputs that raised something other than a clean error (target: 0)."""

    failures: list[str] = field(default_factory=list)
    """One line for each broken promise or harness error."""
    wall_s: float = 0.0

    def margin(self, recovered: int, acknowledged: int) -> None:
        m = recovered - acknowledged
        self.margin_min = m if self.margin_min is None else min(self.margin_min, m)
        self.margin_max = m if self.margin_max is None else max(self.margin_max, m)

    def fail(self, line: str) -> None:
        self.failures.append(line)

    @property
    def ok(self) -> bool:
        return not self.failures and not (
            self.wrong_states
            or self.lost_acknowledged
            or self.lost_handed_off
            or self.corruptions_undetected
            or self.damaged_loads
            or self.fallback_not_newest
            or self.partial_files_visible
            or self.fuzz_crashes
            or self.storage_faults != self.storage_faults_surfaced
            or self.recoveries != self.recoveries_ok
            or self.leaked
        )

    def merge(self, other: TortureReport) -> None:
        """Add ``other``'s counters to this report."""
        for name, value in vars(other).items():
            mine = getattr(self, name)
            if name in ("margin_min", "margin_max"):
                if value is not None:
                    pick = min if name == "margin_min" else max
                    setattr(self, name, value if mine is None else pick(mine, value))
            elif isinstance(value, (Counter, list)):
                mine += value
            elif isinstance(value, (int, float)):
                setattr(self, name, mine + value)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, value in vars(self).items():
            out[name] = dict(value) if isinstance(value, Counter) else value
        out["ok"] = self.ok
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TortureReport:
        """The report :meth:`to_json` wrote (its derived ``ok`` is recomputed, not read)."""
        out = cls()
        for name, value in vars(out).items():
            if name in data:
                got = data[name]
                setattr(out, name, Counter(got) if isinstance(value, Counter) else got)
        return out

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=True)

    def format_text(self) -> str:
        """The summary: kills and recoveries, steps, corruptions, storage faults, fuzzing."""
        margin = (
            "n/a"
            if self.margin_min is None
            else f"min {self.margin_min:+d}, max {self.margin_max:+d}"
        )
        by_strategy: list[str] = []
        for strategy in sorted(
            set(self.kills_by_strategy) | {k.split(" ", 1)[0] for k in self.recoveries_by_source}
        ):
            sources = sorted(
                (k.split(" ", 1)[1], v)
                for k, v in self.recoveries_by_source.items()
                if k.split(" ", 1)[0] == strategy
            )
            by_strategy.append(
                f"  {strategy:<22} kills {self.kills_by_strategy[strategy]}"
                f"   recoveries {sum(v for _, v in sources)}"
                + (f" ({', '.join(f'{k} {v}' for k, v in sources)})" if sources else "")
                + f"   wrong states {self.wrong_states_by_strategy[strategy]}"
            )
        lines = [
            f"kills performed          {self.kills}"
            + (
                f"  ({', '.join(f'{k} {v}' for k, v in sorted(self.kills_by_target.items()))})"
                if self.kills_by_target
                else ""
            ),
            f"recoveries succeeded     {self.recoveries_ok} / {self.recoveries}"
            f"   wrong states {self.wrong_states}",
            *by_strategy,
            f"recovered - acknowledged {margin}   acknowledged steps lost {self.lost_acknowledged}"
            + (f" ({self.lost_acknowledged_steps} steps)" if self.lost_acknowledged_steps else "")
            + f", handed-off steps lost {self.lost_handed_off}",
            f"processes taken over     {self.adoptions}   of another job refused"
            f" {self.refused_survivors}   left behind at the end {self.leaked}",
            f"corruptions injected     {self.corruptions}   detected {self.corruptions_detected}"
            f"   undetected {self.corruptions_undetected}   damaged data loaded {self.damaged_loads}"
            f"   fallbacks {self.fallbacks} (not to the newest intact step: {self.fallback_not_newest})",
            f"storage faults injected  {self.storage_faults}   surfaced {self.storage_faults_surfaced}"
            f"   partial files visible {self.partial_files_visible}",
            f"inputs fuzzed            {self.fuzz_inputs}   clean errors {self.fuzz_clean_errors}"
            f"   valid parses {self.fuzz_valid_parses}   crashes {self.fuzz_crashes}",
        ]
        if self.kills_by_point:
            lines.append(
                "kill points              "
                + ", ".join(f"{k} {v}" for k, v in sorted(self.kills_by_point.items()))
            )
        if self.wall_s:
            lines.append(f"wall time                {self.wall_s:.0f} s")
        lines.append(f"result                   {'OK' if self.ok else 'FAILED'}")
        for f in self.failures[:20]:
            lines.append(f"  failure: {f}")
        if len(self.failures) > 20:
            lines.append(f"  ... {len(self.failures) - 20} more failures")
        return "\n".join(lines)

"""The demo's report: an aligned two-column table of what the runs showed."""

from __future__ import annotations

import json
from typing import Any

from lowdiff_lab.harness import fmt_bytes


def _fmt(x: float | None, spec: str = ".4f", suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


def lowdiff_rows(
    sg: dict[str, Any], rc: dict[str, Any], wc: dict[str, Any]
) -> list[tuple[str, str]]:
    """Report rows of a LowDiff demo: record and full sizes, recovery time (this run's and
    the worst case the retained files allow)."""
    return [
        (
            "bytes per record",
            f"{fmt_bytes(sg['bytes_per_record'])}  ({sg['records']} records in {sg['record_files']} files)",
        ),
        (
            "bytes per full checkpoint",
            f"{fmt_bytes(sg['bytes_per_full'])}  ({_fmt(sg['full_over_record'], '.0f', 'x')} a record)",
        ),
        (
            "record bytes per parameter",
            f"{_fmt(sg['record_bytes_per_param'])}  (8*ratio = {_fmt(sg['expected_bytes_per_param'])})",
        ),
        (
            "recovery time",
            f"{_fmt(rc.get('total_s'), '.3f', ' s')}: read {_fmt(rc.get('read_s'), '.3f', ' s')}, "
            f"decode {_fmt(rc.get('decode_s'), '.3f', ' s')}, replay {_fmt(rc.get('replay_s'), '.3f', ' s')} "
            f"({rc.get('records_replayed', 'n/a')} record(s) replayed on the full checkpoint of "
            f"step {rc.get('full_step', 'n/a')})",
        ),
        (
            "recovery time, worst case",
            f"{_fmt(wc.get('total_s'), '.3f', ' s')}: read {_fmt(wc.get('read_s'), '.3f', ' s')}, "
            f"decode {_fmt(wc.get('decode_s'), '.3f', ' s')}, replay {_fmt(wc.get('replay_s'), '.3f', ' s')} "
            f"({wc.get('records_replayed', 'n/a')} record(s) replayed on the full checkpoint of "
            f"step {wc.get('full_step', 'n/a')}, to step {wc.get('step', 'n/a')})",
        ),
    ]


def plus_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """Report rows of a LowDiff+ demo: memory against disk recovery, trainer waiting."""
    sg, mem, disk = r["storage"], r["recovery"] or {}, r.get("recovery_worst_case") or {}
    ts = r.get("trainer_stats") or {}
    steps = max(1, int(ts.get("steps", 0) or 0))
    ratio = (
        disk.get("total_s") / mem["total_s"] if mem.get("total_s") and disk.get("total_s") else None
    )
    return [
        (
            "bytes per full checkpoint",
            f"{fmt_bytes(sg['bytes_per_full'])}  ({sg['full_checkpoints']} persisted replicas kept)",
        ),
        (
            "recovery from memory",
            f"{_fmt(mem.get('total_s'), '.4f', ' s')}  (source: {mem.get('source', 'n/a')}, "
            f"{mem.get('files_read', 'n/a')} files read, step {mem.get('step', 'n/a')})",
        ),
        (
            "recovery from disk",
            f"{_fmt(disk.get('total_s'), '.4f', ' s')}: read {_fmt(disk.get('read_s'), '.4f', ' s')}, "
            f"load {_fmt((disk.get('decode_s') or 0) + (disk.get('replay_s') or 0), '.4f', ' s')} "
            f"(full checkpoint of step {disk.get('step', 'n/a')}; {_fmt(ratio, '.1f', 'x')} the memory recovery)",
        ),
        (
            "trainer wait per step",
            f"{_fmt(_ms((ts.get('lag_wait_s') or 0) / steps), '.2f', ' ms')} for a free snapshot slot (bounded lag), "
            f"{_fmt(_ms((ts.get('snapshot_finish_s') or 0) / steps), '.2f', ' ms')} finishing snapshots, "
            f"{_fmt(_ms((ts.get('record_send_s') or 0) / steps), '.2f', ' ms')} handing the step over",
        ),
    ]


def format_report(r: dict[str, Any]) -> str:
    """Render the report dict as an aligned two-column table."""
    m, k, st, ls, sg, rc, ov, mc = (
        r["model"],
        r["kill"],
        r["state_check"],
        r["loss"],
        r["storage"],
        r["recovery"] or {},
        r["overhead"],
        r["machine"],
    )
    wc = r.get("recovery_worst_case") or {}
    mismatch = st["mismatched_keys"] + st["only_in_recovered"] + st["only_in_reference"]
    rows: list[tuple[str, str]] = [
        ("model", f"{m['name']} ({m['n_params']:,} parameters)"),
        ("compressor", json.dumps(r["compressor"])),
        (
            "steps",
            f"{r['steps']}  (full every {r['full_every']}, {r['batch_size']} records per write)"
            if r["strategy"] != "lowdiff+"
            else f"{r['steps']}  (replica persisted at the Young–Daly interval of its MTBF, lag at most 2 steps)",
        ),
        (
            "kill step (SIGKILL sent)",
            f"{k['kill_step']}  (target {k['target_step']}, durable then {k['durable_at_kill']})",
        ),
        ("recovered step", f"{k['recovered_step']}"),
        (
            "state at recovered step",
            f"bit-identical: {'yes' if st['bit_identical'] else 'no'}  ({st['n_keys']} tensors)",
        ),
    ]
    if mismatch:
        shown = ", ".join(mismatch[:12]) + (" ..." if len(mismatch) > 12 else "")
        rows.append(("  mismatching keys", f"{len(mismatch)}: {shown}"))
    rows += [
        (
            "final loss, recovered / reference",
            f"{_fmt(ls['recovered_final'])} / {_fmt(ls['reference_final'])}  (mean of last 10 steps)",
        ),
        (
            "held-out loss, recovered / reference",
            f"{_fmt(ls['recovered_eval'])} / {_fmt(ls['reference_eval'])}",
        ),
        *(plus_rows(r) if r["strategy"] == "lowdiff+" else lowdiff_rows(sg, rc, wc)),
        (
            "overhead vs reference, median step",
            f"{_fmt(ov.get('median_overhead_pct'), '+.1f', ' %')}  ({_fmt(_ms(ov.get('median_step_s_lowdiff')), '.1f', ' ms')} vs "
            f"{_fmt(_ms(ov.get('median_step_s_none')), '.1f', ' ms')})",
        ),
        (
            "overhead vs reference, total",
            f"{_fmt(ov.get('total_overhead_pct'), '+.1f', ' %')}  ({_fmt(ov.get('total_s_lowdiff'), '.1f', ' s')} vs "
            f"{_fmt(ov.get('total_s_none'), '.1f', ' s')} over {ov.get('steps_timed')} steps, "
            f"first {ov.get('warmup_steps_skipped')} skipped)",
        ),
        (
            "machine",
            f"{mc['cpu_count']} CPUs ({mc['cpus_usable']} usable), {mc['threads_per_run']} threads/run, torch {mc['torch']}",
        ),
        ("output directory", str(r["out_dir"])),
        ("demo wall time", f"{r['wall_s']:.1f} s"),
    ]
    width = max(len(a) for a, _ in rows)
    title = "lowdiff demo: kill, resume, compare"
    lines = [title, "=" * len(title)]
    lines += [f"{a.ljust(width)}  {b}" for a, b in rows]
    return "\n".join(lines)


def _ms(x: float | None) -> float | None:
    return None if x is None else 1000.0 * x


__all__ = ["format_report", "lowdiff_rows", "plus_rows"]

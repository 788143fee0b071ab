"""Report sections of the timing, recovery and storage experiments of ``lowdiff bench``.

One Markdown section per experiment: ``overhead`` (Exp. 1/2), ``frequency`` (Exp. 4),
``recovery`` (Exp. 5), ``batching`` (Exp. 7), ``storage`` (Exp. 9) and ``ratio``
(Exp. 10). Each is empty when the run has no rows of its experiment.
"""

from __future__ import annotations

from typing import Any

from lowdiff_lab.bench.tables import fmt_pct, fmt_s, rows_of, table
from lowdiff_lab.harness import fmt_bytes


def _cell_interval(x: Any) -> str:
    """An interval in a table cell (a dash when there is none)."""
    return "–" if x is None else str(x)


def section_overhead(rows: list[dict[str, Any]]) -> str:
    """Exp. 1/2: time per iteration and overhead of every method, per setting and
    durable interval, after a summary across intervals."""
    out = [
        "## Overhead (Exp. 1/2) at equal durability",
        "",
        "Every method of one durable interval k trains interleaved in one run. Durable "
        "every: steps between two points at which the whole state is on disk. Trainer "
        "crash: steps between two points that survive a crash of the training process "
        "alone (1: every step is handed to a process that outlives it). Time per iteration: "
        "median over timed blocks of (the block's iterations + its final `ck.flush()`) / "
        "iterations, so each method pays for all of its I/O (min–max in brackets); drain: "
        "the median `ck.flush()` at the end of a block. Overhead: ratio of medians to the run "
        "without checkpointing in the same run; best block: ratio of the fastest blocks (other "
        "load on a shared machine only adds time, so this is the least disturbed estimate).",
    ]
    for setting, title in (
        ("compressed", "With gradient compression (Exp. 1)"),
        ("uncompressed", "Without gradient compression (Exp. 2)"),
    ):
        rs = rows_of(rows, "overhead", setting=setting)
        if not rs:
            continue
        out += ["", f"### {title}"]
        summary = _overhead_summary(rs)
        if summary:
            out += ["", summary]
        for k in dict.fromkeys(r.get("interval", 1) for r in rs):
            block = [r for r in rs if r.get("interval", 1) == k]
            n = block[0].get("block_iters")
            out += ["", f"#### Durable interval k = {k}" + (f" (blocks of {n})" if n else ""), ""]
            out.append(
                table(
                    [
                        "method",
                        "durable every",
                        "trainer crash",
                        "time / iteration",
                        "overhead",
                        "best block",
                        "drain / block",
                        "stall / step",
                        "written / step",
                    ],
                    [
                        [
                            r["method"],
                            _cell_interval(r.get("durable_every")),
                            _cell_interval(r.get("arm_memory_every")),
                            f"{fmt_s(r['median_s'])} ({fmt_s(r['min_s'])}–{fmt_s(r['max_s'])})",
                            "–" if r["method"].startswith("W/O") else fmt_pct(r["overhead"]),
                            "–"
                            if r["method"].startswith("W/O")
                            else fmt_pct(r.get("overhead_best")),
                            fmt_s(r.get("drain_s")) if r.get("arm_strategy") else "–",
                            fmt_s(r.get("stall_s_per_step"))
                            if r.get("stall_s_per_step") is not None
                            else "–",
                            fmt_bytes(r.get("bytes_written_per_step"))
                            if r.get("bytes_written_per_step") is not None
                            else "–",
                        ]
                        for r in block
                    ],
                )
            )
    return "\n".join(out)


def _overhead_summary(rs: list[dict[str, Any]]) -> str:
    """Overhead of every method (rows) at every durable interval (columns)."""
    ks = list(dict.fromkeys(r.get("interval", 1) for r in rs))
    if len(ks) < 2:
        return ""
    methods = [
        m
        for m in dict.fromkeys(r["method"] for r in rs)
        if not m.startswith("W/O")
        and all(r.get("arm_full_every") != "auto" for r in rs if r["method"] == m)
    ]
    body = []
    for m in methods:
        cells = []
        for k in ks:
            hit = [r for r in rs if r["method"] == m and r.get("interval", 1) == k]
            cells.append(
                f"{fmt_pct(hit[0]['overhead'])} ({fmt_pct(hit[0].get('overhead_best'))})"
                if hit
                else "–"
            )
        body.append([m, *cells])
    return (
        "Overhead against the same training without checkpoints, by durable interval "
        "(ratio of medians; in brackets, of the fastest blocks):\n\n"
        + table(["method", *[f"k = {k}" for k in ks]], body)
    )


def section_frequency(rows: list[dict[str, Any]]) -> str:
    """Exp. 4: the smallest durable interval within the bound, per method."""
    summary = [r for r in rows_of(rows, "frequency") if r.get("summary")]
    if not summary:
        return ""
    tried = [r for r in rows_of(rows, "frequency") if not r.get("summary")]
    bound = summary[0]["bound"]
    body = []
    for s in summary:
        per = sorted((r for r in tried if r["method"] == s["method"]), key=lambda r: r["interval"])
        body.append(
            [
                s["method"],
                str(s["min_interval"])
                if s["min_interval"] is not None
                else f"> {s['largest_interval_tried']}",
                ", ".join(
                    f"{r['interval']}: {fmt_pct(r['overhead'])}"
                    + (f" ({fmt_pct(r['overhead_best'])})" if "overhead_best" in r else "")
                    for r in per
                ),
            ]
        )
    return "\n".join(
        [
            "## Checkpoint frequency (Exp. 4)",
            "",
            f"Smallest durable interval k (iterations) whose slowdown is at most {100 * bound:.1f}%, "
            "from the overhead runs (compressed training; LowDiff+ uncompressed), by the ratio of "
            "medians (in brackets: of the fastest blocks). LowDiff's k is "
            "its record batch b, LowDiff+'s and Gemini's their persistence interval; all three "
            "also hand every step to a process that survives a trainer crash.",
            "",
            table(["method", "min interval", "overhead per interval tried"], body),
        ]
    )


def _restarts(rows: list[dict[str, Any]]) -> str:
    """How many restarts the rows sum up ("1" for results written before they had several)."""
    counts = sorted({int(r.get("restarts", 1)) for r in rows})
    return "/".join(map(str, counts)) or "1"


def _memcpy_line(rows: list[dict[str, Any]]) -> str:
    """The memcpy of the whole state each f's restarts measured (the floor of a recovery
    from memory), next to LowDiff+ (S)'s ``resume()``."""
    parts = []
    for r in rows:
        if r.get("source") == "memory" and r.get("memcpy_s") is not None:
            parts.append(
                f"{r['method']} at f = {r['full_every']}: resume() {fmt_s(r['resume_s'])}, "
                f"a memcpy of the whole state {fmt_s(r['memcpy_s'])}"
            )
    return ("In the same run: " + "; ".join(parts) + ".") if parts else ""


def _ratio_line(rows: list[dict[str, Any]]) -> str:
    """Each method's restart to the first new step as a ratio of torch.save's at the
    same f, in the same run."""
    base = {
        r["full_every"]: r.get("first_new_step_s")
        for r in rows
        if r["method"] == "torch.save" and r.get("first_new_step_s")
    }
    parts = []
    for f, ref in base.items():
        ratios = [
            f"{r['method']} {r['first_new_step_s'] / ref:.2f}×"
            for r in rows
            if r["full_every"] == f and r["method"] != "torch.save" and r.get("first_new_step_s")
        ]
        parts.append(f"f = {f}: " + ", ".join(ratios))
    if not parts:
        return ""
    return (
        "Restart to the first new step against torch.save's at the same f: "
        + "; ".join(parts)
        + "."
    )


def section_recovery(rows: list[dict[str, Any]]) -> str:
    """Exp. 5: each method's recovery costs and restart wall times."""
    rs = rows_of(rows, "recovery")
    if not rs:
        return ""
    body = [
        [
            r["method"],
            str(r["full_every"]),
            f"{r['recovered_step']} / {r['failure_step']}",
            fmt_s(r["read_s"]),
            fmt_s(r["decompress_s"]),
            fmt_s(r["reconstruct_s"]),
            fmt_s(r.get("resume_s")),
            fmt_s(r.get("first_step_s")),
            f"{r['retrained_steps']}: {fmt_s(r['retrain_s'])}" if r["retrained_steps"] else "–",
            fmt_s(r.get("first_new_step_s")),
            str(r["source"]),
        ]
        for r in rs
    ]
    return "\n".join(
        [
            "## Recovery (Exp. 5)",
            "",
            "A failure just before the next full checkpoint (step 2f−1); every method "
            "checkpoints every f steps (LowDiff: a full checkpoint every f, records in between; "
            "Gemini: in memory every step, on disk every f). Read, decompress, reconstruct: the "
            "strategy's own recovery stats. The wall times are the same for every method, "
            "counted from just before the restarted job builds its Checkpointer: resume() "
            "(including starting the strategy's background process), the end of the first "
            "training step after the restart, and the end of the first new step (the lost steps "
            "retrained, then step 2f). (S): the trainer is SIGKILLed and its background process outlives "
            "it; Gemini and LowDiff+ recover from that process's memory, LowDiff from disk, and "
            "LowDiff and LowDiff+ then take the process over instead of starting one. Each row is "
            f"the median of {_restarts(rs)} restart(s).",
            "",
            table(
                [
                    "method",
                    "f",
                    "recovered / failed at",
                    "read",
                    "decompress",
                    "reconstruct",
                    "resume()",
                    "to first step",
                    "retrained",
                    "to first new step",
                    "source",
                ],
                body,
            ),
            "",
            _ratio_line(rs),
            "",
            _memcpy_line(rs),
        ]
    )


def section_batching(rows: list[dict[str, Any]]) -> str:
    """Exp. 7: LowDiff's write time per record, and the memory a batch holds."""
    rs = rows_of(rows, "batching")
    if not rs:
        return ""
    body = [
        [
            str(r["batch_size"]),
            fmt_s(r["write_s_per_record"]),
            fmt_s(r["write_s_per_write"]),
            fmt_bytes(r["record_row_bytes"]),
            fmt_bytes(r["batch_bytes_held_by_checkpointing_process"]),
            fmt_bytes(r.get("accelerator_peak_bytes")) if "accelerator_peak_bytes" in r else "–",
        ]
        for r in rs
    ]
    return "\n".join(
        [
            "## Batched writes (Exp. 7)",
            "",
            "LowDiff's write time per record against the batch size b. The batch is assembled in "
            "host memory by the checkpointing process (offloaded batching): the accelerator holds "
            "no batch, so its peak memory does not grow with b.",
            "",
            table(
                [
                    "b",
                    "write / record",
                    "write / batch",
                    "record",
                    "batch in host memory",
                    "accelerator peak",
                ],
                body,
            ),
        ]
    )


def section_storage(rows: list[dict[str, Any]]) -> str:
    """Exp. 9: bytes per checkpoint, written per step and left on disk."""
    rs = rows_of(rows, "storage")
    if not rs:
        return ""
    body = [
        [
            f"{r['method']} ({r['setting']})",
            fmt_bytes(r.get("full_checkpoint_bytes")),
            fmt_bytes(r.get("differential_bytes")),
            fmt_bytes(r["bytes_written_per_step"]),
            fmt_bytes(r.get("disk_bytes")),
        ]
        for r in rs
    ]
    return "\n".join(
        [
            "## Storage (Exp. 9)",
            "",
            "Bytes of one full checkpoint during training (the newest on disk after step 0, with "
            "the optimizer state; step 0's has none), of one differential checkpoint, written "
            "per training step, and left on disk at the end of the overhead run at the smallest "
            "durable interval (after retention).",
            "",
            table(["method", "full checkpoint", "differential", "written / step", "on disk"], body),
        ]
    )


def section_ratio(rows: list[dict[str, Any]]) -> str:
    """Exp. 10: LowDiff's overhead and record against the top-k ratio."""
    rs = rows_of(rows, "ratio")
    if not rs:
        return ""
    body = [
        [
            f"{r['ratio']:g}",
            fmt_s(r["reference_median_s"]),
            fmt_s(r["lowdiff_median_s"]),
            fmt_pct(r["overhead"]),
            fmt_bytes(r["record_bytes"]),
            fmt_s(r["record_write_s"]),
        ]
        for r in rs
    ]
    return "\n".join(
        [
            "## Compression ratio (Exp. 10)",
            "",
            table(
                [
                    "ρ",
                    "W/O CKPT / iteration",
                    "LowDiff / iteration",
                    "overhead",
                    "record",
                    "write / record",
                ],
                body,
            ),
        ]
    )

"""Writing a bench run: JSON lines, a Markdown report in the paper's layout, PNG plots.

Files in the output folder:

- ``results.jsonl``: one JSON object per line: first ``{"kind": "run", ...}`` (machine,
  torch, git revision, settings), then one ``{"kind": "row", ...}`` per measurement.
- ``report.md``: the tables, one section per experiment.
- ``<experiment>.png``: one figure per experiment (matplotlib, Agg backend).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lowdiff.bench.fidelity import plot_fidelity, section_fidelity
from lowdiff.cli.common import fmt_bytes


def fmt_s(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if x >= 1:
        return f"{x:.2f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.1f} ms"
    return f"{x * 1e6:.0f} µs"


def fmt_pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _of(rows: list[dict[str, Any]], exp: str, **match: Any) -> list[dict[str, Any]]:
    return [
        r for r in rows if r["experiment"] == exp and all(r.get(k) == v for k, v in match.items())
    ]


# --------------------------------------------------------------------------- sections


def _cell_interval(x: Any) -> str:
    return "–" if x is None else str(x)


def section_overhead(rows: list[dict[str, Any]]) -> str:
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
        rs = _of(rows, "overhead", setting=setting)
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
    summary = [r for r in _of(rows, "frequency") if r.get("summary")]
    if not summary:
        return ""
    tried = [r for r in _of(rows, "frequency") if not r.get("summary")]
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


def section_recovery(rows: list[dict[str, Any]]) -> str:
    rs = _of(rows, "recovery")
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
            "retrained, then step 2f). (S): the trainer is SIGKILLed and the new one recovers from the memory "
            "of the process that outlived it.",
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
        ]
    )


def section_batching(rows: list[dict[str, Any]]) -> str:
    rs = _of(rows, "batching")
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
    rs = _of(rows, "storage")
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
    rs = _of(rows, "ratio")
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


def section_breakdown(rows: list[dict[str, Any]]) -> str:
    per = _of(rows, "breakdown", table="per-method")
    plus = _of(rows, "breakdown", table="lowdiff+")
    if not per and not plus:
        return ""
    out = ["## Per-iteration breakdown", ""]
    if per:
        out += [
            "One training iteration and one checkpoint of each method (compressed training, the "
            "smallest durable interval). Compression: extra compression the checkpoint needs "
            "(LowDiff reuses the training's). Checkpoint: time to write one checkpoint (in the "
            "background for every method but torch.save). Stall: time the training waited per step.",
            "",
            table(
                [
                    "method",
                    "iteration",
                    "compression",
                    "checkpoint",
                    "stall / step",
                    "drain / block",
                ],
                [
                    [
                        r["method"],
                        fmt_s(r["iteration_s"]),
                        "0 (reuse)" if r["method"] == "LowDiff" else fmt_s(r["compression_s"]),
                        fmt_s(r["checkpoint_s"]),
                        fmt_s(r["stall_s_per_step"]),
                        fmt_s(r.get("drain_s")),
                    ]
                    for r in per
                ],
            ),
            "",
        ]
    if plus:
        out += [
            "LowDiff+ (uncompressed training): phases of one iteration on the training side, and "
            "the replica's CPU optimizer step in its own process.",
            "",
            table(
                ["component", *[r["method"] for r in plus]],
                [
                    ["forward + backward", *[fmt_s(r["forward_backward_s"]) for r in plus]],
                    ["update (+ hand-off)", *[fmt_s(r["update_s"]) for r in plus]],
                    [
                        "layer-wise snapshot (finish)",
                        *[
                            "–" if r["snapshot_finish_s"] is None else fmt_s(r["snapshot_finish_s"])
                            for r in plus
                        ],
                    ],
                    [
                        "CPU replica update (its process)",
                        *[
                            "–" if r["replica_update_s"] is None else fmt_s(r["replica_update_s"])
                            for r in plus
                        ],
                    ],
                    [
                        "waiting for the replica",
                        *[
                            "–" if r["replica_wait_s"] is None else fmt_s(r["replica_wait_s"])
                            for r in plus
                        ],
                    ],
                    ["iteration (median)", *[fmt_s(r["median_s"]) for r in plus]],
                ],
            ),
            "",
        ]
    out += trainer_tables(rows, "breakdown")
    return "\n".join(out)


_STAGE_NAMES = {
    "begin": "begin_step + before_update",
    "take_gradients": "take_gradients (all of it)",
    "compress": "of which compression (training's own)",
    "hparams": "hyperparameters",
    "update": "optimizer.step() (training's own)",
    "after_update": "after_update (record hand-over, full checkpoint copy)",
}


def trainer_tables(rows: list[dict[str, Any]], experiment: str) -> list[str]:
    """The trainer-side tables of :mod:`lowdiff.bench.hotpaths` (per stage, per part),
    one block per workload."""
    pre = "trainer-" if experiment == "breakdown" else ""
    stages = _of(rows, experiment, table=f"{pre}stage")
    out: list[str] = []
    for wl in dict.fromkeys(r["workload"] for r in stages):
        s0 = next(
            (
                r
                for r in _of(rows, experiment, table=f"{pre}summary", workload=wl)
                if r.get("name") == "trainer_overhead"
            ),
            None,
        )
        if s0 is not None:
            out += [
                f"LowDiff's own work on the training process (`{wl}`, "
                f"{s0['n_params'] / 1e6:.2f}M parameters, a record every step, "
                f"f={s0['full_every']}): **{fmt_s(s0['trainer_s_per_step'])} per step, "
                f"{s0['value'] * 100:.2f}% of a {fmt_s(s0['none_s_per_step'])} step** of the "
                f"same compressed training without checkpoints (target at most "
                f"{s0['target'] * 100:.0f}%). Per stage of the step pipeline, per step, "
                "medians of the blocks:",
                "",
            ]
        out += [
            table(
                ["stage", "compressed training, no checkpoint", "LowDiff"],
                [
                    [
                        _STAGE_NAMES.get(r["stage"], r["stage"]),
                        fmt_s(r["none_s_per_step"]),
                        fmt_s(r["lowdiff_s_per_step"]),
                    ]
                    for r in stages
                    if r["workload"] == wl
                ],
            ),
            "",
        ]
        parts = _of(rows, experiment, table=f"{pre}part", workload=wl)
        if parts:
            out += [
                table(
                    ["part of LowDiff's hand-over", "per step"],
                    [[r["what"], fmt_s(r["lowdiff_s_per_step"])] for r in parts],
                ),
                "",
            ]
    return out


def section_hotpaths(rows: list[dict[str, Any]]) -> str:
    targets = _of(rows, "hotpaths", table="target")
    if not targets:
        return ""

    def val(r: dict[str, Any]) -> str:
        v = r["value"]
        if r["unit"] == "x":
            return f"{v:.2f}x"
        if r["unit"] == "overhead":
            return f"{v * 100:+.1f}%"
        return f"{v * 100:.1f}%" if v >= 0.001 else f"{v * 100:.3f}%"

    def goal(r: dict[str, Any]) -> str:
        g = r["target"]
        if g is None:
            return "reported"
        shown = f"{g:.2f}x" if r["unit"] == "x" else f"{g * 100:.0f}%"
        return f"{r['compare']} {shown}"

    out = [
        "## Hot paths: each target beside its measurement",
        "",
        "Every figure is a ratio of two measurements taken side by side in this run "
        "(alternating blocks; medians). See `lowdiff.bench.hotpaths`, `lowdiff.bench.replica`, "
        "`lowdiff.bench.snapshot_bw` and `lowdiff.bench.wire` for what each one times.",
        "",
        table(
            ["#", "what", "measured", "target", "met", "detail"],
            [
                [
                    str(r["target_id"]),
                    r["name"],
                    val(r),
                    goal(r),
                    "yes" if r["met"] else "**no**",
                    r.get("detail", ""),
                ]
                for r in targets
            ],
        ),
        "",
    ]
    e2e = [r for r in _of(rows, "hotpaths", table="summary") if r["name"] == "end_to_end_overhead"]
    for r in e2e:
        out += [
            f"End to end, `{r['workload']}`: time per step of each block, LowDiff "
            f"{', '.join(f'{x * 1e3:.1f}' for x in r['blocks_lowdiff_s'])} ms; compressed "
            f"training without checkpoints {', '.join(f'{x * 1e3:.1f}' for x in r['blocks_none_s'])} ms; "
            "each repeat's pair, back to back: "
            f"{', '.join(f'{x * 100:+.1f}%' for x in r.get('paired_overheads', []))} "
            f"(median {r['value'] * 100:+.1f}%; ratio of the medians {r.get('ratio_of_medians', r['value']) * 100:+.1f}%).",
            "",
        ]
    out += trainer_tables(rows, "hotpaths")
    return "\n".join(out)


def section_replica(rows: list[dict[str, Any]]) -> str:
    got = _of(rows, "replica")
    if not got:
        return ""
    from lowdiff.bench.replica import format_rows

    return "\n".join(
        [
            "## LowDiff+ replica update",
            "",
            "The replica's update per step (in its process: the step's metadata decoded, the "
            "gradients of a snapshot slot bound, the optimizer step over `replica_threads` "
            "balanced shards of one thread each, buffers and RNG copied, the step published) "
            "against a bare `torch.optim` step of the same class and flags with as many torch "
            "threads, over the same parameters, gradients and state; blocks alternate, medians "
            "per step. Same bits: the replica and the bare optimizer hold identical tensors "
            "after the same steps.",
            "",
            format_rows(got),
            "",
        ]
    )


SECTIONS = {
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
}


def markdown(run: dict[str, Any], rows: list[dict[str, Any]]) -> str:
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


# --------------------------------------------------------------------------- plots


def plots(out: Path, rows: list[dict[str, Any]], experiments: list[str]) -> list[Path]:
    """One PNG per experiment that has rows; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    if "overhead" in experiments and _of(rows, "overhead"):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, setting in zip(axes, ("compressed", "uncompressed"), strict=True):
            rs = [
                r
                for r in _of(rows, "overhead", setting=setting)
                if not r["method"].startswith("W/O") and r.get("arm_full_every") != "auto"
            ]
            for method in dict.fromkeys(r["method"] for r in rs):
                pts = sorted(
                    (r.get("interval", 1), 100 * r["overhead"]) for r in rs if r["method"] == method
                )
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=method)
            ax.axhline(0, color="gray", linewidth=0.8)
            ax.set_xscale("log")
            ax.set_yscale("symlog", linthresh=10)
            ax.set_xlabel("durable interval k (steps)")
            ax.set_ylabel("overhead (%), drain included")
            ax.set_title(f"Exp. 1/2: {setting} training")
            ax.legend(fontsize=7)
        save(fig, "overhead")
    summ = [r for r in _of(rows, "frequency") if r.get("summary")]
    if "frequency" in experiments and summ:
        fig, ax = plt.subplots(figsize=(7, 4))
        top = summ[0]["largest_interval_tried"] * 2
        ax.bar(
            [r["method"] for r in summ],
            [r["min_interval"] or top for r in summ],
            color=["tab:blue" if r["min_interval"] else "tab:gray" for r in summ],
        )
        ax.set_yscale("log")
        ax.set_ylabel("min interval within 3.5% (iterations)")
        ax.set_title("Exp. 4: maximum checkpoint frequency (gray: none of the intervals tried)")
        ax.tick_params(axis="x", rotation=35)
        save(fig, "frequency")
    rec = _of(rows, "recovery")
    if "recovery" in experiments and rec:
        fig, ax = plt.subplots(figsize=(8, 4))
        for method in dict.fromkeys(r["method"] for r in rec):
            rs = [r for r in rec if r["method"] == method]
            ax.plot(
                [r["full_every"] for r in rs],
                [r["first_new_step_s"] for r in rs],
                marker="o",
                label=method,
            )
        ax.set_xlabel("checkpoint interval f")
        ax.set_ylabel("restart to the first new step (s)")
        ax.set_title("Exp. 5: recovery, resume() and lost work")
        ax.legend(fontsize=8)
        save(fig, "recovery")
    bat = _of(rows, "batching")
    if "batching" in experiments and bat:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(
            [r["batch_size"] for r in bat], [r["write_s_per_record"] * 1e3 for r in bat], marker="o"
        )
        ax.set_xlabel("batch size b")
        ax.set_ylabel("write time per record (ms)")
        ax.set_title("Exp. 7: batched writes")
        save(fig, "batching")
    sto = _of(rows, "storage")
    if "storage" in experiments and sto:
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.bar(
            [f"{r['method']}\n({r['setting'][:4]}.)" for r in sto],
            [r["bytes_written_per_step"] / 2**20 for r in sto],
            color="tab:orange",
        )
        ax.set_yscale("log")
        ax.set_ylabel("MiB written per step")
        ax.set_title("Exp. 9: storage")
        ax.tick_params(axis="x", labelsize=7)
        save(fig, "storage")
    rat = _of(rows, "ratio")
    if "ratio" in experiments and rat:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["ratio"] for r in rat], [100 * r["overhead"] for r in rat], marker="o")
        ax.axhline(3.5, color="gray", linestyle="--", linewidth=1)
        ax.set_xscale("log")
        ax.set_xlabel("compression ratio ρ")
        ax.set_ylabel("LowDiff overhead (%)")
        ax.set_title("Exp. 10: compression ratio")
        save(fig, "ratio")
    per = _of(rows, "breakdown", table="per-method")
    if "breakdown" in experiments and per:
        fig, ax = plt.subplots(figsize=(7, 4))
        names = [r["method"] for r in per]
        ax.bar(names, [r["compression_s"] * 1e3 for r in per], label="compression")
        ax.bar(
            names,
            [r["checkpoint_s"] * 1e3 for r in per],
            bottom=[r["compression_s"] * 1e3 for r in per],
            label="checkpoint write",
        )
        ax.axhline(per[0]["iteration_s"] * 1e3, color="gray", linestyle="--", label="one iteration")
        ax.set_yscale("symlog")
        ax.set_ylabel("ms")
        ax.set_title("Breakdown: one checkpoint per method")
        ax.legend(fontsize=8)
        ax.tick_params(axis="x", rotation=35)
        save(fig, "breakdown")
    if "fidelity" in experiments and (fp := plot_fidelity(out, rows)) is not None:
        written.append(fp)
    return written


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

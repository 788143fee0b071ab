"""Writing a chaos run: JSON lines, a Markdown report, PNG figures (as ``lowdiff bench`` does).

Files in the output folder:

- ``results.jsonl``: first ``{"kind": "run", ...}`` (machine, torch, git revision,
  settings, MTBFs and schedules), then one ``{"kind": "row", ...}`` per measurement
  (``experiment``: ``reference``, ``schedule``, ``wasted``, ``scale-gpus`` (a simulation,
  ``"simulation": true``), ``lowdiff-plan``, ``grid``, ``grid-summary``);
- ``report.md``: the tables;
- ``wasted.png`` (Exp. 3), ``effective_ratio.png`` (Exp. 11), ``scale_gpus.png``
  (Exp. 12, simulation), ``grid.png`` (Exp. 8).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from lowdiff_lab.bench.tables import fmt_s, table


def _of(rows: list[dict[str, Any]], exp: str) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("experiment") == exp]


def _rounds(ws: list[dict[str, Any]]) -> int:
    """How many rounds the ``wasted`` rows come from (``lowdiff chaos --rounds``)."""
    return len({r.get("round", 0) for r in ws})


def median_rows(ws: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One ``wasted`` row per (method, MTBF): the round at the median effective ratio (the
    lower of the two middle ones for an even count), in the order the rows came."""
    cells: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in ws:
        cells.setdefault((r["method"], r["mtbf_s"]), []).append(r)
    picked = []
    for rs in cells.values():
        mid = statistics.median_low(x["effective_ratio"] for x in rs)
        picked.append(next(x for x in rs if x["effective_ratio"] == mid))
    return picked


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _sec(x: float | None) -> str:
    # signed: a steady overhead below the noise of the reference comes out negative
    if x is None:
        return "n/a"
    return ("−" + fmt_s(-x)) if x < 0 else fmt_s(x)


def _fb(r: dict[str, Any]) -> str:
    if r["strategy"] == "lowdiff":
        f, b = r.get("full_every"), r.get("batch_size_records")
        if f == "auto":
            cf, cb = r.get("chosen_full_every"), r.get("chosen_batch_size")
            return f"auto (at the end: f={cf}, b={cb})" if cf else "auto"
        return f"f={f}, b={b}"
    if r["strategy"] == "lowdiff+":
        return "persist auto"
    if r["strategy"] == "gemini":
        return f"every step, persist {r['strategy_options'].get('persist_every')}"
    if r["strategy"] == "naive-dc":
        return f"full {r['full_every']}, diff every step"
    if r["strategy"] == "checkfreq" and r.get("full_every") == "auto":
        chosen = int((r.get("ck_stats") or {}).get("interval") or 0)
        return (
            f"auto (CheckFreq's own; at the end: {chosen})" if chosen else "auto (CheckFreq's own)"
        )
    if r.get("interval_policy") == "Young–Daly":
        return f"every {r['full_every']} (Young–Daly)"
    return f"every {r['full_every']}"


def section_wasted(rows: list[dict[str, Any]]) -> str:
    ws = _of(rows, "wasted")
    if not ws:
        return ""
    out = [
        "## Wasted time (Exp. 3)",
        "",
        "Wasted time = total − failure-free time without checkpointing (T_ff, the reference "
        "job of the same training: compressed, or uncompressed for LowDiff+). It splits into "
        "startup (the strategy's first `resume()`, beyond the reference's), steady-state "
        "overhead (the steps done for the first time, and the final `close()`, beyond T_ff), "
        "lost work (steps trained twice, and steps cut short) and recovery (restart of the "
        "process, then `resume()`; *restore* is the part the strategy's recovery stats time: "
        "reading, decompressing, replaying or copying out of memory). The effective training "
        "time ratio (Gemini's) is T_ff / total. (S): software failures (the training process "
        "is killed), (H): hardware failures (training and checkpointing processes and their "
        "shared memory are gone).",
    ]
    n_rounds = _rounds(ws)
    if n_rounds > 1:
        out += [
            "",
            f"Every method ran {n_rounds} rounds through each schedule (`--rounds`); each "
            "round's job is accounted against the reference jobs around its own block.",
        ]
    for m in sorted({r["mtbf_s"] for r in ws}, reverse=True):
        rs = [r for r in ws if r["mtbf_s"] == m]
        if n_rounds > 1:
            rs.sort(key=lambda r: r.get("round", 0))
        sched = rs[0]
        out += [
            "",
            f"### MTBF {m:g} s ({sched['failures']} failure(s), at steps "
            f"{', '.join(str(s) for s in sched['failed_at_steps']) or '–'})",
            "",
            table(
                [
                    "method" if n_rounds == 1 else "method (round)",
                    "checkpoints",
                    "failures",
                    "total",
                    "wasted",
                    "startup",
                    "steady overhead",
                    "lost work",
                    "recovery (restore)",
                    "recovered from",
                    "effective ratio",
                ],
                [
                    [
                        r["method"] if n_rounds == 1 else f"{r['method']} ({r['round'] + 1})",
                        _fb(r),
                        str(r["failures"]),
                        fmt_s(r["total_s"]),
                        _sec(r["wasted_s"]),
                        _sec(r["startup_overhead_s"]),
                        _sec(r["overhead_s"]),
                        f"{fmt_s(r['lost_work_s'])} ({r['steps_redone']} steps)",
                        f"{fmt_s(r['recovery_s'])} ({fmt_s(r['restore_s'])})",
                        ", ".join(
                            f"{src or '?'}@{st}"
                            for src, st in zip(
                                r["recovery_sources"], r["recovered_steps"], strict=False
                            )
                        )
                        or "–",
                        _pct(r["effective_ratio"]),
                    ]
                    for r in rs
                ],
            ),
        ]
    return "\n".join(out)


def section_ratio(rows: list[dict[str, Any]]) -> str:
    ws = _of(rows, "wasted")
    if not ws:
        return ""
    mtbfs = sorted({r["mtbf_s"] for r in ws}, reverse=True)
    methods = list(dict.fromkeys(r["method"] for r in ws))
    n_rounds = _rounds(ws)
    body = []
    for meth in methods:
        cells = []
        for m in mtbfs:
            rs = [x for x in ws if x["method"] == meth and x["mtbf_s"] == m]
            if not rs:
                cells.append("–")
                continue
            ratio = statistics.median(x["effective_ratio"] for x in rs)
            core = statistics.median(x["core_ratio"] for x in rs)
            spread = ""
            if len(rs) > 1:
                lo, hi = (f(x["effective_ratio"] for x in rs) for f in (min, max))
                spread = f" [{100 * lo:.1f}–{100 * hi:.1f}]"
            cells.append(f"{_pct(ratio)}{spread} ({_pct(core)})")
        body.append([meth, *cells])
    rounds_text = (
        f" Median over {n_rounds} rounds, in square brackets the lowest and the highest."
        if n_rounds > 1
        else ""
    )
    return "\n".join(
        [
            "## Effective training time ratio (Exp. 11)",
            "",
            "T_ff / total, per MTBF (seconds of failure-free training)." + rounds_text + " In "
            "brackets: the same without process start-ups (T_ff / (T_ff + steady overhead + "
            "lost work + restore)), the regime of failures hours apart, where start-ups are "
            "amortised.",
            "",
            table(["method", *[f"MTBF {m:g} s" for m in mtbfs]], body),
        ]
    )


def section_gpus(rows: list[dict[str, Any]]) -> str:
    sim = _of(rows, "scale-gpus")
    if not sim:
        return ""
    gpus = sorted({r["n_gpus"] for r in sim})
    methods = list(dict.fromkeys(r["method"] for r in sim))
    body = []
    for meth in methods:
        cells = []
        for n in gpus:
            r = next(x for x in sim if x["method"] == meth and x["n_gpus"] == n)
            cell = _pct(r["effective_ratio"])
            if r["measured_effective_ratio"] is not None:
                cell += f" (measured {_pct(r['measured_effective_ratio'])})"
            cells.append(cell)
        body.append([meth, *cells])
    r0 = sim[0]
    per = [
        [
            r["method"],
            _pct(r["steady_overhead_per_s"]),
            _sec(r["startup_overhead_s"]),
            fmt_s(r["cost_per_failure_s"]),
        ]
        for r in sim
        if r["n_gpus"] == gpus[0]
    ]
    return "\n".join(
        [
            "## More GPUs (Exp. 12): SIMULATION",
            "",
            "**This is a simulation, not a measurement**: more GPUs cannot be run here. Each "
            "method keeps its measured per-rank costs (steady overhead per second of training, "
            "startup, and the mean cost of one failure: lost work plus recovery, over all its "
            f"jobs above), while the system MTBF shrinks with the GPU count: M_N = "
            f"{r0['system_mtbf_s'] * gpus[0] / gpus[0]:g} s × {gpus[0]} / N (the largest MTBF "
            "measured stands for the smallest GPU count). A job of failure-free length T then "
            "takes T (1 + overhead) + startup + (T / M_N) × cost per failure. Where a system "
            "MTBF equals one that was measured, the measured ratio is shown next to it.",
            "",
            table(
                [
                    "method",
                    *[
                        f"{n} GPUs (M={next(x['system_mtbf_s'] for x in sim if x['n_gpus'] == n):.3g} s)"
                        for n in gpus
                    ],
                ],
                body,
            ),
            "",
            "Measured per-rank costs used:",
            "",
            table(["method", "steady overhead", "startup", "cost per failure"], per),
        ]
    )


def section_intervals(rows: list[dict[str, Any]]) -> str:
    ys = _of(rows, "baseline-interval")
    if not ys:
        return ""
    return "\n".join(
        [
            "## The baselines' intervals (Young–Daly)",
            "",
            "torch.save and DCP async checkpoint every `sqrt(2 C M) / tau` steps, with C the "
            "training time one checkpoint cost in a failure-free profiling job of each "
            "(its stall per checkpoint), M the MTBF and tau the step time of the reference. "
            'CheckFreq picks its own interval (`full_every="auto"`).',
            "",
            table(
                ["method", "C per checkpoint", "MTBF", "tau", "interval"],
                [
                    [
                        y["strategy"],
                        fmt_s(y["checkpoint_cost_s"]),
                        f"{y['mtbf_s']:g} s",
                        fmt_s(y["tau_s"]),
                        str(y["interval"]),
                    ]
                    for y in ys
                ],
            ),
        ]
    )


def section_plan(rows: list[dict[str, Any]]) -> str:
    ps = _of(rows, "lowdiff-plan")
    if not ps:
        return ""
    return "\n".join(
        [
            "## LowDiff's (f, b) from the model",
            "",
            "The Checkpointer's own tuner was not used: a profiling LowDiff job measured the "
            "costs, and `lowdiff.plan.optimize` picked (f*, b*) per MTBF.",
            "",
            table(
                ["MTBF", "f*", "b*", "predicted T_w"],
                [
                    [f"{p['mtbf_s']:g} s", str(p["f"]), str(p["b"]), fmt_s(p["wasted_s"])]
                    for p in ps
                ],
            ),
        ]
    )


def section_grid(rows: list[dict[str, Any]]) -> str:
    cells = _of(rows, "grid")
    summ = _of(rows, "grid-summary")
    if not cells or not summ:
        return ""
    s = summ[0]
    fs = sorted({c["f"] for c in cells})
    bs = sorted({c["b"] for c in cells})

    def grid_table(key: str) -> str:
        body = []
        for f in fs:
            line = [str(f)]
            for b in bs:
                c = next((x for x in cells if x["f"] == f and x["b"] == b), None)
                if c is None:
                    line.append("–")
                    continue
                v = _sec(c[key])
                if (f, b) == (s["f_star"], s["b_star"]):
                    v = f"**{v}**"
                line.append(v)
            body.append(line)
        return table(["f \\ b", *[str(b) for b in bs]], body)

    cm = s["cost_model"]
    return "\n".join(
        [
            "## LowDiff's (f, b) grid (Exp. 8)",
            "",
            f"LowDiff at every (f, b) of the grid under the same {s['failures']} failure(s) "
            f"(MTBF {s['mtbf_s']:g} s). The model is the paper's T_w(f, b) "
            "(`lowdiff.plan.wasted_time`) with the costs measured by these same jobs and the "
            f"failures they met (M = T_ff / failures = {s['model_mtbf_s']:.3g} s). Its pick "
            f"over the grid is **(f*, b*) = ({s['f_star']}, {s['b_star']})** (bold). The "
            "measured value comparable with the model is the *core* wasted time, without the "
            "process start-ups the model has no term for: steady overhead + lost work + restore.",
            "",
            f"- rank of (f*, b*) among the {s['cells']} measured cells: "
            f"**{s['rank_core']}** by the core wasted time "
            f"(best measured: {tuple(s['measured_best_core'])}), "
            f"**{s['rank_wasted']}** by the whole wasted time "
            f"(best measured: {tuple(s['measured_best_wasted'])})",
            f"- without the grid, the model's argmin is (f, b) = "
            f"({s['unconstrained_plan']['f']}, {s['unconstrained_plan']['b']}) at the nominal MTBF",
            f"- measured costs: τ = {fmt_s(cm['tau'])}, S_F = {cm['full_bytes'] / 1024:.0f} KiB, "
            f"record {cm['record_bytes'] / 1024:.1f} KiB, W = {cm['write_bw'] / 2**20:.0f} MiB/s, "
            f"L_B = {fmt_s(cm['batch_latency'])}, L_F = {fmt_s(cm['full_latency'])}, "
            f"W_r = {cm['read_bw'] / 2**20:.0f} MiB/s, R_F = {fmt_s(cm['full_recovery_s'])}, "
            f"decompress {fmt_s(cm['decompress_s_per_record'])} and replay "
            f"{fmt_s(cm['replay_s_per_record'])} per record",
            "",
            "Predicted by the model:",
            "",
            grid_table("model_wasted_s"),
            "",
            "Measured, core (steady overhead + lost work + restore):",
            "",
            grid_table("core_wasted_s"),
            "",
            "Measured, whole wasted time (with restarts and process start-ups):",
            "",
            grid_table("wasted_s"),
        ]
    )


def markdown(run: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    m = run["machine"]
    s = run["settings"]
    info = run["info"]
    where = f"{m['processor']}, {m['cpus_usable']} usable CPUs, {m.get('memory_gib', '?')} GiB"
    refs = _of(rows, "reference")
    ref_line = "; ".join(
        f"{setting} {fmt_s(info[f't_ff_{setting}_s'])} "
        f"(runs: {', '.join(fmt_s(r['total_s']) for r in refs if r['setting'] == setting)})"
        for setting in ("compressed", "uncompressed")
        if f"t_ff_{setting}_s" in info
    )
    cold = info.get("cold_start_s")
    head = [
        "# lowdiff chaos report",
        "",
        f"- Machine: {where}; {m['platform']}",
        f"- torch {m['torch']}, lowdiff {m['lowdiff']}, git {m['git_revision']}",
        f"- Workload: {s['model']}, {s['steps']} steps of batch {s['batch_size']} × "
        f"{s['seq_len']}, {s['threads']} torch thread(s) per training process, top-k ratio "
        f"{s['ratio']} (error feedback {'on' if s['error_feedback'] else 'off'}); step time "
        f"τ = {fmt_s(info['tau_s'])}",
        f"- Failure-free time without checkpointing T_ff (median of the reference jobs): {ref_line}",
        f"- Failures: seed {s['seed']}, measured in training progress (the same steps for "
        "every method; see docs/chaos.md)",
        f"- Launcher: {info['launcher']}"
        + (
            f" (processes forked from a warm server; a cold interpreter start would add "
            f"{fmt_s(cold)} of imports to every restart, the same for every method, not included)"
            if info["launcher"] == "fork" and cold
            else " (a fresh interpreter per process)"
        ),
        f"- Profile: {'quick' if s['quick'] else 'full'}; {run['jobs']} jobs; took "
        f"{run['wall_s']:.0f} s",
        "",
    ]
    parts = [
        section_wasted(rows),
        section_ratio(rows),
        section_gpus(rows),
        section_intervals(rows),
        section_plan(rows),
        section_grid(rows),
    ]
    return "\n".join(head) + "\n" + "\n\n".join(p for p in parts if p) + "\n"


def plots(out: Path, rows: list[dict[str, Any]]) -> list[Path]:
    """The figures that have rows; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = {
        "wasted": _plot_wasted(plt, _of(rows, "wasted")),
        "effective_ratio": _plot_ratio(plt, _of(rows, "wasted")),
        "scale_gpus": _plot_gpus(plt, _of(rows, "scale-gpus")),
        "grid": _plot_grid(plt, _of(rows, "grid"), _of(rows, "grid-summary")),
    }
    written: list[Path] = []
    for name, fig in figures.items():
        if fig is None:
            continue
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _plot_wasted(plt: Any, ws: list[dict[str, Any]]) -> Any:
    """Exp. 3: each method's wasted time, split into its parts, one panel per MTBF (of the
    round at the median effective ratio, :func:`median_rows`)."""
    if not ws:
        return None
    mtbfs = sorted({r["mtbf_s"] for r in ws}, reverse=True)
    fig, axes = plt.subplots(1, len(mtbfs), figsize=(5.5 * len(mtbfs), 4.5), squeeze=False)
    parts = [
        ("startup_overhead_s", "startup", "tab:gray"),
        ("overhead_s", "steady overhead", "tab:blue"),
        ("lost_work_s", "lost work", "tab:orange"),
        ("recovery_s", "recovery", "tab:red"),
    ]
    ws = median_rows(ws)
    for ax, m in zip(axes[0], mtbfs, strict=True):
        rs = [r for r in ws if r["mtbf_s"] == m]
        x = range(len(rs))
        # a negative part (a steady overhead below the noise) stacks downwards
        pos = [0.0] * len(rs)
        neg = [0.0] * len(rs)
        for key, label, color in parts:
            vals = [r[key] for r in rs]
            bottoms = [p if v >= 0 else n for v, p, n in zip(vals, pos, neg, strict=True)]
            ax.bar(x, vals, bottom=bottoms, color=color, label=label)
            pos = [p + max(v, 0) for v, p in zip(vals, pos, strict=True)]
            neg = [n + min(v, 0) for v, n in zip(vals, neg, strict=True)]
        ax.set_xticks(list(x), [r["method"] for r in rs], rotation=40, ha="right")
        ax.set_ylabel("wasted time (s)")
        ax.set_title(f"Exp. 3: MTBF {m:g} s ({rs[0]['failures']} failures)")
        ax.axhline(0, color="black", linewidth=0.5)
    axes[0][0].legend(fontsize=8)
    return fig


def _plot_ratio(plt: Any, ws: list[dict[str, Any]]) -> Any:
    """Exp. 11: each method's effective training time ratio against the MTBF (the median
    over the rounds)."""
    if not ws:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for meth in dict.fromkeys(r["method"] for r in ws):
        mtbfs = sorted({r["mtbf_s"] for r in ws if r["method"] == meth})
        ax.plot(
            mtbfs,
            [
                100
                * statistics.median(
                    r["effective_ratio"] for r in ws if r["method"] == meth and r["mtbf_s"] == m
                )
                for m in mtbfs
            ],
            marker="o",
            label=meth,
        )
    ax.set_xscale("log")
    ax.set_xlabel("MTBF (s of failure-free training)")
    ax.set_ylabel("effective training time ratio (%)")
    ax.set_title("Exp. 11: training under frequent failures")
    ax.legend(fontsize=8)
    return fig


def _plot_gpus(plt: Any, sim: list[dict[str, Any]]) -> Any:
    """Exp. 12 (a simulation): each method's effective ratio against the GPU count."""
    if not sim:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for meth in dict.fromkeys(r["method"] for r in sim):
        rs = sorted((r for r in sim if r["method"] == meth), key=lambda r: r["n_gpus"])
        ax.plot(
            [r["n_gpus"] for r in rs],
            [100 * r["effective_ratio"] for r in rs],
            marker="o",
            label=meth,
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("effective training time ratio (%)")
    ax.set_title("Exp. 12: more GPUs — SIMULATION from measured costs")
    ax.legend(fontsize=8)
    return fig


def _plot_grid(plt: Any, cells: list[dict[str, Any]], summ: list[dict[str, Any]]) -> Any:
    """Exp. 8: the model's and the measured wasted time over the (f, b) grid, the model's
    pick starred."""
    if not (cells and summ):
        return None
    fs = sorted({c["f"] for c in cells})
    bs = sorted({c["b"] for c in cells})
    star = (summ[0]["f_star"], summ[0]["b_star"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, title in zip(
        axes,
        ("model_wasted_s", "core_wasted_s", "wasted_s"),
        ("model T_w(f, b)", "measured, core", "measured, whole"),
        strict=True,
    ):
        grid = [
            [next((c[key] for c in cells if c["f"] == f and c["b"] == b), float("nan")) for b in bs]
            for f in fs
        ]
        im = ax.imshow(grid, cmap="viridis_r", aspect="auto")
        ax.set_xticks(range(len(bs)), [str(b) for b in bs])
        ax.set_yticks(range(len(fs)), [str(f) for f in fs])
        ax.set_xlabel("batch size b")
        ax.set_ylabel("full-checkpoint interval f")
        ax.set_title(f"Exp. 8: {title} (s)")
        for i, f in enumerate(fs):
            for j, b in enumerate(bs):
                v = grid[i][j]
                if v == v:  # not a missing cell (NaN)
                    starred = (f, b) == star
                    ax.text(
                        j,
                        i,
                        f"{v:.2f}" + ("*" if starred else ""),
                        ha="center",
                        va="center",
                        color="white",
                        fontsize=8,
                        fontweight="bold" if starred else "normal",
                    )
        fig.colorbar(im, ax=ax)
    return fig


def write(out: Path, run: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Path]:
    """Write ``results.jsonl``, ``report.md`` and the figures into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.jsonl", "w") as f:
        f.write(json.dumps({"kind": "run", **run}, sort_keys=True, default=str) + "\n")
        for r in rows:
            f.write(json.dumps({"kind": "row", **r}, sort_keys=True, default=str) + "\n")
    (out / "report.md").write_text(markdown(run, rows))
    files = {"results": out / "results.jsonl", "report": out / "report.md"}
    for p in plots(out, rows):
        files[p.stem] = p
    return files


__all__ = ["markdown", "plots", "write"]

"""The figures of a ``lowdiff bench`` run: one PNG per experiment (matplotlib, Agg backend).

Each ``_*_figure`` draws one experiment's figure from its rows, or returns None when the
run has none; :func:`plots` saves those of the experiments that ran. The fidelity figure
is :func:`lowdiff_lab.bench.report_fidelity.plot_fidelity`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lowdiff_lab.bench.report_fidelity import plot_fidelity
from lowdiff_lab.bench.tables import rows_of

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def plots(out: Path, rows: list[dict[str, Any]], experiments: list[str]) -> list[Path]:
    """One PNG per experiment that has rows; returns the files written."""
    # matplotlib is an optional dependency, and the Agg backend must be chosen before
    # pyplot is first imported: both only where figures are drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, draw in FIGURES.items():
        fig = draw(plt, rows) if name in experiments else None
        if fig is None:
            continue
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    if "fidelity" in experiments and (fp := plot_fidelity(out, rows)) is not None:
        written.append(fp)
    return written


def _overhead_figure(plt: Any, rows: list[dict[str, Any]]) -> Figure | None:
    """Exp. 1/2: overhead against the durable interval, per method, per setting."""
    if not rows_of(rows, "overhead"):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, setting in zip(axes, ("compressed", "uncompressed"), strict=True):
        rs = [
            r
            for r in rows_of(rows, "overhead", setting=setting)
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
    return fig


def _frequency_figure(plt: Any, rows: list[dict[str, Any]]) -> Figure | None:
    """Exp. 4: the smallest durable interval within the bound, per method."""
    summ = [r for r in rows_of(rows, "frequency") if r.get("summary")]
    if not summ:
        return None
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
    return fig


def _recovery_figure(plt: Any, rows: list[dict[str, Any]]) -> Figure | None:
    """Exp. 5: restart to the first new step against the checkpoint interval f."""
    rec = rows_of(rows, "recovery")
    if not rec:
        return None
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
    return fig


def _batching_figure(plt: Any, rows: list[dict[str, Any]]) -> Figure | None:
    """Exp. 7: LowDiff's write time per record against the batch size b."""
    bat = rows_of(rows, "batching")
    if not bat:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(
        [r["batch_size"] for r in bat], [r["write_s_per_record"] * 1e3 for r in bat], marker="o"
    )
    ax.set_xlabel("batch size b")
    ax.set_ylabel("write time per record (ms)")
    ax.set_title("Exp. 7: batched writes")
    return fig


def _storage_figure(plt: Any, rows: list[dict[str, Any]]) -> Figure | None:
    """Exp. 9: bytes written per step, per method and setting."""
    sto = rows_of(rows, "storage")
    if not sto:
        return None
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
    return fig


def _ratio_figure(plt: Any, rows: list[dict[str, Any]]) -> Figure | None:
    """Exp. 10: LowDiff's overhead against the compression ratio, beside the 3.5% bound."""
    rat = rows_of(rows, "ratio")
    if not rat:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["ratio"] for r in rat], [100 * r["overhead"] for r in rat], marker="o")
    ax.axhline(3.5, color="gray", linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("compression ratio ρ")
    ax.set_ylabel("LowDiff overhead (%)")
    ax.set_title("Exp. 10: compression ratio")
    return fig


def _breakdown_figure(plt: Any, rows: list[dict[str, Any]]) -> Figure | None:
    """One checkpoint per method (compression and write, stacked) beside one iteration."""
    per = rows_of(rows, "breakdown", table="per-method")
    if not per:
        return None
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
    return fig


FIGURES: dict[str, Callable[[Any, list[dict[str, Any]]], Figure | None]] = {
    "overhead": _overhead_figure,
    "frequency": _frequency_figure,
    "recovery": _recovery_figure,
    "batching": _batching_figure,
    "storage": _storage_figure,
    "ratio": _ratio_figure,
    "breakdown": _breakdown_figure,
}
"""The figure of each experiment that has one (besides fidelity), in the order they are drawn."""

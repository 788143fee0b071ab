"""The report of ``lowdiff bench fidelity`` (Exp. 6): the Markdown section and the plot.

:func:`section_fidelity` lays the rows out as the paper's Table "Model performance after
checkpoint/recovery" (one table at the recovered step, one at the final step);
:func:`plot_fidelity` draws ΔModel against the step after recovery.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lowdiff_lab.bench.tables import table


def _num(x: float | None) -> str:
    """A small measure in scientific notation; exactly ``"0"`` when it is zero."""
    if x is None:
        return "n/a"
    return "0" if x == 0 else f"{x:.1e}"


def _diff_cell(r: dict[str, Any], what: str) -> str:
    """ΔModel or ΔOptim. (``what``: ``"model"`` / ``"optim"``), absolute and relative."""
    a, rel = r.get(f"{what}_max_abs_diff"), r.get(f"{what}_max_rel_diff")
    if a is None:
        return "n/a"
    return "0" if a == 0 else f"{a:.1e} (rel. {rel:.1e})"


def section_fidelity(rows: list[dict[str, Any]]) -> str:
    """Markdown in the layout of the paper's Table "Model performance after checkpoint/recovery".

    One table at the recovered step and one at the final step; rows grouped by setting,
    each group led by its Baseline (the uninterrupted run). Empty without fidelity rows.

    Example:
        >>> section_fidelity([])
        ''
    """
    fid = [r for r in rows if r.get("experiment") == "fidelity"]
    if not fid:
        return ""
    out = ["## Fidelity after recovery (Exp. 6)", ""]
    skipped = [r["skipped"] for r in fid if "skipped" in r]
    if skipped:
        return "\n".join([*out, f"Not run: {skipped[0]}."])
    measured = [r for r in fid if r.get("point") in ("recovered", "final")]
    if not measured:
        return ""
    out.append(_intro(measured[0]))
    for point, title in (
        ("recovered", "At the recovered step"),
        ("final", "At the final step, after training on"),
    ):
        rs = [r for r in measured if r["point"] == point]
        if rs:
            out += ["", f"### {title}", "", _point_table(rs, point)]
    out += ["", _identical_summary(measured)]
    return "\n".join(out)


def _intro(m0: dict[str, Any]) -> str:
    """What was run and what each column measures, from any measured row."""
    return (
        f"{m0['workload']}, Adam lr {m0['lr']:g}. "
        f"The training process is SIGKILLed after step {m0['failure_step']} (once its checkpoint "
        f"is durable), recovered with `resume()` in fresh objects, and trained on to step "
        f"{m0['final_step']}; each row compares it with the same job run without a failure "
        f"(Baseline: same weights, data and dropout). PPL on {m0['eval_positions']} held-out "
        "positions; ΔModel / ΔOptim.: largest absolute difference over model parameters / "
        "optimizer state (relative: largest per-tensor max|a−b| / max|b|); KL: KL(baseline ‖ "
        "recovered) of the next-token distributions, mean over positions; Top-10: positions "
        f"whose 10 most likely tokens agree. LowDiff, LowDiff+ and Naive DC take a full "
        f"checkpoint every {m0['full_every']} steps, the other baselines every step. GC: "
        "gradient compression."
    )


def _point_table(rs: list[dict[str, Any]], point: str) -> str:
    """The table of one point (``"recovered"`` or ``"final"``), a group per setting."""
    body: list[list[str]] = []
    for key in dict.fromkeys(r["setting"] for r in rs):
        group = [r for r in rs if r["setting"] == key]
        body.append([f"*{group[0]['setting_label']}*", "", "", "", "", ""])
        for r in group:
            if r.get("reference"):
                body.append([f"Baseline (step {r['step']})", f"{r['ppl']:.2f}", "–", "–", "–", "–"])
                continue
            step = (
                "" if r["step"] == r["failure_step"] or point == "final" else f" (step {r['step']})"
            )
            body.append(
                [
                    r["method"] + step,
                    f"{r['ppl']:.2f}",
                    _diff_cell(r, "model"),
                    _diff_cell(r, "optim"),
                    _num(r["kl"]),
                    "100%" if r["top10_agreement"] == 1 else f"{100 * r['top10_agreement']:.1f}%",
                ]
            )
    return table(["Method", "PPL", "ΔModel", "ΔOptim.", "KL", "Top-10"], body)


def _identical_summary(measured: list[dict[str, Any]]) -> str:
    """Which strategies hold bit-identical state at the recovered and the final step."""

    def names(point: str, exact: bool) -> str:
        got = sorted(
            {
                f"{r['method']} ({r['setting']})"
                for r in measured
                if r["point"] == point
                and not r.get("reference")
                and (r["model_bit_identical"] and r["optim_bit_identical"]) == exact
            }
        )
        return ", ".join(got) or "none"

    return (
        "Model and optimizer state bit-identical (`torch.equal`) to the baseline at the "
        f"recovered step: {names('recovered', True)}; not: {names('recovered', False)}. "
        f"Still bit-identical at the final step: {names('final', True)}. With error feedback "
        "on, every strategy restarts the residual at zero after recovery (no checkpoint "
        "carries it), so the run after recovery can drift from the baseline although the "
        "recovered state is exact."
    )


def plot_fidelity(out_dir: Path, rows: list[dict[str, Any]]) -> Path | None:
    """``fidelity.png``: ΔModel against the step after recovery, one panel per setting.

    Returns:
        The file written, or None without trace rows.

    Example:
        >>> plot_fidelity(Path("results"), []) is None
        True
    """
    traces = [r for r in rows if r.get("experiment") == "fidelity" and r.get("point") == "trace"]
    if not traces:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys(r["setting"] for r in traces))
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    markers = "os^vDx*+"
    for ax, key in zip(axes[0], keys, strict=True):
        group = [r for r in traces if r["setting"] == key]
        top = 0.0
        for i, r in enumerate(group):
            ys = r["trace_model_max_abs_diff"]
            top = max(top, *ys) if ys else top
            # identical curves (every exact strategy) stay visible: markers and dashes differ
            ax.plot(
                r["trace_steps"],
                ys,
                marker=markers[i % len(markers)],
                ms=4,
                linestyle=("-", "--", ":", "-.")[i % 4],
                alpha=0.8,
                label=r["method"],
            )
        ax.set_yscale("symlog", linthresh=1e-9)
        ax.set_ylim(bottom=0, top=max(1e-6, 3 * top))
        ax.set_xlabel("step (first point: the recovered step)")
        ax.set_ylabel("ΔModel: max |recovered − baseline|")
        ax.set_title(group[0]["setting_label"], fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle("Exp. 6: fidelity after recovery")
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "fidelity.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

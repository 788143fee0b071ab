"""Report sections of the cost breakdown and the hot paths of ``lowdiff bench``.

``breakdown`` (the per-iteration tables), ``replica`` (the LowDiff+ replica update) and
``hotpaths`` (each target beside its measurement). ``breakdown`` and ``hotpaths`` share
the trainer-side tables of LowDiff's step bench (:func:`trainer_tables`).
"""

from __future__ import annotations

from typing import Any

from lowdiff_lab.bench.replica import format_rows
from lowdiff_lab.bench.tables import fmt_s, rows_of, table


def section_breakdown(rows: list[dict[str, Any]]) -> str:
    """The per-iteration tables: one checkpoint per method, LowDiff+'s phases, and
    LowDiff's own work on the training process."""
    per = rows_of(rows, "breakdown", table="per-method")
    plus = rows_of(rows, "breakdown", table="lowdiff+")
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
    """The trainer-side tables of :mod:`lowdiff_lab.bench.hotpaths` (per stage, per part),
    one block per workload."""
    pre = "trainer-" if experiment == "breakdown" else ""
    stages = rows_of(rows, experiment, table=f"{pre}stage")
    out: list[str] = []
    for wl in dict.fromkeys(r["workload"] for r in stages):
        s0 = next(
            (
                r
                for r in rows_of(rows, experiment, table=f"{pre}summary", workload=wl)
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
        parts = rows_of(rows, experiment, table=f"{pre}part", workload=wl)
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
    """Every hot-path target beside its measurement, the end-to-end blocks, and the
    trainer-side tables."""
    targets = rows_of(rows, "hotpaths", table="target")
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
        "(alternating blocks; medians). See `lowdiff_lab.bench.hotpaths`, `lowdiff_lab.bench.replica`, "
        "`lowdiff_lab.bench.snapshot_bw` and `lowdiff_lab.bench.wire` for what each one times.",
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
    e2e = [
        r for r in rows_of(rows, "hotpaths", table="summary") if r["name"] == "end_to_end_overhead"
    ]
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
    """The LowDiff+ replica update against a bare step, per optimizer and threads."""
    got = rows_of(rows, "replica")
    if not got:
        return ""
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

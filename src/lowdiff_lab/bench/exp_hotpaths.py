"""The ``replica`` and ``hotpaths`` experiments of ``lowdiff bench``: each hot-path target
beside its measurement.

``replica``: the LowDiff+ replica update against a bare ``torch.optim`` step
(:mod:`lowdiff_lab.bench.replica`). ``hotpaths``: every hot-path target, each a ratio of two
measurements taken side by side in the run: the replica update (at most 1.2x a bare
step), LowDiff end to end (at most 3% over compressed training, a record durable every
step, on the profile's ``hot_e2e_workload``; :mod:`lowdiff_lab.bench.hotpaths`), LowDiff's work
on the training process (at most 2% of a step, on ``hot_trainer_workload``), the LowDiff+
snapshot copies (at least 70% of memcpy bandwidth; :mod:`lowdiff_lab.bench.snapshot_bw`) and
the DDP exchange's bytes on the wire against a dense all-reduce
(:mod:`lowdiff_lab.bench.wire`).

The replica rows and LowDiff's step bench are measured once per bench run and kept in the
context's cache: ``breakdown`` reads the same step bench (:func:`lowdiff_step_rows`).
"""

from __future__ import annotations

from typing import Any

from lowdiff_lab.bench.context import Context, Profile
from lowdiff_lab.bench.hotpaths import lowdiff_step_bench
from lowdiff_lab.bench.replica import replica_update_bench
from lowdiff_lab.bench.snapshot_bw import snapshot_bandwidth_bench
from lowdiff_lab.bench.wire import ddp_wire_bench


def replica(ctx: Context) -> list[dict[str, Any]]:
    """The LowDiff+ replica's per-step update against a bare ``torch.optim`` step of the
    same class, flags and thread count over the same parameters (issue target: at most
    1.2x), alternating blocks in this process; see :mod:`lowdiff_lab.bench.replica`."""
    return [{"experiment": "replica", **r} for r in replica_rows(ctx)]


def lowdiff_step_rows(
    ctx: Context, workload: str, batch_size: int | None = 1
) -> list[dict[str, Any]]:
    """LowDiff against compressed training on ``workload`` (:mod:`lowdiff_lab.bench.hotpaths`),
    run once per bench run and shared by ``breakdown`` and ``hotpaths``."""
    key = f"lowdiff-steps:{workload}:{batch_size}"
    if key not in ctx.cache:
        ctx.cache[key] = lowdiff_step_bench(
            workload=workload,
            steps=ctx.profile.hot_steps,
            repeats=max(3, ctx.settings.repeats),
            ratio=ctx.profile.ratio,
            batch_size=batch_size,
            workdir=ctx.settings.workdir,
            progress=ctx.progress,
        )
    return ctx.cache[key]


def replica_rows(ctx: Context) -> list[dict[str, Any]]:
    """The replica update bench's rows, run once per bench run (``replica``, ``hotpaths``)."""
    if "replica" not in ctx.cache:
        ctx.cache["replica"] = replica_update_bench(
            n_params=ctx.profile.replica_params,
            threads=tuple(ctx.profile.replica_threads),
            repeats=max(3, ctx.settings.repeats),
            steps=5,
            progress=ctx.progress,
        )
    return ctx.cache["replica"]


def hotpaths(ctx: Context) -> list[dict[str, Any]]:
    """The hot-path targets, each measured side by side in this run with its target
    beside it (rows with ``table="target"``), followed by the measurements' own rows."""
    p = ctx.profile
    rep = replica_rows(ctx)
    e2e_rows = lowdiff_step_rows(ctx, p.hot_e2e_workload)
    # the library's default b: records handed over every step, durable every b steps
    default_b = lowdiff_step_rows(ctx, p.hot_e2e_workload, None)
    tr_rows = lowdiff_step_rows(ctx, p.hot_trainer_workload)
    snap = _snapshot_rows(ctx)
    wire = ddp_wire_bench(workload=p.hot_trainer_workload, ratio=p.ratio, progress=ctx.progress)
    rows = [
        *_replica_targets(rep),
        *_lowdiff_targets(p, e2e_rows, default_b, tr_rows),
        *_snapshot_targets(snap),
        _wire_target(p, wire),
    ]
    rows += e2e_rows + (tr_rows if tr_rows is not e2e_rows else [])
    rows += [{**r, "table": f"default-b-{r['table']}"} for r in default_b]
    rows += [{**r, "experiment": "hotpaths", "table": "snapshot"} for r in snap]
    rows += [{**r, "experiment": "hotpaths", "table": "wire"} for r in wire]
    return rows


def _target(
    n: int, name: str, value: float, goal: float | None, met: bool, **kw: Any
) -> dict[str, Any]:
    """One row of the targets table: target ``n``, its measured value beside its goal."""
    return {
        "experiment": "hotpaths",
        "table": "target",
        "target_id": n,
        "name": name,
        "value": value,
        "target": goal,
        "met": bool(met),
        **kw,
    }


def _snapshot_rows(ctx: Context) -> list[dict[str, Any]]:
    """The snapshot bandwidth on the end-to-end workload (the larger model) and on the
    trainer-side one, whose many small gradients make a copy per tensor cost it more
    (``snapshot_over_split``)."""
    p = ctx.profile
    snap: list[dict[str, Any]] = []
    for wl in dict.fromkeys((p.hot_e2e_workload, p.hot_trainer_workload)):
        snap += snapshot_bandwidth_bench(
            workload=wl, repeats=max(3, ctx.settings.repeats), progress=ctx.progress
        )
    return snap


def _replica_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Target 1: the replica update over a bare step, per optimizer, flags and threads."""
    out = []
    for r in rows:
        flags = ",".join(f"{k}={v}" for k, v in r["flags"].items())
        out.append(_target(
            1, f"replica update / bare step ({r['optimizer'].rsplit('.', 1)[-1]} {flags}, "
            f"{r['threads']} thread(s))", r["ratio"], r["target"],
            r["meets_target"] and r["identical"], compare="<=", unit="x",
            detail=f"{r['replica_s'] * 1e3:.2f} ms vs {r['bare_s'] * 1e3:.2f} ms; "
            f"identical bits: {r['identical']}",
        ))  # fmt: skip
    return out


def _lowdiff_targets(
    p: Profile,
    e2e_rows: list[dict[str, Any]],
    default_b: list[dict[str, Any]],
    tr_rows: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """Targets 2 and 3: LowDiff end to end (a record durable every step, and for
    information the default b), and LowDiff's work on the training process."""
    e2e = next(r for r in e2e_rows if r.get("name") == "end_to_end_overhead")
    e2 = next(r for r in default_b if r.get("name") == "end_to_end_overhead")
    tr = next(r for r in tr_rows if r.get("name") == "trainer_overhead")
    return [
        _target(
            2, f"LowDiff end to end over compressed training ({p.hot_e2e_workload}, "
            f"{e2e['n_params'] / 1e6:.1f}M parameters, a record durable every step, "
            f"f={e2e['full_every']})", e2e["value"], e2e["target"], e2e["met"], compare="<=",
            unit="overhead", detail=f"median of {e2e['repeats']} back-to-back block pairs; "
            f"medians {e2e['lowdiff_s_per_step'] * 1e3:.1f} ms vs "
            f"{e2e['none_s_per_step'] * 1e3:.1f} ms per step "
            f"({e2e['ratio_of_medians'] * 100:+.1f}%)",
        ),
        _target(
            2, f"the same with the default b={e2['batch_size']} (a record handed over every "
            f"step, durable every {e2['batch_size']} steps)", e2["value"], None, True,
            compare="", unit="overhead", detail=f"{e2['lowdiff_s_per_step'] * 1e3:.1f} ms vs "
            f"{e2['none_s_per_step'] * 1e3:.1f} ms per step; for information, the target is b=1",
        ),
        _target(
            3, f"LowDiff's work on the training process / step ({p.hot_trainer_workload})",
            tr["value"], tr["target"], tr["met"], compare="<=", unit="fraction",
            detail=f"{tr['trainer_s_per_step'] * 1e3:.3f} ms of a "
            f"{tr['none_s_per_step'] * 1e3:.1f} ms step; per stage in the breakdown experiment",
        ),
    ]  # fmt: skip


def _snapshot_targets(snap: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Target 4: the LowDiff+ snapshot copies over memcpy bandwidth, per workload."""
    out = []
    for r in snap:
        where = "in the hook" if r["copy_mode"] == "inline" else "by the copy thread"
        out.append(_target(
            4, f"LowDiff+ snapshot copies / memcpy bandwidth ({r['workload']}, "
            f"{r['grad_bytes'] / 1e6:.1f} MB in {r['tensors']} gradients)",
            r["snapshot_over_memcpy"], r["target"], r["met"] and r["identical"],
            compare=">=", unit="fraction", detail=f"{r['snapshot_gbps']:.2f} GB/s copied "
            f"{where} during backward vs {r['memcpy_gbps']:.2f} GB/s memcpy with "
            f"{r['torch_threads']} torch threads; {r['snapshot_over_split'] * 100:.0f}% of a "
            f"copy per tensor ({r['memcpy_split_gbps']:.2f} GB/s); identical bits: "
            f"{r['identical']}",
        ))  # fmt: skip
    return out


def _wire_target(p: Profile, wire: list[dict[str, Any]]) -> dict[str, Any]:
    """Target 5 (reported): the DDP exchange's bytes over a dense all-reduce's, rank 0,
    the last step."""
    last = max(r["step"] for r in wire)
    w0 = next(r for r in wire if r["step"] == last and r["rank"] == 0)
    return _target(
        5, f"DDP exchange bytes / dense all-reduce ({p.hot_trainer_workload}, "
        f"{w0['world_size']} ranks, ratio {p.ratio})", w0["lowdiff_over_dense"], None, True,
        compare="", unit="fraction", detail=f"{w0['lowdiff_bytes']:,} vs "
        f"{w0['dense_payload_bytes']:,} bytes per rank and step; indices {w0['index_dtypes']}, "
        f"values {w0['value_dtype']}",
    )  # fmt: skip

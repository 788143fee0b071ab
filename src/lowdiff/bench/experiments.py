"""The experiments of ``lowdiff bench``, after the paper's section "Evaluation".

Each experiment is a function ``(ctx) -> list[row]``; a row is a flat JSON-able dict
with an ``"experiment"`` key. Rows are measurements only: nothing is filled in from the
paper or from a model of the costs. Values that are computed from measurements (such as
an overhead ratio) say so in their key.

- ``overhead`` (Exp. 1/2): time per iteration with a checkpoint every iteration, with and
  without gradient compression, against the same training without checkpoints, all in
  one interleaved run.
- ``frequency`` (Exp. 4): the smallest interval (of the candidates) that keeps the
  slowdown at or under the bound (3.5%).
- ``recovery`` (Exp. 5): recovery time, split into read, decompress and reconstruct,
  against the full-checkpoint interval f.
- ``batching`` (Exp. 7): LowDiff's write time per record against the batch size b, and
  the memory a batch holds.
- ``storage`` (Exp. 9): bytes per checkpoint and bytes written per step.
- ``ratio`` (Exp. 10): LowDiff's overhead and record size against the top-k ratio.
- ``breakdown``: the per-iteration tables (checkpoint costs per method; LowDiff+ phases).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from lowdiff.bench.core import Arena, Arm, BenchSettings, build_workload, make_checkpointer
from lowdiff.bench.core import make_optimizer as _make_optimizer

EXPERIMENTS = (
    "overhead",
    "breakdown",
    "storage",
    "frequency",
    "recovery",
    "batching",
    "ratio",
    "fidelity",
)
"""Every experiment, in the order they run."""
DEFAULT_EXPERIMENTS = EXPERIMENTS[:-1]
"""What ``lowdiff bench`` runs when no experiment is named (``fidelity`` runs when named)."""
OVERHEAD_BOUND = 0.035
"""The slowdown bound of Exp. 4 (3.5%, after CheckFreq)."""


@dataclass
class Profile:
    """Sizes of one bench run.

    Attributes:
        ratio: The top-k ratio of compressed training (the paper's 0.01).
        lowdiff_full_every: LowDiff's full-checkpoint interval f in the timing experiments.
        lowdiff_batch: LowDiff's batch size b in the timing experiments.
        intervals: Candidate checkpoint intervals of ``frequency``.
        recovery_fulls: Full-checkpoint intervals f of ``recovery``.
        batch_sizes: Batch sizes b of ``batching``.
        ratios: Top-k ratios of ``ratio``.
        gemini_persist_every: Gemini persists every this many in-memory checkpoints.
    """

    ratio: float = 0.01
    lowdiff_full_every: int = 20
    lowdiff_batch: int = 5
    intervals: list[int] = field(default_factory=lambda: [1, 2, 5, 10, 20])
    recovery_fulls: list[int] = field(default_factory=lambda: [5, 10, 20, 50])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 5, 10, 20])
    ratios: list[float] = field(default_factory=lambda: [0.001, 0.005, 0.01, 0.05, 0.1])
    gemini_persist_every: int = 10


QUICK_PROFILE = Profile(
    intervals=[1, 2, 5],
    recovery_fulls=[5, 10],
    batch_sizes=[1, 2, 5, 10],
    ratios=[0.001, 0.01, 0.1],
)


@dataclass
class Context:
    """What experiments share: settings, sizes, the progress callback and cached runs."""

    settings: BenchSettings
    profile: Profile
    progress: Callable[[str], None] = lambda _m: None
    cache: dict[str, Any] = field(default_factory=dict)
    methods: frozenset[str] | None = None
    """Strategies to run (None: all); the runs without checkpointing always run."""

    def wants(self, strategy: str | None) -> bool:
        return strategy in (None, "none") or self.methods is None or strategy in self.methods


# --------------------------------------------------------------------------- arms


def compressed_arms(p: Profile, interval: int = 1) -> list[Arm]:
    """Compressed training: no checkpoint, LowDiff, and every baseline at ``interval``."""
    r = p.ratio
    return [
        Arm("W/O CKPT", "none", r),
        Arm(
            "LowDiff",
            "lowdiff",
            r,
            p.lowdiff_full_every,
            (("batch_size", p.lowdiff_batch),),
        ),
        *baseline_arms(p, r, interval),
    ]


def uncompressed_arms(p: Profile, interval: int = 1) -> list[Arm]:
    """Uncompressed training: no checkpoint, LowDiff+, and every baseline at ``interval``."""
    return [
        Arm("W/O CKPT", None),
        Arm("LowDiff+", "lowdiff+", None, p.lowdiff_full_every, (("persist_every", "auto"),)),
        *baseline_arms(p, None, interval),
    ]


def baseline_arms(p: Profile, ratio: float | None, interval: int) -> list[Arm]:
    nd_ratio = p.ratio if ratio is None else ratio
    return [
        Arm("torch.save", "torch-save", ratio, interval),
        Arm("CheckFreq", "checkfreq", ratio, interval),
        Arm("Gemini", "gemini", ratio, interval, (("persist_every", p.gemini_persist_every),)),
        Arm(
            "Naive DC",
            "naive-dc",
            ratio,
            max(p.lowdiff_full_every, interval),
            (("ratio", nd_ratio), ("diff_every", interval)),
        ),
        Arm("DCP async", "dcp-async", ratio, interval),
    ]


def _arena(ctx: Context, key: str, arms: list[Arm]) -> dict[str, Any]:
    """Run (or reuse) one interleaved arena; returns ``{label: summary}`` plus disk bytes.

    Phases are timed apart in every arena (forward+backward, update+checkpoint): the
    breakdown tables reuse the overhead runs instead of training once more.
    """
    if key in ctx.cache:
        return ctx.cache[key]  # type: ignore[no-any-return]
    arms = [a for a in arms if ctx.wants(a.strategy)]
    with Arena(ctx.settings, arms, ctx.progress, phases=True) as arena:
        arena.run()
        out = arena.results()
        for r in arena.runs:
            out[r.arm.label]["disk_bytes"] = arena.disk_bytes(r)
    ctx.cache[key] = out
    return out


def _overhead_rows(exp: str, setting: str, res: dict[str, Any], ref: str) -> list[dict[str, Any]]:
    base = res[ref]["median_s"]
    rows = []
    for label, r in res.items():
        st = r.get("stats", {})
        steps = max(1.0, st.get("steps", 0.0))
        rows.append(
            {
                "experiment": exp,
                "setting": setting,
                "method": label,
                **{f"arm_{k}": v for k, v in r["arm"].items() if k != "label"},
                "median_s": r["median_s"],
                "min_s": r["min_s"],
                "max_s": r["max_s"],
                "blocks": r["n"],
                "overhead": r["median_s"] / base - 1.0,
                "overhead_min": r["min_s"] / res[ref]["max_s"] - 1.0,
                "overhead_max": r["max_s"] / res[ref]["min_s"] - 1.0,
                "stall_s_per_step": st.get("stall_s", 0.0) / steps if st else None,
                "drain_s": r.get("drain_s"),
                "bytes_written_per_step": _bytes_written(st) / steps if st else None,
                "disk_bytes": r.get("disk_bytes"),
            }
        )
    return rows


def _bytes_written(st: dict[str, float]) -> float:
    """Bytes a strategy wrote in its session, from its own counters."""
    if "record_bytes" in st:  # lowdiff / lowdiff+
        return st.get("record_bytes", 0.0) + st.get("full_bytes", 0.0)
    return st.get("bytes_written", 0.0)


# --------------------------------------------------------------------------- experiments


def overhead(ctx: Context) -> list[dict[str, Any]]:
    """Exp. 1/2: per-iteration time with a checkpoint every iteration."""
    p = ctx.profile
    rows = _overhead_rows(
        "overhead", "compressed", _arena(ctx, "compressed-1", compressed_arms(p)), "W/O CKPT"
    )
    rows += _overhead_rows(
        "overhead", "uncompressed", _arena(ctx, "uncompressed-1", uncompressed_arms(p)), "W/O CKPT"
    )
    return rows


def storage(ctx: Context) -> list[dict[str, Any]]:
    """Exp. 9: bytes per checkpoint and bytes written per step (from the overhead runs)."""
    p = ctx.profile
    rows = []
    for setting, key, arms in (
        ("compressed", "compressed-1", compressed_arms(p)),
        ("uncompressed", "uncompressed-1", uncompressed_arms(p)),
    ):
        res = _arena(ctx, key, arms)
        for label, r in res.items():
            st = r.get("stats")
            if not st:
                continue
            steps = max(1.0, st.get("steps", 0.0))
            row: dict[str, Any] = {
                "experiment": "storage",
                "setting": setting,
                "method": label,
                "steps": st.get("steps"),
                "bytes_written_per_step": _bytes_written(st) / steps,
                "disk_bytes": r.get("disk_bytes"),
            }
            if "record_bytes" in st:
                row["full_checkpoint_bytes"] = st["full_bytes"] / max(1.0, st["fulls_written"])
                if st.get("records_written"):
                    row["differential_bytes"] = st["record_bytes"] / st["records_written"]
            else:
                n = max(1.0, st.get("checkpoints", 0.0) + st.get("fulls", 0.0))
                if "diff_bytes" in st and st.get("diffs"):
                    row["differential_bytes"] = st["diff_bytes"] / st["diffs"]
                    row["full_checkpoint_bytes"] = (st["bytes_written"] - st["diff_bytes"]) / max(
                        1.0, st.get("fulls", 1.0)
                    )
                elif st.get("persists"):  # Gemini: in memory every interval, on disk rarely
                    row["full_checkpoint_bytes"] = st["bytes_written"] / st["persists"]
                    row["memory_bytes_per_checkpoint"] = st.get("memory_bytes", 0.0) / n
                else:
                    row["full_checkpoint_bytes"] = st.get("bytes_written", 0.0) / n
            rows.append(row)
    return rows


def frequency(ctx: Context) -> list[dict[str, Any]]:
    """Exp. 4: the smallest checkpoint interval whose slowdown is within the bound."""
    p, s = ctx.profile, ctx.settings
    pending = {
        a.label for a in compressed_arms(p) if a.strategy != "none" and ctx.wants(a.strategy)
    }
    if ctx.wants("lowdiff+"):
        pending.add("LowDiff+ (P)")
    found: dict[str, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []
    for k in p.intervals:
        if not pending:
            break
        arms = [a for a in compressed_arms(p, k) if a.label in pending | {"W/O CKPT"}]
        if k > 1:  # LowDiff logs every step by design: its interval is 1
            arms = [a for a in arms if a.label != "LowDiff"]
        plus = [Arm("W/O CKPT (uncompressed)", None)]
        if "LowDiff+ (P)" in pending:
            plus.append(
                Arm(
                    "LowDiff+ (P)",
                    "lowdiff+",
                    None,
                    max(k, p.lowdiff_full_every),
                    (("persist_every", k),),
                )
            )
        # a block holds at least two checkpoints of the interval
        sub = BenchSettings(**{**asdict(s), "iters": max(s.iters, 2 * k)})
        sub_ctx = Context(sub, p, ctx.progress, methods=ctx.methods)
        if k == 1 and "compressed-1" in ctx.cache:  # the overhead run measured interval 1
            res = dict(ctx.cache["compressed-1"])
            if len(plus) > 1:
                res.update(_arena(sub_ctx, "frequency-plus-1", plus))
        else:
            res = _arena(sub_ctx, f"frequency-{k}", arms + plus)
        for label, r in res.items():
            if label.startswith("W/O"):
                continue
            ref = res["W/O CKPT (uncompressed)" if label.startswith("LowDiff+") else "W/O CKPT"]
            ov = r["median_s"] / ref["median_s"] - 1.0
            rows.append(
                {
                    "experiment": "frequency",
                    "method": label,
                    "interval": k,
                    "overhead": ov,
                    "median_s": r["median_s"],
                    "reference_median_s": ref["median_s"],
                    "within_bound": ov <= OVERHEAD_BOUND,
                }
            )
            if ov <= OVERHEAD_BOUND and label in pending:
                pending.discard(label)
                found[label] = {"interval": k, "overhead": ov}
    for label in sorted(found.keys() | pending):
        tried = [r["interval"] for r in rows if r["method"] == label and "interval" in r]
        rows.append(
            {
                "experiment": "frequency",
                "method": label,
                "summary": True,
                "bound": OVERHEAD_BOUND,
                "min_interval": found.get(label, {}).get("interval"),
                "largest_interval_tried": max(tried, default=None),
            }
        )
    return rows


def recovery(ctx: Context) -> list[dict[str, Any]]:
    """Exp. 5: recovery time against the full-checkpoint interval."""
    p = ctx.profile
    rows = []
    cases: list[tuple[str, str, float | None, tuple[tuple[str, Any], ...]]] = [
        ("Baseline (torch.save)", "torch-save", None, ()),
        ("Naive DC w/o OC", "naive-dc", None, (("ratio", p.ratio),)),
        ("Naive DC w/ OC", "naive-dc", None, (("ratio", p.ratio), ("compress_optimizer", True))),
        ("LowDiff", "lowdiff", p.ratio, (("batch_size", p.lowdiff_batch),)),
    ]
    for f in p.recovery_fulls:
        target = 2 * f - 1  # the worst case: just before the next full checkpoint
        for label, strategy, ratio, opts in cases:
            if ctx.wants(strategy):
                ctx.progress(f"recovery f={f}: {label}")
                rows.append(_recovery_case(ctx, Arm(label, strategy, ratio, f, opts), target))
        if ctx.wants("lowdiff+"):
            ctx.progress(f"recovery f={f}: LowDiff+ (S)")
            rows.append(_plus_memory_case(ctx, f, target))
    return rows


def _recovery_case(ctx: Context, arm: Arm, target: int) -> dict[str, Any]:
    s = ctx.settings
    d = Path(s.workdir) / f"lowdiff-bench-recovery-{os.getpid()}-{arm.strategy}-{arm.full_every}"
    _rmtree(d)
    try:
        wl = build_workload(s)
        opt = _make_optimizer(wl.model, s.lr)
        ck = make_checkpointer(arm, wl.model, opt, d)
        for t in range(target):
            wl.forward_backward(t)
            ck.step()
            opt.zero_grad(set_to_none=True)
        ck.close()
        wl2 = build_workload(s)
        opt2 = _make_optimizer(wl2.model, s.lr)
        t0 = time.perf_counter()
        ck2 = make_checkpointer(arm, wl2.model, opt2, d)
        total = time.perf_counter() - t0
        rs = ck2.recovery_stats
        step = ck2.step_count
        # lost work: a checkpoint older than the failure is reconstructed by retraining
        t1 = time.perf_counter()
        for t in range(step, target):
            wl2.forward_backward(t)
            ck2.step()
            opt2.zero_grad(set_to_none=True)
        retrain = time.perf_counter() - t1
        ck2.close()
        return {
            "experiment": "recovery",
            "method": arm.label,
            "full_every": arm.full_every,
            "failure_step": target,
            "recovered_step": step,
            "read_s": rs.read_s,
            "decompress_s": rs.decode_s,
            "reconstruct_s": rs.replay_s,
            "retrain_s": retrain,
            "retrained_steps": target - step,
            "recovery_s": rs.total_s or rs.read_s + rs.decode_s + rs.replay_s,
            "resume_s": total,
            "total_s": (rs.total_s or rs.read_s + rs.decode_s + rs.replay_s) + retrain,
            "bytes_read": rs.bytes_read,
            "records_replayed": rs.records_replayed,
            "source": rs.source,
        }
    finally:
        _rmtree(d)


def _plus_child(settings: dict[str, Any], directory: str, full_every: int, steps: int) -> None:
    """Train ``steps`` LowDiff+ steps, then die by SIGKILL (a software failure)."""
    try:
        s = BenchSettings(**{**settings, "workdir": Path(settings["workdir"])})
        wl = build_workload(s)
        opt = _make_optimizer(wl.model, s.lr)
        ck = make_checkpointer(
            Arm("LowDiff+", "lowdiff+", None, full_every), wl.model, opt, Path(directory)
        )
        for t in range(steps):
            wl.forward_backward(t)
            ck.step()
            opt.zero_grad(set_to_none=True)
        ck.flush()  # the replica has merged every step (and persisted it)
    except BaseException:
        # exiting normally would wait for the replica process, which waits for this one
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os.kill(os.getpid(), signal.SIGKILL)


def _plus_memory_case(ctx: Context, f: int, target: int) -> dict[str, Any]:
    s = ctx.settings
    d = Path(s.workdir) / f"lowdiff-bench-recovery-{os.getpid()}-plus-{f}"
    _rmtree(d)
    try:
        proc = mp.get_context("spawn").Process(
            target=_plus_child, args=({**asdict(s), "workdir": str(s.workdir)}, str(d), f, target)
        )
        proc.start()
        proc.join(600)
        if proc.exitcode != -signal.SIGKILL:
            if proc.is_alive():
                proc.kill()
            raise RuntimeError(
                f"the LowDiff+ training child did not reach its failure point (exit code "
                f"{proc.exitcode}); its traceback is above"
            )
        wl = build_workload(s)
        opt = _make_optimizer(wl.model, s.lr)
        t0 = time.perf_counter()
        ck = make_checkpointer(Arm("LowDiff+", "lowdiff+", None, f), wl.model, opt, d)
        total = time.perf_counter() - t0
        rs = ck.recovery_stats
        step = ck.step_count
        ck.close()
        return {
            "experiment": "recovery",
            "method": "LowDiff+ (S)",
            "full_every": f,
            "failure_step": target,
            "recovered_step": step,
            "read_s": rs.read_s if rs else None,
            "decompress_s": rs.decode_s if rs else None,
            "reconstruct_s": rs.replay_s if rs else None,
            "retrain_s": 0.0,
            "retrained_steps": target - step,
            "recovery_s": rs.total_s if rs else None,
            "resume_s": total,
            "total_s": rs.total_s if rs else None,
            "bytes_read": rs.bytes_read if rs else None,
            "records_replayed": rs.records_replayed if rs else None,
            "source": rs.source if rs else None,
        }
    finally:
        _rmtree(d)


def batching(ctx: Context) -> list[dict[str, Any]]:
    """Exp. 7: LowDiff's write time per record against b, and what a batch holds in memory."""
    p, s = ctx.profile, ctx.settings
    rows: list[dict[str, Any]] = []
    if not ctx.wants("lowdiff"):
        return rows
    steps = max(s.iters * s.repeats, 2 * max(p.batch_sizes))
    for b in p.batch_sizes:
        ctx.progress(f"batching b={b}")
        d = Path(s.workdir) / f"lowdiff-bench-batching-{os.getpid()}-{b}"
        _rmtree(d)
        try:
            wl = build_workload(s)
            opt = _make_optimizer(wl.model, s.lr)
            arm = Arm("LowDiff", "lowdiff", p.ratio, 10**6, (("batch_size", b),))
            if s.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            ck = make_checkpointer(arm, wl.model, opt, d)
            for t in range(steps):
                wl.forward_backward(t)
                ck.step()
                opt.zero_grad(set_to_none=True)
            ck.flush()
            st = ck.stats
            row = {
                "experiment": "batching",
                "batch_size": b,
                "steps": steps,
                "records": st["records_written"],
                "writes": st["record_files_written"],
                "write_s_per_record": st["record_write_s"] / max(1.0, st["records_written"]),
                "write_s_per_write": st["record_write_s"] / max(1.0, st["record_files_written"]),
                "record_row_bytes": st["record_row_bytes"],
                "batch_bytes_held_by_checkpointing_process": st["record_row_bytes"] * b,
                "host_rss_bytes": _rss_bytes(),
            }
            if s.device == "cuda":
                row["accelerator_peak_bytes"] = torch.cuda.max_memory_allocated()
            ck.close()
            rows.append(row)
        finally:
            _rmtree(d)
    return rows


def ratio(ctx: Context) -> list[dict[str, Any]]:
    """Exp. 10: LowDiff's overhead and record size against the top-k ratio."""
    p = ctx.profile
    if not ctx.wants("lowdiff"):
        return []
    arms = []
    for r in p.ratios:
        arms.append(Arm(f"W/O CKPT rho={r:g}", "none", r))
        arms.append(
            Arm(
                f"LowDiff rho={r:g}",
                "lowdiff",
                r,
                p.lowdiff_full_every,
                (("batch_size", p.lowdiff_batch),),
            )
        )
    res = _arena(ctx, "ratio", arms)
    rows = []
    for r in p.ratios:
        ref, ld = res[f"W/O CKPT rho={r:g}"], res[f"LowDiff rho={r:g}"]
        st = ld["stats"]
        rows.append(
            {
                "experiment": "ratio",
                "ratio": r,
                "reference_median_s": ref["median_s"],
                "lowdiff_median_s": ld["median_s"],
                "overhead": ld["median_s"] / ref["median_s"] - 1.0,
                "record_bytes": st["record_bytes"] / max(1.0, st["records_written"]),
                "record_write_s": st["record_write_s"] / max(1.0, st["records_written"]),
            }
        )
    return rows


def breakdown(ctx: Context) -> list[dict[str, Any]]:
    """The per-iteration tables: checkpoint costs per method, and LowDiff+'s phases."""
    p = ctx.profile
    rows: list[dict[str, Any]] = []
    comp = _arena(ctx, "compressed-1", compressed_arms(p))
    iteration = comp["W/O CKPT"]["median_s"]
    for label, r in comp.items():
        if label == "W/O CKPT":
            continue
        st = r["stats"]
        steps = max(1.0, st.get("steps", 0.0))
        if "record_bytes" in st:  # LowDiff: the compression is the training's own
            compression = 0.0
            n = max(1.0, st["records_written"])
            ckpt = st["record_write_s"] / n + st["record_send_s"] / steps
        else:
            compression = st.get("compress_s", 0.0) / max(1.0, st.get("checkpoints", 1.0))
            ckpt = st.get("write_s", 0.0) / max(
                1.0, st.get("checkpoints", 0.0) + st.get("fulls", 0.0)
            )
        rows.append(
            {
                "experiment": "breakdown",
                "table": "per-method",
                "method": label,
                "iteration_s": iteration,
                "compression_s": compression,
                "checkpoint_s": ckpt,
                "stall_s_per_step": (
                    st.get("stall_s", st.get("slot_wait_s", 0.0) + st.get("full_wait_s", 0.0))
                )
                / steps,
                "median_s": r["median_s"],
            }
        )
    unc = _arena(ctx, "uncompressed-1", uncompressed_arms(p))
    for label, r in unc.items():
        if label not in ("W/O CKPT", "LowDiff+"):
            continue
        ph = r.get("phases_s", {})
        st = r.get("stats", {})
        steps = max(1.0, st.get("steps", 1.0))
        rows.append(
            {
                "experiment": "breakdown",
                "table": "lowdiff+",
                "method": label,
                "forward_backward_s": ph.get("forward_backward"),
                "update_s": ph.get("update_and_checkpoint"),
                "snapshot_finish_s": st.get("snapshot_finish_s", 0.0) / steps if st else None,
                "replica_update_s": st.get("replica_merge_s", 0.0)
                / max(1.0, st.get("replica_merges", 0.0))
                if st
                else None,
                "replica_wait_s": st.get("lag_wait_s", 0.0) / steps if st else None,
                "median_s": r["median_s"],
            }
        )
    return rows


def _fidelity(ctx: Context) -> list[dict[str, Any]]:
    # imported here: lowdiff.bench.fidelity imports this module
    from lowdiff.bench.fidelity import fidelity

    return fidelity(ctx)


RUNNERS: dict[str, Callable[[Context], list[dict[str, Any]]]] = {
    "overhead": overhead,
    "frequency": frequency,
    "recovery": recovery,
    "batching": batching,
    "storage": storage,
    "ratio": ratio,
    "fidelity": _fidelity,
    "breakdown": breakdown,
}


def _rss_bytes() -> int | None:
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return None


def _rmtree(d: Path) -> None:
    import shutil

    shutil.rmtree(d, ignore_errors=True)

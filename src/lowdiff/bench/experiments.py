"""The experiments of ``lowdiff bench``, after the paper's section "Evaluation".

Each experiment is a function ``(ctx) -> list[row]``; a row is a flat JSON-able dict
with an ``"experiment"`` key. Rows are measurements only: nothing is filled in from the
paper or from a model of the costs. Values that are computed from measurements (such as
an overhead ratio) say so in their key.

**Equal durability.** Methods are compared at the same *durable interval* ``k``: the
steps between two points at which the whole training state is recoverable from disk.
LowDiff at ``k`` writes its records in batches of ``b = k``; LowDiff+ persists its
replica every ``k`` steps; Gemini keeps a checkpoint in its holder's memory every step
and persists every ``k``-th; torch.save, CheckFreq and DCP async checkpoint every ``k``
steps; Naive DC writes a difference every ``k`` steps. LowDiff, LowDiff+ and Gemini also
hand every step to a process that outlives a crash of the trainer; every row says so
(``arm_memory_every``). Every time covers the drain of the block's checkpoints
(:mod:`lowdiff.bench.core`).

- ``overhead`` (Exp. 1/2): time per iteration at durable intervals ``k`` (the profile's
  ``intervals``), with and without gradient compression, against the same training
  without checkpoints, every method of one ``k`` in one interleaved run. At ``k = 1``
  CheckFreq also runs with its own adaptive interval.
- ``frequency`` (Exp. 4): the smallest durable interval (of the candidates) that keeps
  the slowdown at or under the bound (3.5%), from the ``overhead`` runs.
- ``recovery`` (Exp. 5): every method restarted after a failure at step 2f−1: its own
  recovery time (read, decompress, reconstruct), ``resume()`` wall time, wall time to the
  end of the first training step after the restart, and to the end of the first new
  step (lost steps retrained, then one more).
- ``batching`` (Exp. 7): LowDiff's write time per record against the batch size b, and
  the memory a batch holds.
- ``storage`` (Exp. 9): bytes per checkpoint and bytes written per step.
- ``ratio`` (Exp. 10): LowDiff's overhead and record size against the top-k ratio.
- ``breakdown``: the per-iteration tables (checkpoint costs per method; LowDiff+ phases;
  LowDiff's own work on the training process, per pipeline stage, on the profile's
  ``hot_trainer_workload``).
- ``replica``: the LowDiff+ replica update against a bare ``torch.optim`` step.
- ``hotpaths``: the hot-path targets side by side with their measured ratios: the replica
  update (at most 1.2x a bare step), LowDiff end to end (at most 3% over compressed
  training, a record durable every step, on ``hot_e2e_workload``), LowDiff's work on the
  training process (at most 2% of a step), LowDiff+ snapshot copies (at least 70% of
  memcpy bandwidth) and the DDP exchange's bytes on the wire against a dense all-reduce.
"""

from __future__ import annotations

import contextlib
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

from lowdiff.bench.core import (
    Arena,
    Arm,
    BenchSettings,
    block_length,
    build_workload,
    make_checkpointer,
    newest_full_bytes,
)
from lowdiff.bench.core import make_optimizer as _make_optimizer
from lowdiff.engine.spawn import spawn_context

EXPERIMENTS = (
    "overhead",
    "breakdown",
    "replica",
    "storage",
    "frequency",
    "recovery",
    "batching",
    "ratio",
    "fidelity",
    "hotpaths",
)
"""Every experiment, in the order they run."""
OWN_WORKLOADS = frozenset({"replica", "hotpaths"})
"""Experiments that build their own workloads (from the profile), not the settings' one."""
DEFAULT_EXPERIMENTS = EXPERIMENTS[:-2]
"""What ``lowdiff bench`` runs when no experiment is named (``fidelity`` and ``hotpaths``
run when named)."""
OVERHEAD_BOUND = 0.035
"""The slowdown bound of Exp. 4 (3.5%, after CheckFreq)."""
DCP_MODES = ("thread", "process")
"""DCP ``async_save`` savers the timing experiments compare (the thread saver is DCP's
default and torchtitan's ``async`` mode)."""


@dataclass
class Profile:
    """Sizes of one bench run.

    Attributes:
        ratio: The top-k ratio of compressed training (the paper's 0.01).
        lowdiff_full_every: LowDiff's (and LowDiff+'s, Naive DC's) full-checkpoint
            interval f in the timing experiments.
        lowdiff_batch: LowDiff's batch size b in ``recovery`` and ``ratio``.
        intervals: Durable intervals k of ``overhead`` and ``frequency``.
        recovery_fulls: Full-checkpoint intervals f of ``recovery``.
        batch_sizes: Batch sizes b of ``batching``.
        ratios: Top-k ratios of ``ratio``.
        gemini_persist_every: Gemini's persistence interval where no durable interval is
            asked for (``fidelity``).
    """

    ratio: float = 0.01
    lowdiff_full_every: int = 20
    lowdiff_batch: int = 5
    intervals: list[int] = field(default_factory=lambda: [1, 5, 10, 20])
    recovery_fulls: list[int] = field(default_factory=lambda: [5, 10, 20, 50])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 5, 10, 20])
    ratios: list[float] = field(default_factory=lambda: [0.001, 0.005, 0.01, 0.05, 0.1])
    gemini_persist_every: int = 10
    replica_params: int = 8_437_760
    """Parameters of ``replica`` (the LowDiff+ replica update against a bare step)."""
    replica_threads: list[int] = field(default_factory=lambda: [1, 2])
    """``replica_threads`` values of ``replica``."""
    hot_e2e_workload: str = "gpt2-3m"
    """Workload of ``hotpaths``' end-to-end LowDiff overhead (3.3M parameters)."""
    hot_trainer_workload: str = "gpt2-demo"
    """Workload of the trainer-side cost (``hotpaths``, ``breakdown``) and of the
    snapshot-bandwidth and DDP-exchange measurements."""
    hot_steps: int = 60
    """Timed steps per block of the end-to-end and trainer-side measurements."""

    def __post_init__(self) -> None:
        if self.hot_steps < 1:
            raise ValueError(f"hot_steps must be >= 1, got {self.hot_steps}")
        for name in ("intervals", "recovery_fulls", "batch_sizes", "replica_threads"):
            vals = getattr(self, name)
            if not vals or any(
                isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in vals
            ):
                raise ValueError(f"{name} must be integers >= 1, got {vals!r}")


QUICK_PROFILE = Profile(
    intervals=[1, 5, 10],
    recovery_fulls=[5, 10],
    batch_sizes=[1, 2, 5, 10],
    ratios=[0.001, 0.01, 0.1],
    hot_e2e_workload="gpt2-tiny",
    hot_trainer_workload="gpt2-tiny",
    hot_steps=10,
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


def _full_every(p: Profile, k: int) -> int:
    """LowDiff's f at durable interval k: the profile's f, or k when k is larger."""
    return max(p.lowdiff_full_every, k)


def compressed_arms(p: Profile, interval: int = 1, *, own_policies: bool = False) -> list[Arm]:
    """Compressed training at durable interval ``interval``: no checkpoint, LowDiff with
    ``b = interval``, and every baseline (see the module docstring)."""
    r, k = p.ratio, interval
    return [
        Arm("W/O CKPT", "none", r),
        Arm(
            "LowDiff",
            "lowdiff",
            r,
            _full_every(p, k),
            (("batch_size", k),),
            durable_every=k,
            memory_every=1,
        ),
        *baseline_arms(p, r, k, dcp_modes=DCP_MODES, own_policies=own_policies),
    ]


def uncompressed_arms(p: Profile, interval: int = 1, *, own_policies: bool = False) -> list[Arm]:
    """Uncompressed training at durable interval ``interval``: no checkpoint, LowDiff+
    persisting every ``interval`` steps, and every baseline."""
    k = interval
    return [
        Arm("W/O CKPT", None),
        Arm(
            "LowDiff+",
            "lowdiff+",
            None,
            _full_every(p, k),
            (("persist_every", k),),
            durable_every=k,
            memory_every=1,
        ),
        *baseline_arms(p, None, k, dcp_modes=DCP_MODES, own_policies=own_policies),
    ]


def baseline_arms(
    p: Profile,
    ratio: float | None,
    interval: int | None,
    *,
    dcp_modes: tuple[str, ...] = ("thread",),
    own_policies: bool = False,
) -> list[Arm]:
    """The baselines at durable interval ``interval``.

    ``interval=None``: Gemini checkpoints every step and persists every
    ``p.gemini_persist_every``, the others checkpoint every step (``fidelity``).
    ``own_policies`` adds CheckFreq with its own adaptive interval (``full_every="auto"``).
    With one DCP mode its label is ``"DCP async"``, else the mode is named.
    """
    nd_ratio = p.ratio if ratio is None else ratio
    k = 1 if interval is None else interval
    persist = p.gemini_persist_every if interval is None else interval
    arms = [
        Arm("torch.save", "torch-save", ratio, k, durable_every=k, memory_every=k),
        Arm("CheckFreq", "checkfreq", ratio, k, durable_every=k, memory_every=k),
    ]
    if own_policies:
        arms.append(Arm("CheckFreq (auto)", "checkfreq", ratio, "auto"))
    arms += [
        Arm(
            "Gemini",
            "gemini",
            ratio,
            1,
            (("persist_every", persist),),
            durable_every=persist,
            memory_every=1,
        ),
        Arm(
            "Naive DC",
            "naive-dc",
            ratio,
            _full_every(p, k),
            (("ratio", nd_ratio), ("diff_every", k)),
            durable_every=k,
            memory_every=k,
        ),
    ]
    for mode in dcp_modes:
        label = "DCP async" if len(dcp_modes) == 1 else f"DCP async ({mode})"
        arms.append(
            Arm(
                label,
                "dcp-async",
                ratio,
                k,
                (("async_mode", mode),),
                durable_every=k,
                memory_every=k,
            )
        )
    return arms


def _arena(ctx: Context, key: str, arms: list[Arm], periods: list[int]) -> dict[str, Any]:
    """Run (or reuse) one interleaved arena; returns ``{label: summary}`` plus disk bytes.

    Blocks are a multiple of every interval in ``periods`` (:func:`block_length`). Phases
    are timed apart in every arena (forward+backward, update+checkpoint): the breakdown
    tables reuse the overhead runs instead of training once more.
    """
    if key in ctx.cache:
        return ctx.cache[key]  # type: ignore[no-any-return]
    s = ctx.settings
    arms = [a for a in arms if ctx.wants(a.strategy)]
    sub = BenchSettings(**{**asdict(s), "iters": block_length(s.iters, periods)})
    with Arena(sub, arms, ctx.progress, phases=True) as arena:
        arena.run()
        out = arena.results()
        for r in arena.runs:
            out[r.arm.label]["disk_bytes"] = arena.disk_bytes(r)
            out[r.arm.label]["steady_full_bytes"] = newest_full_bytes(r.directory)
            if r.arm.full_every == "auto" and r.ck is not None:
                out[r.arm.label]["chosen_interval"] = r.ck.stats.get("interval")
    ctx.cache[key] = out
    return out


def _timing_arena(ctx: Context, setting: str, k: int) -> dict[str, Any]:
    p = ctx.profile
    own = k == min(p.intervals)
    arms = (compressed_arms if setting == "compressed" else uncompressed_arms)(
        p, k, own_policies=own
    )
    return _arena(ctx, f"{setting}-{k}", arms, [_full_every(p, k), k])


def _overhead_rows(
    exp: str, setting: str, res: dict[str, Any], ref: str, interval: int
) -> list[dict[str, Any]]:
    base = res[ref]["median_s"]
    rows = []
    for label, r in res.items():
        st = r.get("stats", {})
        steps = max(1.0, st.get("steps", 0.0))
        arm = r["arm"]
        durable = arm.get("durable_every")
        if arm.get("full_every") == "auto":  # 0: the policy has not chosen yet
            durable = int(r.get("chosen_interval") or 0) or None
        rows.append(
            {
                "experiment": exp,
                "setting": setting,
                "interval": interval,
                "method": label,
                **{f"arm_{k}": v for k, v in arm.items() if k != "label"},
                "durable_every": durable,
                "median_s": r["median_s"],
                "min_s": r["min_s"],
                "max_s": r["max_s"],
                "iter_median_s": r.get("iter_median_s"),
                "block_iters": r.get("block_iters"),
                "blocks": r["n"],
                "overhead": r["median_s"] / base - 1.0,
                # the fastest block of each: what other load on a shared machine only adds to
                "overhead_best": r["min_s"] / res[ref]["min_s"] - 1.0,
                "overhead_min": r["min_s"] / res[ref]["max_s"] - 1.0,
                "overhead_max": r["max_s"] / res[ref]["min_s"] - 1.0,
                "stall_s_per_step": st.get("stall_s", 0.0) / steps if st else None,
                "drain_s": r.get("drain_s"),
                "drain_max_s": r.get("drain_max_s"),
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
    """Exp. 1/2: per-iteration time at every durable interval of the profile."""
    rows: list[dict[str, Any]] = []
    for setting in ("compressed", "uncompressed"):
        for k in ctx.profile.intervals:
            res = _timing_arena(ctx, setting, k)
            rows += _overhead_rows("overhead", setting, res, "W/O CKPT", k)
    return rows


def storage(ctx: Context) -> list[dict[str, Any]]:
    """Exp. 9: bytes per checkpoint and bytes written per step (from the overhead runs at
    the smallest durable interval)."""
    k = min(ctx.profile.intervals)
    rows = []
    for setting in ("compressed", "uncompressed"):
        res = _timing_arena(ctx, setting, k)
        for label, r in res.items():
            st = r.get("stats")
            if not st:
                continue
            steps = max(1.0, st.get("steps", 0.0))
            row: dict[str, Any] = {
                "experiment": "storage",
                "setting": setting,
                "interval": k,
                "method": label,
                "steps": st.get("steps"),
                "bytes_written_per_step": _bytes_written(st) / steps,
                "disk_bytes": r.get("disk_bytes"),
                # the newest full checkpoint on disk: it holds the optimizer state, which
                # the step-0 checkpoint does not have yet
                "full_checkpoint_bytes": r.get("steady_full_bytes"),
            }
            if "record_bytes" in st:
                if st.get("records_written"):
                    row["differential_bytes"] = st["record_bytes"] / st["records_written"]
            elif "diff_bytes" in st and st.get("diffs"):
                row["differential_bytes"] = st["diff_bytes"] / st["diffs"]
            if st.get("persists") and "memory_bytes" in st:  # Gemini: in memory every step
                n = max(1.0, st.get("checkpoints", 0.0))
                row["memory_bytes_per_checkpoint"] = st["memory_bytes"] / n
            rows.append(row)
    return rows


def frequency(ctx: Context) -> list[dict[str, Any]]:
    """Exp. 4: the smallest durable interval whose slowdown is within the bound."""
    p = ctx.profile
    rows: list[dict[str, Any]] = []
    found: dict[str, int] = {}
    labels: list[str] = []
    for k in sorted(p.intervals):
        for setting in ("compressed", "uncompressed"):
            res = _timing_arena(ctx, setting, k)
            ref = res["W/O CKPT"]["median_s"]
            for label, r in res.items():
                if label.startswith("W/O") or r["arm"]["full_every"] == "auto":
                    continue
                if setting == "uncompressed" and label != "LowDiff+":
                    continue  # the baselines' figure is the compressed run's
                ov = r["median_s"] / ref - 1.0
                best = r["min_s"] / res["W/O CKPT"]["min_s"] - 1.0
                if label not in labels:
                    labels.append(label)
                rows.append(
                    {
                        "experiment": "frequency",
                        "method": label,
                        "setting": setting,
                        "interval": k,
                        "overhead": ov,
                        "overhead_best": best,
                        "median_s": r["median_s"],
                        "reference_median_s": ref,
                        "within_bound": ov <= OVERHEAD_BOUND,
                    }
                )
                if ov <= OVERHEAD_BOUND and label not in found:
                    found[label] = k
    for label in labels:
        tried = [r["interval"] for r in rows if r["method"] == label and "interval" in r]
        rows.append(
            {
                "experiment": "frequency",
                "method": label,
                "summary": True,
                "bound": OVERHEAD_BOUND,
                "min_interval": found.get(label),
                "largest_interval_tried": max(tried, default=None),
            }
        )
    return rows


def recovery(ctx: Context) -> list[dict[str, Any]]:
    """Exp. 5: every method restarted after a failure at step 2f−1.

    The failure of a method whose state lives on disk only is a stop of its training
    (``close()``, which adds no checkpoint that the interval f does not take; what is
    durable then is what a SIGKILL would have left). LowDiff+ and Gemini recover from the
    memory of a process that outlives the trainer, so their trainer is a child process
    killed with SIGKILL.
    """
    p = ctx.profile
    rows = []
    b = p.lowdiff_batch
    for f in p.recovery_fulls:
        target = 2 * f - 1  # the worst case: just before the next full checkpoint
        cases = [
            Arm("torch.save", "torch-save", None, f),
            Arm("CheckFreq", "checkfreq", None, f),
            Arm("DCP async", "dcp-async", None, f, (("async_mode", "thread"),)),
            Arm("Naive DC w/o OC", "naive-dc", None, f, (("ratio", p.ratio),)),
            Arm(
                "Naive DC w/ OC",
                "naive-dc",
                None,
                f,
                (("ratio", p.ratio), ("compress_optimizer", True)),
            ),
            Arm("LowDiff", "lowdiff", p.ratio, f, (("batch_size", min(b, f)),)),
        ]
        for arm in cases:
            if ctx.wants(arm.strategy):
                ctx.progress(f"recovery f={f}: {arm.label}")
                rows.append(_recovery_case(ctx, arm, target))
        killed = [
            Arm("Gemini (S)", "gemini", None, 1, (("persist_every", f),)),
            Arm("LowDiff+ (S)", "lowdiff+", None, f),
        ]
        for arm in killed:
            if ctx.wants(arm.strategy):
                ctx.progress(f"recovery f={f}: {arm.label}")
                rows.append(_killed_case(ctx, arm, f, target))
    return rows


def _restart(
    s: BenchSettings, arm: Arm, d: Path, f: int, target: int
) -> tuple[dict[str, Any], Any]:
    """Build the training job afresh, restart the strategy on ``d`` and train until the
    first step that was never done before is done; the timings of the restart.

    Every method is timed the same way, from just before its Checkpointer is built (the
    model and optimizer exist, as in a restarted job): ``resume_s`` to the end of
    ``resume()``, ``first_step_s`` to the end of the first training step after it,
    ``retrain_s`` the lost steps trained again, ``first_new_step_s`` to the end of step
    ``target + 1`` (the first new step: lost steps retrained, then one more).
    """
    wl = build_workload(s)
    opt = _make_optimizer(wl.model, s.lr)
    t0 = time.perf_counter()
    ck = make_checkpointer(arm, wl.model, opt, d)
    t_resume = time.perf_counter() - t0
    step = ck.step_count
    t_first: float | None = None
    t_caught_up = t_new = t_resume
    for t in range(step, target + 1):
        wl.forward_backward(t)
        ck.step()
        opt.zero_grad(set_to_none=True)
        now = time.perf_counter() - t0
        if t_first is None:
            t_first = now
        if t + 1 == target:
            t_caught_up = now
        t_new = now
    rs = ck.recovery_stats
    own = None
    if rs is not None:
        own = rs.total_s or rs.read_s + rs.decode_s + rs.replay_s
    row = {
        "experiment": "recovery",
        "method": arm.label,
        "full_every": f,
        "failure_step": target,
        "recovered_step": step,
        "read_s": rs.read_s if rs else None,
        "decompress_s": rs.decode_s if rs else None,
        "reconstruct_s": rs.replay_s if rs else None,
        "recovery_s": own,
        "resume_s": t_resume,
        "first_step_s": t_first,
        "retrained_steps": target - step,
        "retrain_s": t_caught_up - t_resume,
        "first_new_step_s": t_new,
        "bytes_read": rs.bytes_read if rs else None,
        "records_replayed": rs.records_replayed if rs else None,
        "source": rs.source if rs else None,
    }
    return row, ck


def _recovery_case(ctx: Context, arm: Arm, target: int) -> dict[str, Any]:
    s = ctx.settings
    f = int(arm.full_every)
    d = Path(s.workdir) / f"lowdiff-bench-recovery-{os.getpid()}-{arm.strategy}-{f}"
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
        row, ck2 = _restart(s, arm, d, f, target)
        ck2.close()
        return row
    finally:
        _rmtree(d)


def _killed_child(settings: dict[str, Any], directory: str, arm: Arm, steps: int) -> None:
    """Train ``steps`` steps of ``arm``, then die by SIGKILL (a software failure)."""
    try:
        s = BenchSettings(**{**settings, "workdir": Path(settings["workdir"])})
        wl = build_workload(s)
        opt = _make_optimizer(wl.model, s.lr)
        ck = make_checkpointer(arm, wl.model, opt, Path(directory))
        for t in range(steps):
            wl.forward_backward(t)
            ck.step()
            opt.zero_grad(set_to_none=True)
        ck.flush()  # the surviving process holds every step (and has persisted what is due)
    except BaseException:
        # exiting normally would wait for the background process, which waits for this one
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os.kill(os.getpid(), signal.SIGKILL)


def _killed_case(ctx: Context, arm: Arm, f: int, target: int) -> dict[str, Any]:
    s = ctx.settings
    d = Path(s.workdir) / f"lowdiff-bench-recovery-{os.getpid()}-{arm.strategy}-killed-{f}"
    _rmtree(d)
    try:
        proc = spawn_context().Process(
            target=_killed_child,
            args=({**asdict(s), "workdir": str(s.workdir)}, str(d), arm, target),
        )
        proc.start()
        proc.join(600)
        if proc.exitcode != -signal.SIGKILL:
            if proc.is_alive():
                proc.kill()
            raise RuntimeError(
                f"the {arm.label} training child did not reach its failure point (exit code "
                f"{proc.exitcode}); its traceback is above"
            )
        row, ck = _restart(s, arm, d, f, target)
        ck.close()
        return row
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
    res = _arena(ctx, "ratio", arms, [p.lowdiff_full_every, p.lowdiff_batch])
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
    """The per-iteration tables: checkpoint costs per method, LowDiff+'s phases, and
    LowDiff's own work on the training process per pipeline stage."""
    p = ctx.profile
    rows: list[dict[str, Any]] = []
    k = min(p.intervals)
    comp = _timing_arena(ctx, "compressed", k)
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
                "drain_s": r.get("drain_s"),
                "median_s": r["median_s"],
            }
        )
    unc = _timing_arena(ctx, "uncompressed", k)
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
    # LowDiff's own work on the training process, per pipeline stage
    for r in _lowdiff_steps(ctx, p.hot_trainer_workload):
        if r["table"] in ("stage", "part") or r.get("name") == "trainer_overhead":
            rows.append({**r, "experiment": "breakdown", "table": f"trainer-{r['table']}"})
    return rows


def _fidelity(ctx: Context) -> list[dict[str, Any]]:
    # imported here: lowdiff.bench.fidelity imports this module
    from lowdiff.bench.fidelity import fidelity

    return fidelity(ctx)


def replica(ctx: Context) -> list[dict[str, Any]]:
    """The LowDiff+ replica's per-step update against a bare ``torch.optim`` step of the
    same class, flags and thread count over the same parameters (issue target: at most
    1.2x), alternating blocks in this process; see :mod:`lowdiff.bench.replica`."""
    return [{"experiment": "replica", **r} for r in _replica_rows(ctx)]


def _lowdiff_steps(ctx: Context, workload: str, batch_size: int | None = 1) -> list[dict[str, Any]]:
    """LowDiff against compressed training on ``workload`` (:mod:`lowdiff.bench.hotpaths`),
    run once per bench run and shared by ``breakdown`` and ``hotpaths``."""
    from lowdiff.bench.hotpaths import lowdiff_step_bench

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


def _replica_rows(ctx: Context) -> list[dict[str, Any]]:
    from lowdiff.bench.replica import replica_update_bench

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
    from lowdiff.bench.snapshot_bw import snapshot_bandwidth_bench
    from lowdiff.bench.wire import ddp_wire_bench

    p = ctx.profile
    rows: list[dict[str, Any]] = []

    def target(n: int, name: str, value: float, goal: float | None, met: bool, **kw: Any) -> None:
        rows.append(
            {"experiment": "hotpaths", "table": "target", "target_id": n, "name": name,
             "value": value, "target": goal, "met": bool(met), **kw}
        )  # fmt: skip

    for r in _replica_rows(ctx):
        flags = ",".join(f"{k}={v}" for k, v in r["flags"].items())
        target(
            1, f"replica update / bare step ({r['optimizer'].rsplit('.', 1)[-1]} {flags}, "
            f"{r['threads']} thread(s))", r["ratio"], r["target"],
            r["meets_target"] and r["identical"], compare="<=", unit="x",
            detail=f"{r['replica_s'] * 1e3:.2f} ms vs {r['bare_s'] * 1e3:.2f} ms; "
            f"identical bits: {r['identical']}",
        )  # fmt: skip
    e2e_rows = _lowdiff_steps(ctx, p.hot_e2e_workload)
    e2e = next(r for r in e2e_rows if r.get("name") == "end_to_end_overhead")
    target(
        2, f"LowDiff end to end over compressed training ({p.hot_e2e_workload}, "
        f"{e2e['n_params'] / 1e6:.1f}M parameters, a record durable every step, "
        f"f={e2e['full_every']})", e2e["value"], e2e["target"], e2e["met"], compare="<=",
        unit="overhead", detail=f"median of {e2e['repeats']} back-to-back block pairs; "
        f"medians {e2e['lowdiff_s_per_step'] * 1e3:.1f} ms vs "
        f"{e2e['none_s_per_step'] * 1e3:.1f} ms per step "
        f"({e2e['ratio_of_medians'] * 100:+.1f}%)",
    )  # fmt: skip
    # the library's default b: records handed over every step, durable every b steps
    dflt = _lowdiff_steps(ctx, p.hot_e2e_workload, None)
    e2 = next(r for r in dflt if r.get("name") == "end_to_end_overhead")
    target(
        2, f"the same with the default b={e2['batch_size']} (a record handed over every "
        f"step, durable every {e2['batch_size']} steps)", e2["value"], None, True,
        compare="", unit="overhead", detail=f"{e2['lowdiff_s_per_step'] * 1e3:.1f} ms vs "
        f"{e2['none_s_per_step'] * 1e3:.1f} ms per step; for information, the target is b=1",
    )  # fmt: skip
    tr_rows = _lowdiff_steps(ctx, p.hot_trainer_workload)
    tr = next(r for r in tr_rows if r.get("name") == "trainer_overhead")
    target(
        3, f"LowDiff's work on the training process / step ({p.hot_trainer_workload})",
        tr["value"], tr["target"], tr["met"], compare="<=", unit="fraction",
        detail=f"{tr['trainer_s_per_step'] * 1e3:.3f} ms of a {tr['none_s_per_step'] * 1e3:.1f} "
        "ms step; per stage in the breakdown experiment",
    )  # fmt: skip
    # on the end-to-end workload (the larger model) and on the demo model, whose 52
    # gradients average 65 KB, so a copy per tensor costs it more (snapshot_over_split)
    snap: list[dict[str, Any]] = []
    for wl in dict.fromkeys((p.hot_e2e_workload, p.hot_trainer_workload)):
        snap += snapshot_bandwidth_bench(
            workload=wl, repeats=max(3, ctx.settings.repeats), progress=ctx.progress
        )
    for r in snap:
        where = "in the hook" if r["copy_mode"] == "inline" else "by the copy thread"
        target(
            4, f"LowDiff+ snapshot copies / memcpy bandwidth ({r['workload']}, "
            f"{r['grad_bytes'] / 1e6:.1f} MB in {r['tensors']} gradients)",
            r["snapshot_over_memcpy"], r["target"], r["met"] and r["identical"],
            compare=">=", unit="fraction", detail=f"{r['snapshot_gbps']:.2f} GB/s copied "
            f"{where} during backward vs {r['memcpy_gbps']:.2f} GB/s memcpy with "
            f"{r['torch_threads']} torch threads; {r['snapshot_over_split'] * 100:.0f}% of a "
            f"copy per tensor ({r['memcpy_split_gbps']:.2f} GB/s); identical bits: "
            f"{r['identical']}",
        )  # fmt: skip
    wire = ddp_wire_bench(workload=p.hot_trainer_workload, ratio=p.ratio, progress=ctx.progress)
    last = max(r["step"] for r in wire)
    w0 = next(r for r in wire if r["step"] == last and r["rank"] == 0)
    target(
        5, f"DDP exchange bytes / dense all-reduce ({p.hot_trainer_workload}, "
        f"{w0['world_size']} ranks, ratio {p.ratio})", w0["lowdiff_over_dense"], None, True,
        compare="", unit="fraction", detail=f"{w0['lowdiff_bytes']:,} vs "
        f"{w0['dense_payload_bytes']:,} bytes per rank and step; indices {w0['index_dtypes']}, "
        f"values {w0['value_dtype']}",
    )  # fmt: skip
    rows += e2e_rows + (tr_rows if tr_rows is not e2e_rows else [])
    rows += [{**r, "table": f"default-b-{r['table']}"} for r in dflt]
    rows += [{**r, "experiment": "hotpaths", "table": "snapshot"} for r in snap]
    rows += [{**r, "experiment": "hotpaths", "table": "wire"} for r in wire]
    return rows


RUNNERS: dict[str, Callable[[Context], list[dict[str, Any]]]] = {
    "overhead": overhead,
    "frequency": frequency,
    "recovery": recovery,
    "batching": batching,
    "storage": storage,
    "ratio": ratio,
    "fidelity": _fidelity,
    "breakdown": breakdown,
    "replica": replica,
    "hotpaths": hotpaths,
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

"""The ``recovery`` experiment of ``lowdiff bench`` (Exp. 5): every method restarted
after a failure at step 2f−1.

Every method checkpoints every f steps and fails just before its next full checkpoint.
Each row holds the strategy's own recovery time (read, decompress, reconstruct, from its
``recovery_stats``), and the same wall times for every method, counted from just before
the restarted job builds its Checkpointer: ``resume()``, the end of the first training
step after the restart, and the end of the first new step (lost steps retrained, then
one more).
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from lowdiff.proc.spawn import spawn_context
from lowdiff_lab.bench.context import Context
from lowdiff_lab.bench.core import (
    Arm,
    BenchSettings,
    build_workload,
    crash_after,
    make_checkpointer,
    make_optimizer,
)


def recovery(ctx: Context) -> list[dict[str, Any]]:
    """Exp. 5: every method restarted after a failure at step 2f−1.

    The failure of a method whose state lives on disk only is a stop of its training
    (``close()``, which adds no checkpoint that the interval f does not take; what is
    durable then is what a SIGKILL would have left). The "(S)" cases are a child trainer
    killed with SIGKILL whose background process outlives it: Gemini and LowDiff+ recover
    from its memory, LowDiff from disk (every record it was sent is written), and LowDiff
    and LowDiff+ take that process over instead of starting one. Each case is restarted ``min(3, repeats)`` times; its row holds
    the median of each timing.
    """
    p = ctx.profile
    rows = []
    b = p.lowdiff_batch
    n = min(RESTARTS, ctx.settings.repeats)
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
                rows.append(_median([_recovery_case(ctx, arm, target) for _ in range(n)]))
        killed = [
            Arm("LowDiff (S)", "lowdiff", p.ratio, f, (("batch_size", min(b, f)),)),
            *memory_arms(f),
        ]
        for arm in killed:
            if ctx.wants(arm.strategy):
                ctx.progress(f"recovery f={f}: {arm.label}")
                rows.append(_median([_killed_case(ctx, arm, f, target) for _ in range(n)]))
    return rows


def memory_arms(f: int) -> list[Arm]:
    """The methods that restart from the memory of a process that outlived the trainer,
    checkpointing every ``f`` steps: Gemini (S) and LowDiff+ (S)."""
    return [
        Arm("Gemini (S)", "gemini", None, 1, (("persist_every", f),)),
        Arm("LowDiff+ (S)", "lowdiff+", None, f),
    ]


RESTARTS = 3
"""Restarts measured per method and f (at most ``repeats``); the row holds their medians."""


def _median(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One row of ``rows`` (the restarts of one case): the median of every timing, the
    rest as the first restart had it, and how many restarts it sums up."""
    out = dict(rows[0], restarts=len(rows))
    for k, v in rows[0].items():
        if k.endswith("_s") and isinstance(v, float):
            vals = [r[k] for r in rows if isinstance(r.get(k), (int, float))]
            out[k] = statistics.median(vals) if vals else v
    return out


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
    opt = make_optimizer(wl.model, s.lr)
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
        "memcpy_s": _memcpy_s(wl.model, opt),
    }
    return row, ck


def _memcpy_s(model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
    """A memcpy of the whole state (parameters, buffers, optimizer state) into memory
    allocated beforehand: the floor of any recovery from memory (fastest of 3)."""
    src = [t for t in model.state_dict().values() if isinstance(t, torch.Tensor)]
    src += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    dst = [torch.empty_like(t) for t in src]
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for d, t in zip(dst, src, strict=True):
            d.copy_(t)
        best = min(best, time.perf_counter() - t0)
    return best


def _recovery_case(ctx: Context, arm: Arm, target: int) -> dict[str, Any]:
    """A method whose state lives on disk: train to ``target``, stop, restart."""
    s = ctx.settings
    f = int(arm.full_every)
    d = Path(s.workdir) / f"lowdiff-bench-recovery-{os.getpid()}-{arm.strategy}-{f}"
    shutil.rmtree(d, ignore_errors=True)
    try:
        wl = build_workload(s)
        opt = make_optimizer(wl.model, s.lr)
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
        shutil.rmtree(d, ignore_errors=True)


def _killed_child(settings: dict[str, Any], directory: str, arm: Arm, steps: int) -> None:
    """(child) Train ``steps`` steps of ``arm``, then die by SIGKILL (a software failure)."""

    def train() -> None:
        s = BenchSettings.from_dict(settings)
        wl = build_workload(s)
        opt = make_optimizer(wl.model, s.lr)
        ck = make_checkpointer(arm, wl.model, opt, Path(directory))
        for t in range(steps):
            wl.forward_backward(t)
            ck.step()
            opt.zero_grad(set_to_none=True)
        ck.flush()  # the surviving process holds every step (and has persisted what is due)

    crash_after(train, error_exit=1)


def crash_in_child(s: BenchSettings, arm: Arm, directory: Path, steps: int) -> None:
    """Train ``steps`` steps of ``arm`` on ``directory`` in a child process, which then
    dies by SIGKILL (its checkpointing processes outlive it, as after a crash).

    Raises:
        RuntimeError: the child ended otherwise (its traceback is on stderr).
    """
    proc = spawn_context().Process(
        target=_killed_child, args=(s.as_dict(), str(directory), arm, steps)
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


def _killed_case(ctx: Context, arm: Arm, f: int, target: int) -> dict[str, Any]:
    """A method that recovers from memory: a child trains to ``target`` and is
    SIGKILLed, then this process restarts the job."""
    s = ctx.settings
    d = Path(s.workdir) / f"lowdiff-bench-recovery-{os.getpid()}-{arm.strategy}-killed-{f}"
    shutil.rmtree(d, ignore_errors=True)
    try:
        crash_in_child(s, arm, d, target)
        row, ck = _restart(s, arm, d, f, target)
        ck.close()
        return row
    finally:
        shutil.rmtree(d, ignore_errors=True)

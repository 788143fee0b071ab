"""The first two training steps after a restart from memory, LowDiff+ (S) against Gemini (S).

The recovery experiment (``lowdiff bench recovery``, Exp. 5) times a restart to the end
of the first new step. This script splits that time for the two methods that restart
from the memory of a process that outlived the trainer: ``resume()``, the copy out of
that process's memory (the strategy's ``decode_s``: the optimizer state cloned into new
tensors), the first step after the restart and the one after it. A method whose copy of
a step runs in the background shows it in the step that waits for it.

Each restart is the bench's: a training child (the same workload, optimizer and
``Checkpointer`` arguments as the bench's, :func:`lowdiff_lab.bench.exp_recovery.memory_arms`) trains to step 2f − 1, flushes, and is
SIGKILLed; this process then builds the model and optimizer afresh and restarts.

Run: ``python benchmarks/first_steps.py [--workload gpt2-3m] [--full-every 5]
[--repeats 5]``; ``--json`` prints the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from lowdiff_lab.bench.core import (
    Arm,
    BenchSettings,
    build_workload,
    make_checkpointer,
    make_optimizer,
)
from lowdiff_lab.bench.exp_recovery import crash_in_child, memory_arms


def restart(s: BenchSettings, arm: Arm, f: int, workdir: Path) -> dict[str, float]:
    """One crash at step 2f − 1 and the restart; its timings in seconds."""
    d = workdir / "ck"
    shutil.rmtree(d, ignore_errors=True)
    target = 2 * f - 1
    crash_in_child(s, arm, d, target)
    wl = build_workload(s)
    opt = make_optimizer(wl.model, s.lr)
    times = [time.perf_counter()]
    ck = make_checkpointer(arm, wl.model, opt, d)
    times.append(time.perf_counter())
    if ck.step_count != target:
        raise RuntimeError(f"{arm.label} resumed at {ck.step_count}, not {target}")
    for t in range(target, target + 2):
        wl.forward_backward(t)
        ck.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter())
    rs = ck.recovery_stats
    assert rs is not None
    row = {
        "resume_s": times[1] - times[0],
        "copy_s": rs.decode_s,
        "first_step_s": times[2] - times[1],
        "second_step_s": times[3] - times[2],
        "source": rs.source,
    }
    ck.close()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="gpt2-3m")
    ap.add_argument("--full-every", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    s = BenchSettings(args.workload)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats + 1):  # the first round warms up
            for arm in memory_arms(args.full_every):
                row = restart(s, arm, args.full_every, Path(tmp))
                if i > 0:
                    rows.append({"method": arm.label, **row})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(
        f"{args.workload}, f = {args.full_every}, crash at step {2 * args.full_every - 1}, "
        f"{args.repeats} restarts per method, {torch.get_num_threads()} torch threads; "
        "min / median / max in ms"
    )
    keys = ("resume_s", "copy_s", "first_step_s", "second_step_s")
    print(f"{'method':14s}" + "".join(f"{k[:-2]:>22s}" for k in keys))
    for label in (arm.label for arm in memory_arms(args.full_every)):
        mine = [r for r in rows if r["method"] == label]
        cells = []
        for k in keys:
            v = sorted(r[k] * 1e3 for r in mine)
            cells.append(f"{v[0]:6.1f} / {statistics.median(v):6.1f} / {v[-1]:6.1f}")
        sources = sorted({r["source"] for r in mine})
        print(
            f"{label:14s}" + "".join(f"{c:>22s}" for c in cells) + f"   from {', '.join(sources)}"
        )


if __name__ == "__main__":
    main()

"""The ``batching`` experiment of ``lowdiff bench`` (Exp. 7): LowDiff's write time per
record against the batch size b, and the memory a batch holds.

The batch is assembled in host memory by the checkpointing process (offloaded batching),
so the rows report its bytes there, this process's resident memory, and on CUDA the
accelerator's peak (which should not grow with b).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from lowdiff_lab.bench.context import Context
from lowdiff_lab.bench.core import Arm, build_workload, make_checkpointer, make_optimizer
from lowdiff_lab.machine import rss_bytes


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
        shutil.rmtree(d, ignore_errors=True)
        try:
            wl = build_workload(s)
            opt = make_optimizer(wl.model, s.lr)
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
                "host_rss_bytes": rss_bytes(),
            }
            if s.device == "cuda":
                row["accelerator_peak_bytes"] = torch.cuda.max_memory_allocated()
            ck.close()
            rows.append(row)
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return rows

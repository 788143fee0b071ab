"""The ``fsdp2`` experiment: LowDiff+ every step against DCP ``async_save`` every step and
at its Young–Daly interval under ``fully_shard`` (2 gloo ranks on CPU).

It runs :mod:`lowdiff_lab.bench.fsdp2` as a 2-rank job under torchrun (``python -m
torch.distributed.run``, as its users start one) and turns the table rank 0 writes into
rows: per arm (``none``, ``lowdiff+``, ``dcp-async``, ``dcp-young-daly``) the seconds per
step until durable (the slowest rank's) and the ratio to training alone; the DCP arms also
carry their interval ``k``, their number of saves and the MTBF. Sizes and the MTBF come
from the profile (``fsdp2_width``, ``fsdp2_depth``, ``fsdp2_steps``, ``fsdp2_mtbf_s``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from lowdiff_lab.bench.context import Context
from lowdiff_lab.bench.tables import table

JOB_TIMEOUT_S = 900.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fsdp2(ctx: Context) -> list[dict[str, Any]]:
    """Run the FSDP2 job once; one row per arm.

    Raises:
        RuntimeError: If the job fails or runs past ``JOB_TIMEOUT_S`` (its output's tail
            is in the message).
    """
    p = ctx.profile
    work = Path(ctx.settings.workdir) / f"lowdiff-bench-fsdp2-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out = work / "table.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
        "--module", "lowdiff_lab.bench.fsdp2", "--dir", str(work / "scratch"),
        "--steps", str(p.fsdp2_steps), "--width", str(p.fsdp2_width),
        "--depth", str(p.fsdp2_depth), "--mtbf", repr(p.fsdp2_mtbf_s), "--out", str(out),
    ]  # fmt: skip
    ctx.progress(
        f"2 gloo ranks, width {p.fsdp2_width}, depth {p.fsdp2_depth}, {p.fsdp2_steps} steps "
        "per arm (training alone, LowDiff+, DCP async_save every step and at its Young–Daly "
        f"interval for an MTBF of {p.fsdp2_mtbf_s:g} s), each until durable"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"fsdp2: the torchrun job ran past {JOB_TIMEOUT_S:.0f} s") from e
    try:
        if r.returncode != 0 or not out.exists():
            raise RuntimeError(
                f"fsdp2: the torchrun job failed ({r.returncode}):\n"
                f"{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
            )
        doc = json.loads(out.read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return [
        {
            "experiment": "fsdp2",
            "arm": row["arm"],
            "world_size": doc["world_size"],
            "parameters": doc["parameters"],
            "steps": doc["steps"],
            "per_step_s": row["per_step_s"],
            "vs_none": row["vs_none"],
            **{k: row[k] for k in ("interval", "saves", "mtbf_s") if k in row},
            **(
                {"save_cost_s": doc["young_daly"]["save_cost_s"]}
                if row["arm"] == "dcp-young-daly"
                else {}
            ),
        }
        for row in doc["rows"]
    ]


def section_fsdp2(rows: list[dict[str, Any]]) -> str:
    """The report section: one line per arm, and LowDiff+ against both DCP arms."""
    mine = [r for r in rows if r.get("experiment") == "fsdp2"]
    if not mine:
        return ""
    by = {r["arm"]: r for r in mine}
    first = mine[0]
    lines = [
        "## FSDP2: LowDiff+ every step against DCP async_save every step and at its "
        "Young–Daly interval",
        "",
        f"{first['world_size']} gloo ranks, {first['parameters']:,} parameters, AdamW, "
        f"{first['steps']} steps per arm, each timed until durable (the slowest rank).",
        "",
        table(
            ["arm", "s/step until durable", "vs training alone", "DCP saves (every k steps)"],
            [
                [
                    r["arm"],
                    f"{r['per_step_s']:.4f}",
                    f"{r['vs_none']:.2f}x",
                    f"{r['saves']} (k = {r['interval']})" if "saves" in r else "",
                ]
                for r in mine
            ],
        ),
    ]
    yd = by.get("dcp-young-daly")
    if yd is not None:
        lines += [
            "",
            f"DCP's Young–Daly interval k = max(1, round(sqrt(2 C M) / t)) = {yd['interval']} "
            f"steps, with the save cost C = {yd.get('save_cost_s', 0.0):.4f} s measured in "
            f"this run (dcp-async's time per step minus training alone's, t = "
            f"{by['none']['per_step_s']:.4f} s) and the MTBF M = {yd['mtbf_s']:g} s; it also "
            "saves after the last step, so the run's end is durable.",
        ]
    for other, what in (
        ("dcp-async", "every step"),
        ("dcp-young-daly", "at its Young–Daly interval"),
    ):
        if "lowdiff+" in by and other in by:
            ratio = by["lowdiff+"]["per_step_s"] / by[other]["per_step_s"]
            lines += [
                "",
                f"LowDiff+ every step takes {ratio:.2f}x the time of DCP async_save {what}.",
            ]
    return "\n".join(lines) + "\n"


__all__ = ["fsdp2", "section_fsdp2"]

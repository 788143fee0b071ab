"""LowDiff's checkpoint and recovery costs, measured in a chaos run, as a :class:`lowdiff.plan.CostModel`.

The inputs of the paper's wasted-time model come from the LowDiff jobs of the same run:

- ``tau`` and ``total_time``: the reference job without checkpointing (median step
  interval, failure-free duration);
- ``full_bytes`` and the full write cost ``C_F``: the final training process's counters
  (``ck.stats``: bytes and write seconds of the full checkpoints it wrote);
  ``full_latency`` is what is left of ``C_F`` beyond ``S_F / W``;
- ``record_bytes`` and ``batch_overhead_bytes``: a line through bytes per record file
  against records per file (one point per job; with one batch size, all bytes go to the
  records);
- ``write_bw`` and ``batch_latency``: :func:`lowdiff.plan.fit_bandwidth` of write seconds
  per record file against bytes per file;
- ``read_bw``: the same fit of read seconds against bytes read over the recoveries from
  disk (the ``resumed`` events' recovery stats); ``decompress_s_per_record`` and
  ``replay_s_per_record``: decode and replay seconds per replayed record;
  ``full_recovery_s``: the median of what a recovery took beyond its records.
"""

from __future__ import annotations

import statistics
from typing import Any

from lowdiff.plan import CostModel, fit_bandwidth, fit_line
from lowdiff_lab.chaos.supervisor import JobResult


def measured_costs(jobs: list[JobResult]) -> dict[str, Any]:
    """The raw LowDiff cost measurements of ``jobs`` (JSON-able).

    Returns:
        ``{"files": [...], "fulls": [...], "recoveries": [...]}``: per job, the record
        files (records, bytes, write seconds, per file) and full checkpoints (bytes, write
        seconds, per checkpoint) of its last process; per recovery from disk, its stats.
    """
    files, fulls, recoveries = [], [], []
    for job in jobs:
        st = job.result.get("ck_stats") or {}
        n_files = int(st.get("record_files_written") or 0)
        if n_files:
            files.append(
                {
                    "job": job.name,
                    "records_per_file": float(st["records_written"]) / n_files,
                    "bytes_per_file": float(st["record_bytes"]) / n_files,
                    "write_s_per_file": float(st["record_write_s"]) / n_files,
                }
            )
        n_fulls = int(st.get("fulls_written") or 0)
        if n_fulls:
            fulls.append(
                {
                    "job": job.name,
                    "bytes": float(st["full_bytes"]) / n_fulls,
                    "write_s": float(st["full_write_s"]) / n_fulls,
                }
            )
        for a in job.attempts[1:]:
            r = a.recovery or {}
            if r.get("source", "disk") == "disk" and r.get("bytes_read"):
                recoveries.append({"job": job.name, **r})
    return {"files": files, "fulls": fulls, "recoveries": recoveries}


def cost_inputs(costs: dict[str, Any]) -> dict[str, float]:
    """The :class:`lowdiff.plan.CostModel` inputs (all but ``tau``, ``total_time``, ``mtbf``).

    Raises:
        ValueError: no record file, full checkpoint or recovery from disk was measured.
    """
    files, fulls, recs = costs["files"], costs["fulls"], costs["recoveries"]
    missing = [n for n, v in (("record files", files), ("full checkpoints", fulls)) if not v]
    if not any(r.get("records_replayed") for r in recs):
        missing.append("recoveries that replayed records")
    if missing:
        raise ValueError(f"cannot build the cost model: no {', '.join(missing)} measured")
    line = fit_line([f["records_per_file"] for f in files], [f["bytes_per_file"] for f in files])
    if line is not None and line[1] > 0:
        overhead, record_bytes = max(0.0, line[0]), line[1]
    else:
        record_bytes = sum(f["bytes_per_file"] for f in files) / sum(
            f["records_per_file"] for f in files
        )
        overhead = 0.0
    write_bw, batch_latency = fit_bandwidth(
        [f["bytes_per_file"] for f in files], [f["write_s_per_file"] for f in files]
    )
    full_bytes = statistics.median(f["bytes"] for f in fulls)
    c_f = statistics.median(f["write_s"] for f in fulls)
    read_bw, _ = fit_bandwidth(
        [float(r["bytes_read"]) for r in recs], [float(r["read_s"]) for r in recs]
    )
    n_rec = sum(int(r.get("records_replayed") or 0) for r in recs)
    decode = sum(float(r.get("decode_s") or 0.0) for r in recs) / n_rec
    replay = sum(float(r.get("replay_s") or 0.0) for r in recs) / n_rec
    rest = [
        max(
            0.0,
            float(r["total_s"])
            - int(r.get("records_replayed") or 0) * (decode + replay)
            - max(0.0, float(r["bytes_read"]) - full_bytes) / read_bw,
        )
        for r in recs
    ]
    return {
        "full_bytes": full_bytes,
        "record_bytes": record_bytes,
        "batch_overhead_bytes": overhead,
        "write_bw": write_bw,
        "batch_latency": batch_latency,
        "full_latency": max(0.0, c_f - full_bytes / write_bw),
        "read_bw": read_bw,
        "full_recovery_s": statistics.median(rest),
        "decompress_s_per_record": decode,
        "replay_s_per_record": replay,
    }


def cost_model(costs: dict[str, Any], *, tau: float, total_time: float, mtbf: float) -> CostModel:
    """The wasted-time model of the measured ``costs`` for a job of ``total_time`` seconds
    of steps of ``tau`` under failures ``mtbf`` seconds apart.

    Raises:
        ValueError: as :func:`cost_inputs`.
    """
    inputs = cost_inputs(costs)
    # every input is a float field of the model (n_gpus, its one int field, is not one)
    return CostModel(tau=tau, total_time=total_time, mtbf=mtbf, **inputs)  # type: ignore[arg-type]


__all__ = ["cost_inputs", "cost_model", "measured_costs"]

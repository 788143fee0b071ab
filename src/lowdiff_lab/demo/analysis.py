"""What the demo measures from its runs: the recovered state against the reference, the
sizes of records and full checkpoints, and the training-time overhead."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from lowdiff.inspection import inspect_dir
from lowdiff.state.capture import diff_states
from lowdiff_lab.demo.settings import SPARSIFIERS

WARMUP_SKIP_MAX = 10
"""At most this many leading steps of each timed run are left out of the overhead."""


def compare_states(path_a: Path, path_b: Path) -> dict[str, Any]:
    """Compare two state dumps key by key with ``torch.equal`` (dtype and shape included).

    Returns:
        ``{"bit_identical": bool, "n_keys": int, "mismatched_keys": [...],
        "only_in_recovered": [...], "only_in_reference": [...]}``.
    """
    a = load_file(str(path_a))
    b = load_file(str(path_b))
    problems = diff_states(a, b)
    only_a = [p.removeprefix("missing ") for p in problems if p.startswith("missing ")]
    only_b = [p.removeprefix("extra ") for p in problems if p.startswith("extra ")]
    mismatched = [p for p in problems if not p.startswith(("missing ", "extra "))]
    return {
        "bit_identical": not (mismatched or only_a or only_b),
        "n_keys": len(set(a) | set(b)),
        "mismatched_keys": mismatched,
        "only_in_recovered": only_a,
        "only_in_reference": only_b,
    }


def storage_stats(directory: Path, n_params: int, compressor: dict[str, Any]) -> dict[str, Any]:
    """Record and full-checkpoint sizes of a finished lowdiff directory."""
    info = inspect_dir(directory)
    rec_bytes = sum(f.nbytes for f in info.record_files)
    n_records = sum(f.n_records for f in info.record_files)
    per_record = rec_bytes / n_records if n_records else None
    # the full checkpoints taken once optimizer state exists (step 0's has none)
    per_full = info.bytes_per_full if info.full_checkpoints else None
    ratio = compressor.get("ratio") if compressor.get("kind") in SPARSIFIERS else None
    return {
        "record_files": len(info.record_files),
        "records": n_records,
        "record_bytes_total": rec_bytes,
        "bytes_per_record": per_record,
        "full_checkpoints": len(info.full_checkpoints),
        "bytes_per_full": per_full,
        "full_over_record": per_full / per_record if per_record and per_full else None,
        "record_bytes_per_param": per_record / n_params if per_record else None,
        # A sparsifier keeps ratio * n values: 4-byte value + 4-byte index each.
        "expected_bytes_per_param": 8 * ratio if ratio is not None else None,
        "recoverable": list(info.recoverable) if info.recoverable else None,
    }


def _warmup_skip(n: int) -> int:
    return min(WARMUP_SKIP_MAX, max(1, n // 20))


def overhead_stats(reference: dict[str, Any], lowdiff_run: dict[str, Any]) -> dict[str, Any]:
    """Training-time overhead of (d) over (c) on steady-state steps.

    Both the median step time (robust to the stalls of a shared machine) and the summed
    step time (which includes the periodic full-checkpoint steps) are compared.
    """
    a = reference["step_times"]
    b = lowdiff_run["step_times"]
    skip = _warmup_skip(min(len(a), len(b)))
    a, b = a[skip:], b[skip:]
    if not a or not b:
        return {"warmup_steps_skipped": skip, "steps_timed": 0}
    med_a, med_b = statistics.median(a), statistics.median(b)
    tot_a, tot_b = sum(a), sum(b)
    return {
        "warmup_steps_skipped": skip,
        "steps_timed": min(len(a), len(b)),
        "median_step_s_none": med_a,
        "median_step_s_lowdiff": med_b,
        "median_overhead_pct": 100.0 * (med_b / med_a - 1.0),
        "total_s_none": tot_a,
        "total_s_lowdiff": tot_b,
        "total_overhead_pct": 100.0 * (tot_b / tot_a - 1.0),
        "close_s_lowdiff": lowdiff_run.get("close_s"),
    }


__all__ = ["WARMUP_SKIP_MAX", "compare_states", "overhead_stats", "storage_stats"]

"""The inputs of the cost model, measured by a ``lowdiff bench`` run.

``lowdiff bench overhead storage batching recovery`` writes one JSON line per measured
row; :func:`bench_inputs` reads the rows of those four experiments back and derives each
:class:`~lowdiff.plan.model.CostModel` input from them, and :func:`cost_model_from_bench`
adds the failure model (MTBF, training time, GPUs) the benchmark cannot measure.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lowdiff.errors import InvalidArgumentError
from lowdiff.plan.fit import fit_bandwidth
from lowdiff.plan.model import CostModel

__all__ = ["BENCH_EXPERIMENTS", "INPUT_SOURCES", "bench_inputs", "cost_model_from_bench"]

BENCH_EXPERIMENTS = ("overhead", "storage", "batching", "recovery")
"""The ``lowdiff bench`` experiments :func:`cost_model_from_bench` reads."""

INPUT_SOURCES: dict[str, str] = {
    "tau": "overhead",
    "full_bytes": "storage",
    "record_bytes": "batching",
    "batch_overhead_bytes": "storage",
    "write_bw": "batching",
    "batch_latency": "batching",
    "full_latency": "batching",
    "read_bw": "recovery",
    "full_recovery_s": "recovery",
    "decompress_s_per_record": "recovery",
    "replay_s_per_record": "recovery",
}
"""Which experiment of :data:`BENCH_EXPERIMENTS` each :class:`CostModel` input comes from
(field name to experiment), so that an error about a missing input can name the
experiment to run."""


def _read_results(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The run header (``"kind": "run"``, empty if none) and the rows of a results file."""
    run: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    with open(path) as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidArgumentError(f"{path}:{i}: not a JSON line ({e.msg})") from None
            if not isinstance(obj, dict):
                raise InvalidArgumentError(f"{path}:{i}: expected a JSON object")
            if obj.get("kind") == "run":
                run = obj
            elif obj.get("kind") == "row" or "experiment" in obj:
                rows.append(obj)
    return run, rows


def _pick(rows: list[dict[str, Any]], exp: str, **match: Any) -> list[dict[str, Any]]:
    """The rows of experiment ``exp`` whose fields equal ``match``."""
    return [
        r
        for r in rows
        if r.get("experiment") == exp and all(r.get(k) == v for k, v in match.items())
    ]


def _batching_inputs(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """``record_bytes``, ``write_bw`` and both latencies, from the ``batching`` rows."""
    batching = [r for r in _pick(rows, "batching") if r.get("writes") and r.get("record_row_bytes")]
    if not batching:
        return None
    row_bytes = float(batching[0]["record_row_bytes"])
    w, lat = fit_bandwidth(
        [row_bytes * r["records"] / r["writes"] for r in batching],
        [float(r["write_s_per_write"]) for r in batching],
    )
    return {"record_bytes": row_bytes, "write_bw": w, "batch_latency": lat, "full_latency": lat}


def _storage_inputs(
    rows: list[dict[str, Any]], run: dict[str, Any], record_bytes: float | None
) -> dict[str, float] | None:
    """``full_bytes`` and, given the record row size, ``batch_overhead_bytes``."""
    store = _pick(rows, "storage", setting="compressed", method="LowDiff")
    if not (store and store[0].get("full_checkpoint_bytes")):
        return None
    out = {"full_bytes": float(store[0]["full_checkpoint_bytes"])}
    per_record = store[0].get("differential_bytes")
    b = int(run.get("profile", {}).get("lowdiff_batch", 0) or 0)
    if per_record and b and record_bytes is not None:
        out["batch_overhead_bytes"] = max(0.0, (float(per_record) - record_bytes) * b)
    return out


def _recovery_inputs(rows: list[dict[str, Any]], full_bytes: float) -> dict[str, float] | None:
    """``read_bw``, the per-record decompression and replay times and ``full_recovery_s``."""
    rec = [r for r in _pick(rows, "recovery", method="LowDiff") if r.get("recovery_s") is not None]
    if not rec:
        return None
    bw_r, _ = fit_bandwidth(
        [float(r["bytes_read"]) for r in rec], [float(r["read_s"]) for r in rec]
    )
    n = sum(int(r.get("records_replayed") or 0) for r in rec)
    dec = sum(float(r["decompress_s"]) for r in rec) / n if n else 0.0
    rep = sum(float(r["reconstruct_s"]) for r in rec) / n if n else 0.0
    rest = sorted(
        max(
            0.0,
            float(r["recovery_s"])
            - int(r.get("records_replayed") or 0) * (dec + rep)
            - max(0.0, float(r["bytes_read"]) - full_bytes) / bw_r,
        )
        for r in rec
    )
    return {
        "read_bw": bw_r,
        "decompress_s_per_record": dec,
        "replay_s_per_record": rep,
        "full_recovery_s": rest[len(rest) // 2],
    }


def bench_inputs(results_jsonl_path: str | Path) -> tuple[dict[str, float], list[str]]:
    """The :class:`CostModel` inputs a ``lowdiff bench`` results file gives.

    Returns:
        ``(inputs, missing)``: the inputs found (field name to value) and the
        experiments of :data:`BENCH_EXPERIMENTS` the file lacks.

    How each input is measured:

    - ``tau``: the median iteration time of compressed training without checkpoints
      (``overhead``, arm "W/O CKPT").
    - ``full_bytes``: LowDiff's full-checkpoint size (``storage``); the record files'
      bytes beyond their rows give ``batch_overhead_bytes``.
    - ``record_bytes``, ``write_bw``, ``batch_latency``: the record row size and a least
      squares fit of write time per file against bytes per file over the batch sizes
      (``batching``). ``full_latency`` is taken equal to ``batch_latency`` (the same
      write, fsync and rename).
    - ``read_bw``: a fit of read time against bytes read; ``decompress_s_per_record`` and
      ``replay_s_per_record``: decompression and reconstruction time per replayed
      record; ``full_recovery_s``: the recovery time left once the records' share is
      taken off (median over the LowDiff rows of ``recovery``).
    """
    path = Path(results_jsonl_path)
    if not path.is_file():
        raise FileNotFoundError(f"no bench results file at {path}")
    run, rows = _read_results(path)
    out: dict[str, float] = {}
    missing: list[str] = []
    ref = _pick(rows, "overhead", setting="compressed", method="W/O CKPT")
    if ref and ref[0].get("median_s"):
        out["tau"] = float(ref[0]["median_s"])
    else:
        missing.append("overhead")
    # in this order: the storage inputs need the record size, the recovery ones the full size
    parts = (
        ("batching", lambda: _batching_inputs(rows)),
        ("storage", lambda: _storage_inputs(rows, run, out.get("record_bytes"))),
        ("recovery", lambda: _recovery_inputs(rows, out.get("full_bytes", 0.0))),
    )
    for exp, derive in parts:
        found = derive()
        if found is None:
            missing.append(exp)
        else:
            out.update(found)
    return out, missing


def cost_model_from_bench(
    results_jsonl_path: str | Path, *, mtbf: float, total_time: float, n_gpus: int = 1
) -> CostModel:
    """A :class:`CostModel` from the measurements of a ``lowdiff bench`` run.

    The file must hold the experiments ``overhead``, ``storage``, ``batching`` and
    ``recovery`` (``lowdiff bench overhead storage batching recovery``); see
    :func:`bench_inputs` for how each input is derived.

    Raises:
        ValueError: the file lacks one of those experiments (named in the message).
        FileNotFoundError: there is no such file.

    Example:
        >>> m = cost_model_from_bench("results/results.jsonl", mtbf=3600, total_time=86400)  # doctest: +SKIP
        >>> optimize(m).f  # doctest: +SKIP
    """
    inputs, missing = bench_inputs(results_jsonl_path)
    if missing:
        raise InvalidArgumentError(
            f"{results_jsonl_path} lacks the bench experiment(s) {', '.join(missing)} "
            f"(needed for {', '.join(k for k, v in INPUT_SOURCES.items() if v in missing)}); "
            f"run `lowdiff bench {' '.join(BENCH_EXPERIMENTS)}`"
        )
    return CostModel(mtbf=mtbf, total_time=total_time, n_gpus=n_gpus, **inputs)

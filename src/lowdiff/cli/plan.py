"""``lowdiff plan``: the (f, b) that minimises the expected wasted time, from given costs.

Every input of :class:`lowdiff.plan.CostModel` is a flag (human units accepted:
``--mtbf 1h``, ``--full-bytes 8.7G``, ``--write-bw 2GB/s``), or comes from a
``lowdiff bench`` results file (``--from-bench results.jsonl``; flags given as well
override what the file says).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lowdiff.errors import InvalidArgumentError
from lowdiff.plan import INPUT_SOURCES, CostModel, Plan, bench_inputs, optimize

_DURATION_UNITS = {
    "": 1.0,
    "s": 1.0,
    "sec": 1.0,
    "ms": 1e-3,
    "us": 1e-6,
    "µs": 1e-6,
    "m": 60.0,
    "min": 60.0,
    "h": 3600.0,
    "d": 86400.0,
}
_SIZE_UNITS = {
    "": 1.0,
    "b": 1.0,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "kib": 2.0**10,
    "mib": 2.0**20,
    "gib": 2.0**30,
    "tib": 2.0**40,
}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-zµ/]*)\s*$")


def _parse(text: str, units: dict[str, float], what: str, example: str) -> float:
    m = _NUMBER.match(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in units:
        raise argparse.ArgumentTypeError(
            f"expected a {what} such as {example} (units: {', '.join(u for u in units if u)}), "
            f"got {text!r}"
        )
    value = float(m.group(1)) * units[unit]
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite {what}, got {text!r}")
    return value


def duration(text: str) -> float:
    """Seconds from ``"0.5"``, ``"500ms"``, ``"90s"``, ``"10min"``, ``"1h"``, ``"7d"``."""
    return _parse(text, _DURATION_UNITS, "duration", "0.5, 500ms, 10min, 1h, 7d")


def size(text: str) -> float:
    """Bytes from ``"123"``, ``"8.7G"``/``"8.7GB"`` (powers of 1000) or ``"8GiB"`` (of 1024)."""
    return _parse(text, _SIZE_UNITS, "size", "8.7G, 512MiB, 20MB")


def rate(text: str) -> float:
    """Bytes per second from ``"2G"``, ``"2GB/s"`` or ``"500MiB/s"``."""
    t = text.strip()
    if t.lower().endswith("/s"):
        t = t[:-2]
    try:
        return size(t)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected a bandwidth such as 2GB/s or 500MiB/s, got {text!r}"
        ) from None


def int_list(text: str) -> list[int]:
    """``"10,30,50"`` or ranges ``"1-6"`` (and mixes: ``"1-4,8,16"``)."""
    out: list[int] = []
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise argparse.ArgumentTypeError(
                        f"range {part!r} runs backwards: write it low-high ({hi}-{lo})"
                    )
                out.extend(range(lo, hi + 1))
            elif part:
                out.append(int(part))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers such as 10,30,50 or 1-6, got {text!r}"
        ) from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return sorted(set(out))


# (flag, CostModel field, parser, help)
_INPUTS: list[tuple[str, str, Callable[[str], Any], str]] = [
    ("--n-gpus", "n_gpus", int, "number of GPUs N (default 1)"),
    ("--tau", "tau", duration, "iteration time tau (e.g. 0.5, 450ms)"),
    ("--total-time", "total_time", duration, "failure-free training time T (e.g. 24h, 7d)"),
    ("--mtbf", "mtbf", duration, "mean time between failures M of the whole job (e.g. 1h)"),
    ("--full-bytes", "full_bytes", size, "size S_F of one full checkpoint (e.g. 8.7G)"),
    ("--record-bytes", "record_bytes", size, "size of one differential record (e.g. 20MB)"),
    (
        "--batch-overhead-bytes",
        "batch_overhead_bytes",
        size,
        "bytes of a record file that do not grow with b (default 0)",
    ),
    ("--write-bw", "write_bw", rate, "write bandwidth W (e.g. 2GB/s)"),
    ("--read-bw", "read_bw", rate, "read bandwidth W_r (default: the write bandwidth)"),
    ("--full-latency", "full_latency", duration, "fixed latency L_F of a full write (default 0)"),
    (
        "--batch-latency",
        "batch_latency",
        duration,
        "fixed latency L_B of a record-file write (default 0)",
    ),
    (
        "--full-recovery",
        "full_recovery_s",
        duration,
        "time R_F to restore one full checkpoint (default 0)",
    ),
    (
        "--decompress",
        "decompress_s_per_record",
        duration,
        "decompression time per record (default 0)",
    ),
    (
        "--replay",
        "replay_s_per_record",
        duration,
        "replay (optimizer step) time per record (default 0)",
    ),
]
_FLAG = {fld: flag for flag, fld, _, _ in _INPUTS}
_REQUIRED = ("tau", "total_time", "mtbf", "full_bytes", "record_bytes", "write_bw")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan",
        help="the full-checkpoint interval f and batch size b with the least expected wasted time",
        description=(
            "Evaluates the paper's wasted-time model T_w(f, b) and prints its argmin over "
            "integers 1 <= b <= f, the model's terms, the continuous optimum f_c(b*) and a table "
            "of T_w normalised to the minimum. Inputs are flags, or --from-bench RESULTS.jsonl "
            "(a `lowdiff bench overhead storage batching recovery` run) plus --mtbf and "
            "--total-time; flags override the file. Sizes: 8.7G = 8.7e9 bytes, 8GiB = 8 * 2^30."
        ),
    )
    for flag, fld, parse, help_ in _INPUTS:
        p.add_argument(flag, dest=fld, type=parse, default=None, help=help_)
    p.add_argument(
        "--from-bench",
        type=Path,
        default=None,
        metavar="RESULTS.jsonl",
        help="take tau, sizes, bandwidths and recovery costs from a lowdiff bench run",
    )
    p.add_argument(
        "--f-values",
        type=int_list,
        default=None,
        help="candidate f (e.g. 10,30,50,100); default: every f that can be optimal",
    )
    p.add_argument(
        "--b-values", type=int_list, default=None, help="candidate b (e.g. 1-6); default: 1-32"
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)
    return p


def build_model(args: argparse.Namespace) -> CostModel:
    """The CostModel of the flags (and of ``--from-bench``); errors name the flag."""
    values: dict[str, Any] = {}
    missing_exps: list[str] = []
    if args.from_bench is not None:
        values, missing_exps = bench_inputs(args.from_bench)
    for _, fld, _, _ in _INPUTS:
        v = getattr(args, fld)
        if v is not None:
            values[fld] = v
    if "read_bw" not in values and "write_bw" in values:
        values["read_bw"] = values["write_bw"]
    lacking = [f for f in _REQUIRED if f not in values]
    if lacking:
        flags = ", ".join(_FLAG[f] for f in lacking)
        hint = ""
        exps = sorted({INPUT_SOURCES[f] for f in lacking if f in INPUT_SOURCES} & set(missing_exps))
        if exps:
            hint = f" ({args.from_bench} lacks the bench experiment(s) {', '.join(exps)})"
        elif args.from_bench is None:
            hint = " (or take measured costs with --from-bench RESULTS.jsonl)"
        raise InvalidArgumentError(f"missing {flags}{hint}")
    try:
        return CostModel(**values)
    except ValueError as e:
        msg = str(e)
        for fld, flag in _FLAG.items():
            msg = msg.replace(f"CostModel.{fld} ", f"{flag} ")
        raise InvalidArgumentError(msg) from None


def _table_axes(plan: Plan, args: argparse.Namespace) -> tuple[list[int], list[int]]:
    if args.f_values is not None:
        fs = list(args.f_values)
    else:
        fs = sorted({max(1, round(plan.f * k)) for k in (0.25, 0.5, 1, 2, 4)} | {plan.f})
    if args.b_values is not None:
        bs = list(args.b_values)
    else:
        top = max(b for _, b in plan.grid)
        near = {plan.b - 1, plan.b, plan.b + 1}
        bs = sorted(b for b in {1, 2, 3, 4, 6, 8, 12, 16, 24, 32} | near if 1 <= b <= top)
    return fs, bs


def _fmt_s(x: float) -> str:
    if abs(x) >= 3600:
        return f"{x / 3600:.2f} h"
    if abs(x) >= 60:
        return f"{x / 60:.1f} min"
    return f"{x:.3g} s"


_TERM_NAMES = {
    "lost_work": "lost work (b*tau/2 per failure)",
    "full_recovery": "full-checkpoint recovery (R_F per failure)",
    "replay": "record replay (R_B(b)/2 * (f/b - 1) per failure)",
    "full_writes": "full-checkpoint writes (C_F every f steps)",
    "batch_writes": "record-file writes (C_B(b), f/b - 1 per f steps)",
}


def run(args: argparse.Namespace) -> int:
    model = build_model(args)
    plan = optimize(model, args.f_values, args.b_values)
    fs, bs = _table_axes(plan, args)
    table = plan.table(fs, bs)
    if args.json:
        out = plan.as_dict()
        out["c_f"] = model.c_f()
        out["c_b"] = model.c_b(plan.b)
        out["r_b"] = model.r_b(plan.b)
        out["table"] = {
            "f_values": fs,
            "b_values": bs,
            "normalized": [[table[(f, b)] for b in bs] for f in fs],
        }
        print(json.dumps(out, indent=1))
        return 0
    gpu_time = model.n_gpus * model.total_time
    print(
        f"f* = {plan.f}   b* = {plan.b}   predicted wasted time T_w = {_fmt_s(plan.wasted_s)} "
        f"GPU time ({100 * plan.wasted_s / gpu_time:.2f}% of N*T)"
    )
    fc = plan.f_c
    print(
        "f_c(b*) = "
        + (f"{fc:.1f} (continuous optimum)" if fc is not None else "none (C_F <= C_B(b*))")
    )
    print(
        f"expected failures T/M = {model.expected_failures:.3g}   C_F = {_fmt_s(model.c_f())}   "
        f"C_B(b*) = {_fmt_s(model.c_b(plan.b))}   R_B(b*) = {_fmt_s(model.r_b(plan.b))}"
    )
    print("\nterms of T_w(f*, b*):")
    for k, v in plan.terms().items():
        print(f"  {_TERM_NAMES[k]:<52} {_fmt_s(v):>10}")
    print("\ninputs:")
    for k, v in model.as_dict().items():
        print(f"  {_FLAG[k]:<24} {v:.6g}")
    print(f"\nnormalized wasted time T_w(f, b) / T_w({plan.f}, {plan.b}):")
    print("  " + "f \\ b".rjust(8) + "".join(f"{b:>8}" for b in bs))
    for f in fs:
        cells = []
        for b in bs:
            cell = table[(f, b)]
            cells.append(f"{'-':>8}" if cell is None else f"{cell:>8.3f}")
        print("  " + f"{f:>8}" + "".join(cells))
    return 0

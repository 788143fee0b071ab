"""``lowdiff bench``: run the benchmark experiments and write the report."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from lowdiff.cli.args import DeprecatedFlag, method_list, output_dir, positive_int
from lowdiff_lab.bench import FULL_WORKLOAD, QUICK_WORKLOAD, run_bench
from lowdiff_lab.bench.core import BenchSettings
from lowdiff_lab.bench.experiments import DEFAULT_EXPERIMENTS, EXPERIMENTS
from lowdiff_lab.harness import end_progress, progress_printer


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``lowdiff bench`` and its options to the CLI's subcommands."""
    p = subparsers.add_parser(
        "bench",
        help="LowDiff, LowDiff+ and the baselines side by side; writes JSON, Markdown and PNG",
        description=(
            "Runs the paper's experiments (default: all) with every strategy interleaved in one run, "
            "and writes results.jsonl, report.md and one PNG per experiment into --out."
        ),
    )
    p.add_argument(
        "experiments",
        nargs="*",
        metavar="EXPERIMENT",
        help=f"any of: {', '.join(EXPERIMENTS)} (default: all but fidelity, hotpaths and fsdp2)",
    )
    p.add_argument(
        "--quick", action="store_true", help="tiny workload, few sizes (minutes on a CPU)"
    )
    p.add_argument(
        "--out", type=Path, default=Path("results"), help="output folder (default: results)"
    )
    p.add_argument("--workload", default=None, help="workload name (see lowdiff_lab.workloads.zoo)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--steps",
        dest="iters",
        type=positive_int,
        default=None,
        help="training steps per timed block, at least (rounded up to a multiple of every "
        "checkpoint interval of the experiment; default 20)",
    )
    p.add_argument("--iters", action=DeprecatedFlag, new="--steps", dest="iters", type=positive_int)
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=None,
        help="timed blocks per method (default 7 quick, 5 full)",
    )
    p.add_argument("--batch-size", type=int, default=None, help="training batch size")
    p.add_argument("--amp", choices=("bf16", "fp16"), default=None, help="mixed precision")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    p.add_argument("--workdir", type=Path, default=None, help="where checkpoints go while it runs")
    p.add_argument(
        "--methods",
        default=None,
        help="comma-separated strategies to compare (default: all of lowdiff, lowdiff+, "
        "torch-save, checkfreq, gemini, naive-dc, dcp-async); every arm keeps its own model copy",
    )
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run the experiments the arguments name, write the report, print the files."""
    experiments = args.experiments or list(DEFAULT_EXPERIMENTS)
    bad = [e for e in experiments if e not in EXPERIMENTS]
    if bad:
        raise ValueError(f"unknown experiment(s) {', '.join(bad)}; known: {', '.join(EXPERIMENTS)}")
    settings = BenchSettings(
        args.workload or (QUICK_WORKLOAD if args.quick else FULL_WORKLOAD),
        device=args.device,
        iters=args.iters or 20,
        repeats=args.repeats or (7 if args.quick else 5),
        workdir=args.workdir or Path(tempfile.gettempdir()),
        amp=args.amp,
        grad_accum=args.grad_accum,
        batch_size=args.batch_size,
    )
    t0 = time.monotonic()
    progress = progress_printer(args.quiet)
    methods = method_list(args.methods)
    output_dir(args.out)
    files = run_bench(
        experiments,
        out=args.out,
        quick=args.quick,
        settings=settings,
        progress=progress,
        methods=methods,
    )
    end_progress(args.quiet)
    print(f"lowdiff bench: {len(experiments)} experiment(s) in {time.monotonic() - t0:.0f} s")
    for name, path in files.items():
        print(f"  {name}: {path}")
    return 0

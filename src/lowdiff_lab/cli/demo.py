"""``lowdiff demo``: kill a real training job mid-run, resume it, and prove the state exact.

The command over :mod:`lowdiff_lab.demo`: it turns the flags into
:func:`lowdiff_lab.demo.demo_settings`, runs :func:`lowdiff_lab.demo.orchestrate` (four training
runs: killed, resumed, reference, uninterrupted) and prints
:func:`lowdiff_lab.demo.format_report` (``--json`` also writes the report). The exit code is 0
when the recovered state is bit-identical to the reference, else 1 (2 for a bad option).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any

from lowdiff.cli.args import DeprecatedFlag, output_file
from lowdiff_lab.demo import (
    COMPRESSORS,
    STRATEGIES,
    DemoError,
    DemoSettings,
    demo_settings,
    format_report,
    orchestrate,
)
from lowdiff_lab.harness import sigterm_as_interrupt


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``demo`` on an ``argparse`` sub-parser collection.

    Args:
        subparsers: The object returned by ``ArgumentParser.add_subparsers()``.

    Returns:
        The new ``demo`` parser (its ``func`` default is :func:`run_demo`).
    """
    p = subparsers.add_parser(
        "demo",
        help="kill a real training job mid-run, resume it, check the state is bit-identical",
        description=(
            "Train a real job, SIGKILL it mid-run, resume it, and check the recovered "
            "training state is bit-identical to an uninterrupted reference; also measures "
            "record sizes, recovery time and training-time overhead."
        ),
    )
    p.add_argument(
        "--quick", action="store_true", help="small profile for tests (gpt2-tiny, 40 steps)"
    )
    p.add_argument(
        "--model", default=None, help="named model (default: gpt2-demo; gpt2-tiny with --quick)"
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="training steps per run (default: 180; 40 with --quick)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seeds the model, the data order and the kill step"
    )
    p.add_argument(
        "--method",
        dest="strategy",
        choices=STRATEGIES,
        default="lowdiff",
        help="checkpointing method (default lowdiff)",
    )
    p.add_argument("--strategy", action=DeprecatedFlag, new="--method", choices=STRATEGIES)
    p.add_argument(
        "--compressor",
        choices=sorted(COMPRESSORS),
        default="topk",
        action=_Given,
        help="gradient compressor of method lowdiff (default topk; lowdiff+ trains "
        "without compression and refuses one)",
    )
    p.add_argument(
        "--ratio",
        type=float,
        default=0.01,
        action=_Given,
        help="kept fraction for sparsifiers (default 0.01)",
    )
    p.add_argument(
        "--full-every", type=int, default=None, help="steps between full checkpoints (default 30)"
    )
    p.add_argument(
        "--records-per-file",
        dest="records_per_file",
        type=int,
        default=None,
        help="records written per file (default 3)",
    )
    p.add_argument(
        "--keep-full", type=int, default=None, help="full checkpoints to keep (default 2)"
    )
    p.add_argument(
        "--batch-size",
        dest="train_batch_size",
        type=int,
        default=None,
        help="training sequences per step",
    )
    p.add_argument(
        "--train-batch-size",
        action=DeprecatedFlag,
        new="--batch-size",
        dest="train_batch_size",
        type=int,
    )
    p.add_argument("--seq-len", type=int, default=None, help="tokens per training sequence")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of each training process (default: CPU count)",
    )
    p.add_argument(
        "--out",
        dest="out_dir",
        default=None,
        help="where runs, dumps and logs go (default: a fresh temporary directory, kept)",
    )
    p.add_argument("--out-dir", action=DeprecatedFlag, new="--out", dest="out_dir")
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="FILE",
        help="print the report as JSON instead of text (with FILE: also write it there)",
    )
    p.add_argument("--quiet", dest="no_progress", action="store_true", help="no progress display")
    p.add_argument(
        "--no-progress",
        action=DeprecatedFlag,
        new="--quiet",
        dest="no_progress",
        nargs=0,
        const=True,
    )
    p.set_defaults(func=run_demo)
    return p


class _Given(argparse.Action):
    """Stores the value and notes that the flag was given (``args.given``)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = {*getattr(namespace, "given", ()), self.dest}


def resolve_settings(args: argparse.Namespace) -> DemoSettings:
    """Turn parsed arguments into settings, validating them (ValueError names the flag)."""
    given = sorted(getattr(args, "given", ()))
    if args.strategy == "lowdiff+" and given:
        flags = " and ".join(f"--{g}" for g in given)
        raise ValueError(
            f"{flags}: strategy lowdiff+ trains without gradient compression; leave "
            f"{'them' if len(given) > 1 else 'it'} out, or use --strategy lowdiff"
        )
    return demo_settings(
        quick=args.quick,
        seed=args.seed,
        strategy=args.strategy,
        compressor=args.compressor,
        ratio=args.ratio,
        threads=args.threads,
        out_dir=args.out_dir,
        progress=not args.no_progress,
        model=args.model,
        steps=args.steps,
        full_every=args.full_every,
        batch_size=args.records_per_file,
        keep_full=args.keep_full,
        train_batch_size=args.train_batch_size,
        seq_len=args.seq_len,
    )


def run_demo(args: argparse.Namespace) -> int:
    """Entry point of ``lowdiff demo``.

    Returns:
        0 if the recovered state is bit-identical to the reference, 1 otherwise
        (including when a phase fails; the reason goes to stderr); 2 for a bad option.
    """
    try:
        settings = resolve_settings(args)
        if args.json not in (None, "-"):
            output_file(Path(args.json), "--json")  # checked now, written after the demo
    except ValueError as e:
        print(f"lowdiff demo: error: {e}", file=sys.stderr)
        return 2
    print(f"lowdiff demo: writing to {settings.out_dir}", file=sys.stderr)
    previous = sigterm_as_interrupt()
    try:
        report = orchestrate(settings)
    except DemoError as e:
        print(f"lowdiff demo: {e}", file=sys.stderr)
        print(f"lowdiff demo: logs kept in {settings.out_dir / 'logs'}", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if args.json == "-":
        print(json.dumps(report, indent=1))
    else:
        print(format_report(report))
    if args.json not in (None, "-"):
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))
    return 0 if report["state_check"]["bit_identical"] else 1


__all__ = ["add_parser", "resolve_settings", "run_demo"]

"""``lowdiff chaos``: inject failures into real training jobs; measure the wasted time."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Any

from lowdiff.cli.args import method_list, output_dir
from lowdiff_lab.chaos.launch import ChaosError
from lowdiff_lab.chaos.run import run_chaos
from lowdiff_lab.chaos.settings import DEFAULT_METHODS, STRATEGIES, ChaosSettings
from lowdiff_lab.harness import Progress, sigterm_as_interrupt


def _floats(option: str) -> Any:
    def parse(text: str) -> list[float]:
        try:
            vals = [float(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{option}: expected comma-separated numbers, got {text!r}"
            ) from None
        if not vals:
            raise argparse.ArgumentTypeError(f"{option}: expected at least one number")
        return vals

    return parse


def _ints(option: str) -> Any:
    def parse(text: str) -> list[int]:
        try:
            vals = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{option}: expected comma-separated integers, got {text!r}"
            ) from None
        if not vals:
            raise argparse.ArgumentTypeError(f"{option}: expected at least one integer")
        return vals

    return parse


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``chaos`` on an ``argparse`` sub-parser collection."""
    p = subparsers.add_parser(
        "chaos",
        help="kill real training jobs at exponential times for an MTBF; wasted time per strategy",
        description=(
            "Trains the same job with every strategy through the same seeded failures "
            "(software: the training process is killed; hardware: its checkpointing "
            "processes and shared memory go too), restarts it until it is done, and splits "
            "each run's time into steady-state overhead, lost work and recovery against the "
            "same training without checkpoints. Writes results.jsonl, report.md and PNGs "
            "into --out. --grid measures LowDiff over a grid of (f, b) against the model."
        ),
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="gpt2-tiny, 100 steps (about a minute on 2 quiet cores; --rounds N runs it N times)",
    )
    p.add_argument(
        "--grid", action="store_true", help="LowDiff over a grid of (f, b) against the model"
    )
    p.add_argument("--out", type=Path, default=Path("chaos"), help="output folder (default: chaos)")
    _add_workload_options(p)
    _add_failure_options(p)
    _add_method_options(p)
    _add_grid_options(p)
    p.add_argument(
        "--launcher",
        choices=("fork", "exec"),
        default="fork",
        help="fork training processes from a warm server (default) or start fresh interpreters",
    )
    p.add_argument("--workdir", type=Path, default=None, help="where the jobs run (default: temp)")
    p.add_argument("--keep", action="store_true", help="keep the jobs' checkpoints and logs")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=run)
    return p


def _add_workload_options(p: argparse.ArgumentParser) -> None:
    """The training job every method runs."""
    p.add_argument("--model", default=None, help="named model (default gpt2-demo; quick gpt2-tiny)")
    p.add_argument("--steps", type=int, default=None, help="steps per job (default 300; quick 100)")
    p.add_argument("--batch-size", type=int, default=None, help="training sequences per step")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence")
    p.add_argument("--threads", type=int, default=1, help="torch threads per training process")
    p.add_argument("--ratio", type=float, default=0.01, help="top-k ratio of compressed training")
    p.add_argument("--no-error-feedback", action="store_true", help="top-k without error feedback")


def _add_failure_options(p: argparse.ArgumentParser) -> None:
    """When the failures strike."""
    p.add_argument(
        "--mtbf",
        type=_floats("--mtbf"),
        default=None,
        help="MTBFs in seconds of failure-free training, comma-separated (default: T_ff/1, "
        "T_ff/2, T_ff/4 of the measured failure-free time T_ff)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=10,
        help="seed of the failure schedules (default 10: 1, 2, 4 failures at the default MTBFs)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="times every method runs through every schedule, each round between reference "
        "jobs of its own; the report gives each cell's median and range (default 1)",
    )


def _add_method_options(p: argparse.ArgumentParser) -> None:
    """The compared methods and how each picks its checkpoint interval."""
    p.add_argument(
        "--methods",
        default=None,
        help=f"comma-separated STRATEGY[:software|hardware] (strategies: {', '.join(STRATEGIES)}; "
        f"default: {','.join(DEFAULT_METHODS)})",
    )
    p.add_argument(
        "--lowdiff",
        default=None,
        metavar="auto|model|F,B",
        help="LowDiff's (f, b): the Checkpointer's tuner (auto), the model on costs of a "
        "profiling job (model), or fixed (default: auto where the Checkpointer has the tuner)",
    )
    p.add_argument(
        "--interval",
        type=_interval,
        default="young-daly",
        metavar="young-daly|N",
        help="checkpoint interval of torch.save and DCP async: the Young-Daly interval from "
        "each one's measured checkpoint cost and the MTBF (default), or N steps",
    )
    p.add_argument(
        "--persist-interval",
        type=int,
        default=10,
        help="Gemini's persistence interval and Naive DC's full-checkpoint interval (default 10)",
    )


def _add_grid_options(p: argparse.ArgumentParser) -> None:
    """The (f, b) grid (``--grid``) and the GPU-count simulation."""
    p.add_argument("--grid-f", type=_ints("--grid-f"), default=None, help="grid values of f")
    p.add_argument("--grid-b", type=_ints("--grid-b"), default=None, help="grid values of b")
    p.add_argument(
        "--grid-mtbf", type=float, default=None, help="MTBF of the grid (default T_ff/2)"
    )
    p.add_argument(
        "--sim-gpus",
        type=_ints("--sim-gpus"),
        default=[8, 16, 32, 64],
        help="GPU counts of the Exp. 12 simulation (default 8,16,32,64)",
    )


def _interval(text: str) -> int | str:
    """``--interval``: ``young-daly`` or an integer (range checked by ChaosSettings)."""
    if text == "young-daly":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--interval: expected 'young-daly' or an integer, got {text!r}"
        ) from None


def run(args: argparse.Namespace) -> int:
    """Entry point of ``lowdiff chaos``."""
    methods = method_list(args.methods) or list(DEFAULT_METHODS)
    output_dir(args.out)
    settings = ChaosSettings(
        quick=args.quick,
        grid=args.grid,
        model=args.model,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        threads=args.threads,
        ratio=args.ratio,
        error_feedback=not args.no_error_feedback,
        seed=args.seed,
        rounds=args.rounds,
        mtbfs=args.mtbf,
        methods=methods,
        lowdiff=args.lowdiff,
        interval=args.interval,
        persist_interval=args.persist_interval,
        grid_f=args.grid_f,
        grid_b=args.grid_b,
        grid_mtbf=args.grid_mtbf,
        sim_gpus=tuple(args.sim_gpus),
        launcher=args.launcher,
        workdir=args.workdir,
        keep=args.keep,
    )
    t0 = time.monotonic()
    previous = sigterm_as_interrupt()
    try:
        with Progress(args.quiet) as progress:
            try:
                files = run_chaos(settings, args.out, progress)
            except ChaosError as e:
                progress.close(keep=True)
                print(f"lowdiff chaos: {e}", file=sys.stderr)
                return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print(f"lowdiff chaos: done in {time.monotonic() - t0:.0f} s")
    for name, path in files.items():
        print(f"  {name}: {path}")
    return 0


__all__ = ["add_parser", "run"]

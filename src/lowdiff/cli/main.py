"""The ``lowdiff`` command line: ``inspect``, ``verify``, ``export`` and ``plan`` (and the
lab's ``demo``, ``bench``, ``chaos`` and ``torture``, registered as plugins).

Every command is a thin layer over the Python API, callable as ``main([...])``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import warnings
from pathlib import Path

from lowdiff.cli.args import non_negative_int
from lowdiff.cli.inspect_cmd import cmd_inspect
from lowdiff.cli.remote_args import local_copy, named
from lowdiff.errors import LowDiffError


def cmd_verify(args: argparse.Namespace) -> int:
    from lowdiff.inspection import verify_dir

    with local_copy(args, everything=True) as damaged:
        checked, bad = verify_dir(args.directory)
    for p, reason in bad:
        print(f"BAD  {named(args, p)}: {named(args, reason)}")
    for why in damaged:  # remote objects that failed their commit's size or checksum
        print(f"BAD  {why}")
    n_bad = len(bad) + len(damaged)
    print(f"{checked + len(damaged)} file(s) checked, {n_bad} bad")
    return 1 if n_bad else 0


def cmd_export(args: argparse.Namespace) -> int:
    # a step other than the newest may need an older full checkpoint: fetch them all
    with local_copy(args, everything=args.step is not None):
        return _cmd_export(args)


def _cmd_export(args: argparse.Namespace) -> int:
    from lowdiff.exporting import export

    step = export(args.directory, args.step, args.out, format=args.format)
    what = "the model state" if args.format == "safetensors" else "the training state"
    if args.format == "hf":
        what = "the model (save_pretrained)"
    print(f"exported {what} at step {step} to {args.out} ({args.format})")
    return 0


_DIR_HELP = "a checkpoint directory, or the URL of a remote tier (remote=, e.g. s3://bucket/run)"


def _remote_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--remote-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an fsspec option for a URL (repeatable; VALUE as JSON when it parses), "
        "e.g. endpoint_url=http://127.0.0.1:9000",
    )


def build_parser() -> argparse.ArgumentParser:
    from lowdiff import __version__, methods
    from lowdiff.cli import plan

    parser = argparse.ArgumentParser(
        prog="lowdiff", description="Per-iteration checkpointing for PyTorch training."
    )
    parser.add_argument("--version", action="version", version=f"lowdiff {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plan.add_parser(sub)
    for add_parser in methods.commands().values():  # the lab's: demo, bench, chaos, torture
        add_parser(sub)

    p = sub.add_parser(
        "inspect", help="list full checkpoints, record files and the recoverable range"
    )
    p.add_argument("directory", help=_DIR_HELP)
    _remote_option(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--all", action="store_true", help="list every record file (a job: every shard's files)"
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="read every file and check its checksum: damaged files are listed as problems "
        "and left out of the recoverable steps (default: from the headers alone)",
    )
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("verify", help="check every checksum; exit 1 naming each bad file")
    p.add_argument("directory", help=_DIR_HELP)
    _remote_option(p)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "export",
        help="write the state at a recoverable step (safetensors, torch.save, DCP, Hugging Face)",
    )
    p.add_argument(
        "directory", help="a checkpoint directory or a distributed job's, or a remote tier's URL"
    )
    _remote_option(p)
    p.add_argument(
        "--step", type=non_negative_int, default=None, help="recoverable step (default: newest)"
    )
    p.add_argument(
        "--format",
        choices=("safetensors", "torch", "dcp", "hf"),
        default="safetensors",
        help="safetensors: the model state dict (default); torch: one torch.save file with "
        "model, optimizer, scheduler and step; dcp: a torch.distributed.checkpoint directory; "
        "hf: a save_pretrained directory (transformers models)",
    )
    p.add_argument(
        "--out", type=Path, required=True, help="output file (safetensors, torch) or directory"
    )
    p.set_defaults(func=cmd_export)

    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # the subcommand's own error: its usage, "lowdiff CMD: error: ..."
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.formatwarning = lambda msg, cat, *a, **k: f"warning: {named(args, msg)}\n"  # type: ignore[assignment]
            return int(args.func(args))
    except LowDiffError as e:
        print(f"lowdiff {args.command}: error: {named(args, e)}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise  # entry() ends quietly
    except (ValueError, OSError) as e:  # FileNotFoundError, IsADirectoryError, a full disk
        print(f"lowdiff {args.command}: error: {named(args, e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"lowdiff {args.command}: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """Console-script entry point."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader went away (``lowdiff inspect DIR | head``): end quietly, as a shell
        # tool does, without a traceback or a second error when Python flushes at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 128 + signal.SIGPIPE
    except OSError as e:  # standard output cannot be written (a full disk: > /dev/full)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(f"lowdiff: error: cannot write the output: {e}", file=sys.stderr)
        code = 2
    raise SystemExit(code)

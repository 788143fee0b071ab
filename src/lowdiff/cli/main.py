"""The ``lowdiff`` command line: ``demo``, ``bench``, ``inspect``, ``verify``, ``export``, ``torture``.

Every command is a thin layer over the Python API, callable as ``main([...])``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lowdiff.cli.args import fmt_bytes, non_negative_int
from lowdiff.errors import InvalidArgumentError, LowDiffError


@contextlib.contextmanager
def _local(args: argparse.Namespace, *, everything: bool) -> Iterator[list[str]]:
    """``args.directory`` as a local directory: a URL of a remote tier (``remote=``) is
    downloaded into a temporary one first (every committed object with ``everything``,
    else the newest chain), removed afterwards. Yields what the download left out as
    damaged (each named)."""
    from lowdiff.remote import fetch, is_url

    where = str(args.directory)
    args.shown = where  # what the user named: the URL, not the download's temp directory
    args.local_root = None
    if not is_url(where):
        args.directory = Path(where)
        yield []
        return
    with tempfile.TemporaryDirectory(prefix="lowdiff-remote-") as tmp:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the damaged objects are reported by the caller
            got = fetch(where, tmp, _remote_options(args.remote_option), everything=everything)
        args.directory = args.local_root = Path(tmp)
        print(
            f"remote tier {where}: {len(got.files)} committed object(s) downloaded", file=sys.stderr
        )
        for why in got.damaged:
            print(f"warning: remote tier: left out {why}", file=sys.stderr)
        yield got.damaged


def _named(args: argparse.Namespace, text: object) -> str:
    """``text`` (a path, or a message naming paths) as the user knows it: a file of a
    remote tier's download is named by its URL, not by the temporary directory that
    held it while the command ran."""
    out = str(text)
    root = getattr(args, "local_root", None)
    if root is not None:
        out = out.replace(str(root), str(args.shown).rstrip("/"))
    return out


def _process_label(lr: dict[str, Any]) -> str:
    """How ``inspect`` names the checkpointing process a directory's descriptor names:
    LowDiff's writer or LowDiff+'s replica, live, or left over by a dead owner."""
    kind = lr.get("process")
    if str(lr.get("state", "")).startswith("stale"):
        return f"left-over {kind or 'checkpointing process'}"
    return f"live {kind or 'replica'}"


def _remote_options(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` items as fsspec options (a VALUE that parses as JSON is taken so)."""
    out: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise InvalidArgumentError(f"--remote-option must be KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def cmd_inspect(args: argparse.Namespace) -> int:
    with _local(args, everything=True) as damaged:
        args.remote_damaged = damaged
        return _cmd_inspect(args)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from lowdiff.inspect import inspect_dir, is_job
    from lowdiff.recovery.scan import FileInfo

    if is_job(args.directory):
        return _inspect_job(args)
    from lowdiff.methods import directory_kind

    kind = directory_kind(Path(args.directory))
    if kind is not None:
        return _inspect_registered(args, kind)
    info = inspect_dir(args.directory, verify=args.verify)
    m = info.manifest
    if args.json:
        out = {
            "directory": args.shown,
            "strategy": m.get("strategy"),
            "compressor": m.get("compressor"),
            "optimizer": m.get("optimizer"),
            "parameters": info.n_parameters,
            "recoverable": list(info.recoverable) if info.recoverable else None,
            "recoverable_intervals": [list(i) for i in info.recoverable_intervals],
            "verified": args.verify,
            "live_replica": info.live_replica,
            "full_checkpoints": [
                {"step": f.first_step, "bytes": f.nbytes, "path": _named(args, f.path)}
                for f in info.full_checkpoints
            ],
            "record_files": [
                {
                    "first_step": f.first_step,
                    "last_step": f.last_step,
                    "records": f.n_records,
                    "bytes": f.nbytes,
                    "path": _named(args, f.path),
                }
                for f in info.record_files
            ],
            "bytes_per_record": info.bytes_per_record,
            "problems": [
                *({"path": _named(args, p), "reason": _named(args, r)} for p, r in info.problems),
                *(  # "<object's URL>: <why>"
                    dict(zip(("path", "reason"), why.split(": ", 1), strict=False))
                    for why in args.remote_damaged
                ),
            ],
            "foreign": [
                {"path": _named(args, p), "reason": _named(args, r)} for p, r in info.foreign
            ],
        }
        print(json.dumps(out, indent=1))
        return 0
    print(f"directory    {args.shown}")
    print(f"strategy     {m.get('strategy')}   compressor {m.get('compressor')}")
    print(f"optimizer    {m.get('optimizer')}   parameters {info.n_parameters:,}")
    settings = f"keep_full={m.get('keep_full')}"
    if m.get("strategy") != "lowdiff+":  # LowDiff+ persists its replica: no f or b of its own
        settings = f"full_every={m.get('full_every')} batch_size={m.get('batch_size')} {settings}"
    print(f"settings     {settings}")
    iv = info.recoverable_intervals
    print(
        f"recoverable  {'steps ' + ', '.join(f'{lo}..{hi}' for lo, hi in iv) if iv else 'nothing'}"
        f"  ({_checked(args)})"
    )
    lr = info.live_replica
    if lr is not None:
        where = f"step {lr['step']}, " if lr.get("step", -1) >= 0 else ""
        print(
            f"{_process_label(lr)} {where}{lr['state']} "
            f"(checkpointing process pid {lr['pid']} on {lr['host']})"
        )
    print(f"\nfull checkpoints ({len(info.full_checkpoints)}):")
    for f in info.full_checkpoints:
        print(f"  step {f.first_step:>8}  {fmt_bytes(f.nbytes):>10}  {f.path.name}")
    print(
        f"\nrecord files ({len(info.record_files)}, {info.n_records} records, {fmt_bytes(info.bytes_per_record)} per record):"
    )
    files = info.record_files
    shown: list[FileInfo | None] = (
        list(files) if args.all or len(files) <= 12 else [*files[:5], None, *files[-5:]]
    )
    for rf in shown:
        if rf is None:
            print(f"  ... {len(files) - 10} more (use --all)")
            continue
        print(
            f"  steps {rf.first_step:>6}..{rf.last_step:<6} {rf.n_records:>3} records  {fmt_bytes(rf.nbytes):>10}  {rf.path.name}"
        )
    problems = [f"{_named(args, p)}: {_named(args, r)}" for p, r in info.problems]
    problems += list(args.remote_damaged)  # left out of the download
    if problems:
        print(f"\nproblems ({len(problems)}):")
        for line in problems:
            print(f"  {line}")
    if info.foreign:
        print(f"\nleft out, of another trajectory ({len(info.foreign)}):")
        for _, r in info.foreign:
            print(f"  {_named(args, r)}")
    return 0


def _checked(args: argparse.Namespace) -> str:
    """How the recoverable steps were established, for inspect's summary line."""
    if args.verify:
        return "every file's checksum checked"
    return "by the file headers; --verify checks every byte"


def _inspect_registered(args: argparse.Namespace, kind: Any) -> int:
    """A registered method's directory (a baseline's): its manifest and checkpoints."""
    from lowdiff.format import layout

    m = layout.read_manifest(args.directory)
    items: list[dict[str, Any]] = []
    for step, p in kind.checkpoints(Path(args.directory)):
        size = (
            sum(q.stat().st_size for q in p.iterdir() if q.is_file())
            if p.is_dir()
            else p.stat().st_size
        )
        items.append({"step": step, "bytes": size, "path": _named(args, p)})
    if args.json:
        print(json.dumps({"directory": args.shown, "manifest": m, "checkpoints": items}, indent=1))
        return 0
    print(f"directory    {args.shown}")
    print(
        f"strategy     {m.get('strategy')}   (a baseline; lowdiff resumes it with the same strategy)"
    )
    print(f"optimizer    {m.get('optimizer')}   full_every {m.get('full_every')}")
    print(f"checkpoints  {len(items)}")
    for it in items:
        print(f"  step {it['step']:>10}  {fmt_bytes(it['bytes']):>10}  {it['path']}")
    return 0


def _inspect_job(args: argparse.Namespace) -> int:
    from lowdiff.inspect import inspect_job

    job = inspect_job(args.directory, verify=args.verify)
    iv = job.recoverable_intervals
    if args.json:
        out = {
            "directory": args.shown,
            "strategy": job.manifest.get("strategy"),
            "world_size": job.world_size,
            "generations": [
                {"index": g.index, "world_size": g.world_size, "start_step": g.start_step}
                for g in job.generations
            ],
            "recoverable": list(job.recoverable) if job.recoverable else None,
            "recoverable_intervals": [list(i) for i in iv],
            "verified": args.verify,
            "shards": [
                {
                    "directory": str(s.root),
                    "name": job.shard_name(s),
                    "parameters": s.n_parameters,
                    "recoverable_intervals": [list(i) for i in s.recoverable_intervals],
                    "full_checkpoints": len(s.full_checkpoints),
                    "bytes_per_full": s.bytes_per_full,
                    "records": s.n_records,
                    "bytes_per_record": s.bytes_per_record,
                    "live_replica": s.live_replica,
                    "problems": [
                        {"path": _named(args, p), "reason": _named(args, r)} for p, r in s.problems
                    ],
                }
                for s in job.shards
            ],
        }
        print(json.dumps(out, indent=1))
        return 0
    print(f"directory    {args.shown}  ({job.describe()})")
    print(f"strategy     {job.manifest.get('strategy')}")
    print(
        f"recoverable  {'steps ' + ', '.join(f'{lo}..{hi}' for lo, hi in iv) if iv else 'nothing'}"
        f"  (steps every shard serves; a resume agrees on the newest; {_checked(args)})"
    )
    print("\nshards:")
    for s in job.shards:
        siv = ", ".join(f"{lo}..{hi}" for lo, hi in s.recoverable_intervals) or "nothing"
        line = (
            f"  {job.shard_name(s)}  {s.n_parameters:>12,} params  recoverable {siv}  "
            f"{len(s.full_checkpoints)} full ({fmt_bytes(s.bytes_per_full)} each)  "
            f"{s.n_records} records ({fmt_bytes(s.bytes_per_record)} each)"
        )
        lr = s.live_replica
        if lr is not None:
            at = f"step {lr['step']}, " if lr.get("step", -1) >= 0 else ""
            line += f"  {_process_label(lr)}: {at}{lr['state']} (pid {lr['pid']})"
        print(line)
        if args.all:  # every file of the shard
            for f in s.full_checkpoints:
                print(
                    f"      full   step {f.first_step:>8}  {fmt_bytes(f.nbytes):>10}  {f.path.name}"
                )
            for rf in s.record_files:
                print(
                    f"      records steps {rf.first_step:>6}..{rf.last_step:<6} {rf.n_records:>3} "
                    f"records  {fmt_bytes(rf.nbytes):>10}  {rf.path.name}"
                )
        for p, r in s.problems:
            print(f"      problem: {_named(args, p)}: {_named(args, r)}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from lowdiff.inspect import verify_dir

    with _local(args, everything=True) as damaged:
        checked, bad = verify_dir(args.directory)
    for p, reason in bad:
        print(f"BAD  {_named(args, p)}: {_named(args, reason)}")
    for why in damaged:  # remote objects that failed their commit's size or checksum
        print(f"BAD  {why}")
    n_bad = len(bad) + len(damaged)
    print(f"{checked + len(damaged)} file(s) checked, {n_bad} bad")
    return 1 if n_bad else 0


def cmd_export(args: argparse.Namespace) -> int:
    # a step other than the newest may need an older full checkpoint: fetch them all
    with _local(args, everything=args.step is not None):
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
            warnings.formatwarning = lambda msg, cat, *a, **k: f"warning: {_named(args, msg)}\n"  # type: ignore[assignment]
            return int(args.func(args))
    except LowDiffError as e:
        print(f"lowdiff {args.command}: error: {_named(args, e)}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise  # entry() ends quietly
    except (ValueError, OSError) as e:  # FileNotFoundError, IsADirectoryError, a full disk
        print(f"lowdiff {args.command}: error: {_named(args, e)}", file=sys.stderr)
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

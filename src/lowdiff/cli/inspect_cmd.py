"""``lowdiff inspect``: what a checkpoint directory holds, as text or JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from lowdiff.cli.args import fmt_bytes
from lowdiff.cli.remote_args import local_copy, named


def _process_label(lr: dict[str, Any]) -> str:
    """How ``inspect`` names the checkpointing process a directory's descriptor names:
    LowDiff's writer or LowDiff+'s replica, live, or left over by a dead owner."""
    kind = lr.get("process")
    if str(lr.get("state", "")).startswith("stale"):
        return f"left-over {kind or 'checkpointing process'}"
    return f"live {kind or 'replica'}"


def cmd_inspect(args: argparse.Namespace) -> int:
    with local_copy(args, everything=True) as damaged:
        args.remote_damaged = damaged
        return _cmd_inspect(args)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from lowdiff.inspection import inspect_dir, is_job

    if is_job(args.directory):
        return _inspect_job(args)
    from lowdiff.methods import directory_kind

    kind = directory_kind(Path(args.directory))
    if kind is not None:
        return _inspect_registered(args, kind)
    info = inspect_dir(args.directory, verify=args.verify)
    if args.json:
        _dir_json(args, info)
    else:
        _dir_text(args, info)
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
        items.append({"step": step, "bytes": size, "path": named(args, p)})
    if args.json:
        print(json.dumps({"directory": args.shown, "manifest": m, "checkpoints": items}, indent=1))
        return 0
    print(f"directory    {args.shown}")
    print(
        f"method       {m.get('strategy')}   (a registered method; lowdiff resumes it with the same method)"
    )
    print(f"optimizer    {m.get('optimizer')}   full_every {m.get('full_every')}")
    print(f"checkpoints  {len(items)}")
    for it in items:
        print(f"  step {it['step']:>10}  {fmt_bytes(it['bytes']):>10}  {it['path']}")
    return 0


def _inspect_job(args: argparse.Namespace) -> int:
    from lowdiff.inspection import inspect_job

    job = inspect_job(args.directory, verify=args.verify)
    if args.json:
        _job_json(args, job)
    else:
        _job_text(args, job)
    return 0


def _dir_json(args: argparse.Namespace, info: Any) -> None:
    m = info.manifest
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
            {"step": f.first_step, "bytes": f.nbytes, "path": named(args, f.path)}
            for f in info.full_checkpoints
        ],
        "record_files": [
            {
                "first_step": f.first_step,
                "last_step": f.last_step,
                "records": f.n_records,
                "bytes": f.nbytes,
                "path": named(args, f.path),
            }
            for f in info.record_files
        ],
        "bytes_per_record": info.bytes_per_record,
        "problems": [
            *({"path": named(args, p), "reason": named(args, r)} for p, r in info.problems),
            *(  # "<object's URL>: <why>"
                dict(zip(("path", "reason"), why.split(": ", 1), strict=False))
                for why in args.remote_damaged
            ),
        ],
        "foreign": [{"path": named(args, p), "reason": named(args, r)} for p, r in info.foreign],
    }
    print(json.dumps(out, indent=1))


def _dir_text(args: argparse.Namespace, info: Any) -> None:
    from lowdiff.recovery.scan import FileInfo

    m = info.manifest
    print(f"directory    {args.shown}")
    print(f"method       {m.get('strategy')}   compressor {m.get('compressor')}")
    print(f"optimizer    {m.get('optimizer')}   parameters {info.n_parameters:,}")
    settings = f"keep_full={m.get('keep_full')}"
    if m.get("strategy") != "lowdiff+":  # LowDiff+ persists its replica: no f or b of its own
        settings = f"full_every={m.get('full_every')} records_per_file={m.get('batch_size')} {settings}"
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
    problems = [f"{named(args, p)}: {named(args, r)}" for p, r in info.problems]
    problems += list(args.remote_damaged)  # left out of the download
    if problems:
        print(f"\nproblems ({len(problems)}):")
        for line in problems:
            print(f"  {line}")
    if info.foreign:
        print(f"\nleft out, of another trajectory ({len(info.foreign)}):")
        for _, r in info.foreign:
            print(f"  {named(args, r)}")


def _job_json(args: argparse.Namespace, job: Any) -> None:
    iv = job.recoverable_intervals
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
                    {"path": named(args, p), "reason": named(args, r)} for p, r in s.problems
                ],
            }
            for s in job.shards
        ],
    }
    print(json.dumps(out, indent=1))


def _job_text(args: argparse.Namespace, job: Any) -> None:
    iv = job.recoverable_intervals
    print(f"directory    {args.shown}  ({job.describe()})")
    print(f"method       {job.manifest.get('strategy')}")
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
            copy = lr.get("peer_copy")
            if copy is not None:
                line += f", with the copy of rank {copy['rank']}'s shard at step {copy['step']}"
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
            print(f"      problem: {named(args, p)}: {named(args, r)}")

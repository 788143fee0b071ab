"""``lowdiff torture``: kill, corrupt, fill the disk and fuzz; check every recovery."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from lowdiff.cli.args import DeprecatedFlag, non_negative_int, positive_int
from lowdiff.errors import InvalidArgumentError
from lowdiff_lab.harness import Progress


def cmd_torture(args: argparse.Namespace) -> int:
    from lowdiff_lab.torture import FULL, QUICK, run_torture

    if args.out is not None and args.out.is_dir() and any(args.out.iterdir()):
        raise InvalidArgumentError(
            f"--out {args.out}: not empty (the runs of an earlier torture?); give a new or "
            "empty folder"
        )
    series = [f for f, n in (("--ddp", args.ddp), ("--nodes", args.nodes)) if n is not None]
    if len(series) > 1:
        raise InvalidArgumentError("--ddp and --nodes are two series: run one at a time")
    if series:
        ignored = [o for o, given in (("--quick", args.quick), ("--kills", args.kills is not None),
                                      ("--jobs", args.jobs != 1)) if given]  # fmt: skip
        if ignored:
            verb = "apply" if len(ignored) > 1 else "applies"
            raise InvalidArgumentError(
                f"{', '.join(ignored)} {verb} to the single-process profiles, not to "
                f"{series[0]} N (its N is the number of kills)"
            )
        return _torture_series(args)
    if args.strategy is not None:
        raise InvalidArgumentError(
            "--method applies to the --ddp and --nodes series only (lowdiff torture --ddp N)"
        )
    profile = QUICK if args.quick else FULL
    if args.kills is not None:
        profile = dataclasses.replace(profile, kills=args.kills)
    log = None if args.json or args.quiet else Progress().write
    report = run_torture(profile, out=args.out, seed=args.seed, jobs=args.jobs, log=log)
    print(report.dumps() if args.json else report.format_text())
    return 0 if report.ok else 1


def _torture_series(args: argparse.Namespace) -> int:
    """The 2-rank DDP kill series (``--ddp N``) or the node-loss series (``--nodes N``)."""
    import shutil
    import tempfile

    from lowdiff_lab.torture.ddp import run_ddp_kills
    from lowdiff_lab.torture.node_loss import run_node_losses

    nodes = args.nodes is not None
    prefix = "lowdiff-nodes-" if nodes else "lowdiff-ddp-"
    work = args.out if args.out is not None else Path(tempfile.mkdtemp(prefix=prefix))
    log = None if args.json or args.quiet else Progress().write
    strategy = args.strategy or "both"
    if nodes:
        report = run_node_losses(work, args.nodes, seed=args.seed, strategy=strategy, log=log)
    else:
        report = run_ddp_kills(work, args.ddp, seed=args.seed, strategy=strategy, log=log)
    print(report.dumps() if args.json else report.format_text())
    if args.out is None:
        if report.ok:
            shutil.rmtree(work, ignore_errors=True)
        else:  # keep the runs of a broken promise for a look
            print(f"runs kept in {work}", file=sys.stderr)
    return 0 if report.ok else 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "torture",
        help="kill, corrupt, fill the disk and fuzz; check every recovery and print the figures",
    )
    p.add_argument("--quick", action="store_true", help="the small profile (about a minute)")
    p.add_argument(
        "--kills", type=non_negative_int, default=None, help="kill plans (full profile: 240)"
    )
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of every random choice")
    p.add_argument("--jobs", type=positive_int, default=1, help="kill chains run side by side")
    p.add_argument("--out", type=Path, default=None, help="working directory (kept)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument(
        "--ddp",
        type=positive_int,
        default=None,
        metavar="N",
        help="run only the 2-rank DDP kill series (torchrun, gloo) with N kills",
    )
    p.add_argument(
        "--nodes",
        type=positive_int,
        default=None,
        metavar="N",
        help="run only the node-loss series: a 2-node torchrun job (two agents on 127.0.0.1) "
        "whose second node is lost and replaced, N times",
    )
    p.add_argument(
        "--method",
        dest="strategy",
        choices=("lowdiff", "lowdiff+", "both"),
        default=None,
        help="method of the --ddp and --nodes series (default both: alternating)",
    )
    p.add_argument(
        "--strategy", action=DeprecatedFlag, new="--method", choices=("lowdiff", "lowdiff+", "both")
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=cmd_torture)

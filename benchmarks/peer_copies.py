"""LowDiff+'s peer copies: their cost per step, and recovery after a node loss from peer
memory, from disk and from the remote tier, side by side in one run.

Runs :func:`lowdiff_lab.bench.peer_copies.run` (2 gloo ranks, each its own node; see its
docstring for every arm) and prints two tables.

    python benchmarks/peer_copies.py --repeats 3 --steps 40 --crash-after 25
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from lowdiff_lab.bench.peer_copies import format_report, run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--crash-after", type=int, default=25)
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lowdiff-peers-") as tmp:
        fig = run(
            Path(tmp), steps=args.steps, warmup=args.warmup, repeats=args.repeats,
            crash_after=args.crash_after,
        )  # fmt: skip
    print(format_report(fig))
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

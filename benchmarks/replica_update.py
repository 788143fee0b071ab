"""The LowDiff+ replica's update against a bare ``torch.optim`` step, and where its time goes.

Runs :func:`lowdiff_lab.bench.replica.replica_update_bench` (blocks of the two sides
alternated in one process, medians compared, the bits checked equal at the end) and
prints its table and the replica's time per stage: the trainer's copy of the gradients
into a slot (``copy in``), and the replica's merge (``bind``, ``optimizer`` with the
clip's factor, ``hand back``).

    python benchmarks/replica_update.py --shapes gpt2-117m --threads 1,2 --clip
"""

from __future__ import annotations

import argparse
import json

from lowdiff_lab.bench.replica import SHAPES, format_rows, replica_update_bench


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", choices=SHAPES, default="gpt2-117m")
    ap.add_argument("--params", type=int, default=8_437_760, help="with --shapes blocks")
    ap.add_argument("--threads", default="1,2", help="comma-separated replica thread counts")
    ap.add_argument("--clip", action="store_true", help="clipping that fires, its factor carried")
    ap.add_argument("--flags", default="fused", choices=("fused", "foreach"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    rows = replica_update_bench(
        n_params=args.params,
        shapes=args.shapes,
        clip=args.clip,
        threads=tuple(int(t) for t in args.threads.split(",")),
        kernels=(("torch.optim.AdamW", {args.flags: True}),),
        repeats=args.repeats,
        steps=args.steps,
    )
    print(format_rows(rows))
    print("\n| replica_threads | copy in (trainer) | bind | optimizer | hand back |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        s = r["stage_s"]
        print(
            f"| {r['threads']} | {r['copy_in_s'] * 1e3:.1f} ms | {s['bind'] * 1e3:.2f} ms "
            f"| {s['optimizer'] * 1e3:.1f} ms | {s['hand_back'] * 1e3:.2f} ms |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

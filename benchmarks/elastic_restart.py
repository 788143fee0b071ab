"""What an elastic restart of a LowDiff+ DDP job costs, against the same job uninterrupted.

Runs :mod:`lowdiff.torture.ddp_job` (2 gloo ranks, ``--steps`` steps, LowDiff+) under
real ``torchrun`` three ways, interleaved, ``--repeats`` times each, and reports the wall
time of each whole ``torchrun`` (start to exit):

- ``uninterrupted``;
- ``one restart``: rank 1 SIGKILLs itself before step ``--kill-at`` (``--max-restarts 1``);
- ``two restarts``: that, then an exception in rank 0 before step ``--raise-at``
  (``--max-restarts 2``).

Every restarted rank takes over the replica process that outlived its predecessor and
recovers from memory; the script checks that (every attempt after the first names the
first attempt's process) and that the final states equal the uninterrupted run's.

Run: ``python benchmarks/elastic_restart.py [--repeats 3] [--steps 12]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lowdiff.state.capture import diff_states
from lowdiff.torture.ddp import torchrun


def _run(base: Path, name: str, steps: int, extra: tuple[str, ...], restarts: int) -> float:
    out = base / name
    out.mkdir()
    t0 = time.perf_counter()
    torchrun(
        "--dir", str(base / f"{name}-ck"), "--out", str(out),
        "--strategy", "lowdiff+", "--steps", str(steps), *extra,
        restarts=restarts,
    )  # fmt: skip
    return time.perf_counter() - t0


def _check(base: Path, name: str, attempts: int) -> None:
    out = base / name
    for r in (0, 1):
        pids = [tuple(map(int, p.read_text().split())) for p in out.glob(f"process-rank{r}-*.txt")]
        firsts = [p for p, adopted in pids if adopted == -1]
        assert len(pids) == attempts and len(firsts) == 1, pids
        assert all(adopted == firsts[0] for _, adopted in pids if adopted != -1), pids
        ref = torch.load(base / "uninterrupted" / f"final-rank{r}.pt", weights_only=False)
        got = torch.load(out / f"final-rank{r}.pt", weights_only=False)
        assert diff_states(ref, got) == [], f"{name}: rank {r} differs from the uninterrupted run"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--kill-at", type=int, default=4)
    p.add_argument("--raise-at", type=int, default=8)
    a = p.parse_args()
    kill = ("--kill-rank", "1", "--kill-at", str(a.kill_at))
    fail = ("--raise-rank", "0", "--raise-at", str(a.raise_at))
    cases = {
        "uninterrupted": ((), 0, 1),
        "one restart": (kill, 1, 2),
        "two restarts": (kill + fail, 2, 3),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(a.repeats):
        with tempfile.TemporaryDirectory() as d:
            base = Path(d)
            for name, (extra, restarts, attempts) in cases.items():
                key = name.replace(" ", "-")
                times[name].append(_run(base, key, a.steps, extra, restarts))
                if key != "uninterrupted":
                    _check(base, key, attempts)
    ref = statistics.median(times["uninterrupted"])
    print(f"{'job':<16} {'median s':>9} {'min s':>7} {'max s':>7} {'/ uninterrupted':>16}")
    for name, v in times.items():
        med = statistics.median(v)
        print(f"{name:<16} {med:9.2f} {min(v):7.2f} {max(v):7.2f} {med / ref:16.2f}")


if __name__ == "__main__":
    main()

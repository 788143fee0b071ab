"""What an elastic restart of a LowDiff+ DDP job costs, against the same job uninterrupted.

Runs :mod:`lowdiff_lab.torture.ddp_job` (2 gloo ranks, ``--steps`` steps, LowDiff+) under
real ``torchrun`` three ways, interleaved, ``--repeats`` times each, and reports the wall
time of each whole ``torchrun`` (start to exit):

- ``uninterrupted``;
- ``one restart``: rank 1 SIGKILLs itself before step ``--kill-at`` (``--max-restarts 1``);
- ``two restarts``: that, then an exception in rank 0 before step ``--raise-at``
  (``--max-restarts 2``);
- ``one restart, none``: the one restart of the same job without checkpointing
  (strategy ``"none"``, which retrains from step 0): what torchrun's own restart of the
  workers costs.

Every restarted rank takes over the replica process that outlived its predecessor and
recovers from memory; the script checks that (every attempt after the first names the
first attempt's process) and that the final states equal the uninterrupted run's. It
also shows where a restarted rank's start goes (median over the restarted ranks of
``one restart``): the interpreter and imports, the process group, DDP's construction,
the ``Checkpointer``, and ``resume()`` (the recovery from memory and the takeover).

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
from lowdiff_lab.torture.ddp import torchrun


def _run(
    base: Path, name: str, steps: int, extra: tuple[str, ...], restarts: int, strategy: str
) -> float:
    out = base / name
    out.mkdir()
    t0 = time.perf_counter()
    torchrun(
        "--dir", str(base / f"{name}-ck"), "--out", str(out),
        "--strategy", strategy, "--steps", str(steps), *extra,
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


def _phases(out: Path) -> list[dict[str, float]]:
    """The phases of the restarted ranks (every attempt that recovered from memory)."""
    got = []
    for p in out.glob("timing-rank*-*.txt"):
        start = out / p.name.replace("timing", "start")
        if start.exists() and start.read_text().endswith("memory"):
            got.append({k: float(v) for k, v in (x.split("=") for x in p.read_text().split())})
    return got


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
        "uninterrupted": ((), 0, 1, "lowdiff+"),
        "one restart": (kill, 1, 2, "lowdiff+"),
        "two restarts": (kill + fail, 2, 3, "lowdiff+"),
        "one restart, none": (kill, 1, 2, "none"),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    phases: list[dict[str, float]] = []
    for _ in range(a.repeats):
        with tempfile.TemporaryDirectory() as d:
            base = Path(d)
            for name, (extra, restarts, attempts, strategy) in cases.items():
                key = name.replace(" ", "-").replace(",", "")
                times[name].append(_run(base, key, a.steps, extra, restarts, strategy))
                if strategy == "lowdiff+" and key != "uninterrupted":
                    _check(base, key, attempts)
            phases.extend(_phases(base / "one-restart"))
    ref = statistics.median(times["uninterrupted"])
    print(f"{'job':<20} {'median s':>9} {'min s':>7} {'max s':>7} {'/ uninterrupted':>16}")
    for name, v in times.items():
        med = statistics.median(v)
        print(f"{name:<20} {med:9.2f} {min(v):7.2f} {max(v):7.2f} {med / ref:16.2f}")
    print("\na restarted rank's start (median of its phases, seconds from the process's start):")
    last = 0.0
    for k in ("imports", "process_group", "ddp", "checkpointer", "resume"):
        at = statistics.median(p[k] for p in phases)
        print(f"  {k:<14} at {at:6.3f} s   (+{at - last:.3f} s)")
        last = at


if __name__ == "__main__":
    main()

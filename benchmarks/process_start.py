"""How long a trainer waits for its checkpointing process to start, by start method.

Starts LowDiff's checkpointing process over the process link (the same entry point,
config and slots as a real session) and times ``ProcessLink.start`` (from the request to
the process's ``Ready``):

- ``spawn``: a fresh interpreter per process, which imports torch itself;
- ``forkserver``, its server a fork of the trainer (lowdiff's default,
  :mod:`lowdiff.proc.server`): ``cold`` is a trainer's first start, which forks the
  server too; ``warm`` every later start of the same trainer;
- ``forkserver``, its server a new interpreter (``LOWDIFF_PROCESS_START=interpreter``,
  multiprocessing's own start: the server imports torch once, and each new process runs
  the main script again): ``cold``, ``warm``, and ``warmed up``, the first start after
  :func:`lowdiff.proc.spawn.warm_up` ran ``--overlap`` seconds earlier (as ``resume()``
  does, while the trainer reads a checkpoint).

Run: ``python benchmarks/process_start.py [--repeats 5] [--overlap 3]``. Each cold
figure is taken in a new interpreter, so every start method begins from the same state.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, tempfile, time
from pathlib import Path
import torch
import torch.multiprocessing as tmp
from lowdiff.engine.wire.configs import WriterConfig
from lowdiff.engine.writer.main import writer_main
from lowdiff.proc import channel, spawn
from lowdiff.proc.link import ProcessLink
from lowdiff.proc.protocol import Close, Kind

method, starts, overlap = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
if method == "spawn":
    spawn.process_context = lambda: tmp.get_context("spawn")
    import lowdiff.proc.link as link_module
    link_module.process_context = spawn.process_context
if method == "warmed":
    spawn.warm_up()
    time.sleep(overlap)
out = []
for i in range(starts):
    root = Path(tempfile.mkdtemp())
    (root / "records").mkdir()
    (root / "full").mkdir()
    cfg = WriterConfig(str(root), 1, 1, 64, "x", "r" * 32)
    link = ProcessLink("the checkpointing process", stall_timeout=60, start_timeout=120)
    slots = torch.zeros((2, 64), dtype=torch.uint8).share_memory_()
    ctr = channel.new_counters()
    t0 = time.perf_counter()
    link.start(writer_main, (cfg, slots, ctr), name="bench", counters=ctr)
    out.append(time.perf_counter() - t0)
    link.send(Close())
    link.wait_for(Kind.CLOSED)
    link.join()
print(json.dumps(out))
"""


def run(method: str, starts: int, overlap: float, server: str = "fork") -> list[float]:
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "start.py"  # spawn needs a main script it can run again
        script.write_text(
            "if __name__ == '__main__':\n"
            + "".join(f"    {line}\n" for line in CHILD.strip().splitlines())
        )
        res = subprocess.run(
            [sys.executable, str(script), method, str(starts), str(overlap)],
            capture_output=True, text=True, check=True,
            env=dict(os.environ, LOWDIFF_PROCESS_START=server),
        )  # fmt: skip
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--overlap", type=float, default=3.0)
    a = p.parse_args()
    names = {
        "spawn": "spawn",
        "fork-cold": "forked server, cold",
        "fork-warm": "forked server, warm",
        "interp-cold": "interpreter server, cold",
        "interp-warm": "interpreter server, warm",
        "interp-warmed": f"interpreter server, warmed up {a.overlap:g} s",
    }
    rows: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(a.repeats):
        rows["spawn"] += run("spawn", 1, 0)
        for server, key in (("fork", "fork"), ("interpreter", "interp")):
            first, *later = run("forkserver", 3, 0, server)
            rows[f"{key}-cold"].append(first)
            rows[f"{key}-warm"] += later
        rows["interp-warmed"] += run("warmed", 1, a.overlap, "interpreter")
    width = max(map(len, names.values())) + 2
    print(f"{'start':<{width}} {'median ms':>10} {'min ms':>8} {'max ms':>8}  n")
    for k, v in rows.items():
        ms = [x * 1e3 for x in v]
        med, lo, hi = statistics.median(ms), min(ms), max(ms)
        print(f"{names[k]:<{width}} {med:10.0f} {lo:8.0f} {hi:8.0f}  {len(ms)}")


if __name__ == "__main__":
    main()

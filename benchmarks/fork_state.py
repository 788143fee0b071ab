"""What the process server's fork costs a trainer whose training state is on the CPU.

A trainer trains a model of ``--layers`` 2048×2048 linear layers with AdamW on the CPU
(12 layers: 50M parameters, 0.8 GB of parameters, gradients and optimizer state), then
builds a Checkpointer, which forks the process server (:mod:`lowdiff.proc.server`),
resumes and trains ``--steps`` more steps. Measured in each run: the constructor, the
first step after ``resume()`` against the median of the others, the anonymous memory
(``RssAnon``) of the server and of the checkpointing process, and ``close()``.

Each figure is taken with the training state left out of the fork (the default,
:mod:`lowdiff.proc.forkmem`) and shared with it as any memory
(``LOWDIFF_FORK_STATE=share``), in new interpreters, alternating, ``--repeats`` times.

Run: ``python benchmarks/fork_state.py [--strategies lowdiff,lowdiff+] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, statistics, sys, tempfile, time
import torch
import lowdiff
import lowdiff.methods as lm
for name in lm.method_modules():
    __import__(name)  # imported ahead, as a warm trainer has them
strategy, layers, steps, directory = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(layers)])
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn(8, 2048)

def step(ck=None):
    model(x).square().mean().backward()
    ck.step() if ck is not None else opt.step()
    opt.zero_grad()

for _ in range(2):
    step()  # the optimizer state exists

def rss_anon_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("RssAnon"))

out = {"trainer_mb": rss_anon_kb(os.getpid()) / 1024}
options = {"compressor": lowdiff.TopK(0.01)} if strategy == "lowdiff" else {}
t = time.perf_counter()
ck = lowdiff.Checkpointer(model, opt, directory, strategy=strategy, **options)
out["ctor_ms"] = (time.perf_counter() - t) * 1e3
t = time.perf_counter()
ck.resume()
out["resume_ms"] = (time.perf_counter() - t) * 1e3
times = []
for _ in range(steps):
    t = time.perf_counter()
    step(ck)
    times.append((time.perf_counter() - t) * 1e3)
out["first_step_ms"] = times[0]
out["steady_step_ms"] = statistics.median(times[1:])
import multiprocessing.forkserver as mpfs
server = mpfs._forkserver._forkserver_pid
out["server_mb"] = rss_anon_kb(server) / 1024
out["process_mb"] = rss_anon_kb(lowdiff.own_strategy(ck).worker_process.pid) / 1024
t = time.perf_counter()
ck.close()
out["close_ms"] = (time.perf_counter() - t) * 1e3
print(json.dumps(out))
"""

KEYS = ("ctor_ms", "first_step_ms", "steady_step_ms", "server_mb", "process_mb", "close_ms")


def run_once(strategy: str, mode: str, layers: int, steps: int) -> dict[str, float]:
    env = dict(os.environ, LOWDIFF_FORK_STATE=mode)
    with tempfile.TemporaryDirectory() as d:
        args = [sys.executable, "-c", CHILD, strategy, str(layers), str(steps), d + "/ck"]
        out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise SystemExit(f"{strategy} ({mode}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--strategies", default="lowdiff,lowdiff+")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print the medians as JSON rows")
    a = ap.parse_args()
    rows: dict[tuple[str, str], list[dict[str, float]]] = {}
    for i in range(a.repeats):
        for strategy in a.strategies.split(","):
            for mode in ("share", "leave-out") if i % 2 == 0 else ("leave-out", "share"):
                r = run_once(strategy, mode, a.layers, a.steps)
                rows.setdefault((strategy, mode), []).append(r)
                if not a.json:
                    print(f"# {strategy} {mode}: {json.dumps(r)}", flush=True)
    if a.json:
        print(json.dumps([
            {"strategy": strategy, "training_state": mode,
             **{k: statistics.median(r[k] for r in rs) for k in ("trainer_mb", *KEYS)}}
            for (strategy, mode), rs in rows.items()
        ]))  # fmt: skip
        return
    trainer = statistics.median(r["trainer_mb"] for rs in rows.values() for r in rs)
    print(f"\ntrainer RssAnon before the Checkpointer: {trainer:.0f} MB; medians of {a.repeats}")
    print("| strategy | training state | " + " | ".join(KEYS) + " |")
    print("| --- | --- |" + " --- |" * len(KEYS))
    for (strategy, mode), rs in rows.items():
        cells = " | ".join(f"{statistics.median(r[k] for r in rs):.0f}" for k in KEYS)
        print(f"| {strategy} | {mode} | {cells} |")


if __name__ == "__main__":
    main()

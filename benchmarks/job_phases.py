"""Where a job of the chaos quick profile spends its time, phase by phase, per method.

``lowdiff chaos --quick`` measures whole jobs; this script splits one job of the same
training (``lowdiff_lab.chaos.settings.ChaosSettings(quick=True)``: ``gpt2-tiny``, 100 steps,
one torch thread) into the parts a checkpointing method adds: the ``Checkpointer``
constructor, ``resume()``, the steps (and of them the time inside ``ck.step()``) and
``close()``, first for a fresh job without failures, then for a job restarted after a
SIGKILL at step ``--kill-at`` (the new trainer's constructor, ``resume()`` with what it
restored, and ``close()``). The reference (``none``: the same training without
checkpoints; ``none-uncompressed`` for LowDiff+) gives the steps' baseline.

Each job is a new interpreter with the strategy modules imported before the clock starts
(as the chaos fork launcher's trainers have them), and the methods alternate, ``--repeats``
times; the table gives medians (ms).

Run: ``python benchmarks/job_phases.py [--methods lowdiff,lowdiff+,torch-save,gemini]
[--repeats 3] [--kill-at 37]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, signal, sys, time
import torch
import lowdiff.methods as lm
for name in lm.method_modules():
    __import__(name)
from lowdiff_lab.chaos.settings import ChaosSettings, method_config, parse_method
from lowdiff_lab.workloads import models, text
from lowdiff_lab.workloads import train as tr

method, directory, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = ChaosSettings(quick=True)
if method.startswith("none"):
    cfg = dict(s.base_config(), strategy="none")
    if method == "none-uncompressed":
        cfg["compressor"] = {"kind": "none"}
else:
    cfg = method_config(parse_method(method), s, "auto", interval=10)
cfg["directory"] = directory
c = tr.TrainConfig.from_dict(cfg)
tr._seed_globals(c)
corpus = text.load_corpus()
model, opt, sched = tr.build_training_objects(c)
out = {}
t0 = time.perf_counter()
ck = tr.build_checkpointer(c, model, opt, sched)
out["ctor"] = time.perf_counter() - t0
t0 = time.perf_counter()
start = ck.resume()
out["resume"] = time.perf_counter() - t0
rec = ck.recovery_stats
out["restore"] = rec.total_s if rec is not None else 0.0
inside, t0 = 0.0, time.perf_counter()
for step in range(start, c.steps):
    if step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    inputs, targets = text.batch_for(step, c.batch_size, c.seq_len, 0, corpus)
    loss = models.lm_loss(model, inputs, targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    t1 = time.perf_counter()
    ck.step()
    inside += time.perf_counter() - t1
    opt.zero_grad()
out["steps"] = time.perf_counter() - t0
out["in_step"] = inside
t0 = time.perf_counter()
ck.close()
out["close"] = time.perf_counter() - t0
print(json.dumps({"start": start, **{k: v * 1e3 for k, v in out.items()}}))
"""

FRESH = ("ctor", "resume", "steps", "in_step", "close")
RESTART = ("ctor", "resume", "restore", "close")


def job(method: str, directory: str, kill_at: int = -1) -> dict[str, float] | None:
    args = [sys.executable, "-c", CHILD, method, directory, str(kill_at)]
    if kill_at >= 0:  # the first trainer of a restart dies by SIGKILL
        subprocess.run(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
        return None
    out = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise SystemExit(f"{method} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="lowdiff,lowdiff+,torch-save,gemini")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kill-at", type=int, default=37)
    ap.add_argument("--json", action="store_true", help="print every job's phases as JSON")
    a = ap.parse_args()
    methods = a.methods.split(",")
    refs = ["none"] + (["none-uncompressed"] if "lowdiff+" in methods else [])
    fresh: dict[str, list[dict[str, float]]] = {}
    restarted: dict[str, list[dict[str, float]]] = {}
    for _ in range(a.repeats):
        for m in refs + methods:
            with tempfile.TemporaryDirectory() as d:
                r = job(m, d + "/ck")
                assert r is not None
                fresh.setdefault(m, []).append(r)
            if m in refs:
                continue
            with tempfile.TemporaryDirectory() as d:
                job(m, d + "/ck", a.kill_at)
                r = job(m, d + "/ck")
                assert r is not None
                restarted.setdefault(m, []).append(r)
            if not a.json:
                print(f"# {m}: fresh {fresh[m][-1]}; restarted {restarted[m][-1]}", flush=True)
    if a.json:
        print(json.dumps({"fresh": fresh, "restarted": restarted}))
        return

    def med(rows: list[dict[str, float]], k: str) -> str:
        return f"{statistics.median(r[k] for r in rows):.1f}"

    print(f"\nA fresh job of 100 steps, medians of {a.repeats} (ms)")
    print("| method | " + " | ".join(FRESH) + " |")
    print("| --- |" + " --- |" * len(FRESH))
    for m, rows in fresh.items():
        print(f"| {m} | " + " | ".join(med(rows, k) for k in FRESH) + " |")
    print(f"\nThe trainer restarted after a SIGKILL at step {a.kill_at} (ms)")
    print("| method | resumed at | " + " | ".join(RESTART) + " |")
    print("| --- | --- |" + " --- |" * len(RESTART))
    for m, rows in restarted.items():
        at = statistics.median(r["start"] for r in rows)
        print(f"| {m} | {at:.0f} | " + " | ".join(med(rows, k) for k in RESTART) + " |")


if __name__ == "__main__":
    main()

"""The remote tier (``remote=``): per-step overhead, upload throughput, recovery time.

Everything runs against an S3-compatible server on this machine (moto's server mode in a
subprocess on 127.0.0.1, as the tests use), in one run, so the ratios compare like with
like:

1. **Per-step overhead** on the 3.3M-parameter GPT-2 workload (``gpt2-3m``): the wall
   time per step of strategy ``"none"`` (the same compression, no checkpointing),
   ``"lowdiff"`` with the local tier alone, and ``"lowdiff"`` with ``remote=`` on the S3
   server. The arms run in interleaved rounds (none, local, remote, none, ...) and each
   figure is the median over rounds of the mean step time of the round's steps (after a
   warm-up), so drift of a shared machine falls on every arm alike. Overhead is
   ``step / none - 1``; the target is remote at most 1 percentage point above local.
   It also records how far the remote durable step trails the step after each step.
2. **Upload throughput** of a full checkpoint of that run: lowdiff's upload
   (:meth:`lowdiff.remote.RemoteStore.put`: the data object, its size check, the commit
   object) against a plain fsspec ``put_file`` of the same file to the same server,
   alternating, repeated; the ratio of the medians (target >= 0.8).
3. **Recovery**: ``lowdiff.restore`` from the local tier, against a new node (the local
   directory deleted): ``ck.resume()`` that downloads the newest committed full
   checkpoint and the records after it, then replays; both checked bit-identical
   (``torch.equal`` on every tensor of the state) to the live state at ``close()``.

Run: ``python benchmarks/remote_tier.py [--steps 60] [--rounds 3] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

import lowdiff
from lowdiff.remote import RemoteStore, fetch
from lowdiff.state.capture import diff_states, snapshot_state
from lowdiff_lab.workloads.zoo import build_workload

WORKLOAD = "gpt2-3m"


def start_moto() -> tuple[subprocess.Popen[str], str]:
    env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("moto server exited")
        if "Running on http://" in line:
            # keep reading its log: a full pipe would block the server's logging, and
            # with it every request (moto logs each one)
            threading.Thread(target=_discard, args=(proc.stdout,), daemon=True).start()
            return proc, line.split("Running on ", 1)[1].strip()


def _discard(stream: Any) -> None:
    for _line in stream:
        pass


def s3_options(endpoint: str) -> dict[str, Any]:
    return {
        "key": "testing",
        "secret": "testing",
        "endpoint_url": endpoint,
        "client_kwargs": {"region_name": "us-east-1"},
    }


def new_bucket(options: dict[str, Any]) -> str:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    name = f"bench{uuid.uuid4().hex[:10]}"
    fs.call_s3("create_bucket", Bucket=name)
    return name


def _objects(seed: int) -> tuple[Any, torch.optim.Optimizer]:
    w = build_workload(WORKLOAD, seed=seed)
    opt = torch.optim.AdamW(w.model.parameters(), lr=1e-3)
    return w, opt


def run_arm(
    arm: str, steps: int, warmup: int, work: Path, options: dict[str, Any]
) -> dict[str, Any]:
    """One round of one arm: mean seconds per step after ``warmup`` steps."""
    w, opt = _objects(0)
    kw: dict[str, Any] = {}
    directory: Path | None = work / f"{arm}-{uuid.uuid4().hex[:6]}"
    if arm == "none":
        kw["strategy"] = "none"
        directory = None
    if arm == "remote":
        kw.update(remote=f"s3://{new_bucket(options)}/run", remote_options=options)
    ck = lowdiff.Checkpointer(w.model, opt, directory, **kw)
    ck.resume()
    lag: list[int] = []
    times = []
    for t in range(steps):
        t0 = time.perf_counter()
        w.model.zero_grad(set_to_none=True)
        w.forward_backward(t)
        ck.step()
        times.append(time.perf_counter() - t0)
        if arm == "remote":
            lag.append(ck.step_count - ck.remote_durable_step)
    t_close = time.perf_counter()
    ck.close()
    close_s = time.perf_counter() - t_close
    out: dict[str, Any] = {
        "step_s": statistics.fmean(times[warmup:]),
        "close_s": close_s,
        "durable_step": ck.durable_step,
    }
    if arm == "remote":
        st = ck.stats
        out.update(
            remote_durable_step=ck.remote_durable_step,
            max_lag_steps=max(lag[warmup:]),
            median_lag_steps=statistics.median(lag[warmup:]),
            remote_files=st["remote_files"],
            remote_bytes=st["remote_bytes"],
            remote_errors=st["remote_errors"],
            url=kw["remote"],
            directory=str(directory),
            state=snapshot_state(w.model, opt),
        )
    elif arm == "local":
        out["directory"] = str(directory)
    return out


def upload_throughput(full: Path, options: dict[str, Any], repeats: int) -> dict[str, Any]:
    """lowdiff's committed upload against a plain fsspec put of the same file."""
    bucket = new_bucket(options)
    store = RemoteStore(f"s3://{bucket}/run", options)
    plain: list[float] = []
    ours: list[float] = []
    for i in range(repeats):
        # alternating which goes first, so neither always follows the other
        for which in ("plain", "ours") if i % 2 == 0 else ("ours", "plain"):
            t0 = time.perf_counter()
            if which == "plain":
                store.fs.put_file(str(full), f"{bucket}/plain/{i}.safetensors")
                plain.append(time.perf_counter() - t0)
            else:
                store.put(full, f"full/{full.name}")
                ours.append(time.perf_counter() - t0)
    n = full.stat().st_size
    p, o = statistics.median(plain), statistics.median(ours)
    return {
        "bytes": n,
        "plain_put_s": plain,
        "lowdiff_put_s": ours,
        "plain_MBps": n / p / 1e6,
        "lowdiff_MBps": n / o / 1e6,
        "ratio": p / o,
    }


def recovery(remote_run: dict[str, Any], options: dict[str, Any], work: Path) -> dict[str, Any]:
    """Local restore against a new node's resume from the remote tier."""
    want = remote_run["state"]
    w1, o1 = _objects(1)
    t0 = time.perf_counter()
    step_local = lowdiff.restore(remote_run["directory"], w1.model, o1)
    local_s = time.perf_counter() - t0
    local_diff = diff_states(want, snapshot_state(w1.model, o1))

    # a new node: download the newest chain into an empty directory, then restore
    fresh = work / "new-node"
    w2, o2 = _objects(2)
    t0 = time.perf_counter()
    got = fetch(remote_run["url"], fresh, options)
    fetch_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    step_remote = lowdiff.restore(fresh, w2.model, o2)
    restore_s = time.perf_counter() - t0
    remote_diff = diff_states(want, snapshot_state(w2.model, o2))

    # and as a trainer does it: Checkpointer(remote=...).resume() on an empty directory
    w3, o3 = _objects(3)
    t0 = time.perf_counter()
    ck = lowdiff.Checkpointer(
        w3.model, o3, work / "new-node-2", remote=remote_run["url"], remote_options=options
    )
    step_resume = ck.resume()
    resume_s = time.perf_counter() - t0
    resume_diff = diff_states(want, snapshot_state(w3.model, o3))
    ck.close()
    return {
        "local_step": step_local,
        "local_s": local_s,
        "local_bit_identical": not local_diff,
        "new_node_step": step_remote,
        "new_node_fetch_s": fetch_s,
        "new_node_restore_s": restore_s,
        "new_node_s": fetch_s + restore_s,
        "new_node_bit_identical": not remote_diff,
        "new_node_downloaded_bytes": got.nbytes,
        "new_node_downloaded_files": sorted(got.files),
        "resume_step": step_resume,
        "resume_s": resume_s,
        "resume_bit_identical": not resume_diff,
        "note": "resume_s: Checkpointer(remote=...).resume() on an empty directory, its "
        "checkpointing process's start included",
    }


def _revision() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5, help="upload throughput repeats")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    server, endpoint = start_moto()
    options = s3_options(endpoint)
    work = Path(tempfile.mkdtemp(prefix="lowdiff-remote-bench-"))
    try:
        rounds: dict[str, list[dict[str, Any]]] = {"none": [], "local": [], "remote": []}
        for _ in range(args.rounds):
            for arm in rounds:
                rounds[arm].append(run_arm(arm, args.steps, args.warmup, work, options))
        step = {a: statistics.median(r["step_s"] for r in runs) for a, runs in rounds.items()}
        last = rounds["remote"][-1]
        full = max(Path(rounds["local"][-1]["directory"]).glob("full/*.safetensors"))
        result = {
            "revision": _revision(),
            "machine": {
                "cpus": os.cpu_count(),
                "torch": torch.__version__,
                "python": platform.python_version(),
                "threads": torch.get_num_threads(),
            },
            "workload": WORKLOAD,
            "parameters": build_workload(WORKLOAD).n_params,
            "steps": args.steps,
            "rounds": args.rounds,
            "step_s": step,
            "overhead_pct": {a: 100 * (step[a] / step["none"] - 1) for a in ("local", "remote")},
            "remote_minus_local_pp": 100 * (step["remote"] - step["local"]) / step["none"],
            "close_s": {
                a: statistics.median(r["close_s"] for r in runs) for a, runs in rounds.items()
            },
            "remote_lag_steps": {
                "max": max(r["max_lag_steps"] for r in rounds["remote"]),
                "median": statistics.median(r["median_lag_steps"] for r in rounds["remote"]),
            },
            "remote_errors": sum(r["remote_errors"] for r in rounds["remote"]),
            "upload": upload_throughput(full, options, args.repeats),
            "recovery": recovery(last, options, work),
        }
    finally:
        server.kill()
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

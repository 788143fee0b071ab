"""LowDiff+'s peer copies measured: their cost per step, and recovery after a node loss
from peer memory, from disk and from the remote tier, side by side in one run.

A job is 2 gloo ranks, each its own "node" (``LOCAL_WORLD_SIZE=1``), started as two
fresh interpreters (as a launcher restarts them), training an MLP with AdamW through
LowDiff+ (:func:`rank_main`). :func:`run` drives the arms:

- steady state, interleaved ``repeats`` times: peer copies ``off`` and ``on`` under DDP
  and under ``fully_shard`` (and DDP without checkpointing, ``none``, for scale); per arm
  the median step time (the slower rank's per step, after ``warmup`` steps), the
  replica's CPU time per merged step and, under ``fully_shard``, the bytes each replica
  sends its holder per step (its snapshot slot: the gradient shard and per-rank state);
- one node lost after step ``crash_after``, three ways: ``peer memory`` (each node on its
  own directory, rank 1's node lost: processes, shared memory and directory),
  ``disk`` (peer copies off, one shared directory, rank 1's node lost but not the shared
  directory: the job reads the persisted replicas) and ``remote tier`` (each node on its
  own directory with a remote tier, both nodes' directories lost: the job downloads);
  per way the restarted job's ``resume()`` (the slower rank's), the step it resumed at,
  and the whole job's wall time against the uninterrupted job's.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

HIDDEN = 1024
LAYERS = 4
BATCH = 64
PERSIST_EVERY = 10


def _model() -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = [torch.nn.Linear(64, HIDDEN), torch.nn.GELU()]
    for _ in range(LAYERS - 1):
        layers += [torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU()]
    layers.append(torch.nn.Linear(HIDDEN, 1))
    return torch.nn.Sequential(*layers)


def rank_main(rank: int, spec_json: str) -> None:
    """One rank of a job (``spec``: the arm's settings, see :func:`_launch`)."""
    t_start = time.perf_counter()
    spec = json.loads(spec_json)
    import datetime

    import torch.distributed as dist

    import lowdiff

    os.environ.update(LOCAL_WORLD_SIZE="1", LOCAL_RANK="0", LOWDIFF_PEER_ADDR="127.0.0.1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{spec['store']}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    torch.manual_seed(0)
    if spec.get("fsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2,))
        net = _model()
        for layer in net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        model: torch.nn.Module = net
    else:
        model = torch.nn.parallel.DistributedDataParallel(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ck = None
    start = 0
    resume_s = 0.0
    info: dict[str, Any] = {}
    if spec["mode"] != "none":
        root = Path(spec["dir"]) if spec["shared"] else Path(spec["dir"], f"node-{rank}")
        remote = None
        if spec["remote"]:
            remote = lowdiff.RemoteOptions(f"file://{spec['remote']}")
        ck = lowdiff.Checkpointer(
            root, model, opt, method="lowdiff+", remote=remote,
            replica=lowdiff.ReplicaOptions(
                persist_every=PERSIST_EVERY, peer_copies=spec["mode"] == "on"
            ),
        )  # fmt: skip
        t0 = time.perf_counter()
        start = ck.resume()
        resume_s = time.perf_counter() - t0
        stats = ck.recovery_stats
        if stats is not None:
            info = {"source": stats.source, "shards": stats.shard_sources}
    times = []
    for step in range(start, spec["steps"]):
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(step * 10 + rank)
        x = torch.randn(BATCH, 64, generator=g)
        torch.nn.functional.mse_loss(model(x), x[:, :1]).backward()
        if ck is None:
            opt.step()
        else:
            ck.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        if step + 1 == spec["crash_after"]:
            assert ck is not None
            t0 = time.perf_counter()
            _settle(ck, step + 1, bool(spec["remote"]))
            # the wait is the benchmark's, not the job's: the driver takes it off
            Path(spec["out"], f"settle-rank{rank}.txt").write_text(str(time.perf_counter() - t0))
            os._exit(0)  # the job dies here; what dies with the node is the driver's
    out = {
        "rank": rank, "start": start, "times": times, "resume_s": resume_s,
        "wall_s": time.perf_counter() - t_start, **info,
    }  # fmt: skip
    if ck is not None:
        ck.flush()
        s = ck.stats
        out["merge_s"] = s["replica_merge_s"]
        out["merges"] = s["replica_merges"]
        impl: Any = ck.strategy_impl
        out["slot_bytes"] = impl.objects.snapshot_layout.row_bytes
        ck.close()
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(out))


def _settle(ck: Any, step: int, remote: bool) -> None:
    """Before the crash: the step acknowledged (and, with a remote tier, this rank's last
    persist uploaded: the job-wide figure is refreshed by steps, and none comes)."""
    deadline = time.monotonic() + 60
    impl = ck.strategy_impl
    while time.monotonic() < deadline:
        done = ck.acknowledged_step >= step
        if remote:
            impl.pipeline.poll()
            done = done and impl.progress.remote_durable >= step - step % PERSIST_EVERY
        if done:
            return
        time.sleep(0.01)
    raise RuntimeError(f"step {step} was not settled within 60 s")


def _launch(work: Path, name: str, spec: dict[str, Any]) -> tuple[float, list[dict[str, Any]]]:
    """Run both ranks of one job; (its wall time, each rank's report, [] after a crash)."""
    out = work / name
    out.mkdir(parents=True)
    spec = {**spec, "out": str(out), "store": str(work / f"store-{name}")}
    code = f"from lowdiff_lab.bench.peer_copies import rank_main; rank_main({{}}, {json.dumps(json.dumps(spec))})"
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen([sys.executable, "-c", code.replace("{}", str(r), 1)]) for r in (0, 1)
    ]
    codes = [p.wait(600) for p in procs]
    wall = time.perf_counter() - t0
    if codes != [0, 0]:
        raise RuntimeError(f"job {name} exited {codes}")
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    return wall, reports


def _lose(root: Path, rank: int, storage: bool) -> None:
    """Rank ``rank``'s node lost: its replica SIGKILLed, its shared memory gone (and with
    ``storage`` its directory)."""
    from lowdiff.proc import holder as rp

    shard = root / f"rank-{rank:05d}"
    d = rp.read_descriptor(shard)
    if d is not None and rp.pid_alive(d.pid):
        os.kill(d.pid, signal.SIGKILL)
        while rp.pid_alive(d.pid):
            time.sleep(0.01)
    if d is not None:
        for n in os.listdir("/dev/shm"):
            if n.startswith(f"lowdiff-{d.run_id[:16]}-"):
                rp.unlink_segment(n)
    if storage:
        shutil.rmtree(root, ignore_errors=True)


def _step_s(reports: list[dict[str, Any]], warmup: int) -> float:
    """Median over steps of the slower rank's step time."""
    per_step = [max(a, b) for a, b in zip(reports[0]["times"], reports[1]["times"], strict=True)]
    return statistics.median(per_step[warmup:])


def run(
    work: Path, *, steps: int = 40, warmup: int = 5, repeats: int = 3, crash_after: int = 25
) -> dict[str, Any]:
    """Every arm (see the module docstring); the figures."""
    work.mkdir(parents=True, exist_ok=True)
    arms = ("none", "off", "on", "fsdp off", "fsdp on")
    steady: dict[str, list[float]] = {a: [] for a in arms}
    merge: dict[str, list[float]] = {a: [] for a in arms if a != "none"}
    slot_bytes: dict[str, int] = {}
    walls: list[float] = []
    for i in range(repeats):
        for arm in arms if i % 2 == 0 else arms[::-1]:
            mode = arm.split()[-1]
            tag = f"steady-{arm.replace(' ', '-')}-{i}"
            spec = {"mode": mode, "steps": steps, "crash_after": 0, "dir": str(work / f"ck-{tag}"),
                    "shared": False, "remote": None, "fsdp": arm.startswith("fsdp")}  # fmt: skip
            wall, reports = _launch(work, tag, spec)
            steady[arm].append(_step_s(reports, warmup))
            if mode != "none":
                merge[arm].append(max(r["merge_s"] / max(r["merges"], 1) for r in reports))
                slot_bytes[arm] = max(r["slot_bytes"] for r in reports)
            if arm == "on":
                walls.append(wall)
    recovery: dict[str, dict[str, Any]] = {}
    ways = {
        "peer memory": ("on", False, False),
        "disk": ("off", True, False),
        "remote tier": ("on", False, True),
    }
    for way, (mode, shared, remote) in ways.items():
        tag = way.replace(" ", "-")
        ck = work / f"ck-{tag}"
        spec = {"mode": mode, "steps": steps, "crash_after": crash_after, "dir": str(ck),
                "shared": shared, "remote": str(work / f"remote-{tag}") if remote else None}  # fmt: skip
        t0 = time.perf_counter()
        _launch(work, f"{tag}-crash", spec)  # the ranks exit 0 at the crash, no report
        settle = max(float(p.read_text()) for p in (work / f"{tag}-crash").glob("settle-*.txt"))
        if remote:
            for r in (0, 1):
                _lose(ck / f"node-{r}", r, storage=True)
        elif shared:
            _lose(ck, 1, storage=False)
        else:
            _lose(ck / "node-1", 1, storage=True)
        wall, reports = _launch(work, f"{tag}-resumed", {**spec, "crash_after": 0})
        recovery[way] = {
            "resume_s": max(r["resume_s"] for r in reports),
            "resumed_at": reports[0]["start"],
            "source": reports[0].get("source"),
            "shards": reports[0].get("shards"),
            "job_s": time.perf_counter() - t0 - settle,
        }
    return {
        "steps": steps, "crash_after": crash_after, "repeats": repeats,
        "params": sum(p.numel() for p in _model().parameters()),
        "step_s": {m: statistics.median(v) for m, v in steady.items()},
        "merge_s": {m: statistics.median(v) for m, v in merge.items()},
        "slot_bytes": slot_bytes,
        "uninterrupted_job_s": statistics.median(walls),
        "recovery": recovery,
    }  # fmt: skip


def format_report(fig: dict[str, Any]) -> str:
    """The figures as two Markdown tables."""
    s, m = fig["step_s"], fig["merge_s"]
    lines = [
        f"MLP of {fig['params'] / 1e6:.1f}M parameters, AdamW, 2 ranks of one node each; "
        f"median of {fig['repeats']} runs of {fig['steps']} steps",
        "",
        "| | step | vs copies off | replica CPU per merged step | sent per step |",
        "|---|---:|---:|---:|---:|",
        f"| DDP, no checkpointing | {s['none'] * 1e3:.1f} ms | | | |",
    ]
    sent = {
        "on": "per-rank state",
        "fsdp on": f"{fig['slot_bytes']['fsdp on'] / 1e6:.1f} MB (its slot)",
    }
    for arm, name in (
        ("off", "DDP"),
        ("on", "DDP"),
        ("fsdp off", "fully_shard"),
        ("fsdp on", "fully_shard"),
    ):
        base = "off" if arm == "on" else "fsdp off" if arm == "fsdp on" else arm
        copies = "on" if arm.endswith("on") else "off"
        lines.append(
            f"| {name}, LowDiff+, peer copies {copies} | {s[arm] * 1e3:.1f} ms | "
            f"{s[arm] / s[base]:.2f}x | {m[arm] * 1e3:.1f} ms | {sent.get(arm, '')} |"
        )
    lines += [
        "",
        f"Node lost after step {fig['crash_after']}; uninterrupted job: "
        f"{fig['uninterrupted_job_s']:.1f} s",
        "",
        "| recovers from | resume() | resumed at | job with one loss | vs uninterrupted |",
        "|---|---:|---:|---:|---:|",
    ]
    for way, r in fig["recovery"].items():
        lines.append(
            f"| {way} | {r['resume_s']:.2f} s | step {r['resumed_at']} | {r['job_s']:.1f} s | "
            f"{r['job_s'] / fig['uninterrupted_job_s']:.2f}x |"
        )
    return "\n".join(lines)

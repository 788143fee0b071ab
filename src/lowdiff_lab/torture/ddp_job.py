"""A small DDP training job for the distributed tests and the DDP kill series (torchrun).

Every rank trains an MLP with BatchNorm and dropout under DDP on its own deterministic
data (seeded by rank and step), with AdamW, a scheduler and gradient clipping, through
``lowdiff.Checkpointer``. Options make it save the whole state after chosen steps, kill
itself with SIGKILL at a step (only on its first attempt; with ``--kill-worker`` its
checkpointing process first, as a machine failure would), log the job-wide durable step
after every step, and save its final state.

Run it with ``torchrun --nproc-per-node 2 -m lowdiff_lab.torture.ddp_job --dir D --out O``
(or through :func:`lowdiff_lab.torture.ddp.torchrun`; any ``--nproc-per-node`` works, and a
job resumes a directory written at another world size). With ``--single`` it is one
plain process (``python -m lowdiff_lab.torture.ddp_job --single ...``), written as rank 0. Files written under ``--out``:

- ``start-rank{r}-{pid}.txt``: ``"{step} {source}"``, where this attempt resumed;
- ``process-rank{r}-{pid}.txt``: ``"{process} {adopted}"``, the pid of this attempt's
  checkpointing process and of the one it took over from a crashed attempt (-1: none);
- ``raised``: ``"{step}"``, written just before ``--raise-at`` raises;
- ``timing-rank{r}-{pid}.txt``: ``"imports=S process_group=S ddp=S checkpointer=S
  resume=S"``, seconds from the process's start to the end of each phase;
- ``resumed-{step}-rank{r}.pt``, ``state-{step}-rank{r}.pt``, ``final-rank{r}.pt``: states;
- ``killed``: ``"{step} {point}"``, written just before the SIGKILL;
- ``flushed-rank{r}-{pid}.txt``, ``clipped-rank{r}-{pid}.txt``: what flush() returned,
  how many steps clipping changed; under LowDiff+ ``copies-rank{r}-{pid}.txt``: the
  gradient copies to host memory, the steps that carried a clip's factor, the
  parameters this rank snapshots, and the steps.

With ``--log-durable PREFIX`` each rank appends to ``PREFIX-rank{r}.txt``, with ``os.write``
on an ``O_APPEND`` descriptor (each line is in the file once the call returns, so it
survives a SIGKILL right after): ``"resume {step} {source} {restart}"`` after ``resume()``
(``restart`` is torchrun's restart count), then ``"{step} {durable_step}"`` after every
``ck.step()``, ``durable_step`` being the job-wide durable step the trainer was told.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lowdiff
from lowdiff.attach import own_strategy
from lowdiff.state.capture import snapshot_state
from lowdiff_lab import checkpointers

_MARKS: dict[str, float] = {"imports": time.time()}
"""When this attempt reached each phase of its start (``timing-rank{r}-{pid}.txt``)."""


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 32)
        )
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def build(
    strategy: str,
    directory: Path,
    ef: bool,
    full_every: int,
    batch_size: int,
    single: bool = False,
    **options: Any,
) -> tuple[nn.Module, torch.optim.Optimizer, Any, lowdiff.Checkpointer]:
    torch.manual_seed(0)
    net = Net()
    # several buckets even for this small model
    model: nn.Module = net if single else DDP(net, bucket_cap_mb=0.004)
    _MARKS["ddp"] = time.time()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    # per-rank RNG streams (dropout; Python and NumPy are checkpointed too)
    rank = 0 if single else dist.get_rank()
    torch.manual_seed(1000 + rank)
    random.seed(2000 + rank)
    np.random.seed(3000 + rank)
    kw: dict[str, Any] = {}
    if strategy == "lowdiff+":
        kw = {"compressor": None, "persist_every": 1, "keep_full": None}
    else:
        kw = {
            "compressor": lowdiff.TopK(0.1, error_feedback=ef),
            "full_every": full_every,
            "batch_size": batch_size,
            "keep_full": None,
        }
    if strategy == "none":
        options.pop("sigterm_timeout", None)
    kw.update(options)
    ck = checkpointers.build(directory, model, opt, strategy, scheduler=sched, **kw)
    _MARKS["checkpointer"] = time.time()
    return model, opt, sched, ck


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def train(args: argparse.Namespace) -> None:
    rank = 0 if args.single else dist.get_rank()
    out = Path(args.out)
    opts = {} if args.sigterm_timeout is None else {"sigterm_timeout": args.sigterm_timeout or None}
    model, opt, sched, ck = build(
        args.strategy, Path(args.dir), args.ef, args.full_every, args.batch_size, args.single,
        **opts,
    )  # fmt: skip
    start = ck.resume()
    _MARKS["resume"] = time.time()
    born = psutil.Process().create_time()
    (out / f"timing-rank{rank}-{os.getpid()}.txt").write_text(
        " ".join(f"{k}={v - born:.4f}" for k, v in _MARKS.items())
    )
    source = ck.recovery_stats.source if ck.recovery_stats is not None else "fresh"
    (out / f"start-rank{rank}-{os.getpid()}.txt").write_text(f"{start} {source}")
    proc = own_strategy(ck).worker_process
    node = os.environ.get("NODE_NAME")
    if node is not None and proc is not None:
        # a "node" of lowdiff_lab.torture.nodes: its checkpointing process dies with it
        with open(out / f"pids-{node}.txt", "a") as f:
            f.write(f"{proc.pid}\n")
    adopted = ck.recovery_stats.takeover_pid if ck.recovery_stats is not None else None
    (out / f"process-rank{rank}-{os.getpid()}.txt").write_text(
        f"{proc.pid if proc is not None else -1} {adopted or -1}"
    )
    torch.save(snapshot_state(model, opt, sched), out / f"resumed-{start}-rank{rank}.pt")
    log = _DurableLog(args.log_durable, rank) if args.log_durable else None
    if log is not None:
        log.write(f"resume {start} {source} {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    save = {int(s) for s in args.save_steps.split(",") if s}
    clipped = 0
    for step in range(start, args.steps):
        kill = step == args.kill_at and rank == args.kill_rank and not (out / "killed").exists()
        if kill and args.kill_point == "before-forward":
            _die(ck, out, step, args)
        if step == args.raise_at and rank == args.raise_rank and not (out / "raised").exists():
            (out / "raised").write_text(str(step))
            raise RuntimeError(f"rank {rank} fails at step {step} (--raise-at)")
        x, y = batch(rank, step)
        nn.functional.cross_entropy(model(x), y).backward()
        if kill and args.kill_point == "after-backward":
            # the gradients are merged (every rank's hook ran), ck.step() has not run
            _die(ck, out, step, args)
        if args.check_merge:
            check_merge(ck, model)
        if args.clip_via == "lowdiff":
            norm = ck.clip_grad_norm_(args.clip)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        clipped += int(norm > args.clip)
        ck.step()
        if log is not None:
            log.write(f"{step + 1} {ck.durable_step}")
        opt.zero_grad()
        if args.step_sleep:
            time.sleep(args.step_sleep)  # stands in for a longer step
        if step + 1 in save:
            torch.save(snapshot_state(model, opt, sched), out / f"state-{step + 1}-rank{rank}.pt")
    (out / f"flushed-rank{rank}-{os.getpid()}.txt").write_text(str(ck.flush()))
    stats = ck.stats
    if "gradient_copies" in stats:  # LowDiff+: the gradients' copies to host memory
        snap = ck.strategy_impl.snapshotter  # type: ignore[attr-defined]
        (out / f"copies-rank{rank}-{os.getpid()}.txt").write_text(
            f"{int(stats['gradient_copies'])} {int(stats['clip_scaled_steps'])} "
            f"{len(snap.params)} {args.steps - start}"
        )
    ck.close()
    # steps whose gradient norm exceeded --clip (so clipping changed the gradient)
    (out / f"clipped-rank{rank}-{os.getpid()}.txt").write_text(f"{clipped} {args.steps - start}")
    torch.save(snapshot_state(model, opt, sched), out / f"final-rank{rank}.pt")
    if log is not None:
        log.close()


class _DurableLog:
    """Lines appended with one ``os.write`` each: a SIGKILL cannot lose a returned write."""

    def __init__(self, prefix: str, rank: int) -> None:
        self._fd = os.open(
            f"{prefix}-rank{rank}.txt", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644
        )

    def write(self, line: str) -> None:
        os.write(self._fd, (line + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


def _die(ck: lowdiff.Checkpointer, out: Path, step: int, args: argparse.Namespace) -> None:
    """SIGKILL this trainer (first its checkpointing process with ``--kill-worker``)."""
    what = args.kill_point
    if args.kill_worker:
        proc = own_strategy(ck).worker_process
        if proc is not None and proc.pid is not None:
            # a machine failure: the trainer and its checkpointing process die together
            # (the worker first, so it cannot drain anything the trainer handed it)
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
            what += " worker"
    (out / "killed").write_text(f"{step} {what}")
    os.kill(os.getpid(), signal.SIGKILL)


def check_merge(ck: lowdiff.Checkpointer, model: nn.Module) -> None:
    """The hook's merged record, decompressed, is exactly the gradient DDP left in .grad."""
    impl = own_strategy(ck)
    hs = impl.ddp_hook_state
    assert hs is not None
    merged = impl.compressor
    for info, p in impl.params:
        payload = hs.payloads[info.index]
        dense = merged.decompress(payload, p.numel(), p.dtype)
        assert p.grad is not None
        if not torch.equal(dense, p.grad.reshape(-1)):
            raise AssertionError(f"record of {info.name} differs from its .grad")
    # and every rank holds the same merged gradient
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    if not all(torch.equal(g, gathered[0]) for g in gathered):
        raise AssertionError("the ranks applied different gradients")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--strategy", default="lowdiff")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds slept after each step")
    ap.add_argument("--full-every", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--ef", action="store_true")
    ap.add_argument("--save-steps", default="")
    ap.add_argument("--kill-at", type=int, default=-1)
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument(
        "--kill-point", choices=("before-forward", "after-backward"), default="before-forward"
    )
    ap.add_argument(
        "--raise-at",
        type=int,
        default=-1,
        help="raise an exception in --raise-rank before this step (once in the job)",
    )
    ap.add_argument("--raise-rank", type=int, default=-1)
    ap.add_argument(
        "--sigterm-timeout",
        type=float,
        default=None,
        help="the Checkpointer's sigterm_timeout (0: None, lowdiff leaves SIGTERM alone)",
    )
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument(
        "--clip-via",
        choices=("torch", "lowdiff"),
        default="torch",
        help="clip with torch.nn.utils.clip_grad_norm_ or with ck.clip_grad_norm_",
    )
    ap.add_argument("--check-merge", action="store_true")
    ap.add_argument(
        "--kill-worker",
        action="store_true",
        help="at the kill, SIGKILL the rank's checkpointing process first (machine failure)",
    )
    ap.add_argument(
        "--log-durable",
        default="",
        metavar="PATH-PREFIX",
        help="append 'step durable_step' lines to PATH-PREFIX-rank{r}.txt after every step",
    )
    ap.add_argument(
        "--single",
        action="store_true",
        help="one process without a process group or DDP (a single-process run, as rank 0)",
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    torch.set_num_threads(1)
    args = parse(argv)
    if args.single:
        train(args)
        return
    dist.init_process_group("gloo")
    _MARKS["process_group"] = time.time()
    try:
        train(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

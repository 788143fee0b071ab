"""FSDP2 (``fully_shard``) workload: LowDiff+ every step against DCP ``async_save`` every
step and at its Young–Daly interval.

Run under torchrun (gloo on CPU)::

    torchrun --nproc-per-node 2 -m lowdiff_lab.bench.fsdp2 --dir runs/bench-fsdp2

In one job, on the same model and batches, one arm after the other (each from the same
initial state):

- ``none``: training alone;
- ``lowdiff+``: ``lowdiff.Checkpointer(method="lowdiff+")``, every step in the replica;
  timed until ``close()`` returned, when the final state is persisted on every rank;
- ``dcp-async``: every step, ``get_state_dict`` and ``dcp.async_save`` of the sharded
  state (the collective save every rank joins), DCP's process saver (the thread saver
  where it cannot start) with ``DefaultStager`` staging into shared memory (pinned as
  well where CUDA is), at most one save in flight (the next save waits for the previous
  one: the stager's buffers are reused); timed until the last save's future completed;
- ``dcp-young-daly``: the same saves every ``k`` steps and after the last step (so the
  run's end is durable), timed until that save completed. ``k = max(1, round(sqrt(2 C M)
  / t))`` (:func:`lowdiff_lab.chaos.settings.young_daly_interval`) with ``C`` the save's cost
  measured in this run (``dcp-async``'s time per step until durable minus ``none``'s),
  ``t`` the time of a step (``none``'s) and ``M`` the mean time between failures
  (``--mtbf``, default 6 hours: lowdiff's own default MTBF, that of the ``"auto"``
  planner). With ``k`` at least the number of steps, the final save is the only one.

Each arm's time is the slowest rank's. Rank 0 prints a table and, with ``--out``, writes
it as JSON. Timings are this machine's, with every process sharing its cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import lowdiff
from lowdiff.plan import DEFAULT_MTBF_S
from lowdiff_lab.chaos.settings import young_daly_interval

ARMS = ("none", "lowdiff+", "dcp-async", "dcp-young-daly")


def _model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(64, width), nn.GELU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.GELU()]
    layers.append(nn.Linear(width, 8))
    return nn.Sequential(*layers)


def _sharded(width: int, depth: int, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _model(width, depth)
    for layer in model.children():
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train_step(model: nn.Module, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(100_003 * step + rank)
    x = torch.randn(64, 64, generator=g)
    loss = nn.functional.mse_loss(model(x), (x[:, :8] * x[:, 8:16]).sin())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


class _DCPSaves:
    """DCP ``async_save`` of the sharded state, at most one in flight (module docstring)."""

    def __init__(self, root: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.root, self.model, self.opt = root, model, opt
        cuda = torch.cuda.is_available()
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=True,
                use_async_staging=False,
                use_non_blocking_copy=cuda,
            )
        )
        self.kind = AsyncCheckpointerType.PROCESS
        self.pending: tuple[Path, Any] | None = None
        self.done: list[Path] = []
        self.count = 0

    def _wait(self) -> None:
        if self.pending is not None:
            path, fut = self.pending
            fut.result()
            for old in self.done:  # keep the newest save only: the disk is not the point
                shutil.rmtree(old, ignore_errors=True)
            self.done = [path]
            self.pending = None

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self._wait()
        self.count += 1
        msd, osd = get_state_dict(self.model, self.opt)
        path = self.root / f"step-{step:06d}"
        try:
            fut = dcp.async_save(
                {"model": msd, "optimizer": osd},
                checkpoint_id=str(path),
                async_checkpointer_type=self.kind,
                async_stager=self.stager,
            )
        except Exception:
            if self.kind != AsyncCheckpointerType.PROCESS:
                raise
            # this torch cannot start the process saver here: the thread saver
            self.kind = AsyncCheckpointerType.THREAD
            fut = dcp.async_save(
                {"model": msd, "optimizer": osd},
                checkpoint_id=str(path),
                async_checkpointer_type=self.kind,
                async_stager=self.stager,
            )
        if not hasattr(fut, "result"):  # an AsyncSaveResponse
            fut = fut.upload_completion
        self.pending = (path, fut)

    def finish(self) -> None:
        self._wait()
        self.stager.close()


def _run_arm(
    arm: str, args: argparse.Namespace, mesh: Any, rank: int, every: int = 1
) -> tuple[float, dict[str, Any]]:
    """Seconds this rank took for the arm's steps until durable, and what ran (a DCP arm
    saves after every ``every``-th timed step and after the last one)."""
    model = _sharded(args.width, args.depth, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    root = Path(args.dir) / arm
    info: dict[str, Any] = {}
    after: Callable[[int], None] = lambda step: None  # noqa: E731
    finish: Callable[[], None] = lambda: None  # noqa: E731
    ck: Any = None
    if arm == "lowdiff+":
        ck = lowdiff.Checkpointer(root, model, opt, method="lowdiff+", full_every=args.persist)
        ck.resume()
        finish = ck.close
    elif arm.startswith("dcp-"):
        root.mkdir(parents=True, exist_ok=True)
        saver = _DCPSaves(root, model, opt)
        last = args.warmup + args.steps - 1

        def after(step: int) -> None:
            if step < args.warmup or (step + 1 - args.warmup) % every == 0 or step == last:
                saver.save(step)

        finish = saver.finish
    for step in range(args.warmup):  # not timed: allocations, the first saves
        _train_step(model, rank, step)
        ck.step() if ck is not None else opt.step()
        after(step)
        opt.zero_grad()
    dist.barrier()
    t0 = time.perf_counter()
    for step in range(args.warmup, args.warmup + args.steps):
        _train_step(model, rank, step)
        ck.step() if ck is not None else opt.step()
        after(step)
        opt.zero_grad()
    t_steps = time.perf_counter() - t0
    finish()
    elapsed = time.perf_counter() - t0
    if arm.startswith("dcp-"):
        info["saver"] = saver.kind.value
        info["saves"] = saver.count - args.warmup  # the timed ones
    info["steps_s"] = t_steps
    return elapsed, info


def main(argv: list[str] | None = None) -> int:
    """Run the four arms in this torchrun job; rank 0 prints (and writes) the table."""
    from torch.distributed.device_mesh import init_device_mesh

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True, help="scratch directory (shared by the ranks)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per arm")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--persist", type=int, default=10, help="LowDiff+ persists every this many")
    ap.add_argument(
        "--mtbf",
        type=float,
        default=DEFAULT_MTBF_S,
        help=f"mean time between failures in seconds, for DCP's Young–Daly interval "
        f"(default {DEFAULT_MTBF_S:.0f})",
    )
    ap.add_argument("--out", help="write the table as JSON here (rank 0)")
    args = ap.parse_args(argv)
    if not (args.mtbf > 0 and args.mtbf < float("inf")):
        ap.error(f"--mtbf must be positive seconds, got {args.mtbf!r}")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    rows: list[dict[str, Any]] = []
    yd: dict[str, Any] = {}
    # an untimed pass first: the first arm would otherwise run on a cold process (its
    # allocator still growing), slower than the same steps in a later arm
    _run_arm("none", args, mesh, rank)
    for arm in ARMS:
        if arm == "dcp-young-daly":  # from the slowest rank's times: the same on every rank
            yd = _young_daly(rows, args)
        elapsed, info = _run_arm(arm, args, mesh, rank, yd.get("interval", 1))
        t = torch.tensor([elapsed, info["steps_s"]], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        rows.append({"arm": arm, "until_durable_s": float(t[0]), "steps_s": float(t[1]), **info})
        if arm.startswith("dcp-"):
            rows[-1]["interval"] = yd.get("interval", 1)
        if yd:
            rows[-1]["mtbf_s"] = args.mtbf
    if rank == 0:
        _report(rows, yd, args, world)
    dist.destroy_process_group()
    return 0


def _young_daly(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """DCP's Young–Daly interval from this run's ``none`` and ``dcp-async`` arms."""
    by = {r["arm"]: r["until_durable_s"] / args.steps for r in rows}
    step_s = by["none"]
    cost = max(0.0, by["dcp-async"] - step_s)  # what one save adds to a step
    k = young_daly_interval(cost, args.mtbf, step_s)
    return {"interval": k, "save_cost_s": cost, "step_s": step_s, "mtbf_s": args.mtbf}


def _report(
    rows: list[dict[str, Any]], yd: dict[str, Any], args: argparse.Namespace, world: int
) -> None:
    """Rank 0: print the table (and write it as JSON with ``--out``)."""
    base = rows[0]["until_durable_s"]
    params = sum(p.numel() for p in _model(args.width, args.depth).parameters())
    print(
        f"FSDP2, {world} gloo ranks, {params:,} parameters, AdamW, {args.steps} steps "
        f"(after {args.warmup} warm-up), torch {torch.__version__}"
    )
    print(f"{'arm':<15} {'s/step until durable':>21} {'vs none':>8} {'DCP saves':>12}")
    for r in rows:
        r["per_step_s"] = r["until_durable_s"] / args.steps
        r["vs_none"] = r["until_durable_s"] / base
        saves = f"{r['saves']} (k={r['interval']})" if "saves" in r else ""
        print(f"{r['arm']:<15} {r['per_step_s']:>21.4f} {r['vs_none']:>7.2f}x {saves:>12}")
    by = {r["arm"]: r["until_durable_s"] for r in rows}
    print(
        f"DCP's Young–Daly interval: k = {yd['interval']} steps (save cost "
        f"{yd['save_cost_s']:.4f} s, step {yd['step_s']:.4f} s, MTBF {args.mtbf:.0f} s)"
    )
    print(
        f"lowdiff+ / dcp-async every step: {by['lowdiff+'] / by['dcp-async']:.2f}; lowdiff+ / "
        f"dcp-young-daly: {by['lowdiff+'] / by['dcp-young-daly']:.2f} (dcp saver: "
        f"{rows[2]['saver']})"
    )
    if args.out:
        doc = {
            "world_size": world,
            "parameters": params,
            "steps": args.steps,
            "young_daly": yd,
            "rows": rows,
        }
        Path(args.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())

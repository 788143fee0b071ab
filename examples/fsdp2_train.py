"""FSDP2 (``fully_shard``) training with LowDiff+ checkpoints every step, under torchrun.

    torchrun --nproc-per-node 2 examples/fsdp2_train.py --dir runs/fsdp2

Kill one rank and let torchrun restart the job (the rank kills itself on the first
attempt only; every rank restarts from its replica in memory, at one step):

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 1 \\
        --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29500 \\
        examples/fsdp2_train.py --dir runs/fsdp2-kill --kill-rank 1 --kill-at 120

Run it again with another ``--nproc-per-node`` and the job resumes at the new world size.
Gloo on CPU (LowDiff+ under fully_shard runs on CPU so far). Needs PyTorch 2.6 or newer.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import lowdiff


def build_model(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(64, width), nn.GELU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    layers.append(nn.Linear(width, 8))
    return nn.Sequential(*layers)


def batch_for(rank: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100_003 * step + rank)
    x = torch.randn(64, 64, generator=g)
    return x.to(device), (x[:, :8] * x[:, 8:16]).sin().to(device)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dir", required=True, help="checkpoint directory (shared by all ranks)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--full-every", type=int, default=50, help="persist the replicas every f steps")
    ap.add_argument("--kill-rank", type=int, default=-1, help="this rank SIGKILLs itself ...")
    ap.add_argument(
        "--kill-at", type=int, default=-1, help="... at this step, on the first attempt"
    )
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))
    torch.manual_seed(0)  # the same initial model on every rank
    model = build_model(args.width, args.depth).to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    # no compressor: LowDiff+, the one method for sharded training
    ck = lowdiff.Checkpointer(
        args.dir, model, optimizer, scheduler=scheduler, full_every=args.full_every
    )
    start = ck.resume()
    if ck.recovery_stats is not None and rank == 0:
        rs = ck.recovery_stats
        print(
            f"[rank 0] resumed {world} ranks at step {start} from {rs.source} in {rs.total_s:.3f} s",
            flush=True,
        )
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    t0 = time.perf_counter()
    for step in range(start, args.steps):
        if first_attempt and rank == args.kill_rank and step == args.kill_at:
            # one write ("\n" in the line, end=""): rank 0 may be printing to the same pipe
            print(f"[rank {rank}] SIGKILL at step {step}\n", end="", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch_for(rank, step, device)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the norm spans the ranks
        ck.step()
        optimizer.zero_grad()
        if rank == 0 and (step + 1) % 50 == 0:
            print(
                f"[rank 0] step {step + 1}  loss {loss.item():.4f}  durable {ck.durable_step}\n",
                end="",
                flush=True,
            )
    train_s = time.perf_counter() - t0
    ck.close()  # persists every rank's replica at the last step
    if rank == 0:
        print(
            f"[rank 0] {args.steps - start} steps in {train_s:.1f} s; durable {ck.durable_step}",
            flush=True,
        )
        print(f"done: {args.steps} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

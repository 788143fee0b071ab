"""Data-parallel training with per-iteration checkpointing, launched by torchrun.

    torchrun --nproc-per-node 2 examples/ddp_train.py --dir runs/ddp
    torchrun --nproc-per-node 2 examples/ddp_train.py --dir runs/ddp-plus --method lowdiff+

Kill one rank and let torchrun restart the job (the rank kills itself on the first
attempt only; the restarted job resumes from the step all ranks agree on):

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 1 \\
        --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29500 \\
        examples/ddp_train.py --dir runs/ddp-kill --kill-rank 1 --kill-at 120

(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` keeps a restarted round from reading the
previous round's addresses from torchrun's shared store, which can make the restart
hang or fail to connect.) Gloo on CPU, NCCL when CUDA is available. Each rank trains on
its own deterministic batches (seeded by rank and step), so a resumed run sees exactly
the batches it would have seen.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

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
    ap.add_argument(
        "--dir", required=True, help="checkpoint directory (shared, or local to each node)"
    )
    ap.add_argument(
        "--method",
        "--strategy",
        default="lowdiff",
        choices=["lowdiff", "lowdiff+", "compression-only"],
    )
    ap.add_argument("--ratio", type=float, default=0.01, help="TopK ratio (lowdiff)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--full-every", type=int, default=50)
    ap.add_argument("--records-per-file", "--batch-size", type=int, default=5)
    ap.add_argument("--kill-rank", type=int, default=-1, help="this rank SIGKILLs itself ...")
    ap.add_argument(
        "--kill-at", type=int, default=-1, help="... at this step, on the first attempt"
    )
    ap.add_argument("--report", help="write each rank's checkpointing figures to this JSON file")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # the same initial model on every rank
    model = DDP(build_model(args.width, args.depth).to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    compressed = args.method != "lowdiff+"  # LowDiff+ trains without compression
    ck = lowdiff.Checkpointer(
        args.dir,
        model,
        optimizer,
        method=args.method,
        compressor=lowdiff.TopK(ratio=args.ratio) if compressed else None,
        scheduler=scheduler,
        full_every=args.full_every,
        records_per_file=args.records_per_file,
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
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        ck.step()
        optimizer.zero_grad()
        if rank == 0 and (step + 1) % 50 == 0:
            print(
                f"[rank 0] step {step + 1}  loss {loss.item():.4f}  durable {ck.durable_step}\n",
                end="",
                flush=True,
            )
    train_s = time.perf_counter() - t0
    ck.close()
    stats = ck.stats
    mine = {
        "rank": rank,
        "world_size": world,
        "method": args.method,
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps": args.steps - start,
        "train_s": train_s,
        "record_bytes_per_step": stats["record_bytes"] / max(1, stats["records_written"]),
        "record_write_s_per_step": stats["record_write_s"] / max(1, stats["records_written"]),
        "full_bytes": stats["full_bytes"] / max(1, stats["fulls_written"]),
        "full_write_s": stats["full_write_s"] / max(1, stats["fulls_written"]),
    }
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        for r in gathered:
            print(
                f"[rank {r['rank']}] records {r['record_bytes_per_step'] / 1024:.1f} KiB/step "
                f"({r['record_write_s_per_step'] * 1e3:.2f} ms/step to write); full checkpoint shards "
                f"{r['full_bytes'] / 2**20:.2f} MiB in {r['full_write_s'] * 1e3:.1f} ms on average "
                "(step 0's holds no optimizer state yet; `lowdiff inspect` gives the later ones)",
                flush=True,
            )
        if args.report:
            with open(args.report, "w") as f:
                json.dump(gathered, f, indent=1)
        print(f"done: {args.steps} steps; see `lowdiff inspect {args.dir}`", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

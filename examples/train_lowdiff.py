"""A minimal training script with per-iteration checkpointing.

Run it, kill it at any moment (Ctrl-C, ``kill -9``), run it again: it resumes from the
newest recoverable step.

    python examples/train_lowdiff.py --dir runs/example                     # LowDiff (TopK 1 %)
    python examples/train_lowdiff.py --dir runs/example-plus --method lowdiff+
    lowdiff inspect runs/example
"""

from __future__ import annotations

import argparse

import torch

import lowdiff


def batch_for(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    # deterministic data per step: a resumed run sees exactly the batches it would have
    g = torch.Generator().manual_seed(step)
    x = torch.randn(64, 32, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", required=True, help="checkpoint directory")
    parser.add_argument(
        "--method",
        "--strategy",
        default="lowdiff",
        choices=["lowdiff", "lowdiff+"],
    )
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    # with a compressor the method is LowDiff, without one LowDiff+
    compressor = lowdiff.TopK(ratio=0.01) if args.method == "lowdiff" else None

    with lowdiff.Checkpointer(
        args.dir,
        model,
        optimizer,
        compressor=compressor,
        scheduler=scheduler,
        full_every=30,
        records_per_file=3,
    ) as ck:
        start = ck.resume()
        if ck.recovery_stats is not None:
            rs = ck.recovery_stats
            print(f"resumed at step {start} from {rs.source} in {rs.total_s:.3f} s")
        for step in range(start, args.steps):
            x, y = batch_for(step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            ck.step()
            optimizer.zero_grad()
            if (step + 1) % 50 == 0:
                print(
                    f"step {step + 1}  loss {loss.item():.4f}  durable up to step {ck.durable_step}"
                )
    print(f"done: {args.steps} steps; see `lowdiff inspect {args.dir}`")


if __name__ == "__main__":
    main()

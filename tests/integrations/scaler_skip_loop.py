"""The README's attach loop with a GradScaler that skips updates (overflows on some
batches): ``python scaler_skip_loop.py DIR TOTAL_UPDATES KILL_AT_ITERATION OUT.json``
(KILL_AT_ITERATION -1: never). SIGKILLs itself at that iteration; at the end writes the
final state and counters to OUT.json."""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler

import lowdiff


def main() -> None:
    directory, total, kill_at, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    ds = torch.utils.data.TensorDataset(x, x[:, :1].cos())
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=total)
    # a huge loss on some batches overflows the scaled gradients: the update is skipped
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    order, workers = (torch.Generator().manual_seed(seed) for seed in (7, 8))
    loader = StatefulDataLoader(
        ds, 8, sampler=RandomSampler(ds, generator=order), generator=workers
    )
    ck = lowdiff.attach(directory, model, optimizer, scheduler=scheduler, compressor=lowdiff.TopK(0.2, error_feedback=False), full_every=4, records_per_file=2, extra_state={"data": loader, "scaler": scaler})  # fmt: skip
    resumed = ck.resume()
    iterations = skipped = 0
    while ck.step_count < total:
        for xb, yb in loader:
            iterations += 1
            if iterations == kill_at:
                print(json.dumps({"skipped": skipped}), flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            boost = 1e38 if xb[0, 0].item() > 1.0 else 1.0
            scaler.scale(torch.nn.functional.mse_loss(model(xb), yb) * boost).backward()
            before = ck.step_count
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad()
            skipped += ck.step_count == before
            if ck.step_count == total:
                break
    ck.close()
    state = {k: v.tolist() for k, v in model.state_dict().items()}
    doc = {"resumed": resumed, "skipped": skipped, "state": state,
           "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
           "loader": loader.state_dict()["_num_yielded"]}  # fmt: skip
    with open(out, "w") as f:
        json.dump(doc, f, default=str)


if __name__ == "__main__":
    main()

"""Your own training loop, unchanged, checkpointed at every step by ``lowdiff.attach``.

The loop calls ``optimizer.step()`` and ``scheduler.step()`` itself; lowdiff runs inside
``optimizer.step()``. The data comes from torchdata's ``StatefulDataLoader``, passed as
``extra_state``: its position (and its shuffling generator) is saved with every step, so
after a crash the next batch is exactly the one an uninterrupted run would have seen.

    python examples/attach_loop.py --dir runs/loop          # kill it at any moment (kill -9) ...
    python examples/attach_loop.py --dir runs/loop          # ... and run it again: it resumes

Needs torchdata (``pip install -e ".[data]"``).
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler

import lowdiff


def make_data(n: int = 200) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 16, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", required=True, help="checkpoint directory")
    parser.add_argument("--steps", type=int, default=120, help="optimizer updates in all")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds per step (to kill it)")
    parser.add_argument("--dump", help="write the final state here (safetensors; for the tests)")
    args = parser.parse_args(argv)

    random.seed(0)  # lowdiff saves and restores every RNG: torch, Python, NumPy
    np.random.seed(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    # Shuffle through the stateful RandomSampler, with its own generator, and give the loader
    # a generator too (for its per-epoch base seed): the global RNG, which dropout uses,
    # is then untouched by data loading, and the order of every later epoch is the same
    # after a resume. (shuffle=True, generator=g resumes the current epoch exactly but
    # reshuffles later epochs differently: a behaviour of StatefulDataLoader.)
    data = make_data()
    loader = StatefulDataLoader(
        data,
        batch_size=16,
        sampler=RandomSampler(data, generator=torch.Generator().manual_seed(7)),
        generator=torch.Generator().manual_seed(8),
    )

    # error_feedback=False: training after a resume is then bit-identical to a run that
    # never crashed (with error feedback the residual restarts at zero after a resume)
    ck = lowdiff.attach(
        args.dir,
        model,
        optimizer,
        compressor=lowdiff.TopK(ratio=0.05, error_feedback=False),
        scheduler=scheduler,
        full_every=20,
        records_per_file=4,
        extra_state={"data": loader},
    )
    step = ck.resume()  # restores model, optimizer, scheduler, RNG and the loader's position
    print(f"resumed {step}", flush=True)
    # the bound is the count of optimizer updates (ck.step_count, what resume() returns),
    # not of loop iterations: a GradScaler that skips an update (no optimizer.step()) would
    # make a restarted loop's iteration count differ from an uninterrupted one's
    while ck.step_count < args.steps:
        for x, y in loader:  # a resumed loader goes on with the next batch of its epoch
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()  # lowdiff checkpoints this update
            scheduler.step()
            optimizer.zero_grad()
            step = ck.step_count
            print(f"step {step} {loss.item().hex()} {x.sum().item().hex()}", flush=True)
            if args.sleep:
                time.sleep(args.sleep)
            if step == args.steps:
                break
    ck.close()
    print(f"stats {ck.stats['records_written']} records", flush=True)
    if args.dump:
        import safetensors.torch

        from lowdiff.state.capture import state_tensors

        state = state_tensors(model, optimizer, scheduler)
        state["data.position"] = torch.tensor(loader.state_dict()["_num_yielded"])
        safetensors.torch.save_file(state, args.dump)
    print("done", flush=True)


if __name__ == "__main__":
    main()

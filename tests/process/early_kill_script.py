"""A trainer that SIGKILLs itself right after its first steps in a new directory, before
its checkpointing process could have done anything with them (``tests/process/
test_early_kill.py``): ``python early_kill_script.py DIR STRATEGY N_STEPS KILL``."""

from __future__ import annotations

import os
import random
import signal
import sys

import numpy as np
import torch

import lowdiff


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and optimizer, every RNG seeded (the recovered RNG states are compared too)."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, ck: lowdiff.Checkpointer, t: int) -> None:
    g = torch.Generator().manual_seed(t)
    model(torch.randn(4, 8, generator=g)).square().sum().backward()
    ck.step()
    ck.optimizer.zero_grad()


def checkpointer(d: str, strategy: str) -> lowdiff.Checkpointer:
    model, opt = build()
    # records wait for a batch of 100 (LowDiff), the replica persists only its first
    # state (LowDiff+): the steps taken are not durable when the trainer is killed
    kw: dict = (
        {"compressor": lowdiff.TopK(0.5, error_feedback=False), "batch_size": 100}
        if strategy == "lowdiff"
        else {"persist_every": 1000}
    )
    return lowdiff.Checkpointer(model, opt, d, strategy=strategy, idle_timeout=30, **kw)


def main() -> None:
    d, strategy, n, kill = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "kill"
    ck = checkpointer(d, strategy)
    start = ck.resume()
    for t in range(start, start + n):
        train_step(ck.model, ck, t)
    print(f"acknowledged {ck.step_count} durable {ck.durable_step}", flush=True)
    if kill:
        os.kill(os.getpid(), signal.SIGKILL)
    ck.close()


if __name__ == "__main__":
    main()

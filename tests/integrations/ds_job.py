"""lowdiff.attach under a DeepSpeed engine (ZeRO stage 0, CPU): run as a script by
test_deepspeed.py, in its own process (DeepSpeed initialises a process group).

Usage: python ds_job.py DIR PORT
"""

from __future__ import annotations

import os
import sys

import torch

import lowdiff
from lowdiff.state.capture import diff_states, state_tensors


def build():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    s = torch.optim.lr_scheduler.StepLR(o, 2, 0.7)
    return m, o, s


def main(directory: str, port: str) -> None:
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port
    )
    import deepspeed
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1)
    m, o, s = build()
    engine, opt, _, sched = deepspeed.initialize(
        model=m,
        optimizer=o,
        lr_scheduler=s,
        config={"train_batch_size": 4, "zero_optimization": {"stage": 0}},
    )
    assert opt is o and sched is s, (type(opt), type(sched))
    ck = lowdiff.attach(
        directory,
        engine.module,
        o,
        scheduler=s,
        compressor=lowdiff.TopK(0.25, error_feedback=False),
        full_every=4,
        records_per_file=2,
    )
    assert ck.resume() == 0
    g = torch.Generator().manual_seed(5)
    for _ in range(7):
        x = torch.randn(4, 6, generator=g)
        engine.backward(torch.nn.functional.mse_loss(engine(x), x[:, :2].sin()))
        engine.step()  # the optimizer's step() and the scheduler's, inside DeepSpeed
    assert ck.step_count == 7, ck.step_count
    ck.close()
    live = state_tensors(m, o, s)
    m2, o2, s2 = build()
    assert lowdiff.restore(directory, m2, o2, s2) == 7
    diff = [k for k in diff_states(live, state_tensors(m2, o2, s2)) if not k.startswith("rng")]
    assert diff == [], diff
    print("ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

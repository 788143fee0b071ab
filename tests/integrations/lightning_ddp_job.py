"""A Lightning DDP job checkpointed by LowDiff+ for the tests, run under torchrun:
``torchrun --nproc-per-node 2 lightning_ddp_job.py --dir D --out O [--fail-rank R --fail-at S]``.

Every rank trains a small regressor with dropout (AdamW, a cosine schedule stepped every
step) on CPU with gloo, from a ``StatefulDataLoader`` that Lightning gives a
``DistributedSampler``, checkpointed by ``LowDiffCallback`` without a compressor
(LowDiff+: each rank's replica process holds its shard in memory). With ``--fail-rank``
and ``--fail-at``, that rank fails on torchrun's first attempt inside update S's forward
pass, by SIGKILL (``--fail kill``) or by raising an exception (``--fail raise``): its
state is at step S - 1, which every rank handed to its replica when update S began
(lowdiff hands a step over when the next ``optimizer.step`` begins), and the other rank
goes on until the collective of update S's backward pass fails.

Files written under ``--out``:

- ``start-rank{r}-attempt{n}.txt``: ``"{step} {source}"``, where attempt ``n`` (torchrun's
  restart count) resumed: ``memory``, ``disk`` or ``fresh``;
- ``failed``: ``"{step} {how}"``, written just before the rank fails (``step``: the step
  its state is at; ``how``: ``kill`` or ``raise``);
- ``final-rank{r}.pt``: the final state (model, AdamW state, scheduler, RNG, global step,
  epoch, data position).
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from lowdiff.integrations._common import unwrap_optimizer
from lowdiff.integrations.lightning import LowDiffCallback
from lowdiff.state.capture import snapshot_state


class Regressor(pl.LightningModule):
    def __init__(self, total_steps: int, fail: tuple[int, int, str], out: Path) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
        )
        self.total_steps, self.fail, self.out = total_steps, fail, out

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        # Lightning runs this in the closure it passes to optimizer.step(): update
        # global_step + 1 has begun, and lowdiff handed global_step over
        rank, update, how = self.fail
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and (rank, update) == (self.global_rank, self.trainer.global_step + 1):
            (self.out / "failed").write_text(f"{self.trainer.global_step} {how}")
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"rank {rank} fails in update {update} (--fail raise)")
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.total_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Starts(pl.Callback):
    """Writes where each rank's attempt resumed."""

    def __init__(self, lowdiff_cb: LowDiffCallback, out: Path) -> None:
        self.lowdiff_cb, self.out = lowdiff_cb, out

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ck = self.lowdiff_cb.ck
        assert ck is not None
        stats = ck.recovery_stats
        source = "fresh" if stats is None else stats.source
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        name = f"start-rank{trainer.global_rank}-attempt{attempt}.txt"
        (self.out / name).write_text(f"{self.lowdiff_cb.resumed_step} {source}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--fail-rank", type=int, default=-1)
    ap.add_argument("--fail-at", type=int, default=-1, help="the update whose forward pass fails")
    ap.add_argument("--fail", choices=("kill", "raise"), default="kill")
    args = ap.parse_args()
    out = Path(args.out)
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(128, 16, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    # torch's RandomSampler: Lightning puts a DistributedSampler in its place, whose order
    # follows from its seed and the epoch (4 batches per rank and epoch)
    loader = StatefulDataLoader(
        data, batch_size=16, sampler=torch.utils.data.RandomSampler(data),
        generator=torch.Generator().manual_seed(8),
    )  # fmt: skip
    # full_every beyond the run: a restart that read the disk would find only step 0 and
    # what the replicas persisted when they were let go
    cb = LowDiffCallback(args.dir, full_every=50, log_stats=False)
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        callbacks=[cb, Starts(cb, out)],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    module = Regressor(args.steps, (args.fail_rank, args.fail_at, args.fail), out)
    trainer.fit(module, train_dataloaders=loader)
    assert cb.ck is not None and cb.ck.method == "lowdiff+", cb.ck
    sched = trainer.lr_scheduler_configs[0].scheduler
    state = snapshot_state(module, unwrap_optimizer(trainer.optimizers[0]), sched)
    state["trainer.global_step"] = torch.tensor(trainer.global_step)
    state["trainer.epoch"] = torch.tensor(trainer.current_epoch)
    state["data.position"] = torch.tensor(loader.state_dict()["_num_yielded"])
    torch.save(state, out / f"final-rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()

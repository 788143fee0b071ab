"""Lightning with lowdiff: every optimizer step is checkpointed, and a restart resumes.

One line differs from a plain Lightning script: the callback. The train loader is
torchdata's ``StatefulDataLoader``, so a resumed run goes on with the next batch.

    python examples/lightning_train.py --dir runs/pl        # kill it at any moment (kill -9) ...
    python examples/lightning_train.py --dir runs/pl        # ... and run it again: it resumes

    python examples/lightning_train.py --dir runs/pl-ddp --devices 2   # DDP, 2 CPU ranks

    # 3 epochs (max_epochs) with a validation loop and ReduceLROnPlateau on its loss
    python examples/lightning_train.py --dir runs/pl-plateau --epochs 3 --plateau

    # FSDP2 (Lightning's ModelParallelStrategy, fully_shard in configure_model), LowDiff+,
    # 2 CPU ranks under torchrun; rank 1 SIGKILLs itself after step 9, torchrun restarts
    # (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the restarted round must not read the
    # previous round's addresses from a rendezvous store shared with the workers)
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 1 \
        examples/lightning_train.py --dir runs/pl-fsdp2 --devices 2 --fsdp2 \
        --kill-rank 1 --kill-after 9

Needs lightning and torchdata (``pip install -e ".[lightning]"``).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import time
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler

import lowdiff
from lowdiff.integrations.lightning import LowDiffCallback


class Regressor(pl.LightningModule):
    def __init__(self, total_steps: int, fsdp2: bool = False) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1)
        )
        self.total_steps = total_steps
        self.fsdp2 = fsdp2

    def configure_model(self) -> None:
        # ModelParallelStrategy calls this once its device mesh is set up
        if not self.fsdp2:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.total_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class PlateauRegressor(Regressor):
    """The same model, validated at each epoch's end, with ``ReduceLROnPlateau`` on the
    validation loss (Lightning steps it after the validation)."""

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
        config = {"scheduler": plateau, "interval": "epoch", "monitor": "val_loss"}
        return {"optimizer": opt, "lr_scheduler": config}


class Progress(pl.Callback):
    """Prints one line per step on rank 0 (the tests compare them with an uninterrupted
    run); with ``exit_after``, every rank exits at once after that step is durable; with
    ``kill``, rank ``kill[0]`` SIGKILLs itself after step ``kill[1]`` on torchrun's first
    attempt, printing the step lowdiff had made durable by then."""

    def __init__(
        self,
        lowdiff_cb: LowDiffCallback,
        sleep: float,
        exit_after: int = 0,
        kill: tuple[int, int] = (-1, 0),
    ) -> None:
        self.lowdiff_cb, self.sleep = lowdiff_cb, sleep
        self.exit_after, self.kill = exit_after, kill

    def on_train_start(self, trainer, pl_module):
        if trainer.global_rank == 0:
            stats = self.lowdiff_cb.ck.recovery_stats if self.lowdiff_cb.ck else None
            source = "" if stats is None else f" from {stats.source}"
            print(f"resumed {self.lowdiff_cb.resumed_step}{source}", flush=True)

    def on_validation_epoch_end(self, trainer, pl_module):
        if trainer.global_rank == 0 and not trainer.sanity_checking:
            loss = trainer.callback_metrics["val_loss"].item()
            print(f"eval {trainer.global_step} {loss.hex()}\n", end="", flush=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        x, _ = batch
        loss = outputs["loss"].item()
        if trainer.global_rank == 0:
            # a line in one write ("\n" in it, end=""): the ranks share stdout, and print()
            # writes a line's text and its end apart when the stream is unbuffered
            print(
                f"step {trainer.global_step} {loss.hex()} {x.sum().item().hex()} "
                f"{trainer.current_epoch}\n",
                end="",
                flush=True,
            )
        if self.sleep:
            time.sleep(self.sleep)
        ck = self.lowdiff_cb.ck
        assert ck is not None
        if self.exit_after and trainer.global_step >= self.exit_after:
            # a crash that loses nothing, on every rank at the same step (under DDP a
            # SIGKILL of one process would leave the others waiting in a collective)
            ck.flush()
            os._exit(0)
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and self.kill == (trainer.global_rank, trainer.global_step):
            # torchrun sees the rank fail, stops the other one and restarts the job
            print(f"kill rank {trainer.global_rank} after step {trainer.global_step} "
                  f"durable {ck.durable_step}\n", end="", flush=True)  # fmt: skip
            os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", required=True, help="lowdiff checkpoint directory")
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps (max_steps)")
    parser.add_argument(
        "--epochs", type=int, default=0, help="train for this many epochs (max_epochs) instead"
    )
    parser.add_argument(
        "--plateau",
        action="store_true",
        help="a validation loop, and ReduceLROnPlateau on its loss instead of the cosine schedule",
    )
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds per step (to kill it)")
    parser.add_argument("--dump", help="write the final state here (safetensors; for the tests)")
    parser.add_argument("--devices", type=int, default=1, help="CPU ranks (more than 1: DDP)")
    parser.add_argument(
        "--exit-after", type=int, default=0, help="exit on every rank once this step is durable"
    )
    parser.add_argument(
        "--fsdp2",
        action="store_true",
        help="ModelParallelStrategy: fully_shard (FSDP2) over the ranks, checkpointed by LowDiff+",
    )
    parser.add_argument("--kill-rank", type=int, default=-1, help="this rank SIGKILLs itself ...")
    parser.add_argument(
        "--kill-after", type=int, default=0, help="... after this step, on torchrun's first attempt"
    )
    args = parser.parse_args(argv)

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(200, 16, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    # One process: torchdata's RandomSampler with its own generator, so data loading
    # leaves the global RNG (dropout) alone and the order of every epoch survives a
    # resume. DDP: torch's RandomSampler, which Lightning replaces with a DistributedSampler
    # whose order is fixed by its seed and the epoch (a torchdata sampler would be wrapped
    # instead, and the wrapper's order depends on how often it was iterated).
    sampler = (
        torch.utils.data.RandomSampler(data)
        if args.devices > 1
        else RandomSampler(data, generator=torch.Generator().manual_seed(7))
    )
    loader = StatefulDataLoader(
        data, batch_size=16, sampler=sampler, generator=torch.Generator().manual_seed(8)
    )

    val = None
    if args.plateau:
        xv = torch.randn(48, 16, generator=g)
        val = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(xv, xv.sum(dim=1, keepdim=True).sin()), batch_size=16
        )

    trainer, cb = _trainer(args)
    total = args.epochs * len(loader) if args.epochs else args.steps
    module = (PlateauRegressor if args.plateau else Regressor)(total, args.fsdp2)
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=val)

    assert cb.ck is not None
    if args.dump and (args.fsdp2 or trainer.global_rank == 0):
        _dump(args.dump, trainer, module, loader, sharded=args.fsdp2)
    if trainer.global_rank == 0:
        print(f"stats {cb.ck.stats['records_written']:.0f} records", flush=True)
        print("done", flush=True)


def _trainer(args: argparse.Namespace) -> tuple[pl.Trainer, LowDiffCallback]:
    """The Trainer and its lowdiff callback: DDP or one process, or FSDP2 with LowDiff+."""
    if args.fsdp2:
        from lightning.pytorch.strategies import ModelParallelStrategy

        # LowDiff+: each rank's replica process holds its shard and persists it every
        # full_every steps (and at close)
        cb = LowDiffCallback(args.dir, full_every=4)  # no compressor: LowDiff+
        strategy: Any = ModelParallelStrategy(
            data_parallel_size=args.devices, tensor_parallel_size=1
        )
    else:
        # error_feedback=False: training after a resume is then bit-identical to a run that
        # never stopped (with error feedback the residual restarts at zero after a resume)
        cb = LowDiffCallback(
            args.dir,
            compressor=lowdiff.TopK(ratio=0.05, error_feedback=False),
            full_every=20,
            records_per_file=4,
        )
        strategy = "ddp" if args.devices > 1 else "auto"
    trainer = pl.Trainer(
        max_steps=-1 if args.epochs else args.steps,
        max_epochs=args.epochs or None,
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        callbacks=[
            cb,
            Progress(cb, args.sleep, args.exit_after, (args.kill_rank, args.kill_after)),
        ],
        enable_checkpointing=False,  # lowdiff checkpoints every step
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return trainer, cb


def _dump(
    path: str, trainer: pl.Trainer, module: Regressor, loader: StatefulDataLoader, sharded: bool
) -> None:
    """The final state as safetensors; under FSDP2 every rank writes its own shard (and RNG)
    to ``<path>.rank<r>``."""
    import safetensors.torch

    from lowdiff.integrations._common import unwrap_optimizer
    from lowdiff.state.capture import state_tensors

    sched = trainer.lr_scheduler_configs[0].scheduler
    state = state_tensors(module, unwrap_optimizer(trainer.optimizers[0]), sched)
    state["trainer.global_step"] = torch.tensor(trainer.global_step)
    state["trainer.epoch"] = torch.tensor(trainer.current_epoch)
    state["data.position"] = torch.tensor(loader.state_dict()["_num_yielded"])
    safetensors.torch.save_file(state, f"{path}.rank{trainer.global_rank}" if sharded else path)


if __name__ == "__main__":
    main()

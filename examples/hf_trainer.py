"""Hugging Face ``Trainer`` with lowdiff: every optimizer step is checkpointed.

Two lines differ from a plain Trainer script: the callback, and ``resume_from_checkpoint``.

    python examples/hf_trainer.py --dir runs/hf        # kill it at any moment (kill -9) ...
    python examples/hf_trainer.py --dir runs/hf        # ... and run it again: it resumes

A tiny GPT-2 (built from a config, nothing is downloaded) learns a synthetic sequence task
on the CPU.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import lowdiff
from lowdiff.integrations.hf import LowDiffCallback


class Sequences(torch.utils.data.Dataset):
    def __init__(self, n: int = 100, length: int = 16, vocab: int = 64, seed: int = 99) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        step = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + step * torch.arange(length)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Progress(TrainerCallback):
    """Prints one line per step (the tests compare them with an uninterrupted run)."""

    def __init__(self, lowdiff_cb: LowDiffCallback, sleep: float) -> None:
        self.lowdiff_cb, self.sleep = lowdiff_cb, sleep

    def on_train_begin(self, args, state, control, **kwargs):
        assert self.lowdiff_cb.ck is not None
        print(f"resumed {self.lowdiff_cb.ck.step_count}", flush=True)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        total = sum(p.detach().double().sum() for p in model.parameters())
        print(
            f"step {state.global_step} {float(total).hex()} {state.epoch!r} {state.best_metric!r}",
            flush=True,
        )
        if self.sleep:
            time.sleep(self.sleep)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        print(f"eval {state.global_step} {float(metrics['eval_loss']).hex()}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", required=True, help="lowdiff checkpoint directory")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (max_steps)")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds per step (to kill it)")
    parser.add_argument("--dump", help="write the final state here (safetensors; for the tests)")
    parser.add_argument(
        "--save-steps",
        type=int,
        default=0,
        help="also let the Trainer save its own checkpoints every N steps (default: none)",
    )
    parser.add_argument(
        "--eval-strategy",
        choices=("no", "steps", "epoch"),
        default="no",
        help="also evaluate (TrainingArguments.eval_strategy; the best eval loss is tracked)",
    )
    parser.add_argument("--eval-steps", type=int, default=5, help="with --eval-strategy steps")
    parser.add_argument(
        "--method",
        "--strategy",
        choices=("lowdiff", "lowdiff+"),
        default="lowdiff",
        help="lowdiff: compressed gradients as records; lowdiff+: no compression, a CPU replica",
    )
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=64,
            n_positions=16,
            n_embd=32,
            n_layer=2,
            n_head=2,
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    training_args = TrainingArguments(
        output_dir=str(Path(args.dir).with_name(Path(args.dir).name + "-out")),
        max_steps=args.steps,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=3,
        logging_steps=5,
        # the Trainer's own checkpoints are not needed (lowdiff's are per step) but may be kept
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        eval_strategy=args.eval_strategy,
        eval_steps=args.eval_steps,
        metric_for_best_model="eval_loss" if args.eval_strategy != "no" else None,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )

    if args.method == "lowdiff+":
        cb = LowDiffCallback(args.dir)  # no compressor: LowDiff+
    else:
        # error_feedback=False: training after a resume is then bit-identical to a run that
        # never stopped (with error feedback the residual restarts at zero after a resume)
        cb = LowDiffCallback(
            args.dir,
            compressor=lowdiff.TopK(ratio=0.05, error_feedback=False),
            full_every=10,
            records_per_file=3,
        )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=Sequences(),
        eval_dataset=Sequences(24, seed=5) if args.eval_strategy != "no" else None,
        callbacks=[cb, Progress(cb, args.sleep)],
    )
    trainer.train(resume_from_checkpoint=cb.resume_from_checkpoint)

    assert cb.ck is not None
    print(f"stats {cb.ck.stats['records_written']:.0f} records", flush=True)
    if args.dump:
        import safetensors.torch

        from lowdiff.integrations._common import unwrap_optimizer
        from lowdiff.state.capture import state_tensors

        state = state_tensors(
            trainer.model, unwrap_optimizer(trainer.optimizer), trainer.lr_scheduler
        )
        state["trainer.global_step"] = torch.tensor(trainer.state.global_step)
        state["trainer.epoch"] = torch.tensor(trainer.state.epoch, dtype=torch.float64)
        safetensors.torch.save_file(state, args.dump)
    print("done", flush=True)


if __name__ == "__main__":
    main()

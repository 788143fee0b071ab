"""The README's GPU table in one command: lowdiff against the same training without it.

    python benchmarks/gpu_reference.py                 # the README's model on cuda:0
    python benchmarks/gpu_reference.py --tiny --device cpu --repeats 1   # a smoke run

Model: a causal transformer LM built from a ``transformers`` GPT-2 config (8 layers,
width 1024, 16 heads, vocabulary 16,384, 256 positions: 117.8M parameters), bf16
autocast, AdamW, gradient clipping, batches of 16 sequences of 255 tokens drawn from a
seeded generator (nothing is downloaded). Arms, each on its own copy of the model:

- ``plain``: no compression, no checkpointing;
- ``topk``: ``TopK(0.01)`` compression, no checkpointing (strategy ``"none"``);
- ``lowdiff``: the same compression, LowDiff at every step (``--full-every``,
  ``--batch-size``);
- ``lowdiff+``: no compression, LowDiff+ (skipped with ``--no-plus``).

Every repeat runs every arm once, in an order that rotates between repeats, after one
untimed warm-up block per arm. A block is ``--steps`` steps and ends with ``ck.flush()``:
its time counts everything until the block's checkpoints are durable. Reported: the
median time per step of each arm over the repeats, each repeat's figure, and the ratios
of ``lowdiff`` to ``topk`` and of ``lowdiff+`` to ``plain`` (compare ratios, measured
side by side, not absolute times across machines).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import lowdiff


def build_model(tiny: bool, device: torch.device, seed: int = 0) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    if tiny:
        cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=32)
    else:
        cfg = GPT2Config(n_layer=8, n_embd=1024, n_head=16, vocab_size=16384, n_positions=256)
    cfg.bos_token_id = cfg.eos_token_id = 0  # inside the vocabulary
    cfg.attn_implementation = "eager" if device.type == "cpu" else "sdpa"
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg).to(device)


class Arm:
    """One configuration under test: its own model, optimizer and Checkpointer."""

    def __init__(self, name: str, args: argparse.Namespace, workdir: Path) -> None:
        self.name = name
        self.device = torch.device(args.device)
        self.model = build_model(args.tiny, self.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.01)
        seq = 31 if args.tiny else 255
        self.batch = (2 if args.tiny else 16, seq)
        self.vocab = self.model.config.vocab_size
        self.gen = torch.Generator(device="cpu").manual_seed(1234)
        self.amp = torch.bfloat16
        topk = lowdiff.TopK(args.ratio)
        kw: dict[str, Any]
        if name == "plain":
            kw = {"strategy": "none", "compressor": lowdiff.NoCompression()}
        elif name == "topk":
            kw = {"strategy": "none", "compressor": topk}
        elif name == "lowdiff":
            kw = {
                "strategy": "lowdiff",
                "compressor": topk,
                "full_every": args.full_every,
                "batch_size": args.batch_size,
            }
        else:
            kw = {"strategy": "lowdiff+", "compressor": None}
        self.ck = lowdiff.Checkpointer(self.model, self.opt, workdir / name, **kw)
        self.ck.resume()

    def step(self) -> None:
        ids = torch.randint(0, self.vocab, self.batch, generator=self.gen).to(self.device)
        with torch.autocast(self.device.type, dtype=self.amp):
            loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.ck.step()
        self.opt.zero_grad(set_to_none=True)

    def block(self, steps: int) -> float:
        """Seconds per step of ``steps`` steps, until their checkpoints are durable."""
        sync(self.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        self.ck.flush()
        sync(self.device)
        return (time.perf_counter() - t0) / steps


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def git_revision() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(args: argparse.Namespace) -> dict[str, Any]:
    names = ["plain", "topk", "lowdiff"] + ([] if args.no_plus else ["lowdiff+"])
    with tempfile.TemporaryDirectory(prefix="lowdiff-gpu-ref-", dir=args.workdir) as d:
        arms = [Arm(n, args, Path(d)) for n in names]
        try:
            for arm in arms:
                arm.block(args.warmup)
            times: dict[str, list[float]] = {n: [] for n in names}
            for r in range(args.repeats):
                order = arms[r % len(arms) :] + arms[: r % len(arms)]
                for arm in order:
                    times[arm.name].append(arm.block(args.steps))
                    print(
                        f"repeat {r + 1}: {arm.name:9s} {times[arm.name][-1] * 1e3:.2f} ms/step",
                        flush=True,
                    )
            record = arms[names.index("lowdiff")].ck.stats
        finally:
            for arm in arms:
                arm.ck.close()
    med = {n: statistics.median(v) for n, v in times.items()}
    params = sum(p.numel() for p in arms[0].model.parameters())
    out: dict[str, Any] = {
        "machine": platform.node(),
        "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "git": git_revision(),
        "parameters": params,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "ms_per_step": {n: v * 1e3 for n, v in med.items()},
        "per_repeat_ms": {n: [x * 1e3 for x in v] for n, v in times.items()},
        "lowdiff_vs_topk": med["lowdiff"] / med["topk"] - 1,
        "record_bytes_per_step": record["record_row_bytes"],
    }
    if "lowdiff+" in med:
        out["lowdiff_plus_vs_plain"] = med["lowdiff+"] / med["plain"] - 1
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a small model (a smoke run)")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per block")
    ap.add_argument("--warmup", type=int, default=8, help="untimed steps per arm first")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ratio", type=float, default=0.01, help="TopK ratio")
    ap.add_argument("--full-every", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=5)
    ap.add_argument("--no-plus", action="store_true", help="leave LowDiff+ out")
    ap.add_argument("--workdir", default=None, help="where the checkpoints go (a temp dir)")
    ap.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = ap.parse_args(argv)
    res = run(args)
    print(
        f"\n{res['device']}, torch {res['torch']}, git {res['git']}, {res['parameters'] / 1e6:.1f}M parameters"
    )
    for n, v in res["ms_per_step"].items():
        reps = ", ".join(f"{x:.2f}" for x in res["per_repeat_ms"][n])
        print(f"{n:9s} {v:8.2f} ms per step (median; per repeat {reps})")
    print(f"LowDiff against the same compressed training: {res['lowdiff_vs_topk']:+.1%}")
    if "lowdiff_plus_vs_plain" in res:
        print(
            f"LowDiff+ against the same uncompressed training: {res['lowdiff_plus_vs_plain']:+.1%}"
        )
    print(f"record: {res['record_bytes_per_step'] / 1e6:.2f} MB per step")
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
